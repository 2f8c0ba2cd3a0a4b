"""The engine loop: state -> plan -> validate -> pack/execute -> validate -> apply.

The host only feeds arrivals, stamps clocks and drains streamed tokens; every
decision and every state transition is a pure, jitted function of pytrees:

* ``policy(manifest.online(), state, allocator view)`` -> IterationPlan
* ``execute`` (one program per token-row bucket) -> IterationResult
* ``apply(manifest, state, plan, result)`` -> next SchedulerState

An iteration is one path, read top-down in ``Engine.step``:

1. fill slots: requests accepted since the last step enter free slots (their
   prefix hits mapped), ``ARRIVAL_BATCH`` at a time in one program call;
   with prefix caching, a preempted request looks its prompt up again and,
   when pages are short, waiting requests' hits are unpinned;
2. ``plan`` program (``_plan_step``): tick, the policy's one plan of this
   iteration, its rule check, and the facts the host settles it by
   (``PlanFacts``: rule violated, never-schedulable slots, admissions,
   preemptions, rows, bucket, cached pages to evict);
3. settle (``Engine._settle``), host work with one rule each, only where
   the facts call for it: a rule violation raises, a request the policy can
   never schedule is rejected (the iteration ends there), an empty plan
   ends the iteration, cached pages are evicted, preemptions are settled
   (§0x0C records; a swap copies the victim's pages out), a swapped request
   admitted is written back;
4. ``step`` program (``_execute_step``), compiled per token bucket: the
   settled plan runs in the token bucket of ``PlanFacts.rows_bound``, its
   result is checked and
   ``apply`` publishes the next state; one fetch of its ``StepFacts``;
5. drain: new tokens and outcomes become ``RequestOutput`` news, finished
   slots are released.

The policy is evaluated once per iteration (``Engine.policy_evaluations``
counts the plan programs run), and the model runs only a settled plan.

``Engine.simulate`` runs the same iterations, many per program call, for
the simulated executor on a virtual clock (``serving.engine.sim_loop``):
requests added ahead of their arrival (``add_future_request``) enter their
slots on the device when the modelled clock reaches them, and an iteration
that needs the host is run by ``step``.

The set of compiled programs is fixed by the config and the slot-table
size: per size, one ``plan`` program, one ``step`` per token bucket in
``EngineConfig.token_buckets``, one arrival writer, one release/cancel
writer, and, where used, the prefix-cache, clock and swap writers
(``compiled_programs()`` reports what was actually compiled;
``serving.cli.launch.warmup`` compiles them, after which a run compiles nothing
more).

Preemption (§0x0C) follows ``EngineConfig.preemption_mode``: "recompute"
frees the victim's pages and later rebuilds its prefix; "swap" copies the
pages to host memory first (``serving.kv.swap``) and writes them back when
the request is re-admitted, so it resumes exactly where it stopped. Either
way the host keeps the request's §0x0C QueueRecord / PreemptionIntent /
ReleaseResult / PreservationResult / ResumeTicket chain, bound by
(request_id, generation, snapshot digest, suspension epoch).

Every accepted, unfinished request holds a slot, so the policy decides over
the whole queue: the slot table starts at ``max_request_slots`` and doubles
when full (one compiled program set per size) up to
``max_queued_requests``; past that bound ``add_request`` raises
``QueueFull``.

Automatic prefix caching (``EngineConfig.enable_prefix_caching``,
``serving.kv.prefix_cache``): when a request enters a slot, the longest cached
prefix of its prompt (whole pages, at least one prompt token left) is mapped
into its page table and its prefill starts there; the policy reads the hit
as ``AllocatorView.prefix_hit_tokens`` and the plan is validated against the
same view. After each step the full prompt pages computed so far join the
cache; before a step that needs more pages than are free, unreferenced
cached pages are evicted, least recently used first.

Logprobs: a request added with ``logprobs`` gets, with each output token,
its raw logprob and the ``MAX_LOGPROBS`` most likely tokens
(``TokenLogprobs``, ``RequestOutput.new_logprobs``); one added with
``prompt_logprobs`` gets each prompt token's (``Request.prompt_logprobs``,
complete when its first output token is out), computed from the prefill
rows it runs (``serving.engine.executor.StepLogprobs``). Both are the raw model
logits' ``log_softmax`` (vLLM's default "raw_logprobs": before the stop
mask, temperature and top-k/top-p), float32. A request that wants prompt
logprobs takes no prefix hit (its whole prompt is computed, so every row
is scored; its full pages still join the cache for others). Iterations in
which such a request emitted or ran prompt rows make one more fetch.

Every accepted request ends with exactly one outcome: ``completed``,
``rejected`` (can never fit the KV cache), ``cancelled`` (``abort``) or
``failed`` (non-finite logits); ``Request.finish_reason`` says why. The host
may also end a request as ``completed`` (``finish``, e.g. a stop string
matched on the text).

A long-running engine stays bounded: ``evict`` drops a finished request from
the host tables, and a client with no request left there gives its client
index (and its device counters) back. Clocks: the host clock is float64 ms
since construction (``now_ms``); the device holds float32 ms since a device
epoch that ``step`` moves forward (``DEVICE_REBASE_MS``), shifting every
live device time with it, so device times stay below ~2**21 ms and keep
sub-ms resolution however long the engine runs.

One file: ``Engine``'s methods read and write the same host tables (slots,
requests, the prefix cache's table, preemption records) in the order
``step`` calls them; the pure parts live apart (``programs``: the jitted
programs; ``requests``: the records; ``config``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import amx
from models import llama
from models import quant
from models import sharding
from scheduler import preemption as pre
from scheduler import records as rec
from scheduler import validate
from serving.engine import cost_model as cost_lib
from serving.engine import programs as programs_lib
from serving.engine import sim_executor
from serving.engine import sim_loop
from serving.engine.config import OUTCOMES, EngineConfig, SamplingParams
from serving.engine.requests import (Arrival, PromptLogprobs, QueueFull, Request,
                                     RequestOutput, TokenLogprobs)
from serving.engine.sampling import MAX_LOGPROBS
from serving.kv import pages as kv_pages
from serving.kv import prefix_cache as pc
from serving.kv import swap as kv_swap

# Device times are float32 ms since the device epoch; once the host clock is
# this far past the epoch (float32 resolution 2**-3 ms here), ``step`` moves
# the epoch to the oldest live arrival, or to now when nothing is live.
DEVICE_REBASE_MS = float(2**20)

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

  Raises:
    ValueError: the simulated executor with a clock that is not virtual;
      ``params`` None with the model executor;
      ``config.weights`` "int8" with parameters that are not float32;
      ``config.int8_gemm`` "amx" where the AMX kernel cannot run;
      ``config.decode_gemm`` "native" where its kernel cannot run.
  """

  def __init__(self, model_cfg, params, config: EngineConfig,
               clock: Optional[Callable[[], float]] = None):
    self.model_cfg = model_cfg
    self.config = config
    if config.max_model_len > model_cfg.max_position:
      # Past its context a model's positions are untrained (and dynamic
      # RoPE, read as plain RoPE within it, would rescale there).
      raise ValueError(
          f"EngineConfig.max_model_len ({config.max_model_len}) must not exceed the "
          f"model's context, ModelConfig.max_position ({model_cfg.max_position}) of "
          f"{model_cfg.name!r} (the launchers take --max_model_len={model_cfg.max_position})")
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
    if simulated:             # no model runs: the weights are neither needed nor kept
      params = {}
    elif params is None:
      raise ValueError("Engine needs model parameters unless EngineConfig.executor is "
                       "'simulated'")
    elif config.weights == "int8":
      params = quant.quantize_params(params, model_cfg.tie_embeddings, gemm=self.int8_gemm)
    # Per-layer weight buffers: each block's GEMM reads its layer in place
    # (``llama.split_layers``).
    self.params = params if simulated else llama.split_layers(self._placement.params(params))
    if self.decode_gemm == "native":
      self.params = llama.with_head_panels(self.params, model_cfg)
    if clock is None:
      clock = sim_executor.VirtualClock() if simulated else time.monotonic
    self._virtual = isinstance(clock, sim_executor.VirtualClock)
    if simulated and not self._virtual:
      raise ValueError("EngineConfig.executor='simulated' charges modelled step times "
                       "and needs a sim_executor.VirtualClock clock")
    # The model's cost features (``serving.engine.cost_model``): every committed
    # step keeps its plan statistics, from which ``last_step_features`` is
    # computed when read (what calibrate.py fits); on a virtual clock the
    # cost model charges them each step.
    self.model_costs = cost_lib.engine_model_costs(model_cfg, config)
    self._last_plan_stats = None
    self.cost_model = None
    if self._virtual:
      self.cost_model = cost_lib.resolve(cost_lib.load(config.cost_model), self.model_costs,
                                         say=cost_lib.say_once)
    self._clock = clock
    self._t0 = clock()
    c = config
    dtype = jnp.bfloat16 if c.kv_cache_dtype == "bfloat16" else jnp.float32
    self.kv = llama.init_kv_cache(model_cfg, 2 if simulated else c.num_pages,
                                  c.page_size, dtype)
    # Commit the initial pytrees to the device, as every later (jit-output)
    # version is: a fresh engine's first step then reuses the programs that
    # an engine with equal configs compiled, instead of compiling again for
    # uncommitted inputs.
    self.kv = self._placement.kv(self.kv)
    (self.pages, self.buffers, self.manifest, self.state) = programs_lib.slot_tables(
        c, c.max_request_slots, self._placement)
    self._slots: List[Optional[Request]] = [None] * c.max_request_slots
    # Accepted since the last step; the next step moves every one of them
    # into a slot (the slot table grows as needed), so the policy sees the
    # whole queue: this list never decides an order.
    self._pending: List[Request] = []
    # Accepted for ``simulate`` ahead of their arrival, in arrival order.
    self._future: List[Request] = []
    self._requests: Dict[str, Request] = {}
    self._clients: Dict[str, int] = {}
    self._client_refs: Dict[str, int] = {}   # requests per client in _requests
    self._free_client_indices: List[int] = []
    self._device_epoch_ms = 0.0   # host ms at device time 0
    self._next_uid = 0
    self.num_iterations = 0
    self.num_preemptions = 0
    self.prefill_tokens_computed = 0     # prompt and rebuild rows run
    self.buckets_used: Dict[int, int] = {}
    self.swap = kv_swap.SwapSpace(int(c.swap_space_mb * 2**20))
    # Set ``record_plans = True`` to keep, per iteration, the plan as host
    # data in ``plan_log`` (request ids, intervals, kinds, intents).
    self.record_plans = False
    self.plan_log: List[dict] = []
    self._page_bytes = kv_swap.page_bytes(self.kv)
    # Recorded output length per request id (the simulated executor's hidden
    # truth; never in the policy's view). Missing: the declared max_tokens.
    self.realized_output_tokens: Dict[str, int] = {}
    self.prefix_cache = (pc.PrefixCache(c.num_pages, c.page_size,
                                        pc.root_key(model_cfg, c.dtype, c.weights, c.page_size,
                                                    self.decode_gemm))
                         if c.enable_prefix_caching else None)
    self._prefix_keys: Dict[str, List[bytes]] = {}   # live requests' page keys
    self._rehit_epoch: Dict[str, int] = {}   # preemption last looked up again
    self._rehit_tokens: Dict[str, int] = {}  # its hit, not recomputed on resume
    self._uncounted: Dict[str, Request] = {}  # placed, first chunk not yet run

    # Blocking device -> host fetches (``_fetch``); an iteration makes two
    # (its ``PlanFacts`` and its ``StepFacts``).
    self.host_fetches = 0
    # Plan programs run: the policy is evaluated once per iteration.
    self.policy_evaluations = 0
    # The last iteration's (emitted mask, launch stamp, publication time),
    # corrected on the device by the next plan program (``_tick``).
    self._stamp = None
    self._no_stamp_mask = None
    self._pages_low = False             # the last step's ``StepFacts.pages_low``
    self._programs = programs_lib.programs(model_cfg, config)
    self._program_sets = [self._programs]     # one per slot-table size used
    self._loop_sets = []                      # ``simulate``'s programs used

  @property
  def num_slots(self) -> int:
    """Current size R of the scheduler's slot table (grows by doubling from
    ``max_request_slots`` up to ``max_queued_requests``)."""
    return len(self._slots)

  # ------------------------------------------------------------------ host
  def now_ms(self) -> float:
    """Engine clock: ms since construction (float64 on the host)."""
    return (self._clock() - self._t0) * 1000.0

  def _device_ms(self, host_ms: float) -> np.float32:
    """A host time as the device's float32 ms since the device epoch."""
    return np.float32(host_ms - self._device_epoch_ms)

  def _rebase_device_clock(self, now_ms: float) -> None:
    """Moves the device epoch forward once ``now_ms`` is DEVICE_REBASE_MS past
    it, to the oldest arrival of a live or pending request (or to now), and
    shifts every device time by the same amount."""
    if now_ms - self._device_epoch_ms < DEVICE_REBASE_MS:
      return
    live = [r.arrival_ms for r in self._slots if r is not None]
    epoch = min([now_ms] + live + [r.arrival_ms for r in self._pending])
    shift = epoch - self._device_epoch_ms
    if shift <= 0:
      return
    self.manifest, self.state = self._programs.shift_clock(
        self.manifest, self.state, np.float32(shift))
    if self._stamp is not None:    # the pending correction moves with them
      emitted, stamp, actual = self._stamp
      self._stamp = (emitted, np.float32(stamp) - np.float32(shift),
                     np.float32(actual) - np.float32(shift))
    self._device_epoch_ms = epoch

  @property
  def clock(self):
    """The injected clock (a ``VirtualClock`` when time is modelled)."""
    return self._clock

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
    executor (ValueError with the simulated one).

    ``cache_salt``: prefix-cache hits only between requests of the same
    salt (it enters the chained page keys; "" is the unsalted chain).
    """
    req = self._accept(request_id, prompt_token_ids, sampling, arrival_ms, priority, client,
                       slo_ttft_ms, slo_tpot_ms, logprobs, prompt_logprobs,
                       self._num_unfinished())
    if not req.finished:
      if cache_salt and self.prefix_cache is not None:
        self._prefix_keys[request_id] = self.prefix_cache.keys_for(req.prompt_token_ids,
                                                                   cache_salt)
      self._pending.append(req)
    return req

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
    reason = self.loop_refusal()
    if reason is not None:
      raise ValueError(f"add_future_request: {reason}")
    last = self._future[-1].arrival_ms if self._future else self.now_ms()
    if not arrival_ms >= last:
      raise ValueError(f"request {request_id!r}: arrival_ms {arrival_ms!r} is before "
                       f"{last!r} (now or the last future arrival); future requests "
                       f"come in arrival order")
    req = self._accept(request_id, prompt_token_ids, sampling, arrival_ms, priority, client,
                       slo_ttft_ms, slo_tpot_ms, False, False,
                       self._num_unfinished())
    if not req.finished:
      self._future.append(req)
    return req

  def _accept(self, request_id, prompt_token_ids, sampling, arrival_ms, priority, client,
              slo_ttft_ms, slo_tpot_ms, logprobs, prompt_logprobs,
              num_unfinished: int) -> Request:
    """``add_request``'s checks and records, ``num_unfinished`` counting
    against ``max_queued_requests``; a request that can never fit the KV
    cache is returned ended (``rejected``)."""
    c = self.config
    ids = [int(t) for t in prompt_token_ids]
    if request_id in self._requests:
      raise ValueError(f"request_id {request_id!r} is already in use")
    if not ids:
      raise ValueError(f"request {request_id!r}: prompt_token_ids must be non-empty")
    if len(ids) >= c.max_model_len:
      raise ValueError(
          f"request {request_id!r}: prompt_token_ids has {len(ids)} tokens; the "
          f"context (max_model_len={c.max_model_len}) leaves room for at most "
          f"{c.max_model_len - 1} prompt tokens")
    bad = [t for t in ids if not 0 <= t < self.model_cfg.vocab_size]
    if bad:
      raise ValueError(f"request {request_id!r}: prompt_token_ids must be in "
                       f"[0, {self.model_cfg.vocab_size}), got {bad[:4]}")
    if not isinstance(sampling, SamplingParams):
      raise ValueError(f"request {request_id!r}: sampling must be SamplingParams")
    if len(sampling.stop_token_ids) > c.max_stop_ids:
      raise ValueError(f"request {request_id!r}: stop_token_ids holds at most "
                       f"{c.max_stop_ids} ids, got {len(sampling.stop_token_ids)}")
    if not -2**31 <= int(priority) < 2**31:
      raise ValueError(f"request {request_id!r}: priority must be in [-2**31, 2**31) "
                       f"(an int32; lower runs first), got {priority}")
    for name, limit in (("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms)):
      if limit is not None and not limit > 0:
        raise ValueError(f"request {request_id!r}: {name} must be > 0 ms (None for "
                         f"no objective), got {limit!r}")
    if (logprobs or prompt_logprobs) and c.executor == "simulated":
      raise ValueError(f"request {request_id!r}: logprobs need the model executor "
                       f"(EngineConfig.executor='simulated' computes no logits)")
    if num_unfinished >= c.max_queued_requests:
      raise QueueFull(request_id, c.max_queued_requests)
    if client not in self._clients:
      if len(self._clients) >= c.num_clients:
        raise ValueError(f"client {client!r}: at most {c.num_clients} clients "
                         f"with requests held by the engine (EngineConfig.num_clients; "
                         f"evict finished requests to free a client)")
      self._clients[client] = (self._free_client_indices.pop(0)
                               if self._free_client_indices else len(self._clients))
    self._client_refs[client] = self._client_refs.get(client, 0) + 1
    req = Request(request_id=request_id, uid=self._next_uid, prompt_token_ids=ids,
                  sampling=sampling, priority=int(priority), client=client,
                  slo_ttft_ms=float("inf") if slo_ttft_ms is None else float(slo_ttft_ms),
                  slo_tpot_ms=float("inf") if slo_tpot_ms is None else float(slo_tpot_ms),
                  arrival_ms=self.now_ms() if arrival_ms is None else float(arrival_ms),
                  want_logprobs=bool(logprobs))
    if prompt_logprobs:
      req.prompt_logprobs = PromptLogprobs.empty(
          len(ids), min(MAX_LOGPROBS, self.model_cfg.vocab_size))
    self._next_uid += 1
    self._requests[request_id] = req
    # KV rows written at most: p + m - 1 (the last output is never fed
    # back), and never past the context (rows [0, max_model_len - 1)).
    rows = min(rec.kv_rows(len(ids), sampling.max_tokens), c.max_model_len - 1)
    need = kv_pages.pages_for(rows, c.page_size)
    if need > c.num_pages - 1:
      self._end(req, "rejected", f"needs {need} KV pages for {rows} KV rows "
                f"(prompt + max_tokens - 1); the cache has {c.num_pages - 1}")
    return req

  def abort(self, request_id: str) -> None:
    """Cancels a request at any lifecycle stage (pages are freed)."""
    req = self._requests.get(request_id)
    if req is None:
      raise ValueError(f"unknown request_id {request_id!r}")
    if req.finished:
      return
    for waiting in (self._pending, self._future):
      if req in waiting:
        waiting.remove(req)
        self._end(req, "cancelled", "abort")
        return
    mask = np.zeros(self.num_slots, bool)
    mask[req.slot] = True
    self.state, self.pages = self._programs.release(self.state, self.pages, mask, mask)
    self._slots[req.slot] = None
    self._end(req, "cancelled", "abort")

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
    req = self._requests.get(request_id)
    if req is None:
      raise ValueError(f"unknown request_id {request_id!r}")
    if not req.finished:
      if not req.output_token_ids:
        raise ValueError(f"request {request_id!r}: finish needs at least one output "
                         f"token (abort cancels a request that has none)")
      if req in self._pending:
        self._pending.remove(req)
      else:
        mask = np.zeros(self.num_slots, bool)
        mask[req.slot] = True
        self.state, self.pages = self._programs.release(self.state, self.pages, mask, mask)
        self._slots[req.slot] = None
      self._end(req, "completed", reason)
    return RequestOutput(req.request_id, [], True, req.outcome, req.finish_reason)

  def evict(self, request_id: str) -> Request:
    """Drops a finished request from the host tables and returns it; its
    client, once no request of it is left there, gives back its client index
    (its device service counters restart at zero for the next client).

    Raises:
      ValueError: unknown ``request_id``, or the request has no outcome yet.
    """
    req = self._requests.get(request_id)
    if req is None:
      raise ValueError(f"unknown request_id {request_id!r}")
    if not req.finished:
      raise ValueError(f"request {request_id!r} is live; abort or finish it first")
    del self._requests[request_id]
    self.realized_output_tokens.pop(request_id, None)
    self._client_refs[req.client] -= 1
    if not self._client_refs[req.client]:
      del self._client_refs[req.client]
      index = self._clients.pop(req.client)
      self.state = self._programs.forget_client(self.state, np.int32(index))
      self._free_client_indices.append(index)
    return req

  def _reject_slots(self, mask, reason: str, outcome: str = "rejected") -> None:
    """Ends the live requests in ``mask`` (bool[R]) with ``outcome``; frees
    their pages."""
    self.state, self.pages = self._programs.release(self.state, self.pages, mask, mask)
    for slot in np.flatnonzero(mask):
      self._end(self._slots[slot], outcome, reason)
      self._slots[slot] = None

  @property
  def last_step_stats(self):
    """(f64[4 + 2 * len(window kinds)] plan statistics, int bucket) of the
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
    """f64[len(cost_model.FEATURES)] of the last committed step (None before
    one), computed when read: ``cost_model.step_features`` of its plan
    statistics and the bucket its plan needed."""
    if self._last_plan_stats is None:
      return None
    stats, bucket = self._last_plan_stats
    return cost_lib.step_features(stats, bucket, self.model_costs)

  @property
  def last_step_rows(self):
    """(prefill rows, decode rows) of the last committed step (None before
    one): prompt and rebuild rows, and one row per decoding sequence, from
    its plan statistics (``cost_model.plan_stats``)."""
    if self._last_plan_stats is None:
      return None
    stats = np.asarray(self._last_plan_stats[0])
    return int(stats[0]), int(stats[1])

  def has_unfinished(self) -> bool:
    """Whether an accepted request, one still to arrive included, has no
    outcome yet."""
    return bool(self._pending or self._future) or any(r is not None for r in self._slots)

  def _num_unfinished(self) -> int:
    """Accepted requests without an outcome, the count
    ``max_queued_requests`` bounds: pending, live (in a slot) and still to
    enter a slot from ``add_future_request`` (``simulate`` may return with
    some whose arrival has passed, before it takes them)."""
    return len(self._pending) + len(self._future) + self._num_live()

  def _num_live(self) -> int:
    return sum(r is not None for r in self._slots)

  @property
  def requests(self) -> Dict[str, Request]:
    return self._requests

  def _end(self, req: Request, outcome: str, reason: str) -> None:
    assert outcome in OUTCOMES
    req.outcome, req.finish_reason = outcome, reason
    self._prefix_keys.pop(req.request_id, None)
    self._rehit_epoch.pop(req.request_id, None)
    self._rehit_tokens.pop(req.request_id, None)
    self._uncounted.pop(req.request_id, None)
    suspended = self.swap.pop(req.request_id)
    if suspended is not None:      # ended while suspended: the copy is void
      req.queue_record = pre.cancel(suspended.record)

  def _fill_slots(self) -> None:
    """Moves every request accepted since the last step into a free slot,
    doubling the slot table when none is free (``_grow``). Which slot a
    request gets decides nothing: policies order by recorded keys."""
    free = [s for s, r in enumerate(self._slots) if r is None]
    if len(free) < len(self._pending):
      self._grow(len(self._pending) + self._num_live())
      free = [s for s, r in enumerate(self._slots) if r is None]
    placed = list(zip(free, self._pending))
    hits = [self._match_prefix(req, slot) for slot, req in placed]
    for i in range(0, len(placed), ARRIVAL_BATCH):
      batch = placed[i:i + ARRIVAL_BATCH]
      pad = ARRIVAL_BATCH - len(batch)
      slots = np.array([s for s, _ in batch] + [-1] * pad, np.int32)
      arrivals = [self._arrival(req) for _, req in batch]
      arrivals += [jax.tree.map(np.zeros_like, arrivals[0])] * pad
      stacked = jax.tree.map(lambda *x: np.stack(x), *arrivals)
      batch_hits = np.array(hits[i:i + ARRIVAL_BATCH] + [0] * pad, np.int32)
      self.manifest, self.state, self.buffers = self._programs.arrive(
          self.manifest, self.state, self.buffers, slots, stacked, batch_hits)
    for slot, req in placed:
      req.slot = slot
      self._slots[slot] = req
      if self.prefix_cache is not None:
        self._uncounted[req.request_id] = req
    self._pending = []

  def _arrival(self, req: Request) -> Arrival:
    c, s = self.config, req.sampling
    prompt = np.zeros(c.max_model_len, np.int32)
    prompt[:len(req.prompt_token_ids)] = req.prompt_token_ids
    stop = np.full(c.max_stop_ids, -1, np.int32)
    stop[:len(s.stop_token_ids)] = s.stop_token_ids
    i32, f32 = np.int32, np.float32
    return Arrival(
        request_id=i32(req.uid), arrival_seq=i32(req.uid),
        arrival_ms=f32(self._device_ms(req.arrival_ms)),
        prompt_len=i32(len(req.prompt_token_ids)), max_tokens=i32(s.max_tokens),
        priority=i32(req.priority), client=i32(self._clients[req.client]),
        ttft_ms=f32(req.slo_ttft_ms), tbt_ms=f32(req.slo_tpot_ms),
        temperature=f32(s.temperature), top_k=i32(s.top_k), top_p=f32(s.top_p),
        seed=np.uint32(s.seed), min_tokens=i32(s.min_tokens),
        ignore_eos=np.bool_(s.ignore_eos), prompt=prompt, stop_ids=stop,
        logprobs=np.bool_(req.want_logprobs),
        prompt_logprobs=np.bool_(req.prompt_logprobs is not None))

  def _grow(self, num_requests: int) -> None:
    """Doubles the slot table until it holds ``num_requests`` (at most
    ``max_queued_requests``, which ``add_request`` and
    ``add_future_request`` enforce). Live slots keep their rows; the
    programs of the new size compile once per size, so an engine compiles
    at most log2(max_queued_requests / max_request_slots) + 1 sets.

    Raises:
      RuntimeError: ``num_requests`` over ``max_queued_requests`` (a
        request got past the bound: a bug in the count, not bad input).
    """
    c = self.config
    if num_requests > c.max_queued_requests:
      raise RuntimeError(
          f"slot table asked for {num_requests} slots, over "
          f"EngineConfig.max_queued_requests={c.max_queued_requests} (every accepted, "
          f"unfinished request counts against it; more than that got past the bound)")
    size = self.num_slots
    while size < num_requests:
      size = min(2 * size, c.max_queued_requests)
    old = (self.pages, self.buffers, self.manifest, self.state)
    new = programs_lib.slot_tables(c, size, self._placement)
    self.pages, self.buffers, self.manifest, self.state = jax.tree.map(
        programs_lib.keep_rows, new, old)
    if self._stamp is not None:        # the pending emission correction keeps its slots
      emitted, stamp, actual = self._stamp
      self._stamp = (programs_lib.keep_rows(self._placement.tables(np.zeros(size, bool)),
                                            emitted), stamp, actual)
    self._slots += [None] * (size - self.num_slots)
    self._programs = programs_lib.programs(self.model_cfg,
                                           dataclasses.replace(c, max_request_slots=size))
    self._program_sets.append(self._programs)

  # ------------------------------------------------------- prefix caching
  def _match_prefix(self, req: Request, slot: int) -> int:
    """Maps the longest cached prefix of ``req``'s prompt into ``slot``'s
    (empty) page table; returns the hit in tokens (0 without a cache)."""
    cache = self.prefix_cache
    if cache is None:
      return 0
    keys = self._prefix_keys.get(req.request_id)
    if keys is None:
      keys = self._prefix_keys[req.request_id] = cache.keys_for(req.prompt_token_ids)
    if req.prompt_logprobs is not None:    # every prompt row must run to be scored
      req.prefix_hit_tokens = 0
      return 0
    hit = cache.match(keys, len(req.prompt_token_ids))
    if hit:
      ids = np.full(self.config.pages_per_seq, kv_pages.NULL_PAGE, np.int32)
      ids[:len(hit)] = hit
      self.pages = self._programs.map_prefix(self.pages, np.int32(slot), ids,
                                             np.int32(len(hit)))
    req.prefix_hit_tokens = len(hit) * self.config.page_size
    return req.prefix_hit_tokens

  def _rehit_preempted(self) -> None:
    """A recompute-preempted request (no preserved copy) looks its prompt up
    again once per preemption: its own cached pages, kept cached when it was
    preempted, or anyone's, are mapped back and it resumes from the hit."""
    if not any(r is not None and r.num_preemptions
               and self._rehit_epoch.get(r.request_id) != r.num_preemptions
               for r in self._slots):
      return                     # nobody to look up again: no round trip
    computed, held, status = self._fetch((self.state.computed,
                                             self.pages.pages_held, self.state.status))
    for slot, req in enumerate(self._slots):
      if (req is None or not req.num_preemptions or held[slot] or computed[slot]
          or status[slot] != rec.WAITING
          or self._rehit_epoch.get(req.request_id) == req.num_preemptions):
        continue
      suspended = self.swap.get(req.request_id)
      if suspended is not None and suspended.k is not None:
        continue                 # swap restores its exact copy instead
      self._rehit_epoch[req.request_id] = req.num_preemptions
      hit = self._match_prefix(req, slot)
      self._rehit_tokens[req.request_id] = hit
      if hit:
        self.state = self._programs.resume_prefix(self.state, np.int32(slot),
                                                  np.int32(hit))

  def _unpin_waiting_hits(self) -> None:
    """A waiting request's prefix hit pins cached pages in its table. When
    the running requests' next rows need more pages than are free or
    evictable, the hits of waiting requests are dropped, latest arrival
    first, until they fit: those pages become evictable again and the
    request's prefill starts from 0 (a hit never starves a running request
    into preempting itself)."""
    c = self.config
    computed, held, status, census = self._fetch((
        self.state.computed, self.pages.pages_held, self.state.status,
        kv_pages.page_census(self.pages)))
    running = status == rec.RUNNING
    need = int(np.sum(running & (kv_pages.pages_for(computed + 1, c.page_size) > held)))
    short = need - int(census[0]) - int(census[1])
    if short <= 0:
      return
    refcount, table = self._fetch((self.pages.refcount, self.pages.page_table))
    refcount = np.array(refcount)
    pinned = [s for s, r in enumerate(self._slots)
              if r is not None and status[s] == rec.WAITING and held[s] > 0]
    for slot in sorted(pinned, key=lambda s: -self._slots[s].uid):
      if short <= 0:
        break
      ids = table[slot, :held[slot]]
      short -= int(np.sum(refcount[ids] == 1))
      refcount[ids] -= 1
      mask = np.zeros(self.num_slots, bool)
      mask[slot] = True
      self.pages = self._programs.unpin(self.pages, mask)
      self.state = self._programs.resume_prefix(self.state, np.int32(slot), np.int32(0))
      req = self._slots[slot]
      req.prefix_hit_tokens = 0
      self._rehit_tokens.pop(req.request_id, None)

  def _prefix_hits(self) -> Optional[np.ndarray]:
    """i32[R] prefix-hit tokens of each slot's request (None when off)."""
    if self.prefix_cache is None:
      return None
    return np.array([0 if r is None else r.prefix_hit_tokens for r in self._slots],
                    np.int32)

  def _count_prefix_use(self, computed) -> None:
    """Counts the prompt of every request whose first chunk just ran, with
    the hit it ran from (``PrefixCache.count_use``), once per request.

    Args:
      computed: i32[R] computed frontiers published by the step (host). A
        request's frontier starts at its hit (0 once the hit is dropped) and
        passes it with its first chunk (at least one prompt token is left
        to compute); it was running before any preemption, so a resume
        lookup is never counted.
    """
    for request_id, req in list(self._uncounted.items()):
      if int(computed[req.slot]) > req.prefix_hit_tokens:
        self.prefix_cache.count_use(len(req.prompt_token_ids), req.prefix_hit_tokens)
        del self._uncounted[request_id]

  def _register_prefixes(self, fetched, skip) -> None:
    """Adds the computed full prompt pages of every slot live before the
    step's releases to the cache, and publishes the table when it changed
    or when the step program held pages for it (``_hold_last_prompt_pages``:
    those the table did not take return to the free stack).

    Args:
      fetched: the step's ``StepFacts.prefix`` on the host: (computed
        i32[R], pages_held i32[R], page_table i32[R, pages_per_seq] before
        the step released any slot, marked bool[]: whether the step held
        pages for the host).
      skip: bool[R] slots whose pages are not to be added (failed logits).
    """
    c, cache = self.config, self.prefix_cache
    computed, held, table, marked = fetched
    added = 0
    for slot, req in enumerate(self._slots):
      if req is None or (skip is not None and skip[slot]):
        continue
      full = min(int(computed[slot]), len(req.prompt_token_ids), int(held[slot]) *
                 c.page_size) // c.page_size
      if full:
        keys = self._prefix_keys[req.request_id]
        added += cache.register(keys[:full], table[slot, :full])
    if added or marked:
      self.pages = self._programs.sync_cached(self.pages, cache.cached_mask())

  def step(self) -> List[RequestOutput]:
    """Runs one iteration; returns the news for every request it touched.

    Read top-down (the module docstring numbers the same steps): fill slots
    -> the ``plan`` program (tick, the policy's one plan, its rule check)
    -> settle the plan where its facts call for it, one rule per step ->
    the ``step`` program in the bucket of the rows bound (execute, check,
    apply) -> drain. An iteration that rejects a request the policy can
    never schedule, or whose plan is empty, ends at the settle step without
    running the model; the next call plans again.

    Raises:
      validate.PlanValidationError / ResultValidationError: the policy's
        plan or the executor's result broke a rule (``scheduler.validate``).
      RuntimeError: the policy selected nothing while requests are live and
        no arrival is pending (no progress is possible).
    """
    self._fill_slots()
    if self.prefix_cache is not None:
      if self.num_preemptions:
        self._rehit_preempted()
      if self._pages_low:
        self._unpin_waiting_hits()
    now_ms = self.now_ms()
    self._rebase_device_clock(now_ms)
    launch = self._device_ms(now_ms)
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
      self._evict(int(facts.evict), refcount)
    preserved = self._suspend(facts.preempt, plan.decision_id)
    self._resume_admitted(facts.admit, facts.preempt)
    return self._execute(plan, facts, preserved, launch)

  def _plan_iteration(self, launch):
    """The ``plan`` program: publishes the ticked state (the last
    iteration's emission stamps corrected, ``_tick``) and returns this
    iteration's plan (on the device), its ``PlanFacts`` (fetched) and the
    page refcounts once its preemptions released theirs (on the device;
    read only to evict)."""
    fix_emitted, fix_stamp, fix_actual = self._pending_stamp()
    self.state, plan, facts, refcount = self._programs.plan(
        self.manifest, self.state, self.pages, self._prefix_hits(), launch,
        fix_emitted, fix_stamp, fix_actual)
    self._stamp = None
    self.policy_evaluations += 1
    return plan, self._fetch(facts), refcount

  def _reject_never(self, never) -> List[RequestOutput]:
    """Rejects the slots (bool[R]) the policy says it can never schedule;
    their news ends the iteration."""
    names = [self._slots[s] for s in np.flatnonzero(never)]
    self._reject_slots(never, f"policy {self.policy.policy_id} can never schedule it "
                       f"(token budget {self.config.max_num_batched_tokens}, "
                       f"{self.config.num_pages - 1} KV pages)")
    return [RequestOutput(r.request_id, [], True, r.outcome, r.finish_reason)
            for r in names]

  def _idle(self) -> List[RequestOutput]:
    """An empty plan: no news, unless requests are live and nothing can
    change the next plan (stepping again would spin: a policy that leaves
    live work unscheduled forever is a scheduler bug; say so)."""
    if any(r is not None for r in self._slots) and not self._pending:
      live = [r.request_id for r in self._slots if r is not None]
      raise RuntimeError(f"policy {self.policy.policy_id} selected no work while "
                         f"requests {live[:8]} are live; no progress is possible")
    return []

  def _evict(self, count: int, refcount) -> None:
    """Evicts ``count`` unreferenced cached pages, least recently used
    first, so that the free stack covers the pages the plan allocates
    (``PlanFacts.evict``); ``refcount`` is i32[num_pages] once the plan's
    preemptions released their pages."""
    self.prefix_cache.evict(count, self._fetch(refcount))
    self.pages = self._programs.sync_cached(self.pages, self.prefix_cache.cached_mask())

  def _resume_admitted(self, admit, preempt) -> None:
    """Settles the re-admission of every admitted slot (bool[R]) whose
    request was preempted and suspended (``_resume``)."""
    for slot in np.flatnonzero(admit):
      if self.swap.get(self._slots[slot].request_id) is not None:
        self._resume(slot, preempt)

  def _execute(self, plan, facts, preserved, launch) -> List[RequestOutput]:
    """The ``step`` program, then the commit and the drain.

    The bucket is that of ``PlanFacts.rows_bound`` (the most rows any valid
    plan on this state could take), not the smallest holding the plan: the
    same plans with prompt rows ran faster there on this CPU (the Azure-conv
    trace of ``scripts/bench_engine.py``: 175 s against 209 s;
    docs/benchmarks.md "One path per iteration"). A row's bits do not
    depend on the bucket (``llama.row_tiled``)."""
    c = self.config
    bucket = c.iteration_bucket(int(facts.rows_bound), int(facts.num_tokens))
    realized = self._realized() if c.executor == "simulated" else None
    (self.kv, self.pages, self.buffers, state, aux, step_facts) = self._programs.step(
        self.params, self.kv, self.pages, self.buffers, self.manifest, self.state,
        plan, realized, preserved, num_rows=bucket)
    return self._commit(state, aux, self._fetch(step_facts), bucket, launch, facts.preempt)

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
      self._clock.advance(self.cost_model.predict_ms(self.last_step_features) / 1000.0)
    emit_ms = self.now_ms()
    # The program stamped this iteration's emissions with its launch time;
    # the next plan program moves them to ``emit_ms``, before any policy
    # reads them (``_tick``).
    self._stamp = (result.emitted, launch, self._device_ms(emit_ms))
    self.num_iterations += 1
    if self.prefix_cache is not None:
      self._count_prefix_use(facts.prefix[0])
      # Before the drain releases the requests that ended in this step: a
      # request whose last prompt chunk emitted its last token still leaves
      # its computed pages in the cache (not one whose logits failed).
      self._register_prefixes(facts.prefix, skip=facts.failed)
    token_logprobs = self._take_logprobs(logprobs, facts.emitted)
    return self._drain(emit_ms, facts.emitted, facts.token, facts.finished,
                       facts.finish_reason, facts.failed, preempt, token_logprobs)

  def _take_logprobs(self, logprobs, emitted) -> Dict[int, TokenLogprobs]:
    """Fetches this step's ``StepLogprobs`` when a request that asked used
    them (one more fetch; none otherwise): records the prompt rows of
    requests still in their prompt, and returns each emitting slot's
    ``TokenLogprobs`` (slot -> logprobs) for requests with ``logprobs``.
    A prompt row computed again (a recompute after preemption) writes the
    same values again."""
    if logprobs is None:
      return {}
    out = [s for s in np.flatnonzero(emitted)
           if self._slots[s] is not None and self._slots[s].want_logprobs]
    prompt = any(r is not None and r.prompt_logprobs is not None and not r.output_token_ids
                 for r in self._slots)
    if not out and not prompt:
      return {}
    tree = {}
    if out:
      tree["out"] = (logprobs.token, logprobs.top_ids, logprobs.top)
    if prompt:
      tree["prompt"] = (logprobs.num_prompt, logprobs.prompt_slot, logprobs.prompt_pos,
                        logprobs.prompt_token, logprobs.prompt_top_ids, logprobs.prompt_top)
    got = self._fetch(tree)
    if prompt:
      count, slots, positions, chosen, top_ids, top = got["prompt"]
      for j in range(int(count)):
        req = self._slots[int(slots[j])]
        if req is None or req.prompt_logprobs is None:
          continue
        at = int(positions[j]) + 1
        req.prompt_logprobs.token[at] = chosen[j]
        req.prompt_logprobs.top_ids[at] = top_ids[j]
        req.prompt_logprobs.top[at] = top[j]
    if not out:
      return {}
    chosen, top_ids, top = got["out"]
    return {int(s): TokenLogprobs(float(chosen[s]), np.array(top_ids[s]), np.array(top[s]))
            for s in out}

  def _pending_stamp(self):
    """(bool[R] emitted, f32[] launch stamp, f32[] publication time) of the
    last iteration, still to be corrected on the device; a no-op
    triple when none is pending."""
    if self._stamp is None or self._stamp[0].shape[0] != self.num_slots:
      return self._no_stamp(), np.float32(0), np.float32(0)
    return self._stamp

  def _no_stamp(self):
    if self._no_stamp_mask is None or self._no_stamp_mask.shape[0] != self.num_slots:
      self._no_stamp_mask = self._placement.tables(np.zeros(self.num_slots, bool))
    return self._no_stamp_mask

  def _fetch(self, tree):
    """``jax.device_get`` counted in ``host_fetches`` (blocking round trips)."""
    self.host_fetches += 1
    return jax.device_get(tree)

  def compile_buckets(self) -> Dict[int, float]:
    """Compiles this slot-table size's ``plan`` program and the ``step``
    program of every token bucket, so that no compile lands in a later
    measurement: each runs once, the step programs on a plan that selects
    nothing (every row padding: no page allocated, no K/V written, nothing
    emitted; the state they publish is dropped). Returns {bucket: seconds}
    (compile and one run; near zero when XLA's persistent compilation
    cache holds them)."""
    launch = self._device_ms(self.now_ms())
    _, plan, facts, _ = self._programs.plan(
        self.manifest, self.state, self.pages, self._prefix_hits(), launch,
        self._no_stamp(), np.float32(0), np.float32(0))
    jax.block_until_ready(facts)
    none = lambda m: m & False       # on the plan's devices, as it is placed
    nothing = plan.replace(selected=none(plan.selected), admit=none(plan.admit),
                           preempt=none(plan.preempt), num_tokens=plan.num_tokens * 0,
                           num_seqs=plan.num_seqs * 0)
    realized = self._realized() if self.config.executor == "simulated" else None
    seconds = {}
    for bucket in self.config.token_buckets:
      t = time.perf_counter()
      (self.kv, self.pages, self.buffers, _, _, step_facts) = self._programs.step(
          self.params, self.kv, self.pages, self.buffers, self.manifest, self.state,
          nothing, realized, np.zeros(self.num_slots, np.int32), num_rows=bucket)
      jax.block_until_ready(step_facts)
      seconds[bucket] = time.perf_counter() - t
    return seconds

  def _realized(self) -> np.ndarray:
    """i32[R] recorded output length of each slot's request (declared
    max_tokens when none was recorded); the simulated executor's truth."""
    out = np.zeros(self.num_slots, np.int32)
    for slot, req in enumerate(self._slots):
      if req is not None:
        out[slot] = self.realized_output_tokens.get(req.request_id, req.sampling.max_tokens)
    return out

  def _log_plan(self, plan) -> None:
    sel, start, end, kind, rank, admit, preempt, decision, status = self._fetch((
        plan.selected, plan.start, plan.end, plan.kind, plan.rank, plan.admit,
        plan.preempt, plan.decision_id, self.state.status))
    name = lambda s: self._slots[s].request_id
    rows = sorted(np.flatnonzero(sel), key=lambda s: rank[s])
    self.plan_log.append(dict(
        decision_id=int(decision), policy_id=plan.policy_id,
        scheduled=[(name(s), int(start[s]), int(end[s]), rec.KIND_NAMES[kind[s]])
                   for s in rows],
        admitted=[name(s) for s in rows if admit[s]],
        preempted=[name(s) for s in np.flatnonzero(preempt)],
        running=[name(s) for s in np.flatnonzero(status == rec.RUNNING)]))

  # ------------------------------------------------------- preemption (§0x0C)
  def _suspend(self, preempt, decision_id) -> np.ndarray:
    """Settles the preemption of every ``preempt`` slot (bool[R]) on the host:
    in "swap" mode copies its committed KV pages to host memory. Returns
    i32[R] preserved prefix tokens (the result's ``preserved_end``)."""
    c = self.config
    preserved = np.zeros(self.num_slots, np.int32)
    if not preempt.any():
      return preserved
    computed, generation, held, table, decision_id = self._fetch((
        self.state.computed, self.state.generation, self.pages.pages_held,
        self.pages.page_table, decision_id))
    for slot in np.flatnonzero(preempt):
      req = self._slots[slot]
      target = int(computed[slot])
      snapshot = kv_swap.digest(np.asarray(
          req.prompt_token_ids + req.output_token_ids, np.int32))
      epoch = req.num_preemptions + 1
      record = pre.QueueRecord(req.request_id, int(generation[slot]), snapshot,
                               epoch - 1)
      mode = pre.PRESERVE_EXACT if c.preemption_mode == "swap" else pre.RECOMPUTE
      intent = pre.PreemptionIntent(
          intent_id=f"{req.request_id}@{epoch}",
          binding=pre.Binding(req.request_id, int(generation[slot]), snapshot, epoch),
          mode=mode, fallback=pre.RECOMPUTE, semantic_target_tokens=target,
          reason="kv_pressure", policy_id=self.policy.policy_id,
          decision_version=int(decision_id))
      record = pre.begin_preemption(record, intent)
      release = pre.ReleaseResult(record.binding, pre.READY,
                                  int(held[slot]) * self._page_bytes)
      k = v = preservation = None
      if mode == pre.PRESERVE_EXACT:
        n = kv_pages.pages_for(target, c.page_size)
        if n == 0:
          preservation = pre.PreservationResult(record.binding, pre.READY, 0)
        elif self.swap.fits(n * self._page_bytes):
          ids = np.full(kv_swap.page_bucket(n, c.pages_per_seq), kv_pages.NULL_PAGE,
                        np.int32)
          ids[:n] = table[slot, :n]
          k, v = self._fetch(self._programs.gather(self.kv, ids))
          k, v = np.array(k[:, :n]), np.array(v[:, :n])
          preservation = pre.PreservationResult(record.binding, pre.READY, target)
        else:
          self.swap.fallbacks += 1
          preservation = pre.PreservationResult(record.binding, pre.FAILED, 0)
      record = pre.settle(record, intent, release, preservation)
      suspension = kv_swap.Suspension(
          record, intent, release, preservation, k, v,
          kv_swap.digest(k, v) if k is not None else "")
      self.swap.put(req.request_id, suspension)
      req.queue_record = record
      preserved[slot] = suspension.ready_tokens
    return preserved

  def _resume(self, slot: int, preempt) -> None:
    """Re-admission of a suspended request: derives its ResumeTicket and, for
    a preserved copy, writes the pages back before the model runs."""
    c = self.config
    req = self._slots[slot]
    s = self.swap.pop(req.request_id)
    record = pre.request_resume(s.record)
    allocation = pre.ReadinessReceipt(record.binding, "allocation", pre.READY)
    ticket = pre.derive_resume_ticket(record, s.intent, s.release, s.preservation,
                                      (allocation,))
    if ticket is None:
      raise RuntimeError(f"request {req.request_id!r}: resume facts incomplete")
    if s.k is not None:
      if kv_swap.digest(s.k, s.v) != s.bytes_sha256:
        raise pre.StaleReceipt(f"request {req.request_id!r}: preserved KV bytes do "
                               f"not match their digest; refusing to resume from them")
      n = s.k.shape[1]
      pad = [(0, 0), (0, kv_swap.page_bucket(n, c.pages_per_seq) - n)] + [(0, 0)] * 3
      self.kv, self.pages = self._programs.restore(
          self.kv, self.pages, preempt, np.int32(slot), np.int32(n),
          np.pad(s.k, pad), np.pad(s.v, pad))
      self.swap.restored(s)
    # Rows a prefix hit mapped back are not recomputed.
    req.recompute_tokens += ticket.recompute_overhead_tokens - self._rehit_tokens.pop(
        req.request_id, 0)
    req.queue_record = pre.complete_resume(record, ticket)

  def _drain(self, emit_ms, emitted, token, finished, reason, failed, preempt,
             token_logprobs: Optional[Dict[int, TokenLogprobs]] = None):
    token_logprobs = token_logprobs or {}
    outputs, release = [], np.zeros(self.num_slots, bool)
    extensions = None     # §0x06 extensions per slot, fetched when one ends
    self.num_preemptions += int(preempt.sum())
    limit = self.config.max_preemptions_per_request
    thrashing = np.zeros_like(release)
    for slot in np.flatnonzero(emitted | failed | preempt):
      req = self._slots[slot]
      if preempt[slot]:
        req.num_preemptions += 1
        if limit and req.num_preemptions > limit:
          thrashing[slot] = True
          continue
      new, new_logprobs = [], None
      if emitted[slot]:
        new = [int(token[slot])]
        req.output_token_ids.extend(new)
        req.token_times_ms.append(emit_ms)
        if req.want_logprobs:
          new_logprobs = [token_logprobs[slot]]
          req.output_logprobs.extend(new_logprobs)
      if failed[slot]:
        self._end(req, "failed", "non-finite logits")
      elif finished[slot]:
        self._end(req, "completed", rec.FINISH_NAMES[int(reason[slot])])
      if req.finished:
        if extensions is None:
          extensions = jax.device_get(self.state.num_extensions)
        req.num_extensions = int(extensions[slot])
        release[slot] = True
        self._slots[slot] = None
      if new or req.finished:
        outputs.append(RequestOutput(req.request_id, new, req.finished,
                                     req.outcome, req.finish_reason,
                                     new_logprobs if new_logprobs else None))
    if release.any():
      none = np.zeros_like(release)
      self.state, self.pages = self._programs.release(self.state, self.pages, none, release)
    if thrashing.any():           # no preemption livelock: bounded, reported
      names = [self._slots[s] for s in np.flatnonzero(thrashing)]
      self._reject_slots(thrashing, f"preempted more than {limit} times "
                         f"(EngineConfig.max_preemptions_per_request)", outcome="failed")
      outputs += [RequestOutput(r.request_id, [], True, r.outcome, r.finish_reason)
                  for r in names]
    return outputs

  # ------------------------------------------------- many iterations per call
  def loop_refusal(self) -> Optional[str]:
    """Why ``simulate`` cannot run this engine, None when it can: it needs
    the simulated executor on a virtual clock, prefix caching off, recompute
    preemption, one device and ``record_plans`` off (``sim_loop.refusal``)."""
    return sim_loop.refusal(self.config, self._virtual, self.record_plans)

  def simulate(self, stop_ms: float = math.inf, *, max_iterations: Optional[int] = None,
               iterations_per_call: int = sim_loop.LOOP_ITERATIONS) -> None:
    """Runs iterations, many per program call (``sim_loop``), until no
    request is live, pending or still to arrive (``add_future_request``),
    or the clock reaches ``stop_ms`` (engine ms; the requests that have
    arrived by then are pending), or ``max_iterations`` ran in this call
    (checked between program calls). The iterations are those ``step``
    runs: the same plans, outputs and counters, and the same times (the
    device repeats the host's float64 clock arithmetic; XLA may round a
    step time's last bit otherwise: ``sim_loop``); an iteration that needs
    the host (a rule violation, a never-schedulable request, a preemption
    or a preempted request's re-admission, an empty plan, the device epoch
    to move) is run by ``step``. Outputs are not returned: the requests'
    records hold them.

    Raises:
      ValueError: an engine the loop does not cover (``loop_refusal``).
      validate.PlanValidationError / ResultValidationError, RuntimeError:
        as ``step``.
    """
    reason = self.loop_refusal()
    if reason is not None:
      raise ValueError(f"Engine.simulate: {reason}; use Engine.step()")
    start = self.num_iterations
    while max_iterations is None or self.num_iterations - start < max_iterations:
      now_ms = self.now_ms()
      self._take_arrived(now_ms)
      if now_ms >= stop_ms:
        return
      if not self._pending and all(r is None for r in self._slots):
        if not self._future:
          return
        self._advance_to(self._future[0].arrival_ms)
        self._take_arrived(self._future[0].arrival_ms)
        continue
      self._fill_slots()
      self._rebase_device_clock(self.now_ms())
      if self._simulate_call(stop_ms, iterations_per_call) in (sim_loop.LoopExit.HOST,
                                                                sim_loop.LoopExit.REBASE):
        self._take_arrived(self.now_ms())
        self.step()

  def _take_arrived(self, now_ms: float) -> None:
    """Future requests that arrived by ``now_ms`` become pending."""
    n = 0
    while n < len(self._future) and self._future[n].arrival_ms <= now_ms:
      n += 1
    self._pending += self._future[:n]
    del self._future[:n]

  def _advance_to(self, ms: float) -> None:
    """Moves the virtual clock forward until ``now_ms() >= ms``."""
    while self.now_ms() < ms:
      self._clock.advance(max((ms - self.now_ms()) / 1000.0, math.ulp(self._clock())))

  def _simulate_call(self, stop_ms: float, iterations: int) -> int:
    """One ``loop`` program call from the host tables; takes its log.
    Returns its exit code (``sim_loop.LoopExit``)."""
    c = self.config
    loop = sim_loop.loop_program(self.model_cfg, c, self.cost_model, self.model_costs,
                                 iterations)
    if loop not in self._loop_sets:
      self._loop_sets.append(loop)
    epoch = self._device_epoch_ms
    free = sum(r is None for r in self._slots)
    queued = self._future[:min(sim_loop.QUEUE_SIZE, free)]
    if len(queued) < len(self._future):      # the next one waits for a free slot
      stop_ms = min(stop_ms, self._future[len(queued)].arrival_ms)
    queue = sim_loop.make_queue(
        [self._arrival(r) for r in queued], [r.arrival_ms for r in queued],
        [self.realized_output_tokens.get(r.request_id, r.sampling.max_tokens) for r in queued],
        [r.arrival_ms == epoch for r in queued],
        Arrival.empty(c.max_model_len, c.max_stop_ids))
    at_epoch = np.array([r is not None and r.arrival_ms == epoch for r in self._slots])
    bits = sim_loop.to_bits
    # The loop carries no token stream: the simulated executor reads none,
    # and the host takes the tokens from the log (sim_loop.simulate_steps).
    tokens = self.buffers.tokens
    self.manifest, self.state, self.pages, buffers, log = loop.run(
        self.params, self.kv, self.manifest, self.state, self.pages,
        self.buffers.replace(tokens=None), self._realized(), at_epoch, queue,
        *self._pending_stamp(), bits(self._clock()), bits(self._t0), bits(epoch), bits(stop_ms),
        bits(DEVICE_REBASE_MS))
    self.buffers = buffers.replace(tokens=tokens)
    log = self._fetch(log)
    self._take_log(log, queued)
    self._clock.advance_to(float(sim_loop.from_bits(log.clock)))
    return int(log.code)

  def _take_log(self, log: sim_loop.SimLog, queued: List[Request]) -> None:
    """The host's side of a ``loop`` call's iterations, as ``_commit`` and
    ``_drain`` keep them for ``step``: the admitted requests' slots, tokens
    and their times, outcomes, released slots, counters."""
    live = [r for r in self._slots if r is not None]
    admitted = queued[:int(log.num_admitted)]
    for req, slot in zip(admitted, log.admitted_slot):
      req.slot = int(slot)
    del self._future[:len(admitted)]
    by_uid = {r.uid: r for r in live + admitted}
    n, num_events = int(log.num_iterations), int(log.num_events)
    emit_ms = sim_loop.from_bits(log.emit[:n])
    # Events grouped by request, each request's in iteration order; an
    # ending event (finished or failed) is its request's last.
    uid = log.event_request[:num_events]
    order = np.argsort(uid, kind="stable")
    uids, starts = np.unique(uid[order], return_index=True)
    ends = np.append(starts[1:], num_events).tolist()
    take = lambda a: a[:num_events][order].tolist()
    tokens, failed, finished = take(log.event_token), take(log.event_failed), take(
        log.event_finished)
    reason, extensions = take(log.event_reason), take(log.event_extensions)
    times = emit_ms[log.event_iteration[:num_events][order]].tolist()
    for u, a, b in zip(uids.tolist(), starts.tolist(), ends):
      req, last = by_uid[u], b - 1
      emitted = last if failed[last] else b      # a failed event emits nothing
      req.output_token_ids.extend(tokens[a:emitted])
      req.token_times_ms.extend(times[a:emitted])
      if failed[last]:
        self._end(req, "failed", "non-finite logits")
      elif finished[last]:
        self._end(req, "completed", rec.FINISH_NAMES[reason[last]])
      if req.finished:
        req.num_extensions = extensions[last]
    for req in live:              # before the admitted: a slot may be taken again
      if req.finished:
        self._slots[req.slot] = None
    for req in admitted:
      if not req.finished:
        self._slots[req.slot] = req
    self.num_iterations += n
    self.policy_evaluations += n
    for bucket in log.bucket[:n]:
      self.buckets_used[int(bucket)] = self.buckets_used.get(int(bucket), 0) + 1
    self.prefill_tokens_computed += int(np.sum(log.prefill_rows[:n]))
    if n:
      self._last_plan_stats = (log.stats[n - 1], int(log.bucket[n - 1]))
    self._stamp = None          # the loop applied the pending correction and its own

  def run(self, max_iterations: Optional[int] = None) -> None:
    """Steps until every accepted request has an outcome. Requests still to
    arrive (``add_future_request``) are run by ``simulate``, which admits
    them at their arrival (``step`` admits only requests already added).

    Raises:
      RuntimeError: requests are unfinished after ``max_iterations``
        iterations (``simulate`` checks between program calls).
    """
    if self._future:
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
    reqs = [self.add_request(f"gen-{self._next_uid}", p, sampling) for p in prompts]
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
    if self.prefix_cache is None:
      return dict(prefix_cache_queries=0, prefix_cache_hits=0, prefix_cache_hit_rate=0.0,
                  prefix_cache_evictions=0, prefix_cache_pages=0)
    return self.prefix_cache.stats()

  def compiled_programs(self) -> Dict[str, int]:
    """Programs traced (and so compiled) per jitted function, summed over
    the slot-table sizes this engine used and shared by engines with equal
    model and engine configs. Per size, ``step`` (the iteration program of
    both paths, the only one holding the model) is bounded by
    ``len(config.token_buckets)``; ``swap_out`` / ``swap_in`` (swap mode
    only) by the power-of-two page counts up to ``pages_per_seq``; the
    others, ``simulate``'s ``loop`` among them (per iterations per call), by 1."""
    total: Dict[str, int] = {}
    for programs in self._program_sets + self._loop_sets:
      for name, n in programs.cache_sizes().items():
        total[name] = total.get(name, 0) + n
    return total
