"""Speculative decoding as a plan decision: how many draft tokens each
decode row verifies (``IterationPlan.num_draft``).

``FixedDraft(inner, k)`` plans with ``inner`` (any registered policy: its
keys, tie-break, state and ``update`` are kept) and then offers each
selected decode row, in the plan's rank order, up to ``k`` drafts: no more
than its output cap leaves (``max_tokens - e - 1``: every verified token
may be emitted), than the token budget has rows left after the plan's own
rows, and than the free pages cover after the plan's own allocation and
the policy's watermark (a draft row may take a page; the executor gives
back pages only rejected rows reached). A row that gets none stays an
ordinary decode row. The acceptance facts ``apply`` learns
(``SchedulerState.draft_tokens`` / ``accepted_tokens``, per request and
per client) are there for a policy that sets k by them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from scheduler import ledger as base
from scheduler import records as rec


def grant_drafts(plan: rec.IterationPlan, manifest: rec.WorkloadManifest,
                 state: rec.SchedulerState, view: rec.AllocatorView, want,
                 watermark_pages: int = 0) -> rec.IterationPlan:
  """``plan`` with ``want`` (i32[R]) drafts granted, in rank order, to its
  selected decode rows as far as the output caps, the token budget and the
  free pages allow (see the module docstring); the intervals, the token
  ledger and ``num_draft`` updated."""
  num_slots = plan.selected.shape[0]
  ps = view.page_size
  decode = plan.selected & (plan.kind == rec.DECODE_ROW)
  room = jnp.maximum(manifest.max_tokens - state.emitted - 1, 0)
  want = jnp.where(decode, jnp.minimum(jnp.maximum(want, 0), room), 0).astype(jnp.int32)
  held = view.pages_held
  reclaim = held if view.reclaimable_pages is None else view.reclaimable_pages
  own = jnp.where(plan.selected, jnp.maximum(base.pages_for(plan.end, ps) - held, 0), 0)
  pages_left = (view.free_pages + jnp.sum(jnp.where(plan.preempt, reclaim, 0))
                - jnp.sum(own) - watermark_pages)
  rows_left = plan.token_budget - plan.num_tokens
  order = jnp.argsort(jnp.where(plan.selected, plan.rank, num_slots + jnp.arange(num_slots)))

  def grant(carry, s):
    rows_left, pages_left = carry
    covered = jnp.maximum(held[s], base.pages_for(plan.end[s], ps))
    fit = (covered + jnp.maximum(pages_left, 0)) * ps - plan.end[s]
    g = jnp.clip(jnp.minimum(want[s], jnp.minimum(rows_left, fit)), 0)
    extra = jnp.maximum(base.pages_for(plan.end[s] + g, ps) - covered, 0)
    return (rows_left - g, pages_left - extra), g

  _, granted = jax.lax.scan(grant, (rows_left, pages_left), order)
  k = jnp.zeros((num_slots,), jnp.int32).at[order].set(granted.astype(jnp.int32))
  return plan.replace(end=plan.end + k, num_draft=k,
                      num_tokens=(plan.num_tokens + jnp.sum(k)).astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class FixedDraft:
  """Wraps ``inner``; offers every decode row ``k`` draft tokens.

  Attributes:
    inner: a registered policy.
    k: drafts offered per decode row (>= 1).

  Raises:
    ValueError: ``k < 1``.
  """

  inner: object
  k: int

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"FixedDraft.k must be >= 1, got {self.k}")

  @property
  def policy_id(self) -> str:
    return f"{self.inner.policy_id}+draft_{self.k}"

  @property
  def version(self) -> str:
    return self.inner.version

  @property
  def budgets(self):
    return self.inner.budgets

  @property
  def tie_break(self):
    return self.inner.tie_break

  def sort_keys(self, manifest, state, view=None):
    keyer = getattr(self.inner, "sort_keys", None)
    if keyer is None:
      return base.sort_keys(manifest, state)
    return keyer(manifest, state, view)

  def init_state(self, num_slots, num_clients):
    init = getattr(self.inner, "init_state", None)
    return None if init is None else init(num_slots, num_clients)

  def update(self, manifest, state, plan, result, successor):
    update = getattr(self.inner, "update", None)
    if update is None:
      return successor.policy_state
    return update(manifest, state, plan, result, successor)

  def __call__(self, manifest: rec.WorkloadManifest, state: rec.SchedulerState,
               view: rec.AllocatorView) -> rec.IterationPlan:
    plan = self.inner(manifest, state, view)
    budgets = getattr(self.inner, "budgets", None)
    watermark = 0 if budgets is None else budgets.watermark_pages
    plan = grant_drafts(plan, manifest, state, view,
                        jnp.full(plan.selected.shape, self.k, jnp.int32), watermark)
    return plan.replace(policy_id=self.policy_id, policy=self)
