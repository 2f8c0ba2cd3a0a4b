"""Segmented ragged paged attention for packed iterations (§0x04, §0x09).

One launch computes request-local causal attention for a packed iteration that
mixes decode rows, prefill chunks with committed history and whole prompts.

Layout shared by every implementation in this file:

* ``q``           f32/bf16[T, n_q_heads, head_dim]      packed query rows
* ``k_pages``     [num_pages, page_size, n_kv_heads, head_dim]
* ``v_pages``     [num_pages, page_size, n_kv_heads, head_dim]; float32,
                  bfloat16, or uint16 holding bfloat16 bits (``KV_BITS``:
                  the CPU storage of a bfloat16 cache, see below)
* ``kv_lens``     i32[S]  committed rows + current rows of each sequence
* ``page_table``  i32[S, pages_per_seq]  logical page -> physical page
* ``cu_q_lens``   i32[S + 1]  packed row offsets; sequence s owns rows
                  ``[cu_q_lens[s], cu_q_lens[s + 1])``
* ``num_seqs``    i32[] (or i32[1])  live sequences; rows at or beyond
                  ``cu_q_lens[num_seqs]`` are padding and produce zeros.

Row ``i`` of sequence ``s`` sits at position ``kv_lens[s] - q_len[s] + i`` and
sees keys ``0..position`` of its own sequence only (and, with a sliding
window ``w``, only keys at positions ``> position - w``). Query head ``h``
reads KV head ``h // (n_q_heads // n_kv_heads)`` (grouped-query attention).

The current rows' K/V must already be in their pages when attention runs
(``write_kv_pages`` below does that as a separate jitted update).

bfloat16 K/V on CPU: XLA:CPU has no bfloat16 gather or scatter; it widens the
gather's whole operand to float32 first, so every layer's attention would
convert the whole cache (most of a bfloat16 decode call when measured). A
bfloat16 cache is therefore stored as its raw bits (``KV_BITS`` = uint16
pages, ``models.llama.init_kv_cache``): the CPU paths gather the bits and
widen only the gathered key block (``widen_kv``), and ``write_kv_pages``
scatters bits. Float bfloat16 pages stay accepted (and correct) everywhere.

Implementations (``impl=``):

* ``"native"``   the C++ CPU kernel of ``attention/native.py`` (an XLA FFI
                 custom call reading the pages directly; per-row numerics,
                 so batch- and chunk-invariant by construction), the CPU
                 default where it builds.
* ``"blocked"``  pure jnp online softmax over key blocks with elementwise
                 products (the TPU default; the invariance fallback).
* ``"blocked_dot"`` the same slots and key-block order with batched
                 ``dot_general`` for scores and P@V (``_dot_update``), the
                 CPU fallback where the native kernel does not build.
* ``"pallas"``   the Pallas kernel of ``attention/pallas_ragged.py``
                 (``interpret=True`` on CPU).
* ``"pallas_tpu"`` the Mosaic TPU kernel of ``attention/pallas_tpu.py``
                 (DMA'd K/V pages; TPU interpret mode off a TPU).
* ``"gather"``   each row gathers its sequence's whole page list (memory heavy;
                 kept as a second jittable cross-check; its arrays are sized
                 by the bucket, so a row's bits may differ between buckets).
* ``"auto"``     ``"pallas"`` on GPU, ``"native"`` on CPU,
                 ``"pallas_tpu"`` on TPU (``resolve_impl``).

Numerics of ``"blocked"`` and ``"pallas"``: each query walks key blocks
``j = 0, 1, ...`` where block ``j`` covers key positions
``[j * block_kv, (j + 1) * block_kv)`` of its own sequence, with float32
scores, running max, running sum and accumulator. The order depends only on
the query's position, so a row's output does not depend on how its prompt was
chunked or which sequences share the launch; on CPU ``"blocked"`` makes that
bitwise (see ``_block_update``).

One file: every implementation of the one layout above (the reference, the
blocked jnp paths, the dispatch to the native and Pallas kernels) sits
beside the others, so their shared contract is stated and read once.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from attention import native
from attention import pallas_ragged
from attention import pallas_tpu

# Page dtype that holds bfloat16 K/V as raw bits (see the module docstring).
KV_BITS = jnp.uint16


def kv_float_dtype(pages_dtype):
  """The float dtype of K/V stored as ``pages_dtype`` (bfloat16 for
  ``KV_BITS`` pages, otherwise ``pages_dtype`` itself)."""
  return jnp.dtype(jnp.bfloat16) if pages_dtype == KV_BITS else jnp.dtype(pages_dtype)


def widen_kv(blk):
  """float32 values of a gathered K/V block, bit-stored pages included."""
  if blk.dtype == KV_BITS:
    blk = jax.lax.bitcast_convert_type(blk, jnp.bfloat16)
  return blk.astype(jnp.float32)


# "blocked_dot" loop sizes: the least number of softmax rows a decode step
# holds (below), prefill slots per step (the dot's batch), key blocks per
# decode step; the default query rows per prefill slot and the longest
# sequence that gets one slot per row (q_len <= short_q). The dots' sums do
# not depend on these sizes (``_dot_update``); they fix the shapes of the
# online-softmax arrays, whose exp XLA:CPU rounds apart between some shapes.
#
# ``row_softmax_rows``: the row layout takes the smallest slot batch W >= 2
# with ``W * n_kv_heads * M >= row_softmax_rows`` (M = max(2, group) query
# rows per KV head), the same in every bucket. Measured on two x86 CPUs
# (AVX2; AVX-512): softmax arrays of 16 to 27 rows of keys round some exps
# apart from those of 32 rows or more (a lone decode row then differs
# between buckets, and a prompt's short last chunk, which takes row slots,
# from the same rows in 64-row slots); from 32 rows up they agree
# (``tests/attention/test_ragged.py``: slot heights, small buckets).
_TUNE = dict(row_softmax_rows=32, chunk_blocks=2, unroll_rows=1, block_q=64, short_q=4)
IMPLS = ("auto", "native", "blocked", "blocked_dot", "pallas", "pallas_tpu", "gather")


# --------------------------------------------------------------------------
# Checks: shapes at trace time, values outside jit.


def check_shapes(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                 num_seqs, *, sm_scale, sliding_window=None, soft_cap=None):
  """Trace-time shape/dtype/static-argument checks.

  Raises:
    ValueError: naming the argument and the violated rule.
  """
  if q.ndim != 3:
    raise ValueError(f"q must be [T, n_q_heads, head_dim], got shape {q.shape}")
  if k_pages.ndim != 4:
    raise ValueError("k_pages must be [num_pages, page_size, n_kv_heads, "
                     f"head_dim], got shape {k_pages.shape}")
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape "
                     f"{k_pages.shape}")
  if v_pages.dtype != k_pages.dtype:
    raise ValueError(f"v_pages dtype {v_pages.dtype} must equal k_pages dtype "
                     f"{k_pages.dtype}")
  if not (jnp.issubdtype(k_pages.dtype, jnp.floating) or k_pages.dtype == KV_BITS):
    raise ValueError(f"k_pages dtype must be a float or {jnp.dtype(KV_BITS)} "
                     f"(bfloat16 bits), got {k_pages.dtype}")
  num_q_heads, head_dim = q.shape[1:]
  num_kv_heads = k_pages.shape[2]
  if k_pages.shape[3] != head_dim:
    raise ValueError(f"k_pages head_dim {k_pages.shape[3]} must equal q "
                     f"head_dim {head_dim}")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"q n_q_heads {num_q_heads} must be a multiple of "
                     f"k_pages n_kv_heads {num_kv_heads}")
  if kv_lens.ndim != 1:
    raise ValueError(f"kv_lens must be [S], got shape {kv_lens.shape}")
  num_slots = kv_lens.shape[0]
  if page_table.ndim != 2 or page_table.shape[0] != num_slots:
    raise ValueError(f"page_table must be [S={num_slots}, pages_per_seq], got "
                     f"shape {page_table.shape}")
  if cu_q_lens.shape != (num_slots + 1,):
    raise ValueError(f"cu_q_lens must be [S + 1] = [{num_slots + 1}], got "
                     f"shape {cu_q_lens.shape}")
  if jnp.shape(num_seqs) not in ((), (1,)):
    raise ValueError(f"num_seqs must be a scalar or [1], got shape "
                     f"{jnp.shape(num_seqs)}")
  for name, x in (("kv_lens", kv_lens), ("page_table", page_table),
                  ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
      raise ValueError(f"{name} must have an integer dtype, got "
                       f"{jnp.result_type(x)}")
  if not (isinstance(sm_scale, (int, float, np.floating))
          and np.isfinite(sm_scale)
          and sm_scale > 0):
    raise ValueError(f"sm_scale must be a finite positive float, got "
                     f"{sm_scale!r}")
  if sliding_window is not None and (not isinstance(sliding_window, int)
                                     or sliding_window < 1):
    raise ValueError(f"sliding_window must be None or an int >= 1, got "
                     f"{sliding_window!r}")
  if soft_cap is not None and not (isinstance(soft_cap, (int, float))
                                   and soft_cap > 0):
    raise ValueError(f"soft_cap must be None or a positive float, got "
                     f"{soft_cap!r}")


def check_values(kv_lens, page_table, cu_q_lens, num_seqs, *, num_rows,
                 page_size, num_pages):
  """Host-side value checks of the ragged descriptors (not jittable).

  Args:
    kv_lens, page_table, cu_q_lens, num_seqs: as in the module docstring,
      concrete arrays.
    num_rows: T, the packed row count of ``q``.
    page_size, num_pages: of ``k_pages``.

  Raises:
    ValueError: naming the argument and the violated rule, e.g. a sequence
      whose ``q_len`` exceeds its ``kv_len``.
  """
  kv_lens, page_table, cu_q_lens = map(np.asarray, (kv_lens, page_table,
                                                    cu_q_lens))
  n = int(np.asarray(num_seqs).reshape(()))
  num_slots, pages_per_seq = page_table.shape
  if not 0 <= n <= num_slots:
    raise ValueError(f"num_seqs={n} must lie in [0, S={num_slots}]")
  cu = cu_q_lens[: n + 1]
  if cu[0] != 0:
    raise ValueError(f"cu_q_lens[0]={cu[0]} must be 0")
  q_lens = np.diff(cu)
  if np.any(q_lens < 0):
    s = int(np.argmax(q_lens < 0))
    raise ValueError(f"cu_q_lens must be non-decreasing: cu_q_lens[{s + 1}]="
                     f"{cu[s + 1]} < cu_q_lens[{s}]={cu[s]}")
  if cu[-1] > num_rows:
    raise ValueError(f"cu_q_lens[num_seqs]={cu[-1]} must be <= T={num_rows}")
  kv = kv_lens[:n]
  if np.any(q_lens > kv):
    s = int(np.argmax(q_lens > kv))
    raise ValueError(f"sequence {s}: q_len={q_lens[s]} must be <= "
                     f"kv_lens[{s}]={kv[s]}")
  if np.any(kv > pages_per_seq * page_size):
    s = int(np.argmax(kv > pages_per_seq * page_size))
    raise ValueError(f"kv_lens[{s}]={kv[s]} must be <= pages_per_seq * "
                     f"page_size = {pages_per_seq * page_size}")
  for s in range(n):
    used = page_table[s, : -(-int(kv[s]) // page_size)]
    if np.any((used < 0) | (used >= num_pages)):
      raise ValueError(f"page_table[{s}] entries for the sequence's "
                       f"{used.size} pages must lie in [0, {num_pages}), got "
                       f"{used.tolist()}")


# --------------------------------------------------------------------------
# KV page writes and row metadata.


@jax.jit
def write_kv_pages(k_pages, v_pages, k_new, v_new, slot_mapping):
  """Scatters the current rows' K/V into their pages.

  Args:
    k_pages, v_pages: [num_pages, page_size, n_kv_heads, head_dim].
    k_new, v_new: [T, n_kv_heads, head_dim] rows to write (cast to the pages'
      dtype; float rows become bfloat16 bits for ``KV_BITS`` pages, and
      ``KV_BITS`` rows are written as they are).
    slot_mapping: i32[T], ``page * page_size + offset`` for each row; a
      negative entry marks a padding row, whose write is dropped.

  Returns:
    The updated ``(k_pages, v_pages)``; nothing else changes.
  """
  num_pages, page_size = k_pages.shape[:2]
  num_slots = num_pages * page_size
  index = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)  # OOB -> drop

  def scatter(pages, rows):
    flat = pages.reshape((num_slots,) + pages.shape[2:])
    if pages.dtype == KV_BITS and rows.dtype != KV_BITS:   # floats -> bits
      rows = jax.lax.bitcast_convert_type(rows.astype(jnp.bfloat16), KV_BITS)
    flat = flat.at[index].set(rows.astype(pages.dtype), mode="drop")
    return flat.reshape(pages.shape)

  return scatter(k_pages, k_new), scatter(v_pages, v_new)


def row_metadata(cu_q_lens, kv_lens, num_seqs, num_rows):
  """Per packed row: sequence index, absolute position and validity.

  Returns:
    ``(seq_of_row i32[T], position i32[T], valid bool[T])``; padding rows get
    sequence 0, position 0 and ``valid=False``.
  """
  num_seqs = jnp.reshape(num_seqs, ())
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  num_slots = kv_lens.shape[0]
  seq = jnp.searchsorted(cu_q_lens, rows, side="right").astype(jnp.int32) - 1
  seq = jnp.clip(seq, 0, num_slots - 1)
  valid = rows < cu_q_lens[num_seqs]
  q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
  position = kv_lens[seq] - q_len + (rows - cu_q_lens[seq])
  return (jnp.where(valid, seq, 0), jnp.where(valid, position, 0), valid)


# --------------------------------------------------------------------------
# Query slots: packed rows re-laid out into blocks of one sequence each.


def query_slots(cu_q_lens, kv_lens, num_seqs, *, num_rows, block_q,
                num_slots, select=None):
  """Lays the selected sequences' rows out as ``block_q``-row slots.

  Sequence ``s`` (if selected) gets ``ceil(q_len / block_q)`` consecutive
  slots; its ``i``-th slot holds its local rows
  ``[i * block_q, min((i + 1) * block_q, q_len))``. Slots past the selected
  sequences' total are empty.

  Args:
    cu_q_lens: i32[S + 1]; kv_lens: i32[S]; num_seqs: i32[] or i32[1].
    num_rows: static T. block_q: static rows per slot.
    num_slots: static slot count, at least the worst case for the selection.
    select: optional bool[S], which sequences to lay out (default: all).

  Returns:
    ``(rows i32[num_slots, block_q], start_pos i32[num_slots],
    num_valid i32[num_slots], seq i32[num_slots])``: the packed row of each
    slot row (``num_rows`` for an empty row), the position of the slot's first
    row, its valid row count (0 for an empty slot) and its sequence.
  """
  num_seqs = jnp.reshape(num_seqs, ()).astype(jnp.int32)
  cu_q_lens = cu_q_lens.astype(jnp.int32)
  kv_lens = kv_lens.astype(jnp.int32)
  seq_ids = jnp.arange(kv_lens.shape[0], dtype=jnp.int32)
  q_lens = jnp.where(seq_ids < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
  if select is not None:
    q_lens = jnp.where(select, q_lens, 0)
  blocks = (q_lens + block_q - 1) // block_q
  # Prefix sums and the slot -> sequence search as [S, S] / [NS, S] compares
  # (S is small): they compile much faster than cumsum and searchsorted.
  before = seq_ids[:, None] < seq_ids[None, :]                  # [S, S]
  cu_blocks = jnp.concatenate([jnp.sum(jnp.where(before, blocks[:, None], 0),
                                       axis=0, dtype=jnp.int32),
                               jnp.sum(blocks, dtype=jnp.int32)[None]])
  slot = jnp.arange(num_slots, dtype=jnp.int32)
  seq = jnp.sum(cu_blocks[None, 1:-1] <= slot[:, None], axis=1,
                dtype=jnp.int32)
  first = (slot - cu_blocks[seq]) * block_q          # first local row
  num_valid = jnp.clip(q_lens[seq] - first, 0, block_q)
  num_valid = jnp.where(slot < cu_blocks[-1], num_valid, 0)
  start_pos = kv_lens[seq] - q_lens[seq] + first
  r = jnp.arange(block_q, dtype=jnp.int32)
  rows = jnp.where(r[None, :] < num_valid[:, None],
                   cu_q_lens[seq][:, None] + first[:, None] + r[None, :],
                   num_rows)
  return rows, start_pos, num_valid, seq


# --------------------------------------------------------------------------
# The blocked jnp path.


def _block_update(state, q, k, v, pos, key_pos, kv_len, *, sm_scale, soft_cap,
                  sliding_window):
  """One online-softmax step of ``W`` slots over one key block.

  Scores and P@V are elementwise products reduced over one axis (not
  ``dot``): XLA's CPU dot picks kernels by matrix shape and so changes the
  low bits with ``block_q`` and the slot count, while these reductions keep a
  fixed sequential order per output element. Rows that see no key of the
  block keep their state bitwise.

  Args:
    state: ``(m, l, acc)``: f32[W, bq, Hkv, G], f32[W, bq, Hkv, G],
      f32[W, bq, Hkv, G, D].
    q: f32[W, bq, Hkv, G, D]. k, v: f32[W, Bk, Hkv, D].
    pos: i32[W, bq] row positions, -1 for empty rows. key_pos: i32[Bk].
    kv_len: i32[W].
  """
  m, l, acc = state
  visible = (key_pos[None, None, :] <= pos[:, :, None])           # [W,bq,Bk]
  if sliding_window is not None:
    visible &= key_pos[None, None, :] > pos[:, :, None] - sliding_window
  key_ok = key_pos[None, :] < kv_len[:, None]                       # [W, Bk]
  k = jnp.where(key_ok[:, :, None, None], k, 0.0)
  v = jnp.where(key_ok[:, :, None, None], v, 0.0)
  # s[w,q,h,g,k] = sum_d q[w,q,h,g,d] * k[w,k,h,d], summed over d in order.
  kt = jnp.transpose(k, (0, 2, 3, 1))                               # [W,H,D,Bk]
  qt = jnp.swapaxes(q, -1, -2)                                      # [W,bq,H,D,G]
  s = jnp.sum(qt[..., None] * kt[:, None, :, :, None, :], axis=3)  # [W,bq,H,G,Bk]
  s = s * sm_scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  vis = visible[:, :, None, None, :]
  s = jnp.where(vis, s, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp(m - m_safe)
  p = jnp.where(vis, jnp.exp(s - m_safe[..., None]), 0.0)
  l_new = alpha * l + jnp.sum(p, axis=-1)
  vt = jnp.swapaxes(v, 1, 2)                                        # [W,H,Bk,D]
  pv = jnp.sum(p[..., None] * vt[:, None, :, None, :, :], axis=-2)  # [W,bq,H,G,D]
  acc_new = alpha[..., None] * acc + pv
  seen = jnp.any(visible, axis=-1)[:, :, None, None]                # [W,bq,1,1]
  return (jnp.where(seen, m_new, m), jnp.where(seen, l_new, l),
          jnp.where(seen[..., None], acc_new, acc))


def _sort_slots(slots, padded, *, num_rows, block_q, block_kv):
  """Slots sorted by key blocks needed (most first), padded to ``padded``.

  Returns ``(pos_s i32[NS, bq] (-1 = no row), seq_s i32[NS], need_s i32[NS],
  rows_s i32[NS, bq] (packed row of each query; num_rows = none))``;
  padding slots need 0 blocks.
  """
  rows, start_pos, num_valid, seq = slots
  pad = padded - rows.shape[0]
  r = jnp.arange(block_q, dtype=jnp.int32)
  pos = jnp.where(r[None, :] < num_valid[:, None],
                  start_pos[:, None] + r[None, :], -1)
  last = start_pos + num_valid - 1
  need = jnp.where(num_valid > 0, last // block_kv + 1, 0)
  order = jnp.argsort(-need, stable=True)

  def sort_pad(x, fill):
    x = x[order]
    return jnp.concatenate([x, jnp.full((pad,) + x.shape[1:], fill, x.dtype)])

  return sort_pad(pos, -1), sort_pad(seq, 0), sort_pad(need, 0), sort_pad(rows, num_rows)


def _slot_queries(q, rows, *, num_kv_heads):
  """f32[W, bq, Hkv, group, D] query rows of slots ``rows`` i32[W, bq]
  (zeros where a row is ``num_rows``, an empty slot row)."""
  num_rows, num_q_heads, head_dim = q.shape
  qs = jnp.take(q, rows, axis=0, mode="fill", fill_value=0)
  return qs.astype(jnp.float32).reshape(rows.shape + (num_kv_heads, num_q_heads // num_kv_heads,
                                                      head_dim))


def _attend_slots(q, k_pages, v_pages, kv_lens, page_table, slots, out, *,
                  block_q, block_kv, chunk, sm_scale, soft_cap,
                  sliding_window):
  """Online softmax for every slot of one layout, written into the rows of
  ``out`` f32[T, Hq, D] that the slots hold; returns the updated ``out``.

  Slots are sorted by the number of key blocks they need, so at key block
  ``j`` the active slots are a prefix, processed ``chunk`` at a time; the cost
  follows the real context lengths, not the page-table width.
  """
  rows = slots[0]
  num_rows, num_q_heads, head_dim = q.shape
  _, page_size, num_kv_heads, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  pages_per_block = block_kv // page_size
  pages_per_seq = page_table.shape[1]
  num_slots = rows.shape[0]
  padded = -(-num_slots // chunk) * chunk

  pos_s, seq_s, need_s, rows_s = _sort_slots(
      slots, padded, num_rows=num_rows, block_q=block_q, block_kv=block_kv)
  qs = _slot_queries(q, rows_s, num_kv_heads=num_kv_heads)
  kv_len_s = kv_lens.astype(jnp.int32)[seq_s]
  table_s = page_table[seq_s]                                     # [NS, P]

  def kv_block(pages_ref, page_ids):
    blk = jnp.take(pages_ref, page_ids, axis=0, mode="clip")
    return widen_kv(blk).reshape(page_ids.shape[0], block_kv,
                                           num_kv_heads, head_dim)

  def over_chunks(j, state):
    num_active = jnp.sum(need_s > j)
    cols = jnp.minimum(j * pages_per_block + jnp.arange(pages_per_block),
                       pages_per_seq - 1)
    key_pos = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)

    def body(c, state):
      start = c * chunk
      take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk)
      page_ids = take(table_s)[:, cols]                           # [W, ppb]
      sub = tuple(take(x) for x in state)
      sub = _block_update(sub, take(qs), kv_block(k_pages, page_ids),
                          kv_block(v_pages, page_ids), take(pos_s), key_pos,
                          take(kv_len_s), sm_scale=sm_scale,
                          soft_cap=soft_cap, sliding_window=sliding_window)
      return tuple(jax.lax.dynamic_update_slice_in_dim(x, y, start, 0)
                   for x, y in zip(state, sub))

    return jax.lax.fori_loop(0, (num_active + chunk - 1) // chunk, body, state)

  shape = (padded, block_q, num_kv_heads, group)
  state = (jnp.full(shape, -jnp.inf, jnp.float32),
           jnp.zeros(shape, jnp.float32),
           jnp.zeros(shape + (head_dim,), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, jnp.max(need_s), over_chunks, state)
  o = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
  return out.at[rows_s.reshape(-1)].set(o.reshape(-1, num_q_heads, head_dim), mode="drop")


def _blocked(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, num_seqs, *,
             sm_scale, soft_cap, sliding_window, block_q, block_kv,
             chunk_rows, chunk_blocks, short_q=None, attend=None, row_kw=None,
             block_kw=None):
  """Row path for short sequences (decode), block path for the rest.

  A sequence with ``q_len <= short_q`` (default ``block_q // 4``) gets one
  slot per row instead of a mostly empty ``block_q``-row slot. ``attend``
  (default ``_attend_slots``) runs one layout, with ``row_kw`` / ``block_kw``
  as extra keywords for the row and block layouts.
  """
  attend = attend or _attend_slots
  num_rows = q.shape[0]
  num_seq_slots = kv_lens.shape[0]
  if short_q is None:
    short_q = max(1, block_q // 4)
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  short = q_lens <= short_q
  kw = dict(block_kv=block_kv, sm_scale=sm_scale, soft_cap=soft_cap,
            sliding_window=sliding_window)
  out = jnp.zeros(q.shape, jnp.float32)
  if block_q == 1:
    layouts = [(1, num_rows, None, chunk_rows, row_kw or {})]
  else:
    long_seqs = min(num_seq_slots, num_rows // (short_q + 1))
    layouts = [(1, min(num_rows, num_seq_slots * short_q), short, chunk_rows,
                row_kw or {}),
               (block_q, (num_rows + long_seqs * (block_q - 1)) // block_q,
                ~short, chunk_blocks, block_kw or {})]
  for bq, num_slots, select, chunk, extra in layouts:
    if num_slots == 0:
      continue
    slots = query_slots(cu_q_lens, kv_lens, num_seqs, num_rows=num_rows,
                        block_q=bq, num_slots=num_slots,
                        select=select)
    # ``chunk`` (the slot batch) is the same in every bucket, even where it
    # exceeds the layout's slot count: the loop body's arrays are then the
    # same shapes in every bucket, and XLA:CPU compiles them alike. Sized
    # by the bucket, the online-softmax arrays ``[chunk, Hkv, M]`` made
    # XLA:CPU's exp round some inputs apart between a 4- and an 8-row
    # bucket (see ``_TUNE``). At least 2: for the dot path a batch of one
    # slot lowers to a different kernel.
    out = attend(q, k_pages, v_pages, kv_lens, page_table, slots, out,
                 block_q=bq, chunk=max(2, chunk), **kw, **extra)
  return out.astype(q.dtype)


# --------------------------------------------------------------------------
# The blocked dot path.


def _dot_update(state, q, k, v, pos, key_pos, kv_len, *, sm_scale, soft_cap,
                sliding_window, group):
  """One online-softmax step of ``W`` slots over one key block, with dots.

  Scores and P@V are ``dot_general``s batched over (slot, KV head), each
  batch element a fixed ``[M, D] x [Bk, D]`` / ``[M, Bk] x [Bk, D]`` product
  with ``M = bq * group`` (at least 2) query rows of one KV head. XLA's CPU
  batched dot computes every batch element with the same per-element kernel
  and sums each output element over the contracted axis in the same order
  for every ``M >= 2``, row index and batch size (``M = 1`` takes a
  different matrix-vector kernel, hence the floor), so a row's bits do not
  depend on the slot count, its slot neighbours or the slot height
  (``tests/attention/test_ragged.py`` checks this bitwise).

  Args:
    state: ``(m, l, acc)``: f32[W, Hkv, M], f32[W, Hkv, M], f32[W, Hkv, M, D].
    q: f32[W, Hkv, M, D]. k, v: f32[W, Hkv, Bk, D], v zero past kv_len.
    pos: i32[W, M] row positions, -1 for empty rows. key_pos: i32[Bk].
    kv_len: i32[W].
  """
  del group
  m, l, acc = state
  visible = key_pos[None, None, :] <= pos[:, :, None]              # [W,M,Bk]
  if sliding_window is not None:
    visible &= key_pos[None, None, :] > pos[:, :, None] - sliding_window
  # A key past kv_len (NaN in a page tail) only spoils its own score column,
  # which the mask below replaces; V is zeroed there (0 * NaN is NaN).
  del kv_len
  s = jax.lax.dot_general(q, k, (((3,), (3,)), ((0, 1), (0, 1))),
                          preferred_element_type=jnp.float32)      # [W,H,M,Bk]
  s = s * sm_scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  vis = visible[:, None]
  s = jnp.where(vis, s, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp(m - m_safe)
  p = jnp.where(vis, jnp.exp(s - m_safe[..., None]), 0.0)
  l_new = alpha * l + jnp.sum(p, axis=-1)
  pv = jax.lax.dot_general(p, v, (((3,), (2,)), ((0, 1), (0, 1))),
                           preferred_element_type=jnp.float32)     # [W,H,M,D]
  acc_new = alpha[..., None] * acc + pv
  seen = jnp.any(visible, axis=-1)[:, None]                         # [W,1,M]
  return (jnp.where(seen, m_new, m), jnp.where(seen, l_new, l),
          jnp.where(seen[..., None], acc_new, acc))


def _attend_slots_dot(q, k_pages, v_pages, kv_lens, page_table, slots, out, *,
                      block_q, block_kv, chunk, sm_scale, soft_cap,
                      sliding_window, unroll=1):
  """Online softmax for every slot of one layout, written into the rows of
  ``out`` f32[T, Hq, D] that the slots hold; returns the updated ``out``.

  Slots are sorted by the number of key blocks they need and processed
  ``chunk`` at a time; a chunk walks key blocks ``0 .. need - 1`` of its
  neediest slot with its state in the loop carry (``unroll`` blocks per
  loop step, each its own online-softmax update, so the numerics do not
  depend on ``unroll``). A chunk gathers its own query rows and scatters
  its own output rows, so the work outside the loop does not grow with
  the (worst-case) slot count, only with the slots holding rows.
  """
  rows = slots[0]
  num_rows, num_q_heads, head_dim = q.shape
  _, page_size, num_kv_heads, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  pages_per_block = block_kv // page_size
  pages_per_seq = page_table.shape[1]
  num_slots = rows.shape[0]
  padded = -(-num_slots // chunk) * chunk
  m_rows = max(2, block_q * group)            # see _dot_update

  pos_s, seq_s, need_s, rows_s = _sort_slots(
      slots, padded, num_rows=num_rows, block_q=block_q, block_kv=block_kv)
  pos_m = jnp.repeat(pos_s, group, axis=1)                        # [NS, bq*G]
  if m_rows > block_q * group:
    pos_m = jnp.pad(pos_m, ((0, 0), (0, m_rows - block_q * group)),
                    constant_values=-1)
  kv_len_s = kv_lens.astype(jnp.int32)[seq_s]
  table_s = page_table[seq_s]                                     # [NS, P]
  num_active = jnp.sum(need_s > 0)

  def kv_block(pages_ref, page_ids):
    blk = jnp.take(pages_ref, page_ids, axis=0, mode="clip")
    return widen_kv(blk).reshape(page_ids.shape[0], -1,
                                           num_kv_heads, head_dim)

  def over_chunks(c, out):
    start = c * chunk
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk)
    table_c, rows_c, pos_c, kv_len_c = (take(table_s), take(rows_s), take(pos_m),
                                        take(kv_len_s))
    q_c = jnp.transpose(_slot_queries(q, rows_c, num_kv_heads=num_kv_heads),
                        (0, 2, 1, 3, 4)).reshape(chunk, num_kv_heads,
                                                 block_q * group, head_dim)
    if m_rows > block_q * group:
      q_c = jnp.pad(q_c, ((0, 0), (0, 0), (0, m_rows - block_q * group), (0, 0)))

    def over_blocks(i, state):
      j0 = i * unroll
      cols = jnp.minimum(j0 * pages_per_block
                         + jnp.arange(unroll * pages_per_block),
                         pages_per_seq - 1)
      page_ids = table_c[:, cols]                        # [W, unroll * ppb]
      key_pos = j0 * block_kv + jnp.arange(unroll * block_kv, dtype=jnp.int32)
      key_ok = (key_pos[None, :] < kv_len_c[:, None])[:, None, :, None]
      k_all = jnp.transpose(kv_block(k_pages, page_ids), (0, 2, 1, 3))
      v_all = jnp.where(key_ok, jnp.transpose(kv_block(v_pages, page_ids),
                                              (0, 2, 1, 3)), 0.0)
      for u in range(unroll):
        sl = slice(u * block_kv, (u + 1) * block_kv)
        state = _dot_update(state, q_c, k_all[:, :, sl], v_all[:, :, sl],
                            pos_c, key_pos[sl], kv_len_c, sm_scale=sm_scale,
                            soft_cap=soft_cap, sliding_window=sliding_window,
                            group=group)
      return state

    shape = (chunk, num_kv_heads, m_rows)
    state = (jnp.full(shape, -jnp.inf, jnp.float32),
             jnp.zeros(shape, jnp.float32),
             jnp.zeros(shape + (head_dim,), jnp.float32))
    steps = (need_s[start] + unroll - 1) // unroll
    _, l, acc = jax.lax.fori_loop(0, steps, over_blocks, state)
    o = jnp.where(l[..., None] > 0,
                  acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    o = o[:, :, :block_q * group].reshape(chunk, num_kv_heads, block_q, group, head_dim)
    o = jnp.transpose(o, (0, 2, 1, 3, 4)).reshape(chunk * block_q, num_q_heads, head_dim)
    return out.at[rows_c.reshape(-1)].set(o, mode="drop")

  return jax.lax.fori_loop(0, (num_active + chunk - 1) // chunk, over_chunks, out)


def _blocked_dot(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                 num_seqs, *, sm_scale, soft_cap, sliding_window, block_q,
                 block_kv, chunk_blocks, unroll_rows=1, short_q=None):
  """``_blocked``'s two layouts with ``_attend_slots_dot``; the row layout's
  slot batch is the least that holds ``_TUNE["row_softmax_rows"]``."""
  num_kv_heads = k_pages.shape[2]
  rows_per_slot = num_kv_heads * max(2, q.shape[1] // num_kv_heads)
  chunk_rows = max(2, -(-_TUNE["row_softmax_rows"] // rows_per_slot))
  return _blocked(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, num_seqs,
                  sm_scale=sm_scale, soft_cap=soft_cap,
                  sliding_window=sliding_window, block_q=block_q,
                  block_kv=block_kv, chunk_rows=chunk_rows,
                  chunk_blocks=chunk_blocks, short_q=short_q,
                  attend=_attend_slots_dot, row_kw={"unroll": unroll_rows},
                  block_kw={"unroll": 1})


# --------------------------------------------------------------------------
# The interim gather path.


def _gather_rows(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                 num_seqs, *, sm_scale, soft_cap, sliding_window):
  """Jittable path: each row gathers its own sequence's pages (memory heavy)."""
  num_rows, num_q_heads, head_dim = q.shape
  _, page_size, num_kv_heads, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  seq, position, valid = row_metadata(cu_q_lens, kv_lens, num_seqs, num_rows)
  pages = page_table[seq]                                   # [T, P]
  k = jnp.take(k_pages, pages, axis=0, mode="clip")
  v = jnp.take(v_pages, pages, axis=0, mode="clip")
  k = k.reshape(num_rows, -1, num_kv_heads, head_dim)
  v = v.reshape(num_rows, -1, num_kv_heads, head_dim)
  key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
  visible = (key_pos[None, :] <= position[:, None]) & valid[:, None]
  if sliding_window is not None:
    visible &= key_pos[None, :] > position[:, None] - sliding_window
  qg = q.reshape(num_rows, num_kv_heads, group, head_dim).astype(jnp.float32)
  k = jnp.where(visible[:, :, None, None], widen_kv(k), 0.0)
  scores = jnp.einsum("tkgd,tskd->tkgs", qg, k) * sm_scale
  if soft_cap is not None:
    scores = soft_cap * jnp.tanh(scores / soft_cap)
  scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
  m = jnp.max(scores, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(visible[:, None, None, :], jnp.exp(scores - m), 0.0)
  v = jnp.where(visible[:, :, None, None], widen_kv(v), 0.0)
  out = jnp.einsum("tkgs,tskd->tkgd", p, v)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
  return out.reshape(num_rows, num_q_heads, head_dim).astype(q.dtype)


# --------------------------------------------------------------------------
# The public entry point.


def resolve_impl(impl: str, backend: str | None = None,
                 head_dim: int | None = None) -> str:
  """Maps ``"auto"`` to the implementation for ``backend`` (default: JAX's).

  ``"pallas"`` on GPU (the kernel lowers through Triton); on CPU
  ``"native"`` (the C++ kernel of ``attention/native.py``, fastest there,
  see docs/benchmarks.md) where it builds and supports ``head_dim``, else
  ``"blocked_dot"`` with a warning naming the reason; ``"pallas_tpu"`` on
  TPU (the Mosaic kernel that DMAs K/V pages).

  Raises:
    ValueError: if ``impl`` is not one of ``IMPLS``.
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if impl != "auto":
    return impl
  backend = backend or jax.default_backend()
  if backend in ("gpu", "cuda", "rocm"):
    return "pallas"
  if backend != "cpu":
    return "pallas_tpu"
  if head_dim is not None and head_dim not in native.HEAD_DIMS:
    return "blocked_dot"
  reason = native.unavailable_reason()
  if reason is not None:
    _warn_fallback(reason)
    return "blocked_dot"
  return "native"


@functools.lru_cache(maxsize=None)
def _warn_fallback(reason: str) -> None:
  """Warns once per process that ``auto`` falls back from the native kernel."""
  warnings.warn(f"attention impl 'auto': the native CPU kernel is unavailable "
                f"({reason}); using 'blocked_dot'", RuntimeWarning, stacklevel=3)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "impl", "sliding_window", "soft_cap",
                              "block_q", "block_kv", "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_table,
                           cu_q_lens, num_seqs, *, sm_scale: float,
                           impl: str = "auto",
                           sliding_window: int | None = None,
                           soft_cap: float | None = None,
                           block_q: int | None = None,
                           block_kv: int | None = None,
                           interpret: bool | None = None):
  """Request-local causal attention over a packed, paged iteration (§0x04).

  Args:
    q: f32/bf16[T, n_q_heads, head_dim] packed query rows.
    k_pages, v_pages: [num_pages, page_size, n_kv_heads, head_dim], float
      or ``KV_BITS`` (bfloat16 bits); the current rows' K/V already written
      (``write_kv_pages``).
    kv_lens: i32[S] committed + current rows per sequence.
    page_table: i32[S, pages_per_seq] logical -> physical page.
    cu_q_lens: i32[S + 1] packed row offsets.
    num_seqs: i32[] or i32[1], live sequences.
    sm_scale: static softmax scale applied to ``q . k`` (e.g. head_dim**-0.5).
    impl: static, one of ``IMPLS`` (see module docstring).
    sliding_window: static; a row at position ``p`` sees keys ``> p - w``.
    soft_cap: static; scores become ``c * tanh(scores / c)`` (after scaling).
    block_q: static query rows per slot (default 16; 64 for "blocked_dot",
      whose default gives sequences with ``q_len <= 4`` one slot per row).
      "blocked" and "blocked_dot" give sequences with ``q_len <= block_q //
      4`` one slot per row (decode) when ``block_q`` is given.
    block_kv: static keys per block, a multiple of ``page_size`` (default:
      128 rounded up to a multiple of ``page_size``). Results are bitwise
      reproducible for a fixed ``block_kv`` and ``page_size``.
    interpret: static, Pallas interpret mode (default: on when the backend is
      CPU; for "pallas_tpu", on off a TPU). "pallas_tpu" also takes a
      ``pltpu.InterpretParams`` (e.g. ``detect_races=True``).

  Returns:
    [T, n_q_heads, head_dim] in ``q.dtype``; padding rows (at or beyond
    ``cu_q_lens[num_seqs]``) are zeros. Chunked prefill gives the same rows as
    one full prefill (§0x09).

  Raises:
    ValueError: at trace time, for inconsistent shapes, dtypes or static
      arguments (message names the argument). Value rules (e.g.
      ``q_len <= kv_len``) are checked on the host by ``check_values``.
  """
  check_shapes(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, num_seqs,
               sm_scale=sm_scale, sliding_window=sliding_window,
               soft_cap=soft_cap)
  impl = resolve_impl(impl, head_dim=q.shape[2])
  page_size = k_pages.shape[1]
  if block_kv is None:
    block_kv = 128
  block_kv = max(page_size, -(-block_kv // page_size) * page_size)
  kw = dict(sm_scale=float(sm_scale), soft_cap=soft_cap,
            sliding_window=sliding_window)
  if impl == "native":
    if q.shape[2] not in native.HEAD_DIMS:
      raise ValueError(f"impl='native' needs head_dim in {native.HEAD_DIMS}, "
                       f"got {q.shape[2]}")
    return native.ragged_attention(q, k_pages, v_pages, kv_lens, page_table,
                                   cu_q_lens, num_seqs, block_kv=block_kv, **kw)
  if impl == "gather":
    return _gather_rows(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                        num_seqs, **kw)
  short_q = None              # _blocked's default: block_q // 4
  if block_q is None:
    block_q = 16
    if impl == "blocked_dot":
      block_q, short_q = _TUNE["block_q"], _TUNE["short_q"]
  if block_q < 1:
    raise ValueError(f"block_q must be >= 1, got {block_q}")
  if impl == "blocked_dot":
    return _blocked_dot(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                        num_seqs, block_q=block_q, block_kv=block_kv,
                        chunk_blocks=_TUNE["chunk_blocks"],
                        unroll_rows=_TUNE["unroll_rows"], short_q=short_q, **kw)
  if impl == "blocked":
    return _blocked(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                    num_seqs, block_q=block_q, block_kv=block_kv,
                    chunk_rows=16, chunk_blocks=4, **kw)
  if k_pages.dtype == KV_BITS:        # the kernels read bfloat16 pages
    k_pages, v_pages = (jax.lax.bitcast_convert_type(x, jnp.bfloat16)
                        for x in (k_pages, v_pages))
  if impl == "pallas_tpu":
    kernel = pallas_tpu
    if interpret is None:
      interpret = jax.default_backend() != "tpu"
  else:
    kernel = pallas_ragged
    if interpret is None:
      interpret = jax.default_backend() == "cpu"
    if not interpret:                # GPU dot tiles need >= 16 rows
      group = q.shape[1] // k_pages.shape[2]
      block_q = max(block_q, 16 // (1 << (group - 1).bit_length()))
  num_rows = q.shape[0]
  num_slots = (num_rows + min(kv_lens.shape[0], num_rows) * (block_q - 1)
               ) // block_q
  slots = query_slots(cu_q_lens, kv_lens, num_seqs, num_rows=num_rows,
                      block_q=block_q, num_slots=num_slots)
  return kernel.ragged_attention_slots(
      q, k_pages, v_pages, kv_lens, page_table, slots, block_q=block_q,
      block_kv=block_kv, interpret=interpret, **kw)


# --------------------------------------------------------------------------
# The plain reference (test oracle).


def reference_attention(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                        num_seqs, *, sm_scale: float,
                        sliding_window: int | None = None,
                        soft_cap: float | None = None):
  """Plain per-sequence loop (numpy, float64); the test oracle.

  Same arguments and result layout as ``ragged_paged_attention``; returns
  f64[T, n_q_heads, head_dim] with zero padding rows. Reads only the pages a
  sequence's ``kv_len`` covers.
  """
  q = np.asarray(q, np.float64)
  k_pages, v_pages = (np.asarray(widen_kv(jnp.asarray(x)) if x.dtype == KV_BITS
                                 else x, np.float64)
                      for x in (k_pages, v_pages))
  kv_lens, page_table, cu_q_lens = map(np.asarray, (kv_lens, page_table,
                                                    cu_q_lens))
  page_size = k_pages.shape[1]
  num_q_heads, num_kv_heads = q.shape[1], k_pages.shape[2]
  group = num_q_heads // num_kv_heads
  out = np.zeros_like(q)
  for s in range(int(np.asarray(num_seqs).reshape(()))):
    lo, hi = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
    kv_len = int(kv_lens[s])
    pages = page_table[s, : -(-kv_len // page_size)]
    k = k_pages[pages].reshape(-1, num_kv_heads, q.shape[2])[:kv_len]
    v = v_pages[pages].reshape(-1, num_kv_heads, q.shape[2])[:kv_len]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    for i in range(hi - lo):
      pos = kv_len - (hi - lo) + i
      first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
      scores = np.einsum("hd,shd->hs", q[lo + i], k[first: pos + 1]) * sm_scale
      if soft_cap is not None:
        scores = soft_cap * np.tanh(scores / soft_cap)
      scores -= scores.max(axis=-1, keepdims=True)
      p = np.exp(scores)
      p /= p.sum(axis=-1, keepdims=True)
      out[lo + i] = np.einsum("hs,shd->hd", p, v[first: pos + 1])
  return out
