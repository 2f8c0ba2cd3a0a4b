"""Earliest TTFT deadline first: the worked example of docs/writing-a-policy.md.

EDF (Liu and Layland 1973) on the first-token SLO of §0x07: a request's
deadline is its original arrival plus its TTFT limit, capped at
``max_ttft_ms`` (a request without an SLO takes the cap), and the earliest
deadline runs first. Every deadline lies at most ``max_ttft_ms`` after its
arrival, so a request is overtaken only by requests that arrived less than
``max_ttft_ms`` after it: none waits forever.

  .venv/bin/python scripts/replay.py --executor=simulated \\
      --policy=docs/examples/edf_policy.py:EarliestDeadlineFirst
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from scheduler import ledger as base
from scheduler import records as rec


@dataclasses.dataclass(frozen=True)
class EarliestDeadlineFirst(base.PolicyBase):
  """Earliest TTFT deadline first, on the shared ledger.

  Attributes:
    budgets: iteration budgets (token rows, sequences, prefill chunk).
    max_ttft_ms: the deadline's cap, ms after arrival (> 0).
  """

  budgets: base.Budgets
  max_ttft_ms: float = 2000.0
  policy_id: str = "edf"
  version: str = "1"
  tie_break: tuple = ("work_rank", "deadline_ms", "arrival_seq", "request_id",
                      "generation")
  starvation_free = True  # a class attribute the conformance kit reads

  def __post_init__(self):
    if not self.max_ttft_ms > 0:
      raise ValueError(f"EarliestDeadlineFirst.max_ttft_ms must be > 0, "
                       f"got {self.max_ttft_ms!r}")

  def sort_keys(self, manifest, state, view=None):
    """i32[R, 5]: the recorded key, columns ``tie_break``."""
    ttft_ms, _ = rec.slo_limits(manifest)
    deadline_ms = manifest.arrival_ms + jnp.minimum(ttft_ms, self.max_ttft_ms)
    return base.identity_keys(manifest, state, base.work_rank(manifest, state),
                              jnp.floor(deadline_ms).astype(jnp.int32))

  def plan(self, manifest, state, alloc):
    keys = self.sort_keys(manifest, state)
    order = base.key_order(keys)
    x, c = base.ledger(manifest, state, alloc, self.budgets, order)
    c = base.greedy_scan(x, c, order, fcfs_break=True)
    return base.finish_plan(manifest, state, x, c, keys, order, self)
