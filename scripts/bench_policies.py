"""Replays one trace once per scheduling policy on one loaded model.

  python scripts/bench_policies.py --max_requests=100 --max_prompt_len=256 \
      --max_output_len=32 --max_num_seqs=16 --num_pages=160

The trace defaults to the VTC LMSYS trace beside the repository. Per policy:
outcome counts, TTFT/TPOT p50/p99 (ms), the client service gap (VTC weights,
`metrics.client_service_gap`), preemptions, duration and output tokens/s;
with --slo_ttft_ms / --slo_tpot_ms / --slo_class also SLO-valid requests,
offered and admitted attainment and request goodput (`metrics.goodput`).
Writes a JSON (every policy's full report) and a markdown table. A policy
that raises is recorded as failed with its traceback; the sweep goes on.
"""

import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from scheduler.registry import POLICIES
from serving import cli
from serving.cli import launch, workload_flags
from serving.harness import metrics
from serving.harness import workloads
from serving.engine.engine import Engine
from serving.harness.replay import replay, run_config, run_outcomes

FLAGS = flags.FLAGS
flags.DEFINE_list("policies", sorted(POLICIES), "Registered policy names to compare.")
flags.DEFINE_string("out", "runs/bench_policies.json", "Result JSON path.")
flags.DEFINE_string("table_out", "runs/bench_policies.md", "Markdown table path.")
workload_flags.define_workload_flags()
launch.define_engine_flags()
FLAGS.set_default("trace", "vtc:" + str(Path(__file__).resolve().parents[2] /
                                        "shared/data/traces/vtc_lmsys/vtc_real_trace.csv"))

COLUMNS = ("policy", "completed", "rejected", "failed", "TTFT p50 ms", "TTFT p99 ms",
           "TPOT p50 ms", "TPOT p99 ms", "service gap", "gap pair", "preemptions",
           "iterations", "duration s", "output tok/s", "SLO valid", "attain offered",
           "attain admitted", "goodput req/s")


def summarize(name, report, gap):
  """One table row (None prints as n/a) from a build_report result (with
  ``goodput`` when SLOs were declared) and a ServiceGap."""
  good = report.get("goodput") or {}
  return {"policy": name, "slo_valid": good.get("valid"),
          "offered_attainment": good.get("offered_attainment"),
          "admitted_attainment": good.get("admitted_attainment"),
          "request_goodput": good.get("request_goodput"), "completed": report["completed"],
          "rejected": report["rejected"],
          "failed": report["failed"], "ttft_p50_ms": report["median_ttft_ms"],
          "ttft_p99_ms": report["p99_ttft_ms"], "tpot_p50_ms": report["median_tpot_ms"],
          "tpot_p99_ms": report["p99_tpot_ms"], "service_gap": gap.gap,
          "gap_pair": list(gap.pair) if gap.pair else None,
          "gap_window_s": list(gap.window_s) if gap.window_s else None,
          "preemptions": report["num_preemptions"],
          "iterations": report["engine_outcomes"]["iterations"], "duration_s": report["duration_s"],
          "output_tok_per_s": report["output_throughput"]}


def markdown(rows, num_offered, prefix=""):
  """The table; client names in "gap pair" (leader > trailer) lose ``prefix``."""
  fmt = lambda v, d=1: "n/a" if v is None else f"{v:.{d}f}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  for r in rows:
    if "error" in r:
      cells = [r["policy"], "-", "-", f"{num_offered} (raised)"] + ["-"] * (len(COLUMNS) - 4)
    else:
      pair = " > ".join(p[len(prefix):] for p in r["gap_pair"] or [])
      cells = [r["policy"], r["completed"], r["rejected"], r["failed"],
               fmt(r["ttft_p50_ms"], 0), fmt(r["ttft_p99_ms"], 0), fmt(r["tpot_p50_ms"], 0),
               fmt(r["tpot_p99_ms"], 0), fmt(r["service_gap"], 0), pair or "-",
               r["preemptions"], r["iterations"], fmt(r["duration_s"]),
               fmt(r["output_tok_per_s"]), fmt(r["slo_valid"]),
               fmt(r["offered_attainment"], 2), fmt(r["admitted_attainment"], 2),
               fmt(r["request_goodput"], 2)]
    lines.append("| " + " | ".join(map(str, cells)) + " |")
  return "\n".join(lines) + "\n"


def run_policy(name, cfg, params, workload, num_clients):
  """Warm-up then replay on a fresh engine. Returns (table row, full report)."""
  engine = Engine(cfg, params, launch.engine_config(policy=name, num_clients=num_clients))
  compile_s = launch.warmup(engine, len(workload))
  records, duration_s = replay(engine, workload)
  config = run_config(engine, FLAGS.model)
  config["compile_seconds_by_bucket"] = {str(k): v for k, v in compile_s.items()}
  report = metrics.build_report(records, duration_s, config, num_offered=len(workload))
  report["engine_outcomes"] = run_outcomes(engine)
  if workload_flags.slo_flags_given():
    report["goodput"] = workload_flags.flag_goodput(records, duration_s)
  gap = metrics.client_service_gap(records)
  return summarize(name, report, gap), report


def main(argv):
  del argv
  if FLAGS.policy is not None:
    raise ValueError(f"--policy={FLAGS.policy} does not apply here; use --policies")
  unknown = [p for p in FLAGS.policies if p not in POLICIES]
  if unknown or not FLAGS.policies:
    raise ValueError(f"--policies must name policies in {sorted(POLICIES)}, got {unknown}")
  engine_cfg = launch.engine_config()
  workload = workload_flags.load_workload(workloads.DEFAULT_VOCAB_SIZE, engine_cfg.max_model_len)
  num_clients = max(engine_cfg.num_clients, len({s.client for s in workload}))
  cfg, params, _ = launch.load_flags_model(engine_cfg)
  if cfg.vocab_size != workloads.DEFAULT_VOCAB_SIZE:
    workload = workload_flags.load_workload(cfg.vocab_size, engine_cfg.max_model_len)
  print(f"workload: {len(workload)} requests over {workload.duration_s:.1f} s "
        f"({workload.source}); clipped prompts: {workload.num_clipped}")
  out = {"argv": sys.argv[1:], "workload": workload.describe(), "policies": {}}
  rows, sweep_t = [], time.perf_counter()
  for name in FLAGS.policies:
    t = time.perf_counter()
    try:
      row, report = run_policy(name, cfg, params, workload, num_clients)
    except Exception:  # a policy bug must not end the sweep; its traceback is the result
      row, report = {"policy": name, "error": traceback.format_exc()}, None
      print(row["error"], file=sys.stderr)
    row["wall_s"] = time.perf_counter() - t
    rows.append(row)
    out["policies"][name] = {"summary": row, "report": report}
    print(f"{name}: {({k: v for k, v in row.items() if k != 'error'})}", flush=True)
    metrics.write_report(FLAGS.out, out)     # after every policy: a partial sweep survives
  out["sweep_wall_s"] = time.perf_counter() - sweep_t
  metrics.write_report(FLAGS.out, out)
  prefix = os.path.commonprefix(sorted({s.client for s in workload}))
  table = markdown(rows, len(workload), prefix)
  Path(FLAGS.table_out).parent.mkdir(parents=True, exist_ok=True)
  Path(FLAGS.table_out).write_text(table)
  print(table + f"sweep: {out['sweep_wall_s']:.0f} s; wrote {FLAGS.out} and {FLAGS.table_out}")


if __name__ == "__main__":
  cli.run(main)
