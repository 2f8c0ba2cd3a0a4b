"""replay.py's model and workload flags: a config preset on the simulated
executor, a trace's window checked before any model loads, --window_s's two
forms, the flags --help lists, and a model flag's refusal naming its value
once."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving.cli import launch, workload_flags
from serving.harness import traces
from tests.e2e import refusals
from tests.serving.engine_testing import free_port

ROOT = Path(__file__).resolve().parents[2]
WINDOW_RULE = ("--window_s must be N > 0 (the trace's first N seconds of arrivals) or A,B "
               "with 0 <= A < B (its arrivals in [A, B) seconds after the first), finite")
WITH_WEIGHTS = "['smollm2-135m'], a *.gguf file or an HF directory"
SPAN_RULE = ("a replay spans at most 1e+10 s of virtual time (the engine's float64 clocks "
             "resolve ~2 us there; further on a step of a few ms is off by 1% and more)")


@pytest.fixture(scope="module", autouse=True)
def _stop_refusal_servers():
  yield
  refusals.stop_servers()



def test_a_config_preset_replays_on_the_simulated_executor(tmp_path):
  """``--model=tiny`` (a config, no weights, no tokenizer) replays with
  --executor=simulated, as sweep.py and bench_sim.py take it."""
  out = tmp_path / "a" / "b" / "replay.json"       # its folders made once the checks passed
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


@pytest.mark.parametrize("args,line", [
    (["--num_requests=0"], "error: --num_requests must be >= 1, got 0"),
    (["--trace=azure:{trace}", "--time_scale=0"],
     "error: --time_scale must be finite and > 0 (a factor on the trace's gaps), got 0.0"),
    (["--engine={dir}/bad.json"],
     "error: {dir}/bad.json: EngineConfig.max_num_seqs must be an int, got 'four'"),
    (["--engine={dir}/bool.json"],
     "error: {dir}/bool.json: EngineConfig.num_pages must be an int, got True"),
    (["--engine={dir}/not.json"],
     "error: engine preset '{dir}/not.json' is not JSON (Expecting property name enclosed in "
     "double quotes: line 1 column 2 (char 1))"),
    (["--policy=nope"], "error: --policy must be one of [..."),
    (["--cost_model=profile:nope"],
     "error: --cost_model must name a shipped accelerator profile, one of [..."),
    (["--model=/nope"],
     "error: --model=/nope: unknown model: not a preset (['smollm2-135m']) and no such path"),
    (["--model=tiny", "--max_model_len=100000"],
     "error: EngineConfig.max_model_len (100000) must not exceed the model's context, ..."),
])
def test_a_refused_replay_leaves_no_out_folder(tmp_path, short_trace, args, line):
  """--out's folders are checked (made, written to and removed) first, and
  made only once every check passed: a run refused by a later flag (the
  workload's, --engine's file, --policy, --cost_model, --model, the
  model's context) leaves none behind. An engine JSON of a wrongly typed
  field, or not JSON, is refused naming the file and the field."""
  files = tmp_path / "files"
  files.mkdir()
  (files / "bad.json").write_text('{"max_num_seqs": "four"}')
  (files / "bool.json").write_text('{"num_pages": true}')
  (files / "not.json").write_text("{truncated")
  args = [a.format(trace=short_trace, dir=files) for a in args]
  status, stdout, stderr = refusals.run("replay.py", "--executor=simulated", *args,
                                        f"--out={tmp_path / 'x1' / 'a' / 'b' / 'r.json'}")
  assert "Traceback" not in stderr, stderr[-3000:]
  last, line = stderr.strip().splitlines()[-1], line.format(dir=files)
  if line.endswith("..."):            # the rest is another test's
    last, line = last[:len(line) - 3], line[:-3]
  assert (status, last) == (2, line)
  assert not (tmp_path / "x1").exists()


def test_a_config_preset_on_the_model_executor_is_the_first_thing_said():
  """--model=tiny with --executor=model is refused before the workload is
  built: no note about fitting it into tiny's context comes first."""
  status, stdout, stderr = refusals.run("replay.py", "--model=tiny", "--engine=tiny",
                                        "--executor=model")
  assert "Traceback" not in stderr, stderr[-3000:]
  assert (status, stdout, stderr.strip().splitlines()) == (2, "", [
      f"error: --model=tiny: a config preset without weights runs only on the simulated "
      f"executor (--executor=simulated); models with weights: {WITH_WEIGHTS}"])


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


@pytest.mark.parametrize("executor", ["model", "simulated"])
@pytest.mark.parametrize("args,line", [
    (["--trace=azure:{trace}", "--time_scale=1e300"],
     f"error: --time_scale=1e+300: the trace's arrivals (3 s, first to last) would span "
     f"3e+300 s as replayed; {SPAN_RULE}"),
    (["--trace=azure:{trace}", "--time_scale=1e10"],
     f"error: --time_scale=1e+10: the trace's arrivals (3 s, first to last) would span "
     f"3e+10 s as replayed; {SPAN_RULE}"),
    (["--trace=azure:{trace}", "--window_s=2,6", "--time_scale=1e300"],
     f"error: --window_s=2,6 x --time_scale=1e+300: a window of 4 s would span 4e+300 s as "
     f"replayed; {SPAN_RULE}"),
    (["--trace=azure:{trace}", "--window_s=1e300", "--time_scale=1e10"],
     f"error: --window_s=1e300 x --time_scale=1e+10: a window of 1e+300 s would span inf s as "
     f"replayed; {SPAN_RULE}"),
    (["--rate_scale=1e-300"],
     f"error: --rate_scale=1e-300: the synthetic workload's 32 arrivals would span 6.03e+300 s "
     f"as replayed; {SPAN_RULE}"),
    (["--num_requests=2", "--rate_scale=1e-309"],      # its one gap overflows
     f"error: --rate_scale=1e-309: the synthetic workload's 2 arrivals would span inf s as "
     f"replayed; {SPAN_RULE}"),
])
def test_a_time_scale_past_the_longest_replay_is_refused_before_the_model_loads(
    short_trace, executor, args, line):
  """--time_scale stretches the trace's arrivals (or --window_s's length),
  --rate_scale the synthetic workload's, past ``workload_flags.MAX_REPLAY_SPAN_S``
  of virtual time: refused naming the flags and the bound, with either
  executor, before the model loads, and without a numpy warning."""
  args = [a.format(trace=short_trace) for a in args]
  status, stdout, stderr = refusals.run("replay.py", f"--executor={executor}", *args)
  assert "Traceback" not in stderr and "Warning" not in stderr, stderr[-3000:]
  assert (status, stdout, stderr.strip().splitlines()) == (2, "", [line])


@pytest.mark.parametrize("kind,text", [
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:13.5000000,30,4\n"
              "2023-11-16 18:15:10.0000000,20,4\n"),
    ("vtc", "arrival_s,client,prompt_len,output_len\n2.5,a,8,2\n0.5,b,8,2\n4,a,8,2\n"),
    ("mooncake", '{"timestamp": 0, "input_length": 8, "output_length": 2, "hash_ids": [1]}\n'
                 '{"timestamp": 0, "input_length": 8, "output_length": 2, "hash_ids": [2]}\n'
                 '{"timestamp": 6000, "input_length": 8, "output_length": 2, "hash_ids": [3]}\n'),
])
def test_a_traces_arrival_span_is_its_loaders(tmp_path, kind, text):
  """``traces.arrival_span_s``, which --time_scale's bound scales, reads
  the rows only and gives the whole trace's span as its loader does
  (rows out of order; Mooncake's spread over a bucket)."""
  path = tmp_path / f"trace.{kind}"
  path.write_text(text)
  loader, _ = traces.trace_loader(f"{kind}:{path}")
  assert traces.arrival_span_s(f"{kind}:{path}") == loader(path).duration_s > 0


@pytest.mark.parametrize("value,window", [
    ("60", (0.0, 60.0)), (["60"], (0.0, 60.0)), (["3", "5.5"], (3.0, 5.5)), ("0,1", (0.0, 1.0)),
])
def test_window_s_is_n_or_a_b(value, window):
  """N is the first N seconds of arrivals, A,B the arrivals in [A, B): the
  one parser of replay.py's, sweep.py's, bench_sim.py's and fidelity.py's
  --window_s."""
  assert workload_flags.parse_window(value) == window


@pytest.mark.parametrize("value", ["0", "-1", "x", "1,2,3", "2,2", "nan", []])
def test_a_bad_window_s_names_the_flag_and_its_rule(value):
  shown = ",".join(value) if isinstance(value, list) else value
  with pytest.raises(ValueError) as e:
    workload_flags.parse_window(value)
  assert str(e.value) == f"{WINDOW_RULE}, got {shown!r}"


def _help(script, flag="--help"):
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), flag],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def test_help_lists_the_flags_a_replay_sets():
  """``--help`` lists the workload's flags and the engine choices a replay
  makes (--trace, --executor, --policy, --num_pages, ...), and every flag
  its text names (--reservation, --slo_class); the other overrides only
  ``--helpfull``."""
  def listed(flag):
    return {line.split(":")[0][4:] for line in _help("replay.py", flag).splitlines()
            if line.startswith("  --")}

  short = listed("--help")
  assert {"trace", "window_s", "time_scale", "max_requests", "num_requests", "rate_scale",
          "max_prompt_len", "max_output_len", "slo_ttft_ms", "slo_tpot_ms", "slo_class",
          "executor", "cost_model", "policy", "num_pages", "reservation", "model", "engine",
          "out"} <= short, short
  assert not {"dtype", "mesh", "seed"} & short, short
  assert {"dtype", "mesh", "seed", "reservation"} <= listed("--helpfull")


@pytest.mark.parametrize("script", ["replay.py", "sweep.py"])
def test_help_examples_are_commands_to_copy(script):
  """Each usage example of ``--help`` reads as typed: no run of spaces
  inside a command (a ``\\`` continuation in the docstring once joined its
  lines), and a continued line ends in `` \\``."""
  lines = _help(script).split("\n")
  commands = [i for i, line in enumerate(lines) if line.lstrip().startswith("python scripts/")]
  assert commands, lines[:20]
  for i in commands:
    while True:
      command = lines[i].split(" # ")[0].strip()
      assert "  " not in command, lines[i]
      if not command.endswith("\\"):
        break
      assert command.endswith(" \\"), lines[i]
      i += 1


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
