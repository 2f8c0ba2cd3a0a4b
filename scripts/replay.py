"""Replays a workload (a real trace or the embedded default) against a model.

  python scripts/replay.py                                 # default workload
  python scripts/replay.py --trace=azure:../shared/data/traces/azure2023/AzureLLMInferenceTrace_conv.csv \
      --window_s=0,60 --time_scale=4

  python scripts/replay.py --policy=least_slack --slo_ttft_ms=2000 --slo_tpot_ms=200

Prints a table and writes a report JSON (vLLM benchmark key names). With
--slo_ttft_ms / --slo_tpot_ms / --slo_class every request declares SLOs and
the report adds ``goodput``: SLO-valid requests and the offered, admitted
and completion-conditioned attainments. Per request the report lists its
preemptions and recomputed tokens.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags
from tqdm import tqdm

from serving import launch, metrics, workloads
from serving.replay import replay, run_config

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "runs/replay.json", "Report JSON path.")
launch.define_workload_flags()
launch.define_engine_flags()


def main(argv):
  del argv
  engine_cfg = launch.engine_config()
  # Read and check the workload before loading the model (fail fast); draw
  # prompt ids again if the model's vocabulary differs from the default.
  workload = launch.load_workload(workloads.DEFAULT_VOCAB_SIZE, engine_cfg.max_model_len)
  clients = len({spec.client for spec in workload})
  engine, cfg, _ = launch.build_engine(num_clients=max(engine_cfg.num_clients, clients))
  if cfg.vocab_size != workloads.DEFAULT_VOCAB_SIZE:
    workload = launch.load_workload(cfg.vocab_size, engine_cfg.max_model_len)
  print(f"workload: {len(workload)} requests over {workload.duration_s:.1f} s "
        f"({workload.source}); clipped prompts: {workload.num_clipped}")
  compile_s = launch.warmup(engine, len(workload))
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
  if launch.slo_flags_given():           # each request judged by its own SLOs
    report["goodput"] = metrics.goodput(records, duration_s=duration_s, per_request=True)
  print(metrics.format_table(report))
  if "goodput" in report:
    g = report["goodput"]
    print(f"goodput: {g['valid']}/{g['offered']} SLO-valid, {g['request_goodput']:.2f} "
          f"req/s; attainment offered {g['offered_attainment']}, admitted "
          f"{g['admitted_attainment']}, completion-conditioned "
          f"{g['completion_conditioned_attainment']}")
  metrics.write_report(FLAGS.out, report)
  print(f"report: {FLAGS.out}")


if __name__ == "__main__":
  app.run(launch.exit_on_bad_input(main))
