"""The shared ledger every policy of the library plans on (§0x05, §0x06, §0x0C).

A policy built on it (1) derives its recorded key (``scheduler.keys``),
(2) walks the key order, offering each slot to ``try_running`` /
``try_admit`` (``greedy_scan`` does the walk), which keep the token,
sequence and page ledgers, and (3) returns ``finish_plan``, whose packing
ranks follow the key order among the selected slots (so ``validate``'s
tie-break rule replays it). ``ledger`` opens the books as two records: a
``LedgerContext`` ``x`` the walk reads (``x.computed``, ``x.decode``) and a
``LedgerCarry`` ``c`` each offer returns anew (``c.replace(free=...)``).
``greedy_plan`` is the whole walk for a policy that only supplies a key.

Here too: the static ``Budgets``, the per-slot ``WorkFacts``, and
``PolicyBase`` (hidden-truth refusal; the policy-state contract of
``docs/writing-a-policy.md``).

One file: the books (``LedgerContext``, ``LedgerCarry``) and every offer
that moves them (running, admission, preemption, the decode-run window)
are one procedure whose invariants (free and reserved pages, the token and
sequence ledgers) hold only together; a carry field and each step that
changes it stay side by side.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from scheduler import admission as adm
from scheduler import records as rec
from scheduler import scan
from scheduler.keys import (identity_keys, inverse_permutation, key_order,  # noqa: F401
                            phase_rank, sort_keys, stable_partition, victim_rank)

INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Budgets:
  """Static iteration budgets (§0x05).

  Attributes:
    token_budget: max token rows per iteration (tau / max_num_batched_tokens).
    seq_budget: max request generations per iteration (max_num_seqs).
    chunk_cap: max prefill rows one request gets per iteration
      (long_prefill_token_threshold); >= 1.
    watermark_pages: pages kept free at admission while anything runs (W of
      the §0x06 soft ceiling C_hard - W).
    reservation: how admission reserves KV rows for the unknown output
      length (§0x06, ``scheduler.admission``): "policy" (each policy's own
      rule: ORCA the declared maximum, the others on demand), or "max",
      "point", "quantile", "watermark", which replace it for every policy.
      "watermark" is the quantile forecast under the soft ceiling and needs
      ``watermark_pages >= 1``; the other kinds keep whatever watermark is
      configured (0 = none, the hard ceiling).
    reservation_quantile: q of "quantile" / "watermark", in (0, 1].
  """

  token_budget: int
  seq_budget: int
  chunk_cap: int
  watermark_pages: int = 0
  reservation: str = "policy"
  reservation_quantile: float = 0.9

  def __post_init__(self):
    for name in ("token_budget", "seq_budget", "chunk_cap"):
      if getattr(self, name) < 1:
        raise ValueError(f"Budgets.{name} must be >= 1, got {getattr(self, name)}")
    if self.watermark_pages < 0:
      raise ValueError(f"Budgets.watermark_pages must be >= 0, got {self.watermark_pages}")
    check_reservation("Budgets", self.reservation, self.reservation_quantile,
                      self.watermark_pages)


def check_reservation(owner: str, kind: str, quantile: float, watermark_pages: int):
  """Raises ValueError naming ``owner``'s field unless the §0x06 reservation
  settings are legal (see ``Budgets.reservation``)."""
  if kind not in adm.ENGINE_KINDS:
    raise ValueError(f"{owner}.reservation must be one of {adm.ENGINE_KINDS}, got {kind!r}")
  if not 0.0 < quantile <= 1.0:
    raise ValueError(f"{owner}.reservation_quantile must be in (0, 1], got {quantile!r}")
  if kind == "watermark" and watermark_pages < 1:
    raise ValueError(f"{owner}.watermark_pages must be >= 1 with reservation "
                     f"'watermark' (W of the soft ceiling), got {watermark_pages}")


def _ceil_div(a, b):
  return (a + b - 1) // b


def _work_kind(manifest, state):
  return jnp.where(state.emitted == 0, rec.PREFILL_CHUNK, rec.REBUILD)


def greedy_plan(policy, manifest, state, alloc, keys):
  """The plan of one greedy walk in ``keys`` order (i32[R, K], the policy's
  recorded tie-break key) over the shared ledger under ``policy.budgets``,
  an FCFS break at the first waiting request that does not fit."""
  order = key_order(keys)
  x, c = ledger(manifest, state, alloc, policy.budgets, order)
  c = greedy_scan(x, c, order, fcfs_break=True)
  return finish_plan(manifest, state, x, c, keys, order, policy)


def refuse_hidden_truth(manifest: rec.WorkloadManifest) -> None:
  """Raises ValueError if the manifest still carries realized lengths (§0x06)."""
  if manifest.hidden_realized_output_tokens is not None:
    raise ValueError("policy input must be the online projection "
                     "(manifest.online()): hidden truth present")


def pages_for(rows, page_size: int):
  """Pages needed to hold ``rows`` token rows."""
  return _ceil_div(rows, page_size)


@flax.struct.dataclass
class WorkFacts:
  """Per-slot facts every policy reads (``work_facts``).

  Attributes:
    target: i32[R], where prefill-like work stops (``rec.prefill_target``).
    running: bool[R], RUNNING (ready or not).
    decode: bool[R], running, ready, at the ordinary decode frontier.
    partial: bool[R], running, ready, with prefill or rebuild rows left.
    waiting: bool[R], WAITING and ready, with prefill-like work left.
    resume: bool[R], WAITING and ready at the ordinary decode frontier: a
      request whose whole KV prefix was preserved across a preemption
      (§0x0C); it is re-admitted with a single decode row.
    work: bool[R], legal work now: ``decode | partial | waiting | resume``.
  """

  target: jax.Array
  running: jax.Array
  decode: jax.Array
  partial: jax.Array
  waiting: jax.Array
  resume: jax.Array
  work: jax.Array


def work_facts(manifest: rec.WorkloadManifest, state: rec.SchedulerState) -> WorkFacts:
  """The ``WorkFacts`` of every slot."""
  target = rec.prefill_target(manifest, state)
  running = state.status == rec.RUNNING
  at_decode = (state.emitted >= 1) & (
      state.computed == manifest.prompt_len + state.emitted - 1)
  decode = running & state.ready & at_decode
  partial = running & state.ready & (state.computed < target)
  waiting_ready = (state.status == rec.WAITING) & state.ready
  waiting = waiting_ready & (state.computed < target)
  resume = waiting_ready & at_decode
  return WorkFacts(target=target, running=running, decode=decode, partial=partial,
                   waiting=waiting, resume=resume,
                   work=decode | partial | waiting | resume)


def reservation_rows(manifest, state, budgets: Budgets, target, policy_rows):
  """i32[R]: KV rows a live request is promised (§0x06): ``policy_rows``
  under reservation "policy", else ``target + A_hat`` with G_hat from
  ``admission.forecast_outputs`` (online facts only) and A_hat from
  ``admission.append_rows`` with U = 0 at the prefill ``target``. An
  unstarted request of prompt p so reserves ``p + G_hat - 1`` rows; one
  that has emitted E >= G_hat reserves only its frontier (its next row is
  an extension). G_hat is re-read at every decision, so a running
  request's reservation follows the estimator as completions arrive."""
  if budgets.reservation == "policy":
    return policy_rows
  g_hat = adm.forecast_outputs(
      "quantile" if budgets.reservation == "watermark" else budgets.reservation,
      manifest.max_tokens, state.completed_outputs, budgets.reservation_quantile)
  return target + adm.append_rows(0, state.emitted, g_hat)


@flax.struct.dataclass
class LedgerContext(WorkFacts):
  """What a policy's walk reads and never writes (``ledger``): the slots'
  ``WorkFacts`` fields, and

  Attributes:
    held: i32[R], pages each slot holds (``alloc.pages_held``).
    reclaim: i32[R], pages a preemption of the slot returns to the free
      pool (``alloc.reclaimable_pages``, else ``held``).
    own: i32[R], pages a running slot is promised and does not hold yet
      (``need_total`` of running slots, 0 elsewhere); the carry's
      ``reserved`` starts as their sum.
    need_total: i32[R], pages the slot's reservation (``reserve_rows``) needs
      beyond those it holds.
    reserved_pages: i32[R], pages covering the slot's reservation; a decode
      row whose page lies past them is an extension (``take_running``).
    decode_need: i32[R], pages a running decode row needs for its next row
      (0 for other slots).
    computed: i32[R], the computed frontier (``state.computed``).
    victim_order: i32[R], slots, the running ones first, each part in
      ascending ``vrank``; recompute victims come off its running part from
      the end (the carry's ``tail``).
    pos: i32[R], each slot's position in ``victim_order``.
    vrank: i32[R], the recompute-victim rank (``victim_rank``): a larger
      rank is evicted first.
    ps: static, token rows per page.
    budgets: static, the iteration ``Budgets``.
    chunk_cap: static, rows one prefill-like interval may take.
    whole_prefill: static, a prefill-like interval takes the whole remaining
      prompt or nothing (no chunking).
    max_prefills: static, cap on prefill-like intervals per plan, or None.
  """

  held: jax.Array
  reclaim: jax.Array
  own: jax.Array
  need_total: jax.Array
  reserved_pages: jax.Array
  decode_need: jax.Array
  computed: jax.Array
  victim_order: jax.Array
  pos: jax.Array
  vrank: jax.Array
  ps: int = flax.struct.field(pytree_node=False)
  budgets: Budgets = flax.struct.field(pytree_node=False)
  chunk_cap: int = flax.struct.field(pytree_node=False)
  whole_prefill: bool = flax.struct.field(pytree_node=False)
  max_prefills: Optional[int] = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class LedgerCarry:
  """The books a policy's walk keeps: each offer returns a new carry
  (``c.replace(...)``), and ``finish_plan`` reads the last.

  Attributes:
    free: i32[], free pages left (preemptions return theirs).
    reserved: i32[], pages promised to live requests and not taken yet.
    tok: i32[], token rows taken (against ``budgets.token_budget``).
    seq: i32[], sequences taken (against ``budgets.seq_budget``).
    prefills: i32[], prefill-like intervals taken (against ``max_prefills``).
    tail: i32[], ``victim_order[:tail]`` are the running slots a decode row
      may still preempt; the next victim is ``victim_order[tail - 1]``.
    live: bool[], some request runs or was admitted (the watermark holds).
    blocked: bool[], a waiting request did not fit under an FCFS ``break``.
    evicted_best: i32[], the least ``vrank`` preempted (INT32_MAX if none):
      no request ranking after it is admitted.
    decode_need: i32[], pages still held back for the running decode rows
      not yet taken or preempted.
    selected: bool[R], slots the plan runs.
    admit: bool[R], admission intents.
    preempt: bool[R], recompute-preemption intents.
    extend: bool[R], §0x06 extension intents (``IterationPlan.extend``).
    end: i32[R], each slot's planned frontier (``computed`` unless selected).
    alloc_now: i32[R], pages each selected slot takes now.
  """

  free: jax.Array
  reserved: jax.Array
  tok: jax.Array
  seq: jax.Array
  prefills: jax.Array
  tail: jax.Array
  live: jax.Array
  blocked: jax.Array
  evicted_best: jax.Array
  decode_need: jax.Array
  selected: jax.Array
  admit: jax.Array
  preempt: jax.Array
  extend: jax.Array
  end: jax.Array
  alloc_now: jax.Array


def ledger(manifest, state, alloc, budgets: Budgets, order, *,
           reserve_rows=None, chunk_cap=None, whole_prefill=False,
           max_prefills=None):
  """(LedgerContext, LedgerCarry) for ``try_running`` / ``try_admit`` /
  ``finish_plan``.

  Args:
    order: i32[R], the policy's key order (the walk over the slots).
      Recompute-preemption victims of a decode row that finds no page are
      taken by ``victim_rank`` instead, the latest (priority, arrival)
      first, whatever the policy's walk order.
    reserve_rows: i32[R] rows a live request is promised at admission
      (default: its prefill target; ORCA: prompt + max_tokens - 1), unless
      ``budgets.reservation`` replaces it (``reservation_rows``). Pages for
      them are reserved until used, so later admissions cannot take them.
    chunk_cap: static rows one prefill-like interval may take (default
      ``budgets.chunk_cap``); ``whole_prefill`` requires the whole remaining
      prompt in one interval (no chunking).
    max_prefills: static cap on prefill-like intervals per plan (SARATHI's
      one anchor chunk), or None.
  """
  f = work_facts(manifest, state)
  ps = alloc.page_size
  held = alloc.pages_held.astype(jnp.int32)
  reserve_rows = reservation_rows(manifest, state, budgets, f.target,
                                  f.target if reserve_rows is None else reserve_rows)
  # A resumed decoder needs pages for its next row as well.
  reserve_rows = jnp.where(f.resume, jnp.maximum(reserve_rows, state.computed + 1),
                           reserve_rows)
  need_total = jnp.maximum(pages_for(reserve_rows, ps) - held, 0)
  own = jnp.where(f.running, need_total, 0)
  # Pages each running decode row needs for its next row: held back from
  # admissions and prefill chunks walked before it, so that a policy whose
  # walk puts prefill work first never makes an earlier decoder a victim.
  decode_need = jnp.where(f.decode, jnp.maximum(
      pages_for(state.computed + 1, ps) - held, 0), 0)
  # Running slots first, each part by victim rank (a partition, not a sort).
  vrank = victim_rank(manifest)
  victim_order, _ = stable_partition(inverse_permutation(vrank), f.running)
  reclaim = (held if alloc.reclaimable_pages is None
             else alloc.reclaimable_pages.astype(jnp.int32))
  x = LedgerContext(
      **{k.name: getattr(f, k.name) for k in dataclasses.fields(WorkFacts)},
      held=held, reclaim=reclaim, own=own, need_total=need_total,
      reserved_pages=pages_for(reserve_rows, ps), decode_need=decode_need,
      computed=state.computed, victim_order=victim_order,
      pos=inverse_permutation(victim_order), vrank=vrank,
      ps=ps, budgets=budgets,
      chunk_cap=budgets.chunk_cap if chunk_cap is None else chunk_cap,
      whole_prefill=whole_prefill, max_prefills=max_prefills)
  num_slots = manifest.num_slots
  c = LedgerCarry(
      free=alloc.free_pages.astype(jnp.int32), reserved=jnp.sum(own),
      tok=jnp.int32(0), seq=jnp.int32(0), prefills=jnp.int32(0),
      tail=jnp.sum(f.running).astype(jnp.int32),
      live=jnp.any(f.running), blocked=jnp.bool_(False),
      evicted_best=jnp.int32(INT32_MAX), decode_need=jnp.sum(decode_need),
      selected=jnp.zeros((num_slots,), bool), admit=jnp.zeros((num_slots,), bool),
      preempt=jnp.zeros((num_slots,), bool), extend=jnp.zeros((num_slots,), bool),
      end=state.computed,
      alloc_now=jnp.zeros((num_slots,), jnp.int32))
  return x, c


def _take(x: LedgerContext, c: LedgerCarry, s, end, need) -> LedgerCarry:
  return c.replace(
      selected=c.selected.at[s].set(True),
      end=c.end.at[s].set(end),
      alloc_now=c.alloc_now.at[s].set(need),
      free=c.free - need,
      tok=c.tok + (end - x.computed[s]),
      seq=c.seq + 1,
      prefills=c.prefills + (~(x.decode[s] | x.resume[s])).astype(jnp.int32),
      decode_need=c.decode_need - x.decode_need[s])


def take_running(x: LedgerContext, c: LedgerCarry, s, end, need) -> LedgerCarry:
  """Takes running slot ``s`` up to ``end`` with ``need`` new pages: they
  come out of its own reservation first; a decode row whose page lies past
  the reserved frontier is a §0x06 extension (``IterationPlan.extend``)."""
  c = _take(x, c, s, end, need)
  return c.replace(
      reserved=c.reserved - jnp.minimum(need, x.own[s]),
      extend=c.extend.at[s].set(
          x.decode[s] & (need > 0) & (pages_for(end, x.ps) > x.reserved_pages[s])))


def preempt_slot(x: LedgerContext, c: LedgerCarry, v) -> LedgerCarry:
  """Recompute-preempts running slot ``v``: its reclaimable pages (those no
  other page table shares) and its reservation return."""
  return c.replace(
      preempt=c.preempt.at[v].set(True),
      free=c.free + x.reclaim[v],
      reserved=c.reserved - x.own[v],
      evicted_best=jnp.minimum(c.evicted_best, x.vrank[v]),
      decode_need=c.decode_need - jnp.where(c.selected[v], 0, x.decode_need[v]))


def _prefill_room(x: LedgerContext, c: LedgerCarry):
  ok = c.seq < x.budgets.seq_budget
  if x.max_prefills is not None:
    ok = ok & (c.prefills < x.max_prefills)
  return ok


def _prefill_width(x: LedgerContext, s, room):
  rem = x.target[s] - x.computed[s]
  if x.whole_prefill:
    return jnp.where(rem <= room, rem, 0)
  return jnp.minimum(jnp.minimum(rem, x.chunk_cap), room)


def try_running(x: LedgerContext, c: LedgerCarry, s, preempt_victims=True) -> LedgerCarry:
  """Offers running slot ``s`` its next interval; returns the new carry.

  A decode row that finds no page preempts running victims from the tail of
  the policy order (never one before ``s``), else ``s`` itself (§0x0C,
  recompute). A running prefill/rebuild chunk is cut to the free pages.
  """
  b = x.budgets
  live = ~c.preempt[s] & ~c.selected[s]
  avail = c.free - (c.reserved - x.own[s]) - c.decode_need
  held, comp = x.held[s], x.computed[s]

  def decode(c):
    need = jnp.maximum(pages_for(comp + 1, x.ps) - held, 0)

    def cond(c):
      v = x.victim_order[jnp.maximum(c.tail - 1, 0)]
      short = need > c.free - (c.reserved - x.own[s])
      return short & (c.tail - 1 > x.pos[s]) & ~c.selected[v]

    def body(c):
      c = preempt_slot(x, c, x.victim_order[c.tail - 1])
      return c.replace(tail=c.tail - 1)

    if preempt_victims:
      c = jax.lax.while_loop(cond, body, c)
    short = need > c.free - (c.reserved - x.own[s])

    def self_preempt(c):
      c = preempt_slot(x, c, s)
      return c.replace(tail=jnp.minimum(c.tail, x.pos[s]))

    return jax.lax.cond(short, self_preempt,
                        lambda c: take_running(x, c, s, comp + 1, need), c)

  def partial(c):
    room = b.token_budget - c.tok
    by_pages = (held + avail) * x.ps - comp
    width = jnp.minimum(_prefill_width(x, s, room), by_pages)
    if x.whole_prefill:
      width = jnp.where(width == x.target[s] - comp, width, 0)
    end = comp + jnp.maximum(width, 0)
    need = jnp.maximum(pages_for(end, x.ps) - held, 0)

    return jax.lax.cond((width > 0) & _prefill_room(x, c),
                        lambda c: take_running(x, c, s, end, need), lambda c: c, c)

  fits_decode = (c.tok < b.token_budget) & (c.seq < b.seq_budget)
  c = jax.lax.cond(live & x.decode[s] & fits_decode, decode, lambda c: c, c)
  return jax.lax.cond(live & x.partial[s], partial, lambda c: c, c)


def admission_width(x: LedgerContext, s, room):
  """Rows waiting slot ``s`` takes at admission within ``room`` rows: one
  decode row for a resumed decoder (``resume``), else its prefill width."""
  return jnp.where(x.resume[s], jnp.minimum(room, 1), _prefill_width(x, s, room))


def admission_fits(x: LedgerContext, c: LedgerCarry, s):
  """(bool, width): waiting slot ``s`` fits the token / sequence budgets
  and the pages left after reservations and the watermark. A resumed
  decoder (``resume``) takes one decode row and no prefill slot."""
  b = x.budgets
  resume = x.resume[s]
  width = admission_width(x, s, b.token_budget - c.tok)
  slot_ok = jnp.where(resume, c.seq < b.seq_budget, _prefill_room(x, c))
  watermark = jnp.where(c.live, b.watermark_pages, 0)
  # §0x06: R + A_hat <= C_hard - W in pages, with the committed pages taken
  # off both sides (the hard ceiling is what is free).
  pages_ok = adm.admits(c.reserved + c.decode_need, x.need_total[s],
                        adm.soft_ceiling(c.free, watermark))
  # Never admit a request that ranks after one this plan evicted: the
  # victim rule would have evicted it first (no thrash of an earlier
  # arrival in favour of a later one).
  not_behind_victim = x.vrank[s] < c.evicted_best
  return ((x.waiting[s] | resume) & (width > 0) & slot_ok & pages_ok
          & not_behind_victim, width)


def admit(x: LedgerContext, c: LedgerCarry, s, width) -> LedgerCarry:
  """Takes waiting slot ``s`` with ``width`` rows and an admission intent."""
  comp = x.computed[s]
  need = jnp.maximum(pages_for(comp + width, x.ps) - x.held[s], 0)
  c = _take(x, c, s, comp + width, need)
  return c.replace(admit=c.admit.at[s].set(True),
                   reserved=c.reserved + jnp.maximum(x.need_total[s] - need, 0),
                   live=jnp.bool_(True))


def try_admit(x: LedgerContext, c: LedgerCarry, s, fcfs_break=True) -> LedgerCarry:
  """Offers waiting slot ``s`` admission; with ``fcfs_break`` a waiting slot
  that does not fit blocks every later one (ORCA's ``break``). A resumed
  decoder (``resume``) is neither blocked by nor blocks a waiting prompt."""
  fits, width = admission_fits(x, c, s)
  resume = x.resume[s]
  is_waiting = (x.waiting[s] | resume) & ~c.selected[s]
  go = is_waiting & fits
  if fcfs_break:
    go = go & (~c.blocked | resume)
    c = c.replace(blocked=c.blocked | (is_waiting & ~resume & ~fits))
  return jax.lax.cond(go, lambda c: admit(x, c, s, width), lambda c: c, c)


def budgets_left(x: LedgerContext, c: LedgerCarry):
  """bool[]: the plan can still take a row: a sequence and a token row are
  left. Every offer needs both (a decode row, a prefill or rebuild chunk,
  an admission), and neither ledger shrinks inside a greedy walk, so once
  this is False every later offer changes nothing and the walk may stop."""
  b = x.budgets
  return (c.seq < b.seq_budget) & (c.tok < b.token_budget)


def greedy_scan(x: LedgerContext, c: LedgerCarry, order, fcfs_break=True,
                preempt_victims=True, admit=True) -> LedgerCarry:
  """One pass over ``order``: running slots via ``try_running``, waiting
  slots via ``try_admit`` (only running slots when ``admit`` is False).

  A slot with no work (not decoding, not mid-prefill, not waiting, not a
  resumed decoder) changes nothing when offered: both offers are guarded by
  those flags. So the pass walks only the slots with work, in ``order``'s
  order (a stable partition of ``order``), skips the slots no offer can
  take any more (waiting prompts behind an FCFS ``break``, prefill work once
  ``max_prefills`` is spent), and stops once the sequence or token budget
  is spent (``budgets_left``): each trip is several small XLA:CPU thunks,
  and the policy's two calls in an iteration then took 27 ms at R = 128
  with one live request on a loaded 2-core machine (docs/benchmarks-log.md "The
  one-request decode step"). A trip that meets a decode row takes the run
  of decode rows from there (``take_decode_run``, up to ``DECODE_RUN`` rows
  at once, the same carry as offering them one by one), so a batch of 128
  decoders costs four trips, not 128. Each trip is O(1) in R, so the pass
  is O(R).
  """
  work = x.decode | x.partial
  if admit:
    work = work | x.waiting | x.resume
  walk, count = stable_partition(order, work)
  # Skips that change nothing: with the prefill slots spent (``max_prefills``)
  # only decode rows and resumed decoders can still be taken; behind an FCFS
  # ``break`` no waiting prompt can. next_*[i]: the first walk position >= i
  # of that kind (``count`` if none).
  position = jnp.arange(walk.shape[0] + 1, dtype=jnp.int32)

  def next_of(kind):
    here = jnp.concatenate([kind[walk], jnp.zeros((1,), bool)]) & (position < count)
    return scan.suffix_min_i32(jnp.where(here, position, count))

  next_decode = next_of(x.decode | x.resume)
  next_running = next_of(x.decode | x.resume | x.partial)

  def cond(carry):
    i, c = carry
    return (i < count) & budgets_left(x, c)

  def skip(nxt, c):
    if admit and fcfs_break:
      nxt = jnp.where(c.blocked, next_running[nxt], nxt)
    if x.max_prefills is not None:
      nxt = jnp.where(c.prefills >= x.max_prefills, next_decode[nxt], nxt)
    return nxt

  def one(carry):
    i, c = carry
    s = walk[i]
    c = try_running(x, c, s, preempt_victims)
    if admit:
      c = try_admit(x, c, s, fcfs_break)
    return skip(i + 1, c), c

  def run(carry):
    i, c = carry
    k, c = take_decode_run(x, c, walk, i, count)
    return jax.lax.cond(k > 0, lambda _: (skip(i + k, c), c), one, carry)

  def step(carry):
    i, _ = carry
    return jax.lax.cond(x.decode[walk[i]], run, one, carry)

  return jax.lax.while_loop(cond, step, (jnp.int32(0), c))[1]


# Decode rows ``take_decode_run`` takes in one step at most: a fixed window,
# so a walk step stays O(1) in the slots (tests/scheduler/test_planning_cost).
DECODE_RUN = 32


def take_decode_run(x: LedgerContext, c: LedgerCarry, walk, i, count):
  """(k, carry): the longest run of decode rows at ``walk[i:count]``, at
  most ``DECODE_RUN`` of them, that
  ``try_running`` would each take without a preemption, taken in one
  vectorised step; the carry is the one ``k`` offers in turn would leave.

  A decode row takes one token row, one sequence and its ``decode_need``
  pages, first out of its own reservation; it is taken while the token and
  sequence budgets have room and its pages fit what is free beyond the
  other slots' reservations (``try_running``'s ``short`` test). The run
  stops at the first row that is not a live decode row or does not fit,
  where the walk offers that slot on its own (a preemption, a prefill, an
  admission). One step of ``DECODE_RUN`` lanes instead of a few XLA:CPU
  thunks per row.
  """
  b = x.budgets
  n = walk.shape[0]
  j = jnp.arange(min(DECODE_RUN, n), dtype=jnp.int32)
  s = walk[jnp.minimum(i + j, n - 1)]
  need = x.decode_need[s]
  own = x.own[s]
  from_own = jnp.minimum(need, own)
  free = c.free - (scan.cumsum_i32(need) - need)
  reserved = c.reserved - (scan.cumsum_i32(from_own) - from_own)
  ok = ((i + j < count) & x.decode[s] & ~c.preempt[s] & ~c.selected[s]
        & (c.tok + j < b.token_budget) & (c.seq + j < b.seq_budget)
        & (need <= free - (reserved - own)))
  take = jnp.cumprod(ok.astype(jnp.int32)).astype(bool)
  k = jnp.sum(take, dtype=jnp.int32)
  dest = jnp.where(take, s, n)
  end = x.computed[s] + 1
  need_taken = jnp.sum(jnp.where(take, need, 0))
  return k, c.replace(
      selected=c.selected.at[dest].set(True, mode="drop"),
      end=c.end.at[dest].set(end, mode="drop"),
      alloc_now=c.alloc_now.at[dest].set(need, mode="drop"),
      extend=c.extend.at[dest].set(
          (need > 0) & (pages_for(end, x.ps) > x.reserved_pages[s]), mode="drop"),
      free=c.free - need_taken,
      reserved=c.reserved - jnp.sum(jnp.where(take, from_own, 0)),
      tok=c.tok + k,
      seq=c.seq + k,
      decode_need=c.decode_need - need_taken)


def finish_plan(manifest, state, x: LedgerContext, c: LedgerCarry, keys, order, policy,
                unschedulable=None) -> rec.IterationPlan:
  """The IterationPlan of a finished ledger; ranks follow ``order``."""
  selected = c.selected
  in_order = selected[order]
  rank = jnp.full(selected.shape, -1, jnp.int32).at[order].set(
      jnp.where(in_order, scan.cumsum_i32(in_order) - 1, -1))
  computed = state.computed
  decode = x.decode | x.resume
  kind = jnp.where(decode, rec.DECODE_ROW, _work_kind(manifest, state))
  b = policy.budgets
  return rec.IterationPlan(
      decision_id=state.decision_id,
      input_state_version=state.state_version,
      selected=selected,
      generation=state.generation,
      snapshot_version=state.snapshot_version,
      start=jnp.where(selected, computed, 0),
      end=jnp.where(selected, c.end, 0),
      kind=jnp.where(selected, kind, rec.NO_WORK).astype(jnp.int32),
      rank=rank,
      admit=c.admit,
      preempt=c.preempt,
      sort_key=keys,
      num_tokens=jnp.sum(jnp.where(selected, c.end - computed, 0)).astype(jnp.int32),
      num_seqs=jnp.sum(selected).astype(jnp.int32),
      policy_id=policy.policy_id,
      policy_version=policy.version,
      token_budget=b.token_budget,
      seq_budget=b.seq_budget,
      unschedulable=unschedulable,
      policy=policy,
      extend=c.extend)


def work_rank(manifest, state):
  """i32[R]: 0 where the slot has legal work now, 1 otherwise."""
  return jnp.where(work_facts(manifest, state).work, 0, 1).astype(jnp.int32)


class PolicyBase:
  """``__call__`` refuses hidden truth, then runs ``plan``.

  A policy with state of its own (``docs/writing-a-policy.md``) overrides
  ``init_state`` and adds ``update(manifest, state, plan, result,
  successor) -> its new state``, which ``scheduler.apply.apply`` calls with
  the completed result; ``plan`` reads the state through ``own_state`` and
  writes nothing.
  """

  def __call__(self, manifest: rec.WorkloadManifest, state: rec.SchedulerState,
               alloc: rec.AllocatorView) -> rec.IterationPlan:
    refuse_hidden_truth(manifest)
    return self.plan(manifest, state, alloc)

  def init_state(self, num_slots: int, num_clients: int):
    """The policy's state before any decision (a pytree; None: no state)."""
    del num_slots, num_clients
    return None

  def own_state(self, state: rec.SchedulerState):
    """``state.policy_state``, or ``init_state``'s for a state built
    without it (a hand-built fixture: ``records.initial_state`` without
    ``policy``)."""
    if state.policy_state is not None:
      return state.policy_state
    return self.init_state(state.status.shape[0], state.service_rows.shape[0])
