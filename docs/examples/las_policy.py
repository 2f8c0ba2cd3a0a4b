"""Least attained service first: a policy with a counter of its own.

Each request's attained service, the token rows it completed in its slot,
is the policy's own state: a ``PerSlot`` column that restarts at 0 when a
new request arrives in the slot. ``update`` (called by ``apply`` with the
completed result) adds the rows each completed interval ran, so a failed
interval adds nothing; ``plan`` reads the counter and orders by it, fewest
rows first (LAS, or foreground-background scheduling, Kleinrock 1976).

  .venv/bin/python scripts/replay.py --executor=simulated \\
      --policy=docs/examples/las_policy.py:LeastAttainedService
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from scheduler import ledger as base
from scheduler import records as rec


@flax.struct.dataclass
class Attained:
  """The policy's state (``SchedulerState.policy_state``).

  Attributes:
    rows: i32 PerSlot, token rows the slot's request completed.
  """

  rows: rec.PerSlot


@dataclasses.dataclass(frozen=True)
class LeastAttainedService(base.PolicyBase):
  """Fewest completed token rows first, on the shared ledger.

  Attributes:
    budgets: iteration budgets (token rows, sequences, prefill chunk).
  """

  budgets: base.Budgets
  policy_id: str = "las"
  version: str = "1"
  tie_break: tuple = ("work_rank", "attained_rows", "arrival_seq", "request_id",
                      "generation")

  def init_state(self, num_slots: int, num_clients: int) -> Attained:
    del num_clients
    return Attained(rows=rec.PerSlot.full(num_slots, 0))

  def sort_keys(self, manifest, state, view=None) -> jax.Array:
    """i32[R, 5]: the recorded key, columns ``tie_break``."""
    rows = self.own_state(state).rows.value
    return base.identity_keys(manifest, state, base.work_rank(manifest, state), rows)

  def plan(self, manifest, state, alloc):
    return base.greedy_plan(self, manifest, state, alloc, self.sort_keys(manifest, state))

  def update(self, manifest, state, plan, result, successor) -> Attained:
    """The state after a completed iteration: + the rows each ran."""
    own = self.own_state(state)
    ran = jnp.where(result.completed & plan.selected, plan.end - plan.start, 0)
    return own.replace(rows=own.rows.replace(value=own.rows.value + ran))
