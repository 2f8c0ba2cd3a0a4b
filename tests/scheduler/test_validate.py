"""One test per validation rule (§0x01A negative fixtures).

The valid fixture is the §0x01A iteration-5 cut planned by the real
SarathiServe policy (``tests.scheduler.fixtures.iteration5_fixture``); every test
mutates one field of the state, manifest, plan, result or packed rows and
asserts the rule's own error type.
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.scheduler import fixtures as fx
from scheduler import records as rec
from scheduler import validate as v
from scheduler.ledger import Budgets
from scheduler.policy_sarathi_serve import SarathiServe
from serving.engine.pack import pack

POLICY = SarathiServe(Budgets(token_budget=4, seq_budget=3, chunk_cap=4))
A, B, C, D, E = range(5)


@pytest.fixture(scope="module")
def valid():
  manifest, state, _ = fx.iteration5_fixture()
  online = manifest.online()
  plan = fx.plan_jit(POLICY, online, state,
                     fx.alloc_view(state, num_pages=16, page_size=4))
  result = fx.fixture_execute(manifest, state, plan, 1.0)
  return online, state, plan, result


def broken_rules(violations):
  """Names of the rules with any True entry, in table order."""
  return [rule for rule, bad in violations.items() if np.asarray(bad).any()]


def _set(arr, idx, value):
  return arr.at[idx].set(value)


def plan_fails(error, rule, manifest, state, plan, only=True):
  broken = broken_rules(v.plan_violations(manifest, state, plan))
  with pytest.raises(error, match=rule):
    v.validate_plan(manifest, state, plan)
  if only:
    assert broken == [rule]
  else:
    assert broken[0] == rule


def result_fails(error, rule, valid, result):
  manifest, state, plan, _ = valid
  broken = broken_rules(v.result_violations(plan, state, manifest, result))
  assert broken == [rule]
  with pytest.raises(error, match=rule):
    v.validate_result(plan, state, manifest, result)


def test_valid_fixture_passes(valid):
  manifest, state, plan, result = valid
  v.validate_plan(manifest, state, plan)
  v.validate_result(plan, state, manifest, result)
  assert issubclass(v.StaleStateVersion, v.PlanValidationError)
  assert issubclass(v.PlannedServiceDebit, v.ResultValidationError)


# ------------------------------------------------------------------ plan


def test_hidden_truth_in_policy_input_is_refused(valid):
  manifest, state, plan, _ = valid
  full, _, _ = fx.iteration5_fixture()
  plan_fails(v.HiddenTruthLeak, "hidden_truth", full, state, plan)

  @flax.struct.dataclass
  class PlanWithTruth(rec.IterationPlan):
    hidden_realized_output_tokens: jax.Array = None

  leaky = PlanWithTruth(**{f.name: getattr(plan, f.name)
                           for f in dataclasses.fields(plan)},
                        hidden_realized_output_tokens=full.hidden_realized_output_tokens)
  plan_fails(v.HiddenTruthLeak, "hidden_truth", manifest, state, leaky)


def test_physical_block_ids_in_plan_are_refused(valid):
  manifest, state, plan, _ = valid

  @flax.struct.dataclass
  class PlanWithPages(rec.IterationPlan):
    page_ids: jax.Array = None

  leaky = PlanWithPages(**{f.name: getattr(plan, f.name)
                           for f in dataclasses.fields(plan)},
                        page_ids=jnp.zeros((6, 2), jnp.int32))
  plan_fails(v.PhysicalBlockLeak, "physical_block", manifest, state, leaky)


def test_stale_state_version(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.StaleStateVersion, "state_version", manifest, state,
             plan.replace(input_state_version=jnp.int32(6)))


def test_stale_decision_id(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.StaleDecision, "decision_id", manifest, state,
             plan.replace(decision_id=jnp.int32(4)))


def test_forged_policy_version(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.ForgedPolicyIdentity, "policy_identity", manifest, state,
             plan.replace(policy_version="2"))


def test_stale_request_generation(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.StaleGeneration, "stale_generation", manifest, state,
             plan.replace(generation=_set(plan.generation, B, 1)))


def test_stale_snapshot_version(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.StaleSnapshot, "stale_snapshot", manifest, state,
             plan.replace(snapshot_version=_set(plan.snapshot_version, C, 5)))


def test_duplicate_request_generation():
  # Two running decodes of generation 0; slot 1 is given slot 0's request id.
  manifest, state = fx.build(
      [dict(slot=0, request_id=10, prompt_len=2, status=rec.RUNNING, emitted=1,
            computed=2),
       dict(slot=1, request_id=11, arrival_seq=1, prompt_len=2,
            status=rec.RUNNING, emitted=1, computed=2)], num_slots=6)
  plan = fx.plan_jit(POLICY, manifest, state,
                     fx.alloc_view(state, num_pages=8, page_size=4))
  v.validate_plan(manifest, state, plan)
  plan_fails(v.DuplicateGeneration, "duplicate_generation",
             manifest.replace(request_id=_set(manifest.request_id, 1, 10)),
             state, plan, only=False)


def test_duplicated_queue_member(valid):
  manifest, state, plan, _ = valid
  # req-A (admitted) becomes a second live slot of req-D's id.
  plan_fails(v.DuplicateQueueMember, "duplicate_member",
             manifest.replace(request_id=_set(manifest.request_id, A, 3)),
             state, plan, only=False)


def test_terminal_member(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.TerminalMember, "terminal", manifest,
             state.replace(status=_set(state.status, C, rec.FINISHED)), plan,
             only=False)


def test_unready_member(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.UnreadyMember, "unready", manifest,
             state.replace(ready=_set(state.ready, B, False)), plan, only=False)


def test_queue_membership_without_admit(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.QueueMembership, "queue_member", manifest, state,
             plan.replace(admit=_set(plan.admit, A, False)))


def test_interval_before_frontier(valid):
  manifest, state, plan, _ = valid
  # The state's frontier moved to 1; the plan still starts at 0.
  plan_fails(v.IntervalBeforeFrontier, "frontier", manifest,
             state.replace(computed=_set(state.computed, A, 1)), plan)


def test_interval_beyond_prompt(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.IntervalBeyondPrompt, "beyond_prompt",
             manifest.replace(prompt_len=_set(manifest.prompt_len, A, 1)),
             state, plan)


def test_multi_row_ordinary_decode(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.MultiRowDecode, "multi_row_decode", manifest, state,
             plan.replace(end=_set(plan.end, B, 5)), only=False)


def test_forged_phase(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.ForgedPhase, "forged_kind", manifest, state,
             plan.replace(kind=_set(plan.kind, A, rec.DECODE_ROW)))


def test_token_budget_overflow(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.TokenBudgetOverflow, "token_budget", manifest, state,
             plan.replace(token_budget=3))


def test_sequence_budget_overflow(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.SequenceBudgetOverflow, "seq_budget", manifest, state,
             plan.replace(seq_budget=2))


def test_ledger_drift(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.LedgerDrift, "ledger_drift", manifest, state,
             plan.replace(num_tokens=jnp.int32(3)))


def test_rank_not_a_permutation(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.RankOrder, "rank", manifest, state,
             plan.replace(rank=_set(plan.rank, A, 5)))


def test_illegal_queue_intent(valid):
  manifest, state, plan, _ = valid
  plan_fails(v.IllegalIntent, "intents", manifest, state,
             plan.replace(preempt=_set(plan.preempt, D, True)))


def test_an_extension_is_only_a_selected_decode_row(valid):
  """§0x06: an extension intent on a slot that runs no decode row is illegal."""
  manifest, state, plan, _ = valid
  assert plan.extend is not None and not bool(plan.extend.any())
  not_decode = int(np.flatnonzero(~(np.asarray(plan.selected)
                                    & (np.asarray(plan.kind) == rec.DECODE_ROW)))[0])
  plan_fails(v.IllegalIntent, "intents", manifest, state,
             plan.replace(extend=_set(plan.extend, not_decode, True)))


def test_forged_tie_break(valid):
  manifest, state, plan, _ = valid
  forged_key = plan.sort_key.at[B, 2].add(10)
  plan_fails(v.ForgedTieBreak, "tie_break", manifest, state,
             plan.replace(sort_key=forged_key))
  swapped = plan.rank.at[B].set(plan.rank[C]).at[C].set(plan.rank[B])
  plan_fails(v.ForgedTieBreak, "tie_break", manifest, state,
             plan.replace(rank=swapped))


# ---------------------------------------------------------------- packed


def _pack(plan):
  buffer = jnp.arange(6 * 16, dtype=jnp.int32).reshape(6, 16)
  table = jnp.arange(6 * 4, dtype=jnp.int32).reshape(6, 4) + 1
  return pack(plan, buffer, table, 4, num_rows=8, num_seqs=3)


def test_forged_position_trace(valid):
  _, _, plan, _ = valid
  packed = _pack(plan)
  v.validate_packed(plan, packed)
  np.testing.assert_array_equal(packed.positions[:4], [3, 3, 0, 1])
  forged = packed.replace(positions=packed.positions.at[3].set(2))
  with pytest.raises(v.ForgedPositionTrace, match="position_trace"):
    v.validate_packed(plan, forged)


def test_packed_segments_match_plan(valid):
  _, _, plan, _ = valid
  packed = _pack(plan)
  swapped = packed.seq_slots[jnp.array([1, 0, 2])]
  forged = packed.replace(seq_slots=swapped)
  with pytest.raises(v.SegmentMismatch, match="segments"):
    v.validate_packed(plan, forged)


# ---------------------------------------------------------------- result


def test_stale_result_binding(valid):
  result = valid[3]
  result_fails(v.StaleResult, "binding", valid,
               result.replace(input_state_version=jnp.int32(6)))


def test_unplanned_completion(valid):
  result = valid[3]
  result_fails(v.UnplannedCompletion, "unplanned_completion", valid,
               result.replace(completed=_set(result.completed, D, True)))


def test_completed_end_mismatch(valid):
  result = valid[3]
  result_fails(v.CompletedEndMismatch, "completed_end", valid,
               result.replace(completed_end=_set(result.completed_end, A, 3)))


def test_failed_slot_completes_nothing(valid):
  result = valid[3]
  result_fails(v.FailedCompletion, "failed_completion", valid,
               result.replace(failed=_set(result.failed, A, True)))


def test_wrong_output_clock(valid):
  result = valid[3]
  # A prefill that has not reached p emits nothing ...
  result_fails(v.WrongOutputClock, "output_clock", valid,
               result.replace(emitted=_set(result.emitted, A, True),
                              token=_set(result.token, A, 7)))
  # ... and a completed decode consumes the latest output and emits one.
  result_fails(v.WrongOutputClock, "output_clock", valid,
               result.replace(emitted=_set(result.emitted, C, False),
                              token=_set(result.token, C, -1)))


def test_service_debited_from_plan(valid):
  result = valid[3]
  # A did not complete, but its planned 2 rows are still debited.
  result_fails(v.PlannedServiceDebit, "service_debit", valid,
               result.replace(completed=_set(result.completed, A, False),
                              completed_end=_set(result.completed_end, A, 0)))


def test_unfounded_terminal_event(valid):
  result = valid[3]
  result_fails(v.UnfoundedTerminal, "terminal", valid,
               result.replace(finished=_set(result.finished, A, True)))


def test_preserved_prefix_needs_a_preemption(valid):
  manifest, state, plan, result = valid
  zeros = jnp.zeros_like(result.service_rows)
  # No slot is preempted by this plan: a preserved prefix is unfounded.
  result_fails(v.UnfoundedPreservation, "preserved_prefix", valid,
               result.replace(preserved_end=_set(zeros, A, 1)))
  # An all-zero preservation fact is the recompute default and passes.
  assert broken_rules(v.result_violations(
      plan, state, manifest, result.replace(preserved_end=zeros))) == []
