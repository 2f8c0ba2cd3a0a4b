"""The policy conformance kit: the rules every scheduling policy must pass.

A policy (``docs/writing-a-policy.md``) is checked by driving it through the
scheduler half of the engine's iteration on small workloads: tick the
clock, plan on the online projection, check the plan
(``validate.plan_violations``), execute it on a simulated executor that
emits outputs until each request's hidden realized length, check the result
(``validate.result_violations``) and publish it with ``apply.apply``, while
a page ledger follows every page a plan takes and every page a preemption or
a finish returns. Tick, policy, checks and ``apply`` are the functions the
engine's plan and step programs run; the executor is the scheduler's fixture executor
(``fixture_execute``, below) and the page table a count, so one policy
compiles one program (seconds) and a workload runs in a fraction of a
second. (``tests/scheduler/test_conformance.py`` also drives every
registered policy through ``serving.engine.engine.Engine`` on the simulated
executor, in the extended profile.)

    from scheduler import conformance
    conformance.check_policy(MyPolicy)                 # fast profile
    conformance.check_policy("sjf", profile="extended")

    python -m scheduler.conformance path/to/mine.py:MyPolicy [--profile=extended]

``check_policy`` returns a ``Report`` of what it checked (printed by the
command line) or raises ``ConformanceError`` (an ``AssertionError``) for the
first broken rule; its message names the rule, states it, and gives the
smallest workload found that breaks it (shrunk request by request), which
``run(policy, workload)`` replays. The rules (``RULES``):

* ``interface``: a hashable object with ``policy_id``, ``version``,
  ``tie_break`` (one name per ``sort_key`` column: as many names as the
  plan's ``sort_key`` has columns) and ``plan``/``__call__``.
* ``policy_state``: a policy with state of its own (``init_state``) makes
  a pytree of arrays, the same on every call, and its ``update`` returns
  one of the same structure, shapes and dtypes (the engine carries it
  through compiled loops); a policy without one plans on a state whose
  ``policy_state`` is None (one that reads a state of its own there is
  refused: it "reads its own state but declares no init_state").
* ``plan_writes_nothing``: ``plan`` leaves its input state (the policy's
  state included), the policy object's fields and its class's attributes
  as they were: only ``update``, called by ``apply`` with the completed
  result, advances the policy's state. Module globals are not checked.
* ``plans_validate``: every plan and every result passes ``scheduler.validate``.
* ``progress``: every request of a finite workload completes.
* ``kv_census``: pages held by live requests + free pages == the cache after
  every iteration, and the free count never goes negative (no plan takes a
  page that is not there); a finished or preempted request holds none.
* ``deterministic``: the same workload run twice gives the same decisions,
  the same tokens and the same final policy state.
* ``whole_queue``: the decisions (request, interval, kind, admissions,
  preemptions in every iteration) are the same whether the requests sit
  packed in a small slot table or scattered over a large one: the policy
  sees the whole queue and no slot index or table size leaks into them.
* ``hidden_truth``: the policy never reads the realized output length:
  handed a manifest that still carries it, it refuses it (ValueError, as
  ``PolicyBase`` does) or plans exactly as on the online projection; and a
  workload whose hidden lengths are changed gets the same decisions up to
  and including the first iteration in which any request ends.
* ``preemption_thrash``: under the default reservation ("policy": prompt
  rows reserved, outputs on demand), a request is preempted at most
  ``thrash_bound(workload)`` times, the number of requests in the workload:
  once per other request, plus one. A stated bar, not a theorem: the shared
  ledger readmits a victim only when its whole rebuild fits beside the
  pages the others hold and their next rows, so a growing peer seldom
  pushes it out twice (on 150 random kit workloads the library's policies
  on it preempted one request at most 3 times and never past this bound,
  but for SARATHI's livelock, ``HARD_CASES[1]``); a
  policy that readmits a victim as soon as its next chunk fits has it
  pushed out again at the peer's next page, over and over
  (``HARD_CASES[0]``: two requests that cannot both finish in 12 pages).
* ``starvation`` (policies whose ``starvation_free`` attribute is True): a
  request that is last by every common order (lowest priority, longest
  prompt, a client whose completed outputs were long, the longest output
  cap) gets its first token within ``STARVATION_HORIZON_ITERS`` (100)
  iterations while a stream of favoured one-row requests fills the sequence
  budget every iteration for ``STARVATION_STREAM_ITERS`` (150).

Profiles: "fast" (``HARD_CASES`` and 3 random workloads of at most 8
requests, on the first half and on the whole of one 16-slot table; what
``--policy=module:Class`` runs at load) and "extended" (12 workloads of at
most 12 requests, two compiled table sizes, 12 and 32 slots). Hypothesis is
not needed; ``workload_strategy()`` gives a hypothesis strategy over the
same workloads for property tests.

One file: the kit is one procedure (the rules, the workloads, the driver and
its fixture executor, the page ledger, the shrinker) that a policy author
reads top to bottom; a rule's check and the workload that breaks it stay
side by side.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from scheduler import apply as apply_lib
from scheduler import iteration
from scheduler import records as rec
from scheduler import validate
from scheduler import registry
from scheduler.ledger import Budgets, pages_for

RULES = {
    "interface": "a policy is a hashable object with policy_id, version, a tie_break "
                 "naming each sort_key column, and __call__(manifest, state, alloc)",
    "policy_state": "init_state gives the same pytree of arrays every call, and update "
                    "keeps its structure, shapes and dtypes; without init_state, plan "
                    "reads no state of its own",
    "plan_writes_nothing": "plan leaves its input state (the policy's state included), "
                           "the policy object and its class as they were",
    "plans_validate": "every plan and result passes scheduler.validate",
    "progress": "every request of a finite workload completes",
    "kv_census": "pages held + free pages == the cache after every iteration, never "
                 "a negative free count",
    "deterministic": "the same workload gives the same decisions, tokens and final "
                     "policy state",
    "whole_queue": "decisions do not depend on the slot table's size or the slots "
                   "the requests sit in",
    "hidden_truth": "the plan never depends on the hidden realized output length",
    "preemption_thrash": "under the default reservation a request is preempted at "
                         "most thrash_bound(workload) times",
    "starvation": "a starvation-free policy gives the disfavoured probe its first "
                  "token within the stated horizon",
}

STARVATION_HORIZON_ITERS = 100
STARVATION_STREAM_ITERS = 150


class ConformanceError(AssertionError):
  """A policy breaks a conformance rule; ``.rule`` names it, ``.example``
  holds the smallest workload found that breaks it (or None)."""

  def __init__(self, rule: str, policy_id: str, detail: str, example=None):
    self.rule, self.example = rule, example
    text = f"policy {policy_id!r} breaks rule '{rule}' ({RULES[rule]}): {detail}"
    if example is not None:
      text += f"\nminimal example: {example!r}"
    super().__init__(text)


# ------------------------------------------------------------------ workloads


@dataclasses.dataclass(frozen=True)
class Req:
  """One request of a kit workload.

  Attributes:
    arrival: iteration at which it arrives (arrival_ms = arrival * tick_ms).
    prompt_len: prompt tokens.
    max_tokens: declared output cap (what a policy may read).
    output_len: realized outputs, the hidden truth (EOS there), in
      ``[1, max_tokens]``; the simulated executor alone reads it.
    priority: lower runs first.
    client: client index.
  """

  arrival: int
  prompt_len: int
  max_tokens: int
  output_len: int
  priority: int = 0
  client: int = 0


@dataclasses.dataclass(frozen=True)
class Workload:
  """Requests (request id = index) and the KV cache they share (pages)."""

  requests: Tuple[Req, ...]
  num_pages: int


@dataclasses.dataclass(frozen=True)
class Kit:
  """Static shape of a kit run (one compiled program per policy and size).

  Attributes:
    budgets: the budgets the policy is built with.
    num_slots: slot table of the "large" runs; the "small" ones use only its
      first half, or, with ``table_sizes``, compiled tables of those sizes.
    table_sizes: (small, large) compiled tables, or () for one table.
    num_clients, page_size: static record sizes.
    tick_ms: the virtual clock's iteration length (ms).
    max_requests, max_prompt, max_tokens: random workload bounds.
    num_workloads: random workloads per check.
  """

  budgets: Budgets = Budgets(token_budget=8, seq_budget=3, chunk_cap=4)
  num_slots: int = 16
  table_sizes: Tuple[int, ...] = ()
  num_clients: int = 4
  page_size: int = 4
  tick_ms: float = 10.0
  max_requests: int = 8
  max_prompt: int = 8
  max_tokens: int = 8
  num_workloads: int = 3

  def __post_init__(self):
    if self.max_prompt > self.budgets.token_budget:
      raise ValueError(f"Kit.max_prompt must be <= budgets.token_budget "
                       f"({self.budgets.token_budget}), got {self.max_prompt}")
    if self.max_requests > self.small_slots:
      raise ValueError(f"Kit.max_requests must be <= the small table's "
                       f"{self.small_slots} slots, got {self.max_requests}")

  @property
  def small_slots(self) -> int:
    """Slots of the small table: ``table_sizes[0]``, else half the table."""
    return self.table_sizes[0] if self.table_sizes else self.num_slots // 2


PROFILES = {
    "fast": Kit(),
    "extended": Kit(num_slots=32, table_sizes=(12, 32), max_requests=12,
                    num_workloads=12),
}


def pages_needed(workload: Workload, page_size: int) -> List[int]:
  """Pages each request holds at its largest: ``pages_for(p + m - 1)``."""
  return [int(pages_for(rec.kv_rows(r.prompt_len, r.max_tokens), page_size))
          for r in workload.requests]


def thrash_bound(workload: Workload) -> int:
  """Preemptions allowed to any one request (``preemption_thrash``): the
  number of requests in the workload."""
  return len(workload.requests)


# Fixed workloads every profile runs first (kit budgets: 8 token rows, 3
# sequences, chunks of 4; pages of 4 rows):
# 0. Thrash: the earlier request has the lower priority (1) and is the
#    victim; each needs 10 pages at its largest, 12 are there.
# 1. Priority inversion under one prefill slot: the early low-priority
#    request, recompute-preempted by the later high-priority one's pages,
#    must not rebuild and preempt itself forever while the other's prefill
#    waits (4 pages; found by this kit in a random workload and shrunk).
HARD_CASES = (
    Workload((Req(0, 8, 30, 30, priority=1, client=0),
              Req(0, 8, 30, 30, priority=0, client=1)), 12),
    Workload((Req(0, 7, 5, 5, priority=2, client=0),
              Req(0, 5, 1, 1, priority=0, client=0)), 4),
)


def random_workload(rng: np.random.Generator, kit: Kit) -> Workload:
  """A seeded random workload within the kit's bounds: 1..max_requests
  requests arriving over 4 iterations, a cache between the largest single
  request and twice that plus 4 pages (page pressure, preemptions)."""
  n = int(rng.integers(1, kit.max_requests + 1))
  reqs = []
  for _ in range(n):
    m = int(rng.integers(1, kit.max_tokens + 1))
    reqs.append(Req(arrival=int(rng.integers(0, 4)),
                    prompt_len=int(rng.integers(1, kit.max_prompt + 1)),
                    max_tokens=m, output_len=int(rng.integers(1, m + 1)),
                    priority=int(rng.integers(0, 3)),
                    client=int(rng.integers(0, kit.num_clients))))
  w = Workload(tuple(reqs), 1)
  big = max(pages_needed(w, kit.page_size))
  return Workload(tuple(reqs), int(rng.integers(big, 2 * big + 5)))


def workload_strategy(kit: Kit = PROFILES["fast"]):
  """A hypothesis strategy over ``random_workload``'s workloads (imports
  hypothesis on call)."""
  from hypothesis import strategies as st

  @st.composite
  def request(draw):
    m = draw(st.integers(1, kit.max_tokens))
    return Req(arrival=draw(st.integers(0, 3)),
               prompt_len=draw(st.integers(1, kit.max_prompt)), max_tokens=m,
               output_len=draw(st.integers(1, m)), priority=draw(st.integers(0, 2)),
               client=draw(st.integers(0, kit.num_clients - 1)))

  @st.composite
  def workload(draw):
    reqs = tuple(draw(st.lists(request(), min_size=1, max_size=kit.max_requests)))
    big = max(pages_needed(Workload(reqs, 1), kit.page_size))
    return Workload(reqs, draw(st.integers(big, 2 * big + 4)))

  return workload()


def starvation_workload(kit: Kit) -> Tuple[Workload, int]:
  """(workload, probe id): two long requests of client 1 complete first
  (its history: long outputs); then the probe (client 1, priority 3, the
  longest prompt and output cap) arrives with a stream of client-0,
  priority-0 requests of one prompt row and one output, ``seq_budget`` of
  them every iteration for ``STARVATION_STREAM_ITERS`` iterations."""
  m = kit.max_tokens
  reqs = [Req(0, 2, m, m, priority=3, client=1), Req(0, 2, m, m, priority=3, client=1)]
  start = m + 2
  probe = len(reqs)
  reqs.append(Req(start, kit.max_prompt, m, m, priority=3, client=1))
  for t in range(STARVATION_STREAM_ITERS):
    reqs += [Req(start + t, 1, 1, 1, priority=0, client=0)] * kit.budgets.seq_budget
  big = max(pages_needed(Workload(tuple(reqs), 1), kit.page_size))
  return Workload(tuple(reqs), 2 * big + 2 * kit.budgets.seq_budget), probe


# ------------------------------------------------------------------ the loop


@dataclasses.dataclass
class Trace:
  """What a run did, by request id.

  Attributes:
    decisions: per iteration, ``(rows, admitted, preempted)``: rows are
      ``(request, start, end, kind)`` in rank order.
    tokens: request -> emitted token ids.
    outcome: request -> "completed", "rejected" or "unfinished".
    first_token_iter: request -> iteration of its first output (or None).
    preemptions: request -> times preempted.
    first_end_iter: the first iteration in which a request ended (or None).
    faults: per rule, the first fault seen (iteration and what).
    policy_state: the policy's state after the last iteration (host arrays).
  """

  decisions: List[tuple] = dataclasses.field(default_factory=list)
  tokens: Dict[int, List[int]] = dataclasses.field(default_factory=dict)
  outcome: Dict[int, str] = dataclasses.field(default_factory=dict)
  first_token_iter: Dict[int, Optional[int]] = dataclasses.field(default_factory=dict)
  preemptions: Dict[int, int] = dataclasses.field(default_factory=dict)
  first_end_iter: Optional[int] = None
  faults: Dict[str, str] = dataclasses.field(default_factory=dict)
  policy_state: object = None


def _refused(policy, manifest, state, view):
  """The policy's plan on a manifest carrying hidden truth, or None if it
  refuses it (a ValueError at trace time, as ``PolicyBase`` raises)."""
  try:
    return policy(manifest, state, view)
  except ValueError:
    return None


def _same_plan(a, b):
  return (jnp.all(a.selected == b.selected) & jnp.all(a.start == b.start)
          & jnp.all(a.end == b.end) & jnp.all(a.rank == b.rank)
          & jnp.all(a.admit == b.admit) & jnp.all(a.preempt == b.preempt))


# The kit's programs are small and run a few hundred iterations: XLA's
# cheapest CPU code generation halves their compile time (the compile of one
# program per policy is most of a check's cost). Integer decisions do not
# depend on it.
_QUICK_COMPILE = dict(xla_backend_optimization_level=0,
                      xla_llvm_disable_expensive_passes=True)


@flax.struct.dataclass
class _Keys:
  """The policy's replayed tie-break keys (i32[R, K]), in the place of the
  AllocatorView that ``validate.replay_keys`` hands to ``sort_keys``."""

  keys: jax.Array


@dataclasses.dataclass(frozen=True)
class _Replayed:
  """Stands in for the policy in the shared check program: its keys were
  replayed by the policy's own program (``_plan``) and arrive as ``_Keys``."""

  policy_id: str = "replayed"

  def sort_keys(self, manifest, state, view):
    return view.keys


@functools.partial(jax.jit, static_argnames=("policy", "page_size"),
                   compiler_options=_QUICK_COMPILE)
def _plan(policy, manifest, state, held, num_pages, now_ms, *, page_size):
  """The policy's own program: tick, plan on the online projection, replay
  its keys, and plan again on the full manifest (``hidden_truth``).

  Returns (ticked state, plan without its policy, keys, hidden_bad)."""
  online = manifest.online()
  view = rec.AllocatorView(free_pages=num_pages - jnp.sum(held), pages_held=held,
                           page_size=page_size)
  state, plan = iteration.plan_iteration(policy, manifest, state, view, now_ms)
  keys = validate.replay_keys(online, state, plan, view)
  full = _refused(policy, manifest, state, view)
  hidden_bad = jnp.bool_(False) if full is None else ~_same_plan(plan, full)
  return state, plan.replace(policy=None, policy_id="", policy_version=""), keys, hidden_bad


# The most drafts the fixture executor verifies in one row (a plan asking
# more breaks validate's rules first: a kit request's max_tokens is smaller).
_MAX_DRAFT = 16


def fixture_execute(manifest: rec.WorkloadManifest, state: rec.SchedulerState,
                    plan: rec.IterationPlan, emit_ms, fail=None) -> rec.IterationResult:
  """Simulated execution of a plan (pure, jit-able).

  Args:
    manifest: the full manifest; execution discovers the stop at
      ``hidden_realized_output_tokens`` (EOS) or ``max_tokens`` (length).
    state, plan: the plan's input state and the plan.
    emit_ms: f32[], publication time of this iteration's outputs (ms).
    fail: optional bool[R], slots whose execution fails (complete nothing).
  Returns:
    IterationResult by the executors' one set of stop rules
    (``iteration.stop_rules``); token ids are ``(request_id * 31 + e) % 1000``
    >= 0. A plan carrying drafts (``num_draft``) is verified with
    ``(request_id + e) % (k + 1)`` of a row's k drafts accepted: a fixed
    acceptance pattern, so runs repeat.
  """
  truth = manifest.hidden_realized_output_tokens
  if plan.num_draft is None:
    new_e = state.emitted + 1
    is_eos = new_e >= truth if truth is not None else jnp.zeros_like(plan.selected)
    return iteration.stop_rules(manifest, state, plan,
                                (manifest.request_id * 31 + new_e) % 1000,
                                is_eos=is_eos, emit_ms=emit_ms, fail=fail)
  width = 1 + _MAX_DRAFT
  new_e = state.emitted[:, None] + 1 + jnp.arange(width)[None, :]
  is_eos = (new_e >= truth[:, None] if truth is not None
            else jnp.zeros(new_e.shape, bool))
  k = plan.num_draft
  verified = jnp.minimum((manifest.request_id + state.emitted) % (jnp.maximum(k, 0) + 1),
                         _MAX_DRAFT)
  return iteration.stop_rules(manifest, state, plan,
                              (manifest.request_id[:, None] * 31 + new_e) % 1000,
                              is_eos=is_eos, emit_ms=emit_ms, fail=fail,
                              verified=jnp.where(k > 0, verified, 0))


@functools.partial(jax.jit, static_argnames=("updater", "page_size"),
                   compiler_options=_QUICK_COMPILE)
def _publish(updater, manifest, state, plan, keys, held, num_pages, emit_ms, *,
             page_size):
  """Checks the plan, executes it, checks the result, applies it and moves
  the page ledger. Shared by every policy without an ``update`` hook
  (``updater`` None); a policy with one passes itself.

  Args:
    manifest: the full manifest; state: the ticked state; plan: the plan
      without its policy; keys: i32[R, K] its replayed keys; held: i32[R]
      pages per slot; num_pages: i32[] the cache.
  Returns:
    (state, held, result, plan_bad, result_bad, free).
  """
  online = manifest.online()
  plan_bad = {k: jnp.any(b) for k, b in validate.plan_violations(
      online, state, plan.replace(policy=_Replayed(), policy_id="replayed"),
      _Keys(keys)).items()}
  result = fixture_execute(manifest, state, plan, emit_ms)
  successor, violations = iteration.publish(online, state, plan.replace(policy=updater),
                                            result)
  result_bad = {k: jnp.any(b) for k, b in violations.items()}
  # The page ledger: a preemption (recompute) returns every page; a
  # completed interval holds the pages of its end; an ended request none.
  held = jnp.where(plan.preempt, 0, held)
  # (a verified row keeps the pages of its accepted rows only).
  grown = jnp.maximum(pages_for(result.completed_end, page_size), held)
  held = jnp.where(result.completed, grown, held)
  held = jnp.where(successor.status == rec.FINISHED, 0, held).astype(jnp.int32)
  return successor, held, result, plan_bad, result_bad, num_pages - jnp.sum(held)


@functools.partial(jax.jit, compiler_options=_QUICK_COMPILE)
def _arrive(manifest, state, slot, request_id, arrival_ms, arrival_seq, prompt_len,
            max_tokens, priority, client, output_len):
  manifest, state = apply_lib.arrive(manifest, state, slot, request_id, arrival_ms,
                                     arrival_seq, prompt_len, max_tokens, priority, client)
  return manifest.replace(hidden_realized_output_tokens=(
      manifest.hidden_realized_output_tokens.at[slot].set(output_len))), state


_release = jax.jit(lambda state: apply_lib.release(state, state.status == rec.FINISHED),
                   compiler_options=_QUICK_COMPILE)
_cancel = jax.jit(apply_lib.cancel, compiler_options=_QUICK_COMPILE)


def _slot_order(num_slots: int, usable: int, scattered: bool) -> List[int]:
  """Slots in the order arrivals take them: the first ``usable`` in index
  order, or every slot in a fixed scattered order (stride 5, from the top)."""
  if not scattered:
    return list(range(usable))
  stride = 5 if num_slots % 5 else 7
  return [(num_slots - 1 - i * stride) % num_slots for i in range(num_slots)]


def run(policy, workload: Workload, *, kit: Kit = PROFILES["fast"],
        num_slots: Optional[int] = None, usable: Optional[int] = None,
        scattered: bool = False, max_iters: Optional[int] = None,
        overflow_waits: bool = False) -> Trace:
  """Runs ``workload`` under ``policy`` (an instance) through the kit loop.

  Args:
    num_slots: compiled table size (default ``kit.num_slots``).
    usable: slots arrivals may take (default all); ``scattered`` takes every
      slot in a fixed non-index order instead.
    max_iters: iteration cap (default: 4 x the workload's rows + 40 after
      the last arrival).
    overflow_waits: an arrival that finds no free slot waits outside the
      table (unseen by the policy) instead of raising.
  Returns:
    The ``Trace``; rule faults seen on the way are in ``trace.faults``.
  Raises:
    ValueError: a workload with more live requests than usable slots.
  """
  num_slots = kit.num_slots if num_slots is None else num_slots
  order = _slot_order(num_slots, num_slots if usable is None else usable, scattered)
  reqs = workload.requests
  last = max((r.arrival for r in reqs), default=0)
  if max_iters is None:
    max_iters = last + 40 + 4 * sum(r.prompt_len + r.max_tokens for r in reqs)
  manifest = rec.empty_manifest(num_slots).replace(
      hidden_realized_output_tokens=jnp.zeros((num_slots,), jnp.int32))
  state = rec.initial_state(num_slots, kit.num_clients, kit.max_tokens, policy=policy)
  held = jnp.zeros((num_slots,), jnp.int32)
  num_pages = jnp.int32(workload.num_pages)
  arrivals = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival, i))
  slot_of: Dict[int, int] = {}
  owner = np.full(num_slots, -1)
  t = Trace(tokens={i: [] for i in range(len(reqs))},
            outcome={i: "unfinished" for i in range(len(reqs))},
            first_token_iter={i: None for i in range(len(reqs))},
            preemptions={i: 0 for i in range(len(reqs))})
  updater = policy if callable(getattr(policy, "update", None)) else None
  nxt = 0
  for it in range(max_iters):
    state = _release(state)
    status = np.asarray(state.status)
    owner[status == rec.FREE] = -1
    while nxt < len(arrivals) and reqs[arrivals[nxt]].arrival <= it:
      i = arrivals[nxt]
      free = [s for s in order if owner[s] < 0]
      if not free and overflow_waits:
        break
      if not free:
        raise ValueError(f"workload needs more than {len(order)} live slots at "
                         f"iteration {it}")
      r, slot = reqs[i], free[0]
      manifest, state = _arrive(
          manifest, state, np.int32(slot), np.int32(i),
          np.float32(r.arrival * kit.tick_ms), np.int32(nxt), np.int32(r.prompt_len),
          np.int32(r.max_tokens), np.int32(r.priority), np.int32(r.client),
          np.int32(r.output_len))
      owner[slot], slot_of[i] = i, slot
      nxt += 1
    if nxt == len(arrivals) and all(o != "unfinished" for o in t.outcome.values()):
      break
    state, plan, keys, hidden_bad = _plan(policy, manifest, state, held, num_pages,
                                          np.float32(it * kit.tick_ms),
                                          page_size=kit.page_size)
    state, held, result, plan_bad, result_bad, free = _publish(
        updater, manifest, state, plan, keys, held, num_pages,
        np.float32((it + 1) * kit.tick_ms), page_size=kit.page_size)
    (sel, start, end, kind, rank, admit, preempt, unsched, emitted, token, finished,
     reason, failed, plan_bad, result_bad, hidden_bad, free, held_now,
     status) = jax.device_get((
         plan.selected, plan.start, plan.end, plan.kind, plan.rank, plan.admit,
         plan.preempt, plan.unschedulable, result.emitted,
         result.token if result.tokens is None else result.tokens,
         result.finished, result.finish_reason, result.failed, plan_bad, result_bad,
         hidden_bad, free, held, state.status))
    rows = tuple((int(owner[s]), int(start[s]), int(end[s]), int(kind[s]))
                 for s in sorted(np.flatnonzero(sel), key=lambda s: rank[s]))
    t.decisions.append((rows, tuple(sorted(int(owner[s]) for s in np.flatnonzero(admit))),
                        tuple(sorted(int(owner[s]) for s in np.flatnonzero(preempt)))))
    broken = [k for k, b in plan_bad.items() if b] + [k for k, b in result_bad.items() if b]
    if broken and "plans_validate" not in t.faults:
      t.faults["plans_validate"] = f"iteration {it}: validate rules {broken} broken"
    if hidden_bad and "hidden_truth" not in t.faults:
      t.faults["hidden_truth"] = (f"iteration {it}: the plan on a manifest carrying the "
                                  f"hidden output lengths differs from the plan on its "
                                  f"online projection (read it, or refuse it)")
    live = (status == rec.WAITING) | (status == rec.RUNNING)
    if (free < 0 or np.any(held_now[~live] != 0)) and "kv_census" not in t.faults:
      t.faults["kv_census"] = (f"iteration {it}: {int(np.sum(held_now))} pages held, "
                               f"{int(free)} free, of {workload.num_pages}")
    for s in np.flatnonzero(preempt):
      t.preemptions[int(owner[s])] += 1
    for s in np.flatnonzero(emitted):
      i = int(owner[s])
      t.tokens[i].extend(int(x) for x in np.atleast_1d(token[s]) if x >= 0)
      if t.first_token_iter[i] is None:
        t.first_token_iter[i] = it
    for s in np.flatnonzero(finished | failed):
      t.outcome[int(owner[s])] = "completed" if finished[s] and not failed[s] else "failed"
      if t.first_end_iter is None:
        t.first_end_iter = it
    if unsched is not None and np.any(unsched & live):
      state = _cancel(state, jnp.asarray(unsched & live))
      for s in np.flatnonzero(unsched & live):
        t.outcome[int(owner[s])] = "rejected"
        held = held.at[s].set(0)
  t.policy_state = jax.device_get(state.policy_state)
  return t


# ------------------------------------------------------------------ the rules


def _decisions_diff(a: Trace, b: Trace, upto: Optional[int] = None) -> Optional[str]:
  n = max(len(a.decisions), len(b.decisions)) if upto is None else upto + 1
  for it in range(n):
    da = a.decisions[it] if it < len(a.decisions) else None
    db = b.decisions[it] if it < len(b.decisions) else None
    if da != db:
      return f"iteration {it}: {da} against {db} ((rows, admitted, preempted))"
  return None


def _hide_differently(w: Workload) -> Workload:
  """The same workload with every hidden output length changed where its
  cap allows (n -> m + 1 - n, or n +- 1 when that is n)."""
  out = []
  for r in w.requests:
    g = r.max_tokens + 1 - r.output_len
    if g == r.output_len:
      g = r.output_len + 1 if r.output_len < r.max_tokens else max(r.output_len - 1, 1)
    out.append(dataclasses.replace(r, output_len=g))
  return dataclasses.replace(w, requests=tuple(out))


class _Checker:
  """Runs the rules for one policy factory under one kit."""

  def __init__(self, factory: Callable[[Budgets], object], kit: Kit):
    self.factory, self.kit = factory, kit
    self.policy = factory(kit.budgets)
    self.policy_id = str(getattr(self.policy, "policy_id", type(self.policy).__name__))
    sizes = kit.table_sizes or (kit.num_slots, kit.num_slots)
    self.small = dict(num_slots=sizes[0],
                      usable=None if kit.table_sizes else kit.small_slots)
    self.large = dict(num_slots=sizes[1], scattered=True)
    self._base: Dict[Workload, Trace] = {}

  def fail(self, rule, detail, example=None):
    raise ConformanceError(rule, self.policy_id, detail, example)

  def base(self, w: Workload) -> Trace:
    """The run on the small table (kept: most rules read it)."""
    if w not in self._base:
      self._base[w] = run(self.policy, w, kit=self.kit, **self.small)
    return self._base[w]

  # ---- each rule below returns a fault (str) or None for one workload

  def interface(self, w=None):
    p = self.policy
    missing = [a for a in ("policy_id", "version", "tie_break") if not hasattr(p, a)]
    if missing or not callable(p):
      return f"{type(p).__name__} lacks {missing or ['__call__']}"
    try:
      hash(p)
    except TypeError as e:
      return (f"{type(p).__name__} is not hashable ({e}): jit takes the policy as a "
              f"static argument (make it a frozen dataclass)")
    if p != self.factory(self.kit.budgets):
      return ("two policies built from the same budgets are not equal (jit would "
              "compile each apart)")
    names = tuple(p.tie_break) if isinstance(p.tie_break, (tuple, list)) else None
    if names is None or not all(isinstance(n, str) for n in names):
      return f"tie_break must be a tuple of column names, got {p.tie_break!r}"
    manifest, state, view = self._probe_tables()
    try:
      plan = jax.eval_shape(lambda m, s: p(m.online(), s, view), manifest, state)
    except Exception:             # noqa: BLE001  (policy_state names why it fails)
      return None
    columns = plan.sort_key.shape[-1]
    if len(names) != columns:
      return (f"tie_break names {len(names)} columns {names!r}, but the sort key "
              f"(plan.sort_key) has {columns}: name each column, in order")
    return None

  def _probe_tables(self):
    """(manifest, state, view): an empty kit table with the policy's state."""
    n, k = self.kit.num_slots, self.kit
    manifest = rec.empty_manifest(n).replace(
        hidden_realized_output_tokens=jnp.zeros((n,), jnp.int32))
    state = rec.initial_state(n, k.num_clients, k.max_tokens, policy=self.policy)
    view = rec.AllocatorView(free_pages=jnp.int32(4 * n), pages_held=jnp.zeros((n,), jnp.int32),
                             page_size=k.page_size)
    return manifest, state, view

  def _stateless_plans(self):
    """Fault of a policy without ``init_state`` whose plan, traced on a
    state whose ``policy_state`` is None, fails: by reading a state of its
    own (told apart by tracing again with a stand-in that refuses every
    read), or otherwise."""
    manifest, state, view = self._probe_tables()
    trace = lambda own: jax.eval_shape(
        lambda m, s: self.policy(m.online(), s.replace(policy_state=own), view),
        manifest, state)
    try:
      trace(None)
      return None
    except (AttributeError, TypeError) as e:
      error = f"{type(e).__name__}: {e}"
    try:
      trace(_NoOwnState())
    except _ReadsOwnState:
      return (f"reads its own state but declares no init_state: planning with "
              f"state.policy_state None raised {error} (define init_state(num_slots, "
              f"num_clients), docs/writing-a-policy.md)")
    except Exception:             # noqa: BLE001  (reported below as traced on None)
      pass
    return (f"planning on a state without a state of its own (state.policy_state "
            f"None) raised {error}")

  def policy_state(self, w=None):
    p = self.policy
    init = getattr(p, "init_state", None)
    n, c = self.kit.num_slots, self.kit.num_clients
    if init is None or init(n, c) is None:
      return self._stateless_plans()
    first, again = init(n, c), init(n, c)
    loose = [type(x).__name__ for x in jax.tree.leaves(first)
             if not isinstance(x, (jax.Array, np.ndarray))]
    if loose:
      return (f"init_state({n}, {c}) has leaves that are not arrays ({loose}): make "
              f"them jnp arrays (jnp.int32(0), jnp.zeros(...))")
    if not _same_tree(jax.device_get(first), jax.device_get(again)):
      return f"two calls of init_state({n}, {c}) differ: {first!r} against {again!r}"
    if not callable(getattr(p, "update", None)):
      return None
    manifest, state, view = self._probe_tables()

    def one_iteration(manifest, state):
      online = manifest.online()
      plan = p(online, state, view)
      result = fixture_execute(manifest, state, plan, jnp.float32(1.0))
      return apply_lib.apply(online, state, plan, result).policy_state

    before = jax.eval_shape(lambda s: s.policy_state, state)
    after = jax.eval_shape(one_iteration, manifest, state)
    if jax.tree.structure(before) != jax.tree.structure(after) or any(
        (a.shape, a.dtype) != (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))):
      return (f"update changes the state's structure, shapes or dtypes: {before} "
              f"becomes {after}")
    return None

  def plan_writes_nothing(self, w=None):
    p = self.policy
    manifest, state, view = self._probe_tables()
    attrs, class_attrs = _attribute_snapshot(p), _attribute_snapshot(type(p))
    seen = {}

    def probe(manifest, state):
      leaves, tree = jax.tree.flatten(state)
      try:
        plan = p(manifest.online(), state, view)
      except dataclasses.FrozenInstanceError as e:
        seen["fault"] = f"plan assigns to a frozen record ({e})"
        return None
      after, tree_after = jax.tree.flatten(state)
      if tree_after != tree or any(a is not b for a, b in zip(leaves, after)):
        seen["fault"] = ("plan replaced part of its input state (a container of the "
                         "policy's state written in place): advance the state in update")
      return plan

    jax.eval_shape(probe, manifest, state)
    if "fault" not in seen and _attribute_snapshot(p) != attrs:
      seen["fault"] = ("plan changed the policy object's attributes: keep state in "
                       "init_state / update, never on the policy")
    if "fault" not in seen and _attribute_snapshot(type(p)) != class_attrs:
      seen["fault"] = (f"plan changed a class attribute of {type(p).__name__}: keep "
                       f"state in init_state / update, never on the class")
    return seen.get("fault")

  def plans_validate(self, w):
    return self.base(w).faults.get("plans_validate")

  def progress(self, w):
    t = self.base(w)
    bad = {i: o for i, o in t.outcome.items() if o != "completed"}
    return (f"requests not completed after {len(t.decisions)} iterations: {bad} "
            f"(preemptions {t.preemptions})") if bad else None

  def kv_census(self, w):
    return self.base(w).faults.get("kv_census")

  def deterministic(self, w):
    a = self.base(w)
    b = run(self.factory(self.kit.budgets), w, kit=self.kit, **self.small)
    diff = _decisions_diff(a, b)
    if diff is None and a.tokens != b.tokens:
      diff = f"tokens differ: {a.tokens} against {b.tokens}"
    if diff is None and not _same_tree(a.policy_state, b.policy_state):
      diff = (f"the final policy state: {a.policy_state!r} against "
              f"{b.policy_state!r}")
    return None if diff is None else f"a second run differs at {diff}"

  def whole_queue(self, w):
    diff = _decisions_diff(self.base(w), run(self.policy, w, kit=self.kit, **self.large))
    return None if diff is None else (
        f"the small table ({self.small}) and the large one ({self.large}) differ at {diff}")

  def hidden_truth(self, w):
    a = self.base(w)
    if a.faults.get("hidden_truth"):
      return a.faults["hidden_truth"]
    b = run(self.policy, _hide_differently(w), kit=self.kit, **self.small)
    ends = [x for x in (a.first_end_iter, b.first_end_iter) if x is not None]
    diff = _decisions_diff(a, b, min(ends) if ends else None)
    return None if diff is None else ("changing only the hidden output lengths changed "
                                      f"a decision before any request ended: {diff}")

  def preemption_thrash(self, w):
    bound = thrash_bound(w)
    for i, n in self.base(w).preemptions.items():
      if n > bound:
        return f"request {i} was preempted {n} times (bound {bound})"
    return None

  def starvation(self):
    """Fault of the fixed starvation workload, or None (also when the
    policy does not declare ``starvation_free``)."""
    if not getattr(self.policy, "starvation_free", False):
      return None
    w, probe = starvation_workload(self.kit)
    t = run(self.policy, w, kit=self.kit, num_slots=self.kit.num_slots,
            max_iters=w.requests[probe].arrival + STARVATION_STREAM_ITERS,
            overflow_waits=True)
    first, arrival = t.first_token_iter[probe], w.requests[probe].arrival
    if first is not None and first - arrival <= STARVATION_HORIZON_ITERS:
      return None
    waited = "never" if first is None else f"after {first - arrival} iterations"
    return (f"the probe (request {probe} of starvation_workload(kit)) got its first "
            f"token {waited}; the horizon is {STARVATION_HORIZON_ITERS} iterations "
            f"while the stream lasts {STARVATION_STREAM_ITERS}")

  def check(self, workloads: Sequence[Workload], rules: Sequence[str]):
    for rule in rules:
      if rule in ("interface", "policy_state", "plan_writes_nothing", "starvation"):
        fault = getattr(self, rule)()
        if fault:
          self.fail(rule, fault)
      else:
        fault_of = getattr(self, rule)
        for w in workloads:
          fault = fault_of(w)
          if fault:
            small, fault = shrink(w, fault_of, fault)
            self.fail(rule, fault, small)


class _ReadsOwnState(Exception):
  """A plan read ``_NoOwnState``."""


class _NoOwnState:
  """``state.policy_state`` of a policy that declares none: every read of it
  raises ``_ReadsOwnState`` (``policy_state``'s probe)."""

  def _refuse(self, *args):
    raise _ReadsOwnState()

  __getattr__ = __getitem__ = __iter__ = __len__ = _refuse


def _same_tree(a, b) -> bool:
  """Same pytree structure and equal leaves (host values)."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  return all(np.shape(x) == np.shape(y) and np.array_equal(x, y)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _attribute_snapshot(obj):
  """What ``plan_writes_nothing`` compares of the policy object (and of its
  class): each attribute's identity, and a deep copy of mutable containers
  (a class's own dunder entries, ``__dataclass_fields__`` and the like,
  left out)."""
  attrs = getattr(obj, "__dict__", {})
  skip = isinstance(obj, type)
  return {k: (id(v), copy.deepcopy(v) if isinstance(v, (list, dict, set)) else None)
          for k, v in attrs.items()
          if not (skip and k.startswith("__") and k.endswith("__"))}


def _smaller(w: Workload):
  """Candidate workloads one step simpler than ``w``."""
  reqs = list(w.requests)
  for i in range(len(reqs)):
    if len(reqs) > 1:
      yield dataclasses.replace(w, requests=tuple(reqs[:i] + reqs[i + 1:]))
  for i, r in enumerate(reqs):
    for change in (dict(arrival=0), dict(priority=0), dict(client=0),
                   dict(max_tokens=r.output_len), dict(output_len=1, max_tokens=1),
                   dict(prompt_len=max(r.prompt_len // 2, 1))):
      s = dataclasses.replace(r, **change)
      if s != r:
        yield dataclasses.replace(w, requests=tuple(reqs[:i] + [s] + reqs[i + 1:]))


def shrink(w: Workload, fault_of: Callable[[Workload], Optional[str]], fault: str,
           max_trials: int = 30):
  """(workload, fault): the smallest variant of ``w`` found that still
  faults, by greedy one-step simplification (drop a request, then simplify
  one field), at most ``max_trials`` runs."""
  trials = 0
  improved = True
  while improved and trials < max_trials:
    improved = False
    for cand in _smaller(w):
      trials += 1
      try:
        got = fault_of(cand)
      except ValueError:
        got = None
      if got:
        w, fault, improved = cand, got, True
        break
      if trials >= max_trials:
        break
  return w, fault


def as_factory(policy) -> Callable[[Budgets], object]:
  """A ``Budgets -> policy`` factory from a registered name, a
  ``module:Class`` or ``path/to/file.py:Class`` spec, a class or factory, or
  an instance (used as it is, whatever the kit's budgets)."""
  if isinstance(policy, str):
    return registry.factory(policy)
  if isinstance(policy, type) or (callable(policy) and not hasattr(policy, "policy_id")):
    return policy
  return lambda budgets: policy


def _count(n: int, noun: str) -> str:
  return f"{n} {noun}" + ("" if n == 1 else "s")


@dataclasses.dataclass(frozen=True)
class Report:
  """What a passing ``check_policy`` checked.

  Attributes:
    policy_id: the policy's id.
    profile: the kit profile.
    rules: the rules run, in order (all passed).
    num_workloads: workloads each per-workload rule ran on.
    num_requests: requests over those workloads.
    has_state: whether the policy keeps a state of its own.
    skipped: rules of ``rules`` that did not apply to the policy, with why.
  """

  policy_id: str
  profile: str
  rules: Tuple[str, ...]
  num_workloads: int
  num_requests: int
  has_state: bool
  skipped: Tuple[Tuple[str, str], ...] = ()

  def __str__(self) -> str:
    state = "with a state of its own" if self.has_state else "without a state of its own"
    lines = [f"policy {self.policy_id!r} ({state}) passes the {self.profile!r} profile: "
             f"{len(self.rules)} rules on {_count(self.num_workloads, 'workload')} "
             f"({_count(self.num_requests, 'request')})"]
    why = dict(self.skipped)
    lines += [f"  {'--' if rule in why else 'ok'} {rule}: "
              + (f"not applicable ({why[rule]})" if rule in why else RULES[rule])
              for rule in self.rules]
    return "\n".join(lines)


def check_policy(policy, profile: str = "fast", *, seed: int = 0,
                 workloads: Optional[Sequence[Workload]] = None,
                 rules: Optional[Sequence[str]] = None) -> Report:
  """Runs the rules on ``policy``; raises ``ConformanceError`` for the first
  broken one (in ``RULES`` order, each over every workload), else returns
  the ``Report`` of what was checked.

  Args:
    policy: see ``as_factory``.
    profile: "fast" or "extended" (``PROFILES``).
    seed: seeds the random workloads.
    workloads: replaces ``HARD_CASES`` and the random workloads.
    rules: the rules to run (default: all of ``RULES``).
  Raises:
    ConformanceError: a broken rule, with a shrunk example.
    ValueError: an unknown profile or rule; ``jax_enable_x64`` on
      (``records.refuse_x64``).
  """
  rec.refuse_x64("the conformance kit")
  if profile not in PROFILES:
    raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
  rules = list(RULES) if rules is None else list(rules)
  unknown = [r for r in rules if r not in RULES]
  if unknown:
    raise ValueError(f"rules must be in {list(RULES)}, got {unknown}")
  kit = PROFILES[profile]
  if workloads is None:
    rng = np.random.default_rng(seed)
    workloads = list(HARD_CASES) + [random_workload(rng, kit)
                                    for _ in range(kit.num_workloads)]
  checker = _Checker(as_factory(policy), kit)
  ran = [r for r in RULES if r in rules]
  checker.check(workloads, ran)
  p = checker.policy
  has_state = callable(getattr(p, "init_state", None)) and p.init_state(1, 1) is not None
  skipped = []
  if "policy_state" in ran and not has_state:
    skipped.append(("policy_state", "no state of its own"))
  if "starvation" in ran and not getattr(p, "starvation_free", False):
    skipped.append(("starvation", "starvation_free not declared"))
  return Report(policy_id=checker.policy_id, profile=profile, rules=tuple(ran),
                num_workloads=len(workloads),
                num_requests=sum(len(w.requests) for w in workloads),
                has_state=has_state, skipped=tuple(skipped))


def main(argv: Sequence[str]) -> int:
  """``python -m scheduler.conformance SPEC [--profile=fast|extended]``:
  checks a registered name or a ``module:Class`` / ``path/to/file.py:Class``
  spec, prints what was checked (exit 0) or the broken rule (exit 1)."""
  args = [a for a in argv if not a.startswith("--profile=")]
  profiles = [a.split("=", 1)[1] for a in argv if a.startswith("--profile=")]
  if len(args) != 1:
    print("usage: python -m scheduler.conformance SPEC [--profile=fast|extended]",
          file=sys.stderr)
    return 2
  try:
    report = check_policy(args[0], profiles[-1] if profiles else "fast")
  except ConformanceError as e:
    print(e, file=sys.stderr)
    return 1
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(report)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
