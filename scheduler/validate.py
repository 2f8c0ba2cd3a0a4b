"""Mechanical legality checks for plans and results (§0x01A).

``plan_violations`` / ``result_violations`` are pure array predicates (usable
under ``jax.jit``): each returns ``{rule_name: bool[]}`` where True means the
rule is broken. ``validate_plan`` / ``validate_result`` run them and raise
``PlanValidationError`` / ``ResultValidationError`` naming the first broken
rule and the offending slots.
"""

from __future__ import annotations

from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from scheduler import records as rec
from scheduler.policies import sort_keys


class PlanValidationError(ValueError):
  """An IterationPlan breaks a legality rule; ``.rule`` names it."""

  def __init__(self, rule: str, message: str):
    super().__init__(f"plan rule '{rule}' violated: {message}")
    self.rule = rule


class ResultValidationError(ValueError):
  """An IterationResult breaks a publication rule; ``.rule`` names it."""

  def __init__(self, rule: str, message: str):
    super().__init__(f"result rule '{rule}' violated: {message}")
    self.rule = rule


PLAN_RULES = {
    "state_version": "plan.input_state_version must equal state.state_version",
    "decision_id": "plan.decision_id must equal state.decision_id",
    "member": "a selected slot must be RUNNING, or WAITING with an admit intent, and ready",
    "generation": "selected generation and snapshot_version must match the state",
    "frontier": "interval must start at the computed frontier",
    "prefill_interval": "prefill/rebuild needs computed < end <= target",
    "decode_interval": "decode needs emitted >= 1, computed == p + e - 1 and end == start + 1",
    "derived_kind": "kind must be derived from the state, not chosen",
    "token_budget": "num_tokens must equal the selected rows and be <= token_budget",
    "seq_budget": "num_seqs must equal the selected count and be <= seq_budget",
    "rank": "ranks must be a permutation of 0..num_seqs-1 over selected slots",
    "intents": "admit only WAITING slots; preempt only RUNNING, unselected slots",
    "tie_break": "recorded sort_key must replay from the state",
}

RESULT_RULES = {
    "binding": "result decision_id/state version must equal the plan's",
    "unplanned_completion": "only selected slots may complete",
    "completed_end": "a completed interval ends at the planned end",
    "output_clock": "emit iff a decode completes or prefill first reaches p",
    "service_debit": "service rows must equal completed rows (0 if not completed)",
    "terminal": "a slot may finish only when it emitted or failed",
}


def plan_violations(manifest: rec.WorkloadManifest, state: rec.SchedulerState,
                    plan: rec.IterationPlan) -> Dict[str, jax.Array]:
  """Rule name -> bool[R] (True where the rule is broken for that slot)."""
  sel = plan.selected
  p, e, c = manifest.prompt_len, state.emitted, state.computed
  target = rec.prefill_target(manifest, state)
  decode_state = (e >= 1) & (c == p + e - 1)
  derived = jnp.where(decode_state, rec.DECODE_ROW,
                      jnp.where(e == 0, rec.PREFILL_CHUNK, rec.REBUILD))
  width = plan.end - plan.start
  num_slots = sel.shape[0]
  scalar = lambda x: jnp.broadcast_to(x, (num_slots,))
  ranks_sorted = jnp.sort(jnp.where(sel, plan.rank, num_slots + 1))
  rank_ok = jnp.all(jnp.where(jnp.arange(num_slots) < plan.num_seqs,
                              ranks_sorted == jnp.arange(num_slots), True))
  member_ok = ((state.status == rec.RUNNING) & ~plan.admit) | (
      (state.status == rec.WAITING) & plan.admit)
  return {
      "state_version": scalar(plan.input_state_version != state.state_version),
      "decision_id": scalar(plan.decision_id != state.decision_id),
      "member": sel & ~(member_ok & state.ready),
      "generation": sel & ((plan.generation != state.generation)
                           | (plan.snapshot_version != state.snapshot_version)),
      "frontier": sel & (plan.start != c),
      "prefill_interval": sel & ~decode_state & ~((c < plan.end) & (plan.end <= target)),
      "decode_interval": sel & (plan.kind == rec.DECODE_ROW) & ~(
          decode_state & (width == 1)),
      "derived_kind": sel & (plan.kind != derived),
      "token_budget": scalar((plan.num_tokens != jnp.sum(jnp.where(sel, width, 0)))
                             | (plan.num_tokens > plan.token_budget)),
      "seq_budget": scalar((plan.num_seqs != jnp.sum(sel))
                           | (plan.num_seqs > plan.seq_budget)),
      "rank": scalar(~rank_ok) | (sel != (plan.rank >= 0)),
      "intents": (plan.admit & (state.status != rec.WAITING))
                 | (plan.preempt & ((state.status != rec.RUNNING) | sel)),
      "tie_break": jnp.any(plan.sort_key != sort_keys(manifest, state), axis=1),
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
  rows = plan.end - plan.start
  return {
      "binding": scalar((result.decision_id != plan.decision_id)
                        | (result.input_state_version != plan.input_state_version)),
      "unplanned_completion": done & ~plan.selected,
      "completed_end": done & (result.completed_end != plan.end),
      "output_clock": result.emitted != should_emit,
      "service_debit": result.service_rows != jnp.where(done, rows, 0),
      "terminal": result.finished & ~(result.emitted | result.failed),
  }


def _raise_first(violations, rules, error_cls):
  for rule, bad in violations.items():
    bad = np.asarray(bad)
    if bad.any():
      slots = np.flatnonzero(bad).tolist()
      raise error_cls(rule, f"{rules[rule]} (slots {slots[:8]})")


def validate_plan(manifest, state, plan) -> None:
  """Raises PlanValidationError for the first broken rule; else None."""
  _raise_first(plan_violations(manifest, state, plan), PLAN_RULES,
               PlanValidationError)


def validate_result(plan, state, manifest, result) -> None:
  """Raises ResultValidationError for the first broken rule; else None."""
  _raise_first(result_violations(plan, state, manifest, result), RESULT_RULES,
               ResultValidationError)


def any_violation(violations: Dict[str, jax.Array]) -> jax.Array:
  """i32[]: bitmask over the dict's rules in order (0 = legal)."""
  bits = [jnp.any(v).astype(jnp.int32) << i for i, v in enumerate(violations.values())]
  return sum(bits[1:], bits[0])
