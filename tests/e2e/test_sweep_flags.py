"""sweep.py's flags and --merge inputs: a bad one is one line naming the
flag and its rule, exit status 2, before any model loads; and the offered
rate of a trial, taken over its window."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e import refusals

ROOT = Path(__file__).resolve().parents[2]
SPAN_RULE = ("a replay spans at most 1e+10 s of virtual time (the engine's float64 clocks "
             "resolve ~2 us there; further on a step of a few ms is off by 1% and more)")


@pytest.fixture(scope="module", autouse=True)
def _stop_refusal_servers():
  yield
  refusals.stop_servers()


@pytest.fixture
def replay_report(tmp_path):
  path = tmp_path / "replay.json"
  path.write_text(json.dumps({"config": {}, "request_goodput": 1.0, "goodput": {}}))
  return path


def test_sweep_refuses_bad_flags_and_merge_inputs_before_loading(tmp_path, replay_report,
                                                                   short_trace):
  not_json = tmp_path / "bad.json"
  not_json.write_text("{truncated")
  # Two sweep.json files sharing a rate (the keys merge reads, no trial).
  sweep = {"trace": "t", "window_s": 60.0, "trials_per_point": 1, "slo": {}, "alpha": 0.9,
           "policies": ["vtc"], "metric_definitions": "m", "rate_scales": [0.5, 1.0],
           "trials": []}
  swept, swept_again = tmp_path / "a.json", tmp_path / "b.json"
  swept.write_text(json.dumps(sweep))
  swept_again.write_text(json.dumps(dict(sweep, rate_scales=[0.5, 2.0])))
  short = short_trace      # arrivals at 0 and 3 s
  cases = [
      (["--rate_scales=1,0.5,1"], "error: --rate_scales must not repeat a value (a point is "
                                  "one value's trials), got 1.0 more than once in "
                                  "['1', '0.5', '1']"),
      (["--rate_scales=1,inf"], "error: --rate_scales must be a non-empty list of finite "
                                "numbers > 0, got ['1', 'inf']"),
      (["--model=tiny", "--executor=model"],
       "error: --model=tiny: a config preset without weights runs only on the simulated "
       "executor (--executor=simulated); models with weights: ['smollm2-135m'], a *.gguf "
       "file or an HF directory"),
      (["--policies=vtc,vtc"], "error: --policies must not repeat a value (a point is one "
                               "value's trials), got 'vtc' more than once in ['vtc', 'vtc']"),
      (["--window_s=5,1"], "error: --window_s must be N > 0 (the trace's first N seconds of "
                           "arrivals) or A,B with 0 <= A < B (its arrivals in [A, B) seconds "
                           "after the first), finite, got '5,1'"),
      ([f"--trace=azure:{short}", "--window_s=2", "--trials=3"],
       "error: --window_s=2 x --trials=3 reaches past the trace: trial 2's window [4, 6) s "
       "holds no request; choose another --window_s or --trials"),
      ([f"--trace=azure:{short}", "--window_s=1", "--trials=4"],
       "error: --window_s=1 x --trials=4 meets a gap in the trace: trial 1's window [1, 2) s "
       "holds no request; choose another --window_s or --trials"),
      (["--window_s=inf"], "error: --window_s must be N > 0 (the trace's first N seconds of "
                           "arrivals) or A,B with 0 <= A < B (its arrivals in [A, B) seconds "
                           "after the first), finite, got 'inf'"),
      # A,B as replay.py takes it: trial k replays the k-th window of B - A
      # seconds after [A, B).
      ([f"--trace=azure:{short}", "--window_s=1,3", "--trials=2"],
       "error: --window_s=1,3 x --trials=2 meets a gap in the trace: trial 0's window [1, 3) s "
       "holds no request; choose another --window_s or --trials"),
      ([f"--trace=azure:{short}", "--window_s=3,4", "--trials=2"],
       "error: --window_s=3,4 x --trials=2 reaches past the trace: trial 1's window [4, 5) s "
       "holds no request; choose another --window_s or --trials"),
      (["--merge=nosuch.json"], "error: --merge: 'nosuch.json' is not a file"),
      ([f"--merge={replay_report}"],
       f"error: --merge takes sweep.json files written by sweep.py; '{replay_report}' is not "
       f"one (it has no 'trace', 'window_s', 'trials_per_point' and 6 more; a replay report "
       f"is one run, not a sweep)"),
      ([f"--merge={not_json}"],
       f"error: --merge: '{not_json}' cannot be read as JSON (Expecting property name "
       f"enclosed in double quotes: line 1 column 2 (char 1))"),
      (["--merge="], "error: --merge must name at least one sweep.json, got ''"),
      ([f"--merge={swept},{swept_again}"],
       f"error: --merge: rate scale 0.5 is in both {swept} and {swept_again} (each rate's "
       f"trials must come from one sweep)"),
      (["--out="], "error: --out must name the folder for sweep.json and the PNGs, got ''"),
      ([f"--merge={replay_report}", "--out="],
       "error: --out must name the folder for sweep.json and the PNGs, got ''"),
      (["--out=README.md"],
       "error: --out 'README.md' cannot be written: it exists and is not a writable directory"),
      (["--sample_every=0"], "error: --sample_every must be >= 1, got 0"),
      (["--jobs=0"], "error: --jobs must be >= 1, got 0"),
      (["--trace=azure:/nonexist.csv"],
       "error: --trace: '/nonexist.csv' (of 'azure:/nonexist.csv') is not a file"),
      # A rate scale's bounds: the lowest stretches a window past a replay's
      # longest span; the highest may make a burst, but not an offered rate
      # past float64's range.
      (["--rate_scales=1e-300,1"],
       f"error: --window_s=60 / --rate_scales=1e-300: a trial's window of 60 s would span "
       f"6e+301 s as replayed; {SPAN_RULE}"),
      (["--window_s=2,12", "--rate_scales=1e-10,1"],
       f"error: --window_s=2,12 / --rate_scales=1e-10: a trial's window of 10 s would span "
       f"1e+11 s as replayed; {SPAN_RULE}"),
      ([f"--trace=azure:{short}", "--window_s=0.5", "--trials=1", "--rate_scales=1,1e308"],
       "error: --rate_scales=1e+308: trial 0's window of 0.5 s holds 1 request(s), which would "
       "offer 1 / 0.5 x 1e+308 req/s, past float64's range (sweep.json and G* give rates in "
       "req/s); lower the highest rate scale"),
  ]
  for args, line in cases:
    # README.md stands for the default trace (../shared may be absent): the
    # refusal under test comes before the trace's existence check.
    trace = [] if any(a.startswith("--trace") for a in args) else ["--trace=azure:README.md"]
    assert refusals.refused("sweep.py", *args, *trace) == (2, line), args


def test_resume_of_a_folder_that_does_not_exist_creates_nothing(tmp_path):
  """--resume with an --out that holds no trials.jsonl is refused before
  any folder is made, --out's or --cache_dir's."""
  out, cache = tmp_path / "does_not_exist", tmp_path / "cache"
  status, last = refusals.refused("sweep.py", "--resume", f"--out={out}",
                                  f"--cache_dir={cache}", "--trace=azure:README.md")
  assert (status, last) == (2, f"error: --resume keeps the trials of {out}/trials.jsonl, which "
                               f"does not exist (is --out the stopped sweep's folder?)")
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,line", [
    (["--max_model_len=100000"],
     "error: EngineConfig.max_model_len (100000) must not exceed the model's context, "
     "ModelConfig.max_position (8192) of 'smollm2-135m' (the launchers take "
     "--max_model_len=8192)"),
    (["--model=tiny", "--max_model_len=1000"],
     "error: EngineConfig.max_model_len (1000) must not exceed the model's context, "
     "ModelConfig.max_position (512) of 'tiny' (the launchers take --max_model_len=512)"),
    (["--cost_model=profile:nope"],
     "error: --cost_model must name a shipped accelerator profile, one of ['profile:a100', "
     "'profile:h100', 'profile:h200', 'profile:tpu_v5e', 'profile:tpu_v6e'], got 'profile:nope'"),
    (["--cost_model={files}/not.json"],
     "error: --cost_model '{files}/not.json' is not a cost model JSON (a calibration of "
     "scripts/calibrate.py, or profile:NAME): Expecting property name enclosed in double "
     "quotes: line 1 column 2 (char 1)"),
    (["--engine={files}/bad.json"],
     "error: {files}/bad.json: EngineConfig.max_num_seqs must be an int, got 'four'"),
    (["--engine={files}/not.json"],
     "error: engine preset '{files}/not.json' is not JSON (Expecting property name enclosed "
     "in double quotes: line 1 column 2 (char 1))"),
])
def test_a_refusal_of_the_engine_leaves_no_out_folder(tmp_path, short_trace, args, line):
  """The trials' engine (its config, cost model and the model's context)
  is checked before OUT/ or --cache_dir is made: a refused sweep left OUT/
  with an empty trials.jsonl."""
  files = tmp_path / "files"
  files.mkdir()
  (files / "bad.json").write_text('{"max_num_seqs": "four"}')
  (files / "not.json").write_text("{truncated")
  made = tmp_path / "made"
  status, last = refusals.refused(
      "sweep.py", f"--trace=azure:{short_trace}", "--window_s=4", "--trials=1",
      "--rate_scales=1", "--policies=vtc", f"--out={made / 'sweep'}",
      f"--cache_dir={made / 'cache'}", *[a.format(files=files) for a in args])
  assert (status, last) == (2, line.format(files=files))
  assert not made.exists()


def test_a_sweep_whose_requests_are_rejected_says_so_not_lower_the_rate(tmp_path):
  """Two of four requests need more KV pages than tiny's cache has: each
  trial's line counts the rejected requests, and G*'s note, the lowest rate
  having missed, says the misses were rejections (with the reason) instead
  of advising lower rates."""
  trace = tmp_path / "long_prompts.csv"
  trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:10.0000000,20,4\n2023-11-16 18:15:10.5000000,400,4\n"
                   "2023-11-16 18:15:11.0000000,300,8\n2023-11-16 18:15:11.5000000,30,4\n")
  out = tmp_path / "sweep"
  status, stdout, stderr = refusals.run(
      "sweep.py", f"--trace=azure:{trace}", "--model=tiny", "--engine=tiny",
      "--max_model_len=512", "--policies=vtc", "--window_s=4", "--rate_scales=1",
      "--trials=1", f"--out={out}")
  assert status == 0, stderr[-3000:]
  assert "vtc                    x1     trial 0: 4 req (2 rejected), attainment 0.500, " in stdout
  (said,) = [line for line in stdout.splitlines() if line.startswith("G*(vtc)")]
  assert said == (
      "G*(vtc) at alpha=0.9: < 1 req/s (the lowest rate tried missed the SLOs, but 2 of its "
      "2 misses were rejected requests, which a lower rate rejects too; x1 trial 0: rejected "
      "2 of 4: needs 77 to 101 KV pages for 307 to 403 KV rows (prompt + max_tokens - 1); the "
      "cache has 63 (num_pages 64 less page 0, the null page): raise num_pages (--num_pages) "
      "to at least 102; sweep.py takes num_pages from --engine (a preset or a JSON file) and "
      "the context from --max_model_len)")
  (t,) = json.loads((out / "sweep.json").read_text())["trials"]
  assert t["rejections"] == [said.split("x1 trial 0: ")[1].split("; sweep.py")[0]]


def test_a_sweep_trial_with_one_request_offers_it_over_the_window(tmp_path, short_trace):
  """Trace windows of 2 s holding one request each: the offered rate is
  requests x rate scale / window (0.5 and 2 req/s), not requests over the
  span of their arrivals (0 s: 1e9 req/s). A merge of the sweep with a
  copy at another rate scale reads both."""
  trace = short_trace      # arrivals at 0 and 3 s
  out = tmp_path / "sweep"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "sweep.py"), f"--trace=azure:{trace}",
       "--engine=tiny", "--max_model_len=64", "--policies=sarathi_serve", "--window_s=2",
       "--rate_scales=1,4", "--trials=1", f"--out={out}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  result = json.loads((out / "sweep.json").read_text())
  assert [(t["rate_scale"], t["num_requests"], t["offered_rate_req_s"])
          for t in result["trials"]] == [(1.0, 1, 0.5), (4.0, 1, 2.0)]
  assert [p["rate_req_s"] for p in result["points"]["sarathi_serve"]] == [0.5, 2.0]
  assert "G*(sarathi_serve) at alpha=0.9: >= 2 req/s" in proc.stdout
  # The first trial compiled its programs (a fresh process); the record says so.
  first = result["trials"][0]["compile"]
  assert first["programs"] >= 1 and first["seconds"] > 0, first

  other = dict(result, rate_scales=[8.0], trials=[
      dict(t, rate_scale=8.0, offered_rate_req_s=4.0) for t in result["trials"][1:]])
  (tmp_path / "other.json").write_text(json.dumps(other))
  merged = tmp_path / "merged"
  status, stdout, stderr = refusals.run("sweep.py", f"--merge={out / 'sweep.json'},"
                                        f"{tmp_path / 'other.json'}", f"--out={merged}")
  assert status == 0, stderr[-3000:]
  assert json.loads((merged / "sweep.json").read_text())["rate_scales"] == [1.0, 4.0, 8.0]


def test_a_rate_scale_that_makes_a_burst_runs_and_reports_its_rate(tmp_path, short_trace):
  """At --rate_scales=1e308 a window's two arrivals fall on one instant (a
  burst, legal); its offered rate, 2 / 4 s x 1e308 = 5e307 req/s, is a
  number (once 2 x 1e308 / 4 = inf, and G* printed "< inf")."""
  out = tmp_path / "sweep"
  status, stdout, stderr = refusals.run(
      "sweep.py", f"--trace=azure:{short_trace}", "--engine=tiny", "--max_model_len=64",
      "--policies=sarathi_serve", "--window_s=4", "--rate_scales=1e308", "--trials=1",
      f"--out={out}")
  assert status == 0 and "Warning" not in stderr, stderr[-3000:]
  (t,) = json.loads((out / "sweep.json").read_text())["trials"]
  assert (t["num_requests"], t["offered_rate_req_s"]) == (2, 5e307)
  (said,) = [line for line in stdout.splitlines() if line.startswith("G*(sarathi_serve)")]
  assert "5e+307 req/s" in said and "inf" not in said, said     # '< R' or '>= R'


def test_a_sweep_takes_a_window_as_a_b(tmp_path, short_trace):
  """--window_s=A,B, as replay.py takes it: trial 0 replays [A, B) of the
  trace (here its second request, at 3 s), its rate over B - A seconds;
  sweep.json keeps the window as [A, B] (a window from 0 as its length)."""
  trace = short_trace      # arrivals at 0 and 3 s
  out = tmp_path / "sweep"
  status, stdout, stderr = refusals.run(
      "sweep.py", f"--trace=azure:{trace}", "--engine=tiny", "--max_model_len=64",
      "--policies=sarathi_serve", "--window_s=2,6", "--rate_scales=1", "--trials=1",
      f"--out={out}")
  assert status == 0, stderr[-3000:]
  result = json.loads((out / "sweep.json").read_text())
  (t,) = result["trials"]
  assert (t["window"], t["num_requests"], t["offered_rate_req_s"]) == ([2.0, 6.0], 1, 0.25)
  assert result["window_s"] == t["settings"]["window_s"] == [2.0, 6.0]


@pytest.mark.extended    # two sweeps, one of them in two spawned processes
def test_trials_in_processes_give_the_same_sweep(tmp_path):
  """``--jobs=2`` runs the trials two at a time in spawned processes; every
  trial is deterministic, so the sweep equals the one-process sweep but for
  wall-clock fields. The two sweeps share ``--cache_dir``: the second's
  processes load programs the first compiled. Both say the cost model's
  lines (which calibration; where it may not hold) once, not once per
  process."""
  trace = tmp_path / "trace.csv"
  trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:10.0000000,20,4\n2023-11-16 18:15:11.0000000,12,6\n"
                   "2023-11-16 18:15:11.5000000,30,3\n")
  runs, said = [], []
  for jobs in (1, 2):
    out = tmp_path / f"jobs{jobs}"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "sweep.py"), f"--trace=azure:{trace}",
         "--engine=tiny", "--max_model_len=64", "--policies=sarathi_serve,vllm_v1",
         "--window_s=4", "--rate_scales=1,2", "--trials=1", f"--jobs={jobs}",
         "--sample_every=1", f"--cache_dir={tmp_path / 'cache'}", f"--out={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    said.append([line for line in (proc.stdout + proc.stderr).splitlines()
                 if line.startswith("cost model:")])
    runs.append(json.loads((out / "sweep.json").read_text()))
    kept = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert sorted(map(json.dumps, kept)) == sorted(map(json.dumps, runs[-1]["trials"]))
  wall = ("wall_s", "iterations_per_s", "compile")   # and the process's program counts:
  strip = lambda r: [{k: (dict(v, compiled_programs=None) if k == "engine_outcomes" else v)
                      for k, v in t.items() if k not in wall} for t in r["trials"]]
  assert [(t["policy"], t["rate_scale"]) for t in runs[1]["trials"]] == [
      ("sarathi_serve", 1.0), ("sarathi_serve", 2.0), ("vllm_v1", 1.0), ("vllm_v1", 2.0)]
  assert strip(runs[0]) == strip(runs[1])
  assert said[0] and len(set(said[0])) == len(said[0]), said
  assert said[1] == said[0], said
  assert runs[0]["g_star"] == runs[1]["g_star"] and runs[1]["jobs"] == 2
  assert runs[1]["compile_cache"] == str(tmp_path / "cache" / "xla")
  # A process may load what it stored itself (one program reached by two
  # functions); the second sweep loads what the first stored as well.
  loaded = [sum(t["compile"]["loaded_from_cache"] for t in r["trials"]) for r in runs]
  assert loaded[1] > loaded[0], loaded



@pytest.mark.extended    # the real model, its buckets compiled in a subprocess
def test_a_model_sweep_compiles_first_and_keeps_the_idle_gap_in_its_times(tmp_path):
  """On the model executor a trial compiles its token buckets before the
  replay (``compile_seconds_by_bucket``), so its replay compiles nothing and
  no request's TTFT holds a compilation; a replay that does not wait for
  arrivals skips the 34 s gap between the two bursts without losing it:
  the trial's duration spans the last arrival (36.1 s), and the time
  series' rows after the gap start at the second burst."""
  trace = tmp_path / "gap.csv"
  trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
      f"2023-11-16 18:15:{s},{p},{o}\n" for s, p, o in [
          ("00.0000000", 60, 8), ("00.5000000", 90, 12), ("01.2000000", 40, 10),
          ("35.0000000", 70, 8), ("35.4000000", 50, 12), ("36.1000000", 80, 10)]))
  out = tmp_path / "sweep"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "sweep.py"), f"--trace=azure:{trace}",
       "--executor=model", "--engine=cpu_small", "--max_model_len=512", "--window_s=40",
       "--trials=1", "--rate_scales=1", "--policies=sarathi_serve", "--sample_every=1",
       f"--cache_dir={tmp_path / 'cache'}", f"--out={out}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  trial = json.loads((out / "sweep.json").read_text())["trials"][0]
  assert trial["compile_seconds_by_bucket"] and trial["compile"]["programs"] == 0
  assert trial["outcomes"]["valid"] + trial["outcomes"]["completed_miss"] == 6
  assert trial["duration_s"] >= 36.1
  t_s = [row[0] / 1000 for row in trial["resources"]["timeseries"]["rows"]]
  assert t_s == sorted(t_s) and t_s[-1] <= trial["duration_s"]
  after_gap = [t for t in t_s if t > 1.2 + 30]        # idle: no iteration in the gap
  assert after_gap and min(after_gap) >= 35.0
