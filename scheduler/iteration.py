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
               max_model_len: Optional[int] = None,
               verified: Optional[jax.Array] = None) -> rec.IterationResult:
  """The ``IterationResult`` of one executed plan.

  A selected slot completes its interval unless it fails; it emits when it
  ran a decode row or its prompt's last chunk; an emission finishes the
  request by the first rule that matches: a stop id, EOS, length
  (``max_tokens`` outputs, or the context ``max_model_len`` full).

  Speculative decoding (``token`` of shape [R, W]): a decode row that
  verified ``verified`` of its drafts offers ``1 + verified`` tokens, the
  target's own tokens at its first rows (a draft equal to it, then the
  token after the last accepted draft). They are emitted in order up to and
  including the first that ends the request by the rules above, so no token
  past an ending one is published; the result's ``accepted`` counts the
  drafts emitted and the computed frontier moves past them only.

  Args:
    token: i32[R] the token each slot produced (read where it emits), or
      i32[R, W] with ``verified``: the tokens of its first W rows.
    is_eos: bool[R] (or bool[R, W]) the token ends the request as EOS (the
      caller applies ``ignore_eos``; simulated executors: the hidden length
      reached).
    emit_ms: f32[] the outputs' publication time (ms).
    stop_ids: i32[R, S] each slot's stop token ids (-1 unused), or None.
    finite: bool[R] the slot's logits were finite (False: an emitting slot
      fails), or None (all finite).
    fail: bool[R] selected slots whose execution fails outright, or None.
    max_model_len: static context length, or None (no context rule).
    verified: i32[R] leading drafts equal to the target's tokens (< W), or
      None (no speculation).
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
  spec = token.ndim == 2
  tok = token if spec else token[:, None]                                  # [R, W]
  eos = is_eos if spec else is_eos[:, None]
  width = tok.shape[1]
  j = jnp.arange(width, dtype=jnp.int32)
  new_e = state.emitted[:, None] + 1 + j[None, :]
  is_stop = (jnp.zeros_like(eos) if stop_ids is None
             else jnp.any(tok[:, :, None] == stop_ids[:, None, :], axis=2))
  at_length = new_e >= manifest.max_tokens[:, None]
  if max_model_len is not None:
    at_length = at_length | (p[:, None] + new_e >= max_model_len)
  reasons = jnp.select([is_stop, eos, at_length],
                       [rec.FINISH_STOP, rec.FINISH_EOS, rec.FINISH_LENGTH],
                       rec.NOT_FINISHED)                                   # [R, W]
  offered = 1 if verified is None else jnp.where(emits, verified, 0) + 1
  ends = (reasons != rec.NOT_FINISHED) & (j[None, :] < jnp.reshape(offered, (-1, 1)))
  first_end = jnp.where(jnp.any(ends, axis=1), jnp.argmax(ends, axis=1), width)
  count = jnp.minimum(offered, first_end + 1)                               # [R]
  last = jnp.broadcast_to(count - 1, p.shape)
  rows = jnp.arange(p.shape[0])
  reason = reasons[rows, last]
  finished = emitted & (reason != rec.NOT_FINISHED)
  accepted = jnp.where(emitted, last, 0).astype(jnp.int32)
  completed_end = jnp.where(done, plan.end - jnp.where(emits, rec.num_draft(plan) - accepted, 0),
                            state.computed)
  result = rec.IterationResult(
      decision_id=plan.decision_id,
      input_state_version=plan.input_state_version,
      completed=done,
      completed_end=completed_end,
      emitted=emitted,
      token=jnp.where(emitted, tok[rows, last], -1),
      emit_ms=jnp.asarray(emit_ms, jnp.float32),
      finished=finished,
      finish_reason=jnp.where(finished, reason, rec.NOT_FINISHED).astype(jnp.int32),
      failed=failed,
      service_rows=jnp.where(done, completed_end - plan.start, 0))
  if not spec:
    return result
  return result.replace(
      accepted=accepted,
      tokens=jnp.where(emitted[:, None] & (j[None, :] <= accepted[:, None]), tok, -1))


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
