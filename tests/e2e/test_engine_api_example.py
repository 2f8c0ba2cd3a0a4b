"""docs/examples/engine_api.py, the engine from Python as README shows it,
run as a user runs it (a subprocess): every request ends with an outcome
and its token count, on the simulated executor and on the real model."""

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "engine_api.py"


def _run(*args):
  proc = subprocess.run([sys.executable, str(EXAMPLE), *args], cwd="/", capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc.stdout


def test_the_engine_example_on_the_simulated_executor():
  """No weights: three requests of 5 tokens each end completed (length),
  the virtual clock advanced by the cost model's step times."""
  out = _run("--simulated", "--engine=tiny", "--max_tokens=5", "--policy=vllm_v1")
  ends = re.findall(r"^(req-\d): (\w+) \((\w+)\), (\d+) tokens$", out, flags=re.M)
  assert sorted(ends) == [(f"req-{i}", "completed", "length", "5") for i in range(3)], out
  clock = re.search(r"^(\d+) iterations, policy vllm_v1, virtual clock at ([\d.]+) ms$", out,
                    re.M)
  assert clock and int(clock[1]) >= 5 and float(clock[2]) > 0, out


def test_the_example_refuses_a_bad_value_in_one_line(monkeypatch, capsys):
  """A bad value is argparse's one line and exit status 2 (the example's
  own process: its refusal needs no engine)."""
  assert _refused(monkeypatch, capsys, "--simulated", "--engine=tiny", "--max_tokens=0") == (
      "engine_api.py: error: SamplingParams.max_tokens must be in [1, 2**31), got 0")


def _refused(monkeypatch, capsys, *args) -> str:
  """The example's main on ``args`` in this process: its exit status must
  be 2; returns the last line it wrote to stderr."""
  monkeypatch.setattr(sys, "argv", ["engine_api.py", *args])
  with pytest.raises(SystemExit) as e:
    _load_example().main()
  assert e.value.code == 2
  return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.extended  # SmolLM2-135M's weights; the tiny preset's one bucket compiles (~25 s)
def test_the_engine_example_on_the_real_model():
  """Greedy SmolLM2 text: each request ends completed, by length or at its
  end-of-text token, and its text is printed."""
  out = _run("--engine=tiny", "--max_tokens=8")
  ends = re.findall(r"^(req-\d): completed \((length|stop)\), (\d+) tokens$", out, flags=re.M)
  assert [e[0] for e in sorted(ends)] == ["req-0", "req-1", "req-2"], out
  assert all(1 <= int(n) <= 8 and (n == "8") == (why == "length") for _, why, n in ends), out
  assert re.search(r"^req-0 'The capital of France is' -> '.+'$", out, flags=re.M), out


def _load_example():
  spec = importlib.util.spec_from_file_location("engine_api", EXAMPLE)
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  return example


def test_the_context_refusal_names_a_flag_the_example_takes(monkeypatch, capsys):
  """``--simulated --model=tiny`` on the default engine (a 2048-token
  context, tiny's is 512) is refused in one line whose advice is a flag of
  the example's own; run with it, every request completes."""
  line = _refused(monkeypatch, capsys, "--simulated", "--model=tiny")
  assert line == (
      "engine_api.py: error: EngineConfig.max_model_len (2048) must not exceed the model's "
      "context, ModelConfig.max_position (512) of 'tiny' (the launchers take "
      "--max_model_len=512)")
  advice = re.search(r"take (--\w+=\d+)\)$", line)[1]
  monkeypatch.setattr(sys, "argv", ["engine_api.py", "--simulated", "--model=tiny", advice,
                                    "--max_tokens=2", "--policy=vllm_v1"])
  _load_example().main()
  out = capsys.readouterr().out
  ends = re.findall(r"^(req-\d): (\w+) \((\w+)\), (\d+) tokens$", out, flags=re.M)
  assert sorted(ends) == [(f"req-{i}", "completed", "length", "2") for i in range(3)], out


def test_the_engine_example_takes_a_config_preset_on_the_simulated_executor(capsys):
  """``--simulated --model=tiny``: the launchers' model check takes a config
  preset there (no weights, no tokenizer: the prompts' bytes stand in for
  token ids), in the example's own process; without --simulated it is
  refused naming --model and the flag that would run it."""
  example = _load_example()
  args = argparse.Namespace(model="tiny", engine="tiny", policy="vllm_v1", max_tokens=2,
                            simulated=True, max_model_len=None)
  example.run(args)
  out = capsys.readouterr().out
  ends = re.findall(r"^(req-\d): (\w+) \((\w+)\), (\d+) tokens$", out, flags=re.M)
  assert sorted(ends) == [(f"req-{i}", "completed", "length", "2") for i in range(3)], out
  assert re.search(r"^req-1 'def fibonacci\(n\):' -> \[\d+, \d+\]$", out, flags=re.M), out
  with pytest.raises(ValueError) as refused:
    example.run(argparse.Namespace(**dict(vars(args), simulated=False)))
  assert str(refused.value) == (
      "--model=tiny: a config preset without weights runs only on the simulated executor "
      "(--simulated); models with weights: ['smollm2-135m'], a *.gguf file or an HF directory")
