"""Scheduling policies: pure, versioned functions (manifest, state) -> plan.

Every policy is a small frozen (hashable) object, so ``jax.jit`` can take it
as a static argument; it declares its id, version and tie-break key and reads
only the online projection of the manifest (never hidden truth) plus the
allocator's published facts (free pages, pages held — never page ids).

Implemented here:

* ``sarathi_serve`` (Sarathi-Serve Algorithm 3 shape, §0x09): running decode
  rows first, then ongoing partial prefills with ``c = min(remaining,
  chunk_cap, tau - n_t)``, then new admissions in FCFS order, under a token
  budget ``tau`` and a separate sequence budget (§0x05). Under KV pressure a
  decode row that cannot get a page preempts the tail of the running order
  (lowest priority, latest arrival) for recompute (§0x0C, §0x0D).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict

import jax
import jax.numpy as jnp

from scheduler import records as rec


@dataclasses.dataclass(frozen=True)
class Budgets:
  """Static iteration budgets (§0x05).

  Attributes:
    token_budget: max token rows per iteration (tau / max_num_batched_tokens).
    seq_budget: max request generations per iteration (max_num_seqs).
    chunk_cap: max prefill rows one request gets per iteration
      (long_prefill_token_threshold); >= 1.
    watermark_pages: pages kept free at admission while anything runs.
  """

  token_budget: int
  seq_budget: int
  chunk_cap: int
  watermark_pages: int = 0

  def __post_init__(self):
    for name in ("token_budget", "seq_budget", "chunk_cap"):
      if getattr(self, name) < 1:
        raise ValueError(f"Budgets.{name} must be >= 1, got {getattr(self, name)}")
    if self.watermark_pages < 0:
      raise ValueError(f"Budgets.watermark_pages must be >= 0, got {self.watermark_pages}")


def _ceil_div(a, b):
  return (a + b - 1) // b


def phase_rank(manifest: rec.WorkloadManifest, state: rec.SchedulerState):
  """i32[R]: 0 decode, 1 running prefill/rebuild, 2 waiting, 3 no work."""
  target = rec.prefill_target(manifest, state)
  running = (state.status == rec.RUNNING) & state.ready
  decode = running & (state.emitted >= 1) & (
      state.computed == manifest.prompt_len + state.emitted - 1)
  partial = running & (state.computed < target)
  waiting = (state.status == rec.WAITING) & state.ready
  return jnp.select([decode, partial, waiting], [0, 1, 2], 3).astype(jnp.int32)


def sort_keys(manifest: rec.WorkloadManifest, state: rec.SchedulerState):
  """i32[R, 5]: the recorded tie-break key, columns ``SORT_KEY_FIELDS``."""
  return jnp.stack([phase_rank(manifest, state), manifest.priority,
                    manifest.arrival_seq, manifest.request_id,
                    state.generation], axis=1).astype(jnp.int32)


def key_order(keys):
  """i32[R]: slots in ascending lexicographic key order (stable)."""
  return jnp.lexsort(tuple(keys[:, i] for i in reversed(range(keys.shape[1]))))


def _work_kind(manifest, state):
  return jnp.where(state.emitted == 0, rec.PREFILL_CHUNK, rec.REBUILD)


@dataclasses.dataclass(frozen=True)
class SarathiServe:
  """Sarathi-Serve: decode-first, partial prefill, then FCFS admission."""

  budgets: Budgets
  policy_id: str = "sarathi_serve"
  version: str = "1"
  tie_break: tuple = rec.SORT_KEY_FIELDS

  def __call__(self, manifest: rec.WorkloadManifest, state: rec.SchedulerState,
               alloc: rec.AllocatorView) -> rec.IterationPlan:
    if manifest.hidden_realized_output_tokens is not None:
      raise ValueError("policy input must be the online projection "
                       "(manifest.online()): hidden truth present")
    return _sarathi_serve_plan(manifest, state, alloc, self)


def _sarathi_serve_plan(manifest, state, alloc, policy):
  b = policy.budgets
  ps = alloc.page_size
  num_slots = manifest.num_slots
  keys = sort_keys(manifest, state)
  order = key_order(keys)
  rank_of_phase = keys[:, 0]
  target = rec.prefill_target(manifest, state)
  held = alloc.pages_held
  computed = state.computed

  # Victim order for KV pressure: running slots, best first; the tail is the
  # lowest priority / latest arrival.
  running = state.status == rec.RUNNING
  victim_keys = jnp.stack([jnp.where(running, 0, 1), manifest.priority,
                           manifest.arrival_seq, manifest.request_id], axis=1)
  victim_order = key_order(victim_keys)
  num_running = jnp.sum(running).astype(jnp.int32)
  position_in_running = jnp.zeros((num_slots,), jnp.int32).at[victim_order].set(
      jnp.arange(num_slots, dtype=jnp.int32))

  init = dict(
      free=alloc.free_pages.astype(jnp.int32),
      tail=num_running,  # victim positions >= tail are preempted
      tok=jnp.int32(0), seq=jnp.int32(0), next_rank=jnp.int32(0),
      selected=jnp.zeros((num_slots,), bool),
      preempt=jnp.zeros((num_slots,), bool),
      admit=jnp.zeros((num_slots,), bool),
      end=computed, rank=jnp.full((num_slots,), -1, jnp.int32),
      alloc_now=jnp.zeros((num_slots,), jnp.int32),
      blocked=jnp.bool_(False))

  def take(c, s, end, need_pages):
    c = dict(c)
    c["selected"] = c["selected"].at[s].set(True)
    c["end"] = c["end"].at[s].set(end)
    c["rank"] = c["rank"].at[s].set(c["next_rank"])
    c["alloc_now"] = c["alloc_now"].at[s].set(need_pages)
    c["free"] = c["free"] - need_pages
    c["tok"] = c["tok"] + (end - computed[s])
    c["seq"] = c["seq"] + 1
    c["next_rank"] = c["next_rank"] + 1
    return c

  # 1. Running decode rows, with tail preemption when no page is left.
  def decode_step(c, s):
    is_decode = (rank_of_phase[s] == 0) & ~c["preempt"][s]
    fits = (c["tok"] < b.token_budget) & (c["seq"] < b.seq_budget)
    need = jnp.maximum(_ceil_div(computed[s] + 1, ps) - held[s], 0)
    my_pos = position_in_running[s]

    def evict(c):
      def cond(c):
        return (c["free"] < need) & (c["tail"] - 1 > my_pos)
      def body(c):
        c = dict(c)
        victim = victim_order[c["tail"] - 1]
        c["preempt"] = c["preempt"].at[victim].set(True)
        c["free"] = c["free"] + held[victim]
        c["tail"] = c["tail"] - 1
        return c
      c = jax.lax.while_loop(cond, body, c)
      # Still short: preempt this request itself.
      short = c["free"] < need
      c = dict(c)
      c["preempt"] = c["preempt"].at[s].set(short | c["preempt"][s])
      c["free"] = c["free"] + jnp.where(short, held[s], 0)
      c["tail"] = jnp.where(short, my_pos, c["tail"])
      return jax.lax.cond(short, lambda c: c, lambda c: take(c, s, computed[s] + 1, need), c)

    c = jax.lax.cond(is_decode & fits, evict, lambda c: c, c)
    return c, None

  # 2. Ongoing partial prefills (and rebuilds after preemption).
  def partial_step(c, s):
    is_partial = (rank_of_phase[s] == 1) & ~c["preempt"][s]
    room = jnp.minimum(b.token_budget - c["tok"], b.chunk_cap)
    by_pages = (held[s] + c["free"]) * ps - computed[s]
    chunk = jnp.minimum(jnp.minimum(target[s] - computed[s], room), by_pages)
    ok = is_partial & (chunk > 0) & (c["seq"] < b.seq_budget)
    need = jnp.maximum(_ceil_div(computed[s] + chunk, ps) - held[s], 0)
    c = jax.lax.cond(ok, lambda c: take(c, s, computed[s] + chunk, need),
                     lambda c: c, c)
    return c, None

  c, _ = jax.lax.scan(decode_step, init, order)
  c, _ = jax.lax.scan(partial_step, c, order)

  # Pages the ongoing prefills still need to reach their target: admission
  # must leave them free, or a half-prefilled request could never finish.
  still_partial = (rank_of_phase == 1) & ~c["preempt"]
  reserved = jnp.sum(jnp.where(
      still_partial,
      jnp.maximum(_ceil_div(target, ps) - held - c["alloc_now"], 0), 0))
  live_after = jnp.sum(running & ~c["preempt"])
  watermark = jnp.where(live_after > 0, b.watermark_pages, 0)

  # 3. New admissions, FCFS with `break` (a head that does not fit blocks).
  def admit_step(c, s):
    is_waiting = rank_of_phase[s] == 2
    room = jnp.minimum(b.token_budget - c["tok"], b.chunk_cap)
    chunk = jnp.minimum(target[s] - computed[s], room)
    need_total = _ceil_div(target[s], ps) - held[s]
    fits = ((c["free"] - c["reserved"] - watermark >= need_total)
            & (chunk > 0) & (c["seq"] < b.seq_budget))
    go = is_waiting & ~c["blocked"] & fits
    c = dict(c)
    c["blocked"] = c["blocked"] | (is_waiting & ~fits)
    need = jnp.maximum(_ceil_div(computed[s] + chunk, ps) - held[s], 0)

    def do(c):
      c = take(c, s, computed[s] + chunk, need)
      c["admit"] = c["admit"].at[s].set(True)
      c["reserved"] = c["reserved"] + (need_total - need)
      return c

    return jax.lax.cond(go, do, lambda c: c, c), None

  c["reserved"] = reserved
  c, _ = jax.lax.scan(admit_step, c, order)

  selected = c["selected"]
  kind = jnp.where(rank_of_phase == 0, rec.DECODE_ROW,
                   _work_kind(manifest, state))
  return rec.IterationPlan(
      decision_id=state.decision_id,
      input_state_version=state.state_version,
      selected=selected,
      generation=state.generation,
      snapshot_version=state.snapshot_version,
      start=jnp.where(selected, computed, 0),
      end=jnp.where(selected, c["end"], 0),
      kind=jnp.where(selected, kind, rec.NO_WORK).astype(jnp.int32),
      rank=c["rank"],
      admit=c["admit"],
      preempt=c["preempt"],
      sort_key=keys,
      num_tokens=c["tok"],
      num_seqs=c["seq"],
      policy_id=policy.policy_id,
      policy_version=policy.version,
      token_budget=b.token_budget,
      seq_budget=b.seq_budget)


POLICIES: Dict[str, Callable[[Budgets], object]] = {
    "sarathi_serve": SarathiServe,
}


def make_policy(name: str, budgets: Budgets):
  """Policy by registered name; ValueError lists the known names."""
  if name not in POLICIES:
    raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
  return POLICIES[name](budgets)
