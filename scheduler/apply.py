"""The only writer of the successor SchedulerState (§0x01A, §0x03).

A plan alone never advances a counter: ``apply`` publishes completed
intervals, emitted outputs and their clocks, terminal events, queue intents
the plan made (admission, recompute preemption) and completed-service debits
(per client, from the result's completed rows, never from the plan), and
the speculation facts (draft tokens verified and accepted, per request and
per client).
A preempted request keeps the exact KV prefix its preservation fact
reports (``IterationResult.preserved_end``: pages copied to host memory and
back) or restarts from 0 (recompute). Completed rows below a
preempted request's old frontier (``rebuild_target``: REBUILD rows, or a
prompt re-run after a preemption during prefill) restore cache: they are
counted in ``recompute_rows``, never as fairness service (§0x0C). A policy
with state of its own (``SchedulerState.policy_state``: VTC's counters,
MLFQ's levels, ...) advances it through its pure ``update`` hook, which
``apply`` calls with the same completed result; nothing else writes it but
``arrive`` and ``forget_client``, which restart its ``PerSlot`` /
``PerClient`` columns for a new request or client.
"""

from __future__ import annotations

import jax.numpy as jnp

from scheduler import records as rec


def apply(manifest: rec.WorkloadManifest, state: rec.SchedulerState,
          plan: rec.IterationPlan,
          result: rec.IterationResult) -> rec.SchedulerState:
  """Successor state from a validated ``(plan, result)`` pair.

  Shapes follow ``scheduler.records``. Pure and jit-compatible; the caller
  validates first (``scheduler.validate``).
  """
  completed = result.completed
  computed = jnp.where(completed, result.completed_end, state.computed)
  # A verified row emits its accepted drafts too (speculative decoding).
  accepted = rec.num_accepted(result)
  emitted_now = jnp.where(result.emitted, 1 + accepted, 0)
  emitted = state.emitted + emitted_now
  first_token_ms = jnp.where(result.emitted & (state.emitted == 0),
                             result.emit_ms, state.first_token_ms)
  last_token_ms = jnp.where(result.emitted, result.emit_ms, state.last_token_ms)

  status = jnp.where(plan.admit & completed, rec.RUNNING, state.status)
  # Preemption: pages released, new generation; the frontier falls back to
  # the exact prefix the preservation path kept (``preserved_end``, §0x0C),
  # 0 for recompute.
  preempted = plan.preempt
  status = jnp.where(preempted, rec.WAITING, status)
  kept = 0 if result.preserved_end is None else result.preserved_end
  computed = jnp.where(preempted, kept, computed)
  generation = state.generation + preempted.astype(jnp.int32)

  ended = result.finished | result.failed
  status = jnp.where(ended, rec.FINISHED, status)
  finish_reason = jnp.where(
      result.finished, result.finish_reason,
      jnp.where(result.failed, rec.FINISH_ERROR, state.finish_reason))

  changed = completed | preempted | ended | plan.admit
  # Completed rows below the frontier a request had when it was preempted
  # (T_target) recompute lost cache: REBUILD rows, and the prompt rows of a
  # request preempted during its prefill (their kind stays PREFILL_CHUNK).
  # They are recompute, never service (§0x0C).
  target = state.rebuild_target
  if target is None:
    redo = jnp.where(completed & (plan.kind == rec.REBUILD), result.service_rows, 0)
  else:
    redo = jnp.where(completed, jnp.clip(jnp.minimum(plan.end, target) - plan.start,
                                         0, result.service_rows), 0)
    target = jnp.where(preempted, jnp.maximum(target, state.computed), target)
  # §0x06 online facts: the realized length of a request that ended
  # (eos / stop / length) joins the completed-output histogram; extensions
  # the plan granted are counted once their row completed.
  done = result.finished & ~result.failed & (result.finish_reason >= rec.FINISH_EOS) & (
      result.finish_reason <= rec.FINISH_LENGTH)
  hist = state.completed_outputs
  if hist is not None:
    hist = hist.at[jnp.minimum(emitted, hist.shape[0] - 1)].add(done.astype(jnp.int32))
  extensions = state.num_extensions
  if extensions is not None and plan.extend is not None:
    extensions = extensions + (plan.extend & completed).astype(jnp.int32)
  drafts = jnp.where(completed, rec.num_draft(plan), 0)
  taken = jnp.where(completed, accepted, 0)
  # A row that did not end its request stopped accepting at a rejection.
  rejected = (completed & ~result.finished & (taken < drafts)).astype(jnp.int32)
  # Per-client counters: service, recompute, the ended requests' count and
  # outputs (the online facts of a per-client output-length mean,
  # ``scheduler.policy_length``) and draft counts, each the sum of a
  # per-slot column over the client's slots. One scatter of every column
  # the state keeps: XLA:CPU runs a scatter as a loop over its R updates,
  # one loop per column before (docs/archive/benchmarks-log.md "The
  # overloaded hour's iteration"). Integer sums: the same values.
  columns = {"service_rows": jnp.where(completed, result.service_rows - redo, 0),
             "recompute_rows": redo,
             "client_completed_requests": done,
             "client_completed_outputs": jnp.where(done, emitted, 0),
             "client_draft_tokens": drafts,
             "client_accepted_tokens": taken,
             "client_draft_rejections": rejected}
  columns = {name: col for name, col in columns.items() if getattr(state, name) is not None}
  counters = jnp.zeros((state.service_rows.shape[0], len(columns)), jnp.int32).at[
      manifest.client].add(jnp.stack([col.astype(jnp.int32) for col in columns.values()], 1))
  client = {name: getattr(state, name) + counters[:, j] for j, name in enumerate(columns)}
  add = lambda a, v: None if a is None else a + v
  successor = state.replace(
      draft_tokens=add(state.draft_tokens, drafts),
      accepted_tokens=add(state.accepted_tokens, taken),
      draft_rejections=add(state.draft_rejections, rejected),
      client_draft_tokens=client.get("client_draft_tokens"),
      client_accepted_tokens=client.get("client_accepted_tokens"),
      client_draft_rejections=client.get("client_draft_rejections"),
      decision_id=state.decision_id + 1,
      state_version=state.state_version + 1,
      now_ms=jnp.maximum(state.now_ms, result.emit_ms),
      status=status.astype(jnp.int32),
      generation=generation,
      snapshot_version=state.snapshot_version + changed.astype(jnp.int32),
      emitted=emitted,
      computed=computed,
      committed=computed,
      first_token_ms=first_token_ms,
      last_token_ms=last_token_ms,
      finish_reason=finish_reason.astype(jnp.int32),
      num_preemptions=state.num_preemptions + preempted.astype(jnp.int32),
      service_rows=client["service_rows"],
      recompute_rows=client.get("recompute_rows"),
      rebuild_target=target,
      completed_outputs=hist,
      num_extensions=extensions,
      client_completed_requests=client.get("client_completed_requests"),
      client_completed_outputs=client.get("client_completed_outputs"))
  update = getattr(plan.policy, "update", None)
  if update is not None:
    policy_state = update(manifest, state, plan, result, successor)
    if isinstance(policy_state, rec.SchedulerState):
      raise TypeError(f"{type(plan.policy).__name__}.update must return the policy's "
                      f"own state (the new SchedulerState.policy_state), not a "
                      f"SchedulerState (docs/writing-a-policy.md)")
    successor = successor.replace(policy_state=policy_state)
  return successor


def tick(state: rec.SchedulerState, now_ms) -> rec.SchedulerState:
  """Publishes the engine clock (monotonic: never moves back)."""
  return state.replace(now_ms=jnp.maximum(state.now_ms, jnp.float32(now_ms)))


def restamp_emissions(state: rec.SchedulerState, emitted, stamp_ms, actual_ms
                      ) -> rec.SchedulerState:
  """Moves one iteration's emission times from the stamp written when it
  was launched to the time its outputs were published.

  Args:
    emitted: bool[R] slots that emitted in that iteration.
    stamp_ms, actual_ms: f32[] the stamp written and the publication time
      (ms, engine clock).
  A slot is moved only while its clocks still hold the stamp (a slot
  refilled since holds -1), so a policy reads the times an iteration run
  program by program would have written; the clock moves to ``actual_ms``
  (monotonic) when any slot moved.
  """
  hit = emitted & (state.last_token_ms == stamp_ms)
  first = hit & (state.emitted == 1) & (state.first_token_ms == stamp_ms)
  return state.replace(
      first_token_ms=jnp.where(first, actual_ms, state.first_token_ms),
      last_token_ms=jnp.where(hit, actual_ms, state.last_token_ms),
      now_ms=jnp.maximum(state.now_ms, jnp.where(jnp.any(hit), actual_ms,
                                                  state.now_ms)))


def shift_clock(manifest: rec.WorkloadManifest, state: rec.SchedulerState, shift_ms):
  """(manifest, state) with every device time minus ``shift_ms`` (f32[], ms):
  arrivals, the clock, and the emission clocks that are set (-1 = none
  stays -1). Differences between times are unchanged; the engine rebases
  its clock with it so f32 milliseconds keep their resolution."""
  shift = lambda t: jnp.where(t >= 0, t - shift_ms, t)
  return (manifest.replace(arrival_ms=manifest.arrival_ms - shift_ms),
          state.replace(now_ms=state.now_ms - shift_ms,
                        first_token_ms=shift(state.first_token_ms),
                        last_token_ms=shift(state.last_token_ms)))


def forget_client(state: rec.SchedulerState, index) -> rec.SchedulerState:
  """Zeroes client ``index``'s counters (i32[] index into the C tables) and
  restarts the policy state's ``PerClient`` columns there, so the table row
  can be given to a new client."""
  zero = lambda a: None if a is None else a.at[index].set(jnp.zeros((), a.dtype))
  return state.replace(
      service_rows=zero(state.service_rows), recompute_rows=zero(state.recompute_rows),
      client_completed_requests=zero(state.client_completed_requests),
      client_completed_outputs=zero(state.client_completed_outputs),
      client_draft_tokens=zero(state.client_draft_tokens),
      client_accepted_tokens=zero(state.client_accepted_tokens),
      client_draft_rejections=zero(state.client_draft_rejections),
      policy_state=rec.restart(state.policy_state, rec.PerClient, index))


def arrive(manifest: rec.WorkloadManifest, state: rec.SchedulerState, slot,
           request_id, arrival_ms, arrival_seq, prompt_len, max_tokens,
           priority, client, ttft_ms=float("inf"), tbt_ms=float("inf"),
           cached_prefix_tokens=0, received_tokens=0):
  """A declared request enters a FREE slot as WAITING, ready, generation 0.

  ``ttft_ms`` / ``tbt_ms`` are its declared SLO limits (ms, +inf = none);
  they are recorded when the manifest carries SLO fields. The policy
  state's ``PerSlot`` columns (MLFQ level, quantum used, wait, ...) restart
  for the new request.
  ``cached_prefix_tokens`` is the prefix hit the allocator mapped into the
  slot's page table (``serving.kv.prefix_cache``; < prompt_len): the request's
  computed and committed frontiers start there.
  ``received_tokens`` > 0: a request handed over by a prefill engine
  (``serving.kv.transfer``) with the KV of its whole prompt (= prompt_len)
  and its first token: its frontiers start at ``received_tokens``, one
  token is emitted, at ``arrival_ms`` (the time it was received), and its
  next row is a decode row. Its pages are written when it is admitted.
  Returns ``(manifest, state)``; the state version is bumped.
  """
  set_ = lambda a, v: a.at[slot].set(jnp.asarray(v, a.dtype))
  received = jnp.asarray(received_tokens, jnp.int32)
  start = jnp.maximum(jnp.asarray(cached_prefix_tokens, jnp.int32), received)
  token_ms = jnp.where(received > 0, jnp.asarray(arrival_ms, jnp.float32), -1.0)
  if manifest.ttft_ms is not None:
    manifest = manifest.replace(ttft_ms=set_(manifest.ttft_ms, ttft_ms))
  if manifest.tbt_ms is not None:
    manifest = manifest.replace(tbt_ms=set_(manifest.tbt_ms, tbt_ms))
  if state.rebuild_target is not None:
    state = state.replace(rebuild_target=set_(state.rebuild_target, 0))
  if state.num_extensions is not None:
    state = state.replace(num_extensions=set_(state.num_extensions, 0))
  if state.draft_tokens is not None:
    state = state.replace(draft_tokens=set_(state.draft_tokens, 0),
                          accepted_tokens=set_(state.accepted_tokens, 0),
                          draft_rejections=set_(state.draft_rejections, 0))
  state = state.replace(policy_state=rec.restart(state.policy_state, rec.PerSlot, slot))
  manifest = manifest.replace(
      request_id=set_(manifest.request_id, request_id),
      arrival_ms=set_(manifest.arrival_ms, arrival_ms),
      arrival_seq=set_(manifest.arrival_seq, arrival_seq),
      prompt_len=set_(manifest.prompt_len, prompt_len),
      max_tokens=set_(manifest.max_tokens, max_tokens),
      priority=set_(manifest.priority, priority),
      client=set_(manifest.client, client))
  state = state.replace(
      state_version=state.state_version + 1,
      status=set_(state.status, rec.WAITING),
      ready=set_(state.ready, True),
      generation=set_(state.generation, 0),
      snapshot_version=state.snapshot_version.at[slot].add(1),
      emitted=set_(state.emitted, jnp.where(received > 0, 1, 0)),
      computed=set_(state.computed, start),
      committed=set_(state.committed, start),
      first_token_ms=set_(state.first_token_ms, token_ms),
      last_token_ms=set_(state.last_token_ms, token_ms),
      finish_reason=set_(state.finish_reason, rec.NOT_FINISHED),
      num_preemptions=set_(state.num_preemptions, 0))
  return manifest, state


def resume_from_prefix(state: rec.SchedulerState, slot, cached_prefix_tokens
                       ) -> rec.SchedulerState:
  """A recompute-preempted request, waiting with nothing computed, resumes
  from the cached prefix the allocator mapped back into its page table
  (``serving.kv.prefix_cache``): computed and committed start there. Rows
  below its ``rebuild_target`` stay recompute, as before."""
  set_ = lambda a, v: a.at[slot].set(jnp.asarray(v, a.dtype))
  return state.replace(
      state_version=state.state_version + 1,
      snapshot_version=state.snapshot_version.at[slot].add(1),
      computed=set_(state.computed, cached_prefix_tokens),
      committed=set_(state.committed, cached_prefix_tokens))


def cancel(state: rec.SchedulerState, mask) -> rec.SchedulerState:
  """Live slots in ``mask`` (bool[R]) end with FINISH_ABORT."""
  live = mask & ((state.status == rec.WAITING) | (state.status == rec.RUNNING))
  return state.replace(
      state_version=state.state_version + 1,
      status=jnp.where(live, rec.FINISHED, state.status),
      generation=state.generation + live.astype(jnp.int32),
      snapshot_version=state.snapshot_version + live.astype(jnp.int32),
      finish_reason=jnp.where(live, rec.FINISH_ABORT, state.finish_reason))


def release(state: rec.SchedulerState, mask) -> rec.SchedulerState:
  """FINISHED slots in ``mask`` (drained by the host) become FREE."""
  done = mask & (state.status == rec.FINISHED)
  return state.replace(
      state_version=state.state_version + 1,
      status=jnp.where(done, rec.FREE, state.status),
      ready=jnp.where(done, False, state.ready))
