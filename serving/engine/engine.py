"""The engine loop: state -> plan -> validate -> pack/execute -> validate -> apply.

The host only feeds arrivals, stamps clocks and drains streamed tokens; every
decision and every state transition is a pure, jitted function of pytrees,
the iteration body (``serving.engine.programs`` over ``scheduler.iteration``).
An iteration is one path, read top-down in ``Engine.step``:

1. fill slots: requests accepted since the last step enter free slots (their
   prefix hits mapped), ``ARRIVAL_BATCH`` at a time in one program call;
   with prefix caching, a preempted request looks its prompt up again and,
   when pages are short, waiting requests' hits are unpinned;
2. the ``plan`` program (``programs.plan_step``): tick, the policy's one
   plan, its rule check, and the facts the host acts on (``PlanFacts``);
3. host work, one rule each, only where the facts call for it: a rule
   violation raises, a request the policy can never schedule is rejected
   (the iteration ends there), an empty plan ends the iteration, cached
   pages are evicted, preempted requests are suspended (§0x0C records; a
   swap copies their pages out), a suspended request admitted is resumed;
4. the ``step`` program (``programs.execute_step``, one per token bucket):
   the plan runs in the bucket of ``PlanFacts.rows_bound``, its result is
   checked and ``apply`` publishes the next state; the next plan program
   runs on it (``plan_ahead``); one fetch of both programs' facts, and the
   next iteration skips step 2 when that plan's inputs are unchanged;
5. drain: new tokens and outcomes become ``RequestOutput`` news, finished
   slots are released.

Who owns what: ``Engine`` holds the device tables (KV cache, pages,
buffers, manifest, state), the compiled programs and the counters, and
composes ``RequestTable`` (accepted requests, slots, pending and future
queues, clients), ``EngineClocks`` (host and device clocks), ``PrefixBook``
(``serving.kv.prefix_book``: prefix-cache bookkeeping), ``Suspensions``
(preemption records and swapped KV) and the simulate driver
(``sim_driver``: many iterations per program call, ``sim_loop``).

Every accepted, unfinished request holds a slot, so the policy decides over
the whole queue: the slot table starts at ``max_request_slots``, doubles
when full (one compiled program set per size) up to ``max_queued_requests``
and halves when a half would be at most three-quarters full; past that
bound ``add_request`` raises ``QueueFull``. Every accepted request ends
with exactly one outcome: ``completed``, ``rejected`` (can never fit the KV
cache), ``cancelled`` (``abort``) or ``failed`` (non-finite logits, or
preempted too often); ``Request.finish_reason`` says why. A long-running
engine stays bounded: ``evict`` drops a finished request, and a client with
none left gives its index back.
docs/architecture.md follows one iteration through the code.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Dict, List, Optional, Sequence

import jax
import numpy as np

from models import amx
from models import sharding
from scheduler import validate
from serving.engine import calibrations as cal_lib
from serving.engine import cost_model as cost_lib
from serving.engine import executor as executor_lib
from serving.engine import handoffs as handoffs_lib
from serving.engine import plan_ahead as plan_ahead_lib
from serving.engine import programs as programs_lib
from serving.engine import sim_driver
from serving.engine import sim_executor
from serving.engine import sim_loop
from serving.engine import speculative
from serving.engine.clocks import DEVICE_REBASE_MS, EngineClocks  # noqa: F401 (re-exported)
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.request_table import RequestTable
from serving.engine.requests import Request, RequestOutput, TokenLogprobs
from serving.engine.suspensions import Suspensions
from serving.kv import pages as kv_pages
from serving.kv import prefix_book
from serving.kv import prefix_cache as pc
from serving.kv import swap as kv_swap
from serving.kv import transfer

# Arrivals are written into their slots by one program call per this many
# (padded with empty entries): one compiled program, and one call per
# iteration unless more than this many requests arrived since the last.
ARRIVAL_BATCH = 8


class Engine:
  """Iteration-level batching engine over a paged KV cache.

  Args:
    model_cfg: ``models.config.ModelConfig`` (hashable).
    params: model parameters (pytree); float32 ones are quantized here when
      ``config.weights`` is "int8" (``models.quant.quantize_params``). The
      simulated executor (``config.executor``) runs no model: it takes None
      (any params given are dropped).
    config: ``EngineConfig``.
    clock: returns seconds (monotonic); injectable for tests. Default:
      ``time.monotonic``, or a ``sim_executor.VirtualClock`` for the
      simulated executor. On a VirtualClock every step advances time by the
      cost model's prediction for its shape (``config.cost_model``), with
      either executor, so a replay's schedule repeats bit for bit.
    kv: a KV cache of these configs to adopt, not allocate (``launch.warmup``'s
      engines borrow one: a page's rows are read only once a request wrote them).

  Raises:
    ValueError: ``config.max_model_len`` past the model's context;
      ``jax_enable_x64`` on (``programs.check_engine``);
      the simulated executor with a clock that is not virtual;
      ``params`` None with the model executor;
      ``config.weights`` "int8" with parameters that are not float32;
      ``config.int8_gemm`` "amx" where the AMX kernel cannot run;
      ``config.decode_gemm`` "native" where its kernel cannot run;
      ``kv`` of another shape or dtype than these configs' cache.
  """

  def __init__(self, model_cfg, params, config: EngineConfig,
               clock: Optional[Callable[[], float]] = None, kv=None):
    self.model_cfg = model_cfg
    self.config = config
    programs_lib.check_engine(model_cfg, config)
    # Tensor parallelism (``models.sharding``): weights and the KV cache
    # split over the mesh's model axis, every other table replicated.
    self.mesh = sharding.make_mesh(config.mesh)
    self._placement = sharding.Placement(model_cfg, self.mesh)
    # The int8 GEMM that runs ("amx" or "xla"; None for dense weights).
    self.int8_gemm = amx.resolve(config.int8_gemm) if config.weights == "int8" else None
    # The GEMM of generated rows' float32 projections ("native" or "xla";
    # None for the simulated executor).
    self.decode_gemm = programs_lib.resolve_decode_gemm(config)
    simulated = config.executor == "simulated"
    self.params = executor_lib.prepare_params(model_cfg, params, config, self._placement,
                                              self.int8_gemm, self.decode_gemm)
    if clock is None:
      clock = sim_executor.VirtualClock() if simulated else time.monotonic
    self._virtual = isinstance(clock, sim_executor.VirtualClock)
    if simulated and not self._virtual:
      raise ValueError("EngineConfig.executor='simulated' charges modelled step times "
                       "and needs a sim_executor.VirtualClock clock")
    # The model's cost features (``cost_model``): each committed step keeps its plan statistics
    # (``last_step_features``, what calibrate.py fits), charged on a virtual clock.
    self.model_costs = cost_lib.engine_model_costs(model_cfg, config)
    self._last_plan_stats = None
    self.cost_model = None
    if self._virtual:
      self.cost_model = cal_lib.resolve(cal_lib.load(config.cost_model), self.model_costs,
                                        say=cal_lib.say_once)
    self.clocks = EngineClocks(clock)
    c = config
    self._programs = programs_lib.programs(model_cfg, config)
    # The device tables: KV cache, pages, buffers, manifest, state.
    self.kv = (programs_lib.kv_cache(model_cfg, c, self._placement) if kv is None
               else programs_lib.adopt_kv(model_cfg, c, kv))
    (self.pages, self.buffers, self.manifest, self.state) = programs_lib.slot_tables(
        c, c.max_request_slots, self._placement, policy=self._programs.policy)
    # Host tables: accepted requests, slots, queues, clients.
    self.table = RequestTable(c, model_cfg.vocab_size)
    self.num_iterations = 0
    self.num_preemptions = 0
    self.spec_counts = speculative.SpecCounts(0 if c.speculation is None else c.speculation.k)
    self.prefill_tokens_computed = 0     # prompt and rebuild rows run
    self.buckets_used: Dict[int, int] = {}
    # Set ``record_plans = True`` to keep, per iteration, the plan as host
    # data in ``plan_log`` (request ids, intervals, kinds, intents).
    self.record_plans = False
    self.plan_log: List[dict] = []
    # Preemption records and swapped-out KV copies (§0x0C).
    self.suspensions = Suspensions(c.preemption_mode, int(c.swap_space_mb * 2**20),
                                   kv_swap.page_bytes(self.kv), c.page_size, c.pages_per_seq)
    # Recorded output length per request id (the simulated executor's hidden
    # truth; never in the policy's view). Missing: the declared max_tokens.
    self.realized_output_tokens: Dict[str, int] = {}
    # Prefix-cache bookkeeping (None with caching off).
    self.prefix = prefix_book.for_engine(model_cfg, c, self.decode_gemm)
    # Ending a request forgets what the others keep for it.
    if self.prefix is not None:
      self.table.on_end.append(self.prefix.forget)
    self.table.on_end.append(self.suspensions.forget)
    # Prefill/decode roles: records handed off or received (``handoffs``).
    self.handoffs = handoffs_lib.Handoffs(c.role, c.page_size, c.pages_per_seq,
                                          kv_swap.page_bytes(self.kv), simulated)
    self.table.on_end.append(self.handoffs.forget)
    if simulated:
      self.table.ends_at_first = lambda r: self.realized_output_tokens.get(
          r.request_id, r.sampling.max_tokens) <= 1
    # Blocking device -> host fetches (``_fetch``): an iteration makes two (its
    # ``PlanFacts``, its ``StepFacts``), one when it takes the plan made ahead
    # with the last step (``plan_ahead``; ``.enabled = False`` turns it off).
    self.host_fetches = 0
    self.plan_ahead = plan_ahead_lib.PlanAhead(enabled=True)
    # Plans run, one per iteration (``plan_ahead.dropped`` counts the others).
    self.policy_evaluations = 0
    self._pages_low = False             # the last step's ``StepFacts.pages_low``
    self._program_sets = [self._programs]     # one per slot-table size used
    self.loop_runs = sim_driver.LoopRuns()    # how ``simulate`` ran (its programs too)

  @property
  def num_slots(self) -> int:
    """Size R of the slot table (``RequestTable.resized``)."""
    return len(self.table.slots)

  requests = property(lambda self: self.table.requests)

  @property
  def swap(self) -> kv_swap.SwapSpace:
    """Host memory of swapped-out KV copies (``preemption_mode="swap"``)."""
    return self.suspensions.swap

  @property
  def prefix_cache(self) -> Optional[pc.PrefixCache]:
    """The prefix cache's table (None with caching off)."""
    return None if self.prefix is None else self.prefix.cache

  # ----------------------------------------------------------------- clocks
  def now_ms(self) -> float:
    """Engine clock: ms since construction, skipped idle gaps included
    (``EngineClocks``; float64 on the host)."""
    return self.clocks.now_ms()

  def _rebase_device_clock(self, now_ms: float) -> None:
    """Moves the device epoch and every device time (``EngineClocks.rebase``)."""
    shift = self.clocks.rebase(now_ms, [r.arrival_ms for r in self.table.live()
                                        + self.table.pending])
    if shift is not None:
      self.manifest, self.state = self._programs.shift_clock(
          self.manifest, self.state, np.float32(shift))

  @property
  def clock(self):
    """The injected clock (a ``VirtualClock`` when time is modelled)."""
    return self.clocks.clock

  def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                  sampling: SamplingParams = SamplingParams(), *,
                  arrival_ms: Optional[float] = None, priority: int = 0,
                  client: str = "default", slo_ttft_ms: Optional[float] = None,
                  slo_tpot_ms: Optional[float] = None, logprobs: bool = False,
                  prompt_logprobs: bool = False, cache_salt: str = "") -> Request:
    """Accepts a request, or raises ValueError naming the bad field.

    A request whose full length can never fit the KV cache is accepted and
    ends at once with outcome ``rejected`` (the rest keep running). Every
    other accepted request is visible to the policy from the next step on,
    however many wait. Raises ``QueueFull`` (and records nothing) while
    ``EngineConfig.max_queued_requests`` accepted requests are unfinished:
    pending, live, or added ahead of their arrival (``add_future_request``)
    and not yet in a slot, arrived or not.

    ``slo_ttft_ms`` (first token, from original arrival) and ``slo_tpot_ms``
    (each later token, from the previous one: the TBT limit) are the
    request's declared SLOs (§0x07), None for none; SLO-aware policies
    (``least_slack``) order by the deadlines they give.

    ``logprobs``: each output token comes with its ``TokenLogprobs``;
    ``prompt_logprobs``: ``Request.prompt_logprobs`` is filled from the
    prefill rows (the request takes no prefix hit). Both need the model
    executor (ValueError with the simulated one). ``cache_salt``: prefix
    hits only within one salt (``PrefixBook.salt``; "" is the unsalted chain).
    """
    if self.config.role == "decode":
      raise ValueError(f"request {request_id!r}: a decode engine (EngineConfig.role) takes "
                       f"requests handed off by a prefill engine (add_handoff)")
    req = self.table.accept(request_id, prompt_token_ids, sampling,
                            self.now_ms() if arrival_ms is None else arrival_ms, priority,
                            client, slo_ttft_ms, slo_tpot_ms, logprobs, prompt_logprobs)
    req.cache_salt = cache_salt
    if not req.finished:
      if cache_salt and self.prefix is not None:
        self.prefix.salt(req, cache_salt)
      self.table.pending.append(req)
    return req

  def add_handoff(self, handoff: transfer.KVHandoff, *,
                  arrival_ms: Optional[float] = None) -> Request:
    """Accepts a request a prefill engine handed off (``take_handoffs``):
    its prompt is computed and its first token emitted (``output_token_ids``
    starts with it; later news carries the tokens after it). Its pages are
    written into this cache when the policy admits it; the policy sees it
    as a waiting request whose frontiers are at its prompt length with one
    token emitted at ``arrival_ms`` (engine ms, default now).

    Raises:
      ValueError: not a decode engine (``EngineConfig.role``); a record this
        engine cannot take (``transfer.check``: the field and the rule);
        ``add_request``'s. ``transfer.ChecksumMismatch``: its bytes or
        fields do not match its checksum. ``QueueFull``: as ``add_request``.
    """
    return self.handoffs.admit(handoff, self.now_ms() if arrival_ms is None else arrival_ms,
                               self.config, self.kv, self.model_cfg.vocab_size, self.table,
                               self.prefix)

  def take_handoffs(self) -> List[transfer.KVHandoff]:
    """A prefill engine's records of the requests that ended "handoff"
    since the last call (each once; their pages are free here)."""
    return self.handoffs.take()

  def add_future_request(self, request_id: str, prompt_token_ids: Sequence[int],
                         sampling: SamplingParams = SamplingParams(), *, arrival_ms: float,
                         priority: int = 0, client: str = "default",
                         slo_ttft_ms: Optional[float] = None,
                         slo_tpot_ms: Optional[float] = None) -> Request:
    """Accepts, for ``simulate``, a request that arrives at ``arrival_ms``
    (engine clock, ms; not before now nor before the last such request):
    checked and recorded now by ``add_request``'s rules, it enters a slot
    only once the simulated clock reaches its arrival, so no policy sees it
    earlier.

    Raises:
      ValueError: ``add_request``'s; an engine ``simulate`` cannot run
        (``loop_refusal``); an arrival out of order.
      QueueFull: the unfinished requests, those still to arrive included,
        fill ``max_queued_requests``; whether the request is refused is then
        known only at its arrival (``add_request`` it then).
    """
    return sim_driver.add_future_request(self, request_id, prompt_token_ids, sampling,
                                         arrival_ms, priority, client, slo_ttft_ms, slo_tpot_ms)

  def abort(self, request_id: str) -> None:
    """Cancels a request at any lifecycle stage (pages are freed)."""
    req = self.table.get(request_id)
    if req.finished:
      return
    if self.table.withdraw(req):
      self.table.end(req, "cancelled", "abort")
    else:
      self._reject_slots(self._one_slot(req.slot), "abort", outcome="cancelled")

  def finish(self, request_id: str, reason: str = "stop") -> RequestOutput:
    """Ends a request that has emitted tokens as ``completed`` with
    ``reason`` (the host's stop rule, e.g. a stop string matched on the
    text); its pages are freed at once. A finished request is left as it is.

    Returns:
      The request's final ``RequestOutput`` (no new tokens).

    Raises:
      ValueError: unknown ``request_id``, or a live request with no output
        token yet (a completed request has output; ``abort`` cancels).
    """
    req = self.table.get(request_id)
    if not req.finished:
      if not req.output_token_ids:
        raise ValueError(f"request {request_id!r}: finish needs at least one output "
                         f"token (abort cancels a request that has none)")
      if req in self.table.pending:
        self.table.pending.remove(req)
        self.table.end(req, "completed", reason)
      else:
        self._reject_slots(self._one_slot(req.slot), reason, outcome="completed")
    return RequestOutput(req.request_id, [], True, req.outcome, req.finish_reason)

  def _one_slot(self, slot: int) -> np.ndarray:
    return np.arange(self.num_slots) == slot

  def evict(self, request_id: str) -> Request:
    """Drops a finished request from the host tables and returns it; its
    client, once no request of it is left there, gives back its client index
    (its device service counters restart at zero for the next client).

    Raises:
      ValueError: unknown ``request_id``, or the request has no outcome yet.
    """
    req = self.table.get(request_id)
    if not req.finished:
      raise ValueError(f"request {request_id!r} is live; abort or finish it first")
    self.realized_output_tokens.pop(request_id, None)
    index = self.table.drop(req)
    if index is not None:
      self.state = self._programs.forget_client(self.state, np.int32(index))
    return req

  def _reject_slots(self, mask, reason: str, outcome: str = "rejected") -> None:
    """Ends the live requests in ``mask`` (bool[R]) with ``outcome``; frees
    their pages and slots."""
    self.state, self.pages = self._programs.release(self.state, self.pages, mask, mask)
    for slot in np.flatnonzero(mask):
      self.table.end(self.table.slots[slot], outcome, reason)
      self.table.vacate(slot)

  @property
  def last_step_stats(self):
    """(f64[7 + 3 * len(window kinds)] plan statistics, int bucket) of the
    last committed step (None before one): ``cost_model.plan_stats`` of its
    plan and the token bucket it ran in, from which ``last_step_features``
    is computed (a step log keeps them, so the features can be computed
    again under another definition)."""
    if self._last_plan_stats is None:
      return None
    stats, bucket = self._last_plan_stats
    return np.asarray(stats, np.float64), int(bucket)

  @property
  def last_step_features(self):
    """f64[len(cost_model.FEATURES)] (f64[3, ...] with a draft model) of the
    last committed step (None before one), computed when read:
    ``cost_model.step_features`` of its plan statistics and bucket."""
    stats = self._last_plan_stats
    return None if stats is None else cost_lib.step_features(*stats, self.model_costs)

  @property
  def last_step_rows(self):
    """(prefill rows, decode rows) of the last committed step (None before
    one): prompt and rebuild rows, and decode rows (drafts included), from
    its plan statistics (``cost_model.plan_stats``)."""
    stats = self.last_step_stats
    return None if stats is None else (int(stats[0][0]), int(stats[0][1]))

  def has_unfinished(self) -> bool:
    """Whether an accepted request (one still to arrive too) has no outcome."""
    return self.table.has_unfinished()

  def _fill_slots(self) -> None:
    """Moves every request accepted since the last step into a free slot,
    resizing the slot table first (``_resize``). Which slot a
    request gets decides nothing: policies order by recorded keys."""
    table = self.table
    size = table.resized(len(table.pending) + table.num_live())
    if size != self.num_slots:
      self._resize(size)
    free = table.free_slots()
    placed = list(zip(free, table.pending))
    hits = [0] * len(placed)
    if self.prefix is not None:
      for i, (slot, req) in enumerate(placed):
        if not req.received_tokens:       # a handed-over request brings its KV
          self.pages, hits[i] = self.prefix.map_hit(req, slot, self.pages, self._programs)
    for i in range(0, len(placed), ARRIVAL_BATCH):
      slots, arrivals, batch_hits = table.arrival_batch(
          placed[i:i + ARRIVAL_BATCH], hits[i:i + ARRIVAL_BATCH], ARRIVAL_BATCH,
          self.clocks.device_ms)
      self.manifest, self.state, self.buffers = self._programs.arrive(
          self.manifest, self.state, self.buffers, slots, arrivals, batch_hits)
    for slot, req in placed:
      table.place(slot, req)
      if self.prefix is not None and not req.received_tokens:
        self.prefix.placed(req)
    table.pending = []

  def _resize(self, size: int) -> None:
    """Resizes the slot table to ``size`` (``RequestTable.resized``): grown,
    every slot keeps its rows; shrunk, the live slots move to the first
    ones, in slot order (``moved_slots``), which decides nothing: policies
    order by recorded keys (the kit's ``whole_queue`` rule). Programs compile
    once per size: log2(max_queued_requests / max_request_slots) + 1 sets."""
    c, moved, stamp = self.config, self.table.moved_slots(size), self.clocks.stamp
    old = (self.pages, self.buffers, self.manifest, self.state), stamp and stamp[0]
    new = (programs_lib.slot_tables(c, size, self._placement, policy=self._programs.policy),
           stamp and self._placement.tables(np.zeros(size, bool)))
    (self.pages, self.buffers, self.manifest, self.state), emitted = programs_lib.moved_rows(
        new, old, np.pad(moved, (0, size - len(moved))), np.int32(len(moved)))
    if stamp is not None:        # the pending emission correction moves too
      self.clocks.stamp = (emitted,) + stamp[1:]
    self.table.move_slots(size, moved)
    self._programs = programs_lib.programs(self.model_cfg,
                                           dataclasses.replace(c, max_request_slots=size))
    if self._programs not in self._program_sets:
      self._program_sets.append(self._programs)

  def _prefix_hits(self) -> Optional[np.ndarray]:
    """i32[R] prefix-hit tokens of each slot's request (None when off)."""
    return None if self.prefix is None else self.prefix.hits(self.table.slots)

  # ------------------------------------------------------------- iteration
  def step(self) -> List[RequestOutput]:
    """Runs one iteration; returns the news for every request it touched.

    Read top-down (the module docstring numbers the same steps): fill slots
    -> the ``plan`` program (tick, the policy's one plan, its rule check)
    -> the host work its facts call for, one rule per step -> the ``step``
    program in the bucket of the rows bound (execute, check, apply) ->
    drain. An iteration that rejects a request the policy can never
    schedule, or whose plan is empty, ends before the model runs; the next
    call plans again.

    Raises:
      validate.PlanValidationError / ResultValidationError: the policy's
        plan or the executor's result broke a rule (``scheduler.validate``).
      RuntimeError: the policy selected nothing while requests are live and
        no arrival is pending (no progress is possible).
    """
    self._rebase_device_clock(self.now_ms())   # first: arrivals are written at the new epoch
    self._fill_slots()
    if self.prefix is not None:
      slots, programs = self.table.slots, self._programs
      if self.num_preemptions:
        self.state, self.pages = self.prefix.rehit_preempted(
            slots, self.state, self.pages, programs, self._fetch, self.swap)
      if self._pages_low:
        self.state, self.pages = self.prefix.unpin_waiting_hits(
            slots, self.state, self.pages, programs, self._fetch)
    launch = self.clocks.device_ms(self.now_ms())
    plan, facts, refcount = self._plan_iteration(launch)
    if facts.bad_plan:
      validate.validate_plan(self.manifest.online(), self.state, plan,
                             kv_pages.view(self.pages, self._prefix_hits()))
    if facts.never.any():
      return self._reject_never(facts.never)
    if facts.num_seqs == 0 and not facts.preempt.any():
      return self._idle()
    if self.record_plans:
      self._log_plan(plan)
    if facts.evict:
      self.pages = self.prefix.evict(int(facts.evict), refcount, self.pages, self._programs,
                                     self._fetch)
    preserved = self.suspensions.suspend(
        self.table.slots, facts.preempt, plan.decision_id, self.state, self.pages, self.kv,
        self._programs, self._fetch, self.policy.policy_id)
    self.kv, self.pages = self.suspensions.resume_admitted(
        self.table.slots, facts.admit, facts.preempt, self.kv, self.pages, self._programs,
        {} if self.prefix is None else self.prefix.rehit_tokens)
    if self.handoffs.received:
      self.kv, self.pages = self.handoffs.import_admitted(
          self.table.slots, facts.admit, facts.preempt, self.kv, self.pages, self._programs)
    return self._execute(plan, facts, preserved, launch)

  def _plan_iteration(self, launch):
    """The ``plan`` program, or the plan made ahead (``plan_ahead``):
    publishes the ticked state (the last iteration's emission stamps
    corrected, ``programs.ticked_state``) and returns this iteration's plan
    (device), its ``PlanFacts`` (fetched) and the page refcounts once its
    preemptions released theirs (device; read only to evict)."""
    fix, hits = self._pending_stamp(), self._prefix_hits()
    ahead = self.plan_ahead.take(self.manifest, self.state, self.pages, hits)
    if ahead is None:
      self.state, plan, facts, refcount = self._programs.plan(
          self.manifest, self.state, self.pages, hits, launch, *fix)
      facts = self._fetch(facts)
    else:     # planned on these very tables: publish the state planning now would
      plan, facts, refcount, self.state = *ahead.taken, self._programs.retick(
          self.state, *fix, launch)
    self.clocks.stamp = None
    self.policy_evaluations += 1
    return plan, facts, refcount

  def _reject_never(self, never) -> List[RequestOutput]:
    """Rejects the slots (bool[R]) the policy says it can never schedule,
    each with its own reason (``RequestTable.never_reason``); their news
    ends the iteration."""
    names = [self.table.slots[s] for s in np.flatnonzero(never)]
    for s, req in zip(np.flatnonzero(never), names):
      self._reject_slots(self._one_slot(s), self.table.never_reason(req, self.policy.policy_id))
    return [RequestOutput(r.request_id, [], True, r.outcome, r.finish_reason)
            for r in names]

  def _idle(self) -> List[RequestOutput]:
    """An empty plan: no news, unless requests are live and nothing can
    change the next plan (stepping again would spin: a policy that leaves
    live work unscheduled forever is a scheduler bug; say so)."""
    if any(r is not None for r in self.table.slots) and not self.table.pending:
      live = [r.request_id for r in self.table.slots if r is not None]
      raise RuntimeError(f"policy {self.policy.policy_id} selected no work while "
                         f"requests {live[:8]} are live; no progress is possible")
    return []

  def _execute(self, plan, facts, preserved, launch) -> List[RequestOutput]:
    """The ``step`` program, then the commit and the drain. The bucket is
    that of ``PlanFacts.rows_bound`` (the most rows any valid plan on this
    state could take), not the smallest holding the plan (faster on CPU:
    docs/benchmarks.md "One path per iteration"); a row's bits do not
    depend on the bucket (``llama.row_tiled``)."""
    c = self.config
    bucket = c.iteration_bucket(int(facts.rows_bound), int(facts.num_tokens))
    realized = self._realized() if c.executor == "simulated" else None
    (self.kv, self.pages, self.buffers, state, aux, step_facts) = self._programs.step(
        self.params, self.kv, self.pages, self.buffers, self.manifest, self.state,
        plan, realized, preserved, num_rows=bucket)
    ahead = self.plan_ahead.dispatch(
        self._programs, self.manifest, state, self.pages, self._prefix_hits(),
        self._pending_stamp(), likely=self.prefix is None or not facts.prompt_rows)
    step_facts = self.plan_ahead.fetch(self._fetch, step_facts, ahead)
    return self._commit(state, aux, step_facts, bucket, launch, facts.preempt)

  def _commit(self, state, aux, facts, bucket: int, launch, preempt) -> List[RequestOutput]:
    """Takes a step program's outputs: the published state, the clock,
    counters, the one-step-late emission correction, the drain."""
    plan, result, logprobs = aux
    if facts.bad_result:
      validate.validate_result(plan, self.state, self.manifest, result)
    self.state = state
    self._pages_low = bool(facts.pages_low)
    self.buckets_used[bucket] = self.buckets_used.get(bucket, 0) + 1
    self.prefill_tokens_computed += int(facts.num_tokens) - int(facts.decodes)
    self._last_plan_stats = (facts.features, bucket)
    if self._virtual:
      self.clocks.clock.advance(self.cost_model.predict_ms(self.last_step_features) / 1000.0)
    emit_ms = self.now_ms()
    # The program stamped this iteration's emissions with its launch time;
    # the next plan program moves them to ``emit_ms``, before any policy
    # reads them (``programs.plan_step``).
    self.clocks.stamp = (result.emitted, launch, self.clocks.device_ms(emit_ms))
    self.num_iterations += 1
    if self.prefix is not None:
      # Before the drain releases the requests that ended in this step: a
      # request whose last prompt chunk emitted its last token still leaves
      # its computed pages in the cache (not one whose logits failed).
      self.pages = self.prefix.after_step(self.table.slots, facts.prefix, facts.failed,
                                          self.pages, self._programs)

    token_logprobs = self.table.take_logprobs(logprobs, facts.emitted, self._fetch, facts.spec)
    self.spec_counts.add(facts.spec)
    outputs = self._drain(emit_ms, facts.emitted, speculative.emitted_tokens(facts),
                          facts.finished,
                          facts.finish_reason, facts.failed, preempt, token_logprobs)
    if facts.handoff is not None:      # before a later program writes the freed pages
      self.handoffs.export([self.table.requests[o.request_id] for o in outputs if o.finished],
                           facts.handoff, self.kv, self._programs, self._fetch)
    return outputs

  def _pending_stamp(self):
    return self.clocks.pending_stamp(self.num_slots, self._placement)

  def _fetch(self, tree):
    """``jax.device_get`` counted in ``host_fetches`` (blocking round trips)."""
    self.host_fetches += 1
    return jax.device_get(tree)

  def compile_buckets(self) -> Dict[int, float]:
    """Compiles this slot-table size's ``plan`` program and every token
    bucket's ``step`` program (``programs.compile_buckets``: each runs once,
    the steps on a plan selecting nothing), so that no compile lands in a
    later measurement. Returns {bucket: seconds} (compile and one run)."""
    realized = self._realized() if self.config.executor == "simulated" else None
    self.kv, self.pages, self.buffers, seconds = programs_lib.compile_buckets(
        self._programs, self.config, self.params, self.kv, self.pages, self.buffers,
        self.manifest, self.state, self._prefix_hits(), self.clocks.device_ms(self.now_ms()),
        self.clocks.no_stamp(self.num_slots, self._placement), realized)
    return seconds

  def _realized(self) -> np.ndarray:
    """i32[R] recorded output length of each slot's request (declared
    max_tokens when none was recorded); the simulated executor's truth."""
    return self.table.realized(self.realized_output_tokens)

  def _log_plan(self, plan) -> None:
    self.plan_log.append(self.table.plan_entry(plan, self._fetch((
        plan.selected, plan.start, plan.end, plan.kind, plan.rank, plan.admit,
        plan.preempt, plan.decision_id, self.state.status))))

  # ------------------------------------------------------------------ drain
  def _drain(self, emit_ms, emitted, token, finished, reason, failed, preempt,
             token_logprobs: Optional[Dict[int, TokenLogprobs]] = None):
    """A step's news (``RequestTable.drain``), its ended slots released and
    requests preempted too often failed; returns the ``RequestOutput``s."""
    self.num_preemptions += int(preempt.sum())
    limit = self.config.max_preemptions_per_request
    outputs, release, thrashing = self.table.drain(
        emit_ms, emitted, token, finished, reason, failed, preempt, token_logprobs or {},
        lambda: jax.device_get(self.state.num_extensions), limit)
    if release.any():
      none = np.zeros_like(release)
      self.state, self.pages = self._programs.release(self.state, self.pages, none, release)
    if thrashing.any():           # no preemption livelock: bounded, reported
      names = [self.table.slots[s] for s in np.flatnonzero(thrashing)]
      self._reject_slots(thrashing, f"preempted more than {limit} times "
                         f"(EngineConfig.max_preemptions_per_request)", outcome="failed")
      outputs += [RequestOutput(r.request_id, [], True, r.outcome, r.finish_reason)
                  for r in names]
    return outputs

  # ------------------------------------------------- many iterations per call
  def loop_refusal(self) -> Optional[str]:
    """Why ``simulate`` cannot run this engine, None when it can: it needs
    the simulated executor on a virtual clock, prefix caching off, recompute
    preemption, one device, ``record_plans`` off (``sim_loop.refusal``)."""
    return sim_loop.refusal(self.config, self._virtual, self.record_plans)

  def simulate(self, stop_ms: float = math.inf, *, max_iterations: Optional[int] = None,
               iterations_per_call: int = sim_loop.LOOP_ITERATIONS,
               marks: Optional[list] = None, until_end: bool = False) -> None:
    """Runs iterations, many per program call (``sim_driver``), until no
    request is live, pending or still to arrive (``add_future_request``),
    the clock reaches ``stop_ms`` (engine ms), ``max_iterations`` ran in
    this call (checked between program calls), or an iteration ended a
    request (with ``until_end``). The iterations, plans, outputs, counters
    and times are ``step``'s; the requests' records hold the outputs.
    ``marks`` (a list) gets a mark ``(ms, request_id, kind)`` per request's
    first output token ("first_token") and end ("finished", any outcome),
    ``ms`` the end of the iteration that brought it (engine ms).

    Raises:
      ValueError: an engine the loop does not cover (``loop_refusal``).
      validate.PlanValidationError / ResultValidationError, RuntimeError: as ``step``.
    """
    sim_driver.simulate(self, stop_ms, max_iterations, iterations_per_call, marks, until_end)

  def run(self, max_iterations: Optional[int] = None) -> None:
    """Steps until every accepted request has an outcome. Requests still to
    arrive (``add_future_request``) are run by ``simulate``, which admits
    them at their arrival (``step`` admits only requests already added).

    Raises:
      RuntimeError: requests are unfinished after ``max_iterations``
        iterations (``simulate`` checks between program calls).
    """
    if self.table.future:
      start = self.num_iterations
      self.simulate(max_iterations=max_iterations)
      if self.has_unfinished():
        raise RuntimeError(f"engine did not finish within {self.num_iterations - start} "
                           f"iterations (max_iterations={max_iterations})")
      return
    n = 0
    while self.has_unfinished():
      self.step()
      n += 1
      if max_iterations is not None and n >= max_iterations:
        raise RuntimeError(f"engine did not finish within {max_iterations} iterations")

  def generate(self, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams = SamplingParams()) -> List[Request]:
    """Runs the prompts to completion; returns their Requests in order."""
    reqs = [self.add_request(f"gen-{self.table.next_uid}", p, sampling) for p in prompts]
    self.run()
    return reqs

  @property
  def policy(self):
    return self._programs.policy

  def prefix_cache_stats(self) -> dict:
    """``prefix_cache_queries`` (prompt tokens of requests whose first chunk
    ran, once each), ``prefix_cache_hits`` (those served from cache: the hits
    they ran from), ``prefix_cache_hit_rate`` (hits / queries),
    evictions and cached pages; zeros with caching off (vLLM's names)."""
    return prefix_book.no_stats() if self.prefix is None else self.prefix.stats()

  def compiled_programs(self) -> Dict[str, int]:
    """Programs traced (and so compiled) per jitted function, summed over
    the slot-table sizes this engine used and shared by engines with equal
    model and engine configs. Per size, ``step`` (the iteration program of
    both paths, the only one holding the model) is bounded by
    ``len(config.token_buckets)``; ``swap_out`` / ``swap_in`` (swap mode
    only) by the power-of-two page counts up to ``pages_per_seq``; the
    others, ``simulate``'s ``loop`` among them (per iterations per call), by 1."""
    total: Dict[str, int] = {}
    for programs in self._program_sets + self.loop_runs.programs:
      for name, n in programs.cache_sizes().items():
        total[name] = total.get(name, 0) + n
    return total
