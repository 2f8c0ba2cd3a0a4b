"""Builds the tables, plots and results.json of docs/ablations.md from the run JSONs.

  .venv/bin/python docs/ablations/make_tables.py --runs=runs/abl \
      --before=docs/ablations/results_format1.json

Reads ``RUNS/repro_{sarathi512_300s,sarathi512,nochunk,orca}/sweep.json`` (Sarathi-Serve
capacity), ``RUNS/vtc_two_clients/sweep.json`` (VTC overload) and
``RUNS/long{,_hi}/{sarathi_serve,vllm_v1,orca,sjf,srpt,spf}.json`` (replay
reports of the long-prompt mix); prints the Markdown tables, writes the PNGs
and ``results.json`` (the numbers of every table with the load average each
run recorded: wall-time figures depend on it, the virtual-time results do
not) into ``--out``, beside this file by default.

With ``--before`` (a results.json an earlier run of this script wrote: the
figures of the format-1 A100 profile), every table cell shows the new figure
with the earlier one beside it in parentheses ("-" where the earlier run had
no such row), each capacity line states both, and the capacity plot draws
the earlier curves dashed.

Every one of those runs must be there and be JSON: a missing or empty
``--runs`` folder, or one with runs missing (named in the error), is refused
with one line and exit status 2 before anything is written, so the tracked
tables are never replaced by partial ones.

Capacity follows Sarathi-Serve's capacity search (microsoft/sarathi-serve,
``sarathi/benchmark/capacity_search``): the largest offered rate whose P99
TBT over every decode gap is <= the SLO and whose median scheduling delay is
<= 2 s; iterserve records no scheduling delay, so the median TTFT (delay plus
the prompt's prefill, a slightly stricter bound) stands in for it.
"""

import argparse
import glob
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from serving import cli
TBT_SLO_MS = 100.0
MEDIAN_DELAY_MS = 2000.0
REPRO = (("sarathi512_300s", "sarathi_serve, budget = chunk 512, 300 s window"),
         ("sarathi512", "sarathi_serve, budget = chunk 512, 60 s window"),
         ("nochunk", "vllm_v1, budget = chunk 8,192 (no chunking), 60 s window"),
         ("orca", "orca, whole prompts, budget 16,384, 60 s window"))
LONG_POLICIES = ("sarathi_serve", "vllm_v1", "orca", "sjf", "srpt", "spf")
LONG_FOLDERS = ("long", "long_hi")


def expected_runs():
  """The run JSONs the tables are built from, relative to --runs."""
  return ([f"repro_{key}/sweep.json" for key, _ in REPRO] + ["vtc_two_clients/sweep.json"]
          + [f"{folder}/{p}.json" for folder in LONG_FOLDERS for p in LONG_POLICIES])


def check_runs(runs: str) -> None:
  """Refuses (ValueError naming --runs) a folder that is missing, holds
  none of ``expected_runs``, lacks some (named), or has one that is not
  JSON: the tables are rebuilt from every run or not at all."""
  if not os.path.isdir(runs):
    raise ValueError(f"--runs {runs!r} is not a folder (the runs of docs/ablations.md write "
                     f"into runs/abl)")
  expected = expected_runs()
  missing = [r for r in expected if not os.path.isfile(os.path.join(runs, r))]
  if len(missing) == len(expected):
    raise ValueError(f"--runs {runs!r} holds none of the {len(expected)} runs the tables "
                     f"are built from (e.g. {expected[0]}; docs/ablations.md runs them)")
  if missing:
    raise ValueError(f"--runs {runs!r} lacks {len(missing)} of the {len(expected)} runs the "
                     f"tables are built from: {', '.join(missing)} (docs/ablations.md runs "
                     f"them; nothing was written)")
  for r in expected:
    try:
      _load(os.path.join(runs, r))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"--runs {runs!r}: {r} cannot be read as JSON ({e})") from None


def _load(path):
  with open(path) as f:
    return json.load(f)


def load_before(path):
  """The earlier results.json of ``--before`` ({} when not given); ValueError
  naming the flag when it cannot be read or lacks a table's section."""
  if not path:
    return {}
  try:
    before = _load(path)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"--before {path!r} cannot be read as JSON ({e})") from None
  missing = [k for k in ("repro", "vtc", "long_mix") if k not in before]
  if missing:
    raise ValueError(f"--before {path!r} is not a results.json of this script: it lacks "
                     f"{', '.join(missing)}")
  return before


def _beside(new, old, fmt):
  """``fmt(new)``, and ``(fmt(old))`` after it when an earlier figure is
  compared (``old`` is ``_NONE`` without --before, None: no such row)."""
  if old is _NONE:
    return fmt(new)
  return f"{fmt(new)} ({'-' if old is None else fmt(old)})"


_NONE = object()


def capacity(sweep):
  """Rows per rate and the capacity bracket (last passing, first failing rate)."""
  rows = []
  for t in sorted(sweep["trials"], key=lambda t: t["rate_scale"]):
    rep = t["report"]
    ok = rep["p99_itl_ms"] <= TBT_SLO_MS and rep["median_ttft_ms"] <= MEDIAN_DELAY_MS
    rows.append(dict(rate_scale=t["rate_scale"], rate_req_s=t["offered_rate_req_s"],
                     requests=t["num_requests"], p99_tbt_ms=rep["p99_itl_ms"],
                     median_ttft_ms=rep["median_ttft_ms"], p99_ttft_ms=rep["p99_ttft_ms"],
                     tbt_miss_fraction=t["tbt"]["miss_fraction"],
                     attainment=t["attainment"], meets_slo=ok,
                     wall_s=t["wall_s"], iterations=t["iterations"]))
  passing = [r["rate_req_s"] for r in rows if r["meets_slo"]]
  failing = [r["rate_req_s"] for r in rows if not r["meets_slo"]
             and (not passing or r["rate_req_s"] > max(passing))]
  return rows, (max(passing) if passing else 0.0), (min(failing) if failing else None)


def _bracket(cap, over):
  return (f"meets the SLO up to {cap:.2f} req/s; "
          + (f"first failing rate {over:.2f} req/s" if over else "no rate tried failed"))


def repro(runs, out, before=None):
  result, fig_rows, old_rows = {}, [], []
  earlier = (before or {}).get("repro")
  for key, label in REPRO:
    sweep = _load(f"{runs}/repro_{key}/sweep.json")
    rows, cap, over = capacity(sweep)
    result[key] = dict(label=label, rows=rows, capacity_req_s=cap, first_failing_req_s=over,
                       load_avg_start=sweep["load_avg_start"], load_avg_end=sweep["load_avg_end"])
    fig_rows.append((label, rows))
    old = (earlier or {}).get(key)
    print(f"\n{label}: {_bracket(cap, over)}"
          + (f" (before: {_bracket(old['capacity_req_s'], old['first_failing_req_s'])})"
             if old else ""))
    by_rate = {r["rate_scale"]: r for r in old["rows"]} if old else {}
    if old:
      old_rows.append((label, old["rows"]))
    print("| x trace rate | offered req/s | requests | P99 TBT (ms) | median TTFT (ms) | "
          "gaps > 100 ms | meets SLO |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
      o = by_rate.get(r["rate_scale"]) if earlier else None
      pick = (lambda k, o=o: _NONE if not earlier else (o[k] if o else None))
      ms, pct = (lambda v: f"{v:.0f}"), (lambda v: f"{100 * v:.2f}%")
      cells = [f"{r['rate_scale']:g}", f"{r['rate_req_s']:.2f}", str(r["requests"]),
               _beside(r["p99_tbt_ms"], pick("p99_tbt_ms"), ms),
               _beside(r["median_ttft_ms"], pick("median_ttft_ms"), ms),
               _beside(r["tbt_miss_fraction"], pick("tbt_miss_fraction"), pct),
               _beside(r["meets_slo"], pick("meets_slo"), lambda v: "yes" if v else "no")]
      print("| " + " | ".join(cells) + " |")
  ours = "sarathi512_300s" if "sarathi512_300s" in result else "sarathi512"
  if ours in result and "nochunk" in result and result["nochunk"]["capacity_req_s"]:
    ratio = result[ours]["capacity_req_s"] / result["nochunk"]["capacity_req_s"]
    result["capacity_ratio_sarathi_over_nochunk"] = ratio
    was = (earlier or {}).get("capacity_ratio_sarathi_over_nochunk")
    print(f"\ncapacity ratio sarathi_serve / vllm_v1 without chunking: {ratio:.2f}x"
          + (f" (before: {was:.2f}x)" if was else ""))
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 2, figsize=(10, 4))
  colors = {}
  for label, rows in fig_rows:
    x = [r["rate_req_s"] for r in rows]
    line, = ax[0].plot(x, [r["p99_tbt_ms"] for r in rows], "o-", label=label)
    ax[1].plot(x, [r["median_ttft_ms"] / 1e3 for r in rows], "o-", c=line.get_color(),
               label=label)
    colors[label] = line.get_color()
  for label, rows in old_rows:
    x = [r["rate_req_s"] for r in rows]
    ax[0].plot(x, [r["p99_tbt_ms"] for r in rows], "x--", c=colors[label], alpha=0.6,
               label=f"{label} (before)")
    ax[1].plot(x, [r["median_ttft_ms"] / 1e3 for r in rows], "x--", c=colors[label],
               alpha=0.6)
  ax[0].axhline(TBT_SLO_MS, ls="--", c="gray")
  ax[1].axhline(MEDIAN_DELAY_MS / 1e3, ls="--", c="gray")
  ax[0].set(xlabel="offered rate (req/s)", ylabel="P99 TBT (ms)", yscale="log",
            title="Mistral-7B, A100 profile, Azure conv"
            + (" (dashed: before)" if old_rows else ""))
  ax[1].set(xlabel="offered rate (req/s)", ylabel="median TTFT (s)", yscale="log")
  ax[1].legend(fontsize=6, loc="lower right")
  fig.tight_layout()
  fig.savefig(f"{out}/capacity_p99_tbt.png", dpi=90)
  plt.close(fig)
  return result


def _on_grid(curve, grid):
  t = np.array([p[0] for p in curve])
  w = np.array([p[1] for p in curve])
  return np.interp(grid, np.concatenate([[0.0], t]), np.concatenate([[0.0], w]))


def vtc(runs, out, before=None):
  sweep = _load(f"{runs}/vtc_two_clients/sweep.json")
  earlier = (before or {}).get("vtc", {}).get("policies") if before else None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 2, figsize=(10, 4))
  result = dict(load_avg_start=sweep["load_avg_start"], load_avg_end=sweep["load_avg_end"],
                policies={})
  print("\n| policy | service gap at 10 s | at 20 s | at 30 s (arrivals end) | "
        "ledger client_service_gap | starved | median / p90 TTFT (s) | makespan (s) |")
  print("|---|---|---|---|---|---|---|---|")
  for t in sweep["trials"]:
    cs = t["client_service"]
    end = max(p[0] for c in cs.values() for p in c)
    grid = np.linspace(0.0, end, 200)
    a, b = _on_grid(cs["client-a"], grid), _on_grid(cs["client-b"], grid)
    diff = b - a
    line, = ax[0].plot(grid, diff, label=t["policy"])
    ax[1].plot(grid, a, c=line.get_color(), ls="--", label=f"{t['policy']} client-a")
    ax[1].plot(grid, b, c=line.get_color(), label=f"{t['policy']} client-b")
    at = {s: float(np.interp(s, grid, diff)) for s in (10.0, 20.0, 30.0)}
    rep = t["report"]
    result["policies"][t["policy"]] = dict(
        service_gap_b_minus_a=at, ledger_gap=t["fairness"]["client_service_gap"],
        starved=t["fairness"]["starved"], median_ttft_ms=rep["median_ttft_ms"],
        p90_ttft_ms=rep["p90_ttft_ms"], duration_s=t["duration_s"], wall_s=t["wall_s"],
        requests=t["num_requests"], offered_rate_req_s=t["offered_rate_req_s"])
    o = (earlier or {}).get(t["policy"])
    pick = (lambda f, o=o: _NONE if earlier is None else (f(o) if o else None))
    gap = lambda s, o=o: o["service_gap_b_minus_a"][str(s)]     # noqa: E731
    num = lambda v: f"{v:,.0f}"                                 # noqa: E731
    ttft = lambda v: f"{v[0] / 1e3:.1f} / {v[1] / 1e3:.1f}"     # noqa: E731
    fair = t["fairness"]
    cells = [t["policy"]] + [_beside(at[s], pick(lambda o, s=s: gap(s)), num)
                             for s in (10.0, 20.0, 30.0)] + [
        _beside(fair["client_service_gap"]["gap"], pick(lambda o: o["ledger_gap"]["gap"]), num),
        _beside(fair["starved"], pick(lambda o: o["starved"]), str),
        _beside((rep["median_ttft_ms"], rep["p90_ttft_ms"]),
                pick(lambda o: (o["median_ttft_ms"], o["p90_ttft_ms"])), ttft),
        _beside(t["duration_s"], pick(lambda o: o["duration_s"]), lambda v: f"{v:.1f}")]
    print("| " + " | ".join(cells) + " |")
  ax[0].axvline(30.0, ls=":", c="gray")
  ax[0].set(xlabel="time (s)", ylabel="service(client-b) - service(client-a)\n"
            "(weighted tokens: 1 per prompt, 2 per output)", title="VTC overload, two clients")
  ax[1].set(xlabel="time (s)", ylabel="cumulative weighted service (tokens)")
  ax[0].legend(fontsize=7)
  ax[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(f"{out}/vtc_service_difference.png", dpi=90)
  plt.close(fig)
  return result


def long_mix(runs, folder, before=None):
  result = {}
  earlier = (before or {}).get("long_mix", {}).get(folder, {}) if before else None
  order = list(LONG_POLICIES)
  paths = {os.path.splitext(os.path.basename(p))[0]: p
           for p in glob.glob(f"{runs}/{folder}/*.json")}
  print(f"\n{folder}:")
  print("| policy | engine | P99 TBT (ms) | TTFT mean / p90 (s) | E2E mean / p90 (s) | "
        "goodput valid / offered | req/s | starved | preempted | rejected |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for name in [p for p in order if p in paths] + sorted(set(paths) - set(order)):
    r = _load(paths[name])
    c = r["config"]
    g = r["goodput"]
    fair = r["ledger"]["fairness"]
    engine = f"budget {c['max_num_batched_tokens']}, chunk {c['long_prefill_token_threshold']}"
    row = dict(engine=engine, p99_tbt_ms=r["p99_itl_ms"], mean_ttft_ms=r["mean_ttft_ms"],
               p90_ttft_ms=r["p90_ttft_ms"], mean_e2el_ms=r["mean_e2el_ms"],
               p90_e2el_ms=r["p90_e2el_ms"], valid=g["valid"], offered=g["offered"],
               request_goodput=g["request_goodput"], starved=fair["starved"],
               preemptions=r["num_preemptions"], rejected=r["rejected"],
               duration_s=r["duration_s"], offered_rate_req_s=g["offered"] / (
                   r["config"]["workload"]["last_arrival_s"] or 1.0))
    result[name] = row
    o = (earlier or {}).get(name)
    cell = lambda keys, fmt, o=o: _beside(                       # noqa: E731
        tuple(row[k] for k in keys), _NONE if earlier is None
        else (tuple(o[k] for k in keys) if o else None), fmt)
    pair = lambda v: f"{v[0] / 1e3:.1f} / {v[1] / 1e3:.1f}"     # noqa: E731
    print(f"| {name} | {engine} | {cell(['p99_tbt_ms'], lambda v: f'{v[0]:.0f}')} | "
          f"{cell(['mean_ttft_ms', 'p90_ttft_ms'], pair)} | "
          f"{cell(['mean_e2el_ms', 'p90_e2el_ms'], pair)} | "
          f"{cell(['valid', 'offered'], lambda v: f'{v[0]} / {v[1]}')} | "
          f"{cell(['request_goodput'], lambda v: f'{v[0]:.2f}')} | "
          f"{cell(['starved'], lambda v: str(v[0]))} | "
          f"{cell(['preemptions'], lambda v: str(v[0]))} | "
          f"{cell(['rejected'], lambda v: str(v[0]))} |")
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", default="runs/abl", help="Folder the runs wrote into; "
                      "every run the tables use must be there (refused otherwise).")
  parser.add_argument("--out", default=HERE, help="Folder for results.json and the PNGs "
                      "(default: docs/ablations, beside this script; created if missing).")
  parser.add_argument("--before", default=None,
                      help="A results.json an earlier run of this script wrote (e.g. "
                           "docs/ablations/results_format1.json): its figures are shown "
                           "beside the new ones in every table.")
  parser.add_argument("--long_load_avg", default=None,
                      help="Load averages seen around the long-mix replays (their "
                           "reports record none), e.g. '8.9-10.5'.")
  args = parser.parse_args()
  try:
    check_runs(args.runs)
    if not args.out:
      raise ValueError("--out must name the folder for results.json and the PNGs, got ''")
    before = load_before(args.before)
    cli.make_dir("out", args.out)
  except ValueError as e:
    cli.refuse(str(e))
  results = {"repro": repro(args.runs, args.out, before),
             "vtc": vtc(args.runs, args.out, before),
             "long_mix": {f: long_mix(args.runs, f, before) for f in LONG_FOLDERS},
             "long_mix_load_avg": args.long_load_avg}
  if args.before:
    results["before"] = args.before
  with open(f"{args.out}/results.json", "w") as f:
    json.dump(results, f, indent=1)
  print(f"\nwrote {args.out}/results.json and PNGs")


if __name__ == "__main__":
  main()
