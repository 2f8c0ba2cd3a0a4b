"""Planning is not execution; one jitted step; determinism; hidden truth.

§0x01A (only a validated result advances state), §0x06 (online projection,
metamorphic hidden-length test), DESIGN "one policy on one state gives one
plan" and "one jax.jit covers plan -> ... -> apply".
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scheduler import apply as apply_lib
from tests.scheduler import fixtures as fx
from scheduler import records as rec
from scheduler import validate as v
from scheduler.ledger import Budgets
from scheduler.policy_sarathi_serve import SarathiServe

POLICY = SarathiServe(Budgets(token_budget=8, seq_budget=4, chunk_cap=4))
# The §0x01A iteration-5 fixture's budgets: K_token = 4, K_seq = 3.
FIXTURE_POLICY = SarathiServe(Budgets(token_budget=4, seq_budget=3, chunk_cap=4))
PAGES, PAGE_SIZE = 256, 4
arrive_jit = jax.jit(apply_lib.arrive)
release_jit = jax.jit(apply_lib.release)


def _leaves_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return (jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
          and all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
                  for x, y in zip(la, lb)))


def _step(manifest, state, now_ms):
  return fx.replay_step_jit(POLICY, manifest, state, jnp.float32(now_ms),
                            num_pages=PAGES, page_size=PAGE_SIZE)


def test_planning_alone_advances_nothing():
  manifest, state, _ = fx.iteration5_fixture()
  before = jax.tree_util.tree_map(np.asarray, state)
  plan = fx.plan_jit(FIXTURE_POLICY, manifest.online(), state,
                     fx.alloc_view(state, num_pages=16, page_size=4))
  assert bool(plan.selected.any())
  assert _leaves_equal(before, state)
  # A result in which nothing completed publishes no progress and no service.
  nothing = fx.fixture_execute(manifest, state, plan, 1.0,
                               fail=jnp.zeros_like(plan.selected)).replace(
      completed=jnp.zeros_like(plan.selected),
      completed_end=state.computed, emitted=jnp.zeros_like(plan.selected),
      token=jnp.full_like(state.computed, -1),
      finished=jnp.zeros_like(plan.selected),
      service_rows=jnp.zeros_like(state.computed))
  v.validate_result(plan, state, manifest.online(), nothing)
  after = apply_lib.apply(manifest.online(), state, plan, nothing)
  for field in ("computed", "committed", "emitted", "service_rows", "generation"):
    np.testing.assert_array_equal(getattr(after, field), getattr(state, field))


def test_failed_slot_keeps_its_frontier():
  manifest, state, _ = fx.iteration5_fixture()
  online = manifest.online()
  plan = fx.plan_jit(FIXTURE_POLICY, online, state,
                     fx.alloc_view(state, num_pages=16, page_size=4))
  fail = jnp.zeros_like(plan.selected).at[1].set(True)          # req-B fails
  result = fx.fixture_execute(manifest, state, plan, 1.0, fail=fail)
  v.validate_result(plan, state, online, result)
  after = apply_lib.apply(online, state, plan, result)
  assert int(after.computed[1]) == int(state.computed[1]) == 3
  assert int(after.emitted[1]) == 1
  assert int(after.finish_reason[1]) == rec.FINISH_ERROR
  # Only the completed rows are debited: alpha gets req-A's 2, beta req-C's 1.
  np.testing.assert_array_equal(after.service_rows, [2, 1])
  assert int(after.computed[0]) == 2 and int(after.computed[2]) == 4


def _request(i):
  """Deterministic declarations of the i-th replay request."""
  return dict(prompt_len=3 + (i * 5) % 11, hidden=1 + (i * 7) % 6, max_tokens=8,
              priority=i % 2)


def test_one_jitted_step_compiles_once_over_200_iterations():
  """plan + predicates + executor + apply in one jit; arrivals/releases too.

  Compiled programs over 200 iterations: replay step 1, arrive 1, release 1.
  """
  num_slots = 8
  manifest = rec.empty_manifest(num_slots).replace(
      hidden_realized_output_tokens=jnp.zeros((num_slots,), jnp.int32))
  state = rec.initial_state(num_slots, 2)
  next_id, finished_total, rows_total = 0, 0, 0
  compiled_before = fx.replay_step_jit._cache_size()
  for it in range(200):
    status = np.asarray(state.status)
    for slot in np.flatnonzero(status == rec.FREE):
      r = _request(next_id)
      manifest, state = arrive_jit(
          manifest, state, np.int32(slot), np.int32(next_id), np.float32(it),
          np.int32(next_id), np.int32(r["prompt_len"]), np.int32(r["max_tokens"]),
          np.int32(r["priority"]), np.int32(next_id % 2))
      manifest = manifest.replace(hidden_realized_output_tokens=(
          manifest.hidden_realized_output_tokens.at[slot].set(r["hidden"])))
      next_id += 1
    state, plan, result, plan_bits, result_bits = _step(manifest, state, it + 1)
    assert int(plan_bits) == 0 and int(result_bits) == 0
    rows_total += int(plan.num_tokens)
    done = np.asarray(state.status) == rec.FINISHED
    finished_total += int(done.sum())
    state = release_jit(state, jnp.asarray(done))
    if it == 0:
      compiled_after_first = fx.replay_step_jit._cache_size()
  assert finished_total > 50
  # Completed-service counters equal every completed row.
  assert int(state.service_rows.sum()) == rows_total
  # No retrace per iteration: one program each (the replay step's cache is
  # shared with other tests, so count what these 200 iterations added).
  assert fx.replay_step_jit._cache_size() == compiled_after_first <= compiled_before + 1
  assert arrive_jit._cache_size() == 1
  assert release_jit._cache_size() == 1


def test_same_state_gives_bitwise_same_plan():
  manifest, state, _ = fx.iteration5_fixture()
  online = manifest.online()
  view = fx.alloc_view(state, num_pages=16, page_size=4)
  plans = [fx.plan_jit(FIXTURE_POLICY, online, state, view) for _ in range(3)]
  rebuilt, rebuilt_state, _ = fx.iteration5_fixture()     # fresh arrays
  plans.append(fx.plan_jit(FIXTURE_POLICY, rebuilt.online(), rebuilt_state, view))
  assert all(_leaves_equal(plans[0], p) for p in plans[1:])


@pytest.mark.parametrize("perm", [(0, 1, 2, 3, 4), (4, 3, 2, 1, 0), (2, 0, 4, 1, 3)])
def test_ties_break_on_recorded_key_not_slot_order(perm):
  """Five waiting requests with equal phase, priority and arrival order.

  Wherever they sit, the policy (sequence budget 4) admits the same four
  request ids in the same rank order: ties break on request_id.
  """
  ids = [40, 12, 33, 7, 21]
  reqs = [dict(slot=perm[i], request_id=rid, arrival_seq=0, prompt_len=1)
          for i, rid in enumerate(ids)]
  manifest, state = fx.build(reqs, num_slots=8)
  _, plan, _, plan_bits, _ = _step(manifest, state, 1.0)
  assert int(plan_bits) == 0
  sel = np.flatnonzero(np.asarray(plan.selected))
  order = sel[np.argsort(np.asarray(plan.rank)[sel])]
  assert np.asarray(manifest.request_id)[order].tolist() == [7, 12, 21, 33]


def _replay_plans(hidden, steps=40):
  reqs = [dict(slot=i, request_id=i, arrival_seq=i, prompt_len=2 + 3 * i,
               max_tokens=12, hidden=h) for i, h in enumerate(hidden)]
  manifest, state = fx.build(reqs, num_slots=8)
  out = []
  for t in range(steps):
    state, plan, result, _, _ = _step(manifest, state, t + 1)
    out.append((plan, bool(np.asarray(result.finished).any())))
  return out


def test_hidden_realized_lengths_never_change_online_plans():
  """§0x06 metamorphic test: change every realized output length.

  Every online plan up to (and including) the first iteration in which
  either replay publishes a stop is byte-for-byte identical.
  """
  manifest, state, _ = fx.iteration5_fixture()
  with pytest.raises(ValueError, match="hidden truth"):
    POLICY(manifest, state, fx.alloc_view(state, num_pages=16, page_size=4))
  a = _replay_plans([6, 8, 7, 9])
  b = _replay_plans([11, 10, 12, 10])
  compared = 0
  for (plan_a, stop_a), (plan_b, stop_b) in zip(a, b):
    assert _leaves_equal(plan_a, plan_b)
    compared += 1
    if stop_a or stop_b:
      break
  assert compared >= 6
  # After a stop the replays legitimately diverge.
  assert not all(_leaves_equal(x[0], y[0]) for x, y in zip(a, b))


def test_ttft_clock_starts_at_original_arrival():
  """§0x07: admission never restarts the first-token clock.

  Five 4-token prompts arrive at t=0 with token budget 8 and sequence budget
  4; the last is admitted only after a running request finishes, and its TTFT is measured from
  its original arrival (0 ms), not from its admission.
  """
  reqs = [dict(slot=i, request_id=i, arrival_seq=i, prompt_len=4, max_tokens=6,
               hidden=3) for i in range(5)]
  manifest, state = fx.build(reqs, num_slots=8)
  admitted_at = {}
  for t in range(1, 9):
    before = np.asarray(state.status)
    state, plan, _, _, _ = _step(manifest, state, 10.0 * t)
    for s in np.flatnonzero(np.asarray(plan.admit) & (before == rec.WAITING)):
      admitted_at.setdefault(int(s), 10.0 * t)
  first = np.asarray(state.first_token_ms)
  assert admitted_at[0] == 10.0 and admitted_at[4] > 10.0
  assert float(manifest.arrival_ms[4]) == 0.0
  ttft = first - np.asarray(manifest.arrival_ms)
  assert ttft[4] == first[4] >= admitted_at[4] > ttft[0]
