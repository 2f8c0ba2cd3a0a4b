"""replay.py's report says what its wall-clock figures ran on: the CPU
(``host_cpu``) and the 1-minute load before and after the replay (a
simulated replay, on a virtual clock, keeps no such field: its report is
the same bytes on every machine; checked in the extended profile)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "--model=random:smollm2-135m,d_model=64,n_heads=4,n_kv_heads=2,ffn_dim=128,n_layers=2"


def _replay(out, *args):
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "replay.py"), "--engine=tiny",
                         MODEL, "--num_requests=2", "--max_prompt_len=16", "--max_output_len=3",
                         "--cache_dir=", f"--out={out}", *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return json.loads(out.read_text())


def test_a_model_replay_names_its_cpu_and_load(tmp_path):
  report = _replay(tmp_path / "model.json")
  assert report["completed"] == 2
  machine = report["machine"]
  assert set(machine) == {"host_cpu", "load_avg_start", "load_avg_end", "replay_wall_s"}
  assert machine["host_cpu"]["cores"] == os.cpu_count()
  assert len(machine["load_avg_start"]) == len(machine["load_avg_end"]) == 3
  # The replay's wall time holds the requests' span (the report's duration).
  assert machine["replay_wall_s"] >= report["duration_s"] > 0


@pytest.mark.extended    # a second replay process
def test_a_simulated_replay_keeps_no_machine_field(tmp_path):
  simulated = _replay(tmp_path / "sim.json", "--executor=simulated")
  assert simulated["completed"] == 2 and "machine" not in simulated
