"""Fairness fixtures of §0x09A through the real policies and apply.

Every trace drives policy -> plan predicates -> fixture executor -> result
predicates -> apply, one iteration at a time; service is read from the
successor states only. Where the article's tables were lost, the docstring
says which inputs were reconstructed.
"""

import jax.numpy as jnp
import numpy as np

from serving.harness import service_gap as fair
from scheduler import records as rec
from scheduler.ledger import Budgets
from scheduler.policy_fairness import (FastServe, PrefixAware, Vtc,
                                       VtcCompletionReconciled, lifted_counters)
from scheduler.policy_orca import Orca
from scheduler.policy_slo import LeastSlack, PriorityAging
from tests.scheduler.policy_testing import Driver

ONE = Budgets(token_budget=4, seq_budget=1, chunk_cap=4)


def vtc_max_increment(w_p: int, w_q: int, max_input_tokens: int,
                      max_batch_tokens: int) -> int:
  """U = max(w_p * L_input, w_q * M): the largest one-step counter jump."""
  return max(w_p * max_input_tokens, w_q * max_batch_tokens)


def vtc_service_bound(w_p: int, w_q: int, max_input_tokens: int,
                      max_batch_tokens: int) -> int:
  """2U: VTC Theorem 4.4's bound on |W_f - W_g| for two clients backlogged
  over the whole interval (only under the theorem's premises)."""
  return 2 * vtc_max_increment(w_p, w_q, max_input_tokens, max_batch_tokens)


def _client_flood(policy):
  """A0..A7 then B0..B3 at tick 0; each event is a 2-token prompt with one
  output (2 weighted units at w_p = 1). Returns, per iteration, the service
  after it and whether both clients were backlogged when it began."""
  d = Driver(policy, num_slots=12)
  for i in range(8):
    d.arrive(f"A{i}", prompt_len=2, max_tokens=1, client=0)
  for i in range(4):
    d.arrive(f"B{i}", prompt_len=2, max_tokens=1, client=1)
  a, b, backlog = [], [], []
  for t in range(12):
    live = np.isin(np.asarray(d.state.status), (rec.WAITING, rec.RUNNING))
    client = np.asarray(d.manifest.client)
    d.step(t + 1.0)
    svc = np.asarray(d.state.service_rows)
    a.append(int(svc[0]))
    b.append(int(svc[1]))
    backlog.append(bool((live & (client == 0)).any() and (live & (client == 1)).any()))
  return a, b, backlog


def test_fifo_versus_least_service_client_gap():
  """FIFO (ORCA order) serves all of A first: gap 16 while B is backlogged;
  VTC alternates the first eight events: gap 2. Both end at A=16, B=8."""
  a, b, backlog = _client_flood(Orca(ONE))
  assert fair.max_backlogged_gap(a, b, backlog) == 16
  assert (a[-1], b[-1]) == (16, 8)
  a, b, backlog = _client_flood(Vtc(ONE, w_p=1, w_q=2))
  assert fair.max_backlogged_gap(a, b, backlog) == 2
  assert a[:8] == [2, 2, 4, 4, 6, 6, 8, 8] and b[:8] == [0, 2, 2, 4, 4, 6, 6, 8]
  assert (a[-1], b[-1]) == (16, 8)


def test_vtc_bound_and_counter_lift():
  """U = max(1 x 8, 2 x 4) = 8, 2U = 16; B becoming active with stored 0 while
  A sits at 4 is lifted to c_B = max(0, 4) = 4 (Algorithm 2)."""
  assert vtc_max_increment(1, 2, 8, 4) == 8
  assert vtc_service_bound(1, 2, 8, 4) == 16
  policy = Vtc(ONE, w_p=1, w_q=2)
  d = Driver(policy, num_slots=2)
  d.arrive("A", prompt_len=4, max_tokens=3, client=0)
  d.step(1.0)
  assert np.asarray(d.state.policy_state.counter.value).tolist() == [4, 0]   # w_p x 4
  d.arrive("B", prompt_len=4, max_tokens=3, client=1)
  assert np.asarray(lifted_counters(d.manifest, d.state, d.state.policy_state)
                    ).tolist() == [4, 4]
  d.step(2.0)                  # A decodes (w_q = 2); B waits, lift published
  assert np.asarray(d.state.policy_state.counter.value).tolist() == [6, 4]


def test_completion_reconciled_failure_trace():
  """Tick 0: A's 4-token input event is selected (C_select 0 -> 4) and fails:
  rolled back to 0, W_done stays 0. Tick 1: the resubmitted event completes
  four input tokens: C_select 0 -> 4 and W_done 0 -> 4."""
  policy = VtcCompletionReconciled(ONE, w_p=1, w_q=2)
  d = Driver(policy, num_slots=2)
  d.arrive("A", prompt_len=4, max_tokens=1, client=0)
  before, plan, _ = d.step(1.0, fail=[True, False])
  prov = policy.provisional_counters(d.manifest.online(), before, plan)
  assert [int(before.policy_state.counter.value[0]), int(prov[0]),
          int(d.state.policy_state.counter.value[0])] == [0, 4, 0]
  assert int(d.state.policy_state.done.value[0]) == 0
  assert int(d.state.finish_reason[0]) == rec.FINISH_ERROR
  d.arrive("A-retry", prompt_len=4, max_tokens=1, client=0)
  before, plan, _ = d.step(2.0)
  prov = policy.provisional_counters(d.manifest.online(), before, plan)
  assert [int(before.policy_state.counter.value[0]), int(prov[0])] == [0, 4]
  vtc = d.state.policy_state
  assert int(vtc.counter.value[0]) == 4 and int(vtc.done.value[0]) == 4


def _low_vs_stream(policy, ticks):
  """A low-priority (4) request at tick 0, one high-priority (0) request each
  tick; one-token prompts, one output; one sequence per iteration; the
  clock is 1 ms per tick. Returns the tick the low request ran (or None)."""
  d = Driver(policy, num_slots=4)
  low = d.arrive("low", prompt_len=1, max_tokens=1, priority=4, t=0.0)
  for t in range(ticks):
    d.arrive(f"high{t}", prompt_len=1, max_tokens=1, priority=0, t=float(t))
    _, plan, _ = d.step(float(t))
    if "low" in d.served(plan):
      assert low in np.flatnonzero(np.asarray(plan.selected))
      return t
  return None


def test_static_priority_starves_aging_wins_at_tick_8():
  """p_eff = 4 - floor(t / 2) reaches the stream's 0 at t = 8 (q_age = 2) and
  wins the tie on arrival; static priority never serves it in 10 ticks."""
  static = _low_vs_stream(PriorityAging(ONE, q_age_ms=0.0), 10)
  assert static is None
  assert fair.starved(eligible_throughout=True, completed_events=0)
  assert _low_vs_stream(PriorityAging(ONE, q_age_ms=2.0), 10) == 8


def _hot_cold(policy, ticks=9):
  """One cold request (no prefix hit) at tick 0 and one new hot request (hit
  = whole 2-token prompt) every tick; one sequence per iteration."""
  d = Driver(policy, num_slots=4)
  d.arrive("cold", prompt_len=2, max_tokens=1, hit=0)
  done = {"hot": 0, "cold": 0}
  for t in range(ticks):
    d.arrive(f"hot{t}", prompt_len=2, max_tokens=1, hit=2)
    _, plan, result = d.step(float(t))
    for name in d.served(plan):
      done["cold" if name == "cold" else "hot"] += 1
  return done


def test_reuse_greedy_starves_cold_quota_progresses():
  """Reuse greedy: hot 9 / cold 0 (cold starved while eligible); the 2:1
  quota: hot 8 / cold 1 (the cold request runs at tick 2)."""
  greedy = _hot_cold(PrefixAware(ONE, quota_hot=0))
  assert greedy == {"hot": 9, "cold": 0}
  assert fair.starved(True, greedy["cold"])
  quota = _hot_cold(PrefixAware(ONE, quota_hot=2))
  assert quota == {"hot": 8, "cold": 1}
  assert not fair.starved(True, quota["cold"])


def test_fastserve_skip_join_demotion_promotion_trace():
  """Reconstructed Loop 8 trace (the article's table was lost).

  Quanta 1, 2, 4, 8 rows; one sequence per iteration. L (4-token prompt, two
  outputs) has first-step cost 4 and skip-joins Q2; a cost-1 job S_t
  (one-token prompt, one output) arrives in Q0 every tick. Without
  promotion L never runs. With alpha = 3: L waits ticks 0-2, is promoted to
  Q0 and runs its prefill at tick 3 (4 rows deplete Q0's quantum: demoted to
  Q1, its next cost 1 would join Q0), waits ticks 4-6, is promoted again and
  emits its second token at tick 7.
  """
  def run(alpha):
    d = Driver(FastServe(ONE, num_levels=4, base_quantum=1, alpha_iters=alpha),
               num_slots=6)
    slot = d.arrive("L", prompt_len=4, max_tokens=2)
    ran, levels, finished = [], [], None
    for t in range(10):
      d.arrive(f"S{t}", prompt_len=1, max_tokens=1)
      _, plan, result = d.step(float(t))
      if "L" in d.served(plan):
        ran.append(t)
        if bool(result.finished[slot]):
          finished = t
      levels.append(int(d.state.policy_state.level.value[slot]))
    return ran, levels, finished

  ran, _, finished = run(alpha=100)
  assert ran == [] and finished is None
  ran, levels, finished = run(alpha=3)
  assert ran == [3, 7] and finished == 7
  assert levels[:7] == [2, 2, 0, 1, 1, 1, 0]


def test_least_slack_burst_two_ttft_misses():
  """§0x07 burst through the real policy: 6 one-token prompts at t = 0, two
  outputs each, 2 rows per 10 ms tick (outputs published at the tick's end),
  TTFT 30 ms, TBT 20 ms. The iteration at 30 ms selects r4, r5 at predicted
  slack -10 ms: first tokens at 40 ms miss TTFT; r0-r3 meet TTFT and TBT."""
  policy = LeastSlack(Budgets(token_budget=2, seq_budget=2, chunk_cap=1), tick_ms=10.0)
  d = Driver(policy, num_slots=6)
  for i in range(6):
    d.arrive(f"r{i}", prompt_len=1, max_tokens=2)
  d.manifest = d.manifest.replace(ttft_ms=jnp.full((6,), 30.0, jnp.float32),
                                  tbt_ms=jnp.full((6,), 20.0, jnp.float32))
  negative = []
  for t in range(6):
    before, plan, _ = d.step(10.0 * t, emit_ms=10.0 * t + 10.0)
    slack = np.asarray(policy.slack_ms(d.manifest.online(),
                                       before.replace(now_ms=jnp.float32(10.0 * t))))
    negative += [d.names[int(s)] for s in np.flatnonzero(np.asarray(plan.selected))
                 if slack[s] < 0]
  first = np.asarray(d.state.first_token_ms)
  last = np.asarray(d.state.last_token_ms)
  assert first.tolist() == [10.0, 10.0, 30.0, 30.0, 40.0, 40.0]
  assert last.tolist() == [20.0, 20.0, 50.0, 50.0, 60.0, 60.0]
  assert sorted(negative) == ["r4", "r5"]
  ttft_ok = first - np.asarray(d.manifest.arrival_ms) <= 30.0
  tbt_ok = last - first <= 20.0
  assert (ttft_ok & tbt_ok).tolist() == [True] * 4 + [False] * 2
