r"""Replays a workload (a real trace or the embedded default) against a model.

  python scripts/replay.py  # the default workload
  python scripts/replay.py \
      --trace=azure:../shared/data/traces/azure2023/AzureLLMInferenceTrace_conv.csv \
      --window_s=0,60 --time_scale=4
  python scripts/replay.py --executor=simulated --trace=azure:...  # whole trace, virtual time
  python scripts/replay.py --executor=simulated --model=tiny --engine=tiny  # a config preset

With a virtual clock (``--executor=simulated`` or ``--clock=virtual``) two
runs of the same command write byte-identical reports.

  python scripts/replay.py --policy=least_slack --slo_ttft_ms=2000 --slo_tpot_ms=200

Prints a table and writes a report JSON (vLLM benchmark key names). With
--slo_ttft_ms / --slo_tpot_ms / --slo_class every request declares SLOs and
the report adds ``goodput``: SLO-valid requests and the offered, admitted
and completion-conditioned attainments. Per request the report lists its
preemptions, recomputed tokens and §0x06 KV extensions;
``--reservation=max|point|quantile|watermark`` chooses how admission reserves
KV for the unknown output length (the report's ``config.reservation`` and
``reservation_estimator``). ``config`` holds what the run was given;
what it measured (iterations, preemptions, extensions, prompt rows
computed, prefix-cache counters, speculative decoding's drafts and
acceptance) is in ``engine_outcomes``. After the table, one line per
rejection reason gives how many requests it rejected (``rejected 3 of 32:
needs 40 KV pages ...``, saying so when every request was); a run that
rejected everything still exits 0: rejection is an outcome. With
--speculative one line gives the drafts and the acceptance rate.

  python scripts/replay.py --engine=cpu_small --num_pages=24 --reservation=point
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags
from tqdm import tqdm

from serving import cli
from serving.cli import launch, workload_flags
from serving.engine import host_cpu
from serving.harness import ledger
from serving.harness import metrics
from serving.harness import report_text
from serving.harness import workloads
from serving.harness.replay import path as replay_path
from serving.harness.replay import replay, run_config, run_outcomes

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "runs/replay.json", "Report JSON path.")
flags.DEFINE_float("ledger_tbt_ms", None, "SLO the ledger scores: per-gap TBT limit (ms).")
flags.DEFINE_float("ledger_horizon_s", None, "Requests unfinished by then are open.")
flags.DEFINE_integer("sample_every", 1, "Ledger: sample KV pages/queue once N iterations "
                     "ran since the last sample.")
workload_flags.define_workload_flags()
launch.define_engine_flags()
# --help lists these beside the workload's flags, --model and --engine; the
# other engine overrides are under --helpfull.
for _name in ("executor", "cost_model", "policy", "num_pages", "reservation"):
  flags.declare_key_flag(_name)


def _check_report_flags() -> None:
  """The report's flags, checked before the model loads (ValueError naming
  the flag and the rule). Nothing is left behind: ``main`` makes --out's
  folder once every check has passed."""
  if not FLAGS.out or os.path.isdir(FLAGS.out):
    raise ValueError(f"--out must be a file path for the report JSON, got {FLAGS.out!r}")
  cli.check_creatable("out", FLAGS.out)      # makes nothing; a folder's spelling refused
  _check_out_dir()
  for name in ("ledger_tbt_ms", "ledger_horizon_s"):
    value = getattr(FLAGS, name)
    if value is not None and not value > 0:
      raise ValueError(f"--{name} must be > 0 (or unset), got {value}")
  if FLAGS.sample_every < 1:
    raise ValueError(f"--sample_every must be >= 1, got {FLAGS.sample_every}")


def _out_dir() -> Path:
  return Path(os.path.abspath(FLAGS.out)).parent


def _check_out_dir() -> None:
  """--out's folder, made and written to (``cli.make_dir``: a path only
  writing refuses, ``/proc`` or a read-only file system, is refused before
  the model loads, not after the replay) and then unmade: the folders made
  are removed again, so a run refused by a later check leaves none.

  Raises:
    ValueError: naming --out (``cli.make_dir``).
  """
  folder = _out_dir()
  made = [p for p in (folder, *folder.parents) if not p.exists()]     # deepest first
  try:
    cli.make_dir("out", str(folder))
  finally:
    for path in made:
      try:
        path.rmdir()
      except OSError:      # not made (refused part-way), or no longer empty
        pass


def main(argv):
  del argv
  _check_report_flags()
  workload_flags.check_workload_flags()     # a trace's --window_s read from it, before any model
  engine_cfg = launch.engine_config()
  launch.engine_clock(engine_cfg)
  # --model's refusal (a config preset on the model executor) is said
  # first, before the workload's fit note.
  launch.check_model_spec("--model", FLAGS.model, simulated=engine_cfg.executor == "simulated")
  # Read and check the workload before loading the model's weights (fail
  # fast); draw prompt ids again if the model's vocabulary differs from the
  # default. The simulated executor reads the config alone: it comes first,
  # and the prompt ids are drawn once.
  model = (launch.load_flags_model(engine_cfg, needs_tokenizer=False)
           if engine_cfg.executor == "simulated" else None)
  vocab = workloads.DEFAULT_VOCAB_SIZE if model is None else model[0].vocab_size
  workload = workload_flags.load_workload(vocab, engine_cfg.max_model_len)
  clients = len({spec.client for spec in workload})
  engine, cfg, _ = launch.build_engine(model, num_clients=max(engine_cfg.num_clients, clients))
  if cfg.vocab_size != vocab:
    workload = workload_flags.load_workload(cfg.vocab_size, engine_cfg.max_model_len)
  cli.make_dir("out", str(_out_dir()))     # every check passed (_check_out_dir)
  print(f"workload: {len(workload)} requests over {workload.duration_s:.1f} s "
        f"({workload.source}); clipped prompts: {workload.num_clipped}")
  sim_path, why = replay_path(engine)
  if engine.cost_model is None:
    compile_s = launch.warmup(engine, len(workload))
  else:          # virtual time: a program compiled when first needed costs no step time
    compile_s = {}
    print("compile: each program when first needed (a virtual clock: no step waits on it)")
  bar = tqdm(total=len(workload), unit="req", desc="replay")
  if engine.cost_model is not None:       # the first iterations wait on compilation
    bar.set_postfix_str("compiling the first programs", refresh=True)
  sampler = ledger.ResourceSampler(engine, FLAGS.sample_every)

  def progress(engine):
    sampler(engine)
    bar.update(engine.table.num_ended - bar.n)
    bar.set_postfix(iterations=engine.num_iterations, refresh=False)

  load_start = os.getloadavg()
  t = time.perf_counter()
  records, duration_s = replay(engine, workload, on_progress=progress,
                               origin_ms=sampler.origin_ms)
  wall_s = time.perf_counter() - t
  bar.close()
  config = run_config(engine, FLAGS.model)
  config["family"] = cfg.family
  config["model_costs"] = launch.model_costs(cfg, engine.config)
  config["workload"] = workload.describe()
  config["replay_path"] = {"path": sim_path, "why": why,
                          "loop_runs": engine.loop_runs.summary()}
  if engine.cost_model is None:     # wall-clock facts stay out of virtual-time reports
    config["compile_seconds_by_bucket"] = {str(k): v for k, v in compile_s.items()}
  report = metrics.build_report(records, duration_s, config, num_offered=len(workload))
  report["engine_outcomes"] = run_outcomes(engine)
  if engine.cost_model is None:     # what the wall-clock figures ran on, and beside what
    report["machine"] = {"host_cpu": host_cpu.host_cpu(), "load_avg_start": load_start,
                         "load_avg_end": os.getloadavg(), "replay_wall_s": wall_s}
  # What the requests were judged by: a comparison coordinate (serving.harness.ablation).
  report["slo"] = {"ttft_ms": FLAGS.slo_ttft_ms, "tpot_ms": FLAGS.slo_tpot_ms,
                   "tbt_ms": FLAGS.ledger_tbt_ms, "classes": FLAGS.slo_class}
  if workload_flags.slo_flags_given():           # each request judged by its own SLOs
    report["goodput"] = workload_flags.flag_goodput(records, duration_s)
  report["ledger"] = ledger.build_ledger(
      records, duration_s=duration_s, ttft_ms=FLAGS.slo_ttft_ms,
      tpot_ms=FLAGS.slo_tpot_ms, tbt_ms=FLAGS.ledger_tbt_ms,
      horizon_s=FLAGS.ledger_horizon_s, engine=engine, sampler=sampler)
  print(f"replay wall time {wall_s:.1f} s, {engine.num_iterations} iterations "
        f"({engine.num_iterations / max(wall_s, 1e-9):.0f} it/s)")
  print(report_text.format_table(report))
  rejections = report_text.format_rejections(report)     # why, in the records' words
  if rejections:
    print(rejections)
  estimator = config["reservation_estimator"]
  estimator = "the policy's own rule" if estimator == "policy" else estimator
  print(f"reservation {config['reservation']} ({estimator}): "
        f"rejected {report['rejected']}, extensions {report['num_extensions']}, "
        f"preemptions {report['num_preemptions']}")
  if engine.config.speculation is not None:
    print(report_text.format_spec_decode(report["engine_outcomes"]["spec_decode"],
                                     engine.config.speculative))
  if "goodput" in report:
    print(report_text.format_goodput(report["goodput"]))
  metrics.write_report(FLAGS.out, report)
  print(f"report: {FLAGS.out}")


if __name__ == "__main__":
  cli.run(main)
