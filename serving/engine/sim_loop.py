"""Many simulated iterations per program call (``Engine.simulate``).

For an engine with the simulated executor on a virtual clock, the ``loop``
program runs the engine's iteration in one jitted ``lax.while_loop``, each
pass built from the step path's own pieces (``serving.engine.programs``):

1. admit every queued arrival whose time has come into the first FREE slot
   (``programs.arrive``, the writer ``Engine`` uses);
2. nothing live: jump the clock to the next queued arrival, or stop;
3. the ``plan`` program's body (``programs.plan_step``: tick, the policy's
   plan, its rule check, ``PlanFacts``);
4. the token bucket of its rows bound (``EngineConfig.iteration_bucket``);
5. the ``step`` program's body (``programs.execute_step``: the simulated
   executor, the result check, ``apply``);
6. the step time: ``cost_model.step_features`` and ``CostModel.predict_ms``
   on the device (one definition with the host's);
7. the clock moves by it, and the iteration's emission times move from the
   launch to it (``apply.restamp_emissions``, what the next plan program
   does on the step path);
8. the iteration and its emitting or ending slots are logged (``SimLog``;
   with speculative decoding each row's tokens and drafts, ``SpecLog``);
9. finished slots are released (``programs.release_slots``).

It returns to the host (``SimLog.code``) when the log is full, the clock
reaches the stop time (the first arrival not queued), nothing is live or
queued, an iteration ended a request and the call asked to return then
(``until_end``, a run-time flag: one program for both), or an iteration
needs the host: a plan rule violation, a request the
policy can never schedule, a preemption or the re-admission of a preempted
request (§0x0C records), an empty plan, or the device epoch to move
(``clocks.DEVICE_REBASE_MS``). These are read from the plan's facts before
the step runs, so such an iteration is not committed: the tables are those
it started from (after its arrivals; before them when the epoch moves, so
that they are written at the new one, as ``Engine.step`` does), and the
host runs it again as an ordinary ``Engine.step``. The step then writes
the page tables and buffers in place (no copy of them is kept); a result
that breaks a rule (``StepFacts.bad_result``) returns ``LoopExit.RESULT``
with the tables the step path has when ``Engine.step`` raises on it (the
step's pages and buffers, the plan's ticked state) and the plan and
result, from which ``Engine.simulate`` raises the rule's
``ResultValidationError``.

Clocks: the loop keeps the host's clock, the ``VirtualClock``'s float64
seconds, on the device (carried as its bits, u32[2], computed in a
``jax.enable_x64`` scope) and repeats the host's float64 arithmetic on it
(``Engine.now_ms``, ``EngineClocks.device_ms``, ``VirtualClock.advance`` of the cost
model's float64 prediction), so its times, and every float32 time the
policy reads, are the step path's. XLA may round a step time's last bit
otherwise than numpy (seen: token times within 6e-11 ms after a thousand
steps); a float32 clock drifted by ~1e-6 ms a step, enough to move a time
the policy reads by one float32 step and change a plan. A device without
float64 cannot run the loop.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Callable, Dict, List, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np

from scheduler import apply as apply_lib
from serving.engine.control import when
from scheduler import records as rec
from scheduler import scan
from serving.engine import cost_model as cost_lib
from serving.engine import programs as programs_lib
from serving.engine.config import EngineConfig
from serving.engine.facts import Arrival



# ``SimLog.events``' columns.
EVENT_COLUMNS = ("iteration", "request", "token", "finished", "reason", "failed", "extensions")
# ``SimLog.resources``' columns: after each committed iteration, the pages
# some page table holds (the loop runs without prefix caching, so every page
# off the free stack is held), and the WAITING and RUNNING slots.
RESOURCE_COLUMNS = ("kv_pages_live", "waiting", "running")


class LoopExit(enum.IntEnum):
  """``SimLog.code``: why a loop call returned (``CONTINUE`` while it runs)."""

  CONTINUE = 0   # still running (never returned)
  FULL = 1       # the log holds ``num_iterations`` iterations
  STOP = 2       # the clock reached the stop time
  IDLE = 3       # nothing live and nothing queued
  HOST = 4       # the next iteration needs the host (``Engine.step`` runs it)
  REBASE = 5     # the device epoch must move (``Engine.step`` runs the iteration)
  END = 6        # the last iteration ended a request (``until_end`` asked for it)
  RESULT = 7     # the last step's result broke a rule (the host raises; ``Rejected``)


# Iterations one call runs at most (K: the log's capacity).
LOOP_ITERATIONS = 512
# Arrivals one call may admit (A: the queue's capacity).
QUEUE_SIZE = 64


def refusal(config: EngineConfig, virtual: bool, record_plans: bool) -> Optional[str]:
  """Why the loop cannot run an engine with ``config`` (None: it can); the
  step path (``Engine.step``) runs every configuration."""
  if config.executor != "simulated":
    return (f"EngineConfig.executor must be 'simulated' for the loop (it runs no model), "
            f"got {config.executor!r}")
  if not virtual:
    return "the loop needs the engine on a sim_executor.VirtualClock"
  if config.enable_prefix_caching:
    return ("EngineConfig.enable_prefix_caching must be False for the loop (it maps no "
            "prefix hits and registers no pages), got True")
  if config.preemption_mode != "recompute":
    return (f"EngineConfig.preemption_mode must be 'recompute' for the loop (a swap copies "
            f"pages on the host), got {config.preemption_mode!r}")
  if config.mesh:
    return f"EngineConfig.mesh must be '' for the loop (one device), got {config.mesh!r}"
  if record_plans:
    return "Engine.record_plans must be False for the loop (its plans stay on the device)"
  if config.role != "mixed":
    return (f"EngineConfig.role must be 'mixed' for the loop (a handoff leaves the engine "
            f"between iterations), got {config.role!r}")
  return None


def to_bits(x: float) -> np.ndarray:
  """u32[2]: the bits of ``x`` as a float64 (how the loop's inputs carry
  host times)."""
  return np.array([x], np.float64).view(np.uint32)


def from_bits(bits) -> np.ndarray:
  """f64[...]: the float64 values of u32[..., 2] bits (``to_bits``)."""
  return np.ascontiguousarray(bits, np.uint32).view(np.float64)[..., 0]


_X64 = functools.partial(jax.enable_x64, True)   # the scope of the loop's float64 clock


def _f64(bits):
  return jax.lax.bitcast_convert_type(bits, jnp.float64)


def _bits(x):
  return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _engine_ms(clock, t0):
  """f64[]: ``Engine.now_ms`` of the clock's seconds (bits; inside ``_X64``).
  The loop runs on a ``VirtualClock`` only, which ``EngineClocks.skip``
  refuses, so no skipped time is left out."""
  return (_f64(clock) - _f64(t0)) * 1000.0


@flax.struct.dataclass
class SimQueue:
  """The arrivals one loop call may admit, in arrival order (leading axis
  A = ``QUEUE_SIZE``; entries from ``count`` on are padding).

  Attributes:
    arrival: ``Arrival`` with leading axis A, as ``RequestTable.arrival`` makes it.
    due: u32[A, 2], its arrival time (engine ms, float64 bits: ``to_bits``).
    realized: i32[A], its recorded output length (the simulated executor's
      truth).
    at_epoch: bool[A], it arrived at the device epoch itself.
    count: i32[], entries in use.
  """

  arrival: Arrival
  due: jax.Array
  realized: jax.Array
  at_epoch: jax.Array
  count: jax.Array


@flax.struct.dataclass
class SpecLog:
  """A speculating engine's part of ``SimLog`` (E events, K =
  ``Speculation.k``): what ``speculative.emitted_tokens`` and
  ``SpecCounts.add`` take from a step's ``StepFacts.spec``.

  Attributes:
    accepted: i32[E], the drafts each event's row accepted (it emitted
      1 + accepted tokens; 0 for a row without drafts).
    tokens: i32[E, 1 + K], the tokens it emitted, in order (-1 past them).
    counts: i32[3 + K], over the committed iterations: rows that carried
      drafts, draft tokens verified, draft tokens accepted, then the
      accepted drafts at each draft position (``SpecCounts``' counters).
  """

  accepted: jax.Array
  tokens: jax.Array
  counts: jax.Array


@flax.struct.dataclass
class SimLog:
  """What one loop call did, fetched once by the host. K iterations at
  most; E = K * max_num_seqs events (an iteration emits or ends at most
  ``max_num_seqs`` slots: the plan rules bound its sequences).

  Attributes:
    code: i32[], why it returned (``LoopExit``).
    num_iterations: i32[], iterations committed (k <= K).
    num_admitted: i32[], queue entries admitted (the first ones).
    admitted_slot: i32[A], the slot each admitted entry took.
    clock: u32[2], the ``VirtualClock``'s seconds at return (float64 bits).
    emit: u32[K, 2], each iteration's publication time (engine ms, float64
      bits): its launch plus its modelled step time.
    bucket: i32[K], its token bucket; prefill_rows: i32[K], its prompt and
      rebuild rows; stats: f32[K, S], its ``cost_model.plan_stats``.
    resources: i32[K, len(RESOURCE_COLUMNS)], the tables' occupancy after
      it (live KV pages, WAITING and RUNNING slots: what
      ``ledger.ResourceSampler`` samples).
    num_events: i32[], events logged.
    events: i32[E, len(EVENT_COLUMNS)], an event per row: its iteration,
      request (engine uid), token (-1: none), finished (0/1), reason
      (``FINISH_NAMES`` index), failed (0/1) and extensions (§0x06, once
      ended). One table, so an iteration logs its events in one scatter
      (XLA:CPU loops over a scatter's R updates once per scatter).
    spec: ``SpecLog`` with speculative decoding (an event's tokens are
      then its row's, the token column the first of them); else None.
  """

  code: jax.Array
  num_iterations: jax.Array
  num_admitted: jax.Array
  admitted_slot: jax.Array
  clock: jax.Array
  emit: jax.Array
  bucket: jax.Array
  prefill_rows: jax.Array
  stats: jax.Array
  resources: jax.Array
  num_events: jax.Array
  events: jax.Array
  spec: Optional[SpecLog] = None

  def event_column(self, name: str, num_events: int) -> np.ndarray:
    """i32[num_events]: the ``EVENT_COLUMNS`` column ``name`` of the first
    ``num_events`` events (a fetched log)."""
    return self.events[:num_events, EVENT_COLUMNS.index(name)]


@flax.struct.dataclass
class Rejected:
  """What a ``LoopExit.RESULT`` call returns beside its tables: the last
  step's ``IterationPlan`` and ``IterationResult`` (zeros on any other
  exit), which ``validate.validate_result`` checks against the returned
  state."""

  plan: rec.IterationPlan
  result: rec.IterationResult


@flax.struct.dataclass
class _Carry:
  """The ``loop`` program's state between iterations."""

  manifest: rec.WorkloadManifest
  state: rec.SchedulerState
  pages: object
  buffers: object
  realized: jax.Array      # i32[R] each slot's recorded output length
  at_epoch: jax.Array      # bool[R] each slot's request arrived at the epoch
  log: SimLog
  rejected: Rejected


def simulate_steps(policy, executor, config: EngineConfig, cost_model, costs, windows,
                   num_iterations: int, params, kv, manifest, state, pages, buffers, realized,
                   at_epoch, queue: SimQueue, fix_emitted, fix_stamp, fix_actual, clock, t0,
                   epoch, stop, rebase, until_end):
  """The ``loop`` program: up to ``num_iterations`` engine iterations.

  Args:
    policy, executor, config, cost_model (``CostModel``), costs
      (``ModelCosts``), windows, num_iterations: static.
    params, kv: the simulated executor's (passed through).
    manifest, state, pages, buffers: the slot tables (donated).
    realized: i32[R] recorded output lengths; at_epoch: bool[R] live slots
      whose request arrived at the device epoch (a rebase cannot move it).
    queue: ``SimQueue``.
    fix_emitted, fix_stamp, fix_actual: the emission correction a host
      step left pending (``programs.plan_step``; ``fix_emitted`` all False
      when none is).
    clock, t0: u32[2] the ``VirtualClock``'s seconds now and at the
      engine's construction; epoch: u32[2] the device epoch (engine ms);
      stop: u32[2] return once the engine clock reaches it (ms), before that
      iteration; rebase: u32[2] ``DEVICE_REBASE_MS`` (all float64 bits).
    until_end: bool[], return after an iteration that ends a request
      (finished or failed: ``LoopExit.END``).

  Returns ``(manifest, state, pages, buffers, SimLog, Rejected)``.
  """
  num_slots = state.status.shape[0]
  buckets = config.token_buckets
  token_budget = buckets[-1]
  size = queue.due.shape[0]
  capacity = num_iterations * config.max_num_seqs
  no_slots = jnp.zeros((num_slots,), bool)
  max_draft = 0 if config.speculation is None else config.speculation.k

  def plan_iteration(c: _Carry):
    """The plan program's body on ``c``'s tables: the launch time (f32
    device ms), the ticked state, the plan, its ``PlanFacts`` and bucket."""
    with _X64():
      launch = (_engine_ms(c.log.clock, t0) - _f64(epoch)).astype(jnp.float32)
    ticked, plan, facts, _ = programs_lib.plan_step(
        policy, False, c.manifest, c.state, c.pages, None, launch, no_slots,
        jnp.float32(0), jnp.float32(0), max_draft=max_draft)
    bucket = config.iteration_bucket(facts.rows_bound, facts.num_tokens, xp=jnp)
    return launch, ticked, plan, facts, bucket

  def run_step(c: _Carry, ticked, plan):
    """The step program's body: its pages, buffers (written in place of
    ``c``'s), published state, ``IterationResult`` and ``StepFacts``."""
    _, pages, buffers, published, (_, result, _), step = programs_lib.execute_step(
        executor, token_budget, False, params, kv, c.pages, c.buffers, c.manifest, ticked,
        plan, c.realized, jnp.zeros((num_slots,), jnp.int32), num_rows=token_budget,
        windows=windows)
    return pages, buffers, published, result, step

  def admit(c: _Carry) -> _Carry:
    def due(c):
      i = jnp.minimum(c.log.num_admitted, size - 1)
      with _X64():
        arrived = _f64(queue.due[i]) <= _engine_ms(c.log.clock, t0)
      return (c.log.num_admitted < queue.count) & arrived

    def one(c):
      i = c.log.num_admitted
      slot = jnp.argmax(c.state.status == rec.FREE).astype(jnp.int32)
      arrival = jax.tree.map(lambda a: a[i], queue.arrival)
      manifest, state, buffers = programs_lib.arrive(c.manifest, c.state, c.buffers, slot,
                                                      arrival, jnp.int32(0))
      return c.replace(
          manifest=manifest, state=state, buffers=buffers,
          realized=c.realized.at[slot].set(queue.realized[i]),
          at_epoch=c.at_epoch.at[slot].set(queue.at_epoch[i]),
          log=c.log.replace(admitted_slot=c.log.admitted_slot.at[i].set(slot),
                            num_admitted=i + 1))

    return jax.lax.while_loop(due, one, c)

  def iterate(c: _Carry) -> _Carry:
    launch, ticked, plan, facts, bucket = plan_iteration(c)
    # The host settles §0x0C records: a preemption, and the re-admission of
    # a preempted request (``Suspensions.resume_admitted``). Decided before
    # the step, which then writes the tables in place.
    resume = facts.admit & (c.state.num_preemptions > 0)
    host = (facts.bad_plan | jnp.any(facts.never) | jnp.any(facts.preempt) | jnp.any(resume)
            | (facts.num_seqs == 0))

    def step_and_commit(c: _Carry) -> _Carry:
      pages, buffers, published, result, step = run_step(c, ticked, plan)
      c = c.replace(pages=pages, buffers=buffers)
      reject = lambda c: c.replace(state=ticked, rejected=Rejected(plan, result),
                                   log=c.log.replace(code=jnp.int32(LoopExit.RESULT)))
      c = when(step.bad_result, reject, c)
      return when(~step.bad_result, functools.partial(
          commit, published=published, result=result, step=step), c)

    def commit(c: _Carry, published, result, step) -> _Carry:
      log, k = c.log, c.log.num_iterations
      with _X64():     # Engine._commit: the clock advances by the prediction, in float64
        features = cost_lib.step_features(step.features, bucket, costs, xp=jnp)
        seconds = _f64(log.clock) + cost_model.predict_ms(features, xp=jnp) / 1000.0
        emit_ms = (seconds - _f64(t0)) * 1000.0
        actual = (emit_ms - _f64(epoch)).astype(jnp.float32)
        clock, emit = _bits(seconds), _bits(emit_ms)
      state = apply_lib.restamp_emissions(published, result.emitted, launch, actual)
      ended = step.finished | step.failed
      release = lambda t: programs_lib.release_slots(*t, no_slots, ended)
      state, pages = when(jnp.any(ended), release, (state, c.pages))
      event = step.emitted | ended
      at = jnp.where(event, log.num_events + scan.cumsum_i32(event) - 1, capacity)
      put = lambda a, v: a.at[at].set(v, mode="drop")
      log = log.replace(
          num_iterations=k + 1, clock=clock,
          code=jnp.where(until_end & jnp.any(ended), LoopExit.END,
                         jnp.where(k + 1 == num_iterations, LoopExit.FULL,
                                   LoopExit.CONTINUE)).astype(jnp.int32),
          emit=log.emit.at[k].set(emit), bucket=log.bucket.at[k].set(bucket),
          prefill_rows=log.prefill_rows.at[k].set(step.num_tokens - step.decodes),
          stats=log.stats.at[k].set(step.features),
          resources=log.resources.at[k].set(jnp.stack([
              pages.num_pages - 1 - pages.num_free,
              jnp.sum(state.status == rec.WAITING, dtype=jnp.int32),
              jnp.sum(state.status == rec.RUNNING, dtype=jnp.int32)]).astype(jnp.int32)),
          num_events=log.num_events + jnp.sum(event, dtype=jnp.int32),
          events=put(log.events, _event_rows(
              iteration=jnp.broadcast_to(k, event.shape), request=c.manifest.request_id,
              token=step.token, finished=step.finished, reason=step.finish_reason,
              failed=step.failed, extensions=state.num_extensions)),
          spec=None if log.spec is None else _log_spec(log.spec, step.spec, put))
      return c.replace(state=state, pages=pages, log=log)

    c = when(~host, step_and_commit, c)
    code = jnp.where(host, LoopExit.HOST, c.log.code).astype(jnp.int32)
    return c.replace(log=c.log.replace(code=code))

  def live_iteration(c: _Carry) -> _Carry:
    live = (c.state.status == rec.WAITING) | (c.state.status == rec.RUNNING)
    with _X64():
      now_ms = _engine_ms(c.log.clock, t0)
      # EngineClocks.rebase: the epoch moves at an iteration's start once
      # the clock is DEVICE_REBASE_MS past it, over the live requests and
      # the queued ones due now (the host's pending), unless one of them
      # arrived at it; before the iteration's arrivals are written, as in
      # Engine.step (the host admits them after the rebase).
      rebase_due = ~(now_ms - _f64(epoch) < _f64(rebase))
      k = jnp.arange(size)
      pending = (k >= c.log.num_admitted) & (k < queue.count) & (_f64(queue.due) <= now_ms)
    rebase_now = (rebase_due & (jnp.any(live) | jnp.any(pending))
                  & ~jnp.any(live & c.at_epoch) & ~jnp.any(pending & queue.at_epoch))
    c = when(~rebase_now, admit, c)
    live = (c.state.status == rec.WAITING) | (c.state.status == rec.RUNNING)
    queued = c.log.num_admitted < queue.count
    i = jnp.minimum(c.log.num_admitted, size - 1)
    with _X64():
      seconds = _f64(c.log.clock)
      # sim_driver._advance_to the next arrival, one step of it.
      jumped = _bits(seconds + jnp.maximum((_f64(queue.due[i]) - now_ms) / 1000.0,
                                           jnp.nextafter(seconds, jnp.inf) - seconds))
    # A rebase returns to the host; nothing live: jump to the next arrival,
    # or return idle; otherwise an iteration.
    any_live = jnp.any(live)
    c = c.replace(log=c.log.replace(
        clock=jnp.where(~rebase_now & ~any_live & queued, jumped, c.log.clock),
        code=jnp.where(rebase_now, LoopExit.REBASE,
                       jnp.where(any_live | queued, c.log.code, LoopExit.IDLE)
                       ).astype(jnp.int32)))
    return when(any_live & ~rebase_now, iterate, c)

  def body(c: _Carry) -> _Carry:
    with _X64():
      reached = _engine_ms(c.log.clock, t0) >= _f64(stop)
    c = when(~reached, live_iteration, c)
    code = jnp.where(reached, LoopExit.STOP, c.log.code).astype(jnp.int32)
    return c.replace(log=c.log.replace(code=code))

  i32 = lambda n, v=0: jnp.full((n,), v, jnp.int32)
  log = SimLog(
      code=jnp.int32(LoopExit.CONTINUE), num_iterations=jnp.int32(0), num_admitted=jnp.int32(0),
      admitted_slot=i32(size, -1), clock=jnp.asarray(clock, jnp.uint32),
      emit=jnp.zeros((num_iterations, 2), jnp.uint32), bucket=i32(num_iterations),
      prefill_rows=i32(num_iterations), stats=None,
      resources=jnp.zeros((num_iterations, len(RESOURCE_COLUMNS)), jnp.int32),
      num_events=jnp.int32(0),
      events=jnp.zeros((capacity, len(EVENT_COLUMNS)), jnp.int32).at[
          :, EVENT_COLUMNS.index("token")].set(-1),
      spec=None if config.speculation is None else SpecLog(
          accepted=i32(capacity), tokens=jnp.full((capacity, 1 + config.speculation.k), -1,
                                                  jnp.int32),
          counts=i32(3 + config.speculation.k)))
  state = apply_lib.restamp_emissions(state, fix_emitted, fix_stamp, fix_actual)
  carry = _Carry(manifest, state, pages, buffers, jnp.asarray(realized, jnp.int32),
                 jnp.asarray(at_epoch, bool), log, None)

  def shapes(c):
    _, ticked, plan, _, _ = plan_iteration(c)
    _, _, _, result, step = run_step(c, ticked, plan)
    return step.features, Rejected(plan, result)

  zeros = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), t)
  stats, rejected = zeros(jax.eval_shape(shapes, carry))
  carry = carry.replace(rejected=rejected, log=log.replace(
      stats=jnp.zeros((num_iterations,) + stats.shape, stats.dtype)))
  carry = jax.lax.while_loop(lambda c: c.log.code == LoopExit.CONTINUE, body, carry)
  return carry.manifest, carry.state, carry.pages, carry.buffers, carry.log, carry.rejected


def _event_rows(**columns) -> jax.Array:
  """i32[R, len(EVENT_COLUMNS)]: one row per slot, ``columns`` (i32 or bool
  [R] each, by ``EVENT_COLUMNS`` name) in ``EVENT_COLUMNS``' order."""
  return jnp.stack([jnp.asarray(columns[name], jnp.int32) for name in EVENT_COLUMNS], axis=1)


def _log_spec(log: SpecLog, spec, put) -> SpecLog:
  """``log`` with one iteration's ``StepFacts.spec`` (num_draft, accepted,
  tokens over the R slots): its events' rows (``put``: to their places)
  and the counts ``SpecCounts.add`` takes from it."""
  num_draft, accepted, tokens = spec
  drafted = num_draft > 0
  total = lambda x: jnp.sum(jnp.where(drafted, x, 0), dtype=jnp.int32)
  k = log.counts.shape[0] - 3
  per_pos = jnp.sum(drafted[:, None] & (accepted[:, None] > jnp.arange(k)[None, :]), axis=0,
                    dtype=jnp.int32)
  counts = log.counts + jnp.concatenate([
      jnp.stack([total(1), total(num_draft), total(accepted)]), per_pos])
  return SpecLog(accepted=put(log.accepted, accepted), tokens=put(log.tokens, tokens),
                 counts=counts)


@dataclasses.dataclass(frozen=True)
class _Loop:
  """The jitted ``loop`` program of one engine configuration."""

  run: Callable
  traces: Dict[str, int]

  def cache_sizes(self) -> Dict[str, int]:
    return dict(self.traces)


# XLA:CPU runs the loop program's ~600 small operations an iteration
# faster when it compiles them with its LLVM IR fusion emitters rather than
# the newer MLIR ones: 0.29-0.32 -> 0.23-0.24 ms an iteration on a lightly
# loaded trial of the Azure hour (docs/archive/benchmarks-log.md, "The loop
# program's fusion emitters"). Copy insertion's region analysis drops the
# two copies of the whole page table ``kv_pages.deallocate``'s loop made
# per released slot: 0.155 -> 0.147 ms an iteration light, and 2.36-2.43 ->
# 2.27-2.29 ms in a 4x trial whose 1,024-slot iterations include that
# size's compile ("Copy insertion's region analysis").
# Set on this program only; the model's programs compile with XLA's
# defaults. Other backends ignore the options.
LOOP_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False,
                         "xla_cpu_copy_insertion_use_region_analysis": True}


@functools.lru_cache(maxsize=16)
def loop_program(model_cfg, config: EngineConfig, cost_model, costs,
                 num_iterations: int) -> _Loop:
  """The ``loop`` program (``simulate_steps``) for one (model config, engine
  config, ``CostModel``, ``ModelCosts``, iterations per call); compiled once
  per slot-table size."""
  traces: Dict[str, int] = {}
  fn = functools.partial(simulate_steps, programs_lib.programs(model_cfg, config).policy,
                         programs_lib.bound_executor(model_cfg, config), config, cost_model,
                         costs, model_cfg.window_kinds, num_iterations)
  return _Loop(programs_lib.counting_jit("loop", fn, traces, donate_argnums=(2, 3, 4, 5),
                                         compiler_options=LOOP_COMPILER_OPTIONS),
               traces)


def make_queue(arrivals: List[Arrival], due_ms: List[float], realized: List[int],
               at_epoch: List[bool], empty: Arrival, size: int = QUEUE_SIZE) -> SimQueue:
  """A ``SimQueue`` of at most ``size`` arrivals (host arrays).

  Args:
    arrivals: their ``Arrival`` records, in arrival order; empty: the
      padding record (``Arrival.empty``).
    due_ms: their arrival times (engine ms).
    realized, at_epoch: as ``SimQueue``'s.
  """
  n = len(arrivals)
  assert n <= size, (n, size)
  pad = lambda xs, v, dtype: np.array(list(xs) + [v] * (size - n), dtype)
  return SimQueue(
      arrival=jax.tree.map(lambda *x: np.stack(x), *(list(arrivals) + [empty] * (size - n))),
      due=np.stack([to_bits(t) for t in list(due_ms) + [math.inf] * (size - n)]),
      realized=pad(realized, 0, np.int32), at_epoch=pad(at_epoch, False, bool),
      count=np.int32(n))


def maps_crowded(fraction: float = 0.5) -> bool:
  """True where this process holds more memory maps than ``fraction`` of the
  kernel's limit (``/proc/self/maps`` against ``vm.max_map_count``); False
  where either cannot be read (not Linux).

  Each compiled XLA:CPU program holds its code in memory maps (~1,000 for a
  loop program and its engine's programs at one slot-table size), so a
  process that keeps every (policy, table size) a sweep reaches passes the
  limit (65,530 by default) and dies in LLVM with "Cannot allocate memory".
  """
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      limit = int(f.read())
    with open("/proc/self/maps", "rb") as f:
      held = sum(1 for _ in f)
  except (OSError, ValueError):
    return False
  return held > fraction * limit


def release_programs() -> None:
  """Drops every compiled program this process holds: the loop programs,
  the engine's programs and executors (``serving.engine.programs``) and
  JAX's own caches (``jax.clear_caches``). A later engine traces its
  programs again or loads them from the persistent compilation cache
  (``jax_compilation_cache_dir``, the launchers' ``--cache_dir``). Engines
  still alive keep the programs they hold."""
  loop_program.cache_clear()
  programs_lib.release_programs()
  jax.clear_caches()
