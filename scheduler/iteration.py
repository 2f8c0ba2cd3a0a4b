"""One iteration's scheduler half, as pure functions every driver composes:
the engine's ``plan`` and ``step`` programs and its many-iteration loop
(``serving.engine.programs``, ``serving.engine.sim_loop``), the
conformance kit (``scheduler.conformance``) and the test fixtures.

    ticked, plan = plan_iteration(policy, manifest, state, view, now_ms)
    ... validate.plan_violations(...), then an executor runs the plan and
        calls ``stop_rules`` for its IterationResult ...
    successor, violations = publish(manifest, ticked, plan, result)

``stop_rules`` is the one definition of which slots completed, emitted,
finished (and why) or failed once a plan ran: the model executor, the
simulated executor and the kit's fixture executor differ only in the
tokens they produce.
"""

from __future__ import annotations

from typing import Dict, Optional

import jax
import jax.numpy as jnp

from scheduler import apply as apply_lib
from scheduler import records as rec
from scheduler import validate


def plan_iteration(policy, manifest: rec.WorkloadManifest, state: rec.SchedulerState,
                   view, now_ms):
  """Publishes the clock (``apply.tick``) and asks the policy for the
  iteration's one plan on the online projection (hidden truth removed).

  Args:
    view: the ``AllocatorView`` the policy reads.
    now_ms: f32[] the iteration's launch time (ms).
  Returns ``(ticked state, plan)``; the plan is unchecked
  (``validate.plan_violations``).
  """
  ticked = apply_lib.tick(state, now_ms)
  return ticked, policy(manifest.online(), ticked, view)


def stop_rules(manifest: rec.WorkloadManifest, state: rec.SchedulerState,
               plan: rec.IterationPlan, token, *, is_eos, emit_ms=0.0,
               stop_ids: Optional[jax.Array] = None, finite: Optional[jax.Array] = None,
               fail: Optional[jax.Array] = None,
               max_model_len: Optional[int] = None) -> rec.IterationResult:
  """The ``IterationResult`` of one executed plan.

  A selected slot completes its interval unless it fails; it emits when it
  ran a decode row or its prompt's last chunk; an emission finishes the
  request by the first rule that matches: a stop id, EOS, length
  (``max_tokens`` outputs, or the context ``max_model_len`` full).

  Args:
    token: i32[R] the token each slot produced (read where it emits).
    is_eos: bool[R] the token ends the request as EOS (the caller applies
      ``ignore_eos``; simulated executors: the hidden length reached).
    emit_ms: f32[] the outputs' publication time (ms).
    stop_ids: i32[R, S] each slot's stop token ids (-1 unused), or None.
    finite: bool[R] the slot's logits were finite (False: an emitting slot
      fails), or None (all finite).
    fail: bool[R] selected slots whose execution fails outright, or None.
    max_model_len: static context length, or None (no context rule).
  """
  p = manifest.prompt_len
  emits = plan.selected & ((plan.kind == rec.DECODE_ROW) | (
      (plan.kind == rec.PREFILL_CHUNK) & (plan.end == p)))
  failed = jnp.zeros_like(plan.selected)
  if finite is not None:
    failed = emits & ~finite
  if fail is not None:
    failed = failed | (fail & plan.selected)
  emitted = emits & ~failed
  done = plan.selected & ~failed
  new_e = state.emitted + 1
  is_stop = (jnp.zeros_like(emits) if stop_ids is None
             else jnp.any(token[:, None] == stop_ids, axis=1))
  at_length = new_e >= manifest.max_tokens
  if max_model_len is not None:
    at_length = at_length | (p + new_e >= max_model_len)
  reason = jnp.select([is_stop, is_eos, at_length],
                      [rec.FINISH_STOP, rec.FINISH_EOS, rec.FINISH_LENGTH],
                      rec.NOT_FINISHED)
  finished = emitted & (reason != rec.NOT_FINISHED)
  return rec.IterationResult(
      decision_id=plan.decision_id,
      input_state_version=plan.input_state_version,
      completed=done,
      completed_end=jnp.where(done, plan.end, state.computed),
      emitted=emitted,
      token=jnp.where(emitted, token, -1),
      emit_ms=jnp.asarray(emit_ms, jnp.float32),
      finished=finished,
      finish_reason=jnp.where(finished, reason, rec.NOT_FINISHED).astype(jnp.int32),
      failed=failed,
      service_rows=jnp.where(done, plan.end - plan.start, 0))


def publish(manifest: rec.WorkloadManifest, state: rec.SchedulerState,
            plan: rec.IterationPlan, result: rec.IterationResult
            ) -> tuple[rec.SchedulerState, Dict[str, jax.Array]]:
  """Checks the result against the plan and the state it was made on, and
  applies it (``apply.apply``, the only writer).

  Returns ``(successor, violations)``: ``validate.result_violations``'s
  rule -> bool[R] (reduce with ``validate.any_violation``); the successor
  is meaningful only when none is set.
  """
  violations = validate.result_violations(plan, state, manifest, result)
  return apply_lib.apply(manifest, state, plan, result), violations
