"""Replays a workload over N simulated replicas behind the router.

  python scripts/cluster_sim.py \
      --trace=azure:../shared/data/traces/azure2023/AzureLLMInferenceTrace_conv.csv \
      --window_s=0,300 --time_scale=0.1 --replicas=1,4,16 --route=prefix_aware \
      --model=DIR --cost_model=profile:h100 --out=runs/cluster.json

Each replica is an engine on the simulated executor (the --engine preset and
overrides, the cost model of --cost_model); ``serving.harness.cluster_sim`` runs
them on one virtual timeline behind ``serving.http.router.Router``, the router
``serve.py --replicas`` uses (``--route``: prefix_aware or round_robin).
``--time_scale`` < 1 compresses the trace's gaps (0.1 = ten times its rate).
Every replica runs ``--policy``: a registered name, or your own as
``path/to/file.py:Class`` / ``module:Class`` (docs/writing-a-policy.md).
For each ``--replicas`` entry the JSON holds the global report (vLLM
benchmark keys, over every request) and one per replica (its requests, its
iterations), plus the simulation's wall time; no model weights are loaded.
A bad flag (an empty ``--replicas``, ``--executor=model``, a trace, window,
policy or engine value) is refused in one line before the model's config or
the trace loads.
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
from serving.harness import metrics
from serving.harness import workloads
from serving.harness.cluster_sim import replay_cluster, router_for
from serving.engine.engine import Engine
from serving.harness.replay import run_config, run_outcomes
from serving.http.router import POLICIES
from serving.engine.sim_executor import VirtualClock

FLAGS = flags.FLAGS
flags.DEFINE_list("replicas", ["1", "4"], "Replica counts to replay (one run each).")
flags.DEFINE_enum("route", "prefix_aware", list(POLICIES), "Router policy.")
flags.DEFINE_string("out", "runs/cluster.json", "Result JSON.")
launch.define_workload_flags()
launch.define_engine_flags()


def _check_flags() -> list:
  """Every flag's value, checked before the model's config or the trace
  loads (ValueError naming the flag and the rule); returns the replica
  counts."""
  if not FLAGS.replicas:
    raise ValueError("--replicas must be a non-empty list of integers >= 1 (a run each), "
                     "got ''")
  counts = []
  for text in FLAGS.replicas:
    if not text.isdigit() or int(text) < 1:
      raise ValueError(f"--replicas entries must be integers >= 1, got {text!r}")
    counts.append(int(text))
  if FLAGS.executor == "model":
    raise ValueError("--executor=model: cluster_sim.py runs every replica on the simulated "
                     "executor (leave --executor unset)")
  cli.check_creatable("out", FLAGS.out)
  launch.check_workload_flags()
  return counts


def main(argv):
  del argv
  counts = _check_flags()
  engine_cfg = launch.engine_config(executor="simulated")
  launch.engine_clock(engine_cfg)
  # Read the workload before the model's config (fail fast); draw prompt ids
  # again if the model's vocabulary differs from the default.
  workload = launch.load_workload(workloads.DEFAULT_VOCAB_SIZE, engine_cfg.max_model_len)
  cfg, _, _ = launch.load_flags_model(engine_cfg)
  if cfg.vocab_size != workloads.DEFAULT_VOCAB_SIZE:
    workload = launch.load_workload(cfg.vocab_size, engine_cfg.max_model_len)
  clients = len({spec.client for spec in workload})
  engine_cfg = dataclasses.replace(engine_cfg,
                                   num_clients=max(engine_cfg.num_clients, clients))
  print(f"workload: {len(workload)} requests over {workload.duration_s:.1f} s "
        f"({workload.source})")
  runs = []
  for n in counts:
    engines = [Engine(cfg, None, engine_cfg, clock=VirtualClock()) for _ in range(n)]
    router = router_for(engines, FLAGS.route)
    t = time.perf_counter()
    records, duration_s, placement, _ = replay_cluster(engines, router, workload)
    wall_s = time.perf_counter() - t
    config = {**run_config(engines[0], FLAGS.model), "replicas": n, "route": FLAGS.route,
              "workload": workload.describe()}
    report = metrics.build_report(records, duration_s, config, num_offered=len(workload))
    per_replica = []
    for r, engine in enumerate(engines):
      mine = [rec for rec in records if placement.get(rec.request_id) == r]
      one = metrics.build_report(mine, duration_s, {"replica": r}, num_offered=len(mine))
      one["engine_outcomes"] = run_outcomes(engine)
      per_replica.append(one)
    iterations = sum(e.num_iterations for e in engines)
    runs.append({"replicas": n, "wall_s": wall_s, "iterations": iterations,
                 "iterations_per_s": iterations / max(wall_s, 1e-9),
                 "load_avg": os.getloadavg(), "report": report, "per_replica": per_replica})
    ms = lambda key: "n/a" if report.get(key) is None else f"{report[key]:.0f} ms"
    print(f"replicas {n:3d}: {report['completed']}/{len(workload)} completed in "
          f"{duration_s:.1f} virtual s ({iterations} iterations, {wall_s:.1f} s wall); "
          f"per replica {[r['completed'] for r in per_replica]}; TTFT median "
          f"{ms('median_ttft_ms')}, p99 {ms('p99_ttft_ms')}; TPOT median "
          f"{ms('median_tpot_ms')}")
  os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump({"route": FLAGS.route, "runs": runs}, f, indent=1)
  print(f"report: {FLAGS.out}")


if __name__ == "__main__":
  cli.run(main)
