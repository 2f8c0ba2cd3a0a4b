"""The four scheduling records of §0x01A as immutable pytrees.

Every record is a ``flax.struct`` dataclass over fixed-size arrays indexed by
request slot ``r in [0, R)``. A slot holds at most one request generation at a
time; free slots have ``status == FREE``. Four writers, four records:

* ``WorkloadManifest`` — request declarations (written on arrival). Its
  ``hidden_realized_output_tokens`` is fixture-only truth; ``online()`` strips
  it before any policy sees the manifest (§0x06).
* ``SchedulerState`` — versioned facts: frontiers, queue membership, clocks,
  completed-service counters. Only ``scheduler.apply.apply`` writes a
  successor state.
* ``IterationPlan`` — a policy's proposal: selected (slot, generation,
  snapshot) with ``[start, end)``, derived work kind, budget ledger, queue and
  preemption intents, and the tie-break key of every candidate.
* ``IterationResult`` — what execution completed: intervals, emitted tokens,
  terminal events, failures, completed-service rows.

Frontier names follow §0x01A: ``prompt_len`` (p), ``emitted`` (e),
``computed`` (c), ``committed`` (k). The legal ordinary work is prefill
``[c, end)`` with ``c < end <= target`` and decode exactly ``[c, c + 1)`` with
``c == p + e - 1``. After a recompute preemption (§0x0C) the request rebuilds
``[c, p + e - 1)`` (``REBUILD``), which publishes no output.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp

# Queue membership (SchedulerState.status).
FREE, WAITING, RUNNING, FINISHED = 0, 1, 2, 3
STATUS_NAMES = ("free", "waiting", "running", "finished")

# Derived work annotation (IterationPlan.kind).
NO_WORK, PREFILL_CHUNK, DECODE_ROW, REBUILD = 0, 1, 2, 3
KIND_NAMES = ("none", "prefill_chunk", "decode_row", "rebuild")

# Terminal reasons (SchedulerState.finish_reason / IterationResult).
NOT_FINISHED, FINISH_EOS, FINISH_STOP, FINISH_LENGTH = 0, 1, 2, 3
FINISH_ABORT, FINISH_ERROR = 4, 5
FINISH_NAMES = ("", "eos", "stop", "length", "abort", "error")

# Tie-break key columns recorded in IterationPlan.sort_key.
SORT_KEY_FIELDS = ("phase_rank", "priority", "arrival_seq", "request_id",
                   "generation")
NUM_SORT_KEYS = len(SORT_KEY_FIELDS)


@flax.struct.dataclass
class WorkloadManifest:
  """Request declarations, one per slot (§0x01A).

  Attributes:
    request_id: i32[R], engine-unique id; -1 for a free slot.
    arrival_ms: f32[R], original arrival on the engine clock (ms).
    arrival_seq: i32[R], global arrival order (the FCFS key); -1 for a slot
      never used (so that it equals request_id in every slot of an engine
      table, and ``keys.key_order`` gives the copy no bits).
    prompt_len: i32[R], prompt tokens p.
    max_tokens: i32[R], declared output cap (the only length a policy sees).
    priority: i32[R], lower runs first.
    client: i32[R], client index for completed-service accounting.
    hidden_realized_output_tokens: i32[R] or None. Fixture-only truth; never
      present in the online projection.
    policy_id, policy_version: static strings, the workload's declared policy
      identity; a plan from another policy identity is refused (§0x01A).
      Empty means the workload leaves the policy unbound.
    ttft_ms, tbt_ms: f32[R] or None, declared SLOs (ms): first-token limit
      from original arrival, next-token limit from the previous emission
      (§0x07). None (or +inf) means no objective; see ``slo_limits``.
  """

  request_id: jax.Array
  arrival_ms: jax.Array
  arrival_seq: jax.Array
  prompt_len: jax.Array
  max_tokens: jax.Array
  priority: jax.Array
  client: jax.Array
  hidden_realized_output_tokens: Optional[jax.Array] = None
  policy_id: str = flax.struct.field(pytree_node=False, default="")
  policy_version: str = flax.struct.field(pytree_node=False, default="")
  ttft_ms: Optional[jax.Array] = None
  tbt_ms: Optional[jax.Array] = None

  @property
  def num_slots(self) -> int:
    return self.request_id.shape[0]

  def online(self) -> "WorkloadManifest":
    """The projection a policy may read: hidden truth removed (§0x06)."""
    return self.replace(hidden_realized_output_tokens=None)


@flax.struct.dataclass
class PerSlot:
  """A column of a policy's state with one entry per slot: it belongs to
  the request in the slot and restarts at ``fresh`` when a new request
  arrives there (``scheduler.apply.arrive``), whether or not the policy
  saw the last one leave.

  Attributes:
    value: [R] array (any dtype).
    fresh: static scalar, the value a new request starts with.
  """

  value: jax.Array
  fresh: Any = flax.struct.field(pytree_node=False, default=0)

  @classmethod
  def full(cls, num_slots: int, fresh, dtype=jnp.int32) -> "PerSlot":
    return cls(value=jnp.full((num_slots,), fresh, dtype), fresh=fresh)


@flax.struct.dataclass
class PerClient:
  """A column of a policy's state with one entry per client table row: it
  restarts at ``fresh`` when the engine gives the row to a new client
  (``scheduler.apply.forget_client``).

  Attributes:
    value: [C] array (any dtype).
    fresh: static scalar, the value a new client starts with.
  """

  value: jax.Array
  fresh: Any = flax.struct.field(pytree_node=False, default=0)

  @classmethod
  def full(cls, num_clients: int, fresh, dtype=jnp.int32) -> "PerClient":
    return cls(value=jnp.full((num_clients,), fresh, dtype), fresh=fresh)


def refuse_x64(who: str) -> None:
  """Refuses ``jax_enable_x64`` where ``who`` builds or traces programs over
  these tables.

  The tables here are int32 and float32; under the flag ``jnp`` widens their
  arithmetic to int64 (``jnp.arange``, Python-int sums), which the
  scheduler's loop carries cannot hold: every registered policy failed to
  trace with a ``TypeError`` from inside the ledger. The simulated loop's
  float64 clock takes a ``jax.enable_x64`` scope of its own inside its
  program (``serving.engine.sim_loop``).

  Raises:
    ValueError: the flag on, process-wide or in a ``jax.enable_x64`` scope.
  """
  if jax.config.jax_enable_x64:
    raise ValueError(
        f"jax_enable_x64 must be off where {who} builds or traces its programs (the "
        f"scheduler's tables are int32 and float32), got on: unset JAX_ENABLE_X64, drop "
        f"jax.config.update('jax_enable_x64', True), or leave the "
        f"`with jax.enable_x64(True):` scope first")


def restart(policy_state, kind, index):
  """``policy_state`` with entry ``index`` (i32[]) of every ``kind``
  (``PerSlot`` or ``PerClient``) column set back to its ``fresh`` value;
  other leaves unchanged."""
  def one(leaf):
    if isinstance(leaf, kind):
      return leaf.replace(value=leaf.value.at[index].set(
          jnp.asarray(leaf.fresh, leaf.value.dtype)))
    return leaf
  return jax.tree.map(one, policy_state, is_leaf=lambda x: isinstance(x, (PerSlot, PerClient)))


@flax.struct.dataclass
class SchedulerState:
  """Versioned scheduler facts at one decision boundary (§0x01A).

  Attributes:
    decision_id: i32[], id of the next decision.
    state_version: i32[], bumped by every ``apply``.
    now_ms: f32[], monotonic engine clock of this state (ms).
    status: i32[R], FREE / WAITING / RUNNING / FINISHED.
    ready: bool[R], readiness facts (e.g. foreign cache present).
    generation: i32[R], request generation; bumped on preemption.
    snapshot_version: i32[R], per-request service-view version; bumped
      whenever that request's facts change.
    emitted: i32[R], output tokens emitted (e).
    computed: i32[R], token rows computed (c).
    committed: i32[R], all-layer committed cache rows (k == c at a boundary).
    first_token_ms, last_token_ms: f32[R], emission clocks (ms; -1 if none).
    finish_reason: i32[R], FINISH_* code, NOT_FINISHED while live.
    num_preemptions: i32[R].
    service_rows: i32[C], completed-service counter per client (rows);
      rebuild rows after a recompute preemption are not service (§0x0C).

  Facts every policy may read, beyond the frontiers (None on a state built
  without them; each advanced only by ``scheduler.apply.apply`` from
  completed results, whatever the policy):
    recompute_rows: i32[C], completed rows per client that recompute cache
      lost to a recompute preemption: REBUILD rows, and prompt rows re-run
      below ``rebuild_target`` (resource usage, never fairness service;
      §0x0C).
    rebuild_target: i32[R], the largest frontier a request had when it was
      preempted (T_target; 0 if never): completed rows below it are
      recompute, rows at or above it are service.
    completed_outputs: i32[L], histogram of the output lengths of requests
      completed in this run (eos / stop / length; index n = n outputs,
      clipped to L - 1): the online facts of the §0x06 point / quantile
      estimators (``scheduler.admission.forecast_outputs``).
    num_extensions: i32[R], §0x06 extensions granted to the request: decode
      rows that crossed its reserved frontier and took a new page
      (``IterationPlan.extend``).
    client_completed_requests: i32[C], requests of each client that
      completed in this run (eos / stop / length; aborts and failures are
      not counted).
    client_completed_outputs: i32[C], the outputs those requests emitted in
      all. With ``client_completed_requests`` the online facts of a
      per-client output-length mean (§0x06; ``scheduler.policy_length``):
      learned only from requests that ended, never a live one's length.
    draft_tokens, accepted_tokens: i32[R], speculative decoding: the draft
      tokens the request's rows verified, and those accepted, since it
      arrived: its acceptance rate, learned online (``IterationResult``).
    draft_rejections: i32[R], its verified rows that rejected a draft (that
      did not end the request, so the first unaccepted draft was a
      rejection): accepted / (accepted + rejections) is the per-token
      acceptance's maximum-likelihood estimate (each row a run of
      Bernoulli trials stopped at the first failure or after k).
    client_draft_tokens, client_accepted_tokens, client_draft_rejections:
      i32[C], the same per client, over every request of the client in
      this run.
    policy_state: the running policy's own state, a pytree the scheduler
      carries without reading (``policy.init_state(num_slots, num_clients)``,
      advanced by the policy's ``update`` hook inside ``apply``; None for a
      policy without state, or a hand-built state: see
      ``scheduler.ledger.PolicyBase.own_state``). Its ``PerSlot`` leaves
      restart at a slot's arrival, its ``PerClient`` leaves when a client's
      table row is given to a new client (``docs/writing-a-policy.md``).
  """

  decision_id: jax.Array
  state_version: jax.Array
  now_ms: jax.Array
  status: jax.Array
  ready: jax.Array
  generation: jax.Array
  snapshot_version: jax.Array
  emitted: jax.Array
  computed: jax.Array
  committed: jax.Array
  first_token_ms: jax.Array
  last_token_ms: jax.Array
  finish_reason: jax.Array
  num_preemptions: jax.Array
  service_rows: jax.Array
  recompute_rows: Optional[jax.Array] = None
  rebuild_target: Optional[jax.Array] = None
  completed_outputs: Optional[jax.Array] = None
  num_extensions: Optional[jax.Array] = None
  client_completed_requests: Optional[jax.Array] = None
  client_completed_outputs: Optional[jax.Array] = None
  draft_tokens: Optional[jax.Array] = None
  accepted_tokens: Optional[jax.Array] = None
  draft_rejections: Optional[jax.Array] = None
  client_draft_tokens: Optional[jax.Array] = None
  client_accepted_tokens: Optional[jax.Array] = None
  client_draft_rejections: Optional[jax.Array] = None
  policy_state: Any = None


@flax.struct.dataclass
class AllocatorView:
  """The allocator facts a policy may read (never page ids; §0x06).

  Attributes:
    free_pages: i32[], pages on the free list.
    pages_held: i32[R], pages owned by each slot.
    page_size: static, token rows per page.
    prefix_hit_tokens: i32[R] or None, exact cached-prefix tokens the
      allocator has proven resident for each slot's prompt (None reads as
      zeros until a prefix cache publishes it; see ``prefix_hits``).
    reclaimable_pages: i32[R] or None, pages a slot's release would return
      to the free pool: its pages that no other page table holds (a page
      shared with a prefix-cache hit stays held). The credit a policy may
      take for preempting the slot; None reads as ``pages_held`` (no
      sharing).
  """

  free_pages: jax.Array
  pages_held: jax.Array
  page_size: int = flax.struct.field(pytree_node=False)
  prefix_hit_tokens: Optional[jax.Array] = None
  reclaimable_pages: Optional[jax.Array] = None


@flax.struct.dataclass
class IterationPlan:
  """One policy decision (§0x01A). Planning advances nothing.

  Attributes:
    decision_id, input_state_version: i32[], bound to the input state.
    policy_id, policy_version: static strings.
    selected: bool[R], slots that run this iteration.
    generation, snapshot_version: i32[R], bound at selection time.
    start, end: i32[R], the half-open interval ``[start, end)``.
    kind: i32[R], derived PREFILL_CHUNK / DECODE_ROW / REBUILD.
    rank: i32[R], packing order among selected slots (-1 if not selected).
    admit: bool[R], WAITING -> RUNNING queue intents.
    preempt: bool[R], RUNNING -> WAITING recompute-preemption intents.
    sort_key: i32[R, NUM_SORT_KEYS], the recorded tie-break key of every
      slot (columns SORT_KEY_FIELDS).
    num_tokens, num_seqs: i32[], the budget ledger (rows, sequences).
    token_budget, seq_budget: static ints the ledger was checked against.
    unschedulable: bool[R] or None, live slots the policy can never serve
      under its static budgets (e.g. an ORCA prompt wider than the token
      budget); they stay blocked and visible here.
    extend: bool[R] or None, §0x06 extension intents: selected decode rows
      past the request's reserved frontier that take a new page (the
      allocator grants it with the plan; when pages are short the ledger's
      victim rule preempts instead).
    policy: static policy object that made the plan, or None. Its
      ``sort_keys(manifest, state)`` replays ``sort_key`` (default:
      ``scheduler.keys.sort_keys``) and its optional
      ``update(manifest, state, plan, result, successor)`` advances its
      counters inside ``scheduler.apply.apply``.
    num_draft: i32[R] or None, speculative decoding: the draft tokens a
      selected decode row verifies (k >= 0; the row's interval is then
      ``[c, c + 1 + k)``: the last emitted token, then k drafts the
      engine's proposer writes after it). None or 0: no speculation.
  """

  decision_id: jax.Array
  input_state_version: jax.Array
  selected: jax.Array
  generation: jax.Array
  snapshot_version: jax.Array
  start: jax.Array
  end: jax.Array
  kind: jax.Array
  rank: jax.Array
  admit: jax.Array
  preempt: jax.Array
  sort_key: jax.Array
  num_tokens: jax.Array
  num_seqs: jax.Array
  policy_id: str = flax.struct.field(pytree_node=False, default="")
  policy_version: str = flax.struct.field(pytree_node=False, default="")
  token_budget: int = flax.struct.field(pytree_node=False, default=0)
  seq_budget: int = flax.struct.field(pytree_node=False, default=0)
  unschedulable: Optional[jax.Array] = None
  policy: object = flax.struct.field(pytree_node=False, default=None)
  extend: Optional[jax.Array] = None
  num_draft: Optional[jax.Array] = None


@flax.struct.dataclass
class IterationResult:
  """Facts returned by execution of one plan (§0x01A).

  Attributes:
    decision_id, input_state_version: i32[], copied from the plan.
    completed: bool[R], the planned interval completed.
    completed_end: i32[R], computed frontier after the interval.
    emitted: bool[R], an output token was emitted.
    token: i32[R], the emitted token id (-1 if none).
    emit_ms: f32[], engine clock when the outputs were published (ms).
    finished: bool[R], terminal event this iteration.
    finish_reason: i32[R], FINISH_* code for finished slots.
    failed: bool[R], execution failed for this slot.
    service_rows: i32[R], completed rows debited to the slot's client.
    preserved_end: i32[R] or None, for a slot the plan preempts: the exact
      KV prefix ``[0, preserved_end)`` kept by the preservation path (copied
      to host memory, restored before the request runs again) — its frontier
      after the preemption (§0x0C ``T_ready``); 0 (or None) means recompute.
    accepted: i32[R] or None, speculative decoding: the draft tokens of the
      slot's row that were verified and emitted (0 <= accepted <=
      ``plan.num_draft``). An emitting slot emits ``1 + accepted`` tokens,
      and its computed frontier moves to ``start + 1 + accepted``.
    tokens: i32[R, 1 + K] or None, with ``accepted``: the tokens emitted, in
      order (-1 past ``1 + accepted``); ``token`` is the last of them.
  """

  decision_id: jax.Array
  input_state_version: jax.Array
  completed: jax.Array
  completed_end: jax.Array
  emitted: jax.Array
  token: jax.Array
  emit_ms: jax.Array
  finished: jax.Array
  finish_reason: jax.Array
  failed: jax.Array
  service_rows: jax.Array
  preserved_end: Optional[jax.Array] = None
  accepted: Optional[jax.Array] = None
  tokens: Optional[jax.Array] = None


def num_draft(plan: IterationPlan):
  """i32[R]: the plan's draft tokens per slot (zeros without speculation)."""
  if plan.num_draft is None:
    return jnp.zeros_like(plan.start)
  return plan.num_draft


def num_accepted(result: IterationResult):
  """i32[R]: the result's accepted draft tokens (zeros without speculation)."""
  if result.accepted is None:
    return jnp.zeros_like(result.completed_end)
  return result.accepted


def empty_manifest(num_slots: int) -> WorkloadManifest:
  """A manifest with every slot free (no SLO declared: limits +inf)."""
  i32 = lambda v: jnp.full((num_slots,), v, jnp.int32)
  inf = jnp.full((num_slots,), jnp.inf, jnp.float32)
  return WorkloadManifest(
      request_id=i32(-1), arrival_ms=jnp.zeros((num_slots,), jnp.float32),
      arrival_seq=i32(-1), prompt_len=i32(0), max_tokens=i32(0),
      priority=i32(0), client=i32(0), ttft_ms=inf, tbt_ms=inf)


def slo_limits(manifest: WorkloadManifest):
  """(ttft_ms f32[R], tbt_ms f32[R]); +inf where no SLO was declared."""
  inf = jnp.full((manifest.num_slots,), jnp.inf, jnp.float32)
  ttft = inf if manifest.ttft_ms is None else manifest.ttft_ms
  tbt = inf if manifest.tbt_ms is None else manifest.tbt_ms
  return ttft, tbt


def prefix_hits(view: AllocatorView):
  """i32[R]: the allocator's published prefix-hit tokens (zeros if none)."""
  if view.prefix_hit_tokens is None:
    return jnp.zeros_like(view.pages_held)
  return view.prefix_hit_tokens


def initial_state(num_slots: int, num_clients: int,
                  max_output_tokens: int = 0, *, policy=None) -> SchedulerState:
  """State version 0: every slot free, clocks and counters at zero.

  ``max_output_tokens`` sizes the completed-output histogram (``L =
  max_output_tokens + 1`` bins); 0 leaves it out (the §0x06 estimators then
  fall back to the declared maximum). ``policy``'s ``init_state(num_slots,
  num_clients)``, when it has one, is the ``policy_state``."""
  i32 = lambda v: jnp.full((num_slots,), v, jnp.int32)
  f32 = lambda v: jnp.full((num_slots,), v, jnp.float32)
  init = getattr(policy, "init_state", None)
  return SchedulerState(
      decision_id=jnp.int32(0), state_version=jnp.int32(0),
      now_ms=jnp.float32(0.0), status=i32(FREE),
      ready=jnp.zeros((num_slots,), bool), generation=i32(0),
      snapshot_version=i32(0), emitted=i32(0), computed=i32(0),
      committed=i32(0), first_token_ms=f32(-1.0), last_token_ms=f32(-1.0),
      finish_reason=i32(NOT_FINISHED), num_preemptions=i32(0),
      service_rows=jnp.zeros((num_clients,), jnp.int32),
      recompute_rows=jnp.zeros((num_clients,), jnp.int32),
      rebuild_target=i32(0),
      completed_outputs=(jnp.zeros((max_output_tokens + 1,), jnp.int32)
                         if max_output_tokens > 0 else None),
      num_extensions=i32(0),
      client_completed_requests=jnp.zeros((num_clients,), jnp.int32),
      client_completed_outputs=jnp.zeros((num_clients,), jnp.int32),
      draft_tokens=i32(0), accepted_tokens=i32(0), draft_rejections=i32(0),
      client_draft_tokens=jnp.zeros((num_clients,), jnp.int32),
      client_accepted_tokens=jnp.zeros((num_clients,), jnp.int32),
      client_draft_rejections=jnp.zeros((num_clients,), jnp.int32),
      policy_state=None if init is None else init(num_slots, num_clients))


def kv_rows(prompt_len, max_tokens):
  """KV rows a request writes at most: ``p + m - 1``.

  Every prompt row is cached; of the ``m`` outputs only the first ``m - 1``
  are fed back (the last sampled token ends the request unfed), so a
  request never needs more rows than this. Works on ints and i32 arrays.
  """
  return prompt_len + max_tokens - 1


def prefill_target(manifest: WorkloadManifest, state: SchedulerState):
  """i32[R]: where prefill-like work must stop.

  ``p`` while nothing was emitted; ``p + e - 1`` after a recompute
  preemption, so the latest emitted token is consumed by an ordinary decode.
  """
  return jnp.where(state.emitted == 0, manifest.prompt_len,
                   manifest.prompt_len + state.emitted - 1)
