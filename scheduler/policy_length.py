"""Length-aware policies with aging: SJF, SRPT and shortest-prefill-first.

Each orders the requests by a length score in token rows (smaller first),
aged by waiting time, and walks that order on the shared ledger
(``scheduler.ledger``) with an FCFS ``break``: a waiting request that does
not fit blocks the ones after it, so a long request at the head of the order
is never overtaken for pages.

* ``sjf`` (shortest job first, non-preemptive; SSJF of Qiu et al. 2024,
  "Efficient Interactive LLM Serving with Proxy Model-based Sequence Length
  Prediction", with the predictor below instead of a proxy model): started
  requests (running, or waiting after a preemption) first, then waiting
  ones by predicted output length ``G_hat``.
* ``srpt`` (shortest remaining processing time, Schrage 1968, "A proof of
  the optimality of the shortest remaining processing time discipline"):
  every request, started or not, by its predicted remaining rows
  ``max(G_hat - e, 1) + (target - c)``: outputs still to come (at least one:
  a request that outlived its prediction looks nearly done) plus prompt or
  rebuild rows still to compute.
* ``spf`` (shortest prefill first): by prompt (or rebuild) rows still to
  compute, ``target - c``: decode rows (0 left) first, then the shortest
  remaining prefill. Reads no prediction.

The prediction (§0x06): ``G_hat`` is the ceil-mean output length of the
requests of the same client that completed in this run
(``SchedulerState.client_completed_*``, written by ``apply`` when a request
ends); a client with no completed request takes the mean over all clients;
before any request completed, the declared ``max_tokens``. Always clipped to
``[1, max_tokens]``. It is a scheduler fact learned from ended requests
only: the realized length of a live request is never read.

Aging (§0x09A): the key is ``score - floor(wait_ms / aging_ms)`` with
``wait_ms`` the time since original arrival on the state clock: the key
improves by one row per ``aging_ms`` waited. Every request ages at the same
rate, so the order is by the virtual deadline ``arrival_ms + aging_ms *
score`` (up to the floor): a request is overtaken only by requests that
arrived less than ``aging_ms * (its score - theirs)`` after it, so none
waits forever (``starvation_free``). ``aging_ms = 0`` turns aging off (pure
length order, which can starve a long request under a stream of short ones).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from scheduler import ledger as base
from scheduler import records as rec

_KEY_CLIP = 2**30  # keys stay well inside i32


def _ceil_mean(total, count):
  return (total + count - 1) // jnp.maximum(count, 1)


def predicted_outputs(manifest: rec.WorkloadManifest, state: rec.SchedulerState):
  """i32[R]: G_hat, the predicted total outputs of each slot's request.

  The ceil-mean output length of the client's completed requests, else of
  all clients' completed requests, else the declared ``max_tokens``;
  clipped to ``[1, max_tokens]``. A state built without the per-client
  counters (``client_completed_*`` None) predicts ``max_tokens``.
  """
  cap = jnp.maximum(manifest.max_tokens, 1)
  count, outputs = state.client_completed_requests, state.client_completed_outputs
  if count is None or outputs is None:
    return cap.astype(jnp.int32)
  own_n, own_sum = count[manifest.client], outputs[manifest.client]
  all_n, all_sum = jnp.sum(count), jnp.sum(outputs)
  guess = jnp.where(own_n > 0, _ceil_mean(own_sum, own_n),
                    jnp.where(all_n > 0, _ceil_mean(all_sum, all_n), cap))
  return jnp.clip(guess, 1, cap).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _LengthAware(base.PolicyBase):
  """Shared walk: key order by (work_rank, [leading], aged score, identity).

  Attributes:
    budgets: iteration budgets.
    aging_ms: ms of waiting that take one row off the score; 0 = no aging.
  """

  budgets: base.Budgets
  aging_ms: float = 20.0

  def __post_init__(self):
    if not self.aging_ms >= 0:
      raise ValueError(f"{type(self).__name__}.aging_ms must be >= 0, got {self.aging_ms!r}")

  @property
  def starvation_free(self) -> bool:
    """Declared to ``scheduler.conformance``: aging bounds every wait."""
    return self.aging_ms > 0

  def score(self, manifest, state):
    """i32[R]: the length score in token rows (smaller runs first)."""
    raise NotImplementedError

  def leading(self, manifest, state):
    """i32[R] columns between work_rank and the aged score."""
    return ()

  def aged_score(self, manifest, state):
    """i32[R]: score - floor((now_ms - arrival_ms) / aging_ms)."""
    score = self.score(manifest, state)
    if self.aging_ms > 0:
      wait = jnp.maximum(state.now_ms - manifest.arrival_ms, 0.0)
      score = score - jnp.minimum(jnp.floor(wait / self.aging_ms), _KEY_CLIP)
    return jnp.clip(score, -_KEY_CLIP, _KEY_CLIP).astype(jnp.int32)

  def sort_keys(self, manifest, state, view=None):
    return base.identity_keys(manifest, state, base.work_rank(manifest, state),
                              *self.leading(manifest, state),
                              self.aged_score(manifest, state))

  def plan(self, manifest, state, alloc):
    return base.greedy_plan(self, manifest, state, alloc, self.sort_keys(manifest, state))


@dataclasses.dataclass(frozen=True)
class ShortestJobFirst(_LengthAware):
  """SJF on the predicted output length; started requests keep going first."""

  policy_id: str = "sjf"
  version: str = "1"
  tie_break: tuple = ("work_rank", "not_started", "aged_predicted_outputs",
                      "arrival_seq", "request_id", "generation")

  def leading(self, manifest, state):
    started = (state.status == rec.RUNNING) | (state.emitted >= 1)
    return ((~started).astype(jnp.int32),)

  def score(self, manifest, state):
    return predicted_outputs(manifest, state)


@dataclasses.dataclass(frozen=True)
class ShortestRemainingFirst(_LengthAware):
  """SRPT on predicted remaining outputs plus prompt/rebuild rows left."""

  policy_id: str = "srpt"
  version: str = "1"
  tie_break: tuple = ("work_rank", "aged_remaining_rows", "arrival_seq",
                      "request_id", "generation")

  def score(self, manifest, state):
    outputs_left = jnp.maximum(predicted_outputs(manifest, state) - state.emitted, 1)
    rows_left = jnp.maximum(rec.prefill_target(manifest, state) - state.computed, 0)
    return outputs_left + rows_left


@dataclasses.dataclass(frozen=True)
class ShortestPrefillFirst(_LengthAware):
  """Shortest remaining prefill (prompt or rebuild rows) first."""

  policy_id: str = "spf"
  version: str = "1"
  tie_break: tuple = ("work_rank", "aged_prefill_rows", "arrival_seq",
                      "request_id", "generation")

  def score(self, manifest, state):
    return jnp.maximum(rec.prefill_target(manifest, state) - state.computed, 0)
