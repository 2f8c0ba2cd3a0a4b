"""Comparison coordinates, goodput capacity and the ablation table (§0x0E).

Two runs may be ranked only when every coordinate that shapes their numbers
is equal: the model, the executor (and for a modelled clock its cost model),
the trace, its window and rate scale, the SLOs, the metric definitions and
the engine configuration apart from the policy being compared.
``check_comparable`` refuses otherwise in one short line naming the first
coordinate that differs, with both values. Coordinates are what the user
set; what a run measured (``serving.harness.replay.run_outcomes``:
iterations, preemptions, extensions, prompt rows computed, prefix-cache
counters) never is one.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence

from serving.harness.report_text import number_text

METRIC_DEFINITIONS = ("vLLM benchmark_serving TTFT/TPOT/ITL/E2EL from original arrival; "
                      "attainment = valid/offered (§0x07); G* = largest rate with mean "
                      "attainment >= alpha (DistServe)")

# Engine-config keys that are the compared variable, a coordinate of their
# own, where the run ran, or measured outcomes (reports written before
# ``run_outcomes`` kept those in the config; they are skipped there).
_NOT_COORDINATES = {"policy_id", "policy_version", "workload", "compile_seconds_by_bucket",
                    "cost_model", "slo", "trace", "platform", "device", "key_order_sort",
                    "scan_kernels",
                    "compiled_programs", "bucket_histogram", "iterations", "preemptions",
                    "swap", "recompute_tokens", "num_slots", "extensions",
                    "prefill_tokens_computed", "prefix_cache_queries", "prefix_cache_hits",
                    "prefix_cache_hit_rate", "prefix_cache_evictions", "prefix_cache_pages"}


def coordinates(run: dict) -> Dict[str, str]:
  """The comparison coordinates of a replay report or a sweep trial
  (each rendered as a canonical JSON string). ``rate_scale`` only where the
  run has one (a sweep's rate grid): a replay report's rate is its
  workload's ``time_scale``, in ``trace``."""
  config = run.get("config", {})
  cost = config.get("cost_model")
  cost = None if cost is None else {k: cost.get(k) for k in ("coef_ms", "combine",
                                                             "min_step_ms")} | {
      "file": cost.get("meta", {}).get("path") or cost.get("meta", {}).get("profile")}
  workload = config.get("workload", {})
  engine = {k: v for k, v in sorted(config.items()) if k not in _NOT_COORDINATES}
  for k in ("model", "executor", "clock"):
    engine.pop(k, None)
  coords = {
      "model": config.get("model"),
      "executor": [config.get("executor", "model"), config.get("clock", "wall")],
      "cost_model": cost,
      "trace": workload,
      **({"rate_scale": run["rate_scale"]} if "rate_scale" in run else {}),
      "slo": run.get("slo") or run.get("ledger", {}).get("slo"),
      "metric_definitions": run.get("metric_definitions", METRIC_DEFINITIONS),
      "engine_config": engine,
  }
  return {k: json.dumps(v, sort_keys=True) for k, v in coords.items()}


def _short(value, width: int = 48) -> str:
  text = json.dumps(value, sort_keys=True)
  return text if len(text) <= width else text[:width - 3] + "..."


def differing_keys(a, b, prefix: str = "") -> List[str]:
  """``"key.sub (a vs b)"`` for every leaf in which two JSON values differ
  (dicts compared key by key, anything else whole; a missing key is
  ``<absent>``)."""
  if isinstance(a, dict) and isinstance(b, dict):
    out = []
    for key in sorted(set(a) | set(b)):
      path = f"{prefix}.{key}" if prefix else str(key)
      if key not in a or key not in b:
        out.append(f"{path} ({_short(a[key]) if key in a else '<absent>'} vs "
                   f"{_short(b[key]) if key in b else '<absent>'})")
      else:
        out += differing_keys(a[key], b[key], path)
    return out
  return [] if a == b else [f"{prefix or 'value'} ({_short(a)} vs {_short(b)})"]


# The most characters of ``check_comparable``'s line (bar long run names or
# values): the differences that fit, then how many more.
MAX_REFUSAL_CHARS = 200


def _refusal(first: str, other: str, diffs: List[tuple]) -> str:
  """``check_comparable``'s line from ``diffs``, ``(coordinate, a, b)`` per
  differing coordinate in order: the first one's differing keys (a cost
  model's ``file`` first: it names the rest) as many as fit in
  ``MAX_REFUSAL_CHARS`` (at least one) and how many more, then the names of
  the other differing coordinates."""
  key, a, b = diffs[0]
  rest = [k for k, _, _ in diffs[1:]]
  tail = (f"; {', '.join(map(repr, rest))} {'differs' if len(rest) == 1 else 'differ'} too"
          if rest else "")
  head = f"refusing to rank {first} and {other}: coordinate {key!r} differs"
  if not (isinstance(a, dict) and isinstance(b, dict)):
    return f"{head} ({_short(a)} vs {_short(b)}){tail}"
  keys = sorted(differing_keys(a, b), key=lambda d: not d.startswith("file "))
  for n in range(len(keys), 0, -1):
    more = f" and {len(keys) - n} more keys" if n < len(keys) else ""
    line = f"{head} in {', '.join(keys[:n])}{more}{tail}"
    if len(line) <= MAX_REFUSAL_CHARS or n == 1:
      return line


def check_comparable(runs: Sequence[dict], names: Optional[Sequence[str]] = None) -> None:
  """Raises ValueError naming the first run that differs from the first one
  and, in one line of at most ``MAX_REFUSAL_CHARS`` where the names and
  values allow, the first coordinate in which it differs with both values
  (and the other differing coordinates), e.g. ``refusing to rank a.json and
  b.json: coordinate 'engine_config' differs in max_num_seqs (256 vs 32)``."""
  names = list(names or [f"run{i}" for i in range(len(runs))])
  if len(runs) < 2:
    return
  base = coordinates(runs[0])
  for name, run in zip(names[1:], runs[1:]):
    other = coordinates(run)
    diffs = [(key, json.loads(base[key]), json.loads(other[key]))
             for key in base if base[key] != other[key]]
    if diffs:
      raise ValueError(_refusal(names[0], name, diffs))


def g_star(rates: Sequence[float], attainment: Sequence[float], alpha: float) -> dict:
  """Goodput capacity at attainment ``alpha`` (DistServe, Zhong et al. OSDI
  2024: the highest request rate whose SLO attainment is >= alpha), and
  whether the rates tried bracket it.

  A capacity is measured only when the grid brackets it: some rate meets
  alpha and a higher one misses. When every rate tried meets alpha the
  capacity is at or above the highest rate (``g_star`` is that rate, a
  lower bound); when the lowest rate misses it is below the lowest rate
  (``g_star`` is None). Neither ranks against another policy's G*.

  Args:
    rates: ascending request rates (req/s); attainment: mean attainment at
      each (fraction in [0, 1]).
  Returns:
    ``{"alpha",
    "g_star": largest grid rate such that it and every lower rate meet
    alpha (None if the lowest misses),
    "g_star_interpolated": the linear crossing between that rate and the
    next one (equal to g_star when no higher rate was run),
    "bracketed": True when a rate meets alpha and the next higher misses,
    "g_star_is_lower_bound": True when every rate tried meets alpha,
    "g_star_below_lowest_rate": True when the lowest rate tried misses,
    "bracket": [last rate meeting alpha or None, first rate missing it or
    None] (req/s)}``.
  Raises:
    ValueError: unsorted or mismatched inputs, alpha outside (0, 1].
  """
  if not 0 < alpha <= 1:
    raise ValueError(f"g_star: alpha must be in (0, 1], got {alpha}")
  if len(rates) != len(attainment) or list(rates) != sorted(rates) or not rates:
    raise ValueError("g_star: rates must be non-empty, ascending and match attainment")
  best = None
  for i, (r, a) in enumerate(zip(rates, attainment)):
    if a + 1e-12 < alpha:
      break
    best = i
  if best is None:
    return {"alpha": alpha, "g_star": None, "g_star_interpolated": None,
            "bracketed": False, "g_star_is_lower_bound": False,
            "g_star_below_lowest_rate": True, "bracket": [None, rates[0]]}
  if best + 1 == len(rates):
    return {"alpha": alpha, "g_star": rates[best], "g_star_interpolated": rates[best],
            "bracketed": False, "g_star_is_lower_bound": True,
            "g_star_below_lowest_rate": False, "bracket": [rates[best], None]}
  r0, r1, a0, a1 = rates[best], rates[best + 1], attainment[best], attainment[best + 1]
  interp = r0 + (r1 - r0) * (a0 - alpha) / (a0 - a1) if a0 != a1 else r0
  return {"alpha": alpha, "g_star": r0, "g_star_interpolated": interp, "bracketed": True,
          "g_star_is_lower_bound": False, "g_star_below_lowest_rate": False,
          "bracket": [r0, r1]}


def g_star_text(g: dict, key: str = "g_star", digits: int = 4) -> str:
  """``g[key]`` (``g_star`` or ``g_star_interpolated`` of a ``g_star``
  result) as text in req/s: the number when bracketed, ``">= R"`` when
  every rate tried met alpha (R the highest rate), ``"< R"`` when the
  lowest rate R missed. A result without the bracketing keys (a sweep.json
  written before they existed) shows its number."""
  if g.get("g_star_below_lowest_rate"):
    return f"< {g['bracket'][1]:.{digits}g}"
  value = g.get(key)
  if value is None:
    return "None"
  return (">= " if g.get("g_star_is_lower_bound") else "") + f"{value:.{digits}g}"


def g_star_note(g: dict) -> str:
  """What the rates tried say about the capacity, for a summary line, e.g.
  ``"every rate tried met the SLOs: raise --rate_scales"`` (met: mean
  attainment >= alpha)."""
  if g.get("g_star_is_lower_bound"):
    return "every rate tried met the SLOs: raise --rate_scales"
  if g.get("g_star_below_lowest_rate"):
    return "the lowest rate tried missed the SLOs: lower --rate_scales"
  lo, hi = g.get("bracket") or (None, None)
  if lo is None:
    return f"interpolated {g.get('g_star_interpolated')}"
  return (f"bracketed: {lo:.4g} req/s meets alpha={g['alpha']:g}, {hi:.4g} misses; "
          f"interpolated {g['g_star_interpolated']:.4g}")


# Metrics where less is better: latencies (``*_ms``, ``*_s``) and counts of
# requests or events that went wrong.
LOWER_IS_BETTER = ("rejected", "failed", "cancelled", "num_preemptions", "num_clipped",
                   "client_service_gap", "gap", "starved", "preemptions",
                   "recompute_tokens")


def lower_is_better(metric: str) -> bool:
  """Whether ``table`` ranks ``metric`` ascending (see ``LOWER_IS_BETTER``);
  a dotted path (``ledger.fairness.client_service_gap.gap``) by its last key."""
  metric = metric.rsplit(".", 1)[-1]
  return metric.endswith(("_ms", "_s")) or metric in LOWER_IS_BETTER


def table(rows: List[dict], metric: str, columns: Sequence[str] = ()) -> str:
  """A text table of runs ranked by ``metric``, best first (ascending for a
  ``lower_is_better`` metric, else descending), with ``columns`` beside it
  (e.g. completed / rejected, so a run that refused its load is seen). A
  row's optional ``"text"`` is shown in place of its value (e.g. ``">= 0.032"``
  for a G* that is a lower bound, ``g_star_text``); the order is the value's.
  Numbers print as ``number_text`` (4 significant digits)."""
  sign = 1.0 if lower_is_better(metric) else -1.0
  rows = sorted(rows, key=lambda r: sign * (r.get(metric) or 0.0))
  width = max(len(r["name"]) for r in rows)
  order = "lower is better" if sign > 0 else "higher is better"
  head = f"{'run':<{width}}  {'policy':<22} {metric:>14}" + "".join(
      f" {c:>10}" for c in columns)
  lines = [head + f"   ({order})"]
  lines += [f"{r['name']:<{width}}  {r['policy']:<22} "
            f"{r.get('text') or number_text(r.get(metric)):>14}"
            + "".join(f" {number_text(r.get(c, '')):>10}" for c in columns) for r in rows]
  return "\n".join(lines)
