"""Pallas kernel for segmented ragged paged attention (§0x04, §0x09).

The kernel, then its ``pallas_call`` wrapper; the jitted public entry point
and the plain reference live in ``attention/ragged.py``.

The wrapper receives the packed rows already laid out as query slots
(``ragged.query_slots``): slot ``b`` holds up to ``block_q`` consecutive rows
of one sequence. The grid is ``(num_slots, n_kv_heads)``; program ``(b, h)``
keeps the slot's rows times the query heads of KV head ``h`` as one
``[block_q * G, head_dim]`` tile and walks key blocks ``j = 0, 1, ...`` of
its sequence (block ``j`` = key positions ``[j * block_kv, (j + 1) *
block_kv)``, gathered page by page through the page table) with a float32
online softmax, stopping after the block that holds its last row. Empty
slots and padding rows read nothing but their slot metadata.

Mosaic GPU: for jax 0.10.2 the Pallas guide documents Mosaic GPU
(``jax.experimental.pallas.mosaic_gpu``) as its GPU backend; this kernel
uses the Triton lowering, which still works there. A port needs: the
vector-indexed page gather (``k_ref[pages]``) replaced by per-page async
copies from GMEM into double-buffered SMEM with barriers (the structure of
the TPU kernel, ``attention/pallas_tpu.py``); query tiles of a warpgroup's
64 rows (``block_q * group`` padded to 64) so scores and P@V run as WGMMA;
bf16 operands for WGMMA (float32 K/V cast on load); the SMEM refs given
the swizzle/tiling transforms WGMMA expects; the float32 online-softmax
state kept in the accumulator's register layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from attention import online_softmax

# float32 tiles multiply in full float32 (Triton's default would be TF32).
_EXACT = jax.lax.Precision.HIGHEST


def _ragged_kernel(
    # Inputs.
    seq_ref,        # i32[num_slots]        sequence of each slot
    start_ref,      # i32[num_slots]        position of the slot's first row
    valid_ref,      # i32[num_slots]        valid rows in the slot
    kv_lens_ref,    # i32[S]
    table_ref,      # i32[S, padded_pages_per_seq]
    q_ref,          # [block_q * G, head_dim]              (slot b, head h)
    k_ref,          # [num_pages, page_size, head_dim]     (head h)
    v_ref,          # [num_pages, page_size, head_dim]     (head h)
    # Output.
    o_ref,          # [block_q * G, head_dim]
    *,
    group: int,
    block_kv: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
):
  b = pl.program_id(0)
  tile_rows, head_dim = q_ref.shape
  page_size = k_ref.shape[1]
  pages_per_block = block_kv // page_size
  seq = seq_ref[b]
  start = start_ref[b]
  num_valid = valid_ref[b]
  kv_len = kv_lens_ref[seq]

  row = jax.lax.broadcasted_iota(jnp.int32, (tile_rows, block_kv), 0) // group
  row_pos = start + row
  row_ok = row < num_valid
  key_iota = jax.lax.broadcasted_iota(jnp.int32, (tile_rows, block_kv), 1)
  key_col = jax.lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)
  q = q_ref[...]

  def body(j, carry):
    pages = table_ref[seq, pl.ds(j * pages_per_block, pages_per_block)]
    key_ok = j * block_kv + key_col < kv_len
    k = k_ref[pages].reshape(block_kv, head_dim)
    v = v_ref[pages].reshape(block_kv, head_dim)
    k = jnp.where(key_ok, k, jnp.zeros_like(k))      # page tails may hold NaN
    v = jnp.where(key_ok, v.astype(jnp.float32), 0.0)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            precision=_EXACT,
                            preferred_element_type=jnp.float32) * sm_scale
    s, visible = online_softmax.visible_scores(
        s, row_ok, row_pos, j * block_kv + key_iota, soft_cap=soft_cap,
        sliding_window=sliding_window)
    return online_softmax.block_update(carry, s, visible, v)

  last = start + num_valid - 1
  num_blocks = jnp.where(num_valid > 0, last // block_kv + 1, 0)
  init = online_softmax.init(tile_rows, head_dim)
  _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
  o_ref[...] = online_softmax.finish(l, acc).astype(o_ref.dtype)


def ragged_attention_slots(q, k_pages, v_pages, kv_lens, page_table, slots, *,
                           block_q: int, block_kv: int, sm_scale: float,
                           soft_cap: float | None,
                           sliding_window: int | None, interpret: bool):
  """Runs ``_ragged_kernel`` over query slots and scatters rows back.

  Args:
    q: f32/bf16[T, n_q_heads, head_dim].
    k_pages, v_pages: [num_pages, page_size, n_kv_heads, head_dim].
    kv_lens: i32[S]. page_table: i32[S, pages_per_seq].
    slots: ``ragged.query_slots(...)`` for ``block_q``: ``(rows
      i32[NS, block_q], start_pos i32[NS], num_valid i32[NS], seq i32[NS])``.
    block_q, block_kv: static tile sizes; ``block_kv % page_size == 0``.
    sm_scale, soft_cap, sliding_window: as ``ragged_paged_attention``.
    interpret: static; run the kernel in the Pallas interpreter (CPU).

  Returns:
    [T, n_q_heads, head_dim] in ``q.dtype``; rows in no slot are zeros.
  """
  rows, start_pos, num_valid, seq = slots
  num_rows, num_q_heads, head_dim = q.shape
  num_pages, page_size, num_kv_heads, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  group_p = 1 << (group - 1).bit_length()    # power of two for GPU tiles
  num_slots = rows.shape[0]
  pages_per_block = block_kv // page_size
  pages_per_seq = page_table.shape[1]
  padded_pages = -(-pages_per_seq // pages_per_block) * pages_per_block
  table = jnp.pad(page_table.astype(jnp.int32),
                  ((0, 0), (0, padded_pages - pages_per_seq)), mode="edge")
  table = jnp.clip(table, 0, num_pages - 1)

  qs = jnp.take(q, rows, axis=0, mode="fill", fill_value=0)    # [NS,bq,Hq,D]
  qs = qs.reshape(num_slots, block_q, num_kv_heads, group, head_dim)
  qs = jnp.pad(qs, ((0, 0),) * 3 + ((0, group_p - group), (0, 0)))
  qs = jnp.transpose(qs, (0, 2, 1, 3, 4)).reshape(
      num_slots, num_kv_heads, block_q * group_p, head_dim)
  tile = block_q * group_p

  kernel = functools.partial(
      _ragged_kernel, group=group_p, block_kv=block_kv, sm_scale=sm_scale,
      soft_cap=soft_cap, sliding_window=sliding_window)
  out = pl.pallas_call(
      kernel,
      grid=(num_slots, num_kv_heads),
      in_specs=[
          pl.BlockSpec((num_slots,), lambda b, h: (0,)),
          pl.BlockSpec((num_slots,), lambda b, h: (0,)),
          pl.BlockSpec((num_slots,), lambda b, h: (0,)),
          pl.BlockSpec(kv_lens.shape, lambda b, h: (0,)),
          pl.BlockSpec(table.shape, lambda b, h: (0, 0)),
          pl.BlockSpec((None, None, tile, head_dim), lambda b, h: (b, h, 0, 0)),
          pl.BlockSpec((num_pages, page_size, None, head_dim),
                       lambda b, h: (0, 0, h, 0)),
          pl.BlockSpec((num_pages, page_size, None, head_dim),
                       lambda b, h: (0, 0, h, 0)),
      ],
      out_specs=pl.BlockSpec((None, None, tile, head_dim),
                             lambda b, h: (b, h, 0, 0)),
      out_shape=jax.ShapeDtypeStruct(qs.shape, jnp.float32),
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
      name=f"ragged_paged_attention_bq{block_q}_bkv{block_kv}",
  )(seq.astype(jnp.int32), start_pos.astype(jnp.int32),
    num_valid.astype(jnp.int32), kv_lens.astype(jnp.int32), table,
    qs.astype(k_pages.dtype), k_pages, v_pages)

  out = out.reshape(num_slots, num_kv_heads, block_q, group_p, head_dim)
  out = jnp.transpose(out[:, :, :, :group], (0, 2, 1, 3, 4))
  out = out.reshape(num_slots * block_q, num_q_heads, head_dim)
  result = jnp.zeros((num_rows, num_q_heads, head_dim), jnp.float32)
  result = result.at[rows.reshape(-1)].set(out, mode="drop")
  return result.astype(q.dtype)
