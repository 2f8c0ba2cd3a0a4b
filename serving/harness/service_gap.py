"""Fairness figures of §0x09A over cumulative service ledgers, cut by cut.

The plain definitions the report's fairness figures are checked against
(``serving.harness.metrics.client_service_gap``, the ledger's starvation
count): the backlogged service gap between two clients and the starvation
predicate. Host-side functions (no jit).
"""

from __future__ import annotations

from typing import Sequence


def max_backlogged_gap(service_a: Sequence[int], service_b: Sequence[int],
                       backlogged: Sequence[bool]) -> int:
  """max |W_a(t) - W_b(t)| over the cuts where both clients are backlogged."""
  gaps = [abs(a - b) for a, b, on in zip(service_a, service_b, backlogged) if on]
  return max(gaps, default=0)


def starved(eligible_throughout: bool, completed_events: int) -> bool:
  """Starved(g, [t1, t2]) = EligibleThroughout and CompletedEvents == 0.

  A group that was not continuously eligible (blocked on a foreign fact, or
  with no offered work) is not starved, whatever it completed.
  """
  return bool(eligible_throughout) and completed_events == 0
