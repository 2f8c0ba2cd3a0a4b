"""Replays one trace with automatic prefix caching on and off, on one model.

  python scripts/bench_prefix_cache.py --max_requests=200 --max_prompt_len=768 \
      --max_output_len=4

The trace defaults to the Mooncake conversation trace beside the repository
(its requests share 512-token blocks when their hash ids repeat). Per run:
outcome counts, prefix-cache queries / hits (tokens) and hit rate, prompt
rows computed (prefill and rebuild), TTFT p50/p99 (ms), iterations, duration.
The two runs must give every request the same tokens (checked, reported).
Writes a JSON (both full reports) and a markdown table.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from serving import cli
from serving.cli import launch, workload_flags
from serving.harness import metrics
from serving.engine.engine import Engine
from serving.harness.replay import replay, run_config, run_outcomes

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "runs/bench_prefix_cache.json", "Result JSON path.")
flags.DEFINE_string("table_out", "runs/bench_prefix_cache.md", "Markdown table path.")
workload_flags.define_workload_flags()
launch.define_engine_flags()
FLAGS.set_default("trace", "mooncake:" + str(
    Path(__file__).resolve().parents[2] /
    "shared/data/traces/mooncake/conversation_trace.jsonl"))

COLUMNS = ("prefix caching", "completed", "hit rate", "hit tokens", "queried tokens",
           "prompt rows computed", "TTFT p50 ms", "TTFT p99 ms", "iterations",
           "duration s")


def run(on, cfg, params, workload):
  """Warm-up then replay on a fresh engine. Returns (row, report, tokens)."""
  engine = Engine(cfg, params, launch.engine_config(enable_prefix_caching=on))
  launch.warmup(engine)
  records, duration_s = replay(engine, workload)
  report = metrics.build_report(records, duration_s, run_config(engine, FLAGS.model),
                                num_offered=len(workload))
  c = report["engine_outcomes"] = run_outcomes(engine)
  row = {"prefix_caching": on, "completed": report["completed"],
         "hit_rate": c["prefix_cache_hit_rate"], "hit_tokens": c["prefix_cache_hits"],
         "queried_tokens": c["prefix_cache_queries"],
         "prompt_rows_computed": c["prefill_tokens_computed"],
         "ttft_p50_ms": report["median_ttft_ms"], "ttft_p99_ms": report["p99_ttft_ms"],
         "iterations": c["iterations"], "duration_s": report["duration_s"]}
  return row, report, {r.request_id: r.output_token_ids for r in records}


def markdown(rows):
  fmt = lambda v, d=1: "n/a" if v is None else f"{v:.{d}f}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  for r in rows:
    cells = ["on" if r["prefix_caching"] else "off", r["completed"], fmt(r["hit_rate"], 3),
             r["hit_tokens"], r["queried_tokens"], r["prompt_rows_computed"],
             fmt(r["ttft_p50_ms"], 0), fmt(r["ttft_p99_ms"], 0), r["iterations"],
             fmt(r["duration_s"])]
    lines.append("| " + " | ".join(map(str, cells)) + " |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  if FLAGS.enable_prefix_caching is not None:
    raise ValueError("--enable_prefix_caching does not apply here: both settings run")
  engine_cfg = launch.engine_config()
  cfg, params, _ = launch.load_flags_model(engine_cfg)
  workload = workload_flags.load_workload(cfg.vocab_size, engine_cfg.max_model_len)
  print(f"workload: {len(workload)} requests over {workload.duration_s:.1f} s "
        f"({workload.source}); clipped prompts: {workload.num_clipped}", flush=True)
  out = {"argv": sys.argv[1:], "workload": workload.describe(), "runs": {}}
  rows, tokens, t0 = [], [], time.perf_counter()
  for on in (True, False):
    row, report, toks = run(on, cfg, params, workload)
    rows.append(row)
    tokens.append(toks)
    out["runs"]["on" if on else "off"] = {"summary": row, "report": report}
    print(row, flush=True)
    metrics.write_report(FLAGS.out, out)
  out["same_tokens"] = tokens[0] == tokens[1]
  out["wall_s"] = time.perf_counter() - t0
  metrics.write_report(FLAGS.out, out)
  table = markdown(rows)
  Path(FLAGS.table_out).parent.mkdir(parents=True, exist_ok=True)
  Path(FLAGS.table_out).write_text(table)
  print(table + f"same tokens on and off: {out['same_tokens']}; {out['wall_s']:.0f} s; "
        f"wrote {FLAGS.out} and {FLAGS.table_out}")


if __name__ == "__main__":
  cli.run(main)
