"""Fairness policies: FastServe MLFQ, VTC, completion-reconciled VTC, and
prefix-aware groups with a quota (§0x09A).

Each names its protected identity and service unit, and keeps its persistent
counters in its own state (``MlfqState``, ``VtcState``, ``PrefixState``:
``SchedulerState.policy_state``, made by ``init_state``); only
``scheduler.apply.apply`` advances it, through the policy's pure
``update(manifest, state, plan, result, successor)`` (called with the
completed result, never from the plan alone). Rebuild rows
after a recompute preemption are never charged as service (§0x0C).

* ``fastserve`` (FastServe skip-join MLFQ, protects jobs): queue quanta
  ``q_j = base_quantum * 2**j`` token rows; a new job joins the first queue
  whose quantum covers its next-iteration cost (rows of its next legal
  interval); a job whose used rows reach its quantum is demoted to
  ``max(level + 1, join level of its next cost)``; a ready job unserved for
  ``alpha_iters`` iterations is promoted to queue 0. Within a queue: arrival.
* ``vtc`` (VTC, Sheng et al. 2024, Algorithm 2, protects clients): running
  requests run every iteration; admissions go to the earliest waiting request
  of the active client with the smallest counter (ties: lower client index).
  A newly active client's counter is lifted to the minimum counter of the
  already active clients (or to the counter of the last client that left).
  Charges: ``w_p * prompt_len`` when an admission is published (provisional
  inside one plan, so one client cannot take several prompts at once),
  ``w_q`` per token a decode row emits.
* ``vtc_completion_reconciled`` (§0x09A teaching adaptation, not the VTC
  theorem): the selection counter C_select is charged the predicted weighted
  rows of every planned interval inside the plan; ``apply`` adds the actual
  weighted completed rows to C_select and to the authoritative W_done, and a
  failed interval adds nothing (the provisional charge is rolled back).
* ``prefix_aware`` (teaching quota, not Preble): waiting requests split into
  hot (allocator-proven prefix hit >= ``hot_pct`` % of the prompt) and cold
  groups; hot goes first, but after ``quota_hot`` hot selections without a
  cold one, an eligible cold request goes first (``quota_hot = 0``: reuse
  greedy, which can starve cold prompts). Eligible: a cold prompt not yet
  fully computed, waiting or part-way through a chunked prefill. The hit is
  the engine's real prefix-cache fact (``serving.kv.prefix_cache``).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from scheduler import ledger as base
from scheduler import records as rec
from scheduler import scan


def _live(state):
  return (state.status == rec.WAITING) | (state.status == rec.RUNNING)


def _per_client(manifest, values, num_clients, mask=None):
  """i32[C]: sum of ``values`` over slots (masked) by client."""
  values = jnp.asarray(values, jnp.int32)
  if mask is not None:
    values = jnp.where(mask, values, 0)
  return jnp.zeros((num_clients,), jnp.int32).at[manifest.client].add(values)


def active_clients(manifest, state):
  """bool[C]: clients with a WAITING or RUNNING request."""
  num_clients = state.service_rows.shape[0]
  idx = jnp.where(_live(state), manifest.client, num_clients)
  return jnp.zeros((num_clients,), bool).at[idx].set(True, mode="drop")


@flax.struct.dataclass
class VtcState:
  """VTC's state (``SchedulerState.policy_state`` under ``vtc`` and
  ``vtc_completion_reconciled``).

  Attributes:
    counter: i32 PerClient, VTC virtual counter c_i, or the provisional
      selection counter C_select of completion-reconciled VTC (§0x09A).
    done: i32 PerClient, authoritative weighted completed service W_done.
    active: bool PerClient, clients with a live request at the last
      publication (the counter lift detects newly active clients).
    last_left: i32[], counter of the last client that left when the active
      set became empty (VTC Algorithm 2).
  """

  counter: rec.PerClient
  done: rec.PerClient
  active: rec.PerClient
  last_left: jax.Array

  @classmethod
  def init(cls, num_clients: int) -> "VtcState":
    return cls(counter=rec.PerClient.full(num_clients, 0),
               done=rec.PerClient.full(num_clients, 0),
               active=rec.PerClient.full(num_clients, False, bool),
               last_left=jnp.int32(0))


def lifted_counters(manifest, state, vtc: VtcState):
  """i32[C]: VTC counters after lifting newly active clients (Algorithm 2).

  A client active now but not at the last publication is lifted to the
  minimum counter of the clients active at both, or, if none is, to
  ``vtc.last_left``.
  """
  counter = vtc.counter.value
  was_active = vtc.active.value
  now = active_clients(manifest, state)
  stay = now & was_active
  floor = jnp.where(jnp.any(stay), jnp.min(jnp.where(stay, counter, base.INT32_MAX)),
                    vtc.last_left)
  return jnp.where(now & ~was_active, jnp.maximum(counter, floor), counter)


# ------------------------------------------------------------------ FastServe


@flax.struct.dataclass
class MlfqState:
  """FastServe's state (``SchedulerState.policy_state`` under ``fastserve``).

  Attributes:
    level: i32 PerSlot, the request's queue index (-1 before skip-join).
    used: i32 PerSlot, quantum used at the current level (token rows).
    wait: i32 PerSlot, iterations the live, ready request went unserved.
  """

  level: rec.PerSlot
  used: rec.PerSlot
  wait: rec.PerSlot


@dataclasses.dataclass(frozen=True)
class FastServe(base.PolicyBase):
  """Skip-join MLFQ with geometric quanta, demotion and promotion.

  Attributes:
    budgets: iteration budgets.
    num_levels: queues Q_0..Q_{L-1}.
    base_quantum: q_0 in token rows; q_j = base_quantum * 2**j.
    alpha_iters: iterations a ready job may wait unserved before promotion.
  """

  budgets: base.Budgets
  num_levels: int = 4
  base_quantum: int = 1
  alpha_iters: int = 8
  policy_id: str = "fastserve"
  version: str = "1"
  tie_break: tuple = ("work_rank", "mlfq_level", "arrival_seq", "request_id",
                      "generation")

  def __post_init__(self):
    for name in ("num_levels", "base_quantum", "alpha_iters"):
      if getattr(self, name) < 1:
        raise ValueError(f"FastServe.{name} must be >= 1, got {getattr(self, name)}")

  def init_state(self, num_slots, num_clients):
    del num_clients
    return MlfqState(level=rec.PerSlot.full(num_slots, -1),
                     used=rec.PerSlot.full(num_slots, 0),
                     wait=rec.PerSlot.full(num_slots, 0))

  def quanta(self):
    """i32[L]: q_j = base_quantum * 2**j (token rows)."""
    return self.base_quantum * (2 ** jnp.arange(self.num_levels, dtype=jnp.int32))

  def next_cost(self, manifest, state):
    """i32[R]: rows of the next legal interval (1 for a decode row)."""
    f = base.work_facts(manifest, state)
    rows = jnp.minimum(f.target - state.computed, self.budgets.chunk_cap)
    return jnp.where(f.decode, 1, jnp.maximum(rows, 1))

  def join_level(self, cost):
    """i32[R]: first queue whose quantum covers ``cost`` (skip-join)."""
    below = jnp.sum(self.quanta()[None, :] < cost[:, None], axis=1)
    return jnp.minimum(below, self.num_levels - 1).astype(jnp.int32)

  def levels(self, manifest, state):
    """i32[R]: the stored queue, or the skip-join queue before joining."""
    stored = self.own_state(state).level.value
    return jnp.where(stored >= 0, stored,
                     self.join_level(self.next_cost(manifest, state)))

  def sort_keys(self, manifest, state, view=None):
    return base.identity_keys(manifest, state, base.work_rank(manifest, state),
                              self.levels(manifest, state))

  def plan(self, manifest, state, alloc):
    keys = self.sort_keys(manifest, state)
    order = base.key_order(keys)
    x, c = base.ledger(manifest, state, alloc, self.budgets, order)
    c = base.greedy_scan(x, c, order, fcfs_break=False)
    return base.finish_plan(manifest, state, x, c, keys, order, self)

  def update(self, manifest, state, plan, result, successor):
    """Quantum use, demotion, wait and promotion from the completed result."""
    own = self.own_state(state)
    level = self.levels(manifest, state)
    served = result.completed & plan.selected
    used = own.used.value + jnp.where(served, plan.end - plan.start, 0)
    quantum = self.quanta()[level]
    depleted = served & (used >= quantum)
    demoted = jnp.minimum(jnp.maximum(level + 1, self.join_level(
        self.next_cost(manifest, successor))), self.num_levels - 1)
    level = jnp.where(depleted, demoted, level)
    used = jnp.where(depleted, 0, used)
    waited = _live(state) & state.ready & ~served
    wait = jnp.where(served, 0, own.wait.value + waited.astype(jnp.int32))
    promote = wait >= self.alpha_iters
    level = jnp.where(promote, 0, level)
    used = jnp.where(promote, 0, used)
    wait = jnp.where(promote, 0, wait)
    gone = ~_live(successor)
    return MlfqState(
        level=own.level.replace(value=jnp.where(gone, -1, level).astype(jnp.int32)),
        used=own.used.replace(value=jnp.where(gone, 0, used).astype(jnp.int32)),
        wait=own.wait.replace(value=jnp.where(gone, 0, wait).astype(jnp.int32)))


# ------------------------------------------------------------------ VTC


@dataclasses.dataclass(frozen=True)
class Vtc(base.PolicyBase):
  """Virtual Token Counter (VTC Algorithm 2).

  Attributes:
    budgets: iteration budgets.
    w_p: service weight of one input (prompt) token.
    w_q: service weight of one output token.
  """

  budgets: base.Budgets
  w_p: int = 1
  w_q: int = 2
  policy_id: str = "vtc"
  version: str = "1"
  tie_break: tuple = ("queue_rank", "client_counter", "arrival_seq",
                      "request_id", "generation")

  def __post_init__(self):
    if self.w_p < 0 or self.w_q < 0:
      raise ValueError(f"{type(self).__name__} weights must be >= 0, got "
                       f"w_p={self.w_p}, w_q={self.w_q}")

  def init_state(self, num_slots, num_clients):
    del num_slots
    return VtcState.init(num_clients)

  # Charges, overridden by the completion-reconciled variant.
  def admission_charge(self, manifest, state, s, width):
    """i32[]: provisional charge of admitting slot ``s`` (paper: w_p x its
    prompt, once: a readmission after preemption is not charged again)."""
    del width
    return jnp.where(state.num_preemptions[s] == 0,
                     self.w_p * manifest.prompt_len[s], 0)

  def running_charges(self, manifest, state, x, c):
    """i32[C]: provisional charges of the running work in the plan."""
    del x, c
    return jnp.zeros_like(state.service_rows)

  def sort_keys(self, manifest, state, view=None):
    """queue_rank 0 running, 1 waiting, 2 other; then the lifted counter."""
    queue = jnp.select([state.status == rec.RUNNING, state.status == rec.WAITING],
                       [0, 1], 2)
    counter = lifted_counters(manifest, state, self.own_state(state))[manifest.client]
    return base.identity_keys(manifest, state, queue, counter)

  def plan(self, manifest, state, alloc):
    """Running requests in key order, then admissions client by client.

    The admission loop keeps, per client, its waiting requests in key order
    (one sort) and a head index; each admission takes the head of the
    client with the least provisional counter (ties: lower index), so a
    trip costs O(C) and there is at most one trip per admission plus the
    one that stops.
    """
    keys = self.sort_keys(manifest, state)
    order = base.key_order(keys)
    x, c = base.ledger(manifest, state, alloc, self.budgets, order)
    c = base.greedy_scan(x, c, order, admit=False)
    num_clients = state.service_rows.shape[0]
    num_slots = manifest.num_slots
    # i32[C]: each client's provisional counter.
    prov = lifted_counters(manifest, state, self.own_state(state)) + self.running_charges(
        manifest, state, x, c)
    # Each client's candidates, in key order: queue[first[k]:last[k]].
    cand = (x.waiting | x.resume) & ~c.selected
    client = manifest.client
    own = cand & (client >= 0) & (client < num_clients)
    # Slots by (client, position in key order): the positions are distinct,
    # so the pairs pack into distinct i32 ``client * R + position`` and one
    # sort of that one array orders them (several arrays sort through a
    # comparator call per comparison on XLA:CPU: several times the work).
    position = base.inverse_permutation(order)
    group = jnp.where(own, client, num_clients)
    if (num_clients + 1) * num_slots <= base.INT32_MAX + 1:
      queue = order[jnp.sort(group * num_slots + position) % num_slots]
    else:
      queue = jnp.lexsort((position, group))
    count = jnp.zeros((num_clients,), jnp.int32).at[client].add(
        own.astype(jnp.int32), mode="drop")
    last = scan.cumsum_i32(count)
    head = last - count                  # i32[C]: each client's next candidate

    def admit_step(carry):
      c, prov, head, _ = carry
      has = head < last
      k = jnp.argmin(jnp.where(has, prov, base.INT32_MAX))
      s = queue[jnp.minimum(head[k], num_slots - 1)]
      fits, width = base.admission_fits(x, c, s)
      go = jnp.any(has) & fits

      def take(books):
        c, prov, head = books
        return (base.admit(x, c, s, width),
                prov.at[k].add(self.admission_charge(manifest, state, s, width)),
                head.at[k].add(1))

      c, prov, head = jax.lax.cond(go, take, lambda books: books, (c, prov, head))
      return c, prov, head, ~go

    c = jax.lax.while_loop(lambda carry: ~carry[3], admit_step,
                           (c, prov, head, jnp.bool_(False)))[0]
    return base.finish_plan(manifest, state, x, c, keys, order, self)

  def actual_charges(self, manifest, state, plan, result):
    """i32[C]: completed service to charge (paper: prompt at a published
    first admission, w_q per token a decode row emitted)."""
    num_clients = state.service_rows.shape[0]
    admitted = plan.admit & result.completed & (state.num_preemptions == 0)
    decode = result.completed & result.emitted & (plan.kind == rec.DECODE_ROW)
    return (_per_client(manifest, self.w_p * manifest.prompt_len, num_clients, admitted)
            + _per_client(manifest, jnp.full_like(manifest.client, self.w_q),
                          num_clients, decode))

  def update(self, manifest, state, plan, result, successor):
    own = self.own_state(state)
    counter = lifted_counters(manifest, state, own)
    charge = self.actual_charges(manifest, state, plan, result)
    counter = counter + charge
    before = active_clients(manifest, state)
    after = active_clients(manifest, successor)
    left = before & ~after
    last = jnp.where(jnp.any(left) & ~jnp.any(after),
                     jnp.max(jnp.where(left, counter, -base.INT32_MAX)),
                     own.last_left)
    return own.replace(counter=own.counter.replace(value=counter),
                       active=own.active.replace(value=after),
                       last_left=last.astype(jnp.int32),
                       done=own.done.replace(value=self.done_after(own, charge)))

  def done_after(self, own: VtcState, charge):
    """i32[C]: W_done after ``charge`` (plain VTC keeps none)."""
    del charge
    return own.done.value


@dataclasses.dataclass(frozen=True)
class VtcCompletionReconciled(Vtc):
  """Completion-reconciled VTC: provisional C_select, authoritative W_done.

  Charges are weighted interval rows: ``w_p`` per prefill row, ``w_q`` per
  decode row, 0 for rebuild rows.
  """

  policy_id: str = "vtc_completion_reconciled"
  version: str = "1"

  def admission_charge(self, manifest, state, s, width):
    del manifest
    return jnp.where(state.emitted[s] == 0, self.w_p * width, 0)

  def _interval_charges(self, manifest, state, plan_kind, rows, mask):
    num_clients = state.service_rows.shape[0]
    w = jnp.select([plan_kind == rec.PREFILL_CHUNK, plan_kind == rec.DECODE_ROW],
                   [self.w_p * rows, self.w_q * rows], 0)
    return _per_client(manifest, w, num_clients, mask)

  def running_charges(self, manifest, state, x, c):
    rows = c.end - state.computed
    kind = jnp.where(x.decode, rec.DECODE_ROW,
                     jnp.where(state.emitted == 0, rec.PREFILL_CHUNK, rec.REBUILD))
    return self._interval_charges(manifest, state, kind, rows, c.selected)

  def provisional_counters(self, manifest, state, plan):
    """i32[C]: C_select as the plan leaves it (lifted + predicted charges)."""
    return lifted_counters(manifest, state, self.own_state(state)) + self._interval_charges(
        manifest, state, plan.kind, plan.end - plan.start, plan.selected)

  def actual_charges(self, manifest, state, plan, result):
    return self._interval_charges(manifest, state, plan.kind, plan.end - plan.start,
                                  result.completed & plan.selected)

  def done_after(self, own, charge):
    return own.done.value + charge


# ------------------------------------------------------------------ prefix


@flax.struct.dataclass
class PrefixState:
  """PrefixAware's state (``SchedulerState.policy_state`` under ``prefix_aware``).

  Attributes:
    hot_streak: i32[], hot selections since the last cold one.
  """

  hot_streak: jax.Array


@dataclasses.dataclass(frozen=True)
class PrefixAware(base.PolicyBase):
  """Cache-hit groups with a hot:cold quota (§0x09A; not Preble's formula).

  Attributes:
    budgets: iteration budgets.
    hot_pct: a request is hot when its proven prefix hit is at least this
      percentage of its prompt (and non-zero).
    quota_hot: hot selections allowed before an eligible cold request goes
      first (2 gives a 2:1 cycle); 0 = reuse greedy (no quota).
  """

  budgets: base.Budgets
  hot_pct: int = 50
  quota_hot: int = 2
  policy_id: str = "prefix_aware"
  version: str = "1"
  tie_break: tuple = ("work_rank", "group_rank", "cold", "minus_hit_tokens",
                      "arrival_seq", "request_id", "generation")

  def init_state(self, num_slots, num_clients):
    del num_slots, num_clients
    return PrefixState(hot_streak=jnp.int32(0))

  def sort_keys(self, manifest, state, view=None):
    """Keys from the allocator's prefix-hit fact (zeros without a view)."""
    hits = (jnp.zeros_like(manifest.prompt_len) if view is None
            else rec.prefix_hits(view))
    hot = (hits > 0) & (hits * 100 >= self.hot_pct * manifest.prompt_len)
    cold = ~hot
    work = base.work_rank(manifest, state)
    # A cold prompt still to be computed, waiting or part-way through its
    # chunked prefill: hot arrivals must not starve either.
    live = (state.status == rec.WAITING) | (state.status == rec.RUNNING)
    prompt_left = live & (state.computed < rec.prefill_target(manifest, state))
    cold_waiting = jnp.any(cold & (work == 0) & prompt_left)
    streak = self.own_state(state).hot_streak
    favor_cold = (self.quota_hot > 0) & (streak >= self.quota_hot) & cold_waiting
    group = jnp.where(favor_cold, hot, cold).astype(jnp.int32)
    return base.identity_keys(manifest, state, work, group, cold.astype(jnp.int32),
                              -hits)

  def plan(self, manifest, state, alloc):
    keys = self.sort_keys(manifest, state, alloc)
    order = base.key_order(keys)
    x, c = base.ledger(manifest, state, alloc, self.budgets, order)
    c = base.greedy_scan(x, c, order, fcfs_break=False)
    return base.finish_plan(manifest, state, x, c, keys, order, self)

  def update(self, manifest, state, plan, result, successor):
    """hot_streak: 0 after a completed cold selection, else + hot ones."""
    served = result.completed & plan.selected
    cold = plan.sort_key[:, 2] == 1
    any_cold = jnp.any(served & cold)
    hot_n = jnp.sum(served & ~cold).astype(jnp.int32)
    streak = self.own_state(state).hot_streak
    return PrefixState(hot_streak=jnp.where(any_cold, 0, streak + hot_n).astype(jnp.int32))
