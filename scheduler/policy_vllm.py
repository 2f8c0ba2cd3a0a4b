"""vLLM V1 scheduler shape at tag v0.23.0 (§0x09, §0x0D). Not a vLLM replay.

There is no prefill or decode phase: every request has a computed frontier
and a target, and the scheduler assigns rows so the former catches up:

1. Running pass, in running-queue order: ``num_new = min(target - computed,
   long_prefill_token_threshold (= Budgets.chunk_cap), token budget left)``;
   a request with nothing to add is skipped. Its pages are allocated on
   demand (only for the rows scheduled now). When they do not fit, a victim
   is recompute-preempted until they do: the tail of the running queue in
   FCFS mode, ``max(priority, arrival)`` in PRIORITY mode (a victim already
   scheduled this step gives its rows and budget back). If the victim is
   the request itself, the running pass stops.
2. Waiting pass, only if step 1 preempted nothing: waiting requests in queue
   order (FCFS: arrival; PRIORITY: priority, then arrival) are admitted with
   the same clamp while sequences, budget and pages last; the first that
   does not fit stops the pass.

Running-queue order is modelled by arrival order, and a preempted request
returns to the waiting queue at its arrival position (the source prepends
it, which coincides when it is the oldest waiting request).

One deliberate departure from the source, the readmission guard: a
recompute victim (``num_preemptions > 0``) waiting to rebuild is readmitted
only when the pages for its whole rebuild and next row fit, plus one page
for each request scheduled in this step whose next row starts a page. The
source readmits it as soon as its next chunk fits, and the peer's next page
pushes it out again: two requests that cannot both finish in a 12-page
cache preempted one of them 4 times, and a 17-page cache 10 times, where
the guard gives 1 (``scheduler.conformance.HARD_CASES[0]``,
``preemption_thrash``). Requests never preempted are admitted exactly as
in the source.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from scheduler import admission as adm
from scheduler import ledger as base
from scheduler import records as rec

MODES = ("fcfs", "priority")


@dataclasses.dataclass(frozen=True)
class VllmV1(base.PolicyBase):
  """Running-then-waiting frontier catch-up with recompute preemption.

  Attributes:
    budgets: ``token_budget`` = max_num_scheduled_tokens, ``seq_budget`` =
      max_num_seqs, ``chunk_cap`` = long_prefill_token_threshold,
      ``watermark_pages`` kept free at waiting admission.
    mode: "fcfs" or "priority" (lower priority value runs first).
  """

  budgets: base.Budgets
  mode: str = "fcfs"
  policy_id: str = "vllm_v1"
  version: str = "v0.23.0-shape-2"
  tie_break: tuple = ("queue_rank", "waiting_priority", "arrival_seq",
                      "request_id", "generation")

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"VllmV1.mode must be one of {MODES}, got {self.mode!r}")

  def sort_keys(self, manifest, state, view=None):
    """i32[R, 5]: queue_rank (0 running, 1 waiting, 2 other), priority of
    waiting requests in PRIORITY mode (else 0), arrival, id, generation."""
    queue = jnp.select([state.status == rec.RUNNING, state.status == rec.WAITING],
                       [0, 1], 2)
    prio = jnp.where((state.status == rec.WAITING) & (self.mode == "priority"),
                     manifest.priority, 0)
    return base.identity_keys(manifest, state, queue, prio)

  def victim_order(self, manifest, state, order):
    """i32[R]: slots, first preempted first: descending position in the
    running queue (``order``) in FCFS mode, descending ``(priority,
    arrival, id)`` in PRIORITY mode."""
    if self.mode == "fcfs":
      return order[::-1]                               # tail of running queue
    return base.key_order(jnp.stack(
        [manifest.priority, manifest.arrival_seq, manifest.request_id], axis=1))[::-1]

  def plan(self, manifest, state, alloc):
    """The two passes walk only their own slots (running and ready;
    waiting or resumed), in ``order``, and each stops at its first ``stop``
    (or once the budgets are spent); victims come off one precomputed list
    by a pointer. Every trip is O(1), the plan O(R log R) (the sorts)."""
    b = self.budgets
    keys = self.sort_keys(manifest, state)
    order = base.key_order(keys)
    x, c = base.ledger(manifest, state, alloc, b, order,
                       reserve_rows=state.computed)      # demand paging
    # Each preemption takes the running, unpreempted slot of largest victim
    # rank; only this pass preempts, so the preempted slots are always the
    # first ``num_preempted`` of the running slots in victim order.
    victims, num_running = base.stable_partition(
        self.victim_order(manifest, state, order), x.running)
    comp, held, ps = x.computed, x.held, x.ps
    catchup = jnp.where(x.decode, 1, x.target - comp)

    def unschedule(c, v):
      was = c.selected[v]
      return c.replace(
          tok=c.tok - jnp.where(was, c.end[v] - comp[v], 0),
          seq=c.seq - was.astype(jnp.int32),
          free=c.free + jnp.where(was, c.alloc_now[v], 0),
          reserved=c.reserved + jnp.where(
              was, jnp.minimum(c.alloc_now[v], x.own[v]), 0),
          extend=c.extend.at[v].set(False),
          selected=c.selected.at[v].set(False),
          end=c.end.at[v].set(comp[v]),
          alloc_now=c.alloc_now.at[v].set(0))

    def running_step(carry):
      # stop: bool[], the pass preempted its own request; num_preempted: i32[].
      i, c, stop, num_preempted = carry
      s = running[i]
      active = ~c.preempt[s]
      num_new = jnp.minimum(jnp.minimum(catchup[s], b.chunk_cap),
                            b.token_budget - c.tok)
      go = active & (num_new > 0) & (c.seq < b.seq_budget)
      need = jnp.maximum(base.pages_for(comp[s] + num_new, ps) - held[s], 0)

      def allocate(books):
        # Pages other requests reserved (§0x06 reservation kinds; none on
        # demand) are not this request's to take.
        def cond(books):
          c, num_preempted = books
          return ((need > c.free - (c.reserved - x.own[s])) & ~c.preempt[s]
                  & (num_preempted < num_running))

        def body(books):
          c, num_preempted = books
          v = victims[num_preempted]
          c = unschedule(c, v)
          return base.preempt_slot(x, c, v), num_preempted + 1

        c, num_preempted = jax.lax.while_loop(cond, body, books)
        self_preempted = c.preempt[s]

        def take(c):
          return base.take_running(x, c, s, comp[s] + num_new, need)

        c = jax.lax.cond(self_preempted, lambda c: c, take, c)
        return c, stop | self_preempted, num_preempted

      c, stop, num_preempted = jax.lax.cond(
          go, allocate, lambda books: (books[0], stop, books[1]), (c, num_preempted))
      return i + 1, c, stop, num_preempted

    # A slot not running and ready changes nothing; nor does any once the
    # pass stopped or a sequence or token row is no longer left (``unschedule``
    # gives rows back only inside a step that could take its own).
    running, num_walk = base.stable_partition(order, x.running & state.ready)
    c = jax.lax.while_loop(
        lambda carry: (carry[0] < num_walk) & ~carry[2] & base.budgets_left(x, carry[1]),
        running_step, (jnp.int32(0), c, jnp.bool_(False), jnp.int32(0)))[1]

    def waiting_step(carry):
      # stop: bool[], the request offered last did not fit.
      i, c, _ = carry
      s = waiting[i]
      num_new = base.admission_width(x, s, b.token_budget - c.tok)
      need = jnp.maximum(base.pages_for(comp[s] + num_new, ps) - held[s], 0)
      # A recompute victim comes back only when its whole rebuild fits
      # beside the running requests' next rows (not in vLLM; see the module
      # docstring).
      forecast = jnp.where(rebuild[s], jnp.maximum(rebuild_pages[s], x.need_total[s])
                           + growth, x.need_total[s])
      watermark = jnp.where(c.live, b.watermark_pages, 0)
      # §0x06: R + A_hat <= C_soft in pages (A_hat = the rows now on demand,
      # or the reservation kind's forecast when larger).
      fits = ((c.seq < b.seq_budget) & (num_new > 0)
              & adm.admits(c.reserved, jnp.maximum(need, forecast),
                           adm.soft_ceiling(c.free, watermark)))
      c = jax.lax.cond(fits, lambda c: base.admit(x, c, s, num_new), lambda c: c, c)
      return i + 1, c, ~fits

    # The readmission guard's facts, read after the running pass: the pages
    # a recompute victim's rebuild (and its next row) needs, and one page for
    # each request scheduled now whose next row starts a page.
    rebuild = (state.num_preemptions > 0) & x.waiting
    # (A cached prefix is no discount: its pages count among the free ones.)
    rebuild_pages = jnp.maximum(base.pages_for(x.target + 1, ps) - held, 0)
    growth = jnp.sum(c.selected & (c.end % ps == 0)).astype(jnp.int32)
    # Waiting and resumed slots in queue order, up to the first that does
    # not fit (the others change nothing).
    waiting, num_waiting = base.stable_partition(order, x.waiting | x.resume)
    c = jax.lax.cond(
        jnp.any(c.preempt), lambda c: c,
        lambda c: jax.lax.while_loop(lambda carry: (carry[0] < num_waiting) & ~carry[2],
                                     waiting_step, (jnp.int32(0), c, jnp.bool_(False)))[1],
        c)
    return base.finish_plan(manifest, state, x, c, keys, order, self)
