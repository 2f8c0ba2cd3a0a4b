"""Step logs of real replays and the cost model fitted on them."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serving.engine import cost_model as cost_lib
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.harness import step_log
from serving.harness import synthetic
from tests.serving.engine_testing import CFG

ROOT = Path(__file__).resolve().parents[2]
COST = cost_lib.CostModel.of(step=5.0, rows=0.5, attention_gflop=2000.0)
# Known coefficients of a one-model fit (weight reads fold into ``step``).
TRUE = dict(step=2.0, rows=0.01, gemm_gflop=2.5, lm_head_gflop=3.3, attention_gflop=6.7,
            kv_read_gb=16.7)


def _meta(costs):
  return dict(model="tiny", family="llama", dtype="float32", engine="tiny",
              device=cost_lib.device_fingerprint(), models=[costs.to_json()], max_load=1.5)


def test_real_replay_logs_one_row_per_step_with_the_engines_features(params, tmp_path):
  engine = Engine(CFG, params, EngineConfig.preset("tiny"))
  wl = synthetic.synthetic_azure_conv(12, rate_scale=4.0, seed=2, max_prompt_len=40,
                                      max_output_len=8, vocab_size=CFG.vocab_size,
                                      reserved_token_ids=frozenset({0, 1}))
  reported = []

  def hook(outputs):
    del outputs
    if engine.num_iterations > len(reported):
      reported.append((engine.last_step_features, engine.last_step_rows))

  log = step_log.StepLog(COST)
  records, _ = log.replay(engine, wl, {"trace": "synthetic"}, on_step=hook, realtime=False)
  assert all(r.outcome == "completed" for r in records)
  a = log.arrays()
  assert len(log) == engine.num_iterations == len(reported) > 0
  np.testing.assert_array_equal(a["features"], np.array([f for f, _ in reported]))
  np.testing.assert_array_equal(a["prefill_rows"], [p for _, (p, _) in reported])
  np.testing.assert_array_equal(a["decode_rows"], [d for _, (_, d) in reported])
  assert a["prefill_rows"].sum() == engine.prefill_tokens_computed
  np.testing.assert_allclose(a["predicted_ms"], [COST.predict_ms(f) for f, _ in reported])
  assert (a["measured_ms"] > 0).all() and (a["case"] == 0).all()
  want = [step_log.step_class(p, d) for _, (p, d) in reported]
  np.testing.assert_array_equal(a["step_class"], want)
  summary = log.summary(0)
  assert summary["count"] == len(log)
  assert sum(c["count"] for c in summary["by_class"].values()) == len(log)
  assert summary["measured_ms_sum"] == pytest.approx(a["measured_ms"].sum())
  assert log.cases == [{"trace": "synthetic", "uncommitted_calls": 0}]

  path = tmp_path / "steps"
  log.save(str(path), 0.5, _meta(engine.model_costs))
  back = step_log.load(str(path))
  np.testing.assert_array_equal(back["features"], a["features"])
  assert back["load_avg"] == 0.5 and back["meta"]["cases"][0]["trace"] == "synthetic"
  assert back["meta"]["cost_model"]["coef_ms"]["step"] == 5.0


def test_step_classes():
  assert [step_log.STEP_CLASSES[step_log.step_class(p, d)]
          for p, d in ((32, 0), (32, 3), (0, 3))] == ["prefill", "mixed", "decode"]


def _synthetic_log(path, load_avg, n=200, seed=0):
  """A step log of random steps of the tiny model whose times are the
  features times ``TRUE``."""
  rng = np.random.default_rng(seed)
  costs = cost_lib.model_costs(CFG)
  true = cost_lib.CostModel.of(**TRUE)
  log = step_log.StepLog(true)
  for _ in range(n):
    decode, chunks = int(rng.integers(0, 32)), int(rng.integers(0, 5))
    prefill = chunks * int(rng.integers(1, 64))
    decode = decode if prefill or decode else 1
    bucket = int(2 ** np.ceil(np.log2(max(prefill + decode, 16))))
    ctx = int(rng.integers(1, 8192))
    stats = [prefill, decode, decode + chunks,
             prefill * (prefill / max(chunks, 1) + 1) / 2 + decode * ctx,
             (decode + chunks) * ctx]
    features = cost_lib.step_features(stats, bucket, costs)
    log.add(features, (prefill, decode), true.predict_ms(features), case=0)
  log.cases.append({"trace": "synthetic", "uncommitted_calls": 0})
  log.save(str(path), load_avg, _meta(costs))
  return str(path)


def test_fit_steps_recovers_known_coefficients(tmp_path):
  path = _synthetic_log(tmp_path / "steps.npz", load_avg=0.3)
  fit = step_log.fit_steps([path], max_load=1.5)
  for name, value in TRUE.items():
    assert fit.coef_ms[cost_lib.FEATURES.index(name)] == pytest.approx(value, rel=1e-3), name
  assert fit.coef_ms[cost_lib.FEATURES.index("weight_read_gb")] == 0.0
  assert fit.meta["source"] == "replay steps" and fit.meta["files"] == [path]
  assert fit.meta["steps"] == 200 and fit.meta["load_avg"] == [0.3]
  assert set(fit.meta["residual_without"]) == set(TRUE)
  assert sum(c["count"] for c in fit.meta["by_class"].values()) == 200


def test_refit_steps_writes_a_calibration_and_refuses_a_busy_log(tmp_path):
  quiet = _synthetic_log(tmp_path / "quiet.npz", load_avg=0.3)
  busy = _synthetic_log(tmp_path / "busy.npz", load_avg=3.0, seed=1)
  with pytest.raises(ValueError, match=r"load average of 3.00 > --max_load=1.5"):
    step_log.fit_steps([quiet, busy], max_load=1.5)
  out = tmp_path / "cal.json"
  script = [sys.executable, str(ROOT / "scripts" / "calibrate.py")]
  proc = subprocess.run(script + [f"--refit_steps={quiet}", f"--out={out}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  cal = cost_lib.load(out)
  assert cal.meta["source"] == "replay steps" and cal.meta["steps"] == 200
  assert cal.coef_ms[0] == pytest.approx(TRUE["step"], rel=1e-3)
  proc = subprocess.run(script + [f"--refit_steps={quiet},{busy}", f"--out={out}",
                                  "--max_load=1.5"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "load average of 3.00 > --max_load=1.5" in proc.stderr
  assert json.loads(out.read_text())["meta"]["files"] == [quiet]
