"""Forced preemption: an instrument for preemption and resume (§0x0C).

``ForcedPreemption(inner, every)`` plans with ``inner`` and, on every
``every``-th decision, turns the selected decode row last in the plan's rank
order into a preemption intent (recompute or swap, as the engine's
``preemption_mode`` says). The plan stays legal: the victim is RUNNING and
no longer selected, the ranks of the later rows close up, and the token and
sequence ledgers drop its row. Replays with and without it must emit the same
tokens: that is what makes recovery exact (a research control, and a test).

A victim has emitted since its last preemption: its decode row starts past
its ``rebuild_target`` (the frontier it had when last preempted). Without
this rule a request alone whose rebuild takes ``every - 1`` iterations (or
``2 * every - 1``, ...) reaches its first decode exactly on the next forced
decision, every time: it is preempted again with nothing emitted and the run
repeats itself until ``max_preemptions_per_request`` fails it. With it, each
forced preemption follows at least one new token. (A state built without
``rebuild_target`` keeps every selected decode row a candidate.)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from scheduler import records as rec
from scheduler.wrapper import PolicyWrapper


@dataclasses.dataclass(frozen=True)
class ForcedPreemption(PolicyWrapper):
  """Wraps ``inner``; preempts one decoding request every ``every`` decisions.

  Attributes:
    inner: a registered policy (its keys, tie-break, state and ``update``
      are kept).
    every: decisions between forced preemptions (>= 2).

  Raises:
    ValueError: ``every < 2``.
  """

  inner: object
  every: int

  def __post_init__(self):
    if self.every < 2:
      raise ValueError(f"ForcedPreemption.every must be >= 2, got {self.every}")

  @property
  def policy_id(self) -> str:
    return f"{self.inner.policy_id}+preempt_every_{self.every}"

  def __call__(self, manifest: rec.WorkloadManifest, state: rec.SchedulerState,
               alloc: rec.AllocatorView) -> rec.IterationPlan:
    plan = self.inner(manifest, state, alloc)
    fire = state.decision_id % self.every == self.every - 1
    cand = plan.selected & (plan.kind == rec.DECODE_ROW) & (state.status == rec.RUNNING)
    if state.rebuild_target is not None:     # emitted since its last preemption
      cand = cand & (plan.start > state.rebuild_target)
    hit = fire & jnp.any(cand)
    v = jnp.argmax(jnp.where(cand, plan.rank, -1))
    victim = hit & (jnp.arange(cand.shape[0]) == v)
    rank_v = plan.rank[v]
    width_v = jnp.sum(jnp.where(victim, plan.end - plan.start, 0))
    rank = jnp.where(victim, -1,
                     jnp.where(hit & (plan.rank > rank_v), plan.rank - 1, plan.rank))
    return plan.replace(
        selected=plan.selected & ~victim,
        start=jnp.where(victim, 0, plan.start),
        end=jnp.where(victim, 0, plan.end),
        kind=jnp.where(victim, rec.NO_WORK, plan.kind).astype(jnp.int32),
        rank=rank.astype(jnp.int32),
        preempt=plan.preempt | victim,
        extend=None if plan.extend is None else plan.extend & ~victim,
        num_tokens=(plan.num_tokens - width_v).astype(jnp.int32),
        num_seqs=(plan.num_seqs - hit.astype(jnp.int32)).astype(jnp.int32),
        policy_id=self.policy_id,
        policy=self)
