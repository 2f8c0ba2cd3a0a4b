"""The engine's iteration body and its jitted programs, pure functions of
pytrees.

The body, public so that every driver builds on it (``Engine.step`` through
the jitted programs below, ``sim_loop.simulate_steps`` inside its loop):

* ``arrive`` / ``arrive_batch``: requests written into free slots;
* ``plan_step``: tick, the policy's one plan (``scheduler.iteration``), its
  rule check and the ``PlanFacts`` the host acts on;
* ``execute_step``: the plan run in a token bucket by the executor (whose
  stop rules are ``scheduler.iteration.stop_rules``), the result checked
  and published (``scheduler.iteration.publish``);
* ``release_slots``: ended or cancelled slots given back.

``programs`` jits them once per (model config, engine config): the ``plan``
and ``step`` programs, the slot writers and the swap copies
(``swap_out``/``swap_in``; ``reserve`` for a simulated handoff). The set of
compiled programs is fixed by the config and the slot-table size: per
size, one ``plan`` program, one ``step`` per token bucket in
``EngineConfig.token_buckets``, one arrival writer, one release/cancel
writer, and, where used, the prefix-cache, clock and swap writers
(``Engine.compiled_programs`` reports what was compiled;
``serving.cli.launch.warmup`` compiles them, after which a run compiles
nothing more)."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from models import llama
from models import rowgemm
from models import sharding
from scheduler import apply as apply_lib
from scheduler import iteration
from scheduler import keys
from scheduler import records as rec
from scheduler import validate
from scheduler.policies import Budgets, make_policy
from scheduler.policy_forced import ForcedPreemption
from scheduler.policy_speculative import AdaptiveDraft, FixedDraft
from serving.engine import cost_model as cost_lib
from serving.engine import sim_executor
from serving.engine.config import EngineConfig, ExecutorConfig
from serving.engine.executor import ModelRunner, allocate_for_plan, execute, init_buffers
from serving.engine.facts import Arrival, PlanFacts, StepFacts
from serving.kv import pages as kv_pages
from serving.kv import swap as kv_swap

@dataclasses.dataclass(frozen=True)
class _Programs:
  """The engine's jitted functions for one (model config, engine config)."""

  policy: object
  plan: Callable
  step: Callable
  arrive: Callable
  release: Callable
  swap_out: Callable
  swap_in: Callable
  reserve: Callable
  shift_clock: Callable
  forget_client: Callable
  map_prefix: Callable
  sync_cached: Callable
  resume_prefix: Callable
  unpin: Callable
  retick: Callable

  traces: Dict[str, int]
  executor_traces: Dict[str, int]

  def cache_sizes(self) -> Dict[str, int]:
    return {**self.executor_traces, **self.traces}


@dataclasses.dataclass(frozen=True)
class _Executor:
  """The programs that read no policy: slot writers, swap."""

  arrive: Callable
  release: Callable
  swap_out: Callable
  swap_in: Callable
  reserve: Callable
  traces: Dict[str, int]


def _table_sizes(config: EngineConfig) -> Tuple[int, ...]:
  """The scheduler settings that size the slot tables and the token bucket
  the slot programs see: slots, sequence and token budgets, clients."""
  return (config.max_request_slots, config.max_num_seqs, config.max_num_batched_tokens,
          config.num_clients)


@functools.lru_cache(maxsize=16)
def _executor(model_cfg, executor_config: ExecutorConfig, executor: str,
              tables: Tuple[int, ...]) -> _Executor:
  """The policy-free slot and swap programs for one engine shape: the
  executor part of the config, the executor kind and the table sizes
  (``_table_sizes``). Engines differing only in scheduler settings (policy,
  reservation, preemption, prefix caching) share them; the model step lives
  in the ``step`` program."""
  del executor, tables   # cache keys: one trace count per engine shape
  traces: Dict[str, int] = {}
  placement = sharding.Placement(model_cfg, sharding.make_mesh(executor_config.mesh))
  # Over a mesh every output keeps the sharding its input had (the cache
  # split, the tables replicated), so each program compiles once per shape.
  jit = functools.partial(counting_jit, traces=traces, **placement.pinned())
  return _Executor(
      arrive=jit("arrive", arrive_batch, donate_argnums=(2,)),
      release=jit("release", release_slots),
      swap_out=jit("swap_out", kv_swap.gather_pages),
      swap_in=jit("swap_in", kv_swap.restore_pages, donate_argnums=(0, 1),
               **placement.pinned(cache_then=1)),
      reserve=jit("reserve", kv_swap.reserve_pages, static_argnames=("bucket",),
                  donate_argnums=(0,)),
      traces=traces)


def check_engine(model_cfg, config: EngineConfig) -> None:
  """Refuses an engine its programs cannot run.

  Raises:
    ValueError: ``config.max_model_len`` above ``model_cfg.max_position``
      (past its context a model's positions are untrained, and dynamic RoPE,
      read as plain RoPE within it, would rescale there); ``jax_enable_x64``
      on (``scheduler.records.refuse_x64``; every program refuses it again
      when traced, ``counting_jit``).
  """
  if config.max_model_len > model_cfg.max_position:
    raise ValueError(
        f"EngineConfig.max_model_len ({config.max_model_len}) must not exceed the "
        f"model's context, ModelConfig.max_position ({model_cfg.max_position}) of "
        f"{model_cfg.name!r} (the launchers take --max_model_len={model_cfg.max_position})")
  rec.refuse_x64("an Engine")


def resolve_decode_gemm(config: EngineConfig) -> str | None:
  """``config.decode_gemm`` resolved: "native" (``models.rowgemm``) or
  "xla"; None for the simulated executor, which runs no GEMM. "auto" is
  "native" where the kernel runs and the weights are float32, dense, on one
  device.

  Raises:
    ValueError: "native" where the kernel cannot run (why).
  """
  if config.executor == "simulated":
    return None
  if config.decode_gemm == "xla":
    return "xla"
  if config.decode_gemm == "auto" and (config.dtype != "float32" or config.weights != "dense"
                                       or config.mesh):
    return "xla"
  return rowgemm.resolve(config.decode_gemm)


def bound_executor(model_cfg, config: EngineConfig) -> Callable:
  """``execute`` (or the simulated executor, ``config.executor``, whose
  logprobs are None) bound to the engine shape; ``num_rows`` (the token
  bucket) is left to the caller."""
  run = _simulated_execute if config.executor == "simulated" else execute
  mesh = sharding.attention_mesh(model_cfg, sharding.make_mesh(config.mesh))
  spec = {} if config.speculation is None else {"speculation": config.speculation}
  if spec and config.executor == "simulated":
    spec.update(acceptance=config.spec_acceptance, seed=config.spec_seed)
  return functools.partial(
      run, model=ModelRunner(model_cfg, config.attention_impl, mesh,
                              config.prefill_chunk_rows, resolve_decode_gemm(config) or "xla",
                              draft_model_config(model_cfg, config)),
      num_seqs=config.max_num_seqs,
      max_model_len=config.max_model_len, **spec)


def _simulated_execute(*args, **kwargs):
  """``sim_executor.simulated_execute`` with ``execute``'s outputs: no
  logits, so no logprobs (None)."""
  return (*sim_executor.simulated_execute(*args, **kwargs), None)


def counting_jit(name, fn, traces, **jit_kwargs):
  """jax.jit whose traces (one per compiled program) are counted by name;
  a trace under ``jax_enable_x64`` (turned on after the engine was built)
  raises ``ValueError`` (``scheduler.records.refuse_x64``)."""
  traces[name] = 0

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    traces[name] += 1          # runs only while tracing, never per call
    rec.refuse_x64("an Engine")
    return fn(*args, **kwargs)

  return jax.jit(traced, **jit_kwargs)


def _execution_view(plan: rec.IterationPlan) -> rec.IterationPlan:
  """The plan as the executor reads it: intervals, kinds, ranks, intents and
  budgets, without the policy's identity, keys or unschedulable mask, so
  that one compiled executor serves every policy of an engine shape."""
  num_slots = plan.selected.shape[0]
  return plan.replace(sort_key=jnp.zeros((num_slots, 1), jnp.int32), policy_id="",
                      policy_version="", unschedulable=None, policy=None)


def plan_step(policy, prefix_caching, manifest, state, pages, prefix_hits, now_ms,
              fix_emitted, fix_stamp, fix_actual, max_draft: int = 0):
  """The ``plan`` program: tick, then the iteration's one plan and the facts
  the host acts on; compiled once per slot-table size, it runs no model.

  Args:
    policy, prefix_caching: static; max_draft: static, the most draft
      tokens a decode row may verify (``Speculation.k``; 0 without).
    manifest, state, pages: the slot tables (``state`` as last published).
    prefix_hits: i32[R] or None (``AllocatorView.prefix_hit_tokens``).
    now_ms: f32[] this iteration's launch time (device ms).
    fix_emitted, fix_stamp, fix_actual: the last iteration's emission
      correction: its emitted slots, launch stamp and publication time
      (``apply.restamp_emissions``; ``fix_emitted`` all False when none is
      pending).

  Returns ``(ticked state, plan, PlanFacts, refcount)``: ``refcount`` is
  i32[num_pages] once the plan's preemptions released their pages (None
  without prefix caching), what eviction reads.
  """
  state = ticked_state(state, fix_emitted, fix_stamp, fix_actual, now_ms)
  # A victim's credit is its reclaimable pages, not the shared ones
  # (``kv_pages.reclaimable``); without prefix caching none is shared.
  view = kv_pages.view(pages, prefix_hits, caching=prefix_caching)
  ticked, plan = iteration.plan_iteration(policy, manifest, state, view, now_ms)
  bad_plan = validate.any_violation(validate.plan_violations(manifest, ticked, plan, view))
  never = (plan.unschedulable if plan.unschedulable is not None
           else jnp.zeros(plan.selected.shape, bool))
  evict, refcount = jnp.zeros((), jnp.int32), None
  if prefix_caching:
    evict, refcount = _pages_to_evict(plan, pages)
  facts = PlanFacts(bad_plan=bad_plan != 0, never=never, admit=plan.admit,
                    preempt=plan.preempt, num_tokens=plan.num_tokens,
                    num_seqs=plan.num_seqs,
                    prompt_rows=jnp.any(plan.selected & (plan.kind != rec.DECODE_ROW)),
                    rows_bound=_rows_bound(manifest, ticked, plan.token_budget,
                                           plan.seq_budget, max_draft),
                    evict=evict)
  return ticked, plan, facts, refcount


def ticked_state(state, fix_emitted, fix_stamp, fix_actual, now_ms):
  """The state a ``plan`` program publishes (the ``retick`` program): the
  last iteration's emissions moved from their launch stamp to the time the
  host published them (``apply.restamp_emissions``), then the clock ticked
  to ``now_ms`` (f32[], ms; ``apply.tick``). An early plan's step runs on
  it (``serving.engine.plan_ahead``)."""
  state = apply_lib.restamp_emissions(state, fix_emitted, fix_stamp, fix_actual)
  return apply_lib.tick(state, now_ms)


def _pages_to_evict(plan, pages):
  """(i32[] count, i32[num_pages] refcount): the cached pages to evict so
  that the free stack covers the pages ``plan`` allocates (up to its
  intervals' ends) once its preemptions released theirs, and the refcounts
  after those releases (``kv_pages.deallocate``: the one release rule)."""
  released = kv_pages.deallocate(pages, plan.preempt)
  target = jnp.minimum(kv_pages.pages_for(plan.end, pages.page_size),
                       pages.page_table.shape[1])
  need = jnp.sum(jnp.maximum(jnp.where(plan.selected, target - released.pages_held, 0), 0))
  return jnp.maximum(need - released.num_free, 0).astype(jnp.int32), released.refcount


def _rows_bound(manifest, state, token_budget, seq_budget, max_draft=0):
  """i32[]: the most token rows a valid plan on ``state`` can schedule: the
  token bucket an iteration runs in (``PlanFacts.rows_bound``).

  The plan rules (``validate.plan_violations``) allow a live slot one row
  in decode state (plus its drafts: at most ``max_draft`` and its output
  cap's room) and at most ``prefill_target - computed`` rows otherwise,
  at most ``seq_budget`` slots and ``token_budget`` rows in all; so the
  bound is the sum of the ``seq_budget`` largest per-slot widths, capped
  by the token budget, whatever the policy.

  Args:
    token_budget, seq_budget: i32[] (or ints) of the plan's budgets.
  """
  p, e, c = manifest.prompt_len, state.emitted, state.computed
  live = (state.status == rec.WAITING) | (state.status == rec.RUNNING)
  decode = (e >= 1) & (c == p + e - 1)
  drafts = jnp.clip(manifest.max_tokens - e - 1, 0, max_draft)
  width = jnp.where(live, jnp.where(decode, 1 + drafts, jnp.maximum(
      rec.prefill_target(manifest, state) - c, 0)), 0)
  return jnp.minimum(_sum_of_largest(width, seq_budget), token_budget).astype(jnp.int32)


def _sum_of_largest(width, k):
  """i32[]: the sum of the ``k`` (i32[]) largest of ``width`` (i32[R], >= 0):
  one ascending sort (``keys.sort_u32``, a radix sort on the CPU) and the
  sum of its last ``k``. Exact: the same multiset of values, however ties
  are ordered."""
  num_slots = width.shape[0]
  ascending = keys.sort_u32(width.astype(jnp.uint32)).astype(width.dtype)
  return jnp.sum(jnp.where(jnp.arange(num_slots) >= num_slots - k, ascending, 0))


def _pages_low_jnp(pages, state, token_budget, seq_budget):
  """bool[]: fewer free pages than the next iteration could need without
  evicting cached pages or unpinning waiting hits: its new pages are at most
  ceil(token budget / page size) + one per sequence, and unpinning needs more
  running requests growing a page than pages free. With prefix caching the
  next iteration then checks for waiting hits to unpin before it plans
  (``PrefixBook.unpin_waiting_hits``); otherwise none can be needed (arrivals
  map cached pages, finishes free pages: neither makes this too optimistic)."""
  bound = -(-token_budget // pages.page_size) + seq_budget
  running = jnp.sum(state.status == rec.RUNNING)
  return pages.num_free < jnp.maximum(bound, running)


def execute_step(executor, token_budget, prefix_caching, params, kv, pages, buffers,
                 manifest, state, plan, realized, preserved_end, *, num_rows: int,
                 windows: tuple = (0,), handoff: bool = False):
  """The ``step`` program: execute the plan in the token bucket
  ``num_rows`` -> check the result -> ``apply``; compiled per bucket.

  Every row's bits are independent of the bucket (``llama.row_tiled``), so
  the host may run a plan in any bucket holding its rows. The executor
  reads the plan without the policy's identity (``_execution_view``);
  ``apply`` reads the whole plan (a policy's ``update`` hook).

  Args:
    executor, token_budget, prefix_caching: static; num_rows: static
      token bucket of this program; windows: static attention window kinds;
      handoff: static, a prefill engine's step (``StepFacts.handoff``).
    kv, pages, buffers: donated; manifest: the slot table; state: the
      ticked state the plan was made on; plan: its ``IterationPlan``.
    realized: i32[R] recorded output lengths (simulated executor) or None.
    preserved_end: i32[R] the result's preserved prefixes (swap
      preemption; zeros otherwise).

  Returns ``(kv, pages, buffers, state, (plan, result, logprobs), facts)``:
  the published state, ``logprobs`` the executor's ``StepLogprobs`` (None
  for the simulated executor; fetched only when a request asked) and
  ``StepFacts``, the one small pytree the host fetches. Emissions are
  stamped with the ticked clock (the launch time) and corrected one
  iteration late to the time the host saw them.
  """
  exec_manifest = manifest if realized is None else manifest.replace(
      hidden_realized_output_tokens=realized)
  run = _execution_view(plan)
  held = table = None
  if prefix_caching:
    pages, held = _hold_last_prompt_pages(pages, manifest, run)
  if handoff:     # where ended slots' pages are, before the executor frees them
    pages = allocate_for_plan(pages, run)
    table = pages.page_table
  kv, pages, buffers, result, logprobs = executor(params, kv, pages, buffers,
                                                    exec_manifest, state, run,
                                                    num_rows=num_rows)
  result = result.replace(emit_ms=state.now_ms,
                          preserved_end=jnp.asarray(preserved_end, jnp.int32))
  published, violations = iteration.publish(manifest, state, plan, result)
  bad_result = validate.any_violation(violations)
  facts = StepFacts(
      pages_low=_pages_low_jnp(pages, published, token_budget, plan.seq_budget),
      bad_result=bad_result != 0,
      emitted=result.emitted, token=result.token, finished=result.finished,
      finish_reason=result.finish_reason, failed=result.failed,
      num_tokens=plan.num_tokens,
      decodes=jnp.sum(jnp.where(plan.selected & (plan.kind == rec.DECODE_ROW),
                                plan.end - plan.start, 0)),
      features=cost_lib.plan_stats(plan, windows, manifest.prompt_len),
      prefix=(published.computed,) + _registrable(held, pages) if prefix_caching else None,
      handoff=table,
      spec=None if result.accepted is None else (rec.num_draft(plan), result.accepted,
                                                 result.tokens))
  return kv, pages, buffers, published, (plan, result, logprobs), facts


def _hold_last_prompt_pages(pages, manifest, plan):
  """Keeps the full prompt pages of every slot whose last prompt chunk runs
  in ``plan`` resident should the request end in this step (its only or
  last token: the executor releases a finished slot's pages at once): the
  plan's pages are allocated here (the executor's own allocation then finds
  them held) and those pages marked cached, so a release leaves them
  evictable instead of free. The host registers them after the step and
  publishes its table (``sync_cached``), which frees any it did not add.

  Returns ``(pages, (pages_held i32[R], page_table i32[R, pages_per_seq],
  marked i32[R]))``: the tables before any release and the full prompt
  pages marked per slot (``_registrable`` turns them into what the host
  registers from).
  """
  pages = allocate_for_plan(pages, plan)
  last = plan.selected & (plan.kind == rec.PREFILL_CHUNK) & (plan.end == manifest.prompt_len)
  full = jnp.where(last, jnp.minimum(manifest.prompt_len // pages.page_size,
                                     pages.pages_held), 0)
  j = jnp.arange(pages.page_table.shape[1], dtype=jnp.int32)
  ids = jnp.where(j[None, :] < full[:, None], pages.page_table, pages.num_pages)
  cached = pages.cached.at[ids.reshape(-1)].set(True, mode="drop")
  return pages.replace(cached=cached), (pages.pages_held, pages.page_table, full)


def _registrable(held, pages):
  """(pages_held i32[R], page_table, marked bool[]) the host may register
  from after the step: a slot that still holds its pages, all of them; a
  slot the step released (finished, failed, preempted), only the pages
  ``_hold_last_prompt_pages`` marked cached before the release (the others
  went back to the free stack and are not the cache's to take)."""
  held_before, table, marked_full = held
  kept = jnp.where(pages.pages_held > 0, held_before, marked_full)
  return kept, table, jnp.any(marked_full > 0)


def arrive(manifest, state, buffers, slot, arrival: Arrival, prefix_hit):
  """Writes one arrival into ``slot``: its declaration (``apply.arrive``,
  ``prefix_hit`` tokens already cached) and its sampling buffers."""
  a = arrival
  manifest, state = apply_lib.arrive(
      manifest, state, slot, request_id=a.request_id, arrival_ms=a.arrival_ms,
      arrival_seq=a.arrival_seq, prompt_len=a.prompt_len, max_tokens=a.max_tokens,
      priority=a.priority, client=a.client, ttft_ms=a.ttft_ms, tbt_ms=a.tbt_ms,
      cached_prefix_tokens=prefix_hit, received_tokens=a.received)
  set_ = lambda buf, v: buf.at[slot].set(jnp.asarray(v).astype(buf.dtype))
  buffers = buffers.replace(
      tokens=None if buffers.tokens is None else buffers.tokens.at[slot].set(a.prompt),
      temperature=set_(buffers.temperature, a.temperature),
      top_k=set_(buffers.top_k, a.top_k), top_p=set_(buffers.top_p, a.top_p),
      seed=set_(buffers.seed, a.seed), min_tokens=set_(buffers.min_tokens, a.min_tokens),
      ignore_eos=set_(buffers.ignore_eos, a.ignore_eos),
      stop_ids=buffers.stop_ids.at[slot].set(a.stop_ids),
      logprobs=set_(buffers.logprobs, a.logprobs),
      prompt_logprobs=set_(buffers.prompt_logprobs, a.prompt_logprobs))
  return manifest, state, buffers


def arrive_batch(manifest, state, buffers, slots, arrivals: Arrival, prefix_hits):
  """Writes up to ``ARRIVAL_BATCH`` arrivals, in order, in one program.

  Args:
    slots: i32[B] target slots, -1 for an empty entry (skipped).
    arrivals: ``Arrival`` with a leading axis B; prefix_hits: i32[B].
  """
  def one(tables, entry):
    slot, arrival, hit = entry
    tables = jax.lax.cond(slot >= 0, lambda t: arrive(*t, slot, arrival, hit),
                          lambda t: t, tables)
    return tables, None

  tables, _ = jax.lax.scan(one, (manifest, state, buffers), (slots, arrivals, prefix_hits))
  return tables


def slot_tables(config: EngineConfig, num_slots: int, placement: sharding.Placement,
                policy=None):
  """Fresh (pages, buffers, manifest, state) for ``num_slots`` slots, on
  the device (replicated over a mesh); the state carries ``policy``'s own
  state (``SchedulerState.policy_state``)."""
  c = config
  tables = (kv_pages.init_pages(num_slots, c.pages_per_seq, c.num_pages, c.page_size),
            init_buffers(num_slots, c.max_model_len, c.max_stop_ids),
            rec.empty_manifest(num_slots),
            rec.initial_state(num_slots, c.num_clients, c.max_model_len, policy=policy))
  return placement.tables(tables)


def draft_model_config(model_cfg, config: EngineConfig):
  """The draft model's ``ModelConfig`` when the model executor speculates
  with one (``Speculation.draft``), else None.

  Raises:
    ValueError: naming ``EngineConfig.speculative``: the draft cannot be
      read, or its vocabulary is not the target's.
  """
  spec = config.speculation
  if config.executor == "simulated" or spec is None or spec.method != "draft":
    return None
  return cost_lib.draft_config(model_cfg, spec.draft, same_windows=False)


def _fresh_kv(model_cfg, config: EngineConfig):
  """(model's cache, draft model's cache or None): these configs' KV caches,
  uncommitted (``config.num_pages`` pages; 2 for the simulated executor,
  which writes none)."""
  dtype = jnp.bfloat16 if config.kv_cache_dtype == "bfloat16" else jnp.float32
  num_pages = 2 if config.executor == "simulated" else config.num_pages
  draft_cfg = draft_model_config(model_cfg, config)
  return (llama.init_kv_cache(model_cfg, num_pages, config.page_size, dtype),
          None if draft_cfg is None else
          llama.init_kv_cache(draft_cfg, num_pages, config.page_size, dtype))


def kv_cache(model_cfg, config: EngineConfig, placement: sharding.Placement):
  """A fresh KV cache (``_fresh_kv``) committed to the device as every later
  (jit-output) version is: a fresh engine's first step then reuses the
  programs an engine with equal configs compiled, instead of compiling
  again for uncommitted inputs."""
  kv, draft = _fresh_kv(model_cfg, config)
  kv = placement.kv(kv)
  if draft is not None:    # the draft's K/V in the same pages (no mesh: refused)
    kv = kv.replace(draft=jax.device_put(draft, jax.local_devices()[0]))
  return kv


def adopt_kv(model_cfg, config: EngineConfig, kv):
  """``kv``, a KV cache made for these configs (``Engine(kv=...)``), checked
  leaf by leaf against the shapes ``kv_cache`` would make (no allocation).

  Raises:
    ValueError: naming the first leaf (its pytree path) whose shape or dtype
      differs, or a tree of other leaves, with what these configs make.
  """
  want, draft = jax.eval_shape(lambda: _fresh_kv(model_cfg, config))
  if draft is not None:
    want = want.replace(draft=draft)
  got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(kv)
  want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(want)
  if got_tree != want_tree:
    raise ValueError(f"Engine(kv=...) must be a KV cache of these configs' structure "
                     f"({want_tree}), got {got_tree}")
  for (path, got), (_, w) in zip(got_leaves, want_leaves):
    if (tuple(np.shape(got)), np.dtype(got.dtype)) != (w.shape, np.dtype(w.dtype)):
      raise ValueError(
          f"Engine(kv=...){jax.tree_util.keystr(path)} must be {w.dtype}{list(w.shape)} "
          f"for these configs (num_pages={config.num_pages}, page_size={config.page_size}, "
          f"kv_cache_dtype={config.kv_cache_dtype!r}, executor={config.executor!r}), got "
          f"{np.dtype(got.dtype)}{list(np.shape(got))}")
  return kv


def release_programs() -> None:
  """Forgets the jitted programs and executors built so far (``programs``,
  ``_executor``); ``sim_loop.release_programs`` says when and why."""
  programs.cache_clear()
  _executor.cache_clear()


def compile_buckets(programs: _Programs, config: EngineConfig, params, kv, pages, buffers,
                    manifest, state, prefix_hits, launch, no_stamp, realized):
  """Runs the ``plan`` and ``retick`` programs and the ``step`` program of
  every token bucket once (``Engine.compile_buckets``), the step programs on a plan
  that selects nothing (every row padding: no page allocated, no K/V
  written, nothing emitted; the state they publish is dropped).

  Returns ``(kv, pages, buffers, {bucket: seconds})``: the donated tables
  as the step programs returned them, and each bucket's compile and run.
  """
  _, plan, facts, _ = programs.plan(manifest, state, pages, prefix_hits, launch,
                                    no_stamp, np.float32(0), np.float32(0))
  jax.block_until_ready((facts, programs.retick(state, no_stamp, np.float32(0),
                                                np.float32(0), launch)))
  none = lambda m: m & False       # on the plan's devices, as it is placed
  nothing = plan.replace(selected=none(plan.selected), admit=none(plan.admit),
                         preempt=none(plan.preempt), num_tokens=plan.num_tokens * 0,
                         num_seqs=plan.num_seqs * 0)
  seconds = {}
  for bucket in config.token_buckets:
    t = time.perf_counter()
    kv, pages, buffers, _, _, step_facts = programs.step(
        params, kv, pages, buffers, manifest, state, nothing, realized,
        np.zeros(plan.selected.shape[0], np.int32), num_rows=bucket)
    jax.block_until_ready(step_facts)
    seconds[bucket] = time.perf_counter() - t
  return kv, pages, buffers, seconds


@jax.jit
def moved_rows(new, old, moved, count):
  """The resized slot tables (``Engine._resize``): for each per-slot array
  (leading axis R -> R'), ``old``'s rows ``moved[:count]`` in ``new``'s
  first ``count`` rows, the rest ``new``'s free ones; ``old`` for the
  leaves whose shape does not change with R. One program per (R, R').

  Args:
    new, old: the same pytree of tables at sizes R' and R.
    moved: i32[R'], the old slot each new slot takes (``RequestTable.
      moved_slots``, padded with 0 past ``count``); count: i32[].
  """
  keep = jnp.arange(moved.shape[0]) < count

  def one(n, o):
    if n.shape == o.shape:
      return o
    return jnp.where(keep.reshape((-1,) + (1,) * (n.ndim - 1)), o[moved], n)

  return jax.tree.map(one, new, old)


def release_slots(state, pages, cancel_mask, release_mask):
  """Cancels the live slots in ``cancel_mask`` (their pages freed) and frees
  the slots in ``release_mask`` for new arrivals (bool[R] each)."""
  state = apply_lib.cancel(state, cancel_mask)
  pages = kv_pages.deallocate(pages, cancel_mask)
  return apply_lib.release(state, release_mask), pages


@functools.lru_cache(maxsize=16)
def programs(model_cfg, config: EngineConfig) -> _Programs:
  """Builds (once per config pair) the jitted plan/execute/publish programs."""
  policy = make_policy(config.policy, Budgets(
      token_budget=config.max_num_batched_tokens, seq_budget=config.max_num_seqs,
      chunk_cap=config.long_prefill_token_threshold,
      watermark_pages=config.watermark_pages, reservation=config.reservation,
      reservation_quantile=config.reservation_quantile))
  if config.force_preempt_every:
    policy = ForcedPreemption(policy, config.force_preempt_every)
  spec = config.speculation
  if spec is not None and spec.adaptive:
    policy = AdaptiveDraft(policy, spec.k, spec.fixed_ms, spec.row_ms,
                           per_row=bool(spec.per_row))
  elif spec is not None:
    policy = FixedDraft(policy, spec.k)
  traces: Dict[str, int] = {}
  placement = sharding.Placement(model_cfg, sharding.make_mesh(config.mesh))
  jit = functools.partial(counting_jit, traces=traces, **placement.pinned())
  executor = _executor(model_cfg, config.executor_config, config.executor,
                       _table_sizes(config))
  return _Programs(
      policy=policy,
      plan=jit("plan", functools.partial(plan_step, policy,
                                         config.enable_prefix_caching,
                                         max_draft=0 if spec is None else spec.k)),
      step=jit("step", functools.partial(
          execute_step, bound_executor(model_cfg, config), config.token_buckets[-1],
          config.enable_prefix_caching, windows=model_cfg.window_kinds,
          handoff=config.role == "prefill"),
          static_argnames=("num_rows",),
          donate_argnums=(1, 2, 3), **placement.pinned(cache_then=5)),
      arrive=executor.arrive, release=executor.release,
      swap_out=executor.swap_out, swap_in=executor.swap_in, reserve=executor.reserve,
      shift_clock=jit("shift_clock", apply_lib.shift_clock),
      forget_client=jit("forget_client", apply_lib.forget_client),
      map_prefix=jit("map_prefix", kv_pages.map_prefix),
      sync_cached=jit("sync_cached", kv_pages.sync_cached),
      resume_prefix=jit("resume_prefix", apply_lib.resume_from_prefix),
      unpin=jit("unpin", kv_pages.deallocate),
      retick=jit("retick", ticked_state),
      traces=traces, executor_traces=executor.traces)
