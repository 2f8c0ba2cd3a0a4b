"""Serving metrics: per-request records -> a vLLM-style benchmark report.

Definitions follow vLLM's `benchmark_serving` (key names and latency
definitions) with two changes the continuous-batching article (§0x07) asks for:

* Percentiles use the nearest-rank estimator `x_(ceil(p n))` and are gated by
  a sample contract: a p-th percentile is reported only when
  `n >= 1 / (1 - p)` (p50: 2, p90: 10, p95: 20, p99: 100). A gated value is
  None and its key is listed in `report["insufficient_sample"]`.
* A one-output request has no inter-output interval, so it has no TPOT (it is
  left out of the TPOT sample, never counted as TPOT = 0).

Latencies are measured from the request's original arrival (§0x07: nothing
restarts a clock at admission). All report latencies are in milliseconds;
record times are in seconds on one clock.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from serving.engine.config import OUTCOMES
LATENCY_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
DEFAULT_PERCENTILES = (90.0, 95.0, 99.0)


# --------------------------------------------------------------------------
# Percentiles with a sample contract


def _fraction(p: float) -> Fraction:
    """p percent as an exact fraction of 1 (Fraction(repr) avoids 0.07*100 != 7)."""
    f = Fraction(repr(float(p))) / 100
    if not (0 < f < 1):
        raise ValueError(f"percentile p={p} must be in (0, 100)")
    return f


def min_samples_for_percentile(p: float) -> int:
    """Smallest n for which the p-th percentile is reported: ceil(1 / (1 - p/100)).

    The article's reciprocal tail-mass rule (§0x07, "Tail Metrics Need A Sample
    Contract"): p50 -> 2, p90 -> 10, p95 -> 20, p99 -> 100, p99.9 -> 1000.

    Raises:
      ValueError: p not in (0, 100).
    """
    return math.ceil(1 / (1 - _fraction(p)))


def percentile_nearest_rank(values: Sequence[float] | np.ndarray, p: float) -> float | None:
    """Nearest-rank p-th percentile `x_(ceil(p/100 * n))`, or None if n is too small.

    Args:
      values: f64[n] samples in any order (any unit; the result has the same).
      p: percentile in (0, 100), e.g. 50, 90, 95, 99.

    Returns:
      An observed sample, or None when n < `min_samples_for_percentile(p)`
      (the caller reports it as insufficient_sample).

    Raises:
      ValueError: p not in (0, 100), or a value is NaN.
    """
    x = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if np.isnan(x).any():
        raise ValueError("percentile of a sample containing NaN")
    n = x.size
    if n < min_samples_for_percentile(p):
        return None
    rank = math.ceil(_fraction(p) * n)  # 1-based
    return float(x[rank - 1])


# --------------------------------------------------------------------------
# Per-request record


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """What happened to one offered request.

    Attributes:
      request_id: unique within a run.
      client: tenant name.
      arrival_s: original arrival time (s), the origin of TTFT and E2EL.
      first_token_s: emission time of the first output token (s), or None if
        none was emitted; equals token_times_s[0] when tokens exist.
      token_times_s: f64[output_tokens] emission time of every output token
        (s), non-decreasing, all >= arrival_s.
      prompt_tokens: prompt length served (tokens).
      output_tokens: output tokens emitted (tokens) == len(token_times_s).
      outcome: one of "completed", "failed", "rejected", "cancelled".
      finish_reason: e.g. "length", "stop", "abort", a rejection reason; free text.
      num_preemptions: times the request was preempted and later resumed.
      clipped: the workload cut this request's prompt.
      output_token_ids: int[output_tokens] the emitted token ids (empty when
        the producer did not record them); replays compare them bit for bit.
      recompute_tokens: KV rows recomputed after its preemptions (tokens).
      slo_ttft_ms, slo_tpot_ms: the request's declared SLO limits (ms), None
        for none; ``goodput(per_request=True)`` judges it by them.
      prefix_hit_tokens: prompt tokens served from the prefix cache at
        admission (whole KV pages; 0 without caching).
      num_extensions: §0x06 extensions: decode rows past the request's KV
        reservation that took a new page.

    Raises (on construction):
      ValueError: unknown outcome, inconsistent token times, or a completed
        request without output tokens.
    """

    request_id: str
    client: str
    arrival_s: float
    first_token_s: float | None
    token_times_s: tuple[float, ...]
    prompt_tokens: int
    output_tokens: int
    outcome: str
    finish_reason: str | None = None
    num_preemptions: int = 0
    clipped: bool = False
    output_token_ids: tuple[int, ...] = ()
    recompute_tokens: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    prefix_hit_tokens: int = 0
    num_extensions: int = 0

    def __post_init__(self):
        object.__setattr__(self, "token_times_s", tuple(float(t) for t in self.token_times_s))
        object.__setattr__(self, "output_token_ids", tuple(int(t) for t in self.output_token_ids))
        rid, times = self.request_id, self.token_times_s
        if self.outcome not in OUTCOMES:
            raise ValueError(f"{rid}: outcome={self.outcome!r} not in {OUTCOMES}")
        if self.output_tokens != len(times):
            raise ValueError(
                f"{rid}: output_tokens={self.output_tokens} but {len(times)} token times")
        if self.prompt_tokens < 0 or self.num_preemptions < 0:
            raise ValueError(f"{rid}: negative prompt_tokens or num_preemptions")
        if self.output_token_ids and len(self.output_token_ids) != self.output_tokens:
            raise ValueError(f"{rid}: {len(self.output_token_ids)} output_token_ids but "
                             f"output_tokens={self.output_tokens}")
        if times:
            if self.first_token_s != times[0]:
                raise ValueError(f"{rid}: first_token_s={self.first_token_s} "
                                 f"!= token_times_s[0]={times[0]}")
            if times[0] < self.arrival_s:
                raise ValueError(
                    f"{rid}: first token at {times[0]} s before arrival {self.arrival_s} s")
            if any(b < a for a, b in zip(times, times[1:])):
                raise ValueError(f"{rid}: token_times_s not non-decreasing")
        elif self.first_token_s is not None:
            raise ValueError(f"{rid}: first_token_s set but no token times")
        if self.outcome == "completed" and not times:
            raise ValueError(f"{rid}: completed with no output tokens")

    @property
    def ttft_s(self) -> float | None:
        """First token time - arrival (s); None without output."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2el_s(self) -> float | None:
        """Last token time - arrival (s); None without output."""
        return self.token_times_s[-1] - self.arrival_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """(e2el - ttft) / (output_tokens - 1) (s); None for <= 1 output token (§0x07)."""
        if self.output_tokens < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> tuple[float, ...]:
        """Gaps between consecutive output tokens (s), output_tokens - 1 of them."""
        t = self.token_times_s
        return tuple(b - a for a, b in zip(t, t[1:]))


# --------------------------------------------------------------------------
# Report


def _check_partition(records: Sequence[RequestRecord], num_offered: int | None) -> dict[str, int]:
    ids = [r.request_id for r in records]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(f"duplicate request ids in records: {dup}")
    counts = {o: sum(r.outcome == o for r in records) for o in OUTCOMES}
    offered = len(records) if num_offered is None else num_offered
    if sum(counts.values()) != offered:
        raise ValueError(
            f"outcome partition does not close: completed+failed+rejected+cancelled = "
            f"{sum(counts.values())} ({counts}) != {offered} offered requests"
        )
    return counts


def _summarize(name: str, samples: Sequence[float], percentiles: Sequence[float],
               report: dict, gated: list[str]) -> None:
    """Adds mean/median/std/p* of `samples` (ms) to report under vLLM key names."""
    x = np.asarray(samples, dtype=np.float64)
    report[f"mean_{name}"] = float(x.mean()) if x.size else None
    report[f"std_{name}"] = float(x.std()) if x.size else None
    if not x.size:
        gated.extend([f"mean_{name}", f"std_{name}"])
    report[f"median_{name}"] = percentile_nearest_rank(x, 50)
    if report[f"median_{name}"] is None:
        gated.append(f"median_{name}")
    for p in percentiles:
        key = f"p{p:g}_{name}"
        report[key] = percentile_nearest_rank(x, p)
        if report[key] is None:
            gated.append(key)
    report[f"num_samples_{name}"] = int(x.size)


def build_report(
    records: Iterable[RequestRecord],
    duration_s: float,
    config: dict | None = None,
    *,
    num_offered: int | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict:
    """A JSON-ready benchmark report with vLLM `benchmark_serving` key names.

    Over COMPLETED requests (vLLM): `total_input_tokens`, `total_output_tokens`,
    `request_throughput` (req/s), `output_throughput` and
    `total_token_throughput` (tokens/s), all divided by `duration_s`; and for
    X in ttft_ms, tpot_ms, itl_ms, e2el_ms: `mean_X`, `std_X`, `median_X`,
    `p<P>_X` for P in `percentiles`, and `num_samples_X`.
      TTFT = first token - arrival; E2EL = last token - arrival;
      TPOT = (E2EL - TTFT) / (output_tokens - 1), only for > 1 output token;
      ITL  = every gap between consecutive output tokens, pooled.
    Gated or empty statistics are None and named in `insufficient_sample`.
    `requests` lists every record (arrival, first-token and every token time
    in s, tokens in/out, outcome, reason, preemptions).

    Args:
      records: one per offered request.
      duration_s: benchmark wall time (s), > 0.
      config: echoed under "config" (engine/workload description).
      num_offered: if given, the partition must close against it (e.g. the
        workload's length), catching records lost by the engine.
      percentiles: tail percentiles to report, each in (0, 100).

    Raises:
      ValueError: duration_s <= 0, duplicate request ids, or
        completed + failed + rejected + cancelled != offered requests.
    """
    records = list(records)
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s={duration_s} must be finite and > 0")
    counts = _check_partition(records, num_offered)
    done = [r for r in records if r.outcome == "completed"]
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    report: dict = {
        "num_requests": len(records),
        **counts,
        "duration_s": float(duration_s),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "num_preemptions": sum(r.num_preemptions for r in records),
        "num_extensions": sum(r.num_extensions for r in records),
        "num_clipped": sum(r.clipped for r in records),
    }
    samples = {
        "ttft_ms": [r.ttft_s * 1e3 for r in done],
        "tpot_ms": [r.tpot_s * 1e3 for r in done if r.tpot_s is not None],
        "itl_ms": [g * 1e3 for r in done for g in r.itls_s],
        "e2el_ms": [r.e2el_s * 1e3 for r in done],
    }
    gated: list[str] = []
    for name in LATENCY_METRICS:
        _summarize(name, samples[name], percentiles, report, gated)
    report["insufficient_sample"] = gated
    report["percentile_method"] = "nearest_rank, reported when n >= ceil(1/(1-p))"
    report["config"] = dict(config or {})
    report["requests"] = [_record_dict(r) for r in records]
    return report


def _record_dict(r: RequestRecord) -> dict:
    """One request's line of the report (times in s from the replay start);
    its fields are scalars and tuples of scalars (no ``asdict`` deep copy)."""
    out = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
    out["token_times_s"] = list(r.token_times_s)
    out["output_token_ids"] = list(r.output_token_ids)
    return out


_ON_LIMIT_TOLERANCE_MS = 1e-6      # 1 ns: a metric exactly on its limit passes


def slo_outcome(r: RequestRecord, *, ttft_ms=None, tpot_ms=None, e2el_ms=None,
                per_request: bool = False, horizon_s: float | None = None) -> str:
    """One request's judgement (``goodput``'s, the ledger's partition): its
    outcome unless "completed"; "open_at_horizon" when its last token comes
    after ``horizon_s``; "valid" when every limit holds, else "completed_miss"."""
    if r.outcome != "completed":
        return r.outcome
    if horizon_s is not None and (not r.token_times_s or r.token_times_s[-1] > horizon_s):
        return "open_at_horizon"
    ttft = r.slo_ttft_ms if per_request and r.slo_ttft_ms is not None else ttft_ms
    tpot = r.slo_tpot_ms if per_request and r.slo_tpot_ms is not None else tpot_ms
    over = lambda value_s, limit_ms: value_s * 1e3 > limit_ms + _ON_LIMIT_TOLERANCE_MS
    if ((ttft is not None and over(r.ttft_s, ttft))
            or (tpot is not None and r.tpot_s is not None and over(r.tpot_s, tpot))
            or (e2el_ms is not None and over(r.e2el_s, e2el_ms))):
        return "completed_miss"
    return "valid"


def goodput(
    records: Iterable[RequestRecord],
    *,
    ttft_ms: float | None = None,
    tpot_ms: float | None = None,
    e2el_ms: float | None = None,
    duration_s: float | None = None,
    per_request: bool = False,
    horizon_s: float | None = None,
) -> dict:
    """Request-level SLO goodput and its three attainment denominators (§0x07).

    A request is SLO-valid when it completed and every given limit holds
    (metric <= limit, as vLLM's goodput): TTFT from original arrival, TPOT
    only where defined (a one-output request passes it vacuously), E2EL;
    with ``per_request=True`` its own ``slo_ttft_ms`` / ``slo_tpot_ms`` first
    (no limit at all: valid on completion); with ``horizon_s`` (s) its last
    token by then (else open at the horizon, ``ledger.classify``: missed).

    Returns counts `offered, admitted, completed, valid, missed, rejected,
    other` (other = failed + cancelled; offered = valid + missed + rejected
    + other), `offered_attainment` (valid/offered), `admitted_attainment`
    (valid/admitted), `completion_conditioned_attainment` (valid/completed,
    diagnostic), each None on a zero denominator; with duration_s,
    `request_goodput` (valid/s) and `token_goodput` (output tokens of valid
    requests per s); `slo`, the limits and rules used.

    Raises:
      ValueError: no limit given, duration_s <= 0, duplicate request ids.
    """
    if ttft_ms is None and tpot_ms is None and e2el_ms is None and not per_request:
        raise ValueError("goodput needs at least one of ttft_ms, tpot_ms, e2el_ms "
                         "(or per_request=True)")
    records = list(records)
    counts = _check_partition(records, None)
    good = [r for r in records if slo_outcome(
        r, ttft_ms=ttft_ms, tpot_ms=tpot_ms, e2el_ms=e2el_ms, per_request=per_request,
        horizon_s=horizon_s) == "valid"]
    offered, completed = len(records), counts["completed"]
    admitted = offered - counts["rejected"]

    def ratio(a: int, b: int) -> float | None:
        return a / b if b else None

    out = {
        "slo": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "e2el_ms": e2el_ms,
                "per_request": per_request, "horizon_s": horizon_s},
        "offered": offered,
        "admitted": admitted,
        "completed": completed,
        "valid": len(good),
        "missed": completed - len(good),
        "rejected": counts["rejected"],
        "other": counts["failed"] + counts["cancelled"],
        "offered_attainment": ratio(len(good), offered),
        "admitted_attainment": ratio(len(good), admitted),
        "completion_conditioned_attainment": ratio(len(good), completed),
    }
    if duration_s is not None:
        if not (math.isfinite(duration_s) and duration_s > 0):
            raise ValueError(f"duration_s={duration_s} must be finite and > 0")
        out["request_goodput"] = len(good) / duration_s
        out["token_goodput"] = sum(r.output_tokens for r in good) / duration_s
    return out


# --------------------------------------------------------------------------
# Client service gap (VTC fairness)


@dataclasses.dataclass(frozen=True)
class ServiceGap:
    """The largest weighted-service difference two clients accumulated while
    both were backlogged (see `client_service_gap`).

    Attributes:
      gap: weighted tokens (w_p * prompt tokens + w_q * output tokens); 0 when
        no two clients were ever backlogged together.
      pair: (leader, trailer), the clients of the worst pair, the leader being
        the one that received `gap` more; None when gap is 0.
      window_s: (t1, t2) (s): the leader's lead grew by `gap` from t1 (before
        the charges at t1 if the joint interval starts there, after them
        otherwise) to t2 (after its charges); None when gap is 0.
    """

    gap: float
    pair: tuple[str, str] | None
    window_s: tuple[float, float] | None


def _backlog_intervals(records: Sequence[RequestRecord]) -> dict[str, list[tuple[float, float]]]:
    """Per client, the merged closed intervals [start, end] (s) in which it
    has a request that arrived and has not ended."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        if r.outcome == "rejected":
            continue  # refused: it never waited for service
        end = r.token_times_s[-1] if r.token_times_s else math.inf
        spans.setdefault(r.client, []).append((r.arrival_s, end))
    merged = {}
    for client, items in spans.items():
        out: list[list[float]] = []
        for start, end in sorted(items):
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        merged[client] = [(a, b) for a, b in out]
    return merged


def client_service_gap(records: Iterable[RequestRecord], *, w_p: float = 1.0,
                       w_q: float = 2.0) -> ServiceGap:
    """Per-client service gap of a run: max over client pairs (f, g) and
    sub-intervals [t1, t2] in which both are continuously backlogged of
    |W_f(t1, t2) - W_g(t1, t2)|.

    Service follows VTC (Sheng et al., "Fairness in Serving Large Language
    Models", OSDI 2024; the article's §0x09A): W_c(t1, t2) =
    w_p * n_p + w_q * n_q, with a request's prompt tokens n_p charged at its
    first-token time and each output token charged at its emission time
    (charges at t1 and t2 count). Within one maximal interval in which both
    clients are backlogged this is max D - min D of D(t) = W_f(t) - W_g(t),
    taking D just before the interval starts as one of the values; it is the
    quantity VTC's Theorem 4.4 bounds by 2U (`serving.harness.service_gap`).

    A client is backlogged at t when one of its requests has arrival_s <= t
    and has not ended; a request ends at its last token time (closed
    interval). A request without tokens never ends (the records carry no end
    time), except a `rejected` one, which is never backlogged. Service of a
    preempted request's recomputed prompt is not charged again.

    One sweep over the event times; each time touches only the pairs of the
    clients whose state changed, so the cost is O(events x clients).

    Args:
      records: the run's requests (times in s on one clock).
      w_p: weight of one prompt token (>= 0).
      w_q: weight of one output token (>= 0).

    Returns:
      A ServiceGap (gap in weighted tokens).

    Raises:
      ValueError: a negative or non-finite weight.
    """
    for name, w in (("w_p", w_p), ("w_q", w_q)):
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"client_service_gap: {name}={w} must be finite and >= 0")
    records = list(records)
    if len({r.client for r in records}) < 2:
        return ServiceGap(0.0, None, None)     # no pair of clients (a trace's one client)
    # time -> (clients opening, {client: charge}, clients closing)
    events: dict[float, tuple[list[str], dict[str, float], list[str]]] = {}

    def at(t: float):
        return events.setdefault(t, ([], {}, []))

    for client, spans in _backlog_intervals(records).items():
        for start, end in spans:
            at(start)[0].append(client)
            if end != math.inf:
                at(end)[2].append(client)
    for r in records:
        for i, t in enumerate(r.token_times_s):
            charges = at(t)[1]
            prompt_charge = w_p * r.prompt_tokens if i == 0 else 0.0
            charges[r.client] = charges.get(r.client, 0.0) + w_q + prompt_charge

    service: dict[str, float] = {}
    active: set[str] = set()
    # (f, g) with f < g -> [lo, lo_t, hi, hi_t] of D = W_f - W_g in the current joint interval
    pairs: dict[tuple[str, str], list[float]] = {}
    best = ServiceGap(0.0, None, None)

    def key(c: str, d: str) -> tuple[tuple[str, str], float]:
        f, g = (c, d) if c < d else (d, c)
        return (f, g), service.get(f, 0.0) - service.get(g, 0.0)

    for t in sorted(events):
        opening, charges, closing = events[t]
        for c in opening:
            for d in active:
                k, diff = key(c, d)
                pairs[k] = [diff, t, diff, t]   # D just before the charges at t
            active.add(c)
        for c, amount in charges.items():
            service[c] = service.get(c, 0.0) + amount
        for c in charges:
            for d in active:
                if d == c:
                    continue
                k, diff = key(c, d)
                lo, lo_t, hi, hi_t = pairs[k]
                if diff - lo > best.gap:       # f pulled ahead of g since lo_t
                    best = ServiceGap(diff - lo, k, (lo_t, t))
                if hi - diff > best.gap:       # g pulled ahead of f since hi_t
                    best = ServiceGap(hi - diff, (k[1], k[0]), (hi_t, t))
                if diff < lo:
                    pairs[k][0:2] = [diff, t]
                if diff > hi:
                    pairs[k][2:4] = [diff, t]
        for c in closing:
            active.discard(c)
            for d in active:
                pairs.pop(key(c, d)[0], None)
    return best


# --------------------------------------------------------------------------
# Output


def write_report(path: str | Path, report: dict) -> None:
    """Writes `report` as indented JSON (NaN/inf rejected), creating parent
    dirs; its top-level `requests`, one a line (json's fast encoder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dump = functools.partial(json.dumps, sort_keys=False, allow_nan=False)
    requests, key = report.get("requests"), '\n  "requests": '
    text = dump({**report, "requests": None} if requests else report, indent=2)
    if requests:    # the top-level key: nested keys are indented further
        rows = ",\n".join("    " + dump(r) for r in requests)
        text = text.replace(key + "null", key + "[\n" + rows + "\n  ]", 1)
    path.write_text(text + "\n")


__all__ = [
    "DEFAULT_PERCENTILES", "LATENCY_METRICS", "OUTCOMES", "RequestRecord", "ServiceGap",
    "build_report", "client_service_gap", "goodput",
    "min_samples_for_percentile", "percentile_nearest_rank", "write_report"
]
