"""Step logs of real replays and the cost model fitted on them."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serving.engine import calibrations as cal_lib
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
            kv_read_gb=16.7, prompt_gemm_gflop=1.1, extra_weight_read_gb=25.0)


def _meta(costs):
  return dict(model="tiny", family="llama", dtype="float32", engine="tiny",
              device=cal_lib.device_fingerprint(), models=[costs.to_json()], max_load=1.5)


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
  # The raw plan statistics and bucket give the features again (so a changed
  # feature definition can be applied to a log without measuring again).
  again = [cost_lib.step_features(st, b, engine.model_costs)
           for st, b in zip(a["plan_stats"], a["bucket"])]
  np.testing.assert_array_equal(np.array(again), a["features"])
  assert set(a["bucket"].tolist()) <= set(engine.config.token_buckets)
  np.testing.assert_array_equal(a["plan_stats"][:, 0], a["prefill_rows"])
  idle = a["idle_before_ms"]
  assert np.isnan(idle[0]) and (idle[1:] >= 0).all()

  path = tmp_path / "steps"
  log.save(str(path), 0.5, _meta(engine.model_costs))
  back = step_log.load(str(path))
  np.testing.assert_array_equal(back["features"], a["features"])
  np.testing.assert_array_equal(back["plan_stats"], a["plan_stats"])
  np.testing.assert_array_equal(back["idle_before_ms"], a["idle_before_ms"])
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
    stats = [prefill, decode, decode + chunks, prefill,
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
  cal = cal_lib.load(out)
  assert cal.meta["source"] == "replay steps" and cal.meta["steps"] == 200
  assert cal.coef_ms[0] == pytest.approx(TRUE["step"], rel=1e-3)
  proc = subprocess.run(script + [f"--refit_steps={quiet},{busy}", f"--out={out}",
                                  "--max_load=1.5"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "load average of 3.00 > --max_load=1.5" in proc.stderr
  assert json.loads(out.read_text())["meta"]["files"] == [quiet]


def _grid(path, costs, rows, dtype="float32", device="abc"):
  """A saved calibration grid (``scripts/calibrate.py``'s ``*_grid.npz``) of
  ``rows`` steps of ``costs`` whose times are the features times ``TRUE``."""
  rng = np.random.default_rng(rows)
  true = cost_lib.CostModel.of(**TRUE)
  x = []
  for _ in range(rows):
    decode, prefill = int(rng.integers(0, 32)), int(rng.integers(0, 256))
    bucket = int(2 ** np.ceil(np.log2(max(prefill + decode, 16))))
    stats = [prefill, decode, decode + (prefill > 0), prefill, prefill * (prefill + 1) / 2,
             decode + (prefill > 0)]
    x.append(cost_lib.step_features(stats, bucket, costs))
  meta = dict(model="m", dtype=dtype, engine="cpu_default", device={"id": device},
              models=[costs.to_json()], model_names=[f"m{rows}"], load_avg_before=0.2,
              load_avg_after=1.9, step_time_spread=[0.05])
  np.savez(path, features=np.array(x), step_ms=np.array([true.predict_ms(r) for r in x]),
           meta=json.dumps(meta))
  return str(path)


def test_grids_of_two_models_measured_apart_merge_into_one_fit(tmp_path):
  small = cost_lib.model_costs(CFG)
  wide = cost_lib.model_costs(dataclasses.replace(CFG, d_model=2 * CFG.d_model,
                                                  ffn_dim=3 * CFG.ffn_dim))
  a, b = _grid(tmp_path / "a.npz", small, 40), _grid(tmp_path / "b.npz", wide, 50)
  x, y, meta = step_log.load_grids([a, b])
  assert x.shape == (90, len(cost_lib.FEATURES)) and y.shape == (90,)
  assert meta["model_names"] == ["m40", "m50"] and len(meta["models"]) == 2
  assert meta["grids"] == [a, b] and meta["load_avg_before"] == [0.2, 0.2]
  with pytest.raises(ValueError, match="grids differ in dtype"):
    step_log.load_grids([a, _grid(tmp_path / "c.npz", wide, 30, dtype="bfloat16")])
  with pytest.raises(ValueError, match="measured on another device"):
    step_log.load_grids([a, _grid(tmp_path / "d.npz", wide, 30, device="xyz")])


# Two script runs with the model executor (~2 min): the extended profile.
@pytest.mark.extended
def test_fidelity_checks_a_second_cost_model_against_the_same_measured_replay(tmp_path):
  """scripts/fidelity.py --measured keeps each real replay's records;
  --reuse_measured checks another cost model against them without replaying
  (same measured side, another simulated side), and refuses a case it lacks;
  --measured_again compares two measurements request by request."""
  trace = tmp_path / "trace.csv"
  trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:17:03.00,20,4\n2023-11-16 18:17:03.40,9,6\n"
                   "2023-11-16 18:17:03.90,31,3\n")
  measured, slow = tmp_path / "measured.json", tmp_path / "slow.json"
  slow.write_text(json.dumps({"coef_ms": {f: (500.0 if f == "step" else 0.0)
                                          for f in cost_lib.FEATURES}}))
  script = [sys.executable, str(ROOT / "scripts" / "fidelity.py"),
            "--model=random:smollm2-135m,d_model=64,n_heads=4,n_kv_heads=2,ffn_dim=128,n_layers=2",
            "--engine=tiny", f"--traces=azure:{trace}", "--window_s=0,5", "--time_scales=1",
            "--max_load=1000", "--cache_dir=", f"--measured={measured}"]
  run = lambda *args: subprocess.run(script + list(args), cwd=ROOT, capture_output=True,
                                     text=True, timeout=300)
  first = run(f"--out={tmp_path / 'a.json'}")
  assert first.returncode == 0, first.stderr[-2000:]
  second = run(f"--out={tmp_path / 'b.json'}", "--reuse_measured", f"--cost_model={slow}")
  assert second.returncode == 0, second.stderr[-2000:]
  a, b = (json.loads((tmp_path / n).read_text())["cases"][0] for n in ("a.json", "b.json"))
  assert a["measured_duration_s"] == b["measured_duration_s"] and a["requests"] == 3
  assert a["ttft"]["measured_median_ms"] == b["ttft"]["measured_median_ms"]
  # 500 ms a step and at least 6 steps (the longest output): over 3 s.
  assert b["simulated_duration_s"] > 6 * 0.5 > a["simulated_duration_s"]
  other = run(f"--out={tmp_path / 'c.json'}", "--reuse_measured", "--time_scales=2")
  assert other.returncode != 0 and "--measured has no case" in other.stderr
  # A measurement against itself: every per-request difference is exactly 0.
  same = run(f"--out={tmp_path / 'd.json'}", "--reuse_measured", f"--measured_again={measured}")
  assert same.returncode == 0, same.stderr[-2000:]
  rep = json.loads((tmp_path / "d.json").read_text())["cases"][0]["repeatability"]
  assert rep["completed_in_both"] == 3 and rep["duration_rel_err"] == 0.0
  assert rep["again_duration_s"] == rep["measured_duration_s"] == a["measured_duration_s"]
  assert all(rep[k]["median_rel_err"] == rep[k]["p90_rel_err"] == 0.0
             for k in ("ttft", "tpot", "e2el"))
