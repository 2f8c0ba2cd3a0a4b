"""docs/ablations/make_tables.py: the tables are rebuilt from every run or
not at all. Each case writes into a temporary --out and checks that the
tracked docs/ablations/results.json and PNGs are left as they were."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "ablations" / "make_tables.py"
TRACKED = [ROOT / "docs" / "ablations" / name
           for name in ("results.json", "capacity_p99_tbt.png", "vtc_service_difference.png")]
REPRO = ("sarathi512_300s", "sarathi512", "nochunk", "orca")
LONG = ("sarathi_serve", "vllm_v1", "orca", "sjf", "srpt", "spf")


def _digests():
  return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in TRACKED if p.exists()}


@pytest.fixture(autouse=True)
def _tracked_files_unchanged():
  before = _digests()
  yield
  assert _digests() == before


def _run(*args):
  proc = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  return proc.returncode, proc.stdout, proc.stderr


def _capacity_sweep(rates=(1.0, 2.0)):
  trials = [{"rate_scale": r, "offered_rate_req_s": r, "num_requests": 10,
             "report": {"p99_itl_ms": 50.0 * r, "median_ttft_ms": 300.0 * r,
                        "p99_ttft_ms": 900.0 * r},
             "tbt": {"miss_fraction": 0.01 * r}, "attainment": 1.0, "wall_s": 1.0,
             "iterations": 100} for r in rates]
  return {"trials": trials, "load_avg_start": [1.0, 1.0, 1.0],
          "load_avg_end": [1.0, 1.0, 1.0]}


def _vtc_sweep():
  curve = lambda slope: [[t, slope * t] for t in (5.0, 15.0, 25.0, 35.0)]
  trials = [{"policy": p, "client_service": {"client-a": curve(1.0), "client-b": curve(2.0)},
             "fairness": {"client_service_gap": {"gap": 10.0}, "starved": 0},
             "report": {"median_ttft_ms": 1000.0, "p90_ttft_ms": 2000.0},
             "duration_s": 40.0, "wall_s": 1.0, "num_requests": 8, "offered_rate_req_s": 0.2}
            for p in ("vtc", "vllm_v1")]
  return {"trials": trials, "load_avg_start": [1.0] * 3, "load_avg_end": [1.0] * 3}


def _replay_report():
  return {"config": {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 512,
                     "workload": {"last_arrival_s": 30.0}},
          "goodput": {"valid": 80, "offered": 87, "request_goodput": 1.0},
          "ledger": {"fairness": {"starved": 0}}, "p99_itl_ms": 57.0, "mean_ttft_ms": 3700.0,
          "p90_ttft_ms": 6600.0, "mean_e2el_ms": 19300.0, "p90_e2el_ms": 30700.0,
          "num_preemptions": 0, "rejected": 0, "duration_s": 60.0}


def _write_runs(runs: Path, skip=()):
  """Every run the tables read, under ``runs``, but those in ``skip``."""
  files = {f"repro_{k}/sweep.json": _capacity_sweep() for k in REPRO}
  files["vtc_two_clients/sweep.json"] = _vtc_sweep()
  files.update({f"{folder}/{p}.json": _replay_report()
                for folder in ("long", "long_hi") for p in LONG})
  for name, content in files.items():
    if name not in skip:
      (runs / name).parent.mkdir(parents=True, exist_ok=True)
      (runs / name).write_text(json.dumps(content))


def test_a_missing_runs_folder_is_refused_and_nothing_is_written(tmp_path):
  out = tmp_path / "out"
  status, _, stderr = _run(f"--runs={tmp_path / 'nonexistent'}", f"--out={out}")
  assert status == 2
  assert stderr.strip() == (f"error: --runs '{tmp_path / 'nonexistent'}' is not a folder "
                            f"(the runs of docs/ablations.md write into runs/abl)")
  assert not out.exists()


def test_an_empty_runs_folder_is_refused_and_nothing_is_written(tmp_path):
  (tmp_path / "runs").mkdir()
  out = tmp_path / "out"
  status, _, stderr = _run(f"--runs={tmp_path / 'runs'}", f"--out={out}")
  assert status == 2 and len(stderr.strip().splitlines()) == 1, stderr
  assert stderr.startswith(f"error: --runs '{tmp_path / 'runs'}' holds none of the 17 runs "
                           f"the tables are built from"), stderr
  assert not out.exists()


def test_partial_runs_are_refused_naming_the_missing_ones(tmp_path):
  runs, out = tmp_path / "runs", tmp_path / "out"
  _write_runs(runs, skip=("repro_orca/sweep.json", "long_hi/spf.json"))
  out.mkdir()
  status, stdout, stderr = _run(f"--runs={runs}", f"--out={out}")
  assert status == 2 and len(stderr.strip().splitlines()) == 1, stderr
  assert stderr.strip() == (f"error: --runs '{runs}' lacks 2 of the 17 runs the tables are "
                            f"built from: repro_orca/sweep.json, long_hi/spf.json "
                            f"(docs/ablations.md runs them; nothing was written)")
  assert not stdout and not list(out.iterdir())


def test_a_run_that_is_not_json_is_refused(tmp_path):
  runs = tmp_path / "runs"
  _write_runs(runs)
  (runs / "long" / "sjf.json").write_text("{truncated")
  status, _, stderr = _run(f"--runs={runs}", f"--out={tmp_path / 'out'}")
  assert status == 2
  assert stderr.startswith(f"error: --runs '{runs}': long/sjf.json cannot be read as JSON")
  assert not (tmp_path / "out").exists()


def test_every_run_present_writes_the_tables_into_out(tmp_path):
  runs, out = tmp_path / "runs", tmp_path / "out"
  _write_runs(runs)
  status, stdout, stderr = _run(f"--runs={runs}", f"--out={out}", "--long_load_avg=1-2")
  assert status == 0, stderr[-3000:]
  results = json.loads((out / "results.json").read_text())
  assert list(results["repro"]) == [*REPRO, "capacity_ratio_sarathi_over_nochunk"]
  assert sorted(results["vtc"]["policies"]) == ["vllm_v1", "vtc"]
  assert {k: list(v) for k, v in results["long_mix"].items()} == {"long": list(LONG),
                                                                   "long_hi": list(LONG)}
  for name in ("capacity_p99_tbt.png", "vtc_service_difference.png"):
    assert (out / name).stat().st_size > 1000
  assert f"wrote {out}/results.json and PNGs" in stdout


def test_before_shows_the_earlier_figures_beside_the_new(tmp_path):
  """A second build with --before (the first build's results.json) prints
  each new figure with the earlier one in parentheses, and '-' for a rate
  the earlier build lacks."""
  runs, first, second = tmp_path / "runs", tmp_path / "first", tmp_path / "second"
  _write_runs(runs)
  assert _run(f"--runs={runs}", f"--out={first}")[0] == 0
  (runs / "repro_nochunk" / "sweep.json").write_text(json.dumps(_capacity_sweep((1.0, 1.5))))
  status, stdout, stderr = _run(f"--runs={runs}", f"--out={second}",
                                f"--before={first / 'results.json'}")
  assert status == 0, stderr[-3000:]
  lines = stdout.splitlines()
  # 1.5x: P99 TBT 75 ms, median TTFT 450 ms, 1.5% gaps, yes; no earlier row.
  assert "| 1 | 1.00 | 10 | 50 (50) | 300 (300) | 1.00% (1.00%) | yes (yes) |" in lines
  assert "| 1.5 | 1.50 | 10 | 75 (-) | 450 (-) | 1.50% (-) | yes (-) |" in lines
  assert ("| sjf | budget 512, chunk 512 | 57 (57) | 3.7 / 6.6 (3.7 / 6.6) | "
          "19.3 / 30.7 (19.3 / 30.7) | 80 / 87 (80 / 87) | 1.00 (1.00) | 0 (0) | 0 (0) | "
          "0 (0) |") in lines
  # client-b gains 1 per second over client-a: 10 at 10 s.
  assert any(line.startswith("| vtc | 10 (10) | 20 (20) | 30 (30) | 10 (10) | 0 (0) | ")
             for line in lines), stdout
  assert "capacity ratio sarathi_serve / vllm_v1 without chunking: 1.33x (before: 1.00x)" \
      in lines
  assert json.loads((second / "results.json").read_text())["before"] == str(
      first / "results.json")
  (tmp_path / "bad.json").write_text(json.dumps({"repro": {}}))
  status, _, stderr = _run(f"--runs={runs}", f"--out={tmp_path / 'third'}",
                           f"--before={tmp_path / 'bad.json'}")
  assert status == 2 and stderr.strip() == (
      f"error: --before '{tmp_path / 'bad.json'}' is not a results.json of this script: "
      f"it lacks vtc, long_mix")
  assert not (tmp_path / "third").exists()
