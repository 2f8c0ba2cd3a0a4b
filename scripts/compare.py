"""Ablation table across runs, refused when their coordinates differ (§0x0E).

  python scripts/compare.py runs/a.json runs/b.json [--metric=request_goodput]
  python scripts/compare.py runs/sweep/sweep.json      # ranked by g_star

Replay reports also rank by the fairness figures of their ledger
(``ledger.fairness``): ``--metric=client_service_gap`` (the largest
backlogged weighted-service gap between two clients) and
``--metric=starved``, both lower first, or any number in the report by its
dotted path (``--metric=ledger.fairness.by_client.c0.weighted_service``).

Without --metric, replay reports rank by request_goodput, or by
request_throughput (said in a note line) when no replay declared SLOs;
sweeps rank by g_star. Values print to 4 significant digits.

Inputs are replay reports (scripts/replay.py) or sweeps (scripts/sweep.py,
ranked by G*), not both: a mix is refused in one line naming which file is
which kind. A sweep's rows are named ``FILE:POLICY``, FILE its file name with
as many of its folders as tell it apart from the other inputs
(``a/sweep.json:vllm_v1`` and ``b/sweep.json:vllm_v1``). A G* that the
sweep's rate grid does not bracket is shown as ``>= R`` (every rate tried
met alpha: a lower bound at the highest rate R) or ``< R`` (the lowest rate
R missed), and one warning line names those policies, which cannot be
ranked on it (two lower bounds are not a tie).
Runs are ranked only when every comparison coordinate
(model, executor + cost model, trace + window + rate scale, SLOs, metric
definitions, engine config apart from the policy) is equal; otherwise the
script prints one short line naming the two runs (by the names above, a
replay report by its file name) and the first coordinate that differs with
both values (e.g. ``refusing to rank a.json and b.json: coordinate
'engine_config' differs in max_num_seqs (32 vs 8)``) and exits with status
2. Coordinates are what the user set: what a run measured (the report's
``engine_outcomes``: iterations, preemptions, extensions, prompt rows
computed, prefix-cache evictions and pages) differs between policies and is
never one, so two replays that differ only in ``--policy`` compare.
"""

import json
import os
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from serving.harness import ablation
from serving import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("metric", None, "Metric to rank by: a report key, a ledger goodput "
                    "key, a ledger fairness figure (client_service_gap, starved), a "
                    "dotted path to any number in the report (ledger.fairness.by_client."
                    "c0.weighted_service), or g_star for a sweep; latencies (*_ms, *_s) and "
                    "rejected/failed counts rank lower first, the rest higher first. "
                    "Default: g_star for sweeps; request_goodput for replay reports, or "
                    "request_throughput (said in a note) when no replay declared SLOs "
                    "(replay.py without --slo_ttft_ms/--slo_tpot_ms/--slo_class): every "
                    "completed request then counts as good, so goodput is throughput.")


def _load(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise ValueError(f"{path}: no such run JSON") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not a run JSON ({e})") from None


# The ledger's fairness figures a replay report ranks by, from
# ``ledger.fairness`` (``serving.harness.ledger``): name -> path below it.
FAIRNESS_FIGURES = {"client_service_gap": ("client_service_gap", "gap"),
                    "starved": ("starved",)}


def lookup(run: dict, path):
  """The value at ``path`` (a dotted string or a sequence of keys) in
  ``run``, or None where a key is missing."""
  value = run
  for key in (path.split(".") if isinstance(path, str) else path):
    if not isinstance(value, dict) or key not in value:
      return None
    value = value[key]
  return value


def fairness_figures(run: dict) -> dict:
  """``FAIRNESS_FIGURES`` of a replay report (those its ledger has)."""
  fair = run.get("ledger", {}).get("fairness", {})
  figures = {name: lookup(fair, path) for name, path in FAIRNESS_FIGURES.items()}
  return {k: v for k, v in figures.items() if v is not None}


def kind_of(run: dict) -> str:
  """``"sweep"`` (scripts/sweep.py's sweep.json) or ``"replay report"``."""
  return "sweep" if "trials" in run else "replay report"


def check_one_kind(paths, runs) -> None:
  """Raises ValueError, in one line, when ``runs`` mix replay reports and
  sweeps (a replay is one rate, ranked by its report or ledger keys; a sweep
  is a rate grid, ranked by G*: neither has the other's numbers)."""
  kinds = [kind_of(r) for r in runs]
  if len(set(kinds)) > 1:
    named = "; ".join(f"{k}: " + ", ".join(p for p, k2 in zip(paths, kinds) if k2 == k)
                      for k in ("replay report", "sweep") if k in kinds)
    raise ValueError(f"refusing to mix replay reports and sweeps ({named}): compare "
                     f"replay reports with replay reports, or sweeps with sweeps "
                     f"(--metric=g_star)")


def _g_star(run: dict, policy: str) -> dict:
  """The sweep's G* of ``policy``; recomputed from its points when the
  sweep.json was written before G* said whether the grid brackets it."""
  g = run["g_star"][policy]
  if "bracketed" not in g and run.get("points", {}).get(policy):
    pts = run["points"][policy]
    g = ablation.g_star([p["rate_req_s"] for p in pts], [p["attainment"] for p in pts],
                        run["alpha"])
  return g


def short_names(paths) -> list:
  """Each path's last parts, as few as tell it apart from the other paths:
  its file name, or with as many of its folders as it takes
  (``runs/a/sweep.json`` and ``runs/b/sweep.json``: ``a/sweep.json`` and
  ``b/sweep.json``). A path given twice keeps its file name."""
  parts = [Path(os.path.abspath(p)).parts for p in paths]
  names = []
  for mine in parts:
    others = [q for q in parts if q != mine]
    n = 1
    while n < len(mine) and any(q[-n:] == mine[-n:] for q in others):
      n += 1
    names.append(os.path.join(*mine[-n:]))
  return names


def rows_of(path: str, run: dict, name: Optional[str] = None):
  """(name, policy, coordinates run, metrics) per run in ``run``: one for a
  replay report, named ``path``; one per policy for a sweep, named
  ``NAME:POLICY`` (``name``, default the file name; its metrics ``g_star``
  and ``g_star_interpolated``, and ``g`` the whole ``ablation.g_star``
  result)."""
  if kind_of(run) == "sweep":   # one row per policy, coordinates per trial
    runs = []
    for p in run["policies"]:
      t = next(t for t in run["trials"] if t["policy"] == p)
      coords_run = {"config": t["config"], "slo": run["slo"],
                    "rate_scale": tuple(run["rate_scales"]),
                    "metric_definitions": run["metric_definitions"]}
      coords_run["config"] = dict(t["config"], workload={
          "trace": run["trace"], "window_s": run["window_s"],
          "trials": run["trials_per_point"]})
      g = _g_star(run, p)
      runs.append((f"{name or os.path.basename(path)}:{p}", p, coords_run,
                   {"g_star": g["g_star"], "g_star_interpolated": g["g_star_interpolated"],
                    "g": g}))
    return runs
  # Goodput keys: the ledger's (each request judged by its own SLOs, else
  # the ledger's limits), else those of the report's top-level goodput.
  led = run.get("ledger", {}).get("goodput") or run.get("goodput", {})
  return [(path, run["config"]["policy_id"], run, {**run, **led, **fairness_figures(run)})]


G_STAR_METRICS = ("g_star", "g_star_interpolated")
# Keys that only a replay with SLOs reports (``serving.harness.metrics.goodput``).
GOODPUT_KEYS = ("request_goodput", "token_goodput", "offered_attainment",
                "admitted_attainment", "completion_conditioned_attainment", "valid",
                "missed", "offered", "admitted", "other")


def has_goodput(run: dict) -> bool:
  """Whether a replay report judged its requests by SLOs (replay.py with
  --slo_ttft_ms / --slo_tpot_ms / --slo_class writes a goodput block)."""
  return bool(run.get("goodput") or run.get("ledger", {}).get("goodput"))


def default_metric(runs) -> tuple:
  """``(metric, note)`` when --metric is not given: ``g_star`` for sweeps;
  ``request_goodput`` for replay reports, or ``request_throughput`` with a
  note line when none of them declared SLOs (then every completed request
  is good, and goodput is throughput)."""
  if all(kind_of(r) == "sweep" for r in runs):
    return "g_star", None
  if any(has_goodput(r) for r in runs):
    return "request_goodput", None
  return "request_throughput", ("note: no SLOs were declared in these replays (replay.py "
                                "--slo_ttft_ms/--slo_tpot_ms/--slo_class): ranking by "
                                "request_throughput, which goodput equals without SLOs "
                                "(--metric picks another)")


def is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def missing_metric_error(metric: str, missing, runs_by_name: dict, rows) -> str:
  """One line saying that ``metric`` is not a number in the runs named in
  ``missing``, why (for a goodput key in replays without SLOs: none were
  declared), and the metrics that are numbers in every run."""
  numbers = sorted(set.intersection(*({k for k, v in m.items() if is_number(v)}
                                      for *_, m in rows)))
  no_slo = [n for n in missing if kind_of(runs_by_name[n]) == "replay report"
            and not has_goodput(runs_by_name[n])]
  if metric in GOODPUT_KEYS and no_slo:
    why = ("no SLOs were declared in those replays: goodput needs replay.py "
           "--slo_ttft_ms/--slo_tpot_ms or --slo_class")
  else:
    why = ("a report key, a ledger goodput key, a ledger fairness figure "
           f"{sorted(FAIRNESS_FIGURES)}, a dotted path to a number, or g_star for a sweep")
  return (f"--metric={metric!r} is not a number in {missing[:4]} ({why}); numbers in "
          f"every run: {', '.join(numbers) or 'none'}")


def unbracketed_warning(rows, metric: str):
  """One line naming the sweep rows whose G* the rate grid does not
  bracket (a lower bound, or below the lowest rate), which cannot be ranked
  on it; None when every G* is bracketed or ``metric`` is not a G*."""
  if metric not in G_STAR_METRICS:
    return None
  gs = [(n, m["g"]) for n, _, _, m in rows if not m["g"].get("bracketed", True)]
  if not gs:
    return None
  why = [w for w, kind in (("'>=': every rate tried met alpha, a lower bound; raise "
                            "--rate_scales", "g_star_is_lower_bound"),
                           ("'<': the lowest rate tried missed alpha; lower --rate_scales",
                            "g_star_below_lowest_rate")) if any(g.get(kind) for _, g in gs)]
  named = ", ".join(f"{n} ({ablation.g_star_text(g, metric)})" for n, g in gs)
  return (f"warning: the rate grid does not bracket G* of {named}: these cannot be "
          f"ranked on {metric} (two bounds are not a tie) ({'; '.join(why)})")


@cli.takes_arguments
def main(argv):
  paths = argv[1:]
  if not paths:
    raise ValueError("compare.py needs at least one run JSON")
  runs = [_load(p) for p in paths]
  check_one_kind(paths, runs)
  metric, note = (FLAGS.metric, None) if FLAGS.metric is not None else default_metric(runs)
  rows, runs_by_name, labels = [], {}, []
  for path, run, name in zip(paths, runs, short_names(paths)):
    for row in rows_of(path, run, name):
      if "." in metric and kind_of(run) == "replay report":
        row[3][metric] = lookup(run, metric)
      rows.append(row)
      runs_by_name[row[0]] = run
      labels.append(name if kind_of(run) == "replay report" else row[0])
  g_metric = metric in G_STAR_METRICS and all("g" in m for *_, m in rows)
  missing = [n for n, _, _, m in rows if not is_number(m.get(metric))
             and not (g_metric and m["g"].get("g_star_below_lowest_rate"))]
  # Runs that differ in a coordinate are refused first: no metric makes them
  # comparable.
  ablation.check_comparable([r[2] for r in rows], labels)
  if missing:
    raise ValueError(missing_metric_error(metric, missing, runs_by_name, rows))
  if note:
    print(note)
  columns = [c for c in ("completed", "rejected", "failed") if all(c in m for *_, m in rows)]
  print(ablation.table([{"name": n, "policy": p, metric: m.get(metric),
                         **({"text": ablation.g_star_text(m["g"], metric)}
                            if g_metric else {}),
                         **{c: m[c] for c in columns}} for n, p, _, m in rows],
                       metric, columns))
  warning = unbracketed_warning(rows, metric) if g_metric else None
  if warning:
    print(warning)
  print("coordinates (equal for every run):")
  for k, v in ablation.coordinates(rows[0][2]).items():
    print(f"  {k}: {v if len(v) <= 160 else v[:157] + '...'}")


if __name__ == "__main__":
  cli.run(main)
