"""Ablation table across runs, refused when their coordinates differ (§0x0E).

  python scripts/compare.py runs/a.json runs/b.json [--metric=request_goodput]
  python scripts/compare.py runs/sweep/sweep.json --metric=g_star

Inputs are replay reports (scripts/replay.py) or a sweep (scripts/sweep.py,
ranked by G*). Runs are ranked only when every comparison coordinate
(model, executor + cost model, trace + window + rate scale, SLOs, metric
definitions, engine config apart from the policy) is equal; otherwise the
script prints one line naming every key that differs (e.g. ``coordinate
'engine_config' differs in max_num_seqs (32 vs 8)``) and exits with status
2. Coordinates are what the user set: what a run measured (the report's
``engine_outcomes``: iterations, preemptions, extensions, prompt rows
computed, prefix-cache evictions and pages) differs between policies and is
never one, so two replays that differ only in ``--policy`` compare.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from serving.harness import ablation
from serving import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("metric", "request_goodput", "Metric to rank by: a report key, a "
                    "ledger goodput key, or g_star for a sweep; latencies (*_ms, *_s) and "
                    "rejected/failed counts rank lower first, the rest higher first.")


def rows_of(path: str):
  try:
    with open(path) as f:
      run = json.load(f)
  except FileNotFoundError:
    raise ValueError(f"{path}: no such run JSON") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not a run JSON ({e})") from None
  if "trials" in run:       # a sweep: one row per policy, coordinates per trial
    runs = []
    for p in run["policies"]:
      t = next(t for t in run["trials"] if t["policy"] == p)
      coords_run = {"config": t["config"], "slo": run["slo"],
                    "rate_scale": tuple(run["rate_scales"]),
                    "metric_definitions": run["metric_definitions"]}
      coords_run["config"] = dict(t["config"], workload={
          "trace": run["trace"], "window_s": run["window_s"],
          "trials": run["trials_per_point"]})
      runs.append((f"{os.path.basename(path)}:{p}", p, coords_run,
                   {"g_star": run["g_star"][p]["g_star"],
                    "g_star_interpolated": run["g_star"][p]["g_star_interpolated"]}))
    return runs
  # Goodput keys: the ledger's (one SLO pair for all), else those of the
  # report's per-request goodput (--slo_class: each request its own SLOs).
  led = run.get("ledger", {}).get("goodput") or run.get("goodput", {})
  return [(path, run["config"]["policy_id"], run, {**run, **led})]


def main(argv):
  paths = argv[1:]
  if not paths:
    raise ValueError("compare.py needs at least one run JSON")
  rows = [r for p in paths for r in rows_of(p)]
  missing = [n for n, _, _, m in rows if m.get(FLAGS.metric) is None]
  if missing:
    raise ValueError(f"--metric={FLAGS.metric!r} is not a number in {missing[:4]} "
                     f"(a report key, a ledger goodput key, or g_star for a sweep)")
  ablation.check_comparable([r[2] for r in rows], [r[0] for r in rows])
  columns = [c for c in ("completed", "rejected", "failed") if all(c in m for *_, m in rows)]
  print(ablation.table([{"name": n, "policy": p, FLAGS.metric: m.get(FLAGS.metric),
                         **{c: m[c] for c in columns}} for n, p, _, m in rows],
                       FLAGS.metric, columns))
  print("coordinates (equal for every run):")
  for k, v in ablation.coordinates(rows[0][2]).items():
    print(f"  {k}: {v[:160]}")


if __name__ == "__main__":
  cli.run(main)
