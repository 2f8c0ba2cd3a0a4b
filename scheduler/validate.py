"""Mechanical legality checks for plans, packed rows and results (§0x01A).

``plan_violations`` / ``result_violations`` / ``packed_violations`` are pure
array predicates (usable under ``jax.jit``): each returns
``{rule_name: bool[R]}`` (``bool[T]`` for packed rows) where True marks a slot
that breaks the rule. ``validate_plan`` / ``validate_result`` /
``validate_packed`` run them on the host and raise the rule's own error type
(a subclass of ``PlanValidationError`` / ``ResultValidationError`` /
``PackedValidationError``) for the first broken rule, naming the rule and the
offending slots. The rule order is the order of the ``*_RULES`` tables.

The negative fixtures of §0x01A map onto the rules:

=====================================================  =======================
interval before frontier / beyond prompt               frontier, beyond_prompt
multi-row ordinary decode                              multi_row_decode
duplicate / stale request generation                   duplicate_generation,
                                                       stale_generation
stale snapshot / scheduler-state version               stale_snapshot,
                                                       state_version
unready / terminal / duplicated queue member           unready, terminal,
                                                       duplicate_member
token / sequence budget, ledger drift                  token_budget,
                                                       seq_budget, ledger_drift
forged phase / position trace / policy / tie-break     forged_kind,
                                                       position_trace (packed),
                                                       policy_identity,
                                                       tie_break
realized-output / physical-block leak                  hidden_truth,
                                                       physical_block
unplanned completion, output clock, planned debit      unplanned_completion,
                                                       output_clock,
                                                       service_debit
preserved prefix not bound to a preemption             preserved_prefix
=====================================================  =======================
"""

from __future__ import annotations

import dataclasses
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from scheduler import records as rec
from scheduler import scan
from scheduler.keys import sort_keys


# ---------------------------------------------------------------- errors


class PlanValidationError(ValueError):
  """An IterationPlan breaks a legality rule; ``.rule`` names it."""

  rule = ""

  def __init__(self, rule: str, message: str):
    super().__init__(f"plan rule '{rule}' violated: {message}")
    self.rule = rule


class ResultValidationError(ValueError):
  """An IterationResult breaks a publication rule; ``.rule`` names it."""

  rule = ""

  def __init__(self, rule: str, message: str):
    super().__init__(f"result rule '{rule}' violated: {message}")
    self.rule = rule


class PackedValidationError(ValueError):
  """A PackedIteration does not reproduce its plan; ``.rule`` names it."""

  rule = ""

  def __init__(self, rule: str, message: str):
    super().__init__(f"packed rule '{rule}' violated: {message}")
    self.rule = rule


class HiddenTruthLeak(PlanValidationError):
  """Hidden realized output length reached the policy's input or the plan."""


class PhysicalBlockLeak(PlanValidationError):
  """Page / block ids (allocator-owned facts) appear in a plan or manifest."""


class StaleStateVersion(PlanValidationError):
  """plan.input_state_version is not the state's version."""


class StaleDecision(PlanValidationError):
  """plan.decision_id is not the state's next decision id."""


class ForgedPolicyIdentity(PlanValidationError):
  """The plan's policy id/version is not the workload's declared policy."""


class StaleGeneration(PlanValidationError):
  """A selected slot binds a request generation the state no longer has."""


class StaleSnapshot(PlanValidationError):
  """A selected slot binds an out-of-date per-request snapshot version."""


class DuplicateGeneration(PlanValidationError):
  """Two selected slots bind the same (request id, generation)."""


class DuplicateQueueMember(PlanValidationError):
  """A selected or admitted request id is live in more than one slot."""


class TerminalMember(PlanValidationError):
  """A finished (terminal) or free slot was selected."""


class UnreadyMember(PlanValidationError):
  """A slot whose readiness fact is false was selected."""


class QueueMembership(PlanValidationError):
  """Selection contradicts queue membership (RUNNING, or WAITING + admit)."""


class IntervalBeforeFrontier(PlanValidationError):
  """The interval does not start at the computed frontier."""


class IntervalBeyondPrompt(PlanValidationError):
  """Prefill-like interval is empty or ends past its target (the prompt)."""


class MultiRowDecode(PlanValidationError):
  """A decode interval is not exactly one row plus its draft tokens."""


class IllegalDraft(PlanValidationError):
  """Draft tokens outside a selected decode row, negative, or reaching past
  the request's ``max_tokens``."""


class ForgedPhase(PlanValidationError):
  """The work kind is not the one derived from the state."""


class TokenBudgetOverflow(PlanValidationError):
  """Selected token rows exceed the token budget."""


class SequenceBudgetOverflow(PlanValidationError):
  """Selected request generations exceed the sequence budget."""


class LedgerDrift(PlanValidationError):
  """The plan's budget ledger does not equal the selected rows / sequences."""


class RankOrder(PlanValidationError):
  """Packing ranks are not a permutation over the selected slots."""


class IllegalIntent(PlanValidationError):
  """Admit / preempt intents on slots in the wrong queue."""


class ForgedTieBreak(PlanValidationError):
  """Recorded keys do not replay from the state, or ranks ignore them."""


class StaleResult(ResultValidationError):
  """Result decision id / state version is not the plan's."""


class UnplannedCompletion(ResultValidationError):
  """A slot the plan did not select reports a completion."""


class CompletedEndMismatch(ResultValidationError):
  """A completed interval does not end at the planned end."""


class UnverifiedToken(ResultValidationError):
  """A result emits draft tokens the plan did not verify (speculative
  decoding): accepted drafts outside [0, num_draft], or without emission."""


class FailedCompletion(ResultValidationError):
  """A slot is reported both failed and completed."""


class WrongOutputClock(ResultValidationError):
  """Emission does not follow the token clock of §0x01A."""


class PlannedServiceDebit(ResultValidationError):
  """Service rows do not equal the completed rows."""


class UnfoundedTerminal(ResultValidationError):
  """A slot finished without emitting or failing."""


class UnfoundedPreservation(ResultValidationError):
  """A preserved prefix on a slot not preempted, or beyond its frontier."""


class ForgedPositionTrace(PackedValidationError):
  """Packed positions are not ``range(start, end)`` of their interval."""


class SegmentMismatch(PackedValidationError):
  """Packed segments are not the selected intervals in rank order."""


PLAN_RULES = {
    "hidden_truth": (HiddenTruthLeak,
                     "policy input and plan must not carry realized output length"),
    "physical_block": (PhysicalBlockLeak,
                       "plan and manifest must not carry page or block ids"),
    "state_version": (StaleStateVersion,
                      "plan.input_state_version must equal state.state_version"),
    "decision_id": (StaleDecision, "plan.decision_id must equal state.decision_id"),
    "policy_identity": (ForgedPolicyIdentity,
                        "plan policy id/version must equal the workload's"),
    "stale_generation": (StaleGeneration,
                         "selected generation must equal state.generation"),
    "stale_snapshot": (StaleSnapshot,
                       "selected snapshot_version must equal the state's"),
    "duplicate_generation": (DuplicateGeneration,
                             "a (request_id, generation) may be selected once"),
    "duplicate_member": (DuplicateQueueMember,
                         "a selected or admitted request must be live in one slot"),
    "terminal": (TerminalMember, "a selected slot must not be FINISHED or FREE"),
    "unready": (UnreadyMember, "a selected slot must be ready"),
    "queue_member": (QueueMembership,
                     "a selected slot must be RUNNING, or WAITING with an admit intent"),
    "frontier": (IntervalBeforeFrontier, "interval must start at the computed frontier"),
    "beyond_prompt": (IntervalBeyondPrompt,
                      "prefill/rebuild needs computed < end <= target"),
    "multi_row_decode": (MultiRowDecode,
                         "decode is exactly [c, c + 1 + k) with c == p + e - 1 and k "
                         "the row's draft tokens (plan.num_draft; 0 without speculation)"),
    "draft": (IllegalDraft,
              "draft tokens ride only a selected decode row, k >= 0, and e + 1 + k <= "
              "max_tokens"),
    "forged_kind": (ForgedPhase, "kind must be derived from the state, not chosen"),
    "token_budget": (TokenBudgetOverflow, "selected rows must be <= token_budget"),
    "seq_budget": (SequenceBudgetOverflow, "selected sequences must be <= seq_budget"),
    "ledger_drift": (LedgerDrift,
                     "num_tokens / num_seqs must equal the selected rows / count"),
    "rank": (RankOrder, "ranks must be a permutation of 0..num_seqs-1 over selected slots"),
    "intents": (IllegalIntent,
                "admit only WAITING slots; preempt only RUNNING, unselected slots"),
    "tie_break": (ForgedTieBreak,
                  "recorded sort_key must replay from the state and order the ranks"),
}

RESULT_RULES = {
    "binding": (StaleResult, "result decision_id/state version must equal the plan's"),
    "unplanned_completion": (UnplannedCompletion, "only selected slots may complete"),
    "completed_end": (CompletedEndMismatch,
                      "a completed interval ends at the planned end (a verified decode "
                      "row: after its last accepted draft)"),
    "unverified": (UnverifiedToken,
                   "accepted drafts are within [0, num_draft] of an emitting row"),
    "failed_completion": (FailedCompletion, "a failed slot completes nothing"),
    "output_clock": (WrongOutputClock,
                     "emit (with a token) iff a decode completes or prefill first reaches p"),
    "service_debit": (PlannedServiceDebit,
                      "service rows must equal completed rows (0 if not completed)"),
    "terminal": (UnfoundedTerminal, "a slot may finish only when it emitted or failed"),
    "preserved_prefix": (UnfoundedPreservation,
                         "preserved_end must be 0 unless the plan preempts the slot, "
                         "and <= its computed frontier"),
}

PACKED_RULES = {
    "position_trace": (ForgedPositionTrace,
                       "a packed row's position must be start + its offset in the segment"),
    "segments": (SegmentMismatch,
                 "segment i must be the rank-i selected slot with end - start rows"),
}

_HIDDEN_WORDS = ("hidden", "realized")
_PHYSICAL_WORDS = ("page", "block", "physical")


def _field_names(record):
  return [f.name for f in dataclasses.fields(record)]


def _leaks(record, words, allowed_none=()):
  """True if ``record`` declares a field named like ``words`` that is set."""
  for name in _field_names(record):
    if any(w in name for w in words):
      if name in allowed_none and getattr(record, name) is None:
        continue
      return True
  return False


# ------------------------------------------------------------ predicates


_INT32_MAX = 2**31 - 1


def _groups(order, cols):
  """i32[R]: the group of equal ``cols`` (i32[R] arrays) each position of
  ``order`` belongs to (0, 1, ... along ``order``), where ``order`` sorts
  the slots by those columns, or by them and then finer ones."""
  differs = jnp.zeros((order.shape[0] - 1,), bool)
  for col in cols:
    col = col[order]
    differs = differs | (col[1:] != col[:-1])
  return scan.cumsum_i32(jnp.concatenate([jnp.zeros((1,), bool), differs]))


def _sorted_groups(cols):
  """(order, group): slots sorted by the columns (first column primary) and
  ``_groups`` of that order. ``jnp.lexsort``, not ``key_order``: only a
  broken plan gets here (``_rank_inverted``), and one sort op compiles
  faster than ``key_order``'s branches."""
  order = jnp.lexsort(tuple(jnp.asarray(col, jnp.int32) for col in reversed(cols)))
  return order.astype(jnp.int32), _groups(order, cols)


def _equal_key_sums(order, group, weight):
  """i32[R]: for each slot, the sum of ``weight`` (bool or i32[R]) over the
  slots in its group of equal keys (``_groups``), itself included. A
  segment sum: O(R), never the R x R pairs."""
  num_slots = order.shape[0]
  totals = jax.ops.segment_sum(jnp.asarray(weight, jnp.int32)[order], group,
                               num_segments=num_slots)
  return jnp.zeros((num_slots,), jnp.int32).at[order].set(totals[group])


def _shares_an_id(rid, member):
  """bool[]: two slots in ``member`` (bool[R]) hold the same ``rid``
  (i32[R]). Counted first: the members' ids modulo 4R (request ids are
  arrival numbers, so live ones rarely lie 4R apart); only when two fall in
  one bucket are the ids sorted. One sort of one array: XLA:CPU sorts it with
  ``std::sort`` on its values, where a sort of several arrays (keys and an
  index) calls a compiled comparator per comparison and moves every element
  per array; at R = 16,384 one such sort took ~0.68 ms standalone on this
  project's 2-core Xeon."""
  buckets = 4 * rid.shape[0]
  hits = jnp.zeros((buckets,), jnp.int32).at[
      jnp.where(member, jnp.remainder(rid, buckets), buckets)].add(1, mode="drop")

  def sorted_ids(_):
    ids = jnp.sort(jnp.where(member, rid, _INT32_MAX))
    adjacent = (ids[1:] == ids[:-1]) & (ids[1:] != _INT32_MAX)
    return jnp.any(adjacent) | (jnp.sum(member & (rid == _INT32_MAX)) >= 2)

  return jax.lax.cond(jnp.any(hits >= 2), sorted_ids, lambda _: jnp.zeros((), bool), None)


def _ranks_are_positions(sel, rank):
  """bool[]: the selected slots' ranks (i32[R]) are 0 .. n-1, each once (n
  selected slots). Counted, not sorted: O(R)."""
  num_slots = sel.shape[0]
  inside = sel & (rank >= 0) & (rank < jnp.sum(sel))
  hits = jnp.zeros((num_slots,), jnp.int32).at[
      jnp.where(inside, rank, num_slots)].add(1, mode="drop")
  return jnp.all(inside == sel) & jnp.all(hits <= 1)


def _in_rank_order(keys, sel, rank):
  """bool[]: walked in rank order, the selected slots' keys (i32[R, K],
  lexicographic) never decrease. Meaningful only when the ranks are
  positions (``_ranks_are_positions``); then no selected slot is ranked
  after one with a larger key. O(R K): one scatter and adjacent compares."""
  num_slots = sel.shape[0]
  by_rank = jnp.zeros((num_slots,), jnp.int32).at[jnp.where(sel, rank, num_slots)].set(
      jnp.arange(num_slots, dtype=jnp.int32), mode="drop")
  before, after = keys[by_rank[:-1]], keys[by_rank[1:]]
  greater, equal = jnp.zeros((num_slots - 1,), bool), jnp.ones((num_slots - 1,), bool)
  for col in range(keys.shape[1]):
    greater = greater | (equal & (before[:, col] > after[:, col]))
    equal = equal & (before[:, col] == after[:, col])
  pairs = jnp.arange(num_slots - 1) < jnp.sum(sel) - 1
  return ~jnp.any(pairs & greater)


def _rank_inverted(keys, sel, rank, ranks_ok):
  """bool[R]: selected slots ranked after a selected slot with a strictly
  larger key (lexicographic over the columns of i32[R, K] ``keys``).

  None, when the ranks are positions (``ranks_ok``, bool[]) and the keys
  never decrease in rank order (``_in_rank_order``, O(R K)): a valid plan
  costs no sort. Otherwise, in key order, a slot is inverted when its rank
  exceeds the least rank of the selected slots in the groups after its own
  group of equal keys (a suffix minimum): one sort and two scans,
  O(R log R).
  """
  if keys.dtype != jnp.int32:          # the sort casts each column; compare as it does
    return _inverted_in_key_order(keys, sel, rank)
  return jax.lax.cond(ranks_ok & _in_rank_order(keys, sel, rank),
                      lambda _: jnp.zeros(sel.shape, bool),
                      lambda _: _inverted_in_key_order(keys, sel, rank), None)


def _inverted_in_key_order(keys, sel, rank):
  """``_rank_inverted`` by one sort of the keys (any ranks)."""
  num_slots = sel.shape[0]
  order, group = _sorted_groups([keys[:, col] for col in range(keys.shape[1])])
  rank_sorted = jnp.where(sel, rank, _INT32_MAX)[order]
  # suffix_min[p] = least selected rank at sorted positions >= p.
  suffix_min = jnp.concatenate([jax.lax.cummin(rank_sorted, reverse=True),
                                jnp.full((1,), _INT32_MAX, rank_sorted.dtype)])
  # First sorted position of each group; the group after the last starts at R.
  group_start = jnp.full((num_slots + 1,), num_slots, jnp.int32).at[group].min(
      jnp.arange(num_slots, dtype=jnp.int32))
  later_min = suffix_min[group_start[group + 1]]
  inverted = jnp.zeros((num_slots,), bool).at[order].set(rank_sorted > later_min)
  return sel & inverted


def replay_keys(manifest: rec.WorkloadManifest, state: rec.SchedulerState,
                plan: rec.IterationPlan, view=None) -> jax.Array:
  """i32[R, K]: the tie-break key the plan's policy derives from the state.

  ``plan.policy.sort_keys(manifest, state, view)`` when the plan names a
  policy object with that method (its id must be the plan's id), else the
  default ``scheduler.keys.sort_keys``. ``view`` is the AllocatorView the
  policy read; only keys built on allocator facts (prefix hits) need it.
  Raises ValueError on an id mismatch.
  """
  keyer = getattr(plan.policy, "sort_keys", None)
  if keyer is None:
    return sort_keys(manifest, state)
  if plan.policy.policy_id != plan.policy_id:
    raise ValueError(f"plan.policy is {plan.policy.policy_id!r} but plan.policy_id "
                     f"is {plan.policy_id!r}")
  return keyer(manifest, state, view)


def plan_violations(manifest: rec.WorkloadManifest, state: rec.SchedulerState,
                    plan: rec.IterationPlan, view=None) -> Dict[str, jax.Array]:
  """Rule name -> bool[R] (True where the rule is broken for that slot).

  ``manifest`` is the policy's input (the online projection); a manifest that
  still carries ``hidden_realized_output_tokens`` breaks ``hidden_truth``.
  Schema and policy-identity rules are static and broadcast to every slot.
  ``view`` (optional AllocatorView) replays keys built on allocator facts.
  """
  sel = plan.selected
  num_slots = sel.shape[0]
  scalar = lambda x: jnp.broadcast_to(jnp.asarray(x), (num_slots,))
  p, e, c = manifest.prompt_len, state.emitted, state.computed
  target = rec.prefill_target(manifest, state)
  decode_state = (e >= 1) & (c == p + e - 1)
  derived = jnp.where(decode_state, rec.DECODE_ROW,
                      jnp.where(e == 0, rec.PREFILL_CHUNK, rec.REBUILD))
  width = jnp.where(sel, plan.end - plan.start, 0)
  k = rec.num_draft(plan)
  live = (state.status == rec.WAITING) | (state.status == rec.RUNNING)

  # Identity checks over slots, by counting equal keys along one sort by
  # (request id, generation), not over R x R pairs; only when two of the
  # slots they read (live, selected or admitted) share a request id, which
  # one sort of the ids alone tells (both rules are all False otherwise).
  rid = manifest.request_id

  def duplicates(_):
    by_id = jnp.lexsort((plan.generation, rid))
    dup_gen = sel & (_equal_key_sums(by_id, _groups(by_id, [rid, plan.generation]),
                                     sel) >= 2)
    dup_member = (sel | plan.admit) & (
        _equal_key_sums(by_id, _groups(by_id, [rid]), live) - live >= 1)
    return dup_gen, dup_member

  no_slots = jnp.zeros((num_slots,), bool)
  dup_gen, dup_member = jax.lax.cond(
      _shares_an_id(rid, live | sel | plan.admit), duplicates,
      lambda _: (no_slots, no_slots), None)

  rank_ok = _ranks_are_positions(sel, plan.rank)

  # Ranks must follow the recorded key order among selected slots. The key
  # is replayed from the state by the plan's own policy (its declared
  # tie-break), or by the default ``sort_keys``.
  keys = replay_keys(manifest, state, plan, view)
  key_shape_bad = keys.shape != plan.sort_key.shape
  if key_shape_bad:
    keys = jnp.zeros(plan.sort_key.shape, jnp.int32)
  rank_inverted = _rank_inverted(keys, sel, plan.rank, rank_ok)

  hidden = (_leaks(manifest, _HIDDEN_WORDS, ("hidden_realized_output_tokens",))
            or _leaks(plan, _HIDDEN_WORDS))
  physical = _leaks(manifest, _PHYSICAL_WORDS) or _leaks(plan, _PHYSICAL_WORDS)
  policy_bad = bool(manifest.policy_id) and (
      (plan.policy_id, plan.policy_version)
      != (manifest.policy_id, manifest.policy_version))
  return {
      "hidden_truth": scalar(hidden),
      "physical_block": scalar(physical),
      "state_version": scalar(plan.input_state_version != state.state_version),
      "decision_id": scalar(plan.decision_id != state.decision_id),
      "policy_identity": scalar(policy_bad),
      "stale_generation": sel & (plan.generation != state.generation),
      "stale_snapshot": sel & (plan.snapshot_version != state.snapshot_version),
      "duplicate_generation": dup_gen,
      "duplicate_member": dup_member,
      "terminal": sel & ~live,
      "unready": sel & live & ~state.ready,
      "queue_member": sel & live & ~(((state.status == rec.RUNNING) & ~plan.admit)
                                     | ((state.status == rec.WAITING) & plan.admit)),
      "frontier": sel & (plan.start != c),
      "beyond_prompt": sel & ~decode_state & ~((c < plan.end) & (plan.end <= target)),
      "multi_row_decode": sel & decode_state & (plan.end - plan.start != 1 + k),
      "draft": (k != 0) & ~(sel & decode_state) | (k < 0)
               | (e + 1 + k > manifest.max_tokens) & (k > 0),
      "forged_kind": sel & (plan.kind != derived),
      "token_budget": scalar(jnp.sum(width) > plan.token_budget),
      "seq_budget": scalar(jnp.sum(sel) > plan.seq_budget),
      "ledger_drift": scalar((plan.num_tokens != jnp.sum(width))
                             | (plan.num_seqs != jnp.sum(sel))),
      "rank": scalar(~rank_ok) | (sel != (plan.rank >= 0)),
      "intents": (plan.admit & (state.status != rec.WAITING))
                 | (plan.preempt & ((state.status != rec.RUNNING) | sel))
                 # a §0x06 extension is a selected decode row's
                 | (jnp.zeros((num_slots,), bool) if plan.extend is None
                    else plan.extend & ~(sel & (plan.kind == rec.DECODE_ROW))),
      "tie_break": (jnp.any(plan.sort_key != keys, axis=1) | rank_inverted
                    | scalar(key_shape_bad)),
  }


def result_violations(plan: rec.IterationPlan, state: rec.SchedulerState,
                      manifest: rec.WorkloadManifest,
                      result: rec.IterationResult) -> Dict[str, jax.Array]:
  """Rule name -> bool[R] (True where the rule is broken for that slot)."""
  num_slots = plan.selected.shape[0]
  scalar = lambda x: jnp.broadcast_to(x, (num_slots,))
  done = result.completed
  first_reach = (plan.kind == rec.PREFILL_CHUNK) & (plan.end == manifest.prompt_len)
  should_emit = done & ((plan.kind == rec.DECODE_ROW) | first_reach)
  accepted = rec.num_accepted(result)
  rows = plan.end - plan.start - jnp.where(result.emitted, rec.num_draft(plan) - accepted, 0)
  return {
      "binding": scalar((result.decision_id != plan.decision_id)
                        | (result.input_state_version != plan.input_state_version)),
      "unplanned_completion": done & ~plan.selected,
      "completed_end": done & (result.completed_end != plan.end - jnp.where(
          result.emitted, rec.num_draft(plan) - accepted, 0)),
      "unverified": (accepted < 0) | (accepted > rec.num_draft(plan))
                    | ((accepted != 0) & ~result.emitted),
      "failed_completion": done & result.failed,
      "output_clock": (result.emitted != should_emit)
                      | (result.emitted != (result.token >= 0)),
      "service_debit": result.service_rows != jnp.where(done, rows, 0),
      "terminal": result.finished & ~(result.emitted | result.failed),
      "preserved_prefix": (jnp.zeros((num_slots,), bool) if result.preserved_end is None
                           else (result.preserved_end < 0)
                           | (~plan.preempt & (result.preserved_end != 0))
                           | (result.preserved_end > state.computed)),
  }


def packed_violations(plan: rec.IterationPlan, packed) -> Dict[str, jax.Array]:
  """Rule name -> bool[T] over packed rows (§0x04).

  ``packed`` is a ``serving.engine.pack.PackedIteration`` (duck-typed: positions,
  slot_of_row, valid_row, seq_slots, valid_seq, cu_q_lens). Request-local
  positions must equal ``range(start, end)`` of the row's interval.
  """
  rows = jnp.arange(packed.positions.shape[0])
  cu = packed.cu_q_lens
  seq = jnp.clip(jnp.searchsorted(cu, rows, side="right") - 1, 0,
                 packed.seq_slots.shape[0] - 1)
  slot = packed.slot_of_row
  expect = plan.start[slot] + rows - cu[seq]
  bad_pos = packed.valid_row & (packed.positions != expect)
  seq_slot = packed.seq_slots
  q_len = cu[1:] - cu[:-1]
  seg_bad = packed.valid_seq & (
      ~plan.selected[seq_slot]
      | (plan.rank[seq_slot] != jnp.arange(seq_slot.shape[0]))
      | (q_len != plan.end[seq_slot] - plan.start[seq_slot]))
  row_bad = packed.valid_row & (seg_bad[seq] | (slot != seq_slot[seq]))
  count_bad = packed.num_seqs != jnp.sum(plan.selected)
  return {"position_trace": bad_pos,
          "segments": row_bad | jnp.any(seg_bad) | count_bad}


# --------------------------------------------------------------- raising


def _raise_first(violations, rules, base_cls):
  for rule, bad in violations.items():
    bad = np.asarray(bad)
    if bad.any():
      cls, text = rules[rule]
      slots = np.flatnonzero(bad).tolist()
      raise cls(rule, f"{text} (slots {slots[:8]})")


def validate_plan(manifest, state, plan, view=None) -> None:
  """Raises the first broken rule's ``PlanValidationError`` subclass.

  Args:
    manifest: the WorkloadManifest the policy read (its online projection).
    state: the SchedulerState the plan claims as input.
    plan: the IterationPlan.
    view: optional AllocatorView the policy read (prefix-hit keys).
  Raises:
    PlanValidationError subclass named in ``PLAN_RULES``.
  """
  _raise_first(plan_violations(manifest, state, plan, view), PLAN_RULES,
               PlanValidationError)


def validate_result(plan, state, manifest, result) -> None:
  """Raises the first broken rule's ``ResultValidationError`` subclass."""
  _raise_first(result_violations(plan, state, manifest, result), RESULT_RULES,
               ResultValidationError)


def validate_packed(plan, packed) -> None:
  """Raises ``ForgedPositionTrace`` / ``SegmentMismatch`` (§0x04)."""
  _raise_first(packed_violations(plan, packed), PACKED_RULES,
               PackedValidationError)


def any_violation(violations: Dict[str, jax.Array]) -> jax.Array:
  """i32[]: bitmask over the dict's rules in order (0 = legal)."""
  bits = [jnp.any(v).astype(jnp.int32) << i for i, v in enumerate(violations.values())]
  return sum(bits[1:], bits[0])
