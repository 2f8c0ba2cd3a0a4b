"""Calibrates the step-time cost model of the simulated executor.

  python scripts/calibrate.py --out=configs/calibration/cost_model_smollm2_cpu.json
  python scripts/calibrate.py --holdout_only --out=configs/calibration/cost_model_smollm2_cpu.json

1. Measures real step times of the model executor over a grid of batch
   shapes (batches of N equal prompts of L tokens, each then decoding a few
   tokens: prefill-heavy, mixed and decode-only steps over growing
   contexts), timing every ``Engine.step`` after the buckets are compiled.
2. Fits ``serving.cost_model`` by non-negative least squares
   (``scipy.optimize.nnls``: the intercept and every coefficient >= 0) and
   writes JSON naming the model, dtype, backend, machine and jax version.
3. Held-out check: replays a short workload in real time with the model
   executor and again with the simulated executor on a virtual clock, and
   reports the median and p90 absolute error of per-request TTFT and E2EL
   (ms).
"""

import dataclasses
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from absl import flags

from serving import cost_model as cost_lib
from serving import cli, launch, workloads
from serving.config import SamplingParams
from serving.engine import Engine
from serving.replay import replay
from serving.sim_executor import VirtualClock

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "configs/calibration/cost_model_smollm2_cpu.json", "Calibration JSON.")
flags.DEFINE_list("batch_sizes", ["1", "4", "16", "32"], "Grid: requests per batch (N).")
flags.DEFINE_list("prompt_lens", ["32", "256", "1024"], "Grid: prompt tokens (L).")
flags.DEFINE_integer("decode_tokens", 8, "Grid: output tokens per request.")
flags.DEFINE_string("refit", None, "Fit from a saved grid (.npz of a previous run) "
                    "instead of measuring; keeps the calibration's meta.")
flags.DEFINE_bool("holdout_only", False, "Skip the grid; check the calibration in "
                  "--out on the held-out replay.")
flags.DEFINE_integer("holdout_requests", 24, "Held-out replay: synthetic Azure-conv "
                     "requests (prompts <= 512, outputs <= 32 tokens).")
flags.DEFINE_float("holdout_rate_scale", 0.1, "Held-out replay: fraction of the Azure "
                   "conv arrival rate.")
flags.DEFINE_string("holdout_out", "runs/calibration_holdout.json", "Held-out report.")
launch.define_engine_flags()


def step_features(entry, engine) -> list:
  """FEATURES of one logged plan (``Engine.plan_log`` entry)."""
  prefill = sum(e - s for _, s, e, kind in entry["scheduled"] if kind != "decode_row")
  decode = sum(1 for *_, kind in entry["scheduled"] if kind == "decode_row")
  kv_read = sum((e - s) * (s + e + 1) / 2 for _, s, e, _ in entry["scheduled"])
  return [prefill, decode, kv_read, engine.config.bucket_for(max(prefill + decode, 1))]


def measure_grid(engine_cfg, cfg, params):
  """Step features and times (ms) over the --batch_sizes x --prompt_lens grid;
  prompt ids are drawn in [20, min(1000, vocab_size))."""
  rng = np.random.default_rng(0)
  top = min(1000, cfg.vocab_size)
  rows, times = [], []
  for n in (int(x) for x in FLAGS.batch_sizes):
    for length in (int(x) for x in FLAGS.prompt_lens):
      engine = Engine(cfg, params, engine_cfg)
      engine.record_plans = True
      for i in range(n):
        engine.add_request(f"g{i}", rng.integers(20, top, size=length).tolist(),
                           SamplingParams(max_tokens=FLAGS.decode_tokens, ignore_eos=True))
      t_case = time.perf_counter()
      while engine.has_unfinished():
        logged = len(engine.plan_log)
        t = time.perf_counter()
        engine.step()
        dt_ms = (time.perf_counter() - t) * 1000.0
        if len(engine.plan_log) > logged:
          rows.append(step_features(engine.plan_log[-1], engine))
          times.append(dt_ms)
      print(f"N={n:3d} L={length:5d}: {engine.num_iterations} steps in "
            f"{time.perf_counter() - t_case:.1f} s")
  return np.array(rows, np.float64), np.array(times, np.float64)


def holdout(engine_cfg, cfg, params, model, vocab):
  """Per-request TTFT/E2EL errors of the simulated replay vs the real one."""
  # Prompts up to 512 tokens and outputs up to 32, both within the context.
  output_len = min(32, engine_cfg.max_model_len // 4)
  wl = workloads.synthetic_azure_conv(FLAGS.holdout_requests, FLAGS.holdout_rate_scale,
                                      max_prompt_len=min(512, engine_cfg.max_model_len
                                                         - output_len),
                                      max_output_len=output_len, seed=7, vocab_size=vocab)
  real_recs, real_s = replay(Engine(cfg, params, engine_cfg), wl, realtime=True)
  sim_cfg = dataclasses.replace(engine_cfg, executor="simulated", cost_model=FLAGS.out)
  sim_recs, sim_s = replay(Engine(cfg, params, sim_cfg, clock=VirtualClock()), wl)
  err = {"ttft_ms": [], "e2el_ms": []}
  for a, b in zip(real_recs, sim_recs):
    if a.outcome == b.outcome == "completed":
      err["ttft_ms"].append(abs(a.first_token_s - b.first_token_s) * 1000.0)
      err["e2el_ms"].append(abs(a.token_times_s[-1] - b.token_times_s[-1]) * 1000.0)
  out = {"requests": len(wl), "measured_duration_s": real_s, "simulated_duration_s": sim_s,
         "load_avg": os.getloadavg()}
  for k, v in err.items():
    out[f"median_abs_err_{k}"] = float(np.median(v))
    out[f"p90_abs_err_{k}"] = float(np.percentile(v, 90))
    meas = [((a.first_token_s if k == "ttft_ms" else a.token_times_s[-1]) - a.arrival_s)
            * 1000.0 for a in real_recs if a.outcome == "completed"]
    out[f"measured_median_{k}"] = float(np.median(meas))
  return out


def _check_grid(engine_cfg) -> None:
  """The grid's flags, checked before the model loads: each prompt and its
  --decode_tokens must fit the engine's context (ValueError naming the flag)."""
  longest = max(int(x) for x in FLAGS.prompt_lens)
  if longest + FLAGS.decode_tokens > engine_cfg.max_model_len:
    raise ValueError(f"--prompt_lens={longest} plus --decode_tokens={FLAGS.decode_tokens} "
                     f"exceeds the engine's max_model_len={engine_cfg.max_model_len} "
                     f"(--engine={FLAGS.engine})")


def main(argv):
  del argv
  engine_cfg = launch.engine_config()
  if not FLAGS.holdout_only and not FLAGS.refit:
    _check_grid(engine_cfg)
  cfg, params, _ = launch.load_flags_model(engine_cfg)
  launch.warmup(Engine(cfg, params, engine_cfg))
  if not FLAGS.holdout_only:
    if FLAGS.refit:
      grid = np.load(FLAGS.refit)
      x, y = grid["features"], grid["step_ms"]
    else:
      x, y = measure_grid(engine_cfg, cfg, params)
    meta = dict(model=FLAGS.model, family=cfg.family,
                model_costs=launch.model_costs(cfg, engine_cfg),
                dtype=engine_cfg.dtype, engine=FLAGS.engine,
                backend=jax.default_backend(), device=str(jax.devices()[0]),
                machine=f"{platform.machine()} {os.cpu_count()} cpus {platform.node()}",
                platform=platform.platform(), jax_version=jax.__version__,
                grid=dict(batch_sizes=FLAGS.batch_sizes, prompt_lens=FLAGS.prompt_lens,
                          decode_tokens=FLAGS.decode_tokens),
                load_avg=os.getloadavg(),
                created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    model = cost_lib.fit(x, y, min_step_ms=float(np.min(y)) * 0.5, meta=meta)
    model.save(FLAGS.out)
    if not FLAGS.refit:
      np.savez(os.path.splitext(FLAGS.out)[0] + "_grid.npz", features=x, step_ms=y)
    print(json.dumps(model.to_json(), indent=1))
  result = holdout(engine_cfg, cfg, params, FLAGS.model, cfg.vocab_size)
  os.makedirs(os.path.dirname(FLAGS.holdout_out) or ".", exist_ok=True)
  with open(FLAGS.holdout_out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  cli.run(main)
