"""Mosaic TPU kernel for segmented ragged paged attention (§0x04, §0x09).

The kernel, then its ``pallas_call`` wrapper; the jitted public entry point
(``ragged.ragged_paged_attention(..., impl="pallas_tpu")``) and the plain
reference live in ``attention/ragged.py``. On a CPU the same kernel runs in
Pallas's TPU interpret mode (``pltpu.InterpretParams``), which simulates
HBM, VMEM, SMEM, DMAs and semaphores (and can detect races).

Structure (the shape production TPU paged-attention kernels take):

* Query slots. The wrapper lays the packed rows out as ``ragged.query_slots``
  slots: slot ``b`` holds up to ``block_q`` consecutive rows of one sequence,
  so prefill chunks, whole prompts and decode rows share one launch. The
  grid is ``(num_slots, n_kv_heads)``.
* GQA folded into the query tile. Program ``(b, h)`` keeps the slot's rows
  times the ``G`` query heads of KV head ``h`` as one ``[tile, head_dim]``
  tile, row ``r`` = query row ``r // G``, head ``h * G + r % G``; ``tile`` is
  ``block_q * G`` rounded up to a multiple of 8 (the trailing rows are
  padding). The tile's last two dims are (multiple of 8, full head_dim), the
  TPU block layout rule.
* Scalar prefetch. Slot metadata (sequence, first position, valid rows),
  ``kv_lens`` and the page table (flattened, i32) go to SMEM before the grid
  runs (``PrefetchScalarGridSpec``); the kernel reads page ids as scalars.
* K/V stay in HBM (``memory_space=pl.ANY``). Key block ``j`` (positions
  ``[j * block_kv, (j + 1) * block_kv)``) is ``block_kv // page_size``
  pages; each page's ``[page_size, head_dim]`` slice of head ``h`` is DMA'd
  (``pltpu.make_async_copy``) into a VMEM buffer ``[2, block_kv, head_dim]``
  (page ``i`` at rows ``[i * page_size, (i + 1) * page_size)``). Double
  buffering: block ``j + 1``'s copies start before block ``j``'s are waited
  on, so the next group's DMA overlaps this group's compute. One DMA
  semaphore per (K or V, buffer).
* Float32 online softmax over the blocks ``first .. last`` the slot needs
  (``first`` skips blocks wholly outside a sliding window), carried in the
  loop as ``m, l: f32[tile, 1]``, ``acc: f32[tile, head_dim]``. Scores are
  a ``dot_general`` in the K/V dtype (bf16 K/V feed the MXU in bf16) with a
  float32 result; P@V runs in float32 (V upcast), matching the other
  implementations' numerics.
* Page tails past ``kv_len`` and unused table entries may hold anything
  (NaN): a score column past ``kv_len`` is never visible and is replaced by
  ``-inf``; V rows past ``kv_len`` are zeroed before P@V.

Not done (the production kernels do more): the next slot's first block is
not prefetched across grid steps; decode rows take a ``block_q``-row slot
each instead of several sequences sharing one query tile; each page is
copied once per KV head (a strided ``[page_size, head_dim]`` slice of the
``[.., n_kv_heads, head_dim]`` HBM tiles) where copying all heads of a page
at once and loading heads with strided VMEM reads needs fewer, larger DMAs.
Mosaic's full compile (layout assignment, DMA legality) runs only on a TPU
host and is unchecked here.

Lowering without a device: ``jax.export(..., platforms=("tpu",))`` lowers
this kernel on a CPU-only host (Mosaic serialises the kernel into the
``tpu_custom_call`` at lowering time); ``tests/attention/test_pallas_tpu.py``
asserts the custom call in the exported module.

Sources: vLLM tpu-inference's ragged paged attention and MaxText's paged
attention kernels (structure only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attention import online_softmax

# float32 tiles multiply in full float32.
_EXACT = jax.lax.Precision.HIGHEST


def _div(x, d: int):
  """``x // d`` for ``x >= 0``: truncating division, which Mosaic lowers
  without asking which TPU generation it compiles for (floor division's
  sign fix-up does ask, so it would not lower on a host without a TPU)."""
  return jax.lax.div(x, jnp.int32(d))


def _ragged_kernel(
    # Scalar prefetch (SMEM).
    seq_ref,        # i32[num_slots]          sequence of each slot
    start_ref,      # i32[num_slots]          position of the slot's first row
    valid_ref,      # i32[num_slots]          valid rows in the slot
    kv_lens_ref,    # i32[S]
    table_ref,      # i32[S * padded_pages_per_seq]  flattened page table
    # Inputs.
    q_ref,          # f32[tile, head_dim]      VMEM block (slot b, head h)
    k_hbm,          # [num_pages, page_size, n_kv_heads, head_dim]  HBM
    v_hbm,          # [num_pages, page_size, n_kv_heads, head_dim]  HBM
    # Output.
    o_ref,          # f32[tile, head_dim]
    # Scratch.
    k_buf,          # [2, block_kv, head_dim]  VMEM, K/V dtype
    v_buf,          # [2, block_kv, head_dim]
    sems,           # DMA semaphores [2 (K, V), 2 (buffer)]
    *,
    group: int,
    block_kv: int,
    pages_per_seq: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
):
  b = pl.program_id(0)
  h = pl.program_id(1)
  tile_rows, head_dim = q_ref.shape
  page_size = k_hbm.shape[1]
  pages_per_block = block_kv // page_size
  seq = seq_ref[b]
  start = start_ref[b]
  num_valid = valid_ref[b]
  kv_len = kv_lens_ref[seq]

  last = start + num_valid - 1
  end_block = jnp.where(num_valid > 0, _div(last, block_kv) + 1, 0)
  first_block = 0
  if sliding_window is not None:
    first_block = jnp.minimum(
        _div(jnp.maximum(start - sliding_window + 1, 0), block_kv), end_block)

  def copies(j, buf):
    """The 2 * pages_per_block DMA descriptors of key block ``j``."""
    base = seq * pages_per_seq + j * pages_per_block
    out = []
    for kind, (hbm, vmem) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
      for i in range(pages_per_block):
        page = table_ref[base + i]
        out.append(pltpu.make_async_copy(
            hbm.at[page, :, h, :],
            vmem.at[buf, pl.ds(i * page_size, page_size), :],
            sems.at[kind, buf]))
    return out

  @pl.when(first_block < end_block)
  def _():
    for c in copies(first_block, jax.lax.rem(first_block, 2)):
      c.start()

  row = _div(jax.lax.broadcasted_iota(jnp.int32, (tile_rows, block_kv), 0),
             group)
  row_pos = start + row
  row_ok = row < num_valid
  key_iota = jax.lax.broadcasted_iota(jnp.int32, (tile_rows, block_kv), 1)
  key_col = jax.lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)
  q = q_ref[...].astype(k_buf.dtype)
  precision = _EXACT if k_buf.dtype == jnp.float32 else None

  def body(j, carry):
    buf = jax.lax.rem(j, 2)

    @pl.when(j + 1 < end_block)
    def _():
      for c in copies(j + 1, 1 - buf):
        c.start()

    for c in copies(j, buf):
      c.wait()
    k = k_buf[buf]                                     # [block_kv, head_dim]
    v = v_buf[buf].astype(jnp.float32)
    v = jnp.where(j * block_kv + key_col < kv_len, v, 0.0)   # tails: NaN
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            precision=precision,
                            preferred_element_type=jnp.float32) * sm_scale
    s, visible = online_softmax.visible_scores(
        s, row_ok, row_pos, j * block_kv + key_iota, soft_cap=soft_cap,
        sliding_window=sliding_window)
    return online_softmax.block_update(carry, s, visible, v)

  init = online_softmax.init(tile_rows, head_dim)
  _, l, acc = jax.lax.fori_loop(first_block, end_block, body, init)
  o_ref[...] = online_softmax.finish(l, acc).astype(o_ref.dtype)


def ragged_attention_slots(q, k_pages, v_pages, kv_lens, page_table, slots, *,
                           block_q: int, block_kv: int, sm_scale: float,
                           soft_cap: float | None,
                           sliding_window: int | None, interpret):
  """Runs ``_ragged_kernel`` over query slots and scatters rows back.

  Args:
    q: f32/bf16[T, n_q_heads, head_dim].
    k_pages, v_pages: [num_pages, page_size, n_kv_heads, head_dim] (f32 or
      bf16), left in HBM.
    kv_lens: i32[S]. page_table: i32[S, pages_per_seq].
    slots: ``ragged.query_slots(...)`` for ``block_q``: ``(rows
      i32[NS, block_q], start_pos i32[NS], num_valid i32[NS], seq i32[NS])``.
    block_q, block_kv: static tile sizes; ``block_kv % page_size == 0``.
    sm_scale, soft_cap, sliding_window: as ``ragged_paged_attention``.
    interpret: static; ``False`` compiles for a TPU, ``True`` or a
      ``pltpu.InterpretParams`` runs TPU interpret mode (CPU).

  Returns:
    [T, n_q_heads, head_dim] in ``q.dtype``; rows in no slot are zeros.

  Raises:
    ValueError: if ``block_kv`` is not a multiple of the page size, or, when
      compiling for a TPU, if ``page_size`` is not a multiple of the K/V
      dtype's sublane tile (8 rows of f32, 16 of bf16: each page lands at row
      ``i * page_size`` of the VMEM buffer, which must be tile-aligned).
      Interpret mode has no such rule (the tiny test model uses 4-row pages).
  """
  rows, start_pos, num_valid, seq = slots
  num_rows, num_q_heads, head_dim = q.shape
  num_pages, page_size, num_kv_heads, _ = k_pages.shape
  if block_kv % page_size:
    raise ValueError(f"block_kv={block_kv} must be a multiple of page_size="
                     f"{page_size}")
  sublanes = 32 // k_pages.dtype.itemsize
  if interpret is False and page_size % sublanes:
    raise ValueError(f"page_size={page_size} must be a multiple of {sublanes} "
                     f"for {k_pages.dtype} K/V pages on a TPU (VMEM tile rows)")
  group = num_q_heads // num_kv_heads
  num_slots = rows.shape[0]
  tile = -(-block_q * group // 8) * 8
  pages_per_block = block_kv // page_size
  pages_per_seq = page_table.shape[1]
  padded_pages = -(-pages_per_seq // pages_per_block) * pages_per_block
  table = jnp.pad(page_table.astype(jnp.int32),
                  ((0, 0), (0, padded_pages - pages_per_seq)), mode="edge")
  table = jnp.clip(table, 0, num_pages - 1).reshape(-1)

  qs = jnp.take(q, rows, axis=0, mode="fill", fill_value=0)    # [NS,bq,Hq,D]
  qs = qs.reshape(num_slots, block_q, num_kv_heads, group, head_dim)
  qs = jnp.transpose(qs, (0, 2, 1, 3, 4)).reshape(
      num_slots, num_kv_heads, block_q * group, head_dim)
  qs = jnp.pad(qs, ((0, 0), (0, 0), (0, tile - block_q * group), (0, 0)))

  if interpret is True:
    interpret = pltpu.InterpretParams()
  kernel = functools.partial(
      _ragged_kernel, group=group, block_kv=block_kv,
      pages_per_seq=padded_pages, sm_scale=sm_scale, soft_cap=soft_cap,
      sliding_window=sliding_window)
  tile_spec = pl.BlockSpec((None, None, tile, head_dim),
                           lambda b, h, *_: (b, h, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=5,
      grid=(num_slots, num_kv_heads),
      in_specs=[tile_spec, pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=tile_spec,
      scratch_shapes=[pltpu.VMEM((2, block_kv, head_dim), k_pages.dtype),
                      pltpu.VMEM((2, block_kv, head_dim), v_pages.dtype),
                      pltpu.SemaphoreType.DMA((2, 2))])
  out = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct(qs.shape, jnp.float32),
      interpret=interpret or False,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary")),
      name=f"ragged_paged_attention_tpu_bq{block_q}_bkv{block_kv}",
  )(seq.astype(jnp.int32), start_pos.astype(jnp.int32),
    num_valid.astype(jnp.int32), kv_lens.astype(jnp.int32), table,
    qs.astype(jnp.float32), k_pages, v_pages)

  out = out[:, :, :block_q * group].reshape(num_slots, num_kv_heads, block_q,
                                            group, head_dim)
  out = jnp.transpose(out, (0, 2, 1, 3, 4))
  out = out.reshape(num_slots * block_q, num_q_heads, head_dim)
  result = jnp.zeros((num_rows, num_q_heads, head_dim), jnp.float32)
  result = result.at[rows.reshape(-1)].set(out, mode="drop")
  return result.astype(q.dtype)
