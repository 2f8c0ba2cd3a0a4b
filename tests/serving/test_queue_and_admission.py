"""Admission facts through the engine: exact KV rows, victims, the queue.

Every case drives ``Engine`` with the tiny random-weight model. Facts about
scheduling and KV accounting alone (KV rows, victims, the visible queue, its
bound) run on the simulated executor: the engine's own plan and step programs, policy,
validation and publication programs, with only the model call replaced, at
about half the compile cost; the cases that compare tokens run the model.
"""

import dataclasses

import numpy as np
import pytest

from scheduler.policies import POLICIES
from serving.engine import cost_model as cost_lib
from serving.harness import metrics
from serving.harness import workloads
from serving.kv import pages as kv_pages
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.harness.replay import replay
from serving.engine.sim_executor import VirtualClock
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
  config = dataclasses.replace(BASE, num_pages=num_pages, policy=policy, executor="simulated")
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


def test_a_request_the_policy_can_never_schedule_is_told_why_and_the_fix(params):
  """ORCA prefills a prompt whole: a 20-token prompt can never fit the
  16-token budget. Admission took it (20 + 4 - 1 = 23 KV rows, 6 pages of
  4; num_pages=10 is the null page and 9 usable), so the policy rejects it,
  its reason in the admission rejection's wording: the pages' makeup, and
  the budget that takes the prompt whole. The other request completes."""
  config = dataclasses.replace(BASE, num_pages=10, watermark_pages=2, policy="orca",
                               executor="simulated")
  engine = Engine(CFG, params, config)
  wide = engine.add_request("wide", _prompts([20])[0], SamplingParams(max_tokens=4))
  ok = engine.add_request("ok", _prompts([5])[0], SamplingParams(max_tokens=4))
  engine.run(max_iterations=50)
  assert (wide.outcome, wide.finish_reason) == (
      "rejected", "policy orca can never schedule it: its prompt has 20 tokens, the token "
                  "budget (max_num_batched_tokens) 16; it needs 6 KV pages for 23 KV rows "
                  "(prompt + max_tokens - 1); the cache has 9 (num_pages 10 less page 0, the "
                  "null page; its 2 watermark pages are kept free only while other requests "
                  "run); to run its prompt whole, raise max_num_batched_tokens "
                  "(--max_num_batched_tokens) to at least 20")
  assert ok.outcome == "completed"


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
                               policy=policy, executor="simulated")
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


@pytest.mark.parametrize("policy,victim", [("vllm_v1_priority", 0), ("vllm_v1", 1)])
def test_a_recompute_victim_is_not_pushed_out_over_and_over(params, policy, victim):
  """num_pages=17, page_size=4: R0 (priority 1) and R1 (priority 0), 20-token
  prompts and 30 outputs each, need 13 pages each at their largest, so they
  cannot both finish together; the victim (R0 by priority, R1 as the tail of
  vLLM's FCFS running queue) is preempted and rebuilds. Readmitted as soon
  as its next chunk fit, vllm_v1_priority's victim was pushed out by its
  peer's next page 10 times; now once (``conformance.thrash_bound`` allows
  2)."""
  config = EngineConfig.preset("tiny", num_pages=17, page_size=4, max_num_seqs=4,
                               policy=policy, executor="simulated")
  engine = Engine(CFG, params, config)
  reqs = [engine.add_request(f"R{i}", p, SamplingParams(max_tokens=30, ignore_eos=True),
                             priority=1 - i)
          for i, p in enumerate(_prompts([20] * 2))]
  engine.run(max_iterations=400)
  assert [r.outcome for r in reqs] == ["completed"] * 2
  assert reqs[victim].num_preemptions == 1
  assert reqs[1 - victim].num_preemptions == 0


# --------------------------------------------------- the whole queue is visible
def _fake_clock():
  t = [0.0]

  def clock():
    t[0] += 1e-3                              # 1 ms per reading
    return t[0]

  return clock


def test_a_priority_request_overtakes_a_backlog(params):
  """vllm_v1_priority, 4 seqs: 20 priority-5 requests, one step, then one
  priority-0 request: it is the next request admitted. (32 slots from the
  start, one table size: the growth is test_queue_bound_refuses_with_a_typed_error's.)"""
  config = EngineConfig.preset("tiny", policy="vllm_v1_priority", max_request_slots=32,
                               max_num_seqs=4, executor="simulated")
  engine = Engine(CFG, params, config)
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
  assert all(r.outcome == "completed" for r in engine.requests.values())


def test_vtc_serves_a_new_client_behind_a_deep_backlog(params):
  """vtc, 32 slots (one table size): client A sends 29 requests, then client
  B 3. All are visible, so VTC's smaller counter (B's, at 0) wins a slot
  among the first admissions once A has been served."""
  config = EngineConfig.preset("tiny", policy="vtc", max_request_slots=32,
                               executor="simulated")
  engine = Engine(CFG, params, config)
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
  from serving.engine.requests import QueueFull
  config = EngineConfig.preset("tiny", max_request_slots=16, max_queued_requests=32,
                               executor="simulated")
  engine = Engine(CFG, params, config)
  resize, sizes = engine._resize, []
  engine._resize = lambda size: (sizes.append(size), resize(size))
  sampling = SamplingParams(max_tokens=2, ignore_eos=True)
  for i, p in enumerate(_prompts([4] * 32)):
    engine.add_request(f"r{i}", p, sampling)
  with pytest.raises(QueueFull, match="max_queued_requests=32"):
    engine.add_request("late", _prompts([4])[0], sampling)
  assert "late" not in engine.requests
  engine.run(max_iterations=200)
  assert sizes[0] == 32, sizes                   # 16 -> 32, the bound
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


def _trace(params, policy, num_slots, workload, cost_file=None):
  """One run of ``workload``: its plans, tokens and the largest size its
  slot table reached; with ``cost_file`` on the simulated executor
  (only the model call is replaced: the same tick, policy, validation and
  apply programs decide) and a virtual clock, else on the model."""
  executor = dict(executor="simulated", cost_model=cost_file) if cost_file else {}
  config = EngineConfig.preset("tiny", policy=policy, max_num_seqs=2, num_pages=12,
                               max_request_slots=num_slots, max_queued_requests=6,
                               **executor)
  engine = Engine(CFG, params, config,
                  clock=VirtualClock() if cost_file else _fake_clock())
  resize, sizes = engine._resize, [num_slots]
  engine._resize = lambda size: (sizes.append(size), resize(size))
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
  return plans, tokens, max(sizes)


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("cost") / "cost.json"
  cost_lib.CostModel.of(step=5.0, rows=0.5, attention_gflop=2000.0,
                      kv_read_gb=400.0).save(path)
  return str(path)


# Four policies, each ordering by a different fact (MLFQ level, slack, aging,
# a fairness counter), to bound the suite's time; the other seven (orca,
# sarathi, sarathi_serve, vllm_v1, vllm_v1_priority, prefix_aware,
# vtc_completion_reconciled) pass this check too: add them here to run it.
SLOT_TABLE_POLICIES = ["fastserve", "least_slack", "priority_aging", "vtc"]


# On the simulated executor these are in the extended profile: the conformance
# kit's whole_queue rule checks every registered policy in the default one.
@pytest.mark.parametrize("policy, executor", [pytest.param(p, "simulated",
                                                           marks=pytest.mark.extended)
                                              for p in SLOT_TABLE_POLICIES]
                         + [pytest.param("vtc", "model", marks=pytest.mark.extended)])
def test_decisions_do_not_depend_on_the_slot_table_size(params, cost_file, policy, executor):
  """Metamorphic: a random workload (priorities, three clients, arrivals
  over four steps, KV pressure) gives the same admission order, the same
  (request, interval, kind) pairs in every iteration and the same tokens
  whether the slot table starts just above max_num_seqs (3, growing to 6 as
  requests queue) or holds the whole workload from the start (6). Four
  policies run on the simulated executor (the engine's own planning programs
  with the model call replaced, a virtual clock); one runs on the model
  (an injected clock), so real tokens are compared too."""
  workload = _random_workload(seed=sorted(POLICIES).index(policy))
  costs = cost_file if executor == "simulated" else None
  small = _trace(params, policy, 3, workload, costs)
  large = _trace(params, policy, 6, workload, costs)
  assert small[2] == large[2] == 6
  assert small[0] == large[0]
  assert small[1] == large[1]
  assert all(outcome in ("completed", "rejected") for outcome, _ in small[1].values())


# ------------------------------------------------------------ SLOs end to end
# ~25 s; least_slack's plans are in the conformance kit and test_planning_cost
@pytest.mark.extended
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


# ------------------------------------------- §0x06 reservation under unknown length
# page_size 1, so a KV row is a page: 29 pages = the article's 28-row hard
# ceiling plus the null page; watermark W = 4 rows (soft ceiling 24).
RESERVE = dataclasses.replace(BASE, page_size=1, num_pages=29, max_num_batched_tokens=32,
                              enable_prefix_caching=False)
RESERVE_KINDS = {"policy": {}, "max": {}, "point": {}, "quantile": {},
                 "watermark": {"watermark_pages": 4}}


def _reservation_engine(params, kind, executor="simulated", **overrides):
  config = dataclasses.replace(RESERVE, reservation=kind, executor=executor,
                               **{**RESERVE_KINDS[kind], **overrides})
  engine = Engine(CFG, params, config)
  engine.record_plans = True
  return engine


def _warm_up(engine, lengths):
  """Completes one request per output length (4-token prompts, EOS ignored):
  the online facts the point / quantile estimators read."""
  for i, (n, p) in enumerate(zip(lengths, _prompts([4] * len(lengths), seed=7))):
    engine.add_request(f"W{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
  engine.run(max_iterations=100)


@pytest.mark.parametrize("kind, admitted, executor", [
    # The 8 base rows are Z (8-token prompt, one output); A, B, C have
    # 4-token prompts and max_tokens 18. Completed outputs [1, 1, 7] give
    # point G_hat = ceil(9 / 3) = 3 and p90 G_hat = 7 (nearest rank 3 of 3).
    ("policy", ["Z", "A", "B", "C"], "simulated"),  # on demand: 8 + 4 + 4 + 4 = 20 <= 28
    ("max", ["Z"], "simulated"),                     # 8 + (4 + 17) = 29 > 28: A waits
    ("point", ["Z", "A", "B", "C"], "simulated"),    # 8 + 3 * (4 + 2) = 26 <= 28
    pytest.param("point", ["Z", "A", "B", "C"], "model", marks=pytest.mark.extended),
    pytest.param("quantile", ["Z", "A", "B"], "simulated",  # 8 + 2 * (4 + 6) = 28; C: 38 > 28
                 marks=pytest.mark.extended),
    ("watermark", ["Z", "A"], "simulated"),          # 8 + 10 = 18 <= 24; B: 28 > 24 = 28 - 4
])
def test_reservation_kind_decides_the_first_admissions(params, kind, admitted, executor):
  """§0x06 Loop 5 shape through the engine: the reservation kind alone
  decides who is admitted in the first plan; every request then completes.
  "max" reserves every row a request can write, so it never extends nor
  preempts; "point" reserves 6 of the 21 rows A, B and C write, so they
  extend and, the cache being short, the victim rule preempts. Every kind
  runs on the simulated executor (admission is the policy's and the
  reservation's business alone); "point", the kind that extends and
  preempts, also runs the model, whose tokens must equal those of Z, A, B
  and C run one at a time."""
  engine = _reservation_engine(params, kind, executor)
  _warm_up(engine, [1, 1, 7])
  z, *abc = _prompts([8, 4, 4, 4], seed=3)
  reqs = [engine.add_request("Z", z, SamplingParams(max_tokens=1, ignore_eos=True))]
  reqs += [engine.add_request(name, p, SamplingParams(max_tokens=18, ignore_eos=True))
           for name, p in zip("ABC", abc)]
  engine.step()
  assert engine.plan_log[-1]["admitted"] == admitted
  engine.run(max_iterations=800)
  assert [r.outcome for r in reqs] == ["completed"] * 4
  assert [len(r.output_token_ids) for r in reqs] == [1, 18, 18, 18]
  if executor == "model":
    assert [r.output_token_ids for r in reqs] == _reference_tokens(params)
  extensions = sum(r.num_extensions for r in reqs)
  preemptions = sum(r.num_preemptions for r in reqs)
  if kind == "max":
    assert (extensions, preemptions) == (0, 0)
  if kind == "point":
    assert extensions > 0 and preemptions > 0


_TOKENS = {}


def _reference_tokens(params):
  """Z, A, B, C run one at a time on the model (no batching; 21 rows fit
  the 28 pages, so no pressure): the tokens a batched run must reproduce."""
  if "ref" not in _TOKENS:
    engine = _reservation_engine(params, "point", "model")
    z, *abc = _prompts([8, 4, 4, 4], seed=3)
    out = []
    for name, p, m in zip("ZABC", [z, *abc], [1, 18, 18, 18]):
      req = engine.add_request(name, p, SamplingParams(max_tokens=m, ignore_eos=True))
      engine.run(max_iterations=100)
      out.append(req.output_token_ids)
    _TOKENS["ref"] = out
  return _TOKENS["ref"]


@pytest.mark.parametrize("kind, extensions", [
    # A: 4-token prompt, 6 outputs, so 4 + 6 - 1 = 9 rows (= pages). One
    # completed request of 3 outputs: G_hat = 3 for point, p90 and
    # watermark, reserving 4 + 3 - 1 = 6 rows.
    ("policy", 5),     # on demand: the prompt's 4 rows, then rows 4..8
    ("max", 0),        # all 9 rows reserved at admission
    ("point", 3),      # rows 6, 7, 8 lie past the reserved frontier
    ("quantile", 3),
    ("watermark", 3),
])
def test_an_extension_is_the_decode_row_past_the_reserved_frontier(
    params, kind, extensions):
  engine = _reservation_engine(params, kind)
  _warm_up(engine, [3])
  req = engine.add_request("A", _prompts([4], seed=5)[0],
                           SamplingParams(max_tokens=6, ignore_eos=True))
  steps = []
  while not req.finished:
    engine.step()
    steps.append(int(np.asarray(engine.state.num_extensions)[req.slot]))
  assert req.num_extensions == extensions
  if kind == "point":
    # Step 1 prefills rows 0..3 (output 1); step k >= 2 decodes row k + 2.
    # Rows 6, 7, 8 (steps 4, 5, 6) are the extensions.
    assert steps == [0, 0, 0, 1, 2, 3]


def test_reservation_settings_name_the_field():
  with pytest.raises(ValueError, match="EngineConfig.reservation must be one of"):
    dataclasses.replace(BASE, reservation="p90")
  with pytest.raises(ValueError, match="watermark_pages must be >= 1"):
    dataclasses.replace(BASE, reservation="watermark")
  with pytest.raises(ValueError, match=r"num_pages must be > watermark_pages = "):
    dataclasses.replace(BASE, reservation="watermark", watermark_pages=BASE.num_pages)
  dataclasses.replace(BASE, reservation="watermark", watermark_pages=BASE.num_pages - 1)
  with pytest.raises(ValueError, match="reservation_quantile must be in"):
    dataclasses.replace(BASE, reservation="quantile", reservation_quantile=0.0)
