"""Measures the simulator's fidelity: real replays against simulated ones.

  python scripts/fidelity.py \
      --traces=azure:../shared/data/traces/azure2023/AzureLLMInferenceTrace_conv.csv,azure:../shared/data/traces/azure2023/AzureLLMInferenceTrace_code.csv \
      --window_s=0,30 --time_scales=8,2,1 --out=runs/fidelity.json

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
"""

import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from serving import cli
from serving.cli import launch
from serving.harness import traces
from serving.harness import workloads
from serving.engine.engine import Engine
from serving.harness.replay import fidelity, replay
from serving.engine.sim_executor import VirtualClock

FLAGS = flags.FLAGS
flags.DEFINE_list("traces", None, "KIND:PATH traces (azure, mooncake, vtc).")
flags.DEFINE_list("window_s", ["0", "30"], "A,B: arrivals in [t0+A, t0+B) seconds.")
flags.DEFINE_list("time_scales", ["8", "2", "1"], "Loads: inter-arrival gaps x this.")
flags.DEFINE_integer("max_prompt_len", 1024, "Clip longer prompts.")
flags.DEFINE_integer("max_output_len", 256, "Cap output lengths.")
flags.DEFINE_integer("max_requests", None, "Keep at most this many requests per case.")
flags.DEFINE_float("max_load", 1.5, "Refuse a case measured above this load average.")
flags.DEFINE_string("out", "runs/fidelity.json", "Result JSON.")
launch.define_engine_flags()


def _workload(trace: str, time_scale: float, vocab: int, max_model_len: int):
  kind, _, path = trace.partition(":")
  loaders = {"azure": traces.load_azure_trace, "mooncake": traces.load_mooncake_trace,
             "vtc": traces.load_vtc_trace}
  if kind not in loaders or not path:
    raise ValueError(f"--traces entries must be KIND:PATH with KIND in {sorted(loaders)}, "
                     f"got {trace!r}")
  a, b = (float(x) for x in FLAGS.window_s)
  wl = loaders[kind](path, time_scale=time_scale, window_s=(a, b),
                     max_requests=FLAGS.max_requests, max_prompt_len=FLAGS.max_prompt_len,
                     max_output_len=FLAGS.max_output_len, seed=0, vocab_size=vocab)
  return workloads.fit_context(wl, max_model_len)


def main(argv):
  del argv
  if not FLAGS.traces:
    raise ValueError("--traces is required (KIND:PATH,...)")
  cli.check_creatable("out", FLAGS.out)
  # Checked before this process loads or compiles anything: afterwards the
  # load average counts its own threads (recorded per case, not checked).
  load_at_start = os.getloadavg()[0]
  if load_at_start > FLAGS.max_load:
    raise ValueError(f"machine busy: load average {load_at_start:.2f} > "
                     f"--max_load={FLAGS.max_load} (stop other jobs first)")
  engine_cfg = launch.engine_config()
  sim_cfg = launch.engine_config(executor="simulated")
  cfg, params, _ = launch.load_flags_model(engine_cfg)
  launch.warmup(Engine(cfg, params, engine_cfg), 64)
  cases = []
  result = {"engine": FLAGS.engine, "model": FLAGS.model, "cost_model": None,
            "load_avg_at_start": load_at_start, "cases": cases}
  for trace in FLAGS.traces:
    for scale in (float(x) for x in FLAGS.time_scales):
      wl = _workload(trace, scale, cfg.vocab_size, engine_cfg.max_model_len)
      load_before = os.getloadavg()[0]
      t = time.perf_counter()
      real, real_s = replay(Engine(cfg, params, engine_cfg), wl, realtime=True)
      wall_s = time.perf_counter() - t
      load_after = os.getloadavg()[0]
      sim_engine = Engine(cfg, None, sim_cfg, clock=VirtualClock())
      result["cost_model"] = sim_engine.cost_model.to_json()
      sim, sim_s = replay(sim_engine, wl)
      case = {"trace": trace, "window_s": FLAGS.window_s, "time_scale": scale,
              "offered_req_s": len(wl) / max(wl.duration_s, 1e-9),
              "load_avg_before": load_before, "load_avg_after": load_after,
              "real_wall_s": wall_s, **fidelity(real, sim, real_s, sim_s)}
      cases.append(case)
      os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
      with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1)
      summary = {k: (case[k]["median_rel_err"] if case[k] else None)
                 for k in ("ttft", "tpot", "e2el")}
      print(f"{trace.rsplit('/', 1)[-1]} x{scale}: {len(wl)} requests, measured "
            f"{real_s:.1f} s vs simulated {sim_s:.1f} s; median rel err {summary}; "
            f"load {load_before:.2f} -> {load_after:.2f}")


if __name__ == "__main__":
  cli.run(main)
