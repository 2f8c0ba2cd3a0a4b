"""The float32 online softmax over key blocks, shared by the Pallas kernels.

Both ragged paged attention kernels (``pallas_ragged``: Triton;
``pallas_tpu``: Mosaic TPU) walk a query tile's keys block by block and keep
the running max ``m`` (f32[T, 1]), normaliser ``l`` (f32[T, 1]) and weighted
sum ``acc`` (f32[T, D]) of the streaming softmax (Milakov & Gimelshein 2018;
FlashAttention). The functions are plain jnp, traced inside each kernel
body; keeping ``m`` and ``l`` two-dimensional meets TPU layout rules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_EXACT = jax.lax.Precision.HIGHEST


def init(tile_rows: int, head_dim: int):
  """(m, l, acc) before the first key block: -inf, 0, 0 (float32)."""
  return (jnp.full((tile_rows, 1), -jnp.inf, jnp.float32),
          jnp.zeros((tile_rows, 1), jnp.float32),
          jnp.zeros((tile_rows, head_dim), jnp.float32))


def visible_scores(s, row_ok, row_pos, key_pos, *, soft_cap, sliding_window):
  """Soft-capped scores and the causal (+ sliding window) mask.

  Args:
    s: f32[T, K] raw scores (already scaled); row_ok: bool, valid query
      rows; row_pos, key_pos: i32 positions; all broadcastable to [T, K].
  Returns ``(s, visible)``; ``visible``: bool[T, K].
  """
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  visible = row_ok & (key_pos <= row_pos)
  if sliding_window is not None:
    visible &= key_pos > row_pos - sliding_window
  return s, visible


def block_update(carry, s, visible, v):
  """Folds one key block into ``carry = (m, l, acc)``.

  Args:
    s: f32[T, K] scores; visible: bool[T, K]; v: f32[K, D] values (rows past
      the sequence zeroed by the caller: page tails may hold NaN).
  """
  m, l, acc = carry
  s = jnp.where(visible, s, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp(m - m_safe)
  p = jnp.where(visible, jnp.exp(s - m_safe), 0.0)
  l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
  acc = alpha * acc + jnp.dot(p, v, precision=_EXACT, preferred_element_type=jnp.float32)
  return m_new, l, acc


def finish(l, acc):
  """f32[T, D] attention output; rows that saw no key are 0."""
  l_safe = jnp.where(l > 0, l, 1.0)
  return jnp.where(l > 0, acc / l_safe, 0.0)
