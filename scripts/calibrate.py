"""Calibrates the simulated executor's step-time model on this device.

  python scripts/calibrate.py                      # --model, on an idle machine
  python scripts/calibrate.py \
      --second_model=random:smollm2-135m,d_model=960,n_heads=15,n_kv_heads=5,ffn_dim=2560
  python scripts/calibrate.py --holdout_only --out=PATH
  python scripts/calibrate.py --quick              # a smaller grid (QUICK_GRID)

The protocol (``serving.engine.cost_model`` holds the model it fits):

1. Refuses to start when the machine is busy: the 1-minute load average
   above ``--max_load`` (default 1.5 on this 2-core kind of machine: a
   calibration taken beside other jobs was 5-45x off).
2. Measures real step times of the model executor over a grid that covers
   what replays run: batches of N prompts of L tokens (N in
   ``--batch_sizes``, L in ``--prompt_lens``, N x L at most
   ``--max_case_tokens``), each then decoding ``--decode_tokens`` tokens, the
   second half arriving once the first half decodes — prefill-only, mixed
   (prefill chunks beside decode rows) and decode-only steps,
   batch 1..max_num_seqs, contexts to max_model_len, the buckets those
   shapes need — after a warmup that compiles every bucket. Each grid case
   runs ``--repeats`` times; the spread of a case's step times across
   repeats (the median over steps of max/min - 1) above ``--max_spread``
   refuses the calibration (a busy machine). (A load average taken after the
   grid would count the calibration's own threads: it is recorded, not
   checked.)
3. Fits the model's features (``cost_model.FEATURES``) by non-negative
   least squares. On one model the weight-read term cannot be told from the
   per-step term and is left out (the calibration then predicts that model
   only); ``--second_model`` (another width: a checkpoint, or ``random:`` a
   preset with overrides, random weights of that shape) runs the grid again
   so every term is fitted and the calibration predicts any model through
   its features.
4. Writes JSON keyed by model, dtype, engine preset and the device
   fingerprint (``calibrations.device_fingerprint``), by default under
   ``--cache_dir``/calibration, where simulated launchers on this device
   find it; and the grid (``*_grid.npz``) beside it for ``--refit``.
5. Held-out check: replays a short workload in real time with the model
   executor and again on the simulated executor with the new calibration,
   and reports per-request relative errors (median and p90) of TTFT, TPOT
   and E2EL and the replay durations.

``--quick`` runs a smaller grid (``QUICK_GRID``: 2 batch sizes x 2 prompt
lengths, 4 output tokens, a held-out replay of 8 requests), meant to fit in
about 5 minutes on an idle machine where no shipped calibration holds; a
flag given explicitly wins over it. Its error against the full protocol
(about twice it, on one machine) is in docs/simulator.md; the JSON's grid
says ``quick``.

``--refit_steps=PATH[,PATH...]`` fits the same features by the same NNLS
on the steps of real replays instead of the grid: the step logs of
``scripts/fidelity.py --step_log`` (``serving.harness.step_log.fit_steps``).
The measurement happened there, so no grid runs, no model loads and there is
no spread or held-out check here (``scripts/fidelity.py`` with the new
calibration on another window is that check); a log recorded at a load
average above ``--max_load`` is refused. The calibration's meta says its
source ("replay steps"), files and step count.
"""

import dataclasses
import gc
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from models.loaders import load_model
from serving.engine import calibrations as cal_lib
from serving.engine import cost_model as cost_lib
from serving import cli
from serving.cli import launch
from serving.harness import step_log
from serving.harness import synthetic
from serving.engine.config import SamplingParams
from serving.engine.engine import Engine
from serving.harness.replay import fidelity, replay
from serving.engine.sim_executor import VirtualClock

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "", "Calibration JSON; default <cache_dir>/calibration/"
                    "<model>_<dtype>_<engine>_<device id>.json.")
flags.DEFINE_string("second_model", "", "A model of another width whose grid is fitted "
                    "too (a checkpoint, preset or GGUF; or random:PRESET[,key=value...] "
                    "for random weights of that preset's shape with overrides).")
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "Grid: requests per batch (N).")
flags.DEFINE_list("prompt_lens", ["32", "256", "1024"], "Grid: prompt tokens (L).")
flags.DEFINE_integer("decode_tokens", 8, "Grid: output tokens per request.")
flags.DEFINE_integer("repeats", 2, "Grid: runs of each case (the spread check).")
flags.DEFINE_integer("max_case_tokens", 9000, "Grid: skip cases whose N x L prompt tokens "
                     "exceed this (long contexts at small N, large N at short prompts).")
flags.DEFINE_float("max_load", 1.5, "Refuse when the 1-minute load average is above this.")
flags.DEFINE_float("max_spread", 0.15, "Refuse when the median spread of a step's time "
                   "across repeats (max/min - 1) is above this.")
flags.DEFINE_list("refit", None, "Fit from saved grids (.npz of previous runs, e.g. one "
                  "per model, each measured in its own process) instead of measuring; "
                  "keeps their meta (models, loads and spreads of each).")
flags.DEFINE_list("features", None, "Fit only these of cost_model.FEATURES (the others stay "
                  "0), e.g. the terms a validation on replay steps kept; default: all (the "
                  "weight-read term only with two or more models).")
flags.DEFINE_enum("fit_error", "absolute", ["absolute", "relative"], "What the fit "
                  "minimizes: the steps' errors in ms, or their relative errors (each "
                  "step weighted by 1 / its time; short decode steps count as much as "
                  "long prompt steps).")
flags.DEFINE_list("refit_steps", None, "Fit on the steps of real replays (.npz step logs "
                  "of scripts/fidelity.py --step_log) instead of measuring a grid.")
flags.DEFINE_bool("holdout_only", False, "Skip the grid; check the calibration in "
                  "--out on the held-out replay.")
flags.DEFINE_bool("quick", False, "A smaller grid (QUICK_GRID; flags given explicitly win): "
                  "about 5 minutes on an idle machine; its error against the full grid: "
                  "docs/simulator.md.")
flags.DEFINE_integer("holdout_requests", 24, "Held-out replay: synthetic Azure-conv "
                     "requests (prompts <= 512, outputs <= 32 tokens).")
flags.DEFINE_float("holdout_rate_scale", 0.1, "Held-out replay: fraction of the Azure "
                   "conv arrival rate.")
flags.DEFINE_string("holdout_out", "runs/calibration_holdout.json", "Held-out report.")
launch.define_engine_flags()


# --quick: the grid's flags and their values (each unless given explicitly).
QUICK_GRID = {"batch_sizes": ["1", "8"], "prompt_lens": ["32", "256"], "decode_tokens": 4,
              "holdout_requests": 8}


def apply_quick() -> None:
  """With --quick, sets each of ``QUICK_GRID``'s flags not given explicitly."""
  if FLAGS.quick:
    for name, value in QUICK_GRID.items():
      if not FLAGS[name].present:
        FLAGS[name].value = value


class BusyMachine(ValueError):
  """The machine is too busy to calibrate on (load or spread)."""


def check_load(when: str, max_load: float) -> float:
  """The 1-minute load average; raises BusyMachine above ``max_load``."""
  load = os.getloadavg()[0]
  if load > max_load:
    raise BusyMachine(f"machine busy {when}: 1-minute load average {load:.2f} > --max_load="
                      f"{max_load} (stop other jobs; a calibration taken beside them is wrong)")
  return load


def spread(times_by_repeat) -> float:
  """Median over steps of max/min - 1 across repeats (f64[repeats, steps])."""
  t = np.asarray(times_by_repeat, np.float64)
  return float(np.median(t.max(axis=0) / t.min(axis=0) - 1.0))


def second_model(spec: str, dtype):
  """(cfg, params) of ``--second_model``: ``random:PRESET,key=value,...``
  (``launch.random_model``: random weights of that shape) or any model the
  loader reads."""
  if spec.startswith(launch.RANDOM_PREFIX):
    cfg, params, _ = launch.random_model(spec, dtype, flag="--second_model")
  else:
    cfg, params, _ = load_model(spec, dtype=dtype)
  return cfg, params


def measure_grid(engine_cfg, cfg, params):
  """Step features and times (ms) over the grid, each case --repeats times.

  Returns (features f64[N, len(FEATURES)], step_ms f64[N] (the median over
  repeats), spread). Prompt ids are drawn in [20, min(1000, vocab))."""
  rng = np.random.default_rng(0)
  top = min(1000, cfg.vocab_size)
  rows, times, spreads = [], [], []
  for n in (int(x) for x in FLAGS.batch_sizes):
    for length in (int(x) for x in FLAGS.prompt_lens):
      if n * length > FLAGS.max_case_tokens:
        continue
      prompts = [rng.integers(20, top, size=length).tolist() for _ in range(n)]
      runs, feats = [], None
      for _ in range(FLAGS.repeats):
        engine = Engine(cfg, params, engine_cfg)
        # Two waves: the second half's prompts arrive once the first half
        # decodes, so their prefill chunks share steps with decode rows.
        first = max(1, n // 2)
        sampling = SamplingParams(max_tokens=FLAGS.decode_tokens, ignore_eos=True)
        for i, p in enumerate(prompts[:first]):
          engine.add_request(f"g{i}", p, sampling)
        waiting = list(enumerate(prompts))[first:]
        run_feats, run_times = [], []
        while engine.has_unfinished() or waiting:
          if waiting and all(engine.requests[f"g{i}"].output_token_ids
                             for i in range(first)):
            for i, p in waiting:
              engine.add_request(f"g{i}", p, sampling)
            waiting = []
          done = engine.num_iterations
          t = time.perf_counter()
          engine.step()
          dt_ms = (time.perf_counter() - t) * 1000.0
          if engine.num_iterations > done:
            run_feats.append(engine.last_step_features)
            run_times.append(dt_ms)
        if feats is not None and len(run_feats) != len(feats):
          raise RuntimeError(f"N={n} L={length}: repeats ran {len(feats)} and "
                             f"{len(run_feats)} steps (the schedule must repeat)")
        feats = run_feats
        runs.append(run_times)
        del engine               # one KV cache alive at a time
        gc.collect()
      spreads.append(spread(runs))
      rows.extend(feats)
      times.extend(np.median(np.asarray(runs), axis=0))
      print(f"{cfg.name} N={n:3d} L={length:5d}: {len(feats)} steps, median "
            f"{np.median(runs):.1f} ms, spread {spreads[-1]:.3f}")
  return np.array(rows, np.float64), np.array(times, np.float64), float(np.median(spreads))


def _efficiencies(model) -> dict:
  """``CostModel.efficiencies`` as JSON: null for a term the fit left at 0
  (its inf is no JSON number)."""
  return {f: (None if math.isinf(v) else v) for f, v in model.efficiencies().items()}


def holdout(engine_cfg, cfg, params, vocab, cost_path):
  """``replay.fidelity`` of the simulated replay of a short workload against
  its real replay (model executor, wall clock)."""
  output_len = min(32, engine_cfg.max_model_len // 4)
  wl = synthetic.synthetic_azure_conv(FLAGS.holdout_requests, FLAGS.holdout_rate_scale,
                                      max_prompt_len=min(512, engine_cfg.max_model_len
                                                         - output_len),
                                      max_output_len=output_len, seed=7, vocab_size=vocab)
  engine = Engine(cfg, params, engine_cfg)
  # Every program compiled before the clock starts (after --refit or
  # --holdout_only nothing is yet): a compile inside the replay is not a step.
  launch.warmup(engine)
  real_recs, real_s = replay(engine, wl, realtime=True)
  sim_cfg = dataclasses.replace(engine_cfg, executor="simulated", cost_model=cost_path)
  sim_recs, sim_s = replay(Engine(cfg, None, sim_cfg, clock=VirtualClock()), wl)
  return {**fidelity(real_recs, sim_recs, real_s, sim_s), "load_avg": os.getloadavg()}


def default_out(dtype: str, engine: str, model_name: str, fingerprint: dict) -> str:
  safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
  return os.path.join(FLAGS.cache_dir or ".", "calibration",
                      f"{safe}_{dtype}_{engine}_{fingerprint['id']}.json")


def refit_steps(paths) -> None:
  """Fits and writes a calibration from real replays' step logs."""
  model = step_log.fit_steps(paths, FLAGS.max_load, features=FLAGS.features,
                             relative=FLAGS.fit_error == "relative")
  meta = model.meta
  out = FLAGS.out or default_out(meta["dtype"], meta["engine"], meta["model"], meta["device"])
  model.save(out)
  print(json.dumps({**model.to_json(), "efficiencies": _efficiencies(model)}, indent=1))
  print(f"calibration: {out}")


def _check_grid(engine_cfg) -> None:
  """The grid's flags, checked before the model loads: each prompt and its
  --decode_tokens must fit the engine's context (ValueError naming the flag)."""
  longest = max(int(x) for x in FLAGS.prompt_lens)
  if longest + FLAGS.decode_tokens > engine_cfg.max_model_len:
    raise ValueError(f"--prompt_lens={longest} plus --decode_tokens={FLAGS.decode_tokens} "
                     f"exceeds the engine's max_model_len={engine_cfg.max_model_len} "
                     f"(--engine={FLAGS.engine})")
  if FLAGS.repeats < 2 and not FLAGS.refit:
    raise ValueError(f"--repeats must be >= 2 (the spread check), got {FLAGS.repeats}")


def _check_flags() -> None:
  """Every flag's value, checked before the load check and before any model
  loads (ValueError naming the flag and the rule): bounds, the grid's
  numbers, the files read (--refit, --refit_steps) and the models
  (--model, --second_model: a ``random:`` spec parses)."""
  unknown = sorted(set(FLAGS.features or ()) - set(cost_lib.FEATURES))
  if unknown:
    raise ValueError(f"--features: unknown term(s) {unknown}; the terms are "
                     f"{list(cost_lib.FEATURES)}")
  for name in ("max_load", "max_spread"):
    if not FLAGS[name].value > 0:
      raise ValueError(f"--{name} must be > 0, got {FLAGS[name].value}")
  if FLAGS.refit_steps and (FLAGS.refit or FLAGS.holdout_only):
    raise ValueError("--refit_steps fits on its own; leave out --refit and --holdout_only")
  for name in ("refit", "refit_steps"):
    for path in FLAGS[name].value or ():
      if not os.path.isfile(path):
        raise ValueError(f"--{name}: {path!r} is not a file")
  if FLAGS.holdout_only and FLAGS.out and not os.path.isfile(FLAGS.out):
    raise ValueError(f"--holdout_only checks the calibration in --out: {FLAGS.out!r} is "
                     f"not a file")
  if FLAGS.out and not FLAGS.holdout_only:
    cli.check_creatable("out", FLAGS.out)
  if FLAGS.refit_steps:
    return                             # no grid runs and no model loads
  for name in ("batch_sizes", "prompt_lens"):
    if not FLAGS[name].value:
      raise ValueError(f"--{name} must be a non-empty list of integers >= 1 (the grid's "
                       f"axis), got ''")
    for x in FLAGS[name].value:
      if not (x.isdigit() and int(x) >= 1):
        raise ValueError(f"--{name} must be integers >= 1, got {x!r}")
  for name in ("decode_tokens", "max_case_tokens", "holdout_requests"):
    if FLAGS[name].value < 1:
      raise ValueError(f"--{name} must be >= 1, got {FLAGS[name].value}")
  smallest = min(int(x) for x in FLAGS.batch_sizes) * min(int(x) for x in FLAGS.prompt_lens)
  if smallest > FLAGS.max_case_tokens:
    raise ValueError(f"--max_case_tokens={FLAGS.max_case_tokens} skips every grid case: the "
                     f"smallest N x L of --batch_sizes and --prompt_lens is {smallest}")
  cli.check_creatable("holdout_out", FLAGS.holdout_out)
  launch.check_model_spec("--model", FLAGS.model)
  if FLAGS.second_model:
    launch.check_model_spec("--second_model", FLAGS.second_model)
  launch.check_cache_dir()


def main(argv):
  del argv
  apply_quick()
  _check_flags()
  if FLAGS.refit_steps:
    return refit_steps(FLAGS.refit_steps)
  engine_cfg = launch.engine_config()
  fingerprint = cal_lib.device_fingerprint()
  measuring = not FLAGS.holdout_only and not FLAGS.refit
  if measuring:
    _check_grid(engine_cfg)
    load_before = check_load("before measuring", FLAGS.max_load)
  cfg, params, _ = launch.load_flags_model(engine_cfg)
  out = FLAGS.out or default_out(engine_cfg.dtype, FLAGS.engine, cfg.name, fingerprint)
  if not FLAGS.holdout_only:
    models = [(cfg, params)]
    if FLAGS.second_model:
      dtype = jnp.bfloat16 if engine_cfg.dtype == "bfloat16" else jnp.float32
      models.append(second_model(FLAGS.second_model, dtype))
    if FLAGS.refit:
      x, y, meta = step_log.load_grids(FLAGS.refit)
    else:
      xs, ys, spreads = [], [], []
      for model_cfg, model_params in models:
        launch.warmup(Engine(model_cfg, model_params, engine_cfg))
        gc.collect()
        x, y, s = measure_grid(engine_cfg, model_cfg, model_params)
        xs.append(x)
        ys.append(y)
        spreads.append(s)
      x, y = np.concatenate(xs), np.concatenate(ys)
      # The load average now includes this process's own threads (about 2 on
      # 2 cores): contention during the grid is judged by the spread instead.
      load_after = os.getloadavg()[0]
      if max(spreads) > FLAGS.max_spread:
        raise BusyMachine(f"step times spread {max(spreads):.3f} across repeats > "
                          f"--max_spread={FLAGS.max_spread}: the machine is not quiet")
      meta = dict(model=cfg.name, family=cfg.family, dtype=engine_cfg.dtype,
                  engine=FLAGS.engine, device=fingerprint,
                  models=[cost_lib.engine_model_costs(m, engine_cfg).to_json()
                          for m, _ in models],
                  model_names=[m.name for m, _ in models],
                  platform=f"{jax.default_backend()} {jax.devices()[0].device_kind}",
                  jax_version=jax.__version__,
                  grid=dict(batch_sizes=FLAGS.batch_sizes, prompt_lens=FLAGS.prompt_lens,
                            decode_tokens=FLAGS.decode_tokens, repeats=FLAGS.repeats,
                            quick=FLAGS.quick),
                  load_avg_before=load_before, load_avg_after=load_after,
                  step_time_spread=spreads, max_load=FLAGS.max_load,
                  max_spread=FLAGS.max_spread,
                  created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    free = [f for f in FLAGS.features or cost_lib.FEATURES
            if f != "weight_read_gb" or len(meta["models"]) > 1]
    model = cost_lib.fit(x, y, free=free, min_step_ms=float(np.min(y)) * 0.5, meta=meta,
                         relative=FLAGS.fit_error == "relative")
    model.save(out)
    if not FLAGS.refit:
      np.savez(os.path.splitext(out)[0] + "_grid.npz", features=x, step_ms=y,
               meta=json.dumps(meta))
    print(json.dumps({**model.to_json(), "efficiencies": _efficiencies(model)}, indent=1))
  result = holdout(engine_cfg, cfg, params, cfg.vocab_size, out)
  result["load_avg_ok"] = result["load_avg"][0] <= FLAGS.max_load
  if not result["load_avg_ok"]:
    print(f"held-out check: the 1-minute load was {result['load_avg'][0]:.2f} at its start "
          f"(> --max_load={FLAGS.max_load}): its measured replay ran beside other work, so "
          f"its errors measure that contention as much as the calibration; check again "
          f"alone (--holdout_only)", file=sys.stderr)
  os.makedirs(os.path.dirname(FLAGS.holdout_out) or ".", exist_ok=True)
  with open(FLAGS.holdout_out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1))
  print(f"calibration: {out}")


if __name__ == "__main__":
  cli.run(main)
