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
per client) are there for a policy that sets k by them:
``AdaptiveDraft(inner, k_max, step_ms_fixed, step_ms_per_row)`` picks one
k per iteration for the plan's decode rows by expected goodput (SmartSpec,
Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large
Language Models Using Goodput"), each row's acceptance its client's learned
rate; with ``per_row=True`` a k per decode row, each at its request's own
learned rate.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from scheduler import ledger as base
from scheduler import records as rec
from scheduler.wrapper import PolicyWrapper


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
class FixedDraft(PolicyWrapper):
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

  def __call__(self, manifest: rec.WorkloadManifest, state: rec.SchedulerState,
               view: rec.AllocatorView) -> rec.IterationPlan:
    plan = self.inner(manifest, state, view)
    plan = grant_drafts(plan, manifest, state, view,
                        jnp.full(plan.selected.shape, self.k, jnp.int32), self.watermark_pages())
    return plan.replace(policy_id=self.policy_id, policy=self)


def client_acceptance(manifest: rec.WorkloadManifest, state: rec.SchedulerState,
                      prior_alpha: float, prior_drafts: float):
  """f32[R]: each slot's client's per-token acceptance estimate: accepted
  drafts over accepted drafts plus rejections (``SchedulerState.client_*``;
  a verified row is Bernoulli trials up to its first failure, so this is
  the maximum-likelihood estimate, where accepted / verified drafts would
  count every draft after a rejection as one), with ``prior_drafts``
  pseudo-trials at ``prior_alpha`` added (the prior until the client's
  drafts outweigh it)."""
  if state.client_draft_rejections is None:
    return jnp.full(manifest.client.shape, prior_alpha, jnp.float32)
  accepted = state.client_accepted_tokens[manifest.client].astype(jnp.float32)
  rejected = state.client_draft_rejections[manifest.client].astype(jnp.float32)
  return (accepted + prior_alpha * prior_drafts) / (accepted + rejected + prior_drafts)


def request_acceptance(manifest: rec.WorkloadManifest, state: rec.SchedulerState,
                       prior_alpha: float, prior_drafts: float):
  """f32[R]: each slot's own per-token acceptance estimate, as
  ``client_acceptance`` over the request's own drafts
  (``SchedulerState.accepted_tokens`` / ``draft_rejections``) with its
  client's estimate as the prior (``prior_drafts`` pseudo-trials): a new
  request starts at its client's rate and moves to its own."""
  client = client_acceptance(manifest, state, prior_alpha, prior_drafts)
  if state.draft_rejections is None:
    return client
  accepted = state.accepted_tokens.astype(jnp.float32)
  rejected = state.draft_rejections.astype(jnp.float32)
  return (accepted + client * prior_drafts) / (accepted + rejected + prior_drafts)


def per_row_drafts(alpha, room, decode, rank, emits_other, other_rows, k_max: int,
                   step_ms_fixed: float, step_ms_per_row: float):
  """i32[R]: drafts per decode row maximizing the plan's expected goodput
  (tokens per ms, as ``expected_goodput``) when each row may take its own
  count, up to ``min(k_max, room)``.

  Row i's j-th draft adds ``alpha_i^j`` expected tokens and one row
  (``step_ms_per_row``), and a row's gains fall with j. For a ratio
  ``(a + sum of gains) / (b + c * n)`` the best set of n drafts is the n
  largest gains, so the optimum is the best prefix of all gains sorted in
  descending order (ties: the higher-ranked row, then the lower j; the
  shorter prefix on equal goodput). A uniform k is one such set, so this
  is at least as good as ``AdaptiveDraft``'s best k.

  Args:
    alpha: f32[R]; room: i32[R] drafts a row may take; decode: bool[R];
      rank: i32[R] the plan's order; emits_other, other_rows: f32[] as
      ``expected_goodput``; k_max: static.
  """
  num_slots = alpha.shape[0]
  j = jnp.arange(1, k_max + 1, dtype=jnp.int32)
  ok = decode[:, None] & (j[None, :] <= jnp.minimum(room, k_max)[:, None])
  gain = jnp.where(ok, alpha[:, None] ** j[None, :].astype(jnp.float32), -1.0).reshape(-1)
  row = jnp.repeat(jnp.arange(num_slots, dtype=jnp.int32), k_max)
  order = jnp.lexsort((jnp.tile(j, num_slots), rank[row], -gain))
  sorted_gain = gain[order]
  base_tokens = emits_other + jnp.sum(decode).astype(jnp.float32)
  n = jnp.arange(1, gain.shape[0] + 1, dtype=jnp.float32)
  goodput = jnp.concatenate([
      (base_tokens / (step_ms_fixed + step_ms_per_row * other_rows))[None],
      (base_tokens + jnp.cumsum(jnp.maximum(sorted_gain, 0.0)))
      / (step_ms_fixed + step_ms_per_row * (other_rows + n))])
  goodput = jnp.where(jnp.concatenate([jnp.ones((1,), bool), sorted_gain >= 0]), goodput,
                      -jnp.inf)
  best = jnp.argmax(goodput)               # the first (shortest) of equal maxima
  taken = jnp.arange(gain.shape[0]) < best
  return jnp.zeros((num_slots,), jnp.int32).at[row[order]].add(taken.astype(jnp.int32))


def expected_goodput(alpha, room, decode, emits_other, other_rows, k: int,
                     step_ms_fixed: float, step_ms_per_row: float):
  """f32[]: expected tokens per ms of a plan whose decode rows verify k
  drafts each (fewer where ``room`` caps them).

  A row verifying k' drafts accepted independently at per-token rate
  alpha emits ``sum_{j=0}^{k'} alpha^j = (1 - alpha^(k'+1)) / (1 - alpha)``
  tokens in expectation (SmartSpec, Liu et al. 2024); the step takes
  ``step_ms_fixed + step_ms_per_row * rows``.

  Args:
    alpha: f32[R] acceptance; room: i32[R] drafts a row may take; decode:
      bool[R] the plan's decode rows; emits_other: f32[] tokens the plan's
      other rows emit; other_rows: f32[] the plan's rows before drafts;
      k: static drafts per decode row.
  """
  kk = jnp.where(decode, jnp.minimum(k, room), 0)
  powers = alpha[:, None] ** jnp.arange(k + 1, dtype=jnp.float32)[None, :]
  tokens = jnp.sum(jnp.where(jnp.arange(k + 1)[None, :] <= kk[:, None], powers, 0.0), axis=1)
  emitted = emits_other + jnp.sum(jnp.where(decode, tokens, 0.0))
  rows = other_rows + jnp.sum(kk).astype(jnp.float32)
  return emitted / (step_ms_fixed + step_ms_per_row * rows)


@dataclasses.dataclass(frozen=True)
class AdaptiveDraft(PolicyWrapper):
  """Wraps ``inner``; each iteration offers every decode row the one k in
  [0, ``k_max``] that maximizes the plan's expected goodput
  (``expected_goodput``: tokens emitted per ms of a step time linear in
  its rows), with each row's acceptance its client's learned rate
  (``client_acceptance``); ties go to the smaller k. Then as
  ``FixedDraft`` with that k (``grant_drafts``). With ``per_row`` each
  decode row gets its own count instead (``per_row_drafts``), from the
  request's own learned rate (``request_acceptance``).

  Attributes:
    inner: a registered policy.
    k_max: the most drafts per decode row (>= 1).
    step_ms_fixed: ms of a step whatever its rows (> 0).
    step_ms_per_row: ms per token row (>= 0).
    prior_alpha: the acceptance assumed before drafts were seen, in (0, 1).
    prior_drafts: the pseudo-drafts it weighs as (> 0).
    per_row: a k per decode row (True) or one for the plan (False).

  Raises:
    ValueError: a field outside its range, naming it.
  """

  inner: object
  k_max: int
  step_ms_fixed: float
  step_ms_per_row: float
  prior_alpha: float = 0.5
  prior_drafts: float = 16.0
  per_row: bool = False

  def __post_init__(self):
    checks = (("k_max", self.k_max >= 1, ">= 1"),
              ("step_ms_fixed", self.step_ms_fixed > 0, "> 0"),
              ("step_ms_per_row", self.step_ms_per_row >= 0, ">= 0"),
              ("prior_alpha", 0 < self.prior_alpha < 1, "in (0, 1)"),
              ("prior_drafts", self.prior_drafts > 0, "> 0"))
    for name, ok, rule in checks:
      if not ok:
        raise ValueError(f"AdaptiveDraft.{name} must be {rule}, got {getattr(self, name)!r}")

  @property
  def policy_id(self) -> str:
    return f"{self.inner.policy_id}+adaptive_{self.k_max}" + ("_per_row" if self.per_row else "")

  def choose_k(self, plan: rec.IterationPlan, manifest: rec.WorkloadManifest,
               state: rec.SchedulerState):
    """i32[]: the k in [0, k_max] of the highest expected goodput for
    ``plan``'s decode rows (the smallest on ties)."""
    decode = plan.selected & (plan.kind == rec.DECODE_ROW)
    room = jnp.maximum(manifest.max_tokens - state.emitted - 1, 0)
    alpha = client_acceptance(manifest, state, self.prior_alpha, self.prior_drafts)
    last_chunk = plan.selected & (plan.kind == rec.PREFILL_CHUNK) & (
        plan.end == manifest.prompt_len)
    emits_other = jnp.sum(last_chunk).astype(jnp.float32)
    other_rows = jnp.asarray(plan.num_tokens, jnp.float32)
    goodput = jnp.stack([
        expected_goodput(alpha, room, decode, emits_other, other_rows, k,
                         self.step_ms_fixed, self.step_ms_per_row)
        for k in range(self.k_max + 1)])
    return jnp.argmax(goodput).astype(jnp.int32)

  def __call__(self, manifest: rec.WorkloadManifest, state: rec.SchedulerState,
               view: rec.AllocatorView) -> rec.IterationPlan:
    plan = self.inner(manifest, state, view)
    if self.per_row:
      want = self.choose_per_row(plan, manifest, state)
    else:
      want = jnp.full(plan.selected.shape, self.choose_k(plan, manifest, state), jnp.int32)
    plan = grant_drafts(plan, manifest, state, view, want, self.watermark_pages())
    return plan.replace(policy_id=self.policy_id, policy=self)

  def choose_per_row(self, plan: rec.IterationPlan, manifest: rec.WorkloadManifest,
                     state: rec.SchedulerState):
    """i32[R]: each decode row's drafts of the highest expected goodput
    (``per_row_drafts``) at its request's learned rate."""
    decode = plan.selected & (plan.kind == rec.DECODE_ROW)
    room = jnp.maximum(manifest.max_tokens - state.emitted - 1, 0)
    alpha = request_acceptance(manifest, state, self.prior_alpha, self.prior_drafts)
    last_chunk = plan.selected & (plan.kind == rec.PREFILL_CHUNK) & (
        plan.end == manifest.prompt_len)
    return per_row_drafts(alpha, room, decode, plan.rank,
                          jnp.sum(last_chunk).astype(jnp.float32),
                          jnp.asarray(plan.num_tokens, jnp.float32), self.k_max,
                          self.step_ms_fixed, self.step_ms_per_row)
