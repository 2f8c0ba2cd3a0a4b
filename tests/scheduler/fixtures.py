"""Fixture builders, a fixture executor and small fixture-only policies.

* ``build`` turns a list of request declarations into a (manifest, state)
  pair; ``hidden`` (realized total output tokens) goes only into the
  manifest's fixture-only field.
* ``fixture_execute`` (the conformance kit's, ``scheduler.conformance``)
  is a simulated executor: it completes every planned interval, emits
  outputs on the §0x01A token clock and stops a request when it reaches its
  hidden realized length (EOS) or its declared cap (length).
* ``replay_step`` is one whole iteration as one pure function, built on the
  body every driver shares (``scheduler.iteration``): tick and the policy on
  the online projection -> plan predicates -> fixture executor -> result
  predicates and ``apply``; jit it with the policy static.
* ``least_slack_replay`` is the §0x07 burst/saturation teaching selector
  (least predicted slack under ``exclusive_endpoint_lower_bound_v1``) with an
  optional live-request cap; ``fixed_cohort_replay`` is the §0x02 fixed
  request-batch policy. Both are fixture policies, not the policy library.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from scheduler import iteration
from scheduler import records as rec
from scheduler import validate
from scheduler.conformance import fixture_execute


# ---------------------------------------------------------------- builders


def build(requests: Sequence[Dict], *, num_slots: int, num_clients: int = 2,
          decision_id: int = 0, state_version: int = 0, now_ms: float = 0.0,
          policy_id: str = "", policy_version: str = ""):
  """(WorkloadManifest, SchedulerState) from request declarations.

  Each request is a dict with ``slot`` and any of: request_id, arrival_ms,
  arrival_seq, prompt_len, max_tokens, priority, client, status, ready,
  generation, snapshot, emitted, computed, hidden (fixture-only realized
  total output tokens). Unlisted slots are FREE. Committed equals computed
  (an ordinary decision boundary).
  """
  m = rec.empty_manifest(num_slots)
  s = rec.initial_state(num_slots, num_clients)
  arr = {k: np.asarray(v).copy() for k, v in
         {**dataclasses.asdict(m), **dataclasses.asdict(s)}.items()
         if v is not None and k not in ("policy_id", "policy_version")}
  hidden = np.zeros(num_slots, np.int32)
  fields = dict(request_id="request_id", arrival_ms="arrival_ms",
                arrival_seq="arrival_seq", prompt_len="prompt_len",
                max_tokens="max_tokens", priority="priority", client="client",
                status="status", ready="ready", generation="generation",
                snapshot="snapshot_version", emitted="emitted",
                computed="computed")
  for r in requests:
    slot = r["slot"]
    arr["status"][slot] = rec.WAITING
    arr["ready"][slot] = True
    arr["max_tokens"][slot] = 16
    for key, name in fields.items():
      if key in r:
        arr[name][slot] = r[key]
    arr["committed"][slot] = arr["computed"][slot]
    hidden[slot] = r.get("hidden", 0)
  j = {k: jnp.asarray(v) for k, v in arr.items()}
  manifest = rec.WorkloadManifest(
      request_id=j["request_id"], arrival_ms=j["arrival_ms"],
      arrival_seq=j["arrival_seq"], prompt_len=j["prompt_len"],
      max_tokens=j["max_tokens"], priority=j["priority"], client=j["client"],
      hidden_realized_output_tokens=(jnp.asarray(hidden) if any(
          "hidden" in r for r in requests) else None),
      policy_id=policy_id, policy_version=policy_version)
  state = s.replace(  # policy counters keep their initial_state values
      decision_id=jnp.int32(decision_id), state_version=jnp.int32(state_version),
      now_ms=jnp.float32(now_ms), status=j["status"], ready=j["ready"],
      generation=j["generation"], snapshot_version=j["snapshot_version"],
      emitted=j["emitted"], computed=j["computed"], committed=j["committed"],
      first_token_ms=j["first_token_ms"], last_token_ms=j["last_token_ms"],
      finish_reason=j["finish_reason"], num_preemptions=j["num_preemptions"],
      service_rows=j["service_rows"])
  return manifest, state


def alloc_view(state: rec.SchedulerState, *, num_pages: int,
               page_size: int) -> rec.AllocatorView:
  """Allocator facts of a cache that holds exactly the committed rows."""
  live = (state.status == rec.WAITING) | (state.status == rec.RUNNING)
  held = jnp.where(live, (state.committed + page_size - 1) // page_size, 0)
  return rec.AllocatorView(free_pages=jnp.int32(num_pages) - jnp.sum(held),
                           pages_held=held.astype(jnp.int32), page_size=page_size)


# ---------------------------------------------------------------- executor


def replay_step(policy, manifest, state, emit_ms, *, num_pages: int, page_size: int):
  """One iteration: plan -> validate -> execute -> validate -> apply.

  Returns ``(next_state, plan, result, plan_bits, result_bits)``; the bits are
  ``validate.any_violation`` masks (0 = legal). Pure: jit with ``policy``,
  ``num_pages`` and ``page_size`` static.
  """
  online = manifest.online()
  view = alloc_view(state, num_pages=num_pages, page_size=page_size)
  state, plan = iteration.plan_iteration(policy, manifest, state, view, emit_ms)
  plan_bits = validate.any_violation(validate.plan_violations(online, state, plan))
  result = fixture_execute(manifest, state, plan, emit_ms)
  successor, violations = iteration.publish(online, state, plan, result)
  return successor, plan, result, plan_bits, validate.any_violation(violations)


def plan(policy, manifest, state, view) -> rec.IterationPlan:
  """``policy(manifest, state, view)``; ``plan_jit`` compiles it once per
  (policy, shapes)."""
  return policy(manifest, state, view)


plan_jit = jax.jit(plan, static_argnums=0)

replay_step_jit = jax.jit(replay_step,
                          static_argnames=("policy", "num_pages", "page_size"))


# ---------------------------------------------------------------- §0x01A


def iteration5_fixture():
  """The §0x01A Loop 2 cut at iteration 5: ``(manifest, state, names)``.

  Slots 0..4 hold req-A..req-E. Reconstructed inputs (the article gives the
  selected intervals, snapshots and generations; the rest is derived from
  them): req-A:0 waiting, 4-token prompt, c = 0; req-B:2 decode with p = 3,
  e = 1, c = 3 and hidden realized length 2 (EOS this iteration); req-C:1
  decode with p = 2, e = 2, c = 3; req-D:0 waiting with foreign readiness
  false; req-E:4 terminal. req-A and req-B belong to client-alpha (0), req-C
  to client-beta (1). decision_id 5, state_version 7.
  """
  names = ("req-A", "req-B", "req-C", "req-D", "req-E")
  reqs = [
      dict(slot=0, request_id=0, arrival_seq=2, prompt_len=4, status=rec.WAITING,
           generation=0, snapshot=3, client=0, hidden=3),
      dict(slot=1, request_id=1, arrival_seq=0, prompt_len=3, status=rec.RUNNING,
           generation=2, snapshot=9, emitted=1, computed=3, client=0, hidden=2),
      dict(slot=2, request_id=2, arrival_seq=1, prompt_len=2, status=rec.RUNNING,
           generation=1, snapshot=6, emitted=2, computed=3, client=1, hidden=5),
      dict(slot=3, request_id=3, arrival_seq=3, prompt_len=4, status=rec.WAITING,
           ready=False, generation=0, snapshot=1, client=1, hidden=2),
      dict(slot=4, request_id=4, arrival_seq=4, prompt_len=2, status=rec.FINISHED,
           generation=4, snapshot=5, emitted=1, computed=2, client=1, hidden=1),
  ]
  manifest, state = build(reqs, num_slots=6, num_clients=2, decision_id=5,
                          state_version=7, policy_id="sarathi_serve",
                          policy_version="1")
  return manifest, state, names


# ---------------------------------------------------------------- §0x02


def fixed_cohort_replay(lengths: Dict[str, int], arrival_cut: Dict[str, int],
                        num_slots: int) -> List[List[Optional[str]]]:
  """Fixed request-batch membership (§0x02), one entry per iteration.

  A cohort of up to ``num_slots`` arrived requests (FIFO) is frozen until its
  longest member finishes; a request with realized length G occupies its
  slot for G slot-iterations (one prefill + G - 1 decodes), then the slot
  idles behind the barrier (None). Realized lengths are execution facts
  learned from stop results; the membership rule never reads them ahead.
  """
  pending = sorted(lengths, key=lambda r: (arrival_cut[r], r))
  timeline, cut = [], 0
  while pending:
    cohort = [r for r in pending if arrival_cut[r] <= cut][:num_slots]
    if not cohort:
      timeline.append([None] * num_slots)
      cut += 1
      continue
    left = {r: lengths[r] for r in cohort}
    while any(left.values()):
      row = [r if left[r] > 0 else None for r in cohort]
      row += [None] * (num_slots - len(row))
      timeline.append(row)
      for r in cohort:
        left[r] = max(left[r] - 1, 0)
      cut += 1
    pending = [r for r in pending if r not in cohort]
  return timeline


# ---------------------------------------------------------------- §0x07


@dataclasses.dataclass
class SloRequest:
  """One request of the §0x07 replay (times in ms)."""

  rid: int
  arrival_ms: float
  outputs: int                       # offline realized outputs (executor-side)
  emit_ms: List[float] = dataclasses.field(default_factory=list)
  rejected: bool = False
  selected_negative_slack: bool = False


def least_slack_replay(arrivals_ms: Sequence[float], *, outputs: int = 2,
                       tick_ms: float = 10.0, rows_per_tick: int = 2,
                       ttft_ms: float = 30.0, tbt_ms: float = 20.0,
                       live_cap: Optional[int] = None,
                       window_ms: Optional[float] = None) -> List[SloRequest]:
  """Least-predicted-slack selection on a tick clock (§0x07).

  Model ``exclusive_endpoint_lower_bound_v1``: every candidate's next endpoint
  takes one unit, so ``predicted_finish = now + tick``. Deadlines: original
  arrival + TTFT for the first output, previous emission + TBT after it.
  Order key: (slack, next token before first token, arrival, id). With
  ``live_cap`` an arrival is rejected when ``live_cap`` admitted requests are
  unfinished at its arrival tick. Outputs of a tick are published at its end;
  the replay stops at ``window_ms`` (or when all work is done).
  """
  reqs = [SloRequest(i, float(a), outputs) for i, a in enumerate(arrivals_ms)]
  todo = sorted(reqs, key=lambda r: (r.arrival_ms, r.rid))
  live: List[SloRequest] = []
  now = 0.0
  while todo or live:
    if window_ms is not None and now + tick_ms > window_ms:
      break
    while todo and todo[0].arrival_ms <= now:
      r = todo.pop(0)
      if live_cap is not None and len(live) >= live_cap:
        r.rejected = True
      else:
        live.append(r)
    cands = []
    for r in live:
      deadline = (r.arrival_ms + ttft_ms if not r.emit_ms
                  else r.emit_ms[-1] + tbt_ms)
      slack = deadline - (now + tick_ms)
      cands.append((slack, 0 if r.emit_ms else 1, r.arrival_ms, r.rid, r))
    cands.sort(key=lambda t: t[:4])
    for slack, _, _, _, r in cands[:rows_per_tick]:
      r.selected_negative_slack |= slack < 0
      r.emit_ms.append(now + tick_ms)
    live = [r for r in live if len(r.emit_ms) < r.outputs]
    now += tick_ms
  return reqs


def slo_outcomes(reqs: Sequence[SloRequest], *, ttft_ms: float, tbt_ms: float):
  """Per-request outcome: valid / missed / rejected / open (§0x07)."""
  out = {}
  for r in reqs:
    if r.rejected:
      out[r.rid] = "rejected"
    elif len(r.emit_ms) < r.outputs:
      out[r.rid] = "open"
    else:
      ok = r.emit_ms[0] - r.arrival_ms <= ttft_ms and all(
          b - a <= tbt_ms for a, b in zip(r.emit_ms, r.emit_ms[1:]))
      out[r.rid] = "valid" if ok else "missed"
  return out
