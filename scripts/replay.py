"""Replays a workload (a real trace or the embedded default) against a model.

  python scripts/replay.py                                 # default workload
  python scripts/replay.py --trace=azure:../shared/data/traces/azure2023/AzureLLMInferenceTrace_conv.csv \
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


def load_workload(vocab_size, max_model_len):
  """The workload of the flags; prompts are clipped to fit the context."""
  synthetic = FLAGS.trace is None
  pick = lambda value, default_synthetic, default_trace: value if value is not None else (
      default_synthetic if synthetic else default_trace)
  common = dict(max_prompt_len=min(pick(FLAGS.max_prompt_len, 512, 1024), max_model_len - 1),
                max_output_len=pick(FLAGS.max_output_len, 64, 512),
                seed=FLAGS.seed, vocab_size=vocab_size)
  if synthetic:
    return workloads.synthetic_azure_conv(FLAGS.num_requests, FLAGS.rate_scale, **common)
  kind, _, path = FLAGS.trace.partition(":")
  loaders = {"azure": workloads.load_azure_trace, "mooncake": workloads.load_mooncake_trace,
             "vtc": workloads.load_vtc_trace}
  if kind not in loaders or not path:
    raise ValueError(f"--trace must be KIND:PATH with KIND in {sorted(loaders)}, "
                     f"got {FLAGS.trace!r}")
  window = None
  if FLAGS.window_s:
    try:
      a, b = (float(x) for x in FLAGS.window_s)
    except ValueError:
      raise ValueError(f"--window_s must be two numbers A,B (seconds), got "
                       f"{','.join(FLAGS.window_s)!r}") from None
    window = (a, b)
  return loaders[kind](path, time_scale=FLAGS.time_scale, window_s=window,
                       max_requests=FLAGS.max_requests, **common)


def main(argv):
  del argv
  engine_cfg = launch.engine_config()
  # Read and check the workload before loading the model (fail fast); draw
  # prompt ids again if the model's vocabulary differs from the default.
  workload = load_workload(workloads.DEFAULT_VOCAB_SIZE, engine_cfg.max_model_len)
  clients = len({spec.client for spec in workload})
  engine, cfg, _ = launch.build_engine(num_clients=max(engine_cfg.num_clients, clients))
  if cfg.vocab_size != workloads.DEFAULT_VOCAB_SIZE:
    workload = load_workload(cfg.vocab_size, engine_cfg.max_model_len)
  print(f"workload: {len(workload)} requests over {workload.duration_s:.1f} s "
        f"({workload.source}); clipped prompts: {workload.num_clipped}")
  compile_s = launch.warmup(engine)
  bar = tqdm(total=len(workload), unit="req", desc="replay")

  def progress(outputs):
    bar.update(sum(1 for o in outputs if o.finished))
    bar.set_postfix(iterations=engine.num_iterations, refresh=False)

  records, duration_s = replay(engine, workload, on_step=progress)
  bar.close()
  config = run_config(engine, FLAGS.model)
  config["workload"] = workload.describe()
  config["compile_seconds_by_bucket"] = {str(k): v for k, v in compile_s.items()}
  report = metrics.build_report(records, duration_s, config, num_offered=len(workload))
  print(metrics.format_table(report))
  metrics.write_report(FLAGS.out, report)
  print(f"report: {FLAGS.out}")


if __name__ == "__main__":
  app.run(launch.exit_on_bad_input(main))
