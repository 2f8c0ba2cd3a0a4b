"""Replays a workload over N simulated replicas behind the router, or over
prefill and decode pools.

  python scripts/cluster_sim.py \
      --trace=azure:../shared/data/traces/azure2023/AzureLLMInferenceTrace_conv.csv \
      --window_s=0,300 --time_scale=0.1 --replicas=1,4,16 --router=prefix_aware \
      --model=DIR --cost_model=profile:h100 --out=runs/cluster.json
  python scripts/cluster_sim.py ... --prefill_replicas=1 --decode_replicas=2 \
      --router=distserve --link=intra --cost_model=profile:a100 --out=runs/pd.json

Each replica is an engine on the simulated executor (the --engine preset and
overrides, the cost model of --cost_model); ``serving.harness.cluster_sim`` runs
them on one virtual timeline behind ``serving.http.router.Router``, the router
``serve.py --replicas`` uses (``--router``: prefix_aware or round_robin).
Mixed replicas the simulated loop covers (``Engine.loop_refusal``: e.g.
``--noenable_prefix_caching``) run many iterations per program call between
the router's events (``--noloop``: one step at a time; the same outcomes);
each run's ``path`` in the JSON says which path ran and why. With ``--prefill_replicas=P
--decode_replicas=D`` (both, each >= 1) it runs P engines of role "prefill"
and D of role "decode" behind the P/D router ``--router`` (a
``serving.http.router.PD_ROUTERS`` name: round_robin, prefix_aware,
distserve), each handoff a transfer over the cost model's ``--link``
(intra-node or inter-node: ``serving.engine.profiles.transfer_link``); P/D
pools step one event at a time (their ``path`` says why).
``--time_scale`` < 1 compresses the trace's gaps (0.1 = ten times its rate).
Every engine runs ``--policy``: a registered name, or your own as
``path/to/file.py:Class`` / ``module:Class`` (docs/writing-a-policy.md).
For each run the JSON holds the global report (vLLM benchmark keys, over
every request) and one per engine (its requests, its iterations), plus the
simulation's wall time (P/D: the transfers and the router's choices per
engine); no model weights load and no text is tokenized, so ``--model``
may be a config preset without either (``tiny``). A bad flag (an empty
``--replicas``, one of ``--prefill_replicas`` / ``--decode_replicas``
without the other or below 1, a router not registered for the mode,
``--executor=model``, a trace, window, policy or engine value) is refused
in one line before the model's config or the trace loads.
"""

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from serving import cli
from serving.cli import launch, workload_flags
from serving.harness import report_text
from serving.engine import calibrations
from serving.engine import profiles
from serving.harness import cluster_sim
from serving.http import router as router_lib

FLAGS = flags.FLAGS
flags.DEFINE_list("replicas", ["1", "4"], "Replica counts to replay (one run each).")
flags.DEFINE_string("router", "prefix_aware", "Router: for --replicas one of "
                    f"{sorted(router_lib.POLICIES)}; for --prefill_replicas/--decode_replicas "
                    f"one of {sorted(router_lib.PD_ROUTERS)}.")
flags.DEFINE_alias("route", "router")
flags.DEFINE_bool("loop", True, "Mixed replicas: many iterations per program call between "
                  "the router's events where the loop covers the engine config "
                  "(Engine.loop_refusal); --noloop steps every iteration. The run's "
                  "\"path\" in the JSON says which ran and why.")
flags.DEFINE_integer("prefill_replicas", None, "Prefill engines (with --decode_replicas).")
flags.DEFINE_integer("decode_replicas", None, "Decode engines (with --prefill_replicas).")
flags.DEFINE_enum("link", "intra", list(profiles.LINKS), "The link a KV handoff crosses: "
                  "intra-node or inter-node (the cost model's figures).")
flags.DEFINE_string("out", "runs/cluster.json", "Result JSON.")
workload_flags.define_workload_flags()
launch.define_engine_flags()


def _check_flags() -> list:
  """Every flag's value, checked before the model's config or the trace
  loads (ValueError naming the flag and the rule); returns the replica
  counts (P/D: ``[(P, D)]``)."""
  pd = FLAGS.prefill_replicas is not None or FLAGS.decode_replicas is not None
  if pd:
    for name in ("prefill_replicas", "decode_replicas"):
      other = "decode_replicas" if name == "prefill_replicas" else "prefill_replicas"
      if FLAGS[name].value is None:
        raise ValueError(f"--{name} must be given with --{other} (both or neither)")
      if FLAGS[name].value < 1:
        raise ValueError(f"--{name} must be >= 1, got {FLAGS[name].value}")
    if FLAGS["replicas"].present:
      raise ValueError("--replicas: give either --replicas (mixed replicas) or "
                       "--prefill_replicas/--decode_replicas, not both")
  elif FLAGS["link"].present:
    raise ValueError("--link applies to --prefill_replicas/--decode_replicas only")
  router_lib.check_router_name(FLAGS.router, pd=pd)
  counts = [(FLAGS.prefill_replicas, FLAGS.decode_replicas)] if pd else []
  if not pd and not FLAGS.replicas:
    raise ValueError("--replicas must be a non-empty list of integers >= 1 (a run each), "
                     "got ''")
  for text in FLAGS.replicas if not pd else ():
    if not text.isdigit() or int(text) < 1:
      raise ValueError(f"--replicas entries must be integers >= 1, got {text!r}")
    if int(text) in counts:
      raise ValueError(f"--replicas must not repeat a count (a run each), got {int(text)} "
                       f"more than once in {FLAGS.replicas}")
    counts.append(int(text))
  if FLAGS.executor == "model":
    raise ValueError("--executor=model: cluster_sim.py runs every replica on the simulated "
                     "executor (leave --executor unset)")
  cli.check_creatable("out", FLAGS.out)
  workload_flags.check_workload_flags()
  return counts


def _latencies(report: dict) -> str:
  """A run's latency line: TTFT median and p99, TPOT median (ms; n/a where
  the report has none)."""
  ms = lambda key: "n/a" if report.get(key) is None else f"{report[key]:.0f} ms"
  return (f"TTFT median {ms('median_ttft_ms')}, p99 {ms('p99_ttft_ms')}; TPOT median "
          f"{ms('median_tpot_ms')}")


def _goodput(run: dict, records) -> None:
  """With SLO flags, each request judged by its own SLOs: the run's
  ``goodput`` block (``metrics.goodput``, as replay.py reports it), printed."""
  if workload_flags.slo_flags_given():
    run["goodput"] = workload_flags.flag_goodput(records, run["report"]["duration_s"])
    print("  " + report_text.format_goodput(run["goodput"]))


def main(argv):
  del argv
  counts = _check_flags()
  engine_cfg = launch.engine_config(executor="simulated")
  launch.engine_clock(engine_cfg)
  link = None
  if isinstance(counts[0], tuple):             # P/D: the link's figures, before any load
    try:
      link = profiles.transfer_link(calibrations.load(engine_cfg.cost_model), FLAGS.link)
    except ValueError as e:
      raise ValueError(f"--link={FLAGS.link}: {e}") from None
  # The simulated executor reads the model's config alone (no weights; no
  # text is tokenized here, so a config preset such as tiny will do), so it
  # comes first and the workload's prompt ids are drawn once, in its
  # vocabulary.
  cfg, _, _ = launch.load_flags_model(engine_cfg, needs_tokenizer=False)
  workload = workload_flags.load_workload(cfg.vocab_size, engine_cfg.max_model_len)
  clients = len({spec.client for spec in workload})
  engine_cfg = dataclasses.replace(engine_cfg,
                                   num_clients=max(engine_cfg.num_clients, clients))
  print(f"workload: {len(workload)} requests over {workload.duration_s:.1f} s "
        f"({workload.source}); clipped prompts: {workload.num_clipped}")
  runs = []
  for n in counts:
    if link is not None:
      run, records = cluster_sim.simulate_pd(cfg, engine_cfg, workload, n[0], n[1],
                                             FLAGS.router, link, FLAGS.link, FLAGS.model)
      runs.append(run)
      report, tr = run["report"], run["transfers"]
      print(f"{n[0]}P{n[1]}D ({FLAGS.router}): {report['completed']}/{len(workload)} completed "
            f"in {report['duration_s']:.1f} virtual s ({run['wall_s']:.1f} s wall); "
            f"{tr['count']} transfers, mean {(tr['mean_ms'] or 0):.3f} ms; "
            f"{_latencies(report)}")
      _goodput(run, records)
      continue
    run, records = cluster_sim.simulate_mixed(cfg, engine_cfg, workload, n, FLAGS.router,
                                              FLAGS.model, loop=FLAGS.loop)
    runs.append(run)
    report, per_replica, path = run["report"], run["per_replica"], run["path"]
    print(f"replicas {n:3d}: {report['completed']}/{len(workload)} completed in "
          f"{report['duration_s']:.1f} virtual s ({run['iterations']} iterations, "
          f"{run['wall_s']:.1f} s wall, {path['path']} path"
          f"{': ' + path['why'] if path['why'] else ''}); per replica "
          f"{[r['completed'] for r in per_replica]}; {_latencies(report)}")
    _goodput(run, records)
  os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump({"route": FLAGS.router, "runs": runs}, f, indent=1)
  print(f"report: {FLAGS.out}")


if __name__ == "__main__":
  cli.run(main)
