"""Speed of a simulated replay of a whole trace (virtual time, real scheduler).

  python scripts/bench_sim.py \
      --trace=azure:../shared/data/traces/azure2023/AzureLLMInferenceTrace_conv.csv \
      --policy=sarathi_serve --out=runs/bench_sim.json

Replays every request of the trace, or of ``--window_s=N`` or ``A,B`` (outputs
uncapped; prompt and output fitted into the context by
``serving.harness.workloads.FIT_RULE``, with a note when that cuts) with
the simulated executor, which holds no weights (``--model`` is a preset, or
a GGUF file or HF directory of which only the config is read), and logs,
every ``--log_every``
iterations, the wall time, the virtual time, iterations per second over the
last interval and the number of waiting requests, so the JSON shows how the
step rate scales with the queue. ``--max_wall_s`` stops the replay early
(the JSON then says how far it got). An arrival while the engine holds
``max_queued_requests`` unfinished requests is refused, as in a replay, and
counted (``refused_queue_full``).

With ``--loop`` (default) the engine runs many iterations per program call
(``Engine.simulate``), which needs prefix caching off: ``--enable_prefix_caching``
defaults to False here (the trace loaders' prompts are random ids, so hits
are rare); an engine the loop does not cover runs ``Engine.step`` and the
JSON says why (``path``, ``loop_refusal``). Progress rows then come every
program call past ``--log_every`` iterations.

The first run compiles the loop program; it is kept in the XLA compilation cache under
``--cache_dir``, so later runs of the same engine configuration load it.
The first progress row's ``wall_s`` shows which a run did.
"""

import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from absl import flags

from models.config import PRESETS
from models.loaders import load_config
from scheduler import keys
from scheduler import records as rec
from scheduler import scan
from serving import cli
from serving.cli import launch, workload_flags
from serving.harness import traces
from serving.harness import workloads
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.engine import sim_loop
from serving.engine.requests import QueueFull

FLAGS = flags.FLAGS
flags.DEFINE_string("trace", "azure:../shared/data/traces/azure2023/"
                    "AzureLLMInferenceTrace_conv.csv", "KIND:PATH.")
flags.DEFINE_list("window_s", None, "N: the trace's first N seconds of arrivals; A,B: its "
                  "arrivals in [t0+A, t0+B) seconds, t0 its first (default: the whole trace).")
flags.DEFINE_string("policy", "sarathi_serve", "Policy.")
flags.DEFINE_string("model", "smollm2-135m", "Model preset, GGUF file or HF directory "
                    "(its config only).")
flags.DEFINE_string("engine", "cpu_default", launch.engine_preset_help())
flags.DEFINE_integer("max_model_len", 8192, "Context; prompt + output are fitted into it "
                     "(serving.harness.workloads.FIT_RULE).")
flags.DEFINE_string("cost_model", None, "Cost model: a calibration JSON or profile:NAME "
                    "(default: the engine preset's cost_model, else the shipped calibration).")
flags.DEFINE_integer("log_every", 2000, "Iterations between progress rows (>= 1).")
flags.DEFINE_float("max_wall_s", None, "Stop after this much wall time (s, > 0), checked "
                   "between program calls: with --loop a call runs up to 512 iterations, "
                   "seconds over a long queue, plus the first call's compile. Unset: no "
                   "limit, the whole trace.")
flags.DEFINE_string("out", "runs/bench_sim.json", "Report JSON; missing parent folders are "
                    "created and an existing file is overwritten. A path that cannot be "
                    "written is refused before anything loads.")
flags.DEFINE_bool("loop", True, "Many iterations per program call (Engine.simulate); "
                  "False: one Engine.step per iteration.")
flags.DEFINE_string("cache_dir", ".cache/iterserve", "XLA compilation cache under "
                    "DIR/xla, as the launchers keep it; a run after the first loads the "
                    "loop program instead of compiling it. Empty: none.")
flags.DEFINE_bool("enable_prefix_caching", False, "Automatic prefix caching (the loop "
                  "needs it off).")


def check_flags() -> None:
  """Refuses a bad flag value by name (ValueError) before the trace or a
  model config loads."""
  cli.check_engine_preset("engine", FLAGS.engine)
  if FLAGS.log_every < 1:
    raise ValueError(f"--log_every must be >= 1, got {FLAGS.log_every}")
  if FLAGS.max_wall_s is not None and not (math.isfinite(FLAGS.max_wall_s)
                                           and FLAGS.max_wall_s > 0):
    raise ValueError(f"--max_wall_s must be finite and > 0 (unset: no limit), got "
                     f"{FLAGS.max_wall_s}")
  if not FLAGS.out or os.path.isdir(FLAGS.out):
    raise ValueError(f"--out must be a file path for the report JSON, got {FLAGS.out!r}")
  cli.check_creatable("out", FLAGS.out)
  # The folder is made (and written to) now: one the process cannot use is
  # refused before the run, not after it.
  cli.make_dir("out", os.path.dirname(os.path.abspath(FLAGS.out)))
  if FLAGS.window_s is not None:
    workload_flags.parse_window(FLAGS.window_s)
  traces.trace_loader(FLAGS.trace, check_file=True)
  if FLAGS.model not in PRESETS:          # read by load_config
    launch.check_model_spec("--model", FLAGS.model)


def main(argv):
  del argv
  check_flags()
  cli.use_compile_cache("cache_dir", FLAGS.cache_dir)
  loader, path = traces.trace_loader(FLAGS.trace)
  cfg = PRESETS[FLAGS.model] if FLAGS.model in PRESETS else load_config(FLAGS.model)[0]
  t = time.perf_counter()
  window = None if FLAGS.window_s is None else workload_flags.parse_window(FLAGS.window_s)
  wl = workloads.fit_context(loader(path, window_s=window, vocab_size=cfg.vocab_size),
                             FLAGS.max_model_len)
  load_s = time.perf_counter() - t
  if workloads.fit_note(wl):
    print(workloads.fit_note(wl))
  engine = Engine(cfg, None, EngineConfig.preset(
      FLAGS.engine, max_model_len=FLAGS.max_model_len, policy=FLAGS.policy,
      executor="simulated", cost_model=FLAGS.cost_model,
      enable_prefix_caching=FLAGS.enable_prefix_caching))
  refusal = engine.loop_refusal() if FLAGS.loop else "--noloop"
  if FLAGS.loop and refusal:
    print(f"Engine.step per iteration: {refusal}")
  specs = sorted(wl.requests, key=lambda s: s.arrival_s)
  arrivals_ms = [s.arrival_s * 1000.0 for s in specs]
  rows, i, start = [], 0, time.perf_counter()
  last = (start, 0)
  print(f"{len(specs)} requests over {wl.duration_s:.0f} s (loaded in {load_s:.1f} s)")
  stopped, queue_full = False, 0
  # With --max_wall_s the wall clock is read after every program call.
  per_call = sim_loop.LOOP_ITERATIONS if FLAGS.max_wall_s is not None else FLAGS.log_every

  def admitted():
    """Accepted requests whose arrival has come (not those refused at the
    queue bound, nor those handed over ahead of an arrival still to come)."""
    now_ms = engine.now_ms()
    return sum(r.arrival_ms <= now_ms for r in engine.requests.values())

  def add(s, method):
    engine.realized_output_tokens[s.request_id] = s.max_tokens
    method(s.request_id, s.prompt_token_ids,
           SamplingParams(max_tokens=s.max_tokens, ignore_eos=True),
           arrival_ms=s.arrival_s * 1000.0, client=s.client)

  while i < len(specs) or engine.has_unfinished():
    now_ms = engine.now_ms()
    while i < len(specs) and arrivals_ms[i] <= now_ms:
      try:
        add(specs[i], engine.add_request)
      except QueueFull:      # max_queued_requests unfinished: refused, as in a replay
        queue_full += 1
      i += 1
    n = engine.num_iterations
    if refusal is None:
      while i < len(specs):  # ahead of their arrival while the bound cannot refuse them
        try:
          add(specs[i], engine.add_future_request)
        except QueueFull:
          break
        i += 1
      engine.simulate(arrivals_ms[i] if i < len(specs) else math.inf,
                      max_iterations=min(FLAGS.log_every - n % FLAGS.log_every,
                                         per_call))
    elif not engine.has_unfinished():
      engine.clock.advance(max(arrivals_ms[i] - now_ms, 0.0) / 1000.0)
      continue
    else:
      engine.step()
    if engine.num_iterations // FLAGS.log_every > n // FLAGS.log_every:
      n = engine.num_iterations
      wall = time.perf_counter()
      status = jax.device_get(engine.state.status)
      row = {"iterations": n, "wall_s": round(wall - start, 1),
             "virtual_s": round(engine.now_ms() / 1000.0, 1),
             "admitted": admitted(),
             "finished": sum(r.finished for r in engine.requests.values()),
             "waiting": len(engine.table.pending) + int(np.sum(status == rec.WAITING)),
             "it_per_s": round((n - last[1]) / (wall - last[0]), 1)}
      last = (wall, n)
      rows.append(row)
      print(row, flush=True)
    if FLAGS.max_wall_s is not None and time.perf_counter() - start > FLAGS.max_wall_s:
      stopped = True
      break
  wall_s = time.perf_counter() - start
  out = {"trace": FLAGS.trace, "requests": len(specs), "trace_duration_s": wl.duration_s,
         "workload": wl.describe(),
         "policy": FLAGS.policy, "completed": sum(r.outcome == "completed"
                                                  for r in engine.requests.values()),
         "admitted": admitted(),
         "refused_queue_full": queue_full,
         "path": "loop" if refusal is None else "step", "loop_refusal": refusal,
         "loop_runs": engine.loop_runs.summary(), "key_order_sort": keys.sort_impl(),
         "scan_kernels": scan.scan_impl(),
         "enable_prefix_caching": FLAGS.enable_prefix_caching,
         "stopped_early": stopped, "wall_s": wall_s,
         "virtual_s": engine.now_ms() / 1000.0, "iterations": engine.num_iterations,
         "iterations_per_s": engine.num_iterations / wall_s,
         "workload_load_s": load_s, "load_avg": os.getloadavg(),
         "compile_cache": f"{FLAGS.cache_dir}/xla" if FLAGS.cache_dir else None,
         "cost_model": engine.cost_model.to_json(), "progress": rows}
  with open(FLAGS.out, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {FLAGS.out}")
  print({k: v for k, v in out.items() if k not in ("progress", "cost_model", "workload")})


if __name__ == "__main__":
  cli.run(main)
