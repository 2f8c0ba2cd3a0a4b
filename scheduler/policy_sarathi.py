"""Original SARATHI: one prefill chunk as the anchor, decode-maximal batching.

(§0x09, SARATHI 2023.) Each iteration takes at most one prefill-like chunk
of at most ``chunk_cap`` rows — the oldest request with prompt (or rebuild)
rows left, running partial prefills and waiting requests alike, by
(priority, arrival) — and piggybacks decode rows in the remaining token and
sequence budget in the same order. A waiting anchor is admitted only if its whole prompt
fits the free pages; if the oldest waiting anchor does not fit, no younger
one overtakes it. With no prefill work the batch is decode-only. A decode
row that finds no page preempts (recompute) the youngest running request.

The anchor order is the recompute-victim order read from the other end
(``policies.victim_rank``: the latest ``(priority, arrival)`` is evicted
first), so the request that ranks first is never both the one the anchor
waits for and the one evicted. With one priority class (the paper's setting)
both are arrival order. Ordering the anchor by arrival alone, an early
low-priority request evicted for a later high-priority one's pages would
take the single prefill slot back to rebuild, find no page at its first
decode, evict itself, and rebuild again, while the other's prefill never got
the slot (a livelock; ``scheduler.conformance.HARD_CASES[1]``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from scheduler import ledger as base


@dataclasses.dataclass(frozen=True)
class Sarathi(base.PolicyBase):
  """SARATHI: ``max_prefills = 1`` anchor chunk, then piggybacked decodes.

  Attributes:
    budgets: ``chunk_cap`` is the chunk size C, ``token_budget`` bounds C
      plus piggybacked decodes, ``seq_budget`` the request slots.
  """

  budgets: base.Budgets
  policy_id: str = "sarathi"
  version: str = "2"
  tie_break: tuple = ("anchor_rank", "priority", "arrival_seq", "request_id",
                      "generation")

  def sort_keys(self, manifest, state, view=None):
    """i32[R, 5]: anchor_rank (0 prefill-like work, 1 decode, 2 none),
    priority, then the identity keys (arrival, id, generation)."""
    f = base.work_facts(manifest, state)
    anchor = jnp.select([f.partial | f.waiting, f.decode | f.resume],
                        [0, 1], 2)
    return base.identity_keys(manifest, state, anchor, manifest.priority)

  def plan(self, manifest, state, alloc):
    keys = self.sort_keys(manifest, state)
    order = base.key_order(keys)
    x, c = base.ledger(manifest, state, alloc, self.budgets, order, max_prefills=1)
    c = base.greedy_scan(x, c, order, fcfs_break=True)
    return base.finish_plan(manifest, state, x, c, keys, order, self)
