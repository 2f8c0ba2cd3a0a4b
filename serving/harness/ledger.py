"""The §0x07 ledger of a run: outcomes, goodput, fairness and resources.

``build_ledger`` turns a replay's ``RequestRecord``s (plus optional engine
facts) into the report's ``ledger`` block:

* ``outcomes``: per offered cohort (arrival window of ``cohort_s`` seconds,
  and per client) the partition of offered requests into ``valid``
  (completed within every SLO), ``completed_miss``, ``rejected``,
  ``cancelled``, ``failed`` and ``open_at_horizon`` (no outcome by the
  horizon: a request whose last token comes after ``horizon_s``). Every
  cohort asserts N_off = sum of its parts.
* ``goodput``: ``serving.harness.metrics.goodput`` (request and token goodput, the
  three attainment denominators kept apart) and TBT deadline misses per
  emission gap (every gap between consecutive output tokens over ``tbt_ms``).
* ``fairness``: completed weighted service per client (w_p * prompt +
  w_q * output tokens of completed requests), the backlogged service gap
  (``metrics.client_service_gap``), and starvation: requests still without
  a first token ``starvation_s`` after arrival, per client.
* ``resources``: live and cached KV pages and queue length over time
  (``ResourceSampler``), preemptions and recompute tokens per request.

SLO limits are inputs (ms; None = no objective), so the ledger reads the
same limits the scheduler was given, from wherever they are declared.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np

from serving.engine import sim_driver
from serving.harness import metrics

PARTS = ("valid", "completed_miss", "rejected", "cancelled", "failed", "open_at_horizon")


class ResourceSampler:
  """``on_progress`` hook of ``replay``: samples the engine's tables after
  each iteration that ends at least ``every`` iterations after the last
  sample, on either path of ``replay``, with the same samples. On the step
  path it reads the tables when called (after every step). On the loop path
  ``Engine.simulate`` keeps each iteration's occupancy for it (its own list
  in ``sim_driver.LoopRuns.resource_readers``, from the loop's
  ``SimLog.resources``), which it reads when called (after at most
  ``replay.PROGRESS_ITERATIONS`` iterations, plus the rest of the loop call
  that crossed them); several samplers may share an engine.

  Each sample (``COLUMNS``, ``sim_driver.resource_sample``): t_ms, the
  iteration's end on the engine clock minus ``origin_ms`` (the engine time
  when the sampler was made, unless given: pass it to ``replay``'s
  ``origin_ms`` and the rows are on the records' time axis); ``kv_pages_live``, pages some
  request's page table holds (refcount >= 1, shared prefix pages counted
  once); ``kv_pages_cached``, pages only the prefix cache holds (refcount 0,
  kept for later hits, evicted on demand, so free for admission); the queue
  length (pending + WAITING slots); the running sequences. Live + cached +
  free pages = ``num_pages - 1``. The ledger's ``*_max`` figures are maxima
  over the samples (a larger ``every`` can miss a peak between two).

  Raises:
    ValueError: ``every`` < 1.
  """

  COLUMNS = sim_driver.SAMPLE_COLUMNS

  def __init__(self, engine, every: int = 1, origin_ms: Optional[float] = None):
    if every < 1:
      raise ValueError(f"ResourceSampler.every must be >= 1, got {every}")
    self.engine, self.every = engine, every
    self.origin_ms = engine.now_ms() if origin_ms is None else origin_ms
    self._last = engine.num_iterations
    self.samples: List[tuple] = []
    self._rows: List[np.ndarray] = []        # this sampler's LoopRuns.resource_readers list
    engine.loop_runs.resource_readers.append(self._rows)

  def __call__(self, engine=None) -> None:
    e = self.engine
    blocks = self._rows[:]
    self._rows.clear()
    if blocks:
      rows = np.concatenate(blocks)
      iteration = rows[:, 0]        # increasing
      i = int(np.searchsorted(iteration, self._last + self.every))
      while i < len(rows):
        self._last = int(iteration[i])
        t_ms, *counts = rows[i, 1:].tolist()
        self.samples.append((round(t_ms - self.origin_ms, 3), *map(int, counts)))
        i = int(np.searchsorted(iteration, self._last + self.every))
    if e.num_iterations - self._last >= self.every:
      self._last = e.num_iterations
      t_ms, *counts = sim_driver.resource_sample(e)
      self.samples.append((round(t_ms - self.origin_ms, 3), *counts))


def _ms(x: Optional[float]) -> Optional[float]:
  return None if x is None else x * 1000.0


def classify(r: metrics.RequestRecord, *, ttft_ms=None, tpot_ms=None,
             horizon_s: Optional[float] = None) -> str:
  """The ledger part of one offered request (one of ``PARTS``). A request
  judged against its own declared SLOs (``r.slo_ttft_ms`` / ``r.slo_tpot_ms``,
  set by ``--slo_ttft_ms`` / ``--slo_tpot_ms`` / ``--slo_class``) uses them;
  ``ttft_ms`` / ``tpot_ms`` apply where a request declared none."""
  return metrics.slo_outcome(r, ttft_ms=ttft_ms, tpot_ms=tpot_ms, per_request=True,
                             horizon_s=horizon_s)


def _partition(records, **kw) -> dict:
  parts = {p: 0 for p in PARTS}
  for r in records:
    parts[classify(r, **kw)] += 1
  n_off = len(records)
  if sum(parts.values()) != n_off:        # the §0x07 closure, asserted
    raise AssertionError(f"ledger partition does not close: {parts} != N_off {n_off}")
  return {"offered": n_off, **parts}


def build_ledger(records: Sequence[metrics.RequestRecord], *, duration_s: float,
                 ttft_ms: Optional[float] = None, tpot_ms: Optional[float] = None,
                 tbt_ms: Optional[float] = None, horizon_s: Optional[float] = None,
                 cohort_s: float = 60.0, starvation_s: float = 30.0,
                 w_p: float = 1.0, w_q: float = 2.0, engine=None,
                 sampler: Optional[ResourceSampler] = None) -> dict:
  """The ledger block of a report (JSON-ready).

  Args:
    records: every offered request (one record each; N_off = len).
    duration_s: the run's duration (s), the goodput denominator.
    ttft_ms, tpot_ms, tbt_ms: SLO limits (ms) or None; ttft_ms and tpot_ms
      apply where a request declared none of its own. ``goodput`` is there
      when some limit applies (these, or a request's own), with
      ``metrics.goodput(per_request=True, horizon_s=horizon_s)``: the
      partition's judgement (its valid requests are the partition's; the
      open ones count as missed there).
    horizon_s: requests not finished by then are ``open_at_horizon``.
    cohort_s: width of an arrival cohort (s, > 0).
    starvation_s: a request without a first token this long after arrival
      (or never) counts as starved (s, > 0).
    engine, sampler: optional; per-request preemptions/recompute tokens
      come from ``engine.requests``, time series from the sampler.
  Raises:
    ValueError: cohort_s or starvation_s <= 0.
    AssertionError: a cohort's parts do not sum to its offered count.
  """
  if not cohort_s > 0:
    raise ValueError(f"build_ledger: cohort_s must be > 0, got {cohort_s}")
  if not starvation_s > 0:
    raise ValueError(f"build_ledger: starvation_s must be > 0, got {starvation_s}")
  records = list(records)
  kw = dict(ttft_ms=ttft_ms, tpot_ms=tpot_ms, horizon_s=horizon_s)
  by_cohort: Dict[int, list] = {}
  by_client: Dict[str, list] = {}
  for r in records:
    by_cohort.setdefault(int(math.floor(r.arrival_s / cohort_s)), []).append(r)
    by_client.setdefault(r.client, []).append(r)
  total = _partition(records, **kw)
  cohorts = [{"arrival_s": [k * cohort_s, (k + 1) * cohort_s], **_partition(v, **kw)}
             for k, v in sorted(by_cohort.items())]
  if sum(c["offered"] for c in cohorts) != total["offered"]:
    raise AssertionError("ledger cohorts do not cover the offered requests")
  own = any(r.slo_ttft_ms is not None or r.slo_tpot_ms is not None for r in records)
  # "requests_declare_slos": some request brought its own limits, which
  # classify applies before these (``--slo_class``: each class its own).
  out = {"slo": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "tbt_ms": tbt_ms,
                 "requests_declare_slos": own},
         "horizon_s": horizon_s, "cohort_s": cohort_s,
         "outcomes": {"total": total, "by_cohort": cohorts,
                      "by_client": {c: _partition(v, **kw) for c, v in sorted(by_client.items())}}}
  if (ttft_ms is not None or tpot_ms is not None or own) and duration_s > 0:
    # Judged as ``classify`` judges: a request's own SLOs first.
    out["goodput"] = metrics.goodput(records, ttft_ms=ttft_ms, tpot_ms=tpot_ms,
                                     duration_s=duration_s, per_request=True,
                                     horizon_s=horizon_s)
  if tbt_ms is not None:
    gaps = [b - a for r in records for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    misses = sum(g * 1000.0 > tbt_ms + 1e-6 for g in gaps)
    out["tbt"] = {"emission_gaps": len(gaps), "deadline_misses": int(misses),
                  "miss_fraction": misses / len(gaps) if gaps else None}
  out["fairness"] = _fairness(records, by_client, starvation_s, w_p, w_q)
  out["resources"] = _resources(records, engine, sampler)
  return out


def _fairness(records, by_client, starvation_s, w_p, w_q) -> dict:
  gap = metrics.client_service_gap(records, w_p=w_p, w_q=w_q)
  per_client = {}
  for c, rs in sorted(by_client.items()):
    done = [r for r in rs if r.outcome == "completed"]
    starved = sum(1 for r in rs if r.outcome != "rejected" and (
        r.first_token_s is None or r.first_token_s - r.arrival_s > starvation_s))
    per_client[c] = {"offered": len(rs), "completed": len(done),
                     "weighted_service": sum(w_p * r.prompt_tokens + w_q * r.output_tokens
                                             for r in done),
                     "starved": starved}
  return {"weights": {"w_p": w_p, "w_q": w_q}, "starvation_s": starvation_s,
          "starved": sum(v["starved"] for v in per_client.values()),
          "client_service_gap": {"gap": gap.gap, "pair": gap.pair, "window_s": gap.window_s},
          "by_client": per_client}


def _resources(records, engine, sampler) -> dict:
  out = {}
  if engine is not None:
    reqs = engine.requests
    per = {r.request_id: (reqs[r.request_id].num_preemptions,
                          reqs[r.request_id].recompute_tokens)
           for r in records if r.request_id in reqs}
    out["preempted_requests"] = sum(1 for p, _ in per.values() if p)
    out["preemptions"] = sum(p for p, _ in per.values())
    out["recompute_tokens"] = sum(t for _, t in per.values())
    out["per_request"] = {k: {"preemptions": p, "recompute_tokens": t}
                          for k, (p, t) in per.items() if p or t}
  if sampler is not None:
    columns = list(ResourceSampler.COLUMNS)
    s = np.asarray(sampler.samples, np.float64).reshape(-1, len(columns))
    out["timeseries"] = {"columns": columns, "every_steps": sampler.every,
                         "rows": [list(map(float, row)) for row in s]}
    if len(s):
      for name in ("kv_pages_live", "kv_pages_cached", "queue_len"):
        out[f"{name}_max"] = int(s[:, columns.index(name)].max())
  return out
