"""A user's policy with a counter of its own, written from
docs/writing-a-policy.md alone (docs/examples/las_policy.py: nothing in
scheduler/ names it), goes everywhere a registered one goes: the kit, the
engine, replay.py, sweep.py, schedule_log.py and compare.py, by
``path/to/file.py:Class``."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from models import llama
from models.config import get_config
from scheduler import conformance
from scheduler import policies
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.engine.sim_executor import VirtualClock

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "las_policy.py"
SPEC = f"{EXAMPLE}:LeastAttainedService"


def _run(script, *args):
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc


def test_the_example_is_not_in_the_scheduler_package():
  assert "las" not in " ".join(p.name for p in (ROOT / "scheduler").iterdir())
  assert not any("LeastAttainedService" in p.read_text()
                 for p in (ROOT / "scheduler").glob("*.py"))


def test_the_counter_policy_passes_the_kit_and_says_what_it_checked():
  report = conformance.check_policy(SPEC)
  assert report.policy_id == "las" and report.has_state
  assert report.rules == tuple(conformance.RULES)
  assert dict(report.skipped) == {"starvation": "starvation_free not declared"}
  assert str(report).startswith("policy 'las' (with a state of its own) passes the 'fast' "
                                "profile: 11 rules on 5 workloads")


def test_the_counter_runs_in_the_engine_and_orders_by_attained_service():
  """Tiny engine, simulated executor, one sequence per iteration: A (8-row
  prompt, 4 outputs) runs first alone; B (one row, 2 outputs) arrives
  after A's first iteration. A's counter is then 8 and B's 0, so B runs
  next, and then alternates with A by the fewest rows attained. The
  counter in the engine's state is each live request's completed rows."""
  cfg = get_config("tiny")
  config = EngineConfig.preset("tiny", policy=SPEC, executor="simulated", max_num_seqs=1,
                               long_prefill_token_threshold=8)
  engine = Engine(cfg, llama.init_params(cfg, jax.random.PRNGKey(0)), config,
                  clock=VirtualClock())
  sampling = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)
  a = engine.add_request("a", list(range(3, 11)), sampling(4))
  engine.step()
  rows = lambda: np.asarray(engine.state.policy_state.rows.value)
  assert rows()[a.slot] == 8
  b = engine.add_request("b", [5], sampling(2))
  engine.step()                       # B's prompt (0 rows < 8)
  assert rows()[b.slot] == 1 and rows()[a.slot] == 8
  engine.step()                       # B decodes (1 < 8)
  assert rows()[b.slot] == 2 and b.outcome == "completed"
  engine.run(max_iterations=20)
  assert a.outcome == "completed" and len(a.output_token_ids) == 4


def test_the_script_flags_take_the_spec():
  policies.check_policy_flag("--policies", [SPEC, "sarathi_serve"])
  with pytest.raises(ValueError, match=r"--policies: .* has no attribute 'Nope'"):
    policies.check_policy_flag("--policies", [f"{EXAMPLE}:Nope"])
  with pytest.raises(ValueError, match=r"--policies must name registered policies"):
    policies.check_policy_flag("--policies", ["las"])


@pytest.mark.extended   # five launches of the tiny preset (compiles), as a user runs them
def test_replay_sweep_schedule_log_and_compare_by_file_spec(tmp_path):
  """Two replays of a synthetic two-client workload (LAS by file path and
  sarathi_serve), compare.py ranking them by the ledger's client service
  gap, a one-trial sweep of both, and schedule_log.py on LAS."""
  common = ["--engine=tiny", "--executor=simulated", "--num_requests=8",
            "--max_prompt_len=24", "--max_output_len=6", "--clients=2", "--priorities=2",
            "--cache_dir="]
  runs = {}
  for name, policy in (("las", SPEC), ("fcfs", "sarathi_serve")):
    runs[name] = tmp_path / f"{name}.json"
    _run("replay.py", *common, f"--policy={policy}", f"--out={runs[name]}")
    report = json.loads(runs[name].read_text())
    assert report["completed"] == 8 and report["config"]["policy_id"] == (
        "las" if name == "las" else "sarathi_serve")
    assert set(report["ledger"]["fairness"]["by_client"]) == {"c0", "c1"}
    assert report["config"]["replay_path"] == {          # the tiny preset caches prefixes
        "path": "step", "why": "EngineConfig.enable_prefix_caching must be False for the "
        "loop (it maps no prefix hits and registers no pages), got True",
        "loop_runs": {"calls": 0, "loop_iterations": 0, "host_iterations": 0,
                      "loop_fraction": None, "exits": {}}}
  looped = tmp_path / "loop.json"
  _run("replay.py", *common, f"--policy={SPEC}", "--noenable_prefix_caching", f"--out={looped}")
  report = json.loads(looped.read_text())
  path = report["config"]["replay_path"]
  assert (path["path"], path["why"]) == ("loop", "")
  # Every iteration of the run is counted once, in the loop or on the host.
  counts = path["loop_runs"]
  assert counts["loop_iterations"] + counts["host_iterations"] == report["engine_outcomes"][
      "iterations"] and counts["loop_iterations"] > 0
  assert counts["calls"] > 0 and set(counts["exits"]) <= {"FULL", "STOP", "IDLE", "HOST",
                                                          "REBASE"}
  table = _run("compare.py", str(runs["fcfs"]), str(runs["las"]),
               "--metric=client_service_gap").stdout
  assert "client_service_gap" in table and "(lower is better)" in table
  assert "las" in table and "sarathi_serve" in table

  trace = tmp_path / "trace.csv"
  trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:10.0000000,20,4\n2023-11-16 18:15:11.0000000,12,6\n"
                   "2023-11-16 18:15:11.5000000,30,3\n")
  out = tmp_path / "sweep"
  _run("sweep.py", f"--trace=azure:{trace}", "--engine=tiny", "--max_model_len=64",
       f"--policies={SPEC},sarathi_serve", "--window_s=4", "--rate_scales=1",
       "--trials=1", f"--out={out}")
  result = json.loads((out / "sweep.json").read_text())
  assert result["policies"] == [SPEC, "sarathi_serve"]
  assert [t["config"]["policy_id"] for t in result["trials"]] == ["las", "sarathi_serve"]
  assert {t["replay_path"]["path"] for t in result["trials"]} == {"step"}
  assert SPEC in _run("compare.py", str(out / "sweep.json")).stdout

  log = tmp_path / "schedule.json"
  _run("schedule_log.py", f"--policies={SPEC}", "--modes=recompute", f"--out={log}")
  run = json.loads(log.read_text())["runs"][f"{SPEC}/recompute"]
  assert run["tokens"] == run["tokens_without_log"] and run["plan_log"]
