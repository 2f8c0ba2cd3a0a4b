"""Goodput per GPU of prefill/decode splits against colocated replicas, in
the simulator (DistServe's question, OSDI'24).

  python scripts/pd_goodput.py \\
      --trace=azure:../shared/data/traces/azure2023/AzureLLMInferenceTrace_conv.csv \\
      --window_s=0,60 --model=runs/models/llama-2-13b \\
      --engine=docs/scale-out/a100_llama13b_vllm.json \\
      --splits=2,3,1P1D,1P2D,2P1D --rate_scales=0.5,1,2 \\
      --slo_ttft_ms=400 --slo_tpot_ms=100 --out=runs/pd/conv.json
  python scripts/pd_goodput.py --table=runs/pd/conv.json     # the table of a saved run

For every split (``N``: N mixed replicas behind the ``--mixed_router``;
``PpDd``: P prefill and D decode engines behind the P/D ``--router``, each
handoff over ``--link``) and every ``--rate_scales`` entry r (the trace's
arrival gaps divided by r, ascending; a split stops at its first failing
rate), one ``serving.harness.cluster_sim`` run on the simulated executor; a request is SLO-valid when it completed within
``--slo_ttft_ms`` and ``--slo_tpot_ms`` (``metrics.goodput``). A split's
goodput is the highest offered rate (req/s) up to which every tested rate
keeps ``--attainment`` of the requests valid (DistServe's 90%), bracketed by
the first rate that fails; per GPU it is divided by the split's engines (one
GPU each). The JSON holds each run's attainment, TTFT and TPOT percentiles
and transfer figures; the table is printed at the end. Every engine runs the
``--engine`` preset (``--decode_engine``, when given, for decode engines).
"""

import dataclasses
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from serving import cli
from serving.cli import launch
from serving.engine import calibrations
from serving.engine import profiles
from serving.engine.config import EngineConfig
from serving.harness import cluster_sim
from serving.harness import metrics
from serving.http import router as router_lib

FLAGS = flags.FLAGS
flags.DEFINE_list("splits", ["2", "1P1D"], "Splits: N (mixed replicas) or PpDd, e.g. 1P2D.")
flags.DEFINE_list("rate_scales", ["1"], "Arrival-rate multipliers of the trace (> 0).")
flags.DEFINE_string("router", "distserve", "P/D router (serving.http.router.PD_ROUTERS).")
flags.DEFINE_string("mixed_router", "round_robin", "Router of the mixed replicas.")
flags.DEFINE_enum("link", "intra", list(profiles.LINKS), "The link a handoff crosses.")
flags.DEFINE_string("decode_engine", None, "Engine preset of the decode engines (default "
                    "--engine).")
flags.DEFINE_float("attainment", 0.9, "Share of requests that must be SLO-valid.")
flags.DEFINE_string("table", None, "Print the table of this saved JSON and stop.")
flags.DEFINE_string("out", "runs/pd_goodput.json", "Result JSON.")
launch.define_workload_flags()
launch.define_engine_flags()

_SPLIT = re.compile(r"^(?:(\d+)|(\d+)P(\d+)D)$")


def parse_split(text: str):
  """``"3"`` -> ``3`` (mixed replicas); ``"1P2D"`` -> ``(1, 2)``.

  Raises:
    ValueError: neither form, or a count below 1.
  """
  m = _SPLIT.match(text)
  counts = [int(g) for g in m.groups() if g is not None] if m else []
  if not counts or min(counts) < 1:
    raise ValueError(f"--splits entries must be N or PpDd with counts >= 1 (e.g. 2, 1P2D), "
                     f"got {text!r}")
  return counts[0] if len(counts) == 1 else tuple(counts)


def _check_flags():
  if FLAGS.table is not None:
    return None, None
  splits = [parse_split(t) for t in FLAGS.splits]
  try:
    rates = [float(r) for r in FLAGS.rate_scales]
  except ValueError:
    raise ValueError(f"--rate_scales must be numbers > 0, got {FLAGS.rate_scales}") from None
  if not rates or min(rates) <= 0:
    raise ValueError(f"--rate_scales must be numbers > 0, got {FLAGS.rate_scales}")
  router_lib.check_router_name(FLAGS.router, pd=True)
  router_lib.check_router_name(FLAGS.mixed_router, pd=False, flag="mixed_router")
  if FLAGS.slo_ttft_ms is None or FLAGS.slo_tpot_ms is None:
    raise ValueError("--slo_ttft_ms and --slo_tpot_ms must both be given (goodput's SLOs)")
  if not 0 < FLAGS.attainment <= 1:
    raise ValueError(f"--attainment must be in (0, 1], got {FLAGS.attainment}")
  if FLAGS["time_scale"].present:
    raise ValueError("--time_scale: give --rate_scales instead (gaps divided by each)")
  if FLAGS.executor == "model":
    raise ValueError("--executor=model: pd_goodput.py runs the simulated executor")
  cli.check_creatable("out", FLAGS.out)
  launch.check_workload_flags()
  return splits, sorted(rates)


def split_name(split) -> str:
  return f"{split[0]}P{split[1]}D" if isinstance(split, tuple) else f"{split} mixed"


def _summary(run: dict, records, workload) -> dict:
  report = run["report"]
  g = metrics.goodput(records, per_request=True, duration_s=report["duration_s"])
  keys = ("completed", "duration_s", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
          "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms")
  out = {k: report.get(k) for k in keys}
  out.update(offered=g["offered"], valid=g["valid"], attainment=g["offered_attainment"],
             offered_rate=len(workload) / workload.duration_s, gpus=run["gpus"],
             iterations=run["iterations"])
  ok_ttft = sum(1 for r in records if r.outcome == "completed"
                and r.ttft_s * 1e3 <= r.slo_ttft_ms + 1e-6)
  ok_tpot = sum(1 for r in records if r.outcome == "completed"
                and (r.tpot_s is None or r.tpot_s * 1e3 <= r.slo_tpot_ms + 1e-6))
  out.update(ttft_attainment=ok_ttft / len(records), tpot_attainment=ok_tpot / len(records))
  if "transfers" in run:
    out["transfers"] = run["transfers"]
  return out


def goodput_of(points: list, attainment: float) -> dict:
  """From ``[(rate req/s, attainment), ...]`` (ascending rates): the highest
  rate up to which every tested one keeps ``attainment``, and the first that
  does not (None: none failed / none passed)."""
  best, fail = None, None
  for rate, att in points:
    if att >= attainment:
      best = rate
    else:
      fail = rate
      break
  return dict(goodput=best, first_failing=fail)


def table(result: dict) -> str:
  """The markdown table of a saved result."""
  rows = ["| split | GPUs | goodput (req/s) | per GPU (req/s) | vs best mixed per GPU | "
          "first failing rate | attainment by rate (TTFT / TPOT share) |",
          "|---|---|---|---|---|---|---|"]
  best_mixed = max((g["per_gpu"] or 0 for name, g in result["goodput"].items()
                    if name.endswith("mixed")), default=0)
  for name, g in result["goodput"].items():
    runs = result["runs"][name]
    cells = "; ".join(f"{r['offered_rate']:.2f}: {r['attainment']:.2f} "
                      f"({r['ttft_attainment']:.2f} / {r['tpot_attainment']:.2f})" for r in runs)
    ratio = (f"{g['per_gpu'] / best_mixed:.2f}x" if g["per_gpu"] and best_mixed else "n/a")
    num = lambda x: "n/a" if x is None else f"{x:.2f}"
    shown = num(g["goodput"]) + (" (no tested rate failed)" if g["first_failing"] is None
                                 and g["goodput"] is not None else "")
    rows.append(f"| {name} | {g['gpus']} | {shown} | {num(g['per_gpu'])} | {ratio} | "
                f"{num(g['first_failing'])} | {cells} |")
  return "\n".join(rows)


def main(argv):
  del argv
  splits, rates = _check_flags()
  if FLAGS.table is not None:
    with open(FLAGS.table) as f:
      print(table(json.load(f)))
    return
  engine_cfg = launch.engine_config(executor="simulated")
  launch.engine_clock(engine_cfg)
  decode_cfg = (EngineConfig.preset(FLAGS.decode_engine, executor="simulated",
                                    cost_model=engine_cfg.cost_model)
                if FLAGS.decode_engine else None)
  link = None
  if any(isinstance(s, tuple) for s in splits):
    try:
      link = profiles.transfer_link(calibrations.load(engine_cfg.cost_model), FLAGS.link)
    except ValueError as e:
      raise ValueError(f"--link={FLAGS.link}: {e}") from None
  cfg, _, _ = launch.load_flags_model(engine_cfg)
  runs, goodput = {}, {}
  for split in splits:
    name = split_name(split)
    runs[name] = []
    for r in rates:
      FLAGS.time_scale = 1.0 / r
      workload = launch.load_workload(cfg.vocab_size, engine_cfg.max_model_len)
      if isinstance(split, tuple):
        run, records = cluster_sim.simulate_pd(cfg, engine_cfg, workload, split[0], split[1],
                                               FLAGS.router, link, FLAGS.link, FLAGS.model,
                                               decode_cfg=decode_cfg)
      else:
        run, records = cluster_sim.simulate_mixed(cfg, engine_cfg, workload, split,
                                                  FLAGS.mixed_router, FLAGS.model)
      one = dict(_summary(run, records, workload), rate_scale=r)
      runs[name].append(one)
      print(f"{name:>8} rate x{r:g} ({one['offered_rate']:.2f} req/s): attainment "
            f"{one['attainment']:.3f} (TTFT {one['ttft_attainment']:.3f}, TPOT "
            f"{one['tpot_attainment']:.3f}); TTFT p50 {one['median_ttft_ms']:.0f} ms, TPOT "
            f"p50 {one['median_tpot_ms']:.1f} ms ({run['wall_s']:.0f} s wall)", flush=True)
      if one["attainment"] < FLAGS.attainment:
        break                                   # the first failing rate brackets goodput
    g = goodput_of([(q["offered_rate"], q["attainment"]) for q in runs[name]],
                   FLAGS.attainment)
    gpus = split[0] + split[1] if isinstance(split, tuple) else split
    goodput[name] = dict(g, gpus=gpus,
                         per_gpu=None if g["goodput"] is None else g["goodput"] / gpus)
  config = dict(model=FLAGS.model, engine=dataclasses.asdict(engine_cfg),
                decode_engine=None if decode_cfg is None else dataclasses.asdict(decode_cfg),
                router=FLAGS.router, mixed_router=FLAGS.mixed_router, link=FLAGS.link,
                link_figures=None if link is None else dataclasses.asdict(link),
                slo_ttft_ms=FLAGS.slo_ttft_ms, slo_tpot_ms=FLAGS.slo_tpot_ms,
                attainment=FLAGS.attainment, rate_scales=rates, trace=FLAGS.trace,
                window_s=FLAGS.window_s, workload=workload.describe())
  result = dict(config=config, goodput=goodput, runs=runs)
  os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(result, f, indent=1)
  print(table(result))
  print(f"report: {FLAGS.out}")


if __name__ == "__main__":
  cli.run(main)
