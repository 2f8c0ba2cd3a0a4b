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
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from scheduler import admission as adm
from scheduler import policies as base
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
  version: str = "v0.23.0-shape-1"
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

  def victim_rank(self, manifest, state, order):
    """i32[R]: larger = preempted first among running requests."""
    if self.mode == "fcfs":
      return base.inverse_permutation(order)           # tail of running queue
    return base.inverse_permutation(base.key_order(jnp.stack(
        [manifest.priority, manifest.arrival_seq, manifest.request_id], axis=1)))

  def plan(self, manifest, state, alloc):
    b = self.budgets
    keys = self.sort_keys(manifest, state)
    order = base.key_order(keys)
    x, c = base.ledger(manifest, state, alloc, b, order,
                       reserve_rows=state.computed)      # demand paging
    vrank = self.victim_rank(manifest, state, order)
    comp, held, ps = x["computed"], x["held"], x["ps"]
    catchup = jnp.where(x["decode"], 1, x["target"] - comp)
    c["stop"] = jnp.bool_(False)

    def unschedule(c, v):
      c = dict(c)
      was = c["selected"][v]
      c["tok"] = c["tok"] - jnp.where(was, c["end"][v] - comp[v], 0)
      c["seq"] = c["seq"] - was.astype(jnp.int32)
      c["free"] = c["free"] + jnp.where(was, c["alloc_now"][v], 0)
      c["reserved"] = c["reserved"] + jnp.where(
          was, jnp.minimum(c["alloc_now"][v], x["own"][v]), 0)
      c["extend"] = c["extend"].at[v].set(False)
      c["selected"] = c["selected"].at[v].set(False)
      c["end"] = c["end"].at[v].set(comp[v])
      c["alloc_now"] = c["alloc_now"].at[v].set(0)
      return c

    def running_step(c, s):
      active = x["running"][s] & state.ready[s] & ~c["preempt"][s] & ~c["stop"]
      num_new = jnp.minimum(jnp.minimum(catchup[s], b.chunk_cap),
                            b.token_budget - c["tok"])
      go = active & (num_new > 0) & (c["seq"] < b.seq_budget)
      need = jnp.maximum(base.pages_for(comp[s] + num_new, ps) - held[s], 0)

      def allocate(c):
        # Pages other requests reserved (§0x06 reservation kinds; none on
        # demand) are not this request's to take.
        def cond(c):
          cands = x["running"] & ~c["preempt"]
          return ((need > c["free"] - (c["reserved"] - x["own"][s])) & ~c["preempt"][s]
                  & jnp.any(cands))

        def body(c):
          cands = x["running"] & ~c["preempt"]
          v = jnp.argmax(jnp.where(cands, vrank, -1))
          c = unschedule(c, v)
          return base.preempt_slot(x, c, v)

        c = jax.lax.while_loop(cond, body, c)
        self_preempted = c["preempt"][s]

        def take(c):
          return base.take_running(x, c, s, comp[s] + num_new, need)

        def stop(c):
          c = dict(c)
          c["stop"] = jnp.bool_(True)
          return c

        return jax.lax.cond(self_preempted, stop, take, c)

      return jax.lax.cond(go, allocate, lambda c: c, c), None

    c, _ = jax.lax.scan(running_step, c, order)
    c["wstop"] = jnp.bool_(False)

    def waiting_step(c, s):
      num_new = base.admission_width(x, s, b.token_budget - c["tok"])
      need = jnp.maximum(base.pages_for(comp[s] + num_new, ps) - held[s], 0)
      watermark = jnp.where(c["live"], b.watermark_pages, 0)
      # §0x06: R + A_hat <= C_soft in pages (A_hat = the rows now on demand,
      # or the reservation kind's forecast when larger).
      fits = ((c["seq"] < b.seq_budget) & (num_new > 0)
              & adm.admits(c["reserved"], jnp.maximum(need, x["need_total"][s]),
                           adm.soft_ceiling(c["free"], watermark)))
      is_waiting = (x["waiting"][s] | x["resume"][s]) & ~c["wstop"]
      c = dict(c)
      c["wstop"] = c["wstop"] | (is_waiting & ~fits)
      return jax.lax.cond(is_waiting & fits, lambda c: base.admit(x, c, s, num_new),
                          lambda c: c, c), None

    c = jax.lax.cond(jnp.any(c["preempt"]), lambda c: c,
                     lambda c: jax.lax.scan(waiting_step, c, order)[0], c)
    return base.finish_plan(manifest, state, x, c, keys, order, self)
