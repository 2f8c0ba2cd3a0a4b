"""Priority with aging and least predicted slack (§0x07, §0x09A).

* ``priority_aging``: effective priority ``p_eff = p_base - floor((t - a) /
  q_age)`` with ``t`` the state clock and ``a`` the original arrival (ms);
  lower runs first. ``q_age_ms = 0`` disables aging (static priority, which
  can starve a low-priority request under a stream of high-priority ones).
* ``least_slack``: deadline = original arrival + TTFT before the first
  output, previous emission + TBT after it (no clock restarts at admission);
  slack = deadline - predicted finish under the named cost model
  ``exclusive_endpoint_lower_bound_v1`` (remaining prefill chunks, plus one
  decode iteration once an output exists, each ``tick_ms``). Ties break on
  next-token before first-token, then arrival and id (stable).

Both walk their key order and give each request its next legal interval
while the budgets last; a decode row short of a page preempts the running
request latest in the key order.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from scheduler import ledger as base
from scheduler import records as rec

COST_MODELS = ("exclusive_endpoint_lower_bound_v1",)
_SLACK_CLIP_US = 2**30  # exact in f32; ~18 minutes


@dataclasses.dataclass(frozen=True)
class PriorityAging(base.PolicyBase):
  """Priority order with aging; FCFS ``break`` among waiting requests.

  Attributes:
    budgets: iteration budgets.
    q_age_ms: aging quantum (ms) on the state clock; 0 = static priority.
  """

  budgets: base.Budgets
  q_age_ms: float = 1000.0
  policy_id: str = "priority_aging"
  version: str = "1"
  tie_break: tuple = ("work_rank", "effective_priority", "arrival_seq",
                      "request_id", "generation")

  def __post_init__(self):
    if self.q_age_ms < 0:
      raise ValueError(f"PriorityAging.q_age_ms must be >= 0, got {self.q_age_ms}")

  def effective_priority(self, manifest, state):
    """i32[R]: p_base - floor((now_ms - arrival_ms) / q_age_ms)."""
    if self.q_age_ms == 0:
      return manifest.priority
    age = jnp.maximum(state.now_ms - manifest.arrival_ms, 0.0)
    return (manifest.priority - jnp.floor(age / self.q_age_ms)).astype(jnp.int32)

  def sort_keys(self, manifest, state, view=None):
    return base.identity_keys(manifest, state, base.work_rank(manifest, state),
                              self.effective_priority(manifest, state))

  def plan(self, manifest, state, alloc):
    return base.greedy_plan(self, manifest, state, alloc, self.sort_keys(manifest, state))


@dataclasses.dataclass(frozen=True)
class LeastSlack(base.PolicyBase):
  """Least predicted slack first (§0x07 teaching selector as a policy).

  Attributes:
    budgets: iteration budgets (``chunk_cap`` sets the prefill chunks the
      cost model counts).
    tick_ms: predicted duration of one iteration (ms).
    cost_model: named cost model; only ``exclusive_endpoint_lower_bound_v1``.
  """

  budgets: base.Budgets
  tick_ms: float = 10.0
  cost_model: str = "exclusive_endpoint_lower_bound_v1"
  policy_id: str = "least_slack"
  version: str = "1"
  tie_break: tuple = ("work_rank", "slack_us", "first_token", "arrival_seq",
                      "request_id", "generation")

  def __post_init__(self):
    if self.cost_model not in COST_MODELS:
      raise ValueError(f"LeastSlack.cost_model must be one of {COST_MODELS}, "
                       f"got {self.cost_model!r}")
    if not self.tick_ms > 0:
      raise ValueError(f"LeastSlack.tick_ms must be > 0, got {self.tick_ms}")

  def deadline_ms(self, manifest, state):
    """f32[R]: arrival + TTFT before the first output, else last emission + TBT."""
    ttft, tbt = rec.slo_limits(manifest)
    return jnp.where(state.emitted == 0, manifest.arrival_ms + ttft,
                     state.last_token_ms + tbt)

  def predicted_finish_ms(self, manifest, state):
    """f32[R]: now + (remaining prefill chunks + [one decode if e >= 1]) * tick."""
    target = rec.prefill_target(manifest, state)
    chunks = base.pages_for(jnp.maximum(target - state.computed, 0),
                            self.budgets.chunk_cap)
    units = chunks + (state.emitted >= 1).astype(jnp.int32)
    return state.now_ms + units.astype(jnp.float32) * self.tick_ms

  def slack_ms(self, manifest, state):
    """f32[R]: deadline - predicted finish (ms); +inf without an SLO."""
    return self.deadline_ms(manifest, state) - self.predicted_finish_ms(manifest, state)

  def sort_keys(self, manifest, state, view=None):
    slack_us = jnp.clip(jnp.floor(self.slack_ms(manifest, state) * 1000.0),
                        -_SLACK_CLIP_US, _SLACK_CLIP_US)
    first = (state.emitted == 0).astype(jnp.int32)
    return base.identity_keys(manifest, state, base.work_rank(manifest, state),
                              slack_us.astype(jnp.int32), first)

  def plan(self, manifest, state, alloc):
    keys = self.sort_keys(manifest, state)
    order = base.key_order(keys)
    x, c = base.ledger(manifest, state, alloc, self.budgets, order)
    c = base.greedy_scan(x, c, order, fcfs_break=False)
    return base.finish_plan(manifest, state, x, c, keys, order, self)
