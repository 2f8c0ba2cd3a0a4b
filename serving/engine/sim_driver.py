"""The host side of ``Engine.simulate``: many iterations per program call.

``simulate`` drives an engine with the simulated executor on a virtual
clock through the ``loop`` program (``serving.engine.sim_loop``): it moves
arrivals whose time has come into the pending queue, jumps the clock over
idle gaps, queues the next arrivals for the device to admit, runs one loop
call, and takes its log (``take_log``) into the same host records
``Engine.step`` keeps; an iteration that needs the host is run by
``Engine.step``.

The loop's iterations are those ``Engine.step`` runs: the same plans,
outputs and counters, and the same times (the device repeats the host's
float64 clock arithmetic; XLA may round a step time's last bit otherwise:
``sim_loop``). The iterations that need the host are a plan rule
violation, a never-schedulable request, a preemption or a preempted
request's re-admission, an empty plan, and the device epoch to move; a
step whose result breaks a rule ends the call, and ``simulate`` raises
that rule's error from the tables ``Engine.step`` would raise on. When
``simulate`` returns at ``stop_ms``, the requests that have arrived by
then are pending.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Dict, List, Optional

import jax
import numpy as np

from scheduler import records as rec
from scheduler import validate
from serving.engine import clocks
from serving.engine import sim_loop
from serving.engine.facts import Arrival
from serving.engine.requests import Request


@dataclasses.dataclass
class LoopRuns:
  """How ``simulate`` ran an engine (``Engine.loop_runs``), so a report can
  say how much of a simulation the loop covered and why the rest fell back.

  Attributes:
    programs: the ``loop`` programs used (one per iterations-per-call and
      slot-table size; ``Engine.compiled_programs`` counts their compiles).
    loop_iterations: iterations the loop program committed.
    host_iterations: iterations ``simulate`` ran as ``Engine.step`` because
      the loop returned for the host (``LoopExit.HOST`` / ``REBASE``).
    exits: loop program calls per ``LoopExit`` name (why each call
      returned; their sum is the number of calls).
    resource_readers: a list per ``ledger.ResourceSampler`` on the engine
      (each adds its own), to which ``simulate`` adds f64[n, 6] blocks: a
      row ``(iteration, *resource_sample)`` for every iteration it runs,
      loop or host (``iteration``: ``Engine.num_iterations`` after it). Each
      reader empties its own list; rows kept for one never read grow with
      the run (48 bytes an iteration).
  """

  programs: list = dataclasses.field(default_factory=list)
  loop_iterations: int = 0
  host_iterations: int = 0
  exits: Dict[str, int] = dataclasses.field(default_factory=collections.Counter)
  resource_readers: List[list] = dataclasses.field(default_factory=list)

  def summary(self) -> dict:
    """The counts as JSON: calls, loop and host iterations, the loop's
    share of the iterations (None before any), exits by name."""
    total = self.loop_iterations + self.host_iterations
    return {"calls": sum(self.exits.values()), "loop_iterations": self.loop_iterations,
            "host_iterations": self.host_iterations,
            "loop_fraction": round(self.loop_iterations / total, 6) if total else None,
            "exits": dict(sorted(self.exits.items()))}


# A resource sample's columns (``resource_sample``; ``ledger.ResourceSampler``).
SAMPLE_COLUMNS = ("t_ms", "kv_pages_live", "kv_pages_cached", "queue_len", "running")


def resource_sample(engine) -> tuple:
  """The engine's tables now, in ``SAMPLE_COLUMNS`` order (one device
  fetch): t_ms, engine ms; kv_pages_live, pages some page table holds, a
  shared prefix page once; kv_pages_cached, pages only the prefix cache
  holds; queue_len, pending requests and WAITING slots; running, RUNNING
  slots."""
  refcount, cached, status = jax.device_get((engine.pages.refcount, engine.pages.cached,
                                             engine.state.status))
  sample = dict(t_ms=round(engine.now_ms(), 3), kv_pages_live=int(np.sum(refcount > 0)),
                kv_pages_cached=int(np.sum(cached & (refcount == 0))),
                queue_len=int(np.sum(status == rec.WAITING)) + len(engine.table.pending),
                running=int(np.sum(status == rec.RUNNING)))
  return tuple(sample[name] for name in SAMPLE_COLUMNS)


def add_future_request(engine, request_id, prompt_token_ids, sampling, arrival_ms,
                       priority, client, slo_ttft_ms, slo_tpot_ms) -> Request:
  """``Engine.add_future_request`` (which documents it) on ``engine``."""
  reason = engine.loop_refusal()
  if reason is not None:
    raise ValueError(f"add_future_request: {reason}")
  table = engine.table
  last = table.future[-1].arrival_ms if table.future else engine.now_ms()
  if not arrival_ms >= last:
    raise ValueError(f"request {request_id!r}: arrival_ms {arrival_ms!r} is before "
                     f"{last!r} (now or the last future arrival); future requests "
                     f"come in arrival order")
  req = table.accept(request_id, prompt_token_ids, sampling, arrival_ms, priority, client,
                     slo_ttft_ms, slo_tpot_ms, False, False)
  if not req.finished:
    table.future.append(req)
  return req


def simulate(engine, stop_ms: float, max_iterations: Optional[int],
             iterations_per_call: int, marks: Optional[list] = None,
             until_end: bool = False) -> None:
  """``Engine.simulate`` (which documents it) on ``engine``.

  ``marks``, when a list, gets ``(ms, request_id, kind)`` for each
  request's first output token (kind "first_token") and for its end
  ("finished", any outcome), ``ms`` the end of the iteration that brought
  it (engine ms): what a caller of ``Engine.step`` reads from its outputs
  (a token in a request's first output; ``RequestOutput.finished``), at the
  time the step ended, which a router needs (``serving.harness.cluster_sim``).
  ``until_end``: also return after the first iteration that ends a request
  (the loop's ``LoopExit.END``, or a host step with a finished output).
  """
  reason = engine.loop_refusal()
  if reason is not None:
    raise ValueError(f"Engine.simulate: {reason}; use Engine.step()")
  table = engine.table
  start = engine.num_iterations
  while max_iterations is None or engine.num_iterations - start < max_iterations:
    now_ms = engine.now_ms()
    table.take_arrived(now_ms)
    if now_ms >= stop_ms:
      return
    if not table.pending and not table.num_live():
      if not table.future:
        return
      _advance_to(engine, table.future[0].arrival_ms)
      table.take_arrived(table.future[0].arrival_ms)
      continue
    engine._rebase_device_clock(engine.now_ms())
    engine._fill_slots()
    code = _call(engine, stop_ms, iterations_per_call, marks, until_end)
    if code == sim_loop.LoopExit.END:
      return
    if code in (sim_loop.LoopExit.HOST, sim_loop.LoopExit.REBASE):
      table.take_arrived(engine.now_ms())
      before = engine.num_iterations
      outputs = engine.step()
      engine.loop_runs.host_iterations += engine.num_iterations - before
      if engine.loop_runs.resource_readers and engine.num_iterations > before:
        row = np.array([[engine.num_iterations, *resource_sample(engine)]], np.float64)
        for reader in engine.loop_runs.resource_readers:
          reader.append(row)
      if marks is not None:
        step_marks(engine, outputs, marks)
      if until_end and any(out.finished for out in outputs):
        return


def step_marks(engine, outputs, marks: list) -> None:
  """Appends to ``marks`` (``simulate``'s) what ``outputs``, the news of
  the ``Engine.step`` that just ran, bring: at its end, ``engine.now_ms()``."""
  ms = engine.now_ms()
  for out in outputs:
    if out.new_token_ids and len(engine.requests[out.request_id].output_token_ids) == len(
        out.new_token_ids):
      marks.append((ms, out.request_id, "first_token"))
    if out.finished:
      marks.append((ms, out.request_id, "finished"))


def _advance_to(engine, ms: float) -> None:
  """Moves the virtual clock forward until ``engine.now_ms() >= ms``."""
  clock = engine.clock
  while engine.now_ms() < ms:
    clock.advance(max((ms - engine.now_ms()) / 1000.0, math.ulp(clock())))


def _call(engine, stop_ms: float, iterations: int, marks: Optional[list] = None,
          until_end: bool = False) -> int:
  """One ``loop`` program call from the engine's tables; takes its log
  (``marks``, ``until_end``: ``simulate``'s). Returns its exit code
  (``sim_loop.LoopExit``); on ``RESULT`` raises the broken rule's
  ``ResultValidationError`` (RuntimeError should the host check find none)."""
  c, table = engine.config, engine.table
  loop = sim_loop.loop_program(engine.model_cfg, c, engine.cost_model, engine.model_costs,
                               iterations)
  runs = engine.loop_runs
  if loop not in runs.programs:
    runs.programs.append(loop)
  epoch = engine.clocks.device_epoch_ms
  free = len(table.free_slots())
  queued = table.future[:min(sim_loop.QUEUE_SIZE, free)]
  if len(queued) < len(table.future):      # the next one waits for a free slot
    stop_ms = min(stop_ms, table.future[len(queued)].arrival_ms)
  queue = sim_loop.make_queue(
      [record for _, record in _queued_arrivals(engine, queued)],
      [r.arrival_ms for r in queued],
      [engine.realized_output_tokens.get(r.request_id, r.sampling.max_tokens)
       for r in queued],
      [r.arrival_ms == epoch for r in queued],
      Arrival.empty(c.max_model_len, c.max_stop_ids))
  at_epoch = np.array([r is not None and r.arrival_ms == epoch for r in table.slots])
  bits = sim_loop.to_bits
  # The loop carries no token stream: the simulated executor reads none,
  # and the host takes the tokens from the log (sim_loop.simulate_steps).
  tokens = engine.buffers.tokens
  engine.manifest, engine.state, engine.pages, buffers, log, rejected = loop.run(
      engine.params, engine.kv, engine.manifest, engine.state, engine.pages,
      engine.buffers.replace(tokens=None), table.realized(engine.realized_output_tokens),
      at_epoch, queue, *engine._pending_stamp(), bits(engine.clock()), bits(engine.clocks.t0),
      bits(epoch), bits(stop_ms), bits(clocks.DEVICE_REBASE_MS), np.bool_(until_end))
  engine.buffers = buffers.replace(tokens=tokens)
  log = engine._fetch(log)
  take_log(engine, log, queued, marks)
  engine.clock.advance_to(float(sim_loop.from_bits(log.clock)))
  runs.loop_iterations += int(log.num_iterations)
  runs.exits[sim_loop.LoopExit(int(log.code)).name] += 1
  if log.code == sim_loop.LoopExit.RESULT:      # Engine._commit's check, on the same tables
    engine.policy_evaluations += 1               # the policy planned the rejected step
    validate.validate_result(rejected.plan, engine.state, engine.manifest, rejected.result)
    raise RuntimeError("the loop program saw a result rule broken that "
                       "validate.validate_result does not find")
  return int(log.code)


def _queued_arrivals(engine, queued: List[Request]) -> List[tuple]:
  """(device arrival ms, ``RequestTable.arrival`` record) of each queued
  future request; a record made for an earlier call is taken again while
  the device epoch, and so its device arrival time, has not moved (a
  future request's record has nothing else that changes)."""
  table = engine.table
  made = table.future_arrivals
  out = []
  for req in queued:
    ms = engine.clocks.device_ms(req.arrival_ms)
    entry = made.get(req.uid)
    out.append(entry if entry is not None and entry[0] == ms else (ms, table.arrival(req, ms)))
  table.future_arrivals = {req.uid: entry for req, entry in zip(queued, out)}
  return out


def take_log(engine, log: sim_loop.SimLog, queued: List[Request],
             marks: Optional[list] = None) -> None:
  """The host's side of a ``loop`` call's iterations, as ``Engine.step``
  keeps them: the admitted requests' slots, each request's news
  (``RequestTable.take_news``: tokens, their times, outcomes), released slots,
  counters (``Engine.spec_counts`` with speculative decoding), each
  iteration's occupancy for ``LoopRuns.resource_readers``; ``marks``
  (``simulate``'s) gets each request's first token and end, at the
  emission time of the iteration that brought it."""
  table = engine.table
  live = table.live()
  admitted = queued[:int(log.num_admitted)]
  for req, slot in zip(admitted, log.admitted_slot):
    req.slot = int(slot)
  del table.future[:len(admitted)]
  by_uid = {r.uid: r for r in live + admitted}
  n, num_events = int(log.num_iterations), int(log.num_events)
  emit_ms = sim_loop.from_bits(log.emit[:n])
  # Events grouped by request, each request's in iteration order; an
  # ending event (finished or failed) is its request's last.
  column = lambda name: log.event_column(name, num_events)
  uid = column("request")
  order = np.argsort(uid, kind="stable")
  uids, starts = np.unique(uid[order], return_index=True)
  ends = np.append(starts[1:], num_events).tolist()
  take = lambda name: column(name)[order].tolist()
  tokens, reason, extensions = take("token"), take("reason"), take("extensions")
  failed = [bool(f) for f in take("failed")]
  finished = [bool(f) for f in take("finished")]
  times = emit_ms[column("iteration")[order]].tolist()
  if log.spec is not None:      # a verified row's tokens (speculative.emitted_tokens)
    rows = log.spec.tokens[:num_events][order]
    accepted = log.spec.accepted[:num_events][order].tolist()
    tokens = [row[:1 + n].tolist() for row, n in zip(rows, accepted)]
    engine.spec_counts.add_counts(log.spec.counts)
  for u, a, b in zip(uids.tolist(), starts.tolist(), ends):
    req, last = by_uid[u], b - 1
    emitted = last if failed[last] else b      # a failed event emits nothing
    first = not req.output_token_ids and emitted > a
    new, new_times = tokens[a:emitted], times[a:emitted]
    if log.spec is not None:
      new_times = [t for row, t in zip(new, new_times) for _ in row]
      new = [token for row in new for token in row]
    table.take_news(req, new, new_times, failed[last], finished[last], reason[last],
                    lambda: extensions[last])
    if marks is not None:
      if first:
        marks.append((times[a], req.request_id, "first_token"))
      if req.finished:
        marks.append((times[last], req.request_id, "finished"))
  for req in live:              # before the admitted: a slot may be taken again
    if req.finished:
      table.vacate(req.slot)
  for req in admitted:
    if not req.finished:
      table.place(req.slot, req)
  if engine.loop_runs.resource_readers and n:
    # resource_sample's columns; the loop runs without prefix caching (no
    # cached pages) and admits from its queue only, so the host's pending
    # requests are those of the call's start (simulate fills free slots first).
    live, waiting, running = np.asarray(log.resources[:n], np.float64).T
    sample = dict(t_ms=[round(ms, 3) for ms in emit_ms.tolist()],   # as resource_sample
                  kv_pages_live=live, kv_pages_cached=np.zeros(n),
                  queue_len=waiting + len(table.pending), running=running)
    rows = np.stack([engine.num_iterations + np.arange(1, n + 1)]
                    + [sample[name] for name in SAMPLE_COLUMNS], axis=1)
    for reader in engine.loop_runs.resource_readers:
      reader.append(rows)
  engine.num_iterations += n
  engine.policy_evaluations += n
  for bucket in log.bucket[:n]:
    engine.buckets_used[int(bucket)] = engine.buckets_used.get(int(bucket), 0) + 1
  engine.prefill_tokens_computed += int(np.sum(log.prefill_rows[:n]))
  if n:
    engine._last_plan_stats = (log.stats[n - 1], int(log.bucket[n - 1]))
  engine.clocks.stamp = None        # the loop applied the pending correction and its own
