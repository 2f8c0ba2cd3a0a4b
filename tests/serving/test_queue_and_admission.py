"""Admission facts through the engine: exact KV rows, victims, the queue.

Every case drives ``Engine`` on the tiny random-weight model.
"""

import dataclasses

import numpy as np
import pytest

from scheduler.policies import POLICIES
from serving import metrics, workloads
from serving import kv_pages
from serving.config import EngineConfig, SamplingParams
from serving.engine import Engine
from serving.replay import replay
from tests.serving.engine_testing import CFG, prompts as _prompts

BASE = EngineConfig.preset("tiny")            # 4 seqs, 16-token budget, page_size 4


# ----------------------------------------------------- exact KV rows (p + m - 1)
@pytest.mark.parametrize("policy, num_pages, max_tokens, accepted", [
    ("sarathi_serve", 3, 5, True),   # 4 + 5 - 1 = 8 rows = 2 pages of 2 usable
    ("orca", 3, 5, True),            # ORCA reserves the whole trajectory
    ("sarathi_serve", 3, 6, False),  # 9 rows = 3 pages: one page short
])
def test_a_request_needs_prompt_plus_max_tokens_minus_one_kv_rows(
    params, policy, num_pages, max_tokens, accepted):
  """A 4-token prompt with max_tokens m writes 4 + m - 1 KV rows (the last
  output is never fed back); page_size 4, one page is the null page."""
  config = dataclasses.replace(BASE, num_pages=num_pages, policy=policy)
  engine = Engine(CFG, params, config)
  req = engine.add_request("r", _prompts([4])[0],
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True))
  engine.run(max_iterations=50)
  if accepted:
    assert req.outcome == "completed", req.finish_reason
    assert len(req.output_token_ids) == max_tokens
    free, evictable, in_use = (int(n) for n in kv_pages.page_census(engine.pages))
    assert (free + evictable, in_use) == (num_pages - 1, 0)
  else:
    assert req.outcome == "rejected"
    assert "needs 3 KV pages for 9 KV rows" in req.finish_reason


# --------------------------------------------------------------- victims
# vLLM's priority mode, and a policy whose walk puts prefill work before
# decode rows (sarathi: its earliest request was the victim 65 times).
VICTIM_POLICIES = ["vllm_v1_priority", "sarathi"]


def _rank(request_id):
  return int(request_id[1:])


@pytest.mark.parametrize("policy", VICTIM_POLICIES)
def test_an_earlier_equal_priority_arrival_is_never_evicted_for_a_later_one(
    params, policy):
  """num_pages=17, page_size=4, max_num_seqs=4; three equal-priority
  requests R0, R1, R2 (20-token prompts, 30 outputs, EOS ignored) added in
  order. In no plan may a request be preempted while a later arrival runs
  on (still running after the plan, or admitted by it)."""
  config = EngineConfig.preset("tiny", num_pages=17, page_size=4, max_num_seqs=4,
                               policy=policy)
  engine = Engine(CFG, params, config)
  engine.record_plans = True
  reqs = [engine.add_request(f"R{i}", p, SamplingParams(max_tokens=30, ignore_eos=True))
          for i, p in enumerate(_prompts([20] * 3))]
  engine.run(max_iterations=400)
  assert [r.outcome for r in reqs] == ["completed"] * 3
  assert reqs[0].num_preemptions == 0      # the earliest arrival never yields
  preemptions = 0
  for plan in engine.plan_log:
    runs_on = set(plan["running"] + plan["admitted"]) - set(plan["preempted"])
    for victim in plan["preempted"]:
      preemptions += 1
      later = [r for r in runs_on if _rank(r) > _rank(victim)]
      assert not later, (plan["decision_id"], victim, later)
  assert preemptions == sum(r.num_preemptions for r in reqs) > 0


# --------------------------------------------------- the whole queue is visible
def _fake_clock():
  t = [0.0]

  def clock():
    t[0] += 1e-3                              # 1 ms per reading
    return t[0]

  return clock


def test_a_priority_request_overtakes_a_backlog(params):
  """vllm_v1_priority, 8 initial slots, 4 seqs: 20 priority-5 requests, one
  step, then one priority-0 request: it is the next request admitted."""
  config = EngineConfig.preset("tiny", policy="vllm_v1_priority", max_request_slots=8,
                               max_num_seqs=4)
  engine = Engine(CFG, params, config, clock=_fake_clock())
  engine.record_plans = True
  sampling = SamplingParams(max_tokens=4, ignore_eos=True)
  for i, p in enumerate(_prompts([6] * 20)):
    engine.add_request(f"b{i}", p, sampling, priority=5)
  engine.step()
  first = list(engine.plan_log[0]["admitted"])
  engine.add_request("urgent", _prompts([6], seed=3)[0], sampling, priority=0)
  engine.run(max_iterations=300)
  admitted = [r for plan in engine.plan_log for r in plan["admitted"]]
  assert admitted.index("urgent") == len(first)
  assert engine.num_slots == 32                  # 8 -> 16 -> 32 slots for 21
  assert all(r.outcome == "completed" for r in engine.requests.values())


def test_vtc_serves_a_new_client_behind_a_deep_backlog(params):
  """vtc, 8 initial slots: client A sends 29 requests, then client B 3. All
  are visible, so VTC's smaller counter (B's, at 0) wins a slot among the
  first admissions once A has been served."""
  config = EngineConfig.preset("tiny", policy="vtc", max_request_slots=8)
  engine = Engine(CFG, params, config, clock=_fake_clock())
  engine.record_plans = True
  sampling = SamplingParams(max_tokens=4, ignore_eos=True)
  for i, p in enumerate(_prompts([6] * 29)):
    engine.add_request(f"a{i}", p, sampling, client="A")
  for i, p in enumerate(_prompts([6] * 3, seed=4)):
    engine.add_request(f"b{i}", p, sampling, client="B")
  engine.run(max_iterations=300)
  admitted = [r for plan in engine.plan_log for r in plan["admitted"]]
  assert admitted.index("b0") <= 3, admitted[:8]


def test_queue_bound_refuses_with_a_typed_error(params):
  from serving.engine import QueueFull
  config = EngineConfig.preset("tiny", max_request_slots=16, max_queued_requests=32)
  engine = Engine(CFG, params, config)
  sampling = SamplingParams(max_tokens=2, ignore_eos=True)
  for i, p in enumerate(_prompts([4] * 32)):
    engine.add_request(f"r{i}", p, sampling)
  with pytest.raises(QueueFull, match="max_queued_requests=32"):
    engine.add_request("late", _prompts([4])[0], sampling)
  assert "late" not in engine.requests
  engine.run(max_iterations=200)
  assert engine.num_slots == 32                  # 16 -> 32, the bound
  engine.add_request("late", _prompts([4])[0], sampling)    # room again
  engine.run(max_iterations=100)
  assert all(r.outcome == "completed" for r in engine.requests.values())


def _random_workload(seed, n=6):
  """(request_id, prompt, sampling, priority, client, step_to_add) tuples."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(3, 13, size=n).tolist()
  out = []
  for i, prompt in enumerate(_prompts(lengths, seed=seed)):
    sampling = SamplingParams(max_tokens=int(rng.integers(2, 9)), ignore_eos=True)
    out.append((f"w{i}", prompt, sampling, int(rng.integers(0, 3)),
                "ABC"[int(rng.integers(0, 3))], int(rng.integers(0, 4))))
  return out


def _trace(params, policy, num_slots, workload):
  config = EngineConfig.preset("tiny", policy=policy, max_num_seqs=2, num_pages=12,
                               max_request_slots=num_slots, max_queued_requests=6)
  engine = Engine(CFG, params, config, clock=_fake_clock())
  engine.record_plans = True
  step = 0
  while step < 300:
    for rid, prompt, sampling, priority, client, at in workload:
      if at == step:
        engine.add_request(rid, prompt, sampling, priority=priority, client=client)
    if step >= max(w[-1] for w in workload) and not engine.has_unfinished():
      break
    engine.step()
    step += 1
  plans = [(p["admitted"], p["scheduled"], p["preempted"]) for p in engine.plan_log]
  tokens = {r.request_id: (r.outcome, r.output_token_ids)
            for r in engine.requests.values()}
  return plans, tokens, engine.num_slots


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_decisions_do_not_depend_on_the_slot_table_size(params, policy):
  """Metamorphic: a random workload (priorities, three clients, arrivals
  over four steps, KV pressure, injected clock) gives the same admission
  order, the same (request, interval, kind) pairs in every iteration and the
  same tokens whether the slot table starts just above max_num_seqs (3,
  growing to 6 as requests queue) or holds the whole workload from the
  start (6)."""
  workload = _random_workload(seed=sorted(POLICIES).index(policy))
  small = _trace(params, policy, 3, workload)
  large = _trace(params, policy, 6, workload)
  assert small[2] == large[2] == 6
  assert small[0] == large[0]
  assert small[1] == large[1]
  assert all(outcome in ("completed", "rejected") for outcome, _ in small[1].values())


# ------------------------------------------------------------ SLOs end to end
def test_least_slack_meets_more_deadlines_than_fcfs(params):
  """A 48-token prompt with a loose TTFT SLO (1 s) arrives with four 8-token
  prompts whose TTFT SLO is 10 ms; the prefill chunk cap (16) equals the
  token budget, so FCFS spends three iterations on the long prompt first.
  The SLOs go RequestSpec -> replay -> add_request -> the manifest, and
  ``metrics.goodput`` judges every request by its own limits. On the
  injected clock (1 ms per reading) FCFS meets 1 of 5, least_slack all 5."""
  ps = _prompts([48, 8, 8, 8, 8], seed=2)
  specs = [workloads.RequestSpec("long", 0.0, tuple(ps[0]), 4, slo_ttft_ms=1000.0,
                                 slo_tpot_ms=1000.0)]
  specs += [workloads.RequestSpec(f"s{i}", 0.0, tuple(p), 4, slo_ttft_ms=10.0,
                                  slo_tpot_ms=1000.0) for i, p in enumerate(ps[1:])]
  workload = workloads.Workload(tuple(specs), "test", None, None, len(specs), 0, 0, 1.0,
                                None, 0, None, None)
  valid = {}
  for policy in ("sarathi_serve", "least_slack"):
    config = EngineConfig.preset("tiny", policy=policy, long_prefill_token_threshold=16)
    engine = Engine(CFG, params, config, clock=_fake_clock())
    records, duration_s = replay(engine, workload, realtime=False)
    good = metrics.goodput(records, per_request=True, duration_s=duration_s)
    assert good["completed"] == good["offered"] == 5
    valid[policy] = good["valid"]
  assert valid == {"sarathi_serve": 1, "least_slack": 5}


def test_slo_classes_follow_the_stated_rule():
  """A client naming a class takes it; the others cycle by arrival index."""
  classes = workloads.parse_slo_classes("interactive:500:100,batch:5000:500")
  specs = tuple(workloads.RequestSpec(f"q{i}", float(i), (5, 6), 2, client=client)
                for i, client in enumerate(["x", "batch", "x", "x"]))
  workload = workloads.Workload(specs, "test", None, None, 4, 0, 0, 1.0, None, 0, None, None)
  got = [(s.slo_ttft_ms, s.slo_tpot_ms)
         for s in workloads.with_slos(workload, classes=classes)]
  assert got == [(500, 100), (5000, 500), (500, 100), (5000, 500)]
  with pytest.raises(ValueError, match="'batch' is given twice"):
    workloads.parse_slo_classes("batch:1:2,batch:3:4")
  with pytest.raises(ValueError, match="limits must be finite and > 0 ms"):
    workloads.parse_slo_classes("a:0:2")
  for text in ("a:1:1,", ",a:1:1", "a:1:1,,b:2:2", ""):
    with pytest.raises(ValueError, match="has an empty entry"):
      workloads.parse_slo_classes(text)
