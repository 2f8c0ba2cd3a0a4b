"""Sarathi-Serve (Algorithm 3 shape, §0x09): the engine's default policy.

Running decode rows first, then ongoing partial prefills with ``c =
min(remaining, chunk_cap, tau - n_t)``, then new admissions in FCFS order,
under a token budget ``tau`` and a separate sequence budget (§0x05). Under
KV pressure a decode row that cannot get a page preempts the latest
(priority, arrival) running request for recompute (``victim_rank``, §0x0C,
§0x0D). Phase rank leads the default key (``scheduler.keys.sort_keys``), so
one greedy walk of the shared ledger in key order offers running decode rows
first, then ongoing partial prefills, then FCFS admissions with ``break``
(a waiting head that does not fit blocks younger ones).
"""

from __future__ import annotations

import dataclasses

from scheduler import ledger as base
from scheduler import records as rec


@dataclasses.dataclass(frozen=True)
class SarathiServe(base.PolicyBase):
  """Sarathi-Serve: decode-first, partial prefill, then FCFS admission."""

  budgets: base.Budgets
  policy_id: str = "sarathi_serve"
  version: str = "1"
  tie_break: tuple = rec.SORT_KEY_FIELDS

  def plan(self, manifest, state, alloc):
    return base.greedy_plan(self, manifest, state, alloc, base.sort_keys(manifest, state))
