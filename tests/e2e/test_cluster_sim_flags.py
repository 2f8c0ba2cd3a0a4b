"""cluster_sim.py's P/D flags and pd_goodput.py's: a bad value is one line
naming the flag and its rule, exit status 2, before the trace or a model
config loads (pd_goodput.py's --table: a file it did not write, named);
cluster_sim.py's SLO flags judge every run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e import refusals


@pytest.fixture(scope="module", autouse=True)
def _stop_refusal_servers():
  yield
  refusals.stop_servers()


@pytest.mark.parametrize("args,line", [
    (["--prefill_replicas=1"],
     "error: --decode_replicas must be given with --prefill_replicas (both or neither)"),
    (["--decode_replicas=2"],
     "error: --prefill_replicas must be given with --decode_replicas (both or neither)"),
    (["--prefill_replicas=0", "--decode_replicas=1"],
     "error: --prefill_replicas must be >= 1, got 0"),
    (["--prefill_replicas=1", "--decode_replicas=0"],
     "error: --decode_replicas must be >= 1, got 0"),
    (["--prefill_replicas=1", "--decode_replicas=1", "--router=fastest"],
     "error: --router must be one of ['distserve', 'prefix_aware', 'round_robin'] for "
     "prefill/decode replicas, got 'fastest'"),
    (["--router=distserve"], "error: --router must be one of ['prefix_aware', 'round_robin'] "
                             "for mixed replicas, got 'distserve'"),
    (["--prefill_replicas=1", "--decode_replicas=1", "--replicas=2"],
     "error: --replicas: give either --replicas (mixed replicas) or "
     "--prefill_replicas/--decode_replicas, not both"),
    (["--link=inter"], "error: --link applies to --prefill_replicas/--decode_replicas only"),
    (["--replicas=2,1,2"], "error: --replicas must not repeat a count (a run each), got 2 "
                           "more than once in ['2', '1', '2']"),
])
def test_cluster_sim_refuses_a_bad_pd_flag_before_loading(args, line):
  assert refusals.refused("cluster_sim.py", *args) == (2, line)


@pytest.mark.parametrize("args,line", [
    (["--splits=1P0D"], "error: --splits entries must be N or PpDd with counts >= 1 (e.g. 2, "
                        "1P2D), got '1P0D'"),
    (["--slos=1000"], "error: --slos entries must be TTFT_MS:TPOT_MS, both > 0, got '1000'"),
    (["--rate_scales=0"], "error: --rate_scales must be finite numbers > 0, got ['0']"),
    (["--rate_scales=1,inf"], "error: --rate_scales must be finite numbers > 0, got "
                              "['1', 'inf']"),
    # The slowest rate's replay is bounded as replay.py's (the synthetic
    # workload's 32 arrivals at --rate_scale 0.1 x 1e-20).
    (["--rate_scales=1e-20,1"], "error: --rate_scales=1e-20: the synthetic workload's 32 "
                                "arrivals would span 6.03e+21 s as replayed; a replay spans at "
                                "most 1e+10 s of virtual time (the engine's float64 clocks "
                                "resolve ~2 us there; further on a step of a few ms is off by "
                                "1% and more)"),
    (["--splits="], "error: --splits must name at least one split (N mixed replicas or PpDd, "
                    "e.g. 2, 1P2D)"),
    # A repeat is the same split or rate however spelled (a split's runs are
    # saved under its name: a second one would overwrite the first).
    (["--splits=1P1D,2,1P1D"], "error: --splits must not repeat a value (each is one row of "
                               "the tables), got '1P1D' more than once in ['1P1D', '2', "
                               "'1P1D']"),
    (["--splits=2,02"], "error: --splits must not repeat a value (each is one row of the "
                        "tables), got '2' more than once in ['2', '02']"),
    (["--rate_scales=1,1"], "error: --rate_scales must not repeat a value (each is a run of "
                            "every split), got 1.0 more than once in ['1', '1']"),
    (["--rate_scales=0.5,1,1.0"], "error: --rate_scales must not repeat a value (each is a run "
                                  "of every split), got 1.0 more than once in ['0.5', '1', "
                                  "'1.0']"),
    (["--table=/missing.json"], "error: --table: '/missing.json' is not a file"),
    (["--table="], "error: --table must name at least one saved pd_goodput.py JSON (its --out)"),
    (["--table=docs"], "error: --table: 'docs' is not a file"),
    # A CPU calibration (the default cost model; --cache_dir= so that no
    # calibration of this machine is found) states no link for a handoff.
    (["--model=tiny", "--engine=tiny", "--cache_dir=", "--splits=2,1P1D"],
     "error: --link=intra: cost model 'cost_model_cpu.json' states no intra link (a profile's "
     "send_recv or links does); the P/D splits ['1P1D'] hand KV over it: give "
     "--cost_model=profile:NAME, a profile that states it (one of ['a100', 'h100', 'h200', "
     "'tpu_v5e', 'tpu_v6e']; e.g. --cost_model=profile:h100), or run mixed splits only"),
    (["--cost_model=configs/calibration/cost_model_cpu.json", "--splits=1P2D,2P1D",
      "--link=inter"],
     "error: --link=inter: cost model 'cost_model_cpu.json' states no inter link (a profile's "
     "send_recv or links does); the P/D splits ['1P2D', '2P1D'] hand KV over it: give "
     "--cost_model=profile:NAME, a profile that states it (one of ['a100', 'h100', 'h200', "
     "'tpu_v5e', 'tpu_v6e']; e.g. --cost_model=profile:h100), or run mixed splits only"),
])
def test_pd_goodput_refuses_a_bad_flag_before_loading(args, line):
  assert refusals.refused("pd_goodput.py", *args) == (2, line)


@pytest.mark.parametrize("text,line", [
    ("", "cannot be read as JSON (Expecting value: line 1 column 1 (char 0))"),
    ("[1, 2]", "is not a pd_goodput.py JSON (it has no 'config.label')"),
    ('{"config": {"label": "x", "engine": {"policy": "orca"}}}',
     "is not a pd_goodput.py JSON (it has no 'config.engine.long_prefill_token_threshold')"),
    ('{"config": {"label": "x", "engine": {"policy": "orca", "max_model_len": 64, '
     '"long_prefill_token_threshold": 64}}, "runs": {}}',
     "is not a pd_goodput.py JSON (it has no 'goodput')"),
    ('{"config": {"label": "x", "engine": {"policy": "orca", "max_model_len": 64, '
     '"long_prefill_token_threshold": 64}}, "goodput": {}, "runs": {}}',
     "is not a pd_goodput.py JSON (its 'goodput' holds no split)"),
])
def test_pd_goodput_refuses_a_table_file_it_did_not_write(tmp_path, text, line):
  """--table reads saved results only: a file that is not JSON, or JSON
  without what the tables read, is refused naming --table and the file."""
  saved = tmp_path / "saved.json"
  saved.write_text(text)
  assert refusals.refused("pd_goodput.py", f"--table={saved}") == (
      2, f"error: --table: {str(saved)!r} {line}")


ARCHIVE = Path(__file__).resolve().parents[2] / "docs/archive/simulator/disaggregation"


def test_pd_goodput_tables_saved_runs_under_the_slo_pairs_they_share(tmp_path):
  """Saved runs judged under different --slos are tabled under the pairs
  every file judged (before, a pair one file lacked was a KeyError); none in
  common is refused naming each file's pairs."""
  conv = json.loads((ARCHIVE / "conv_vllm.json").read_text())
  assert conv["config"]["slos"] == ["1000:100", "1000:50"]
  one = json.loads(json.dumps(conv))
  one["config"]["label"] = "one"
  for by_slo in one["goodput"].values():
    del by_slo["1000:50"]
  saved = tmp_path / "one.json"
  saved.write_text(json.dumps(one))
  status, stdout, stderr = refusals.run("pd_goodput.py",
                                        f"--table={ARCHIVE / 'conv_vllm.json'},{saved}")
  assert status == 0, stderr[-3000:]
  assert [line for line in stdout.splitlines() if line.startswith("SLO")] == [
      "SLO TTFT:TPOT ms 1000:100"]
  code = ARCHIVE / "code_vllm.json"
  assert refusals.refused("pd_goodput.py", f"--table={saved},{code}") == (
      2, f"error: --table: the files judged no SLO pair in common (a table compares its runs "
         f"under one): {{{str(saved)!r}: ['1000:100'], {str(code)!r}: ['2000:100', "
         f"'2000:50']}}")


def test_cluster_sim_judges_each_run_by_the_slo_flags(tmp_path):
  """--slo_ttft_ms / --slo_tpot_ms give each run a ``goodput`` block, printed
  under its line: its SLO-valid count is the hand count over the run's
  request records (TTFT from arrival, TPOT over the later tokens)."""
  out = tmp_path / "cluster.json"
  root = Path(__file__).resolve().parents[2]
  proc = subprocess.run(
      [sys.executable, str(root / "scripts" / "cluster_sim.py"), "--model=tiny", "--engine=tiny",
       "--num_requests=8", "--replicas=1,2", "--noenable_prefix_caching", "--cache_dir=",
       "--slo_ttft_ms=100", "--slo_tpot_ms=17.5", f"--out={out}",
       # One calibration on every machine kind: the limits below split its times.
       "--cost_model=configs/calibration/cost_model_cpu.json"],
      cwd=root, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  lines = [line.strip() for line in proc.stdout.splitlines()]
  # A config preset needs no tokenizer here: --model=tiny is taken.
  assert any(line.startswith("model: tiny (") and "config preset" in line for line in lines)
  report = json.loads(out.read_text())["runs"][0]["report"]
  assert (f"clipped prompts: {report['num_clipped']}" in
          next(line for line in lines if line.startswith("workload: ")))
  valid_counts = []
  for run in json.loads(out.read_text())["runs"]:
    valid = 0
    for r in run["report"]["requests"]:
      times = r["token_times_s"]
      ttft_ms = (times[0] - r["arrival_s"]) * 1e3
      tpot_ms = (times[-1] - times[0]) / (len(times) - 1) * 1e3 if len(times) > 1 else 0.0
      valid += r["outcome"] == "completed" and ttft_ms <= 100 + 1e-6 and tpot_ms <= 17.5 + 1e-6
    g = run["goodput"]
    assert (g["offered"], g["valid"]) == (8, valid), run["replicas"]
    assert f"goodput: {valid}/8 SLO-valid" in "\n".join(lines)
    valid_counts.append(valid)
  assert 0 < sum(valid_counts) < 16      # the limits split the requests

