"""Replays a workload (a real trace or the embedded default) against a model.

  python scripts/replay.py                                 # default workload
  python scripts/replay.py --trace=azure_conv:../shared/data/traces/azure2023/AzureLLMInferenceTrace_conv.csv \
      --window_s=0,60 --time_scale=4

Prints a table and writes a report JSON (vLLM benchmark key names).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags
from tqdm import tqdm

from serving import launch, metrics, workloads
from serving.replay import replay, run_config

FLAGS = flags.FLAGS
flags.DEFINE_string("trace", None, "KIND:PATH with KIND in azure, mooncake, vtc; "
                    "unset = the embedded synthetic Azure-conv workload.")
flags.DEFINE_integer("num_requests", 32, "Requests of the synthetic default workload.")
flags.DEFINE_float("rate_scale", 0.1, "Synthetic default: fraction of the Azure "
                   "conv trace's arrival rate (5.53 req/s).")
flags.DEFINE_float("time_scale", 1.0, "Multiply inter-arrival gaps (>1 = slower).")
flags.DEFINE_list("window_s", None, "A,B: keep arrivals in [t0+A, t0+B) seconds.")
flags.DEFINE_integer("max_requests", None, "Keep at most this many requests.")
flags.DEFINE_integer("max_prompt_len", None, "Clip longer prompts (counted); default "
                     "512 for the synthetic workload, 1024 for traces.")
flags.DEFINE_integer("max_output_len", None, "Cap output lengths; default 64 for the "
                     "synthetic workload, 512 for traces.")
flags.DEFINE_integer("seed", 0, "Seed for prompt token ids and arrivals.")
flags.DEFINE_string("out", "runs/replay.json", "Report JSON path.")
launch.define_engine_flags()


def load_workload(vocab_size):
  synthetic = FLAGS.trace is None
  pick = lambda value, default_synthetic, default_trace: value if value is not None else (
      default_synthetic if synthetic else default_trace)
  common = dict(max_prompt_len=pick(FLAGS.max_prompt_len, 512, 1024),
                max_output_len=pick(FLAGS.max_output_len, 64, 512),
                seed=FLAGS.seed, vocab_size=vocab_size)
  if synthetic:
    return workloads.synthetic_azure_conv(FLAGS.num_requests, FLAGS.rate_scale, **common)
  kind, _, path = FLAGS.trace.partition(":")
  loaders = {"azure": workloads.load_azure_trace, "mooncake": workloads.load_mooncake_trace,
             "vtc": workloads.load_vtc_trace}
  if kind not in loaders or not path:
    raise app.UsageError(f"--trace must be KIND:PATH with KIND in {sorted(loaders)}, "
                         f"got {FLAGS.trace!r}")
  window = tuple(float(x) for x in FLAGS.window_s) if FLAGS.window_s else None
  return loaders[kind](path, time_scale=FLAGS.time_scale, window_s=window,
                       max_requests=FLAGS.max_requests, **common)


def main(argv):
  del argv
  engine, cfg, _ = launch.build_engine()
  workload = load_workload(cfg.vocab_size)
  print(f"workload: {len(workload)} requests over {workload.duration_s:.1f} s "
        f"({workload.source}); clipped prompts: {workload.num_clipped}")
  compile_s = launch.warmup(engine)
  bar = tqdm(total=len(workload), unit="req", desc="replay")
  records, duration_s = replay(engine, workload, on_step=bar.update)
  bar.close()
  config = run_config(engine, FLAGS.model)
  config["workload"] = workload.describe()
  config["compile_seconds_by_bucket"] = {str(k): v for k, v in compile_s.items()}
  report = metrics.build_report(records, duration_s, config, num_offered=len(workload))
  print(metrics.format_table(report))
  metrics.write_report(FLAGS.out, report)
  print(f"report: {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
