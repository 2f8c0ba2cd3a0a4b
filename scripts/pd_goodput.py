"""Goodput per GPU of prefill/decode splits against colocated replicas, in
the simulator (DistServe's question, OSDI'24).

  python scripts/pd_goodput.py \\
      --trace=azure:../shared/data/traces/azure2023/AzureLLMInferenceTrace_conv.csv \\
      --window_s=0,60 --model=runs/models/llama-2-13b \\
      --engine=docs/scale-out/a100_llama13b_vllm.json \\
      --cost_model=profile:a100 --splits=2,3,1P1D,1P2D,2P1D --rate_scales=0.5,1,2 \\
      --slos=1000:100,1000:60 --out=runs/pd/conv.json
  python scripts/pd_goodput.py --table=runs/pd/conv.json,runs/pd/other.json   # saved runs

For every split (``N``: N mixed replicas behind the ``--mixed_router``;
``PpDd``: P prefill and D decode engines behind the P/D ``--router``, each
handoff over ``--link``) and every ``--rate_scales`` entry r (the trace's
arrival gaps divided by r, or the synthetic workload without ``--trace``
drawn at ``--rate_scale`` x r; ascending), one ``serving.harness.cluster_sim``
run on the simulated executor. A request is SLO-valid under a ``--slos``
pair when it completed within its TTFT and TPOT limits (``metrics.goodput``;
every pair is judged on the same runs). A split's goodput under a pair is
the highest offered rate (req/s) up to which every tested rate keeps
``--attainment`` of the requests valid (DistServe's 90%), bracketed by the
first rate that fails; a split stops once every pair has failed. Per GPU it
is divided by the split's engines (one GPU each). The JSON holds each run's
attainments, TTFT and TPOT percentiles, transfer figures and the path the
simulation took (``path``: mixed replicas the loop covers run many
iterations per program call, ``cluster_sim.replay_cluster``); the tables are
printed at the end. Every engine runs the ``--engine`` preset
(``--decode_engine``, when given, for decode engines). No weights load and
no text is tokenized: ``--model`` may be a config preset without either
(``tiny``).

A handoff's time is the cost model's ``--link`` figures, which only an
accelerator profile states (``--cost_model=profile:NAME``: a100, h100, h200,
tpu_v5e, tpu_v6e); a CPU calibration (the default, as on ``--model=tiny
--engine=tiny``) states none, so a ``PpDd`` split with one is refused before
anything runs: give a profile (e.g. ``--cost_model=profile:h100``) or run
mixed splits only. Entries of ``--splits`` and ``--rate_scales`` must not
repeat. ``--table`` prints the tables of saved result JSONs (this script's
``--out``) under the SLO pairs every one of them judged.
"""

import dataclasses
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from serving import cli
from serving.cli import launch, workload_flags
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
flags.DEFINE_list("slos", ["1000:100"], "SLO pairs TTFT_MS:TPOT_MS, each judged on the "
                  "same runs (a split stops once every pair has failed).")
flags.DEFINE_float("attainment", 0.9, "Share of requests that must be SLO-valid.")
flags.DEFINE_string("label", None, "Name of this run's engines in the table (default: the "
                    "--engine file's stem).")
flags.DEFINE_list("table", None, "Print the table of these saved JSONs and stop.")
flags.DEFINE_string("out", "runs/pd_goodput.json", "Result JSON.")
workload_flags.define_workload_flags()
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


def parse_slo(text: str):
  """``"1000:100"`` -> ``(1000.0, 100.0)`` (TTFT ms, TPOT ms).

  Raises:
    ValueError: not two numbers > 0.
  """
  try:
    ttft, tpot = (float(x) for x in text.split(":"))
  except ValueError:
    ttft = tpot = -1.0
  if not (ttft > 0 and tpot > 0):
    raise ValueError(f"--slos entries must be TTFT_MS:TPOT_MS, both > 0, got {text!r}")
  return ttft, tpot


def _check_flags():
  """The flags of a run, checked before any model loads or run starts;
  returns the splits, the rate scales (ascending), the SLO pairs, the
  engine config and the P/D splits' link (None without one). Raises
  ValueError naming the flag and the rule."""
  if FLAGS.table is not None:
    return None, None, None, None, None
  if not FLAGS.splits:
    raise ValueError("--splits must name at least one split (N mixed replicas or PpDd, e.g. "
                     "2, 1P2D)")
  splits = [parse_split(t) for t in FLAGS.splits]
  _check_unique("splits", [split_text(s) for s in splits], "each is one row of the tables")
  try:
    rates = [float(r) for r in FLAGS.rate_scales]
  except ValueError:
    raise ValueError(f"--rate_scales must be numbers > 0, got {FLAGS.rate_scales}") from None
  if not rates or not all(0 < r < math.inf for r in rates):
    raise ValueError(f"--rate_scales must be finite numbers > 0, got {FLAGS.rate_scales}")
  _check_unique("rate_scales", rates, "each is a run of every split")
  if not FLAGS.slos:
    raise ValueError("--slos must name at least one TTFT_MS:TPOT_MS pair")
  slos = [parse_slo(t) for t in FLAGS.slos]
  router_lib.check_router_name(FLAGS.router, pd=True)
  router_lib.check_router_name(FLAGS.mixed_router, pd=False, flag="mixed_router")
  if workload_flags.slo_flags_given():
    raise ValueError("--slo_ttft_ms / --slo_tpot_ms / --slo_class: give --slos instead")
  if not 0 < FLAGS.attainment <= 1:
    raise ValueError(f"--attainment must be in (0, 1], got {FLAGS.attainment}")
  if FLAGS["time_scale"].present:
    raise ValueError("--time_scale: give --rate_scales instead (gaps divided by each)")
  if FLAGS.executor == "model":
    raise ValueError("--executor=model: pd_goodput.py runs the simulated executor")
  if FLAGS.decode_engine:
    cli.check_engine_preset("decode_engine", FLAGS.decode_engine)
  cli.check_creatable("out", FLAGS.out)
  workload_flags.check_workload_flags()
  slowest = min(rates)      # the longest replay: its span bounded as replay.py's
  workload_flags.check_scaled_span(_scale_at(slowest, FLAGS.rate_scale),
                                   f"--rate_scales={slowest:g}")
  engine_cfg = launch.engine_config(executor="simulated")
  launch.engine_clock(engine_cfg)
  return splits, sorted(rates), slos, engine_cfg, _pd_link(engine_cfg, splits)


def _check_unique(name: str, values: list, each: str) -> None:
  """Refuses a value that ``--name`` (its entries parsed to ``values``)
  gives twice, as sweep.py's --rate_scales."""
  twice = [v for i, v in enumerate(values) if v in values[:i]]
  if twice:
    raise ValueError(f"--{name} must not repeat a value ({each}), got {twice[0]!r} more than "
                     f"once in {getattr(FLAGS, name)}")


def _pd_link(engine_cfg: EngineConfig, splits: list):
  """The figures of the ``--link`` the P/D splits' handoffs cross
  (``profiles.transfer_link`` of the engine's cost model), None without a
  P/D split.

  Raises:
    ValueError: naming --link: the cost model states no such link (a CPU
      calibration, the default), with the profiles that do.
  """
  pd = [split_text(s) for s in splits if isinstance(s, tuple)]
  if not pd:
    return None
  try:
    return profiles.transfer_link(calibrations.load(engine_cfg.cost_model), FLAGS.link)
  except ValueError as e:
    stating = [name for name in profiles.profile_names()
               if _states_link(f"{calibrations.PROFILE_PREFIX}{name}", FLAGS.link)]
    example = "h100" if "h100" in stating else (stating or ["NAME"])[0]
    raise ValueError(f"--link={FLAGS.link}: {e}; the P/D splits {pd} hand KV over it: give "
                     f"--cost_model=profile:NAME, a profile that states it (one of {stating}; "
                     f"e.g. --cost_model=profile:{example}), or run mixed splits only") from None


def _states_link(cost_model: str, link: str) -> bool:
  try:
    profiles.transfer_link(calibrations.load(cost_model), link)
  except ValueError:
    return False
  return True


def _scale_at(r: float, base_rate_scale: float) -> float:
  """The flags' workload scale at rate scale ``r``: a trace's time scale
  1 / r, or the synthetic workload's rate scale ``base_rate_scale`` (its
  --rate_scale) x r."""
  return base_rate_scale * r if FLAGS.trace is None else 1.0 / r


def split_name(split) -> str:
  return f"{split[0]}P{split[1]}D" if isinstance(split, tuple) else f"{split} mixed"


def split_text(split) -> str:
  """A split as ``--splits`` spells it: ``"3"`` or ``"1P2D"``."""
  return f"{split[0]}P{split[1]}D" if isinstance(split, tuple) else str(split)


def slo_key(slo) -> str:
  return f"{slo[0]:g}:{slo[1]:g}"


def _summary(run: dict, records, workload, slos) -> dict:
  report = run["report"]
  keys = ("completed", "duration_s", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
          "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms")
  out = {k: report.get(k) for k in keys}
  out.update(offered=len(records), offered_rate=len(workload) / workload.duration_s,
             gpus=run["gpus"], iterations=run["iterations"], path=run["path"], slos={})
  done = [r for r in records if r.outcome == "completed"]
  for ttft, tpot in slos:
    g = metrics.goodput(records, ttft_ms=ttft, tpot_ms=tpot, duration_s=report["duration_s"])
    ok_ttft = sum(1 for r in done if r.ttft_s * 1e3 <= ttft + 1e-6)
    ok_tpot = sum(1 for r in done if r.tpot_s is None or r.tpot_s * 1e3 <= tpot + 1e-6)
    out["slos"][slo_key((ttft, tpot))] = dict(
        valid=g["valid"], attainment=g["offered_attainment"],
        ttft_attainment=ok_ttft / len(records), tpot_attainment=ok_tpot / len(records))
  if "transfers" in run:
    out["transfers"] = run["transfers"]
  return out


def table(results: list, slo: str) -> str:
  """The markdown table of saved results (``label`` of each) under one SLO
  pair: per split its goodput, per GPU, and its ratio to the best mixed
  replicas of the same GPU count among them, and to the mixed replicas
  running ``vllm_v1`` without chunking (DistServe's colocated baseline)."""
  rows = ["| GPUs | split | goodput (req/s) | per GPU (req/s) | vs best mixed | "
          "vs mixed vllm_v1 | attainment at each tested rate, req/s: share "
          "(TTFT / TPOT share) |", "|---|---|---|---|---|---|---|"]
  entries = []
  for res in results:
    engine = res["config"]["engine"]
    vllm = (engine["policy"] == "vllm_v1"
            and engine["long_prefill_token_threshold"] >= engine["max_model_len"])
    for name, by_slo in res["goodput"].items():
      mixed = name.endswith("mixed")
      label = f"{name} ({res['config']['label']})" if mixed else name
      entries.append((by_slo[slo], label, mixed, mixed and vllm, res["runs"][name]))
  best, base = {}, {}
  for g, _, mixed, vllm, _ in entries:
    if mixed:
      best[g["gpus"]] = max(best.get(g["gpus"], 0.0), g["per_gpu"] or 0.0)
    if vllm:
      base[g["gpus"]] = max(base.get(g["gpus"], 0.0), g["per_gpu"] or 0.0)
  num = lambda x: "n/a" if x is None else f"{x:.2f}"
  ratio = lambda g, ref: (f"{g['per_gpu'] / ref[g['gpus']]:.2f}x"
                          if g["per_gpu"] and ref.get(g["gpus"]) else "n/a")
  for g, label, _, _, runs in sorted(entries, key=lambda e: (e[0]["gpus"], not e[2], e[1])):
    cells = "; ".join(f"{r['offered_rate']:.2f}: {r['slos'][slo]['attainment']:.2f} "
                      f"({r['slos'][slo]['ttft_attainment']:.2f} / "
                      f"{r['slos'][slo]['tpot_attainment']:.2f})" for r in runs
                      if slo in r["slos"])
    shown = num(g["goodput"])
    if g["goodput"] is None:
      shown = "< lowest tested"
    elif g["first_failing"] is None:
      shown = f">= {shown} (none failed)"
    rows.append(f"| {g['gpus']} | {label} | {shown} | {num(g['per_gpu'])} | "
                f"{ratio(g, best)} | {ratio(g, base)} | {cells} |")
  return "\n".join(rows)


# What ``table`` reads of a saved result: dotted keys.
RESULT_KEYS = ("config.label", "config.engine.policy",
               "config.engine.long_prefill_token_threshold", "config.engine.max_model_len",
               "goodput", "runs")


def read_result(path: str) -> dict:
  """A saved result of --table (this script's --out JSON).

  Raises:
    ValueError: naming --table and the file: not a file, not JSON, or not a
      pd_goodput.py JSON (the first key it lacks, or no split).
  """
  result = cli.read_json("table", path)
  for key in RESULT_KEYS:
    node = result
    for part in key.split("."):
      node = node.get(part) if isinstance(node, dict) else None
    if node is None:
      raise ValueError(f"--table: {path!r} is not a pd_goodput.py JSON (it has no {key!r})")
  goodput = result["goodput"]
  if not (isinstance(goodput, dict) and goodput
          and all(isinstance(g, dict) for g in goodput.values())):
    raise ValueError(f"--table: {path!r} is not a pd_goodput.py JSON (its 'goodput' holds no "
                     f"split)")
  return result


def _slo_pairs(result: dict) -> list:
  """The SLO pairs every split of ``result`` was judged under."""
  by_split = [list(g) for g in result["goodput"].values()]
  return [k for k in by_split[0] if all(k in pairs for pairs in by_split)]


def _tables(results: list, paths=None) -> str:
  """The tables of ``results`` (read from ``paths``, for a refusal) under
  each SLO pair every one of them judged, in the first's order.

  Raises:
    ValueError: naming --table: no pair common to all.
  """
  keys = [k for k in _slo_pairs(results[0]) if all(k in _slo_pairs(r) for r in results)]
  if not keys:
    judged = {path: _slo_pairs(r) for path, r in zip(paths or range(len(results)), results)}
    raise ValueError(f"--table: the files judged no SLO pair in common (a table compares its "
                     f"runs under one): {judged}")
  return "\n\n".join(f"SLO TTFT:TPOT ms {k}\n\n{table(results, k)}" for k in keys)


def main(argv):
  del argv
  splits, rates, slos, engine_cfg, link = _check_flags()
  if FLAGS.table is not None:
    if not FLAGS.table:
      raise ValueError("--table must name at least one saved pd_goodput.py JSON (its --out)")
    results = [read_result(path) for path in FLAGS.table]
    print(_tables(results, FLAGS.table))
    return
  decode_cfg = (EngineConfig.preset(FLAGS.decode_engine, executor="simulated",
                                    cost_model=engine_cfg.cost_model)
                if FLAGS.decode_engine else None)
  cfg, _, _ = launch.load_flags_model(engine_cfg, needs_tokenizer=False)
  runs, goodput = {}, {}
  scaled = "rate_scale" if FLAGS.trace is None else "time_scale"
  base_rate_scale = FLAGS.rate_scale
  for split in splits:
    name = split_name(split)
    runs[name] = []
    for r in rates:
      FLAGS[scaled].value = _scale_at(r, base_rate_scale)
      workload = workload_flags.load_workload(cfg.vocab_size, engine_cfg.max_model_len)
      if isinstance(split, tuple):
        run, records = cluster_sim.simulate_pd(cfg, engine_cfg, workload, split[0], split[1],
                                               FLAGS.router, link, FLAGS.link, FLAGS.model,
                                               decode_cfg=decode_cfg)
      else:
        run, records = cluster_sim.simulate_mixed(cfg, engine_cfg, workload, split,
                                                  FLAGS.mixed_router, FLAGS.model)
      one = dict(_summary(run, records, workload, slos), rate_scale=r)
      runs[name].append(one)
      shares = ", ".join(f"{k}: {v['attainment']:.3f}" for k, v in one["slos"].items())
      print(f"{name:>8} rate x{r:g} ({one['offered_rate']:.2f} req/s): attainment {shares}; "
            f"TTFT p50 {one['median_ttft_ms']:.0f} ms, TPOT p50 "
            f"{one['median_tpot_ms']:.1f} ms ({run['wall_s']:.0f} s wall)", flush=True)
      if all(v["attainment"] < FLAGS.attainment for v in one["slos"].values()):
        break                                   # every pair failed: goodput is bracketed
    gpus = split[0] + split[1] if isinstance(split, tuple) else split
    goodput[name] = {}
    for slo in slos:
      k = slo_key(slo)
      g = cluster_sim.goodput_bracket(
          [(q["offered_rate"], q["slos"][k]["attainment"]) for q in runs[name]],
          FLAGS.attainment)
      goodput[name][k] = dict(g, gpus=gpus,
                              per_gpu=None if g["goodput"] is None else g["goodput"] / gpus)
  label = FLAGS.label or os.path.splitext(os.path.basename(FLAGS.engine))[0]
  config = dict(label=label, model=FLAGS.model, engine=dataclasses.asdict(engine_cfg),
                decode_engine=None if decode_cfg is None else dataclasses.asdict(decode_cfg),
                router=FLAGS.router, mixed_router=FLAGS.mixed_router, link=FLAGS.link,
                link_figures=None if link is None else dataclasses.asdict(link),
                slos=[slo_key(s) for s in slos], attainment=FLAGS.attainment,
                rate_scales=rates, trace=FLAGS.trace, window_s=FLAGS.window_s,
                max_requests=FLAGS.max_requests, workload=workload.describe())
  result = dict(config=config, goodput=goodput, runs=runs)
  os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(result, f, indent=1)
  print(_tables([result]))
  print(f"report: {FLAGS.out}")


if __name__ == "__main__":
  cli.run(main)
