"""Shared drivers for the policy tests: one jitted step per policy (plan on
the online projection, plan predicates with the allocator view, fixture
executor with an optional failure mask, result predicates, apply)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from scheduler import apply as apply_lib
from tests.scheduler import fixtures as fx
from scheduler import records as rec
from scheduler import validate as v


@functools.partial(jax.jit, static_argnames=("policy", "num_pages", "page_size"))
def step(policy, manifest, state, now_ms, emit_ms, hits, fail, *, num_pages,
         page_size):
  """Plans at ``now_ms``, publishes at ``emit_ms``. Returns (next_state, plan,
  result, plan_bits, result_bits)."""
  online = manifest.online()
  state = apply_lib.tick(state, now_ms)
  view = fx.alloc_view(state, num_pages=num_pages, page_size=page_size).replace(
      prefix_hit_tokens=hits)
  plan = policy(online, state, view)
  plan_bits = v.any_violation(v.plan_violations(online, state, plan, view))
  result = fx.fixture_execute(manifest, state, plan, emit_ms, fail=fail)
  result_bits = v.any_violation(v.result_violations(plan, state, online, result))
  return (apply_lib.apply(online, state, plan, result), plan, result, plan_bits,
          result_bits)


# Own wrappers: jax.jit of the same function shares one compilation cache,
# and other tests count that cache's programs.
_arrive = jax.jit(lambda *args: apply_lib.arrive(*args))
_release = jax.jit(lambda state, mask: apply_lib.release(state, mask))


class Driver:
  """A replay over R slots with arrivals, releases and one policy."""

  def __init__(self, policy, num_slots, num_clients=2, num_pages=64, page_size=4):
    self.policy, self.num_pages, self.page_size = policy, num_pages, page_size
    self.manifest = rec.empty_manifest(num_slots).replace(
        hidden_realized_output_tokens=jnp.zeros((num_slots,), jnp.int32))
    self.state = rec.initial_state(num_slots, num_clients, policy=policy)
    self.hits = np.zeros(num_slots, np.int32)
    self.next_seq = 0
    self.names = {}

  def arrive(self, name, *, prompt_len, max_tokens, t=0.0, priority=0, client=0,
             hidden=None, hit=0):
    """Puts a request into the lowest FREE slot; returns the slot."""
    self.state = _release(self.state, self.state.status == rec.FINISHED)
    slot = int(np.flatnonzero(np.asarray(self.state.status) == rec.FREE)[0])
    seq = self.next_seq
    self.next_seq += 1
    self.manifest, self.state = _arrive(
        self.manifest, self.state, np.int32(slot), np.int32(seq), np.float32(t),
        np.int32(seq), np.int32(prompt_len), np.int32(max_tokens),
        np.int32(priority), np.int32(client))
    self.manifest = self.manifest.replace(
        hidden_realized_output_tokens=self.manifest.hidden_realized_output_tokens
        .at[slot].set(max_tokens if hidden is None else hidden))
    self.hits[slot] = hit
    self.names[slot] = name
    return slot

  def step(self, now_ms, fail=None, emit_ms=None):
    n = self.manifest.num_slots
    fail = np.zeros(n, bool) if fail is None else np.asarray(fail)
    before = self.state
    self.state, plan, result, pb, rb = step(
        self.policy, self.manifest, self.state, jnp.float32(now_ms),
        jnp.float32(now_ms if emit_ms is None else emit_ms), jnp.asarray(self.hits),
        jnp.asarray(fail), num_pages=self.num_pages, page_size=self.page_size)
    assert int(pb) == 0, f"plan rules broken: {int(pb):b}"
    assert int(rb) == 0, f"result rules broken: {int(rb):b}"
    return before, plan, result

  def served(self, plan):
    """Names of the selected slots in rank order."""
    sel = np.flatnonzero(np.asarray(plan.selected))
    order = sel[np.argsort(np.asarray(plan.rank)[sel])]
    return [self.names[int(s)] for s in order]
