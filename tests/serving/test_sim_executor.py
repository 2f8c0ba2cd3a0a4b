"""Simulated executor, virtual clock, cost model and the §0x07 ledger."""

import json

import numpy as np
import pytest

from serving.engine import cost_model as cost_lib
from serving.harness import ledger
from serving.harness import metrics
from serving.harness import synthetic
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.harness.replay import replay, run_config
from serving.engine.sim_executor import VirtualClock
from tests.serving.engine_testing import CFG, prompts, save_test_cost_model, step_ms


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
  return save_test_cost_model(tmp_path_factory.mktemp("cost") / "cost.json")


def _sim_engine(params, cost_file, **overrides):
  cfg = EngineConfig.preset("tiny", executor="simulated", cost_model=cost_file, **overrides)
  return Engine(CFG, params, cfg)


def _workload(seed, n=16):
  return synthetic.synthetic_azure_conv(
      n, rate_scale=2.0, seed=seed, max_prompt_len=30, max_output_len=12,
      vocab_size=CFG.vocab_size, reserved_token_ids=frozenset({0, 1}))


def _report_bytes(params, cost_file, path):
  engine = _sim_engine(params, cost_file)
  wl = _workload(3)
  sampler = ledger.ResourceSampler(engine)
  records, duration_s = replay(engine, wl, realtime=False, on_progress=sampler)
  report = metrics.build_report(records, duration_s, run_config(engine, "tiny"),
                                num_offered=len(wl))
  report["ledger"] = ledger.build_ledger(records, duration_s=duration_s, ttft_ms=200.0,
                                         tpot_ms=30.0, tbt_ms=30.0, engine=engine,
                                         sampler=sampler)
  metrics.write_report(path, report)
  return path.read_bytes(), records, engine


def test_simulated_replays_are_byte_identical_and_admit_by_virtual_time(
    params, cost_file, tmp_path):
  a, records, engine = _report_bytes(params, cost_file, tmp_path / "a.json")
  b, _, _ = _report_bytes(params, cost_file, tmp_path / "b.json")
  assert a == b
  wl = {s.request_id: s for s in _workload(3)}
  for r in records:
    # Arrivals keep their recorded offsets on the virtual clock; every
    # request ran to its recorded length.
    assert r.arrival_s == pytest.approx(wl[r.request_id].arrival_s, abs=1e-9)
    assert r.outcome == "completed" and r.output_tokens == wl[r.request_id].max_tokens
    assert r.first_token_s > r.arrival_s
  # Engine time is the sum of modelled step times: alone on an idle engine,
  # a 20-token prompt gets its first token after 3 chunks (cap 8): a chunk
  # [s, e) computes (e - s)(s + e + 1)/2 query-key pairs and reads e cached
  # keys; then 1 decode step of 21 pairs and 21 keys.
  engine = _sim_engine(params, cost_file)
  req = engine.add_request("solo", prompts([20])[0], SamplingParams(max_tokens=2))
  engine.run()
  t_ms = sum(step_ms(n, pairs, keys) for n, pairs, keys in ((8, 36, 8), (8, 100, 16),
                                                              (4, 74, 20)))
  assert req.token_times_ms[0] == pytest.approx(t_ms, rel=1e-6)
  assert req.token_times_ms[1] - req.token_times_ms[0] == pytest.approx(
      step_ms(1, 21, 21), rel=1e-6)
  report = json.loads(a)
  assert report["config"]["executor"] == "simulated"
  assert report["config"]["clock"] == "virtual"


def test_hidden_output_length_ends_the_request_and_stays_out_of_the_policy(
    params, cost_file):
  engine = _sim_engine(params, cost_file)
  engine.realized_output_tokens["short"] = 3
  req = engine.add_request("short", prompts([10])[0], SamplingParams(max_tokens=20))
  long = engine.add_request("long", prompts([6], seed=1)[0], SamplingParams(max_tokens=5))
  engine.run()
  assert (req.outcome, req.finish_reason, len(req.output_token_ids)) == ("completed", "eos", 3)
  assert req.output_token_ids[-1] in CFG.eos_token_ids
  assert (long.finish_reason, len(long.output_token_ids)) == ("length", 5)
  assert engine.manifest.hidden_realized_output_tokens is None


def test_simulated_executor_refuses_a_wall_clock(params, cost_file):
  cfg = EngineConfig.preset("tiny", executor="simulated", cost_model=cost_file)
  with pytest.raises(ValueError, match="VirtualClock"):
    Engine(CFG, params, cfg, clock=lambda: 0.0)
  with pytest.raises(ValueError, match="executor"):
    EngineConfig.preset("tiny", executor="fast")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ledger_partition_closes_on_random_workloads_with_aborts(params, cost_file, seed):
  rng = np.random.default_rng(seed)
  engine = _sim_engine(params, cost_file)
  wl = _workload(10 + seed, n=14)
  victims = set(rng.choice([s.request_id for s in wl], 4, replace=False))
  steps = [0]

  def abort_some(outputs):
    steps[0] += 1
    for rid in list(victims):
      if rid in engine.requests and rng.random() < 0.3:
        engine.abort(rid)
        victims.discard(rid)

  records, duration_s = replay(engine, wl, realtime=False, on_step=abort_some)
  horizon = float(np.median([r.token_times_s[-1] for r in records if r.token_times_s]))
  out = ledger.build_ledger(records, duration_s=duration_s, ttft_ms=100.0, tpot_ms=20.0,
                            tbt_ms=20.0, horizon_s=horizon, cohort_s=1.0, engine=engine)
  total = out["outcomes"]["total"]
  assert total["offered"] == len(wl)
  assert sum(total[p] for p in ledger.PARTS) == len(wl)
  assert total["cancelled"] == sum(r.outcome == "cancelled" for r in records) >= 1
  assert total["open_at_horizon"] >= 1
  for group in out["outcomes"]["by_cohort"] + list(out["outcomes"]["by_client"].values()):
    assert sum(group[p] for p in ledger.PARTS) == group["offered"]
  assert sum(c["offered"] for c in out["outcomes"]["by_cohort"]) == len(wl)
  # Independent count of the valid requests.
  valid = sum(1 for r in records if r.outcome == "completed" and r.token_times_s[-1] <= horizon
              and r.ttft_s <= 0.1 and (r.tpot_s is None or r.tpot_s <= 0.02))
  assert total["valid"] == valid
  gaps = [b - a for r in records for a, b in zip(r.token_times_s, r.token_times_s[1:])]
  assert out["tbt"]["deadline_misses"] == sum(g > 0.02 for g in gaps)


def test_comparison_refuses_runs_whose_coordinates_differ(params, cost_file, tmp_path):
  from serving.harness import ablation
  raw, _, _ = _report_bytes(params, cost_file, tmp_path / "r.json")
  base = json.loads(raw)
  other = json.loads(raw)
  other["config"]["policy_id"] = "vllm_v1"          # the compared variable
  ablation.check_comparable([base, other])
  for path, value, coordinate in (
      (("ledger", "slo", "ttft_ms"), 500.0, "slo"),
      (("config", "cost_model", "coef_ms", "step"), 6.0, "cost_model"),
      (("config", "max_num_batched_tokens"), 32, "engine_config"),
      (("config", "workload"), {"source": "azure", "window_s": [0, 60]}, "trace"),
      (("config", "executor"), "model", "executor")):
    changed = json.loads(raw)
    node = changed
    for key in path[:-1]:
      node = node[key]
    node[path[-1]] = value
    with pytest.raises(ValueError, match=f"coordinate '{coordinate}' differs"):
      ablation.check_comparable([base, changed], ["a", "b"])


def test_g_star_follows_distserve_definition():
  from serving.harness import ablation
  g = ablation.g_star([1.0, 2.0, 4.0, 8.0], [1.0, 0.95, 0.85, 0.2], 0.9)
  assert g["g_star"] == 2.0
  assert g["g_star_interpolated"] == pytest.approx(2.0 + 2.0 * 0.05 / 0.10)
  assert ablation.g_star([1.0, 2.0], [0.5, 0.99], 0.9)["g_star"] is None


def test_g_star_says_whether_the_rates_tried_bracket_it():
  """Worked by hand at alpha = 0.9: a grid the attainment crosses brackets
  G*; one where every rate meets alpha gives only a lower bound (the highest
  rate); one whose lowest rate misses gives only '< lowest rate'."""
  from serving.harness import ablation
  # Crossing between 2 (0.95) and 4 (0.85): 2 + (4 - 2) * (0.95 - 0.9) / (0.95 - 0.85) = 3.
  g = ablation.g_star([1.0, 2.0, 4.0, 8.0], [1.0, 0.95, 0.85, 0.2], 0.9)
  assert g == {"alpha": 0.9, "g_star": 2.0, "g_star_interpolated": pytest.approx(3.0),
               "bracketed": True, "g_star_is_lower_bound": False,
               "g_star_below_lowest_rate": False, "bracket": [2.0, 4.0]}
  assert ablation.g_star_text(g) == "2" and ablation.g_star_text(g, "g_star_interpolated") == "3"
  assert ablation.g_star_note(g) == "bracketed: 2 req/s meets alpha=0.9, 4 misses; interpolated 3"
  # Every rate meets (0.9 exactly counts): G* >= the highest rate, 2.
  g = ablation.g_star([0.5, 1.0, 2.0], [1.0, 0.97, 0.9], 0.9)
  assert g == {"alpha": 0.9, "g_star": 2.0, "g_star_interpolated": 2.0, "bracketed": False,
               "g_star_is_lower_bound": True, "g_star_below_lowest_rate": False,
               "bracket": [2.0, None]}
  assert ablation.g_star_text(g) == ">= 2"
  assert ablation.g_star_note(g) == "every rate tried met the SLOs: raise --rate_scales"
  # The lowest rate misses (a higher one meeting does not count): G* < 0.5.
  g = ablation.g_star([0.5, 1.0], [0.8, 0.95], 0.9)
  assert g == {"alpha": 0.9, "g_star": None, "g_star_interpolated": None, "bracketed": False,
               "g_star_is_lower_bound": False, "g_star_below_lowest_rate": True,
               "bracket": [None, 0.5]}
  assert ablation.g_star_text(g) == "< 0.5"
  assert ablation.g_star_note(g) == "the lowest rate tried missed the SLOs: lower --rate_scales"
  # One rate that meets: a lower bound, not a measurement.
  assert ablation.g_star([3.0], [1.0], 0.9)["g_star_is_lower_bound"]


def test_model_executor_on_a_virtual_clock_repeats_schedule_and_report(
    params, cost_file, tmp_path):
  """--clock=virtual with the real model: time is the cost model's, so the
  schedule, token times and tokens repeat bit for bit, and the schedule is
  the simulated executor's (same lengths: the trace's max_tokens)."""
  def run(executor, path):
    cfg = EngineConfig.preset("tiny", executor=executor, cost_model=cost_file)
    engine = Engine(CFG, params, cfg, clock=VirtualClock())
    engine.record_plans = True
    wl = _workload(5, n=8)
    records, duration_s = replay(engine, wl, realtime=False)
    metrics.write_report(path, metrics.build_report(
        records, duration_s, run_config(engine, "tiny"), num_offered=len(wl)))
    return path.read_bytes(), engine.plan_log, [r.token_times_s for r in records]

  a, plans_a, times_a = run("model", tmp_path / "a.json")
  b, plans_b, _ = run("model", tmp_path / "b.json")
  assert a == b and plans_a == plans_b
  _, plans_sim, times_sim = run("simulated", tmp_path / "s.json")
  assert [p["scheduled"] for p in plans_sim] == [p["scheduled"] for p in plans_a]
  assert times_sim == times_a


def test_engine_checks_the_calibration_it_is_given(params, tmp_path, capfd):
  """A calibration made on another device gets a one-line warning; one
  fitted on another model only is refused, naming it."""
  tiny = cost_lib.model_costs(CFG)
  other = cost_lib.model_costs(CFG.__class__(**{**CFG.__dict__, "d_model": 128}))
  for name, models, device in (("elsewhere", [tiny.to_json()], {"id": "0123456789ab",
                                                                 "cpu": "another cpu"}),
                               ("wrong_model", [other.to_json()], {})):
    cost_lib.CostModel.of(step=1.0, meta={"models": models, "device": device,
                                          "model": name}).save(tmp_path / f"{name}.json")
  cfg = EngineConfig.preset("tiny", executor="simulated",
                            cost_model=str(tmp_path / "elsewhere.json"))
  Engine(CFG, None, cfg, clock=VirtualClock())
  err = capfd.readouterr().err
  assert "was calibrated on another device than this one: another CPU model (another cpu vs " in err
  assert "(id 0123456789ab vs " in err
  assert len([line for line in err.splitlines() if line.startswith("cost model:")]) == 1
  cfg = EngineConfig.preset("tiny", executor="simulated",
                            cost_model=str(tmp_path / "wrong_model.json"))
  with pytest.raises(ValueError, match="fitted on one model only \\(wrong_model"):
    Engine(CFG, None, cfg, clock=VirtualClock())


def test_table_ranks_latencies_lower_first_and_shows_rejections():
  from serving.harness import ablation
  rows = [{"name": "a", "policy": "orca", "median_ttft_ms": 900.0, "rejected": 20},
          {"name": "b", "policy": "sarathi_serve", "median_ttft_ms": 300.0, "rejected": 0}]
  lines = ablation.table(rows, "median_ttft_ms", ["rejected"]).splitlines()
  assert "(lower is better)" in lines[0] and lines[0].split()[3] == "rejected"
  assert [line.split()[0] for line in lines[1:]] == ["b", "a"]
  assert lines[2].split()[-1] == "20"
  goodput = [dict(r, request_goodput=g) for r, g in zip(rows, (0.18, 0.0))]
  assert ablation.table(goodput, "request_goodput").splitlines()[1].split()[0] == "a"
  assert not ablation.lower_is_better("request_goodput") and ablation.lower_is_better("rejected")
