"""replay.py's model and workload flags: a config preset on the simulated
executor, a trace's window checked before any model loads, --window_s's two
forms, the flags --help lists, and a model flag's refusal naming its value
once."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving.cli import launch
from tests.e2e import refusals
from tests.serving.engine_testing import free_port

ROOT = Path(__file__).resolve().parents[2]
WINDOW_RULE = ("--window_s must be N > 0 (the trace's first N seconds of arrivals) or A,B "
               "with 0 <= A < B (its arrivals in [A, B) seconds after the first), finite")
WITH_WEIGHTS = "['smollm2-135m'], a *.gguf file or an HF directory"


@pytest.fixture(scope="module", autouse=True)
def _stop_refusal_servers():
  yield
  refusals.stop_servers()



def test_a_config_preset_replays_on_the_simulated_executor(tmp_path):
  """``--model=tiny`` (a config, no weights, no tokenizer) replays with
  --executor=simulated, as sweep.py and bench_sim.py take it."""
  out = tmp_path / "replay.json"
  status, stdout, stderr = refusals.run(
      "replay.py", "--executor=simulated", "--model=tiny", "--engine=tiny",
      "--num_requests=2", "--max_output_len=2", f"--out={out}")
  assert status == 0, stderr[-3000:]
  assert ("model: tiny (llama, 2 layers, d_model 64, context 64 (the model's 512)) config "
          "preset (simulated executor: no weights); attention: none (simulated executor)\n"
          ) in stdout
  report = json.loads(out.read_text())
  assert (report["config"]["model"], report["config"]["family"]) == ("tiny", "llama")
  assert (report["completed"], report["total_output_tokens"]) == (2, 4)


@pytest.mark.parametrize("script,args,line", [
    ("replay.py", [],
     f"error: --model=tiny: a config preset without weights runs only on the simulated "
     f"executor (--executor=simulated); models with weights: {WITH_WEIGHTS}"),
    ("replay.py", ["--executor=model", "--trace=azure:{trace}"],
     f"error: --model=tiny: a config preset without weights runs only on the simulated "
     f"executor (--executor=simulated); models with weights: {WITH_WEIGHTS}"),
    ("generate.py", ["--prompt=hi", "--executor=simulated", "--engine=tiny"],
     f"error: --model=tiny: a config preset has no tokenizer, and this launcher takes a "
     f"model with one: {WITH_WEIGHTS}"),
    ("serve.py", ["--executor=simulated", "--engine=tiny", "--port={port}"],
     f"error: --model=tiny: a config preset has no tokenizer, and this launcher takes a "
     f"model with one: {WITH_WEIGHTS}"),
])
def test_a_config_preset_is_refused_where_it_cannot_run(short_trace, script, args, line):
  """On the model executor (no weights), or by a launcher that reads text
  (no tokenizer), before any model loads, the refusal saying why."""
  args = [a.format(trace=short_trace, port=free_port()) for a in args]
  assert refusals.refused(script, "--model=tiny", *args) == (2, line)


@pytest.mark.parametrize("executor", ["model", "simulated"])
@pytest.mark.parametrize("window,line", [
    ("10,20", "error: {trace}: no request in window_s=(10.0, 20.0) (seconds from the trace's "
              "first arrival; its arrivals span 3.0 s, first to last)"),
    ("", f"error: {WINDOW_RULE}, got ''"),
    ("5,1", f"error: {WINDOW_RULE}, got '5,1'"),
    ("0,inf", f"error: {WINDOW_RULE}, got '0,inf'"),
])
def test_a_window_is_refused_before_the_model_loads(short_trace, executor, window, line):
  """A window no request of the trace is in, or one not N or A,B, is refused
  with either executor before the model (or its config) loads: no
  ``model:`` line (``refusals.refused`` checks it)."""
  status, last = refusals.refused("replay.py", f"--executor={executor}",
                                  f"--trace=azure:{short_trace}", f"--window_s={window}")
  assert (status, last) == (2, line.format(trace=short_trace))


@pytest.mark.parametrize("value,window", [
    ("60", (0.0, 60.0)), (["60"], (0.0, 60.0)), (["3", "5.5"], (3.0, 5.5)), ("0,1", (0.0, 1.0)),
])
def test_window_s_is_n_or_a_b(value, window):
  """N is the first N seconds of arrivals, A,B the arrivals in [A, B): the
  one parser of replay.py's, sweep.py's, bench_sim.py's and fidelity.py's
  --window_s."""
  assert launch.parse_window(value) == window


@pytest.mark.parametrize("value", ["0", "-1", "x", "1,2,3", "2,2", "nan", []])
def test_a_bad_window_s_names_the_flag_and_its_rule(value):
  shown = ",".join(value) if isinstance(value, list) else value
  with pytest.raises(ValueError) as e:
    launch.parse_window(value)
  assert str(e.value) == f"{WINDOW_RULE}, got {shown!r}"


def test_help_lists_the_flags_a_replay_sets():
  """``--help`` lists the workload's flags and the engine choices a replay
  makes (--trace, --executor, --policy, --num_pages, ...); the other
  overrides only ``--helpfull``."""
  def listed(flag):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "replay.py"), flag],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {line.split(":")[0][4:] for line in proc.stdout.splitlines()
            if line.startswith("  --")}

  short = listed("--help")
  assert {"trace", "window_s", "time_scale", "max_requests", "num_requests", "rate_scale",
          "max_prompt_len", "max_output_len", "slo_ttft_ms", "slo_tpot_ms", "executor",
          "cost_model", "policy", "num_pages", "model", "engine", "out"} <= short, short
  assert not {"dtype", "mesh", "seed", "reservation"} & short, short
  assert {"dtype", "mesh", "seed", "reservation"} <= listed("--helpfull")


def test_a_model_that_cannot_be_found_is_named_once(tmp_path):
  """``check_model_spec`` names the flag and its value, and the loader's
  reason without the value again."""
  missing, bare = tmp_path / "nope.gguf", tmp_path / "bare"
  bare.mkdir()
  for spec, why in ((missing, "unknown model: not a preset (['smollm2-135m']) and no such path"),
                    (bare, "expected a *.gguf file or a directory containing config.json")):
    with pytest.raises(ValueError) as e:
      launch.check_model_spec("--model", str(spec))
    assert str(e.value) == f"--model={spec}: {why}"
