r"""Goodput-capacity sweep: policies x arrival-rate scales x seeded trials.

  python scripts/sweep.py --policies=sarathi_serve,vllm_v1,orca \
      --rate_scales=0.25,0.5,1,2 --trials=2 --window_s=120 --out=runs/sweep_azure

Each trial replays a window of the trace, ``[k*W, (k+1)*W)`` seconds for
trial k with ``--window_s=W`` (``A,B``: trial 0 replays ``[A, B)`` and trial
k the k-th window of its length after it; distinct slices of real traffic,
the flag read as replay.py reads it), with inter-arrival gaps divided
by the rate scale, through the real scheduler code: the simulated executor
on a virtual clock by default (``--executor=model`` runs the model, on the
wall clock unless ``--clock=virtual``). Per (policy, rate) the mean offered
attainment (valid/offered, SLO ``--ttft_ms`` and ``--tpot_ms``) gives G* at
``--alpha`` (DistServe's definition, ``serving.harness.ablation.g_star``). G*
is measured only when the grid brackets it (a rate meets alpha, the next
misses); when every rate meets alpha it is a lower bound, printed ``>= R``
(raise --rate_scales), and when the lowest misses it is ``< R`` (lower them;
unless most of its misses were rejected requests, which a lower rate rejects
too: then the note gives the first rejection reason). Each trial's line
says how many of its requests were rejected; its record keeps why
(``rejections``).
Every trial is kept in ``OUT/sweep.json``; PNG plots are written beside it.
A trial's offered rate is its requests over its window as replayed,
its window's length / rate scale seconds (``offered_rate``), so a window with one
request, or with its arrivals bunched at one end, offers what the trace did.

Prompt and output lengths are fitted into ``--max_model_len`` together
(``serving.harness.workloads.FIT_RULE``: the output keeps min(requested,
max_model_len // 2) tokens, the prompt is cut to the rest), and a note says
so when it cuts. The simulated executor reads only the model's config
(``--model``: a preset, or a GGUF file or HF directory whose weights are not
loaded).

  python scripts/compare.py OUT/sweep.json --metric=g_star    # the ranking

``--jobs=2`` runs two trials at a time, each in a spawned process; trials
are handed out rate by rate, so the processes run different policies at
once. The cost model's lines (which calibration, where it may not hold)
are said once, before the processes start. The programs that take over a
second to compile (the loop program, one per policy and slot-table size,
with prefix caching off; the table grows through the same sizes at every
rate) are kept in the XLA compilation cache under ``--cache_dir``: each
compiles once, in whichever process needs it first, and a later sweep
loads them. Each trial records the seconds its replay spent on programs
(tracing, compiling or loading: ``compile``) beside its ``wall_s``. A
process whose compiled programs pass half of the kernel's memory-map limit
lets them go after a trial
(``sim_loop.release_programs``; the trial records ``released_programs``) and
the next trial loads what it needs from the cache: a whole-hour grid kept
every (policy, slot-table size) program and died at the limit. Each trial's
record is also appended to ``OUT/trials.jsonl`` as the trial ends, so a
sweep stopped or broken midway keeps the trials that finished. OUT/ and
--cache_dir are made once the flags and the trials' engine (its config,
cost model and the model's context) passed their checks: a refused sweep
leaves neither.
"""

import collections
import dataclasses
import functools
import hashlib
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent import futures

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
from absl import flags

from models.config import PRESETS
from scheduler import policies
from serving.harness import ablation
from serving import cli
from serving.cli import launch, workload_flags
from serving.cli import model_spec
from serving.harness import ledger
from serving.harness import metrics
from serving.harness import report_text
from serving.harness import traces
from serving.harness import workloads
from serving.engine import calibrations as cal_lib
from serving.engine import cost_model as cost_lib
from serving.engine.config import EngineConfig
from serving.engine import programs
from serving.engine import sim_loop
from serving.engine.engine import Engine
from serving.harness.replay import path as replay_path
from serving.harness.replay import replay, run_config, run_outcomes
from serving.engine.sim_executor import VirtualClock

FLAGS = flags.FLAGS
TRIALS_FILE = "trials.jsonl"     # one JSON line per finished trial, in finishing order
# The flags a trial's record depends on, kept in it ("settings"): --resume
# reuses a record only when they equal this run's.
TRIAL_SETTINGS = ("trace", "window_s", "ttft_ms", "tpot_ms", "model", "engine", "max_model_len",
                  "max_output_len", "executor", "clock", "cost_model", "sample_every")

flags.DEFINE_string("trace", "azure:../shared/data/traces/azure2023/"
                    "AzureLLMInferenceTrace_conv.csv", "KIND:PATH (azure, vtc, mooncake).")
flags.DEFINE_list("policies", ["sarathi_serve", "vllm_v1"], "Policies to compare: "
                  "registered names, or your own as module:Class or "
                  "path/to/file.py:Class (checked by the conformance kit at load).")
flags.DEFINE_list("rate_scales", ["0.01", "0.03", "0.1"], "Arrival-rate multipliers (any "
                  "order; run and reported ascending; none twice). The defaults bracket "
                  "G* of the default setup (SmolLM2-135M on a shipped 2-core CPU "
                  "calibration) on the AVX-512 kinds; a GPU setup takes rates near 1.")
flags.DEFINE_integer("trials", 2, "Seeded trials (trace windows) per point.")


flags.DEFINE_list("window_s", ["60"], "Trial 0's window of the trace, as replay.py's: N, "
                  "its first N seconds, or A,B, its arrivals in [A, B) seconds after the "
                  "first (before rate scaling); trial k replays the k-th window of that "
                  "length after it: [k * N, (k + 1) * N) for N.")
flags.DEFINE_float("ttft_ms", 20000.0, "SLO: TTFT limit (ms). The default fits the default "
                  "CPU setup, where a prompt of a few thousand tokens takes seconds; a "
                  "GPU setup takes a paper's limit (e.g. 2000).")
flags.DEFINE_float("tpot_ms", 100.0, "SLO: TPOT limit (ms).")
flags.DEFINE_float("alpha", 0.9, "Attainment target of G*.")
flags.DEFINE_string("model", "smollm2-135m", "Model preset, GGUF file or HF directory "
                    "(its config shapes the run; weights are loaded only for "
                    "--executor=model).")
flags.DEFINE_string("engine", "cpu_default", launch.engine_preset_help())
flags.DEFINE_integer("max_model_len", 8192, "Context; prompt + output are fitted into it "
                     "(serving.harness.workloads.FIT_RULE).")
flags.DEFINE_integer("max_output_len", None, "Cap output lengths (default: none).")
flags.DEFINE_enum("executor", "simulated", ["simulated", "model"], "Executor.")
flags.DEFINE_enum("clock", None, ["wall", "virtual"], "Default: virtual if simulated.")
flags.DEFINE_string("cost_model", None, "Cost model: a calibration JSON or profile:NAME "
                    "(default: the engine preset's cost_model, else the shipped calibration).")
flags.DEFINE_integer("sample_every", 64, "Ledger time series: once N iterations ran since "
                     "the last sample (>= 1; 64 keeps the 4x Azure conv hour's trial at "
                     "~820 rows of sweep.json).")
flags.DEFINE_string("out", "runs/sweep", "Output folder (sweep.json + PNGs; trials.jsonl as "
                    "trials end); created with its missing parents, an existing sweep.json "
                    "and trials.jsonl in it are overwritten (--resume keeps trials.jsonl).")
flags.DEFINE_integer("jobs", 1, "Trials run at once, each in a process of its own "
                     "(spawned; every trial is deterministic, so the results do not depend "
                     "on it, but for wall times and program counts). 2 uses both cores of "
                     "a 2-core machine.")
flags.DEFINE_string("cache_dir", ".cache/iterserve", "XLA compilation cache under "
                    "CACHE_DIR/xla, shared by the trial processes and later sweeps: a "
                    "program (one per policy and slot-table size) compiles once, not once "
                    "per process ('' = none).")
flags.DEFINE_bool("resume", False, "Finish a sweep that stopped part-way: keep the trials "
                  "OUT/trials.jsonl holds (each run with this sweep's settings, or refused), "
                  "run only the grid's others, appending them to it.")
flags.DEFINE_list("merge", None, "Instead of running: merge the trials of these "
                  "sweep.json files (same trace, window, SLOs, alpha and trials; "
                  "different rate grids) into --out, recomputing G* and plots.")


def load(rate_scale: float, trial: int, vocab: int, max_model_len: int):
  """Trial ``trial``'s window of --trace at ``rate_scale``, fitted into the
  context (``workloads.fit_context``)."""
  loader, path = traces.trace_loader(FLAGS.trace)
  wl = loader(path, time_scale=1.0 / rate_scale, window_s=trial_window(trial),
              max_output_len=FLAGS.max_output_len, seed=trial, vocab_size=vocab)
  return workloads.fit_context(wl, max_model_len)


def trial_window(k: int) -> tuple:
  """Trial ``k``'s window, (start, end) seconds after the trace's first
  arrival: --window_s's (``workload_flags.parse_window``) moved on by k of its
  length."""
  a, b = workload_flags.parse_window(FLAGS.window_s)
  return a + k * (b - a), a + (k + 1) * (b - a)


def window_setting():
  """--window_s as sweep.json and each trial's settings keep it: the
  length W of a window from 0 (as sweep.py kept it before it took A,B, so
  --resume and --merge still take those files), else [A, B]."""
  a, b = workload_flags.parse_window(FLAGS.window_s)
  return b if a == 0 else [a, b]


def config_only(name: str):
  """The ModelConfig of ``name`` without its weights: a preset's, or
  ``loaders.load_config``'s."""
  from models import loaders
  return PRESETS[name] if name in PRESETS else loaders.load_config(name)[0]


def model_config(name: str):
  """(ModelConfig, params): params None for the simulated executor, which
  reads only the config (``config_only``)."""
  from models import loaders
  if FLAGS.executor == "model":
    cfg, params, _ = loaders.load_model(name)
    return cfg, params
  return config_only(name), None


def clock_of(config) -> str:
  """The trials' clock: --clock, else virtual for the simulated executor."""
  return FLAGS.clock or ("virtual" if config.executor == "simulated" else "wall")


def run_trial(model_cfg, params, config, wl):
  """One replay of ``wl`` on a new engine; its record (without the trial's
  coordinates, which ``trial`` adds)."""
  engine = Engine(model_cfg, params, config,
                  clock=VirtualClock() if clock_of(config) == "virtual" else time.monotonic)
  # The model executor compiles its buckets first, as replay.py does, so no
  # request's latency holds a compilation (a virtual clock charges none).
  warmup = launch.warmup(engine, len(wl)) if engine.cost_model is None else None
  sampler = ledger.ResourceSampler(engine, FLAGS.sample_every)
  sim_path, why = replay_path(engine)
  compiles = cli.compile_counter()
  before = compiles.snapshot()
  t = time.perf_counter()
  records, duration_s = replay(engine, wl, realtime=False, on_progress=sampler,
                               origin_ms=sampler.origin_ms)
  wall_s = time.perf_counter() - t
  compiled = compiles.since(before)
  led = ledger.build_ledger(records, duration_s=duration_s, ttft_ms=FLAGS.ttft_ms,
                            tpot_ms=FLAGS.tpot_ms, tbt_ms=FLAGS.tpot_ms, engine=engine,
                            sampler=sampler)
  report = metrics.build_report(records, duration_s, run_config(engine, FLAGS.model),
                                num_offered=len(wl))
  outcomes = run_outcomes(engine)
  q = np.linspace(0, 100, 51)
  ttft = [r.ttft_s * 1e3 for r in records if r.outcome == "completed"]
  gaps = [(b - a) * 1e3 for r in records for a, b in zip(r.token_times_s, r.token_times_s[1:])]
  clients = sorted({r.client for r in records})
  return {
      "duration_s": duration_s, "wall_s": wall_s, "iterations": engine.num_iterations,
      "replay_path": {"path": sim_path, "why": why,
                      "loop_runs": engine.loop_runs.summary()},
      "iterations_per_s": engine.num_iterations / wall_s,
      "compile": compiled,
      **({} if warmup is None else {"compile_seconds_by_bucket": {
          str(k): v for k, v in warmup.items()}}),
      "attainment": led["goodput"]["offered_attainment"],
      "admitted_attainment": led["goodput"]["admitted_attainment"],
      "request_goodput": led["goodput"]["request_goodput"],
      "token_goodput": led["goodput"]["token_goodput"],
      "outcomes": led["outcomes"]["total"], "tbt": led["tbt"],
      # Why requests were rejected, one line a reason, the most frequent first.
      "rejections": report_text.format_rejections(report).splitlines(),
      "fairness": {k: led["fairness"][k] for k in ("starved", "client_service_gap")},
      "resources": {k: v for k, v in led["resources"].items() if k != "per_request"},
      "report": {k: report[k] for k in report if k.startswith(("median_", "p90_", "p99_"))},
      "ttft_ms_quantiles": np.percentile(ttft, q).tolist() if ttft else [],
      "tbt_ms_quantiles": np.percentile(gaps, q).tolist() if gaps else [],
      "client_service": {c: [(t, w) for t, w in _service_curve(records, c)]
                         for c in clients[:6]},
      "config": report["config"], "engine_outcomes": outcomes, "workload": wl.describe(),
  }


def offered_rate(num_requests: int, window_s: float, rate_scale: float) -> float:
  """Requests per second a trial offers: its requests over its window's
  length as replayed (``window_s`` trace seconds, every gap divided by
  ``rate_scale``). Not over the span from the first arrival to the last,
  which is 0 s for a window with one request (a rate of 1e9 req/s) and
  short for one whose arrivals bunch up. Divided before it is multiplied:
  2 requests in 4 s at 1e308 offer 5e307 req/s, not 2e308 / 4 = inf."""
  return num_requests / window_s * rate_scale


def _service_curve(records, client, w_p=1.0, w_q=2.0, points=40):
  ev = sorted((t, w_q + (w_p * r.prompt_tokens if i == 0 else 0.0)) for r in records
              if r.client == client for i, t in enumerate(r.token_times_s))
  if not ev:
    return []
  t, w = np.array([e[0] for e in ev]), np.cumsum([e[1] for e in ev])
  idx = np.unique(np.linspace(0, len(t) - 1, points).astype(int))
  return list(zip(t[idx].tolist(), w[idx].tolist()))


def plots(result, out):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  pols = result["policies"]
  fig, ax = plt.subplots(1, 2, figsize=(10, 4))
  for p in pols:
    pts, g = result["points"][p], result["g_star"][p]
    ax[0].plot([x["rate_req_s"] for x in pts], [x["attainment"] for x in pts], "o-",
               label=f"{p}: G* {ablation.g_star_text(g, digits=3)} req/s")
    ax[1].plot([x["rate_req_s"] for x in pts], [x["request_goodput"] for x in pts], "o-", label=p)
  ax[0].axhline(result["alpha"], ls="--", c="gray")
  ax[0].set(xlabel="offered rate (req/s)", ylabel="SLO attainment (valid/offered)")
  loose = [p for p in pols if not result["g_star"][p].get("bracketed", True)]
  if loose:         # '>=': every rate met alpha; '<': the lowest missed
    ax[0].set_title(f"G* not bracketed by the rates tried for {', '.join(loose)}",
                    fontsize=9)
  ax[1].set(xlabel="offered rate (req/s)", ylabel="request goodput (req/s)")
  ax[0].legend()
  fig.tight_layout()
  fig.savefig(f"{out}/attainment_goodput.png", dpi=90)
  plt.close(fig)
  mid = result["rate_scales"][len(result["rate_scales"]) // 2]
  trials = {p: next(t for t in result["trials"] if t["policy"] == p and
                    t["rate_scale"] == mid and t["trial"] == 0) for p in pols}
  fig, ax = plt.subplots(1, 2, figsize=(10, 4))
  q = np.linspace(0, 1, 51)
  for p, t in trials.items():
    if t["ttft_ms_quantiles"]:
      ax[0].plot(t["ttft_ms_quantiles"], q, label=p)
    if t["tbt_ms_quantiles"]:
      ax[1].plot(t["tbt_ms_quantiles"], q, label=p)
  ax[0].set(xscale="log", xlabel="TTFT (ms)", ylabel="CDF", title=f"rate x{mid}")
  ax[1].set(xscale="log", xlabel="TBT gap (ms)", ylabel="CDF")
  _legend(ax[0])
  fig.tight_layout()
  fig.savefig(f"{out}/ttft_tbt_cdf.png", dpi=90)
  plt.close(fig)
  fig, ax = plt.subplots(1, 2, figsize=(10, 4))
  for p, t in trials.items():
    series = t["resources"].get("timeseries", {})
    rows, cols = np.array(series.get("rows", [])), series.get("columns", [])
    if not len(rows):
      continue
    col = lambda name: rows[:, cols.index(name)]
    dots = {"marker": "o", "ms": 3} if len(rows) < 30 else {}     # a few rows: seen
    if "kv_pages_live" in cols:
      line, = ax[0].plot(col("t_ms") / 1e3, col("kv_pages_live"), label=f"{p} live", **dots)
      ax[0].plot(col("t_ms") / 1e3, col("kv_pages_cached"), ls="--", c=line.get_color(),
                 label=f"{p} cached only", **dots)
    else:             # a sweep.json written before live and cached pages were apart
      ax[0].plot(col("t_ms") / 1e3, col("kv_pages_in_use"), label=f"{p} live + cached", **dots)
    ax[1].plot(col("t_ms") / 1e3, col("queue_len"), label=p, **dots)
  ax[0].set(xlabel="time (s)", ylabel="KV pages", title=f"rate x{mid}, trial 0")
  ax[1].set(xlabel="time (s)", ylabel="queue length (waiting)")
  if not ax[0].lines:
    ax[0].text(0.5, 0.5, "no rows: the trials ran fewer iterations than --sample_every",
               ha="center", fontsize=8, transform=ax[0].transAxes)
  _legend(ax[0])
  fig.tight_layout()
  fig.savefig(f"{out}/kv_queue.png", dpi=90)
  plt.close(fig)
  fig, axes = plt.subplots(1, len(pols), figsize=(5 * len(pols), 4), squeeze=False)
  for a, (p, t) in zip(axes[0], trials.items()):
    for c, curve in t["client_service"].items():
      if curve:
        a.plot([x[0] for x in curve], [x[1] for x in curve], label=c)
    a.set(xlabel="time (s)", ylabel="weighted service (tokens)", title=p)
    _legend(a, fontsize=7)
  fig.tight_layout()
  fig.savefig(f"{out}/client_service.png", dpi=90)
  plt.close(fig)


def _legend(ax, **kw) -> None:
  """A legend where the axes drew a labelled line (matplotlib warns on none)."""
  if ax.get_legend_handles_labels()[0]:
    ax.legend(**kw)


def _check_out() -> None:
  """--out, checked before anything loads (ValueError naming it)."""
  if not FLAGS.out:
    raise ValueError("--out must name the folder for sweep.json and the PNGs, got ''")
  cli.check_creatable("out", FLAGS.out, directory=True)


def _check_resume() -> None:
  """--resume: OUT/trials.jsonl must exist (ValueError naming the flag),
  checked before anything is created."""
  path = f"{FLAGS.out}/{TRIALS_FILE}"
  if not os.path.isfile(path):
    raise ValueError(f"--resume keeps the trials of {path}, which does not exist (is --out "
                     f"the stopped sweep's folder?)")


def _check_flags():
  """The sweep's flags, checked before any trial runs; returns the rate
  scales. Raises ValueError naming the flag and the rule."""
  try:
    rates = [float(r) for r in FLAGS.rate_scales]
  except ValueError:
    raise ValueError(f"--rate_scales must be numbers, got {FLAGS.rate_scales}") from None
  if not rates or any(not 0 < r < math.inf for r in rates):
    raise ValueError(f"--rate_scales must be a non-empty list of finite numbers > 0, got "
                     f"{FLAGS.rate_scales}")
  for name, values in (("rate_scales", rates), ("policies", FLAGS.policies)):
    twice = sorted({v for v in values if values.count(v) > 1}, key=str)
    if twice:
      raise ValueError(f"--{name} must not repeat a value (a point is one value's "
                       f"trials), got {twice[0]!r} more than once in {getattr(FLAGS, name)}")
  _check_out()
  if FLAGS.resume:         # refused before any folder is made (--out's or --cache_dir's)
    _check_resume()
  if FLAGS.cache_dir:      # made with --out, once every check passed (main)
    cli.check_creatable("cache_dir", FLAGS.cache_dir, directory=True)
  traces.trace_loader(FLAGS.trace, check_file=True)   # refused here, before any model loads
  cli.check_engine_preset("engine", FLAGS.engine)
  if FLAGS.model not in PRESETS or model_spec.is_config_preset(FLAGS.model):
    launch.check_model_spec("--model", FLAGS.model, simulated=FLAGS.executor == "simulated")
  if FLAGS.max_model_len < 2:
    raise ValueError(f"--max_model_len must be >= 2 (a prompt and an output token), "
                     f"got {FLAGS.max_model_len}")
  policies.check_policy_flag("--policies", FLAGS.policies)
  for name in ("trials", "sample_every", "jobs"):
    if getattr(FLAGS, name) < 1:
      raise ValueError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  a, b = workload_flags.parse_window(FLAGS.window_s)
  workload_flags.check_replay_span(f"--window_s={','.join(FLAGS.window_s)} / --rate_scales="
                           f"{min(rates):g}", f"a trial's window of {b - a:g} s",
                           (b - a) / min(rates))
  for name in ("ttft_ms", "tpot_ms"):
    if not (math.isfinite(getattr(FLAGS, name)) and getattr(FLAGS, name) > 0):
      raise ValueError(f"--{name} must be finite and > 0, got {getattr(FLAGS, name)}")
  if not 0 < FLAGS.alpha <= 1:
    raise ValueError(f"--alpha must be in (0, 1], got {FLAGS.alpha}")
  _check_windows(rates)
  _check_engine()
  return sorted(rates)


def _check_engine() -> None:
  """The trials' engine, checked before OUT/ is made (once the first trial
  refused it, leaving an empty OUT/trials.jsonl): its config (the --engine
  preset with --max_model_len, --executor and --cost_model), --cost_model's
  file, the model's context, and each user policy of --policies by the
  conformance kit (once per process: the first trial does not run it
  again).

  Raises:
    ValueError: naming the flag, the field or the policy.
  """
  base = base_config()
  launch.check_cost_model()
  programs.check_engine(config_only(FLAGS.model), base)
  for name in FLAGS.policies:
    if not policies.is_registered(name):
      policies.check_user_policy(name)


def _check_windows(rates) -> None:
  """Refuses, before any trial runs, --window_s x --trials whose trial
  windows (``trial_window``) do not each hold a request: past the trace's
  last arrival, or over a gap in it; and a rate scale of ``rates`` at which
  a window's requests would offer more req/s than a float64 holds."""
  loader, path = traces.trace_loader(FLAGS.trace)
  n = FLAGS.trials
  a, b = workload_flags.parse_window(FLAGS.window_s)
  w = b - a
  try:         # from the first arrival, so the times are seconds after it
    arrivals = [spec.arrival_s for spec in loader(path, window_s=(0.0, trial_window(n - 1)[1]),
                                                    max_output_len=FLAGS.max_output_len)]
  except workloads.WorkloadError as e:
    if "no request in window_s" not in str(e):
      raise
    arrivals = []
  trial_of = (int((t - a) // w) for t in arrivals if t >= a)
  held = collections.Counter(k for k in trial_of if k < n)     # requests per trial
  for k in range(n):
    if k in held:
      continue
    start, stop = trial_window(k)
    where = ("reaches past the trace" if not arrivals or start > max(arrivals)
             else "meets a gap in the trace")
    raise ValueError(f"--window_s={','.join(FLAGS.window_s)} x --trials={n} {where}: trial "
                     f"{k}'s window [{start:g}, {stop:g}) s holds no request; choose another "
                     f"--window_s or --trials")
  # A rate scale so high that a window's arrivals fall on one instant is a
  # burst, and runs; its offered rate must still be a number.
  k, most = held.most_common(1)[0]
  fastest = max(rates)
  if not math.isfinite(offered_rate(most, w, fastest)):
    raise ValueError(f"--rate_scales={fastest:g}: trial {k}'s window of {w:g} s holds {most} "
                     f"request(s), which would offer {most} / {w:g} x {fastest:g} req/s, past "
                     f"float64's range (sweep.json and G* give rates in req/s); lower the "
                     f"highest rate scale")


def main(argv):
  del argv
  if FLAGS["merge"].present:
    if not FLAGS.merge:
      raise ValueError("--merge must name at least one sweep.json, got ''")
    if FLAGS.resume:
      raise ValueError("--resume finishes a run's trials; --merge runs none (use one of them)")
    _check_out()
    return finish(merge(FLAGS.merge))
  rates = _check_flags()
  if FLAGS.cache_dir:
    cli.make_dir("cache_dir", FLAGS.cache_dir)
  cli.make_dir("out", FLAGS.out)
  result = {"trace": FLAGS.trace, "window_s": window_setting(), "trials_per_point": FLAGS.trials,
            "slo": {"ttft_ms": FLAGS.ttft_ms, "tpot_ms": FLAGS.tpot_ms}, "alpha": FLAGS.alpha,
            "policies": FLAGS.policies, "rate_scales": rates,
            "metric_definitions": ablation.METRIC_DEFINITIONS, "jobs": FLAGS.jobs,
            "compile_cache": f"{FLAGS.cache_dir}/xla" if FLAGS.cache_dir else None,
            "load_avg_start": os.getloadavg(), "trials": [], "points": {}, "g_star": {}}
  tasks = [(policy, rate, k) for policy in FLAGS.policies for rate in rates
           for k in range(FLAGS.trials)]
  t = time.perf_counter()
  done = resumed(tasks) if FLAGS.resume else {}
  result["resumed_trials"] = len(done)
  with open(f"{FLAGS.out}/{TRIALS_FILE}", "a" if FLAGS.resume else "w") as log:
    def keep(task, record):    # each trial on disk as it ends
      done[task] = record
      log.write(json.dumps(record) + "\n")
      log.flush()

    todo = [task for task in tasks if task not in done]
    if FLAGS.jobs == 1:
      for task in todo:
        keep(task, trial(*task))
    else:             # spawned, not forked: JAX is not fork-safe once started
      ctx = multiprocessing.get_context("spawn")
      said = say_cost_model()     # once for the sweep, not once per process
      with futures.ProcessPoolExecutor(FLAGS.jobs, mp_context=ctx,
                                       initializer=_start_trial_process,
                                       initargs=(list(sys.argv), said)) as pool:
        # Handed out rate by rate, so the processes run different policies
        # at once: a policy's program for a slot-table size compiles in one
        # of them and the other loads it from the compilation cache.
        spread = sorted(todo, key=lambda task: (rates.index(task[1]), task[2]))
        running = {pool.submit(trial, *task): task for task in spread}
        for future in futures.as_completed(running):
          keep(running[future], future.result())
  result["trials"] = [done[task] for task in tasks]
  result["wall_s"] = time.perf_counter() - t
  result["load_avg_end"] = os.getloadavg()
  finish(result, f"{FLAGS.out}/{TRIALS_FILE}")


def resumed(tasks) -> dict:
  """--resume: the records of OUT/trials.jsonl for this run's tasks, by
  (policy, rate scale, trial). The file is rewritten with its complete
  lines first (a crash can leave a last line cut short; it is dropped and
  its trial runs again).

  Raises:
    ValueError: no such file, a line that is not a trial record, or one
      run with other settings (TRIAL_SETTINGS) than this run.
  """
  _check_resume()
  path = f"{FLAGS.out}/{TRIALS_FILE}"
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().split("\n")
  except UnicodeDecodeError:
    raise ValueError(f"--resume: {path} is not a trials.jsonl sweep.py wrote (not UTF-8 "
                     f"text)") from None
  ours, kept = settings(), []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      if n == len(lines):      # cut short by the stop: no newline after it
        print(f"--resume: {path} line {n} was cut short; its trial runs again")
        continue
      raise ValueError(f"--resume: {path} line {n} is not JSON") from None
    theirs = record.get("settings") if isinstance(record, dict) else None
    if not isinstance(theirs, dict):
      raise ValueError(f"--resume: {path} line {n} is not a trial record of this sweep.py "
                       f"(it has no 'settings')")
    differ = [k for k in ours if theirs.get(k) != ours[k]]
    if differ and differ[0] == "trace_sha256":
      raise ValueError(f"--resume: {path} line {n} was run on another --trace file (the file "
                       f"{FLAGS.trace!r} names changed since: sha256 differs); its trials "
                       f"cannot join this sweep (another --out)")
    if differ:
      k = differ[0]
      raise ValueError(f"--resume: {path} line {n} was run with --{k}={theirs.get(k)}, this "
                       f"run has --{k}={ours[k]}; its trials cannot join this sweep (run with "
                       f"its flags, or another --out)")
    kept.append(record)
  with open(path, "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in kept))
  wanted = set(tasks)
  done = {}
  for r in kept:
    task = (r["policy"], r["rate_scale"], r["trial"])
    if task in wanted:
      done.setdefault(task, r)
  print(f"--resume: {len(done)} of the grid's {len(tasks)} trials kept from {path}; "
        f"running {len(tasks) - len(done)}", flush=True)
  return done


def settings() -> dict:
  """The flags a trial's record depends on (TRIAL_SETTINGS), by name, and
  the trace file's sha256 (``trace_sha256``: a file edited in place is
  another trace)."""
  return dict({k: getattr(FLAGS, k) for k in TRIAL_SETTINGS}, window_s=window_setting(),
              trace_sha256=_trace_sha256())


@functools.lru_cache(maxsize=1)
def _trace_sha256() -> str:
  _, path = traces.trace_loader(FLAGS.trace)
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def say_cost_model() -> list:
  """The cost model's lines (``calibrations.resolve``: which calibration,
  and where its times may not hold), said here before the trial processes
  start and returned for them to keep quiet (``_start_trial_process``):
  each would say them again. Empty on the wall clock, which has no cost
  model."""
  base = base_config()
  if clock_of(base) != "virtual":
    return []
  lines = []
  costs = cost_lib.engine_model_costs(config_only(FLAGS.model), base)
  cal_lib.resolve(cal_lib.load(base.cost_model), costs, say=lines.append)
  for line in lines:
    cal_lib.say_once(line)
  return lines


def _start_trial_process(argv, said) -> None:
  """A trial process's start: the parent's flags, and the lines it said
  (``say_cost_model``) counted as said here."""
  FLAGS(argv)
  cal_lib.count_as_said(said)


def base_config() -> EngineConfig:
  """The trials' EngineConfig but for the policy."""
  return EngineConfig.preset(FLAGS.engine, max_model_len=FLAGS.max_model_len,
                             executor=FLAGS.executor, cost_model=FLAGS.cost_model,
                             num_clients=64)


@functools.lru_cache(maxsize=1)
def _setup():
  """(base EngineConfig, ModelConfig, params), once per process, with the
  compilation cache of --cache_dir turned on in it."""
  cli.use_compile_cache("cache_dir", FLAGS.cache_dir)
  return (base_config(),) + model_config(FLAGS.model)


def trial(policy: str, rate: float, k: int) -> dict:
  """One trial: ``policy`` on trial ``k``'s window at ``rate``; its record."""
  base, model_cfg, params = _setup()
  config = dataclasses.replace(base, policy=policy)
  wl = load(rate, k, model_cfg.vocab_size, config.max_model_len)
  note = workloads.fit_note(wl)
  if note and policy == FLAGS.policies[0]:     # the same cut for every policy
    print(f"trial {k} x{rate:g}: {note}")
  t = run_trial(model_cfg, params, config, wl)
  # A process that keeps every (policy, slot-table size) program of a grid
  # passes the kernel's memory-map limit; the next trial reloads what it
  # needs from --cache_dir.
  t["released_programs"] = sim_loop.maps_crowded()
  if t["released_programs"]:
    sim_loop.release_programs()
  start, stop = trial_window(k)
  t.update(policy=policy, rate_scale=rate, trial=k, settings=settings(), num_requests=len(wl),
           offered_rate_req_s=offered_rate(len(wl), stop - start, rate), window=[start, stop])
  rejected = t["outcomes"]["rejected"]
  print(f"{policy:22s} x{rate:<5g} trial {k}: {len(wl)} req"
        + (f" ({rejected} rejected)" if rejected else "")
        + f", attainment {t['attainment']:.3f}, {t['iterations']} it in {t['wall_s']:.1f} s "
        f"(programs {t['compile']['seconds']:.1f} s)", flush=True)
  return t


def summarize(result):
  """Points (mean over trials) and G* per policy, from ``result["trials"]``."""
  for policy in result["policies"]:
    pts = []
    for rate in result["rate_scales"]:
      ts = [t for t in result["trials"] if t["policy"] == policy and t["rate_scale"] == rate]
      pts.append({"rate_scale": rate,
                  "rate_req_s": float(np.mean([t["offered_rate_req_s"] for t in ts])),
                  "attainment": float(np.mean([t["attainment"] for t in ts])),
                  "request_goodput": float(np.mean([t["request_goodput"] for t in ts]))})
    result["points"][policy] = pts
    result["g_star"][policy] = ablation.g_star([p["rate_req_s"] for p in pts],
                                               [p["attainment"] for p in pts], result["alpha"])


def g_star_note(result, policy: str, g: dict) -> str:
  """``ablation.g_star_note`` of ``policy``'s G* ``g``, but where the lowest
  rate missed alpha mostly by rejected requests (more than half of its
  trials' misses: requests the engine cannot hold, at any rate): that, and
  the first trial's most frequent rejection reason, instead of advising
  lower rates."""
  if not g.get("g_star_below_lowest_rate"):
    return ablation.g_star_note(g)
  lowest = result["rate_scales"][0]
  trials = [t for t in result["trials"] if t["policy"] == policy and t["rate_scale"] == lowest]
  count = lambda part: sum(t.get("outcomes", {}).get(part, 0) for t in trials)
  missed, rejected = count("offered") - count("valid"), count("rejected")
  if not 2 * rejected > missed:
    return ablation.g_star_note(g)
  why = next((f"; x{lowest:g} trial {t['trial']}: {t['rejections'][0]}" for t in trials
              if t.get("rejections")), "")        # a sweep.json of before they were kept
  return (f"the lowest rate tried missed the SLOs, but {rejected} of its {missed} misses were "
          f"rejected requests, which a lower rate rejects too{why}; sweep.py takes num_pages "
          f"from --engine (a preset or a JSON file) and the context from --max_model_len")


def merge(paths):
  """One sweep from several with equal settings and disjoint rate grids.

  Raises:
    ValueError: a setting other than the rate grid differs, or a rate repeats.
  """
  keys = ("trace", "window_s", "trials_per_point", "slo", "alpha", "policies",
          "metric_definitions")
  runs = [_read_sweep(p, keys + ("rate_scales", "trials")) for p in paths]
  for p, r in zip(paths[1:], runs[1:]):
    for k in keys:
      if r[k] != runs[0][k]:
        raise ValueError(f"--merge: {p} differs from {paths[0]} in {k!r}")
  rates = sorted(x for r in runs for x in r["rate_scales"])
  seen = {}
  for p, r in zip(paths, runs):
    for x in r["rate_scales"]:
      if x in seen:
        raise ValueError(f"--merge: rate scale {x:g} is in both {seen[x]} and {p} (each "
                         f"rate's trials must come from one sweep)")
      seen[x] = p
  # Engine config, model, executor and cost model equal across every trial.
  ablation.check_comparable([dict(t, rate_scale=None) for r in runs for t in r["trials"]])
  return dict({k: runs[0][k] for k in keys}, rate_scales=rates, merged_from=list(paths),
              trials=[t for r in runs for t in r["trials"]], points={}, g_star={},
              load_avg_start=runs[0].get("load_avg_start"),
              load_avg_end=runs[-1].get("load_avg_end"))


def _read_sweep(path: str, keys) -> dict:
  """A sweep.json of --merge, or ValueError naming the flag and the file:
  missing, not JSON, or not a sweep (a replay report has no rate grid)."""
  run = cli.read_json("merge", path)
  missing = [k for k in keys if k not in run] if isinstance(run, dict) else list(keys)
  if missing:
    named = ", ".join(map(repr, missing[:3])) + (f" and {len(missing) - 3} more"
                                                 if len(missing) > 3 else "")
    raise ValueError(f"--merge takes sweep.json files written by sweep.py; {path!r} is not "
                     f"one (it has no {named}; a replay report is one run, not a sweep)")
  return run


def finish(result, trials_file=None):
  summarize(result)
  os.makedirs(FLAGS.out, exist_ok=True)
  with open(f"{FLAGS.out}/sweep.json", "w") as f:
    json.dump(result, f, indent=1)
  plots(result, FLAGS.out)
  for p, g in result["g_star"].items():
    print(f"G*({p}) at alpha={result['alpha']}: {ablation.g_star_text(g)} req/s "
          f"({g_star_note(result, p, g)})")
  also = f", {trials_file}" if trials_file else ""
  print(f"wrote {FLAGS.out}/sweep.json{also} and PNGs")


if __name__ == "__main__":
  cli.run(main)
