"""Fairness ledgers of §0x09A: the VTC counter bound, backlogged service gap
and the starvation predicate. Plain host-side functions (no jit)."""

from __future__ import annotations

from typing import Sequence


def vtc_max_increment(w_p: int, w_q: int, max_input_tokens: int,
                      max_batch_tokens: int) -> int:
  """U = max(w_p * L_input, w_q * M): the largest one-step counter jump."""
  return max(w_p * max_input_tokens, w_q * max_batch_tokens)


def vtc_service_bound(w_p: int, w_q: int, max_input_tokens: int,
                      max_batch_tokens: int) -> int:
  """2U: VTC Theorem 4.4's bound on |W_f - W_g| for two clients backlogged
  over the whole interval (only under the theorem's premises)."""
  return 2 * vtc_max_increment(w_p, w_q, max_input_tokens, max_batch_tokens)


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
