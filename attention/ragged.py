"""Segmented ragged paged attention for packed iterations (§0x04, §0x09).

One launch computes request-local causal attention for a packed iteration that
mixes decode rows, prefill chunks with committed history and whole prompts.

Layout shared by every implementation in this file:

* ``q``           f32/bf16[T, n_q_heads, head_dim]      packed query rows
* ``k_pages``     [num_pages, page_size, n_kv_heads, head_dim]
* ``v_pages``     [num_pages, page_size, n_kv_heads, head_dim]
* ``kv_lens``     i32[S]  committed rows + current rows of each sequence
* ``page_table``  i32[S, pages_per_seq]  logical page -> physical page
* ``cu_q_lens``   i32[S + 1]  packed row offsets; sequence s owns rows
                  ``[cu_q_lens[s], cu_q_lens[s + 1])``
* ``num_seqs``    i32[]  live sequences; rows at or beyond
                  ``cu_q_lens[num_seqs]`` are padding and produce zeros.

Row ``i`` of sequence ``s`` sits at position ``kv_lens[s] - q_len[s] + i`` and
sees keys ``0..position`` of its own sequence only. Query head ``h`` reads KV
head ``h // (n_q_heads // n_kv_heads)`` (grouped-query attention).

The current rows' K/V must already be in their pages when attention runs
(``write_kv_pages`` below does that as a separate jitted update).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def write_kv_pages(k_pages, v_pages, k_new, v_new, slot_mapping):
  """Scatters the current rows' K/V into their pages.

  Args:
    k_pages, v_pages: [num_pages, page_size, n_kv_heads, head_dim].
    k_new, v_new: [T, n_kv_heads, head_dim] rows to write.
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
    flat = flat.at[index].set(rows.astype(pages.dtype), mode="drop")
    return flat.reshape(pages.shape)

  return scatter(k_pages, k_new), scatter(v_pages, v_new)


def row_metadata(cu_q_lens, kv_lens, num_seqs, num_rows):
  """Per packed row: sequence index, absolute position and validity.

  Returns:
    ``(seq_of_row i32[T], position i32[T], valid bool[T])``; padding rows get
    sequence 0, position 0 and ``valid=False``.
  """
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  num_slots = kv_lens.shape[0]
  seq = jnp.searchsorted(cu_q_lens, rows, side="right").astype(jnp.int32) - 1
  seq = jnp.clip(seq, 0, num_slots - 1)
  valid = rows < cu_q_lens[num_seqs]
  q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
  position = kv_lens[seq] - q_len + (rows - cu_q_lens[seq])
  return (jnp.where(valid, seq, 0), jnp.where(valid, position, 0), valid)


def _gather_rows(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                 num_seqs, *, sm_scale):
  """Jittable path: each row gathers its own sequence's pages (memory heavy)."""
  num_rows, num_q_heads, head_dim = q.shape
  _, page_size, num_kv_heads, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  seq, position, valid = row_metadata(cu_q_lens, kv_lens, num_seqs, num_rows)
  pages = page_table[seq]                                   # [T, P]
  k = k_pages[pages].reshape(num_rows, -1, num_kv_heads, head_dim)
  v = v_pages[pages].reshape(num_rows, -1, num_kv_heads, head_dim)
  key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
  visible = (key_pos[None, :] <= position[:, None]) & valid[:, None]
  qg = q.reshape(num_rows, num_kv_heads, group, head_dim).astype(jnp.float32)
  scores = jnp.einsum("tkgd,tskd->tkgs", qg, k.astype(jnp.float32)) * sm_scale
  scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
  m = jnp.max(scores, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(visible[:, None, None, :], jnp.exp(scores - m), 0.0)
  v = jnp.where(visible[:, :, None, None], v.astype(jnp.float32), 0.0)
  out = jnp.einsum("tkgs,tskd->tkgd", p, v)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
  return out.reshape(num_rows, num_q_heads, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "impl"))
def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_table,
                           cu_q_lens, num_seqs, *, sm_scale: float,
                           impl: str = "gather"):
  """Request-local causal attention over a packed, paged iteration.

  Shapes and semantics are in the module docstring. Returns
  ``[T, n_q_heads, head_dim]`` in ``q.dtype``; padding rows are zeros.
  """
  if impl != "gather":
    raise ValueError(f"impl must be 'gather', got {impl!r}")
  return _gather_rows(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                      num_seqs, sm_scale=sm_scale)


def reference_attention(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                        num_seqs, *, sm_scale: float):
  """Plain per-sequence loop (numpy, float64); the test oracle."""
  q = np.asarray(q, np.float64)
  k_pages = np.asarray(k_pages, np.float64)
  v_pages = np.asarray(v_pages, np.float64)
  kv_lens, page_table, cu_q_lens = map(np.asarray, (kv_lens, page_table, cu_q_lens))
  num_q_heads, num_kv_heads = q.shape[1], k_pages.shape[2]
  group = num_q_heads // num_kv_heads
  out = np.zeros_like(q)
  for s in range(int(num_seqs)):
    lo, hi = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
    kv_len = int(kv_lens[s])
    k = k_pages[page_table[s]].reshape(-1, num_kv_heads, q.shape[2])[:kv_len]
    v = v_pages[page_table[s]].reshape(-1, num_kv_heads, q.shape[2])[:kv_len]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    for i in range(hi - lo):
      pos = kv_len - (hi - lo) + i
      scores = np.einsum("hd,shd->hs", q[lo + i], k[: pos + 1]) * sm_scale
      scores -= scores.max(axis=-1, keepdims=True)
      p = np.exp(scores)
      p /= p.sum(axis=-1, keepdims=True)
      out[lo + i] = np.einsum("hs,shd->hd", p, v[: pos + 1])
  return out
