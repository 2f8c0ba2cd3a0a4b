"""ORCA Algorithm 1: iteration-level FCFS with max-token reservation (§0x03).

Every request with legal work is offered in arrival order. A request that
has not started (INITIATION) reserves the KV rows of its whole trajectory,
``prompt + max_tokens - 1`` (``records.kv_rows``: the last output is never
fed back), as pages when it is selected; if that reservation, its whole prompt (ORCA does
not chunk) or the sequence budget (``max_bs``) does not fit, selection
*breaks*: no younger request is admitted ahead of it. The reservation is
released when the request finishes (it is derived from the running set, so
it leaves with it). Because every running request holds pages for its whole
trajectory, decode rows never need a preemption.

A prompt wider than the token budget, or a trajectory larger than the whole
cache, can never be selected: it stays blocked (and blocks younger waiting
requests, as the paper's ``break`` does) and is reported in
``IterationPlan.unschedulable`` so the host can reject it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from scheduler import ledger as base
from scheduler import records as rec


@dataclasses.dataclass(frozen=True)
class Orca(base.PolicyBase):
  """ORCA Select(): FCFS, reservation at initiation, ``break`` not skip.

  Attributes:
    budgets: token budget, ``max_bs`` = ``seq_budget``; ``chunk_cap`` unused.
  """

  budgets: base.Budgets
  policy_id: str = "orca"
  version: str = "1"
  tie_break: tuple = ("work_rank", "arrival_seq", "request_id", "generation")

  def sort_keys(self, manifest, state, view=None):
    """i32[R, 4]: (work_rank, arrival_seq, request_id, generation)."""
    return base.identity_keys(manifest, state, base.work_rank(manifest, state))

  def reserve_rows(self, manifest, state):
    """i32[R]: rows reserved at initiation: the whole trajectory's KV rows,
    ``prompt + max_tokens - 1`` (ORCA reserves max_tokens; ``kv_rows``), or
    the §0x06 forecast of ``budgets.reservation`` (``reservation_rows``)."""
    return base.reservation_rows(manifest, state, self.budgets,
                                 rec.prefill_target(manifest, state),
                                 rec.kv_rows(manifest.prompt_len, manifest.max_tokens))

  def unschedulable(self, manifest, state, alloc):
    """bool[R]: live requests this policy can never select."""
    f = base.work_facts(manifest, state)
    wide = f.waiting & (f.target - state.computed > self.budgets.token_budget)
    total_pages = alloc.free_pages + jnp.sum(alloc.pages_held)
    big = f.waiting & (base.pages_for(self.reserve_rows(manifest, state),
                                      alloc.page_size) > total_pages)
    return wide | big

  def plan(self, manifest, state, alloc):
    keys = self.sort_keys(manifest, state)
    order = base.key_order(keys)
    x, c = base.ledger(manifest, state, alloc, self.budgets, order,
                       reserve_rows=self.reserve_rows(manifest, state), whole_prefill=True)
    c = base.greedy_scan(x, c, order, fcfs_break=True)
    return base.finish_plan(manifest, state, x, c, keys, order, self,
                            unschedulable=self.unschedulable(manifest, state, alloc))
