"""docs/writing-a-policy.md and its worked example, docs/examples/edf_policy.py.

The guide's code block is the shipped file, byte for byte, and its rule
table names the kit's rules, so neither can drift; the example, loaded as a
user would (``--policy=path/to/file.py:Class``), passes the kit and runs the engine
on SLO-carrying requests in deadline order. The command-line walk of the
guide (two replays, compare) runs in the extended profile.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from models import llama
from models.config import get_config
from scheduler import conformance
from scheduler.policies import Budgets, make_policy
from scheduler import policy_loader
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.engine.sim_executor import VirtualClock

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "writing-a-policy.md"
EXAMPLE = ROOT / "docs" / "examples" / "edf_policy.py"
SPEC = f"{EXAMPLE}:EarliestDeadlineFirst"
EarliestDeadlineFirst = policy_loader.load_factory(SPEC)


def _python_blocks(text):
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_guide_shows_the_shipped_example_and_the_kit_rules():
  text = GUIDE.read_text()
  blocks = [b for b in _python_blocks(text) if b.startswith('"""Earliest TTFT')]
  assert blocks == [EXAMPLE.read_text()]
  counter = EXAMPLE.with_name("las_policy.py").read_text()
  assert [b for b in _python_blocks(text) if b.startswith('"""Least attained')] == [counter]
  assert len(EXAMPLE.read_text().splitlines()) <= 60
  table = re.findall(r"^\| `(\w+)` \|", text.split("## Check it")[1], flags=re.M)
  assert table == list(conformance.RULES)
  readme = (ROOT / "README.md").read_text()
  assert "docs/writing-a-policy.md" in readme


def test_a_bad_cap_is_refused_by_name():
  with pytest.raises(ValueError, match="EarliestDeadlineFirst.max_ttft_ms must be > 0"):
    EarliestDeadlineFirst(Budgets(token_budget=8, seq_budget=2, chunk_cap=4), max_ttft_ms=0)


def test_the_example_loads_passes_the_kit_and_runs_in_deadline_order():
  """Tiny engine, simulated executor, 16-row budget and 8-row chunks: a
  48-token prompt with a loose TTFT SLO (5 s) arrives first, then four
  8-token prompts with a 50 ms one. EDF gives the four their first tokens
  before the long one's; everything completes."""
  policy = make_policy(SPEC, Budgets(token_budget=16, seq_budget=4, chunk_cap=8))
  assert policy.policy_id == "edf" and policy.starvation_free
  cfg = get_config("tiny")
  config = EngineConfig.preset("tiny", policy=SPEC, executor="simulated",
                               long_prefill_token_threshold=8)
  engine = Engine(cfg, llama.init_params(cfg, jax.random.PRNGKey(0)), config,
                  clock=VirtualClock())
  sampling = SamplingParams(max_tokens=3, ignore_eos=True)
  long = engine.add_request("long", list(range(3, 51)), sampling, slo_ttft_ms=5000.0)
  short = [engine.add_request(f"s{i}", list(range(10 + i, 18 + i)), sampling,
                              slo_ttft_ms=50.0) for i in range(4)]
  engine.run(max_iterations=100)
  assert [r.outcome for r in [long] + short] == ["completed"] * 5
  assert engine.policy.policy_id == "edf"
  assert max(r.token_times_ms[0] for r in short) < long.token_times_ms[0]


def _replay(*args):
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "replay.py"), *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.extended   # two replays on the tiny preset (compiles), as a user runs them
def test_the_guide_commands_run_and_compare(tmp_path):
  """The guide's walk: a replay with the example by file path, one with
  sarathi_serve, and compare.py ranking the two (equal coordinates)."""
  common = ["--engine=tiny", "--executor=simulated",
            "--num_requests=8", "--max_prompt_len=32", "--max_output_len=8",
            "--slo_class=interactive:500:100,batch:5000:500", "--cache_dir="]
  runs = {}
  for name, policy in (("edf", f"{EXAMPLE}:EarliestDeadlineFirst"),
                       ("fcfs", "sarathi_serve")):
    runs[name] = tmp_path / f"{name}.json"
    proc = _replay(*common, f"--policy={policy}", f"--out={runs[name]}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads(runs[name].read_text())["completed"] == 8
  table = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare.py"),
                          str(runs["fcfs"]), str(runs["edf"])], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
  assert table.returncode == 0, table.stderr[-2000:]
  assert "edf" in table.stdout and "sarathi_serve" in table.stdout
