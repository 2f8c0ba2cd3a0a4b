"""Speculation as a plan decision (``scheduler.policy_speculative``): drafts
granted in rank order within output caps, the token budget and free pages;
speculating plans pass the conformance kit; plans and results that break
the draft rules are refused."""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

from scheduler import conformance
from scheduler import records as rec
from scheduler import validate
from scheduler.policies import make_policy
from scheduler.policy_speculative import (AdaptiveDraft, FixedDraft, expected_goodput,
                                          grant_drafts, per_row_drafts)
from scheduler.registry import POLICIES

KIT = conformance.PROFILES["fast"]
FAST = ("sarathi_serve", "vtc")      # a stateless and a stateful policy


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[] if n in FAST else [pytest.mark.extended])
    for n in sorted(POLICIES)])
def test_every_registered_policy_conforms_while_speculating(name):
  """The kit's rules hold for each policy wrapped in FixedDraft (its
  executor accepts a fixed pattern of the drafts, and every plan and
  result passes validate's draft rules)."""
  policy = FixedDraft(make_policy(name, KIT.budgets), 2)
  report = conformance.check_policy(policy)
  assert report.policy_id == f"{name}+draft_2"
  assert "plans_validate" in report.rules


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[] if n in FAST else [pytest.mark.extended])
    for n in sorted(POLICIES)])
def test_every_registered_policy_conforms_while_speculating_adaptively(name):
  """As above with AdaptiveDraft (a cheap fixed step: it speculates while
  the prior and the kit's acceptance make drafts pay)."""
  policy = AdaptiveDraft(make_policy(name, KIT.budgets), 3, step_ms_fixed=20.0,
                         step_ms_per_row=0.1)
  report = conformance.check_policy(policy)
  assert report.policy_id == f"{name}+adaptive_3"
  assert "plans_validate" in report.rules


@pytest.mark.parametrize("name", FAST)
def test_policies_conform_with_a_k_per_row(name):
  policy = AdaptiveDraft(make_policy(name, KIT.budgets), 3, step_ms_fixed=20.0,
                         step_ms_per_row=0.1, per_row=True)
  report = conformance.check_policy(policy)
  assert report.policy_id == f"{name}+adaptive_3_per_row"
  assert "plans_validate" in report.rules


def _decode_state(num_slots=4):
  """Four running requests at their decode frontier: prompt 4, emitted
  1, 2, 3 and 1, max_tokens 8, 8, 5 and 8; pages of 4 rows."""
  p = jnp.array([4, 4, 4, 4])
  e = jnp.array([1, 2, 3, 1])
  manifest = rec.empty_manifest(num_slots).replace(
      request_id=jnp.arange(num_slots), prompt_len=p, max_tokens=jnp.array([8, 8, 5, 8]),
      arrival_seq=jnp.arange(num_slots))
  state = rec.initial_state(num_slots, 1).replace(
      status=jnp.full((num_slots,), rec.RUNNING), emitted=e, computed=p + e - 1,
      committed=p + e - 1, ready=jnp.ones((num_slots,), bool))
  return manifest, state


def _plan(manifest, state, token_budget):
  c = state.computed
  return rec.IterationPlan(
      decision_id=state.decision_id, input_state_version=state.state_version,
      selected=jnp.ones((4,), bool), generation=state.generation,
      snapshot_version=state.snapshot_version, start=c, end=c + 1,
      kind=jnp.full((4,), rec.DECODE_ROW), rank=jnp.arange(4),
      admit=jnp.zeros((4,), bool), preempt=jnp.zeros((4,), bool),
      sort_key=jnp.zeros((4, rec.NUM_SORT_KEYS), jnp.int32), num_tokens=jnp.int32(4),
      num_seqs=jnp.int32(4), token_budget=token_budget, seq_budget=4)


def test_drafts_go_in_rank_order_within_caps_budget_and_pages():
  """Hand-worked, pages of 4 rows. Computed frontiers 4, 5, 6, 4; held 1,
  2, 2, 1 pages; the decode rows end at 5, 6, 7, 5, so the plan itself
  takes 2 of the 3 free pages (slots 0 and 3) and 1 is left. Want 3 drafts
  each; slot 2's output cap allows 5 - 3 - 1 = 1. Token budget 11: 7 rows
  left. Rank order: slot 0 takes 3 (rows to 8, in its 2 pages), slot 1
  takes 3 (rows to 9: the last free page), slot 2 takes 1 (rows to 8, in
  its 2 pages), slot 3 none (no rows left)."""
  manifest, state = _decode_state()
  view = rec.AllocatorView(free_pages=jnp.int32(3), pages_held=jnp.array([1, 2, 2, 1]),
                           page_size=4)
  plan = grant_drafts(_plan(manifest, state, 11), manifest, state, view,
                      jnp.full((4,), 3, jnp.int32))
  assert plan.num_draft.tolist() == [3, 3, 1, 0]
  assert (plan.end - plan.start).tolist() == [4, 4, 2, 1]
  assert int(plan.num_tokens) == 11
  violations = validate.plan_violations(manifest, state, plan, view)
  for rule in ("draft", "multi_row_decode", "token_budget", "ledger_drift"):
    assert not violations[rule].any(), rule


@pytest.mark.parametrize("watermark, want", [(0, [3, 3, 1, 3]), (1, [3, 2, 1, 3])])
def test_the_watermark_is_kept_free(watermark, want):
  """As above with 12 rows left: with a watermark of 1 page the last free
  page is kept, so slot 1 stops at the end of its own pages (2 drafts)."""
  manifest, state = _decode_state()
  view = rec.AllocatorView(free_pages=jnp.int32(3), pages_held=jnp.array([1, 2, 2, 1]),
                           page_size=4)
  plan = grant_drafts(_plan(manifest, state, 16), manifest, state, view,
                      jnp.full((4,), 3, jnp.int32), watermark_pages=watermark)
  assert plan.num_draft.tolist() == want


@pytest.mark.parametrize("change, rule", [
    (lambda p: p.replace(num_draft=jnp.array([1, 0, 0, 0])), "multi_row_decode"),
    (lambda p: p.replace(num_draft=jnp.array([5, 0, 0, 0]), end=p.end.at[0].add(5),
                         num_tokens=p.num_tokens + 5), "draft"),
    (lambda p: p.replace(num_draft=jnp.array([-1, 0, 0, 0]), end=p.end.at[0].add(-1),
                         num_tokens=p.num_tokens - 1), "draft"),
])
def test_plans_breaking_the_draft_rules_are_refused(change, rule):
  """A draft needs its row (end = start + 1 + k), k >= 0, and room under
  max_tokens: slot 0 has emitted 1 of 6, so at most 6 - 1 - 1 = 4 drafts."""
  manifest, state = _decode_state()
  manifest = manifest.replace(max_tokens=jnp.array([6, 8, 5, 8]))   # slot 0: k <= 4
  plan = change(_plan(manifest, state, 16))
  violations = validate.plan_violations(manifest, state, plan)
  assert bool(violations[rule][0])
  with pytest.raises(validate.PlanValidationError, match=rule):
    validate.validate_plan(manifest, state, plan)


def test_a_result_emitting_an_unverified_draft_is_refused():
  """A row that verified 1 draft cannot report 2 accepted."""
  manifest, state = _decode_state()
  plan = _plan(manifest, state, 16)
  plan = plan.replace(num_draft=jnp.array([1, 0, 0, 0]), end=plan.end.at[0].add(1),
                      num_tokens=plan.num_tokens + 1)
  from scheduler import iteration
  tokens = jnp.arange(8).reshape(4, 2) + 10
  result = iteration.stop_rules(manifest, state, plan, tokens,
                                is_eos=jnp.zeros((4, 2), bool), verified=jnp.array([1, 0, 0, 0]))
  assert result.accepted.tolist() == [1, 0, 0, 0]
  assert result.tokens[0].tolist() == [10, 11] and result.token.tolist() == [11, 12, 14, 16]
  assert result.completed_end.tolist() == [6, 6, 7, 5]
  assert not validate.any_violation(validate.result_violations(plan, state, manifest, result))
  forged = result.replace(accepted=jnp.array([2, 0, 0, 0]),
                          completed_end=result.completed_end.at[0].add(1))
  violations = validate.result_violations(plan, state, manifest, forged)
  assert bool(violations["unverified"][0])
  with pytest.raises(validate.ResultValidationError, match="unverified"):
    validate.validate_result(plan, state, manifest, forged)


def test_a_stop_inside_the_accepted_drafts_ends_the_request_there():
  """Slot 0 verified 2 drafts; its second token is a stop id: it emits 2
  tokens (accepted 1), finishes 'stop', and its frontier moves 2 rows."""
  manifest, state = _decode_state()
  plan = _plan(manifest, state, 16)
  plan = plan.replace(num_draft=jnp.array([2, 0, 0, 0]), end=plan.end.at[0].add(2),
                      num_tokens=plan.num_tokens + 2)
  from scheduler import iteration
  tokens = jnp.array([[20, 21, 22], [30, 0, 0], [40, 0, 0], [50, 0, 0]])
  stop_ids = jnp.full((4, 2), -1).at[0, 0].set(21)
  result = iteration.stop_rules(manifest, state, plan, tokens,
                                is_eos=jnp.zeros((4, 3), bool), stop_ids=stop_ids,
                                verified=jnp.array([2, 0, 0, 0]))
  assert result.accepted.tolist() == [1, 0, 0, 0]
  assert result.tokens[0].tolist() == [20, 21, -1]
  assert bool(result.finished[0]) and int(result.finish_reason[0]) == rec.FINISH_STOP
  assert int(result.completed_end[0]) == 4 + 2
  np.testing.assert_array_equal(result.service_rows, [2, 1, 1, 1])
  assert not validate.any_violation(validate.result_violations(plan, state, manifest, result))


def test_fixed_draft_refuses_k_below_one():
  with pytest.raises(ValueError, match="FixedDraft.k must be >= 1"):
    FixedDraft(make_policy("fcfs", KIT.budgets) if "fcfs" in POLICIES
               else make_policy("sarathi_serve", KIT.budgets), 0)
  assert dataclasses.is_dataclass(FixedDraft)


def _learned(state, drafts, accepted):
  """``state`` whose one client's drafts were ``accepted`` successes and
  ``drafts - accepted`` rejections (its estimate ``accepted / drafts``)."""
  return state.replace(client_draft_tokens=jnp.array([drafts], jnp.int32),
                       client_accepted_tokens=jnp.array([accepted], jnp.int32),
                       client_draft_rejections=jnp.array([drafts - accepted], jnp.int32))


class _HandPlan:
  """A policy that plans ``_plan``: the four decode rows, budget 64."""

  policy_id, version, budgets, tie_break = "hand", "1", None, None

  def __call__(self, manifest, state, view):
    return _plan(manifest, state, 64)


@pytest.mark.parametrize("drafts, accepted, fixed_ms, row_ms, k_max, want", [
    # alpha ~ 0.01 (the prior of 16 drafts at 0.5 is negligible), fixed
    # 10 ms, 1 ms a row: k=0 gives 4 tokens / (10 + 4) = 0.286 per ms,
    # k=1 4 * 1.01 / (10 + 8) = 0.224.
    (10**6, 10**4, 10.0, 1.0, 4, 0),
    # alpha 0.8 but the rows dominate (0.01 ms fixed, 10 ms a row): k=0
    # 4 / 40.01 = 0.09998, k=1 (3 * 1.8 + 1.8) / 80.01 = 0.090.
    (10**6, 8 * 10**5, 0.01, 10.0, 4, 0),
    # alpha ~ 1 and the fixed cost dominates (100 ms, 0.01 ms a row): k=4
    # gives 5 + 5 + 2 + 5 = 17 tokens (slot 2's cap leaves it 1 draft) in
    # 100.17 ms = 0.170 per ms, k=0 4 / 100.04 = 0.040.
    (10**6, 10**6, 100.0, 0.01, 4, 4),
    # No drafts seen: the prior alpha 0.5. Fixed 10 ms, 1 ms a row: k=0
    # 4 / 14 = 0.286; k=1 4 * 1.5 / 18 = 0.333; k=2 (3 * 1.75 + 1.5) / 21
    # = 0.321 (slot 2 takes 1); k=3 (3 * 1.875 + 1.5) / 24 = 0.297.
    (0, 0, 10.0, 1.0, 4, 1),
])
def test_adaptive_draft_picks_the_k_of_the_highest_expected_goodput(
    drafts, accepted, fixed_ms, row_ms, k_max, want):
  """Four decode rows (output caps leave 6, 5, 1 and 6 drafts), one
  client whose learned acceptance is ``accepted / drafts``; hand-worked
  goodputs in the cases."""
  manifest, state = _decode_state()
  state = _learned(state, drafts, accepted)
  policy = AdaptiveDraft(_HandPlan(), k_max, fixed_ms, row_ms)
  assert int(policy.choose_k(_plan(manifest, state, 64), manifest, state)) == want
  view = rec.AllocatorView(free_pages=jnp.int32(64), pages_held=jnp.array([2, 2, 2, 2]),
                           page_size=4)
  plan = policy(manifest, state, view)
  np.testing.assert_array_equal(plan.num_draft, np.minimum(want, [6, 5, 1, 6]))
  assert plan.policy_id == "hand+adaptive_%d" % k_max
  violations = validate.plan_violations(manifest, state, plan, view)
  for rule in ("draft", "multi_row_decode", "token_budget", "ledger_drift"):
    assert not violations[rule].any(), rule


def test_expected_goodput_equals_the_closed_form():
  """sum_{j<=k} alpha^j = (1 - alpha^(k+1)) / (1 - alpha), over rows."""
  alpha = jnp.array([0.3, 0.9, 0.6])
  for k in range(5):
    got = float(expected_goodput(alpha, jnp.array([9, 9, 9]), jnp.ones(3, bool),
                                 jnp.float32(2.0), jnp.float32(7.0), k, 3.0, 0.5))
    tokens = 2.0 + sum((1 - a ** (k + 1)) / (1 - a) for a in (0.3, 0.9, 0.6))
    assert got == pytest.approx(tokens / (3.0 + 0.5 * (7 + 3 * k)), rel=1e-6)


@pytest.mark.parametrize("field, kwargs, rule", [
    ("k_max", dict(k_max=0), ">= 1"), ("step_ms_fixed", dict(step_ms_fixed=0.0), "> 0"),
    ("step_ms_per_row", dict(step_ms_per_row=-1.0), ">= 0"),
    ("prior_alpha", dict(prior_alpha=1.0), "in (0, 1)"),
    ("prior_drafts", dict(prior_drafts=0.0), "> 0")])
def test_adaptive_draft_refuses_bad_fields_naming_them(field, kwargs, rule):
  args = dict(inner=make_policy("sarathi_serve", KIT.budgets), k_max=4, step_ms_fixed=10.0,
              step_ms_per_row=0.1)
  with pytest.raises(ValueError, match=rf"AdaptiveDraft\.{field} must be {re.escape(rule)}"):
    AdaptiveDraft(**{**args, **kwargs})


def _per_slot_learned(state, drafts, accepted):
  """``state`` whose slots' own drafts were ``accepted`` successes of
  ``drafts`` (lists over the four slots), the client having seen none."""
  drafts, accepted = jnp.array(drafts, jnp.int32), jnp.array(accepted, jnp.int32)
  return state.replace(draft_tokens=drafts, accepted_tokens=accepted,
                       draft_rejections=drafts - accepted)


def test_per_row_drafts_go_to_the_rows_that_accept():
  """Slots' own rates ~0.99, ~0.01, ~0.99 (cap: 1 draft) and ~0.5;
  fixed 10 ms, 1 ms a row. The gains sorted: 0.99, 0.99 (slot 0 j=1, slot
  2 j=1; rank breaks the tie), 0.98, 0.97, 0.96, 0.5 (slot 3 j=1), 0.25,
  ... Goodput with the first n: 4 / 14 = 0.2857; +0.99 -> 4.99 / 15 =
  0.333; +0.99 -> 5.98 / 16 = 0.374; +0.98 -> 6.96 / 17 = 0.409; +0.97 ->
  7.93 / 18 = 0.441; +0.96 -> 8.89 / 19 = 0.468 (slot 0 at k_max 4); +0.5
  -> 9.39 / 20 = 0.470; +0.25 -> 9.64 / 21 = 0.459. So slot 0 takes 4,
  slot 2 its one, slot 3 one, slot 1 none."""
  manifest, state = _decode_state()
  n = 10**6
  state = _per_slot_learned(state, [n, n, n, n], [n - n // 100, n // 100, n - n // 100, n // 2])
  policy = AdaptiveDraft(_HandPlan(), 4, 10.0, 1.0, per_row=True)
  plan = _plan(manifest, state, 64)
  np.testing.assert_array_equal(policy.choose_per_row(plan, manifest, state), [4, 0, 1, 1])
  view = rec.AllocatorView(free_pages=jnp.int32(64), pages_held=jnp.array([2, 2, 2, 2]),
                           page_size=4)
  planned = policy(manifest, state, view)
  np.testing.assert_array_equal(planned.num_draft, [4, 0, 1, 1])
  assert planned.policy_id == "hand+adaptive_4_per_row"
  violations = validate.plan_violations(manifest, state, planned, view)
  for rule in ("draft", "multi_row_decode", "token_budget", "ledger_drift"):
    assert not violations[rule].any(), rule


def test_a_new_request_starts_at_its_clients_rate():
  """With no drafts of its own, a request's estimate is its client's."""
  from scheduler.policy_speculative import client_acceptance, request_acceptance
  manifest, state = _decode_state()
  state = _learned(state, 1000, 900)
  state = _per_slot_learned(state, [0, 0, 0, 0], [0, 0, 0, 0])
  np.testing.assert_allclose(request_acceptance(manifest, state, 0.5, 16.0),
                             client_acceptance(manifest, state, 0.5, 16.0), rtol=1e-6)


@pytest.mark.parametrize("seed", [s if s < 6 else pytest.param(s, marks=pytest.mark.extended)
                                  for s in range(20)])
def test_per_row_drafts_are_at_least_as_good_as_any_one_k(seed):
  """The per-row optimum over random rates, caps and step costs is never
  below the best uniform k's expected goodput (a uniform k is one of the
  sets it chooses among), and never gives a row more than its cap."""
  rng = np.random.default_rng(seed)
  num_slots, k_max = 6, 4
  alpha = jnp.asarray(rng.uniform(0.0, 0.99, num_slots), jnp.float32)
  room = jnp.asarray(rng.integers(0, 7, num_slots), jnp.int32)
  decode = jnp.asarray(rng.random(num_slots) < 0.8)
  fixed_ms, row_ms = float(rng.uniform(0.5, 50)), float(rng.uniform(0.01, 5))
  emits, rows = jnp.float32(rng.integers(0, 3)), jnp.float32(rng.integers(0, 20) + decode.sum())
  k = per_row_drafts(alpha, room, decode, jnp.arange(num_slots), emits, rows, k_max,
                     fixed_ms, row_ms)
  assert np.all(np.asarray(k) <= np.minimum(np.asarray(room), k_max))
  assert np.all(np.asarray(k)[~np.asarray(decode)] == 0)
  powers = np.asarray(alpha)[:, None] ** np.arange(1, k_max + 1)[None, :]
  tokens = float(emits) + float(decode.sum()) + sum(
      powers[i, :int(k[i])].sum() for i in range(num_slots))
  got = tokens / (fixed_ms + row_ms * (float(rows) + int(np.sum(k))))
  best_uniform = max(float(expected_goodput(alpha, room, decode, emits, rows, u, fixed_ms,
                                            row_ms)) for u in range(k_max + 1))
  assert got >= best_uniform * (1 - 1e-5)
