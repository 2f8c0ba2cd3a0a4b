"""Admission under unknown output length (§0x06).

One home for the reservation arithmetic, in jnp so the engine's jitted
policies run it (``scheduler.ledger.ledger`` reads it through
``reservation_rows``) and the host records below reuse it:

* ``forecast_outputs``: G_hat per request from online facts only: the
  declared ``max_tokens`` ("max"), or an estimator over the output lengths
  of requests already completed in this run (``completed_outputs``, a
  histogram kept in ``SchedulerState`` by ``scheduler.apply``): its
  ceil-mean ("point", estimator ``mean_completed``) or its nearest-rank
  quantile ("quantile" / "watermark", estimator ``p90_completed`` for
  q = 0.9); the declared maximum before any request completed. Always
  clipped to ``[1, max_tokens]``. The realized length of a live request is
  never read.
* ``append_rows``: A_hat = U + max(G_hat - max(E, 1), 0): for a request that
  has emitted E >= 1 outputs, ``max(G_hat - E, 0)``; for an unstarted one,
  ``U + max(G_hat - 1, 0)`` (prefill emits output 1; §0x05). U counts the
  prompt (or rebuild) rows still to compute.
* ``soft_ceiling`` (C_hard - W) and ``admits`` (R + A_hat <= C_soft).

The article's host-level records of the same arithmetic (reservation
estimates, allocation requests and results) are test fixtures
(``tests/scheduler/article_admission.py``); the engine builds none. In the
engine an extension is the decode row that crosses a request's reserved
frontier (``IterationPlan.extend``), and a refused extension is handled by
the ledger's victim rule.
"""

from __future__ import annotations

import jax.numpy as jnp

from scheduler import scan

POLICY_KINDS = ("max", "point", "quantile", "watermark")
# The engine's kinds: "policy" keeps each policy's published rule (ORCA
# reserves the declared maximum; the others allocate output rows on demand).
ENGINE_KINDS = ("policy",) + POLICY_KINDS


def estimator_name(kind: str, quantile: float = 0.9) -> str:
  """Name of the online G_hat estimator of ``kind`` (reported per replay)."""
  if kind == "point":
    return "mean_completed"
  if kind in ("quantile", "watermark"):
    return f"p{round(quantile * 100):d}_completed"
  return "declared_max" if kind == "max" else "policy"


def completed_quantile(completed_outputs, quantile: float):
  """i32[]: nearest-rank ``quantile`` of a histogram of completed output
  lengths (``completed_outputs[n]`` = requests that ended with n outputs);
  0 when empty. The smallest n with ``cumsum[n] >= ceil(q * total)``."""
  total = jnp.sum(completed_outputs)
  rank = jnp.maximum(jnp.ceil(quantile * total.astype(jnp.float32)).astype(jnp.int32), 1)
  return jnp.argmax(scan.cumsum_i32(completed_outputs) >= rank).astype(jnp.int32)


def completed_mean(completed_outputs):
  """i32[]: ceil of the mean completed output length (0 when empty)."""
  total = jnp.sum(completed_outputs)
  lengths = jnp.arange(completed_outputs.shape[0], dtype=jnp.int32)
  outputs = jnp.sum(lengths * completed_outputs)
  return jnp.where(total > 0, (outputs + total - 1) // jnp.maximum(total, 1), 0)


def forecast_outputs(kind: str, max_tokens, completed_outputs=None,
                     quantile: float = 0.9):
  """i32[R]: G_hat, the forecast total outputs of each request (§0x06).

  Args:
    kind: one of ``POLICY_KINDS`` (static).
    max_tokens: i32[R], declared output caps.
    completed_outputs: i32[L] histogram of the output lengths of requests
      completed in this run, or None (then every kind falls back to the
      declared maximum).
    quantile: static, the quantile of "quantile" / "watermark".

  Raises:
    ValueError: an unknown kind.
  """
  if kind not in POLICY_KINDS:
    raise ValueError(f"reservation kind must be one of {POLICY_KINDS}, got {kind!r}")
  max_tokens = jnp.asarray(max_tokens, jnp.int32)
  if kind == "max" or completed_outputs is None:
    return max_tokens
  est = (completed_mean(completed_outputs) if kind == "point"
         else completed_quantile(completed_outputs, quantile))
  est = jnp.where(jnp.sum(completed_outputs) > 0, est, max_tokens)
  return jnp.clip(est, 1, jnp.maximum(max_tokens, 1)).astype(jnp.int32)


def append_rows(uncached_rows, emitted, forecast_total):
  """A_hat = U + max(G_hat - max(E, 1), 0) future KV rows (§0x05, §0x06).

  ints or i32 arrays: ``uncached_rows`` U (prompt / rebuild rows still to
  compute), ``emitted`` E, ``forecast_total`` G_hat. The last output is
  never fed back, so a request with G_hat outputs writes ``p + G_hat - 1``
  rows in all.
  """
  return uncached_rows + jnp.maximum(forecast_total - jnp.maximum(emitted, 1), 0)


def soft_ceiling(hard_ceiling, watermark):
  """C_soft = C_hard - W (rows or pages; W is held outside admission)."""
  return hard_ceiling - watermark


def admits(reserved, estimated, ceiling):
  """The FIFO admission predicate ``R + A_hat <= C_soft`` (bool)."""
  return reserved + estimated <= ceiling
