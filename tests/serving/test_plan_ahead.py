"""Planning one iteration ahead (``serving.engine.plan_ahead``) on the tiny
random-weight model: the plan made right after a step and fetched with its
facts is taken only when it is the plan the policy would make at launch, so
tokens, plans and the published state equal those of an engine that plans
at launch, with one blocking round trip an iteration instead of two."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.engine import plan_ahead
from serving.engine import programs as programs_lib
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from tests.serving.engine_testing import CFG, prompts as _prompts

BASE = EngineConfig.preset("tiny")            # 4 seqs, 16-token budget, chunk cap 8


def _run(params, config, on):
  """Four requests, three more added after the third iteration (greedy and
  seeded, ends at different iterations), on a clock that ticks 1 ms per
  reading (so equal times need equal readings); returns the engine and
  each request's tokens and emission times."""
  ticks = iter(range(10**6))
  engine = Engine(CFG, params, config, clock=lambda: next(ticks) / 1000.0)
  engine.record_plans = True
  engine.plan_ahead.enabled = on
  prompts = _prompts([9, 5, 12, 7, 3, 20, 4], seed=5)
  reqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6 + 2 * i, ignore_eos=True))
          for i, p in enumerate(prompts[:4])]
  for i in range(40):
    if i == 3:
      reqs += [engine.add_request(f"s{j}", p, SamplingParams(
          max_tokens=5, ignore_eos=True, temperature=0.8, seed=j))
               for j, p in enumerate(prompts[4:])]
    if not engine.has_unfinished():
      break
    engine.step()
  assert not engine.has_unfinished()
  return engine, [(r.output_token_ids, r.token_times_ms) for r in reqs]


@pytest.mark.parametrize("config", [
    pytest.param(BASE, id="sarathi_serve"),
    pytest.param(dataclasses.replace(BASE, policy="vllm_v1", enable_prefix_caching=False),
                 id="vllm_v1-no-prefix-cache", marks=pytest.mark.extended),
    pytest.param(dataclasses.replace(BASE, force_preempt_every=4, preemption_mode="swap"),
                 id="forced-swap", marks=pytest.mark.extended),
    pytest.param(dataclasses.replace(BASE, speculative="ngram:k=2,n=2"), id="speculative"),
    pytest.param(dataclasses.replace(BASE, policy="least_slack"), id="least_slack"),
])
def test_planning_ahead_changes_no_token_plan_or_state(params, config):
  off, off_tokens = _run(params, config, on=False)
  on, on_tokens = _run(params, config, on=True)
  assert on_tokens == off_tokens
  assert on.plan_log == off.plan_log
  assert on.num_iterations == off.num_iterations
  assert off.policy_evaluations == off.num_iterations
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), off.state, on.state)
  assert all(jax.tree.leaves(same))
  assert on.policy_evaluations == on.num_iterations
  if config.policy == "least_slack":         # orders by deadlines: reads the clock
    assert on.plan_ahead.used == 0 and on.host_fetches == off.host_fetches
  else:
    # Taken in most decode iterations, dropped where an arrival, a finish,
    # a preemption or a new cached page changed the tables.
    assert on.plan_ahead.used >= 3 and on.plan_ahead.dropped >= 1
    assert off.host_fetches - on.host_fetches == on.plan_ahead.used


def test_a_decode_iteration_makes_one_round_trip(params):
  engine = Engine(CFG, params, BASE)
  engine.generate(_prompts([6, 9], seed=2)[:1], SamplingParams(max_tokens=2, ignore_eos=True))
  for i, p in enumerate(_prompts([6, 9], seed=3)):
    engine.add_request(f"d{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
  for _ in range(3):                        # prompts, then the first decode rows
    engine.step()
  fetches, used = engine.host_fetches, engine.plan_ahead.used
  for _ in range(6):
    engine.step()
  assert engine.host_fetches - fetches == 6 and engine.plan_ahead.used - used == 6


def test_turning_planning_ahead_off_drops_the_pending_plan(params):
  """A plan made ahead before ``enabled`` went False is dropped, not taken:
  the next iteration plans at launch (two round trips)."""
  engine = Engine(CFG, params, BASE)
  for i, p in enumerate(_prompts([6, 9], seed=3)):
    engine.add_request(f"d{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
  for _ in range(4):                        # prompts, then decode rows planned ahead
    engine.step()
  assert engine.plan_ahead.pending
  fetches, used, dropped = (engine.host_fetches, engine.plan_ahead.used,
                            engine.plan_ahead.dropped)
  engine.plan_ahead.enabled = False
  engine.step()
  assert engine.plan_ahead.used == used and engine.plan_ahead.dropped == dropped + 1
  assert engine.host_fetches - fetches == 2 and not engine.plan_ahead.pending


def test_every_evaluation_is_a_plan_run_or_one_made_ahead_and_dropped(params, monkeypatch):
  """Counted on the device (a ``jax.debug.callback`` in the policy): the
  policy runs once per iteration, plus once per plan made ahead and
  dropped, plus the one made after the last step (pending)."""
  calls = []

  class Counting:
    def __init__(self, inner):
      self.inner = inner

    def __getattr__(self, name):
      return getattr(self.inner, name)

    def __call__(self, manifest, state, view):
      jax.debug.callback(lambda: calls.append(1))
      return self.inner(manifest, state, view)

  real = programs_lib.make_policy
  monkeypatch.setattr(programs_lib, "make_policy", lambda *a: Counting(real(*a)))
  # A config no other test builds: its programs hold the counting policy.
  engine, _ = _run(params, dataclasses.replace(BASE, num_clients=5), on=True)
  jax.effects_barrier()
  ahead = engine.plan_ahead
  assert ahead.used >= 3 and ahead.dropped >= 1
  assert len(calls) == engine.num_iterations + ahead.dropped + ahead.pending


class _Gated:
  """A policy that reads ``field`` of the state ("host": a host callback):
  the base plan, selecting nothing unless every value of it is >= -1
  (always true here)."""

  def __init__(self, base, field):
    self.base, self.field = base, field

  def __call__(self, manifest, state, view):
    plan = self.base(manifest, state, view)
    value = (jax.pure_callback(lambda: np.float32(0), jax.ShapeDtypeStruct((), jnp.float32))
             if self.field == "host" else getattr(state, self.field))
    return plan.replace(selected=plan.selected & jnp.all(value >= -1))


@pytest.mark.parametrize("field,reads", [("now_ms", True), ("last_token_ms", True),
                                         ("host", True), ("emitted", False)])
def test_the_clock_read_is_found_through_a_policy(params, field, reads):
  engine = Engine(CFG, params, BASE)
  engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2))
  engine.step()
  fix = engine.clocks.no_fix(engine.num_slots, engine._placement)  # pylint: disable=protected-access
  tables = (engine.manifest, engine.state, engine.pages, engine._prefix_hits(), fix)  # pylint: disable=protected-access
  assert not plan_ahead.reads_clock(engine._programs.plan, *tables)  # pylint: disable=protected-access
  gated = functools.partial(programs_lib.plan_step, _Gated(engine.policy, field), True)
  assert plan_ahead.reads_clock(gated, *tables) == reads
