"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A request's randomness is ``fold_in(PRNGKey(seed), output_index)``: it
depends only on its own seed and how many tokens it emitted, never on which
other requests share the batch or on the iteration number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _filtered_logits(logits, top_k, top_p):
  """Masks one row [V] to its top-k, then top-p set (-inf elsewhere)."""
  vocab = logits.shape[-1]
  desc = -jnp.sort(-logits)
  kth = desc[jnp.clip(top_k - 1, 0, vocab - 1)]
  k_thresh = jnp.where(top_k > 0, kth, -jnp.inf)
  desc = jnp.where(desc >= k_thresh, desc, -jnp.inf)
  probs = jax.nn.softmax(desc)
  mass_before = jnp.cumsum(probs) - probs
  # The top token always stays: a top_p below float32's range arrives as 0,
  # where ``mass_before < top_p`` would keep none (and id 0 was drawn).
  first = jax.lax.broadcasted_iota(jnp.int32, desc.shape, desc.ndim - 1) == 0
  keep = ((mass_before < top_p) | first) & (desc > -jnp.inf)
  p_thresh = jnp.min(jnp.where(keep, desc, jnp.inf))
  return jnp.where(logits >= jnp.maximum(k_thresh, p_thresh), logits, -jnp.inf)


def greedy_argmax(logits: jax.Array) -> jax.Array:
  """i32[N] index of each row's largest logit, the lowest id on ties.

  The same index as ``jnp.argmax(logits, axis=-1)`` (a NaN counts as the
  largest value, its first occurrence wins), computed as two plain
  reductions: a row max, then the lowest index holding it. XLA:CPU lowers
  ``argmax`` to a variadic (value, index) reduce that it does not
  vectorise; over a 49152-entry vocabulary that took ~10 ms for 32 rows,
  against ~1 ms for this form (docs/benchmarks-log.md "The one-request decode
  step").

  Args:
    logits: f32[N, V].
  """
  top = jnp.max(logits, axis=-1, keepdims=True)
  ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  hit = (logits == top) | jnp.isnan(logits)
  return jnp.min(jnp.where(hit, ids, logits.shape[-1]), axis=-1)


def sample(logits, temperature, top_k, top_p, seed, output_index):
  """Samples one token per row.

  Args:
    logits: f32[N, V].
    temperature: f32[N]; 0 selects greedy argmax (lowest id wins ties).
    top_k: i32[N] (0 = off; 1 is greedy argmax, the same tie-break, at any
      temperature and seed); top_p: f32[N] in (0, 1].
    seed: u32[N] per-request seeds; output_index: i32[N], the index of the
      output token being drawn (= tokens emitted so far).

  Returns:
    i32[N] token ids.
  """
  logits = logits.astype(jnp.float32)
  greedy = greedy_argmax(logits)

  def draw(row, t, k, p, s, i):
    key = jax.random.fold_in(jax.random.PRNGKey(s), i)
    scaled = row / jnp.where(t > 0, t, 1.0)
    return jax.random.categorical(key, _filtered_logits(scaled, k, p)).astype(jnp.int32)

  def sampled(_):
    return jax.vmap(draw)(logits, temperature, top_k, top_p, seed, output_index)

  draws = (temperature > 0) & (top_k != 1)
  drawn = jax.lax.cond(jnp.any(draws), sampled, lambda _: greedy, None)
  return jnp.where(draws, drawn, greedy)


# The most alternatives a request may ask for per token (vLLM's default
# ``max_logprobs``): the device programs always compute this many, so their
# output shapes do not depend on the request.
MAX_LOGPROBS = 20


def raw_logprobs(logits, token, *, k: int = MAX_LOGPROBS):
  """Log-probabilities of the raw model logits (vLLM's default
  ``logprobs_mode="raw_logprobs"``): ``log_softmax`` of each row as the
  model computed it, before the min_tokens stop mask, temperature, top-k
  and top-p; so a token's logprob does not depend on the request's
  sampling parameters. Float32, row by row (a row's values never depend on
  the other rows).

  Args:
    logits: f32[N, V] raw logits.
    token: i32[N] the token whose logprob each row reports (clipped to
      [0, V); the caller ignores rows it does not want).
    k: static, alternatives per row (at most V).

  Returns:
    (chosen f32[N], top_ids i32[N, k], top_logprobs f32[N, k]): the token's
    logprob, and the k most likely tokens in descending order (the lower id
    first on ties, ``lax.top_k``).
  """
  logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  index = jnp.clip(token, 0, logits.shape[-1] - 1)[:, None]
  chosen = jnp.take_along_axis(logprobs, index, axis=-1)[:, 0]
  top, ids = jax.lax.top_k(logprobs, min(k, logits.shape[-1]))
  return chosen, ids.astype(jnp.int32), top
