"""Measures the simulator's fidelity: real replays against simulated ones.

  python scripts/fidelity.py \
      --traces=azure:CONV_CSV,azure:CODE_CSV \
      --window_s=0,30 --time_scales=8,2,1 --out=runs/fidelity.json

(CONV_CSV, CODE_CSV: the Azure 2023 trace's AzureLLMInferenceTrace_conv.csv
and AzureLLMInferenceTrace_code.csv, e.g. under ../shared/data/traces/azure2023/.)
For each trace and each ``--time_scales`` entry (inter-arrival gaps
multiplied by it: larger is lighter load), replays the same workload twice:
with the model executor on the wall clock (what really happens) and with the
simulated executor on the virtual clock under the engine's cost model
(``--cost_model``, or the calibration ``launch.engine_config`` finds), and
writes ``serving.harness.replay.fidelity`` per case: per-request median and p90
relative error of TTFT, TPOT and E2EL, and the replay durations. Each case
records the load average before and after its real replay (which count this
process's own threads); the run refuses to start above ``--max_load``: a
fidelity figure taken on a busy machine says nothing about the simulator.

``--step_log=PATH`` also logs every committed step of each real replay
(``serving.harness.step_log``): its cost features, the wall time of its
``engine.step()`` call, the cost model's prediction and its class
(prefill-only, mixed, decode-only), all cases in one .npz;
each case's ``steps`` in the JSON sums them and gives per class the median
of predicted / measured - 1, and ``simulated_steps`` counts the simulated
replay's steps per class (with both replays' iteration counts: where the
schedules differ).
``scripts/calibrate.py --refit_steps=PATH`` fits the cost model on them.

``--measured=PATH`` writes each case's real replay (its per-request
records, duration, iterations, load averages) to one JSON; with
``--reuse_measured`` the cases are read back from it instead of replayed, so
another cost model is checked against the same measurement (no real replay
runs, no model weights load, and the load check is skipped: only simulated
replays run).

``--measured_again=PATH`` reads a second ``--measured`` JSON of the same
cases, measured in another run, and gives each case ``repeatability``: the
same per-request errors between the two real replays (``fidelity`` of one
against the other: the signed errors are again - measured, and the second
replay's duration is ``again_duration_s``), with the second run's load
averages. That is the machine's own repeatability: a cost model
cannot be closer to one real replay than another real replay is.
"""

import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

import jax

from serving import cli
from serving.cli import launch, workload_flags
from serving.engine import calibrations as cal_lib
from serving.engine import cost_model as cost_lib
from serving.harness import step_log
from serving.harness import traces
from serving.harness import workloads
from serving.engine.engine import Engine
from serving.harness.metrics import RequestRecord
from serving.harness.replay import fidelity, replay
from serving.harness.replay import path as replay_path
from serving.engine.sim_executor import VirtualClock

FLAGS = flags.FLAGS
flags.DEFINE_list("traces", None, "KIND:PATH traces (azure, mooncake, vtc).")
flags.DEFINE_list("window_s", ["0", "30"], "N: the first N seconds of arrivals; A,B: the "
                  "arrivals in [t0+A, t0+B) seconds.")
flags.DEFINE_list("time_scales", ["8", "2", "1"], "Loads: inter-arrival gaps x this.")
flags.DEFINE_integer("max_prompt_len", 1024, "Clip longer prompts.")
flags.DEFINE_integer("max_output_len", 256, "Cap output lengths.")
flags.DEFINE_integer("max_requests", None, "Keep at most this many requests per case.")
flags.DEFINE_float("max_load", 1.5, "Refuse a case measured above this load average.")
flags.DEFINE_string("out", "runs/fidelity.json", "Result JSON.")
flags.DEFINE_string("step_log", None, "Also log every step of the real replays (features, "
                    "measured and predicted ms, class) to this .npz "
                    "(scripts/calibrate.py --refit_steps fits on it).")
flags.DEFINE_string("measured", None, "Write the real replays' per-request records to this "
                    "JSON (or, with --reuse_measured, read them from it).")
flags.DEFINE_string("measured_again", None, "A second --measured JSON of the same cases "
                    "(another run): each case also reports the two real replays' "
                    "per-request difference (repeatability).")
flags.DEFINE_bool("reuse_measured", False, "Check the cost model against the real replays in "
                  "--measured instead of replaying (simulated replays only).")
launch.define_engine_flags()


def _case_key(trace: str, scale: float) -> str:
  return f"{trace}@x{scale:g}"


def _load_measured(path: str, flag: str = "--measured") -> dict:
  """The real replays a ``--measured`` run wrote.

  Raises:
    ValueError: naming ``flag``, when the file is not such a JSON.
  """
  try:
    with open(path) as f:
      data = json.load(f)
    if "model" not in data:
      raise KeyError("model")
    for case in data["cases"].values():
      case["records"] = [RequestRecord(**r) for r in case["records"]]
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"{flag} {path!r} is not a JSON of measured replays (written by "
                     f"--measured without --reuse_measured): {type(e).__name__}: {e}") from None
  return data


def _measured_case(data: dict, key: str, requests: int, flag: str) -> dict:
  """Case ``key`` of a ``--measured`` JSON, checked against the workload's
  request count (ValueError naming ``flag`` when it has no such case, or
  one of another size: another window or clipping)."""
  if key not in data["cases"]:
    raise ValueError(f"{flag} has no case {key!r} (it has {sorted(data['cases'])})")
  m = data["cases"][key]
  if m["requests"] != requests:
    raise ValueError(f"{flag} case {key!r} has {m['requests']} requests, the "
                     f"workload {requests}: another window or clipping")
  return m


def _workload(trace: str, time_scale: float, vocab: int, max_model_len: int):
  loader, path = traces.trace_loader(trace, "--traces entries")
  wl = loader(path, time_scale=time_scale, window_s=workload_flags.parse_window(FLAGS.window_s),
            max_requests=FLAGS.max_requests, max_prompt_len=FLAGS.max_prompt_len,
            max_output_len=FLAGS.max_output_len, seed=0, vocab_size=vocab)
  return workloads.fit_context(wl, max_model_len)


def _check_flags() -> None:
  """Every flag's value, checked before the load check and before any model
  loads (ValueError naming the flag and the rule): the traces' specs and
  files, the window, time scales and bounds, the files written and read,
  and --model (a ``random:`` spec parses)."""
  if not FLAGS.traces:
    raise ValueError("--traces is required (KIND:PATH,...)")
  for trace in FLAGS.traces:
    traces.trace_loader(trace, "--traces entries")
    traces.trace_loader(trace, "--traces", check_file=True)
  a, b = workload_flags.parse_window(FLAGS.window_s)
  for x in FLAGS.time_scales:
    try:
      ok = float(x) > 0 and math.isfinite(float(x))
    except ValueError:
      ok = False
    if not ok:
      raise ValueError(f"--time_scales must be numbers > 0, got {x!r}")
  slowest = max(float(x) for x in FLAGS.time_scales)
  workload_flags.check_replay_span(
      f"--window_s={','.join(FLAGS.window_s)} x --time_scales={slowest:g}",
      f"a window of {b - a:g} s", (b - a) * slowest)
  if not FLAGS.max_load > 0:
    raise ValueError(f"--max_load must be > 0, got {FLAGS.max_load}")
  for name in ("max_prompt_len", "max_output_len", "max_requests"):
    value = FLAGS[name].value
    if value is not None and value < 1:
      raise ValueError(f"--{name} must be >= 1, got {value}")
  cli.check_creatable("out", FLAGS.out)
  if FLAGS.reuse_measured and not FLAGS.measured:
    raise ValueError("--reuse_measured needs --measured=PATH (the real replays to read)")
  if FLAGS.reuse_measured and FLAGS.step_log:
    raise ValueError("--step_log logs real replays; --reuse_measured runs none")
  if FLAGS.reuse_measured and not os.path.isfile(FLAGS.measured):
    raise ValueError(f"--measured: {FLAGS.measured!r} is not a file (--reuse_measured "
                     f"reads it)")
  if FLAGS.measured_again and not os.path.isfile(FLAGS.measured_again):
    raise ValueError(f"--measured_again: {FLAGS.measured_again!r} is not a file (a "
                     f"--measured JSON of another run)")
  if FLAGS.step_log:
    cli.check_creatable("step_log", FLAGS.step_log)
  if FLAGS.measured and not FLAGS.reuse_measured:
    cli.check_creatable("measured", FLAGS.measured)
  launch.check_model_spec("--model", FLAGS.model)
  launch.check_cache_dir()


def main(argv):
  del argv
  _check_flags()
  engine_cfg = launch.engine_config()
  sim_cfg = launch.engine_config(executor="simulated")
  measured = _load_measured(FLAGS.measured) if FLAGS.reuse_measured else None
  again = (_load_measured(FLAGS.measured_again, "--measured_again")
           if FLAGS.measured_again else None)
  # Checked before this process loads or compiles anything: afterwards the
  # load average counts its own threads (recorded per case, not checked).
  load_at_start = os.getloadavg()[0]
  if load_at_start > FLAGS.max_load and not FLAGS.reuse_measured:
    raise ValueError(f"machine busy: load average {load_at_start:.2f} > "
                     f"--max_load={FLAGS.max_load} (stop other jobs first)")
  if measured is None:
    cfg, params, _ = launch.load_flags_model(engine_cfg)
    launch.warmup(Engine(cfg, params, engine_cfg), 64)
  else:
    cfg, params, _ = launch.load_flags_model(sim_cfg)     # the config only
    if measured["model"] != cfg.name:
      raise ValueError(f"--measured holds replays of {measured['model']!r}, not {cfg.name!r}")
  if again is not None and again["model"] != cfg.name:
    raise ValueError(f"--measured_again holds replays of {again['model']!r}, not {cfg.name!r}")
  saved = {"model": cfg.name, "engine": FLAGS.engine, "cases": {}}
  model_costs = cost_lib.engine_model_costs(cfg, engine_cfg)
  steps = None
  if FLAGS.step_log:
    cost = cal_lib.resolve(cal_lib.load(sim_cfg.cost_model), model_costs,
                           say=cal_lib.say_once)
    steps = step_log.StepLog(cost)
    log_meta = dict(model=cfg.name, family=cfg.family, dtype=engine_cfg.dtype,
                    engine=FLAGS.engine, device=cal_lib.device_fingerprint(),
                    models=[model_costs.to_json()], max_load=FLAGS.max_load,
                    platform=f"{jax.default_backend()} {jax.devices()[0].device_kind}")
  cases = []
  result = {"engine": FLAGS.engine, "model": FLAGS.model, "cost_model": None,
            "load_avg_at_start": load_at_start, "cases": cases,
            "measured": FLAGS.measured, "reused_measured": FLAGS.reuse_measured}
  for trace in FLAGS.traces:
    for scale in (float(x) for x in FLAGS.time_scales):
      wl = _workload(trace, scale, cfg.vocab_size, engine_cfg.max_model_len)
      key = _case_key(trace, scale)
      if measured is not None:
        m = _measured_case(measured, key, len(wl), "--measured")
        real, real_s, wall_s = m["records"], m["duration_s"], m["wall_s"]
        load_before, load_after = m["load_avg_before"], m["load_avg_after"]
        real_iterations = m["iterations"]
      else:
        load_before = os.getloadavg()[0]
      info = {"trace": trace, "window_s": FLAGS.window_s, "time_scale": scale,
              "offered_req_s": len(wl) / max(wl.duration_s, 1e-9),
              "load_avg_before": load_before}
      if measured is None:
        real_engine = Engine(cfg, params, engine_cfg)
        t = time.perf_counter()
        if steps is None:
          real, real_s = replay(real_engine, wl, realtime=True)
        else:
          real, real_s = steps.replay(real_engine, wl, info, realtime=True)
        wall_s = time.perf_counter() - t
        load_after = os.getloadavg()[0]
        real_iterations = real_engine.num_iterations
        del real_engine          # one KV cache alive at a time
      if FLAGS.measured and measured is None:
        saved["cases"][key] = {
            "requests": len(wl), "duration_s": real_s, "wall_s": wall_s,
            "iterations": real_iterations, "load_avg_before": load_before,
            "load_avg_after": load_after,
            "records": [dataclasses.asdict(r) for r in real]}
        with open(FLAGS.measured, "w") as f:
          json.dump(saved, f)
      sim_engine = Engine(cfg, None, sim_cfg, clock=VirtualClock())
      result["cost_model"] = sim_engine.cost_model.to_json()
      if steps is None:
        sim_path = replay_path(sim_engine)
        sim, sim_s = replay(sim_engine, wl)
      else:
        sim_path = ("step", "a step log (--step_log) records every step")
        sim_steps = step_log.StepLog(steps.cost)
        sim, sim_s = sim_steps.replay(sim_engine, wl)
      case = {**info, "load_avg_after": load_after, "real_wall_s": wall_s,
              "simulated_path": {"path": sim_path[0], "why": sim_path[1]},
              "iterations": {"measured": real_iterations,
                             "simulated": sim_engine.num_iterations},
              **fidelity(real, sim, real_s, sim_s)}
      if again is not None:
        other = _measured_case(again, key, len(wl), "--measured_again")
        rep = fidelity(real, other["records"], real_s, other["duration_s"])
        rep["again_duration_s"] = rep.pop("simulated_duration_s")
        case["repeatability"] = {"load_avg_before": other["load_avg_before"],
                                 "load_avg_after": other["load_avg_after"], **rep}
      if steps is not None:
        steps.cases[-1]["load_avg_after"] = load_after
        case["steps"] = steps.summary(len(steps.cases) - 1)
        case["simulated_steps"] = sim_steps.schedule(0)
        steps.save(FLAGS.step_log, load_at_start, log_meta)
      cases.append(case)
      os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
      with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1)
      summary = {k: (case[k]["median_rel_err"] if case[k] else None)
                 for k in ("ttft", "tpot", "e2el")}
      print(f"{trace.rsplit('/', 1)[-1]} x{scale}: {len(wl)} requests, measured "
            f"{real_s:.1f} s vs simulated {sim_s:.1f} s; median rel err {summary}; "
            f"load {load_before:.2f} -> {load_after:.2f}; iterations "
            f"{real_iterations} measured, {sim_engine.num_iterations} simulated")
      if again is not None:
        rep = case["repeatability"]
        median = {k: (rep[k]["median_rel_err"] if rep[k] else None)
                  for k in ("ttft", "tpot", "e2el")}
        print(f"  measured again: {rep['measured_duration_s']:.1f} vs "
              f"{rep['again_duration_s']:.1f} s; median rel err {median}")


if __name__ == "__main__":
  cli.run(main)
