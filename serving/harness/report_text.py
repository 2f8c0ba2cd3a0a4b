"""The printed lines of a serving report (``metrics.build_report``):
vLLM's fixed-width table, why requests were rejected, goodput and
speculative decoding's counters, numbers as ``number_text`` writes them
(as scripts/compare.py prints them)."""

from __future__ import annotations

import re
from typing import Sequence

from serving.harness.metrics import LATENCY_METRICS


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(report: dict) -> str:
    """A fixed-width text table of a `build_report` result, like vLLM's printout.

    Gated statistics print as "n/a (n=<samples>)".
    """
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(label: str, value, digits: int = 2):
        lines.append(f"{label:<40}{_fmt(value, digits):>10}")

    row("Successful requests:", report["completed"])
    row("Failed requests:", report["failed"])
    row("Rejected requests:", report["rejected"])
    row("Cancelled requests:", report["cancelled"])
    row("Benchmark duration (s):", report["duration_s"])
    row("Total input tokens:", report["total_input_tokens"])
    row("Total generated tokens:", report["total_output_tokens"])
    row("Request throughput (req/s):", report["request_throughput"])
    row("Output token throughput (tok/s):", report["output_throughput"])
    row("Total token throughput (tok/s):", report["total_token_throughput"])
    row("Preemptions:", report.get("num_preemptions"))
    row("KV extensions:", report.get("num_extensions"))
    titles = {"ttft_ms": ("Time to First Token", "TTFT"),
              "tpot_ms": ("Time per Output Token (excl. 1st token)", "TPOT"),
              "itl_ms": ("Inter-token Latency", "ITL"),
              "e2el_ms": ("End-to-end Latency", "E2EL")}
    for name in LATENCY_METRICS:
        title, short = titles[name]
        lines.append(title.center(width, "-"))
        n = report.get(f"num_samples_{name}")
        stats = [k for k in report
                 if k.endswith(f"_{name}") and not k.startswith(("num_samples_", "std_"))]
        for key in stats:
            stat = key[: -len(name) - 1]
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            value = report[key]
            text = _fmt(value) if value is not None else f"n/a (n={n})"
            lines.append(f"{label + ' ' + short + ' (ms):':<40}{text:>10}")
    lines.append("=" * width)
    if report.get("insufficient_sample"):
        lines.append("insufficient_sample: " + ", ".join(report["insufficient_sample"]))
    return "\n".join(lines)


# A number in a reason's text (not one inside a word, as in "smollm2").
_NUMBER = re.compile(r"\b\d+(?:\.\d+)?\b")


def _one_text(reasons: Sequence[str]) -> str:
    """One text for reasons that differ only in their numbers: a number
    every reason has the same stays as it is, one that differs becomes
    ``"LO to HI"`` (smallest and largest of them), and one after "at least"
    the largest (the bound that holds for every reason)."""
    pieces = _NUMBER.split(reasons[0])
    columns = zip(*(_NUMBER.findall(r) for r in reasons))
    numbers = []
    for before, column in zip(pieces, columns):
        lo, hi = min(column, key=float), max(column, key=float)
        if before.endswith("at least "):
            numbers.append(hi)
        else:
            numbers.append(lo if lo == hi else f"{lo} to {hi}")
    return pieces[0] + "".join(n + p for n, p in zip(numbers, pieces[1:]))


def format_rejections(report: dict) -> str:
    """Why the requests of a `build_report` result were rejected: one line
    per reason, the most frequent first, ``"rejected N of TOTAL: REASON"``,
    the reason the records' ``finish_reason``. Reasons that differ only in
    their numbers (``"needs 36 KV pages ..."``, ``"needs 17 KV pages ..."``)
    are one line, each number that differs given as its range
    (``"needs 17 to 36 KV pages ..."``). When every request was rejected the
    first line says so. "" when none was.
    """
    rejected = [r.get("finish_reason") or "no reason given"
                for r in report["requests"] if r["outcome"] == "rejected"]
    kinds: dict[str, list[str]] = {}        # reason with numbers masked -> reasons
    for reason in rejected:
        kinds.setdefault(_NUMBER.sub("#", reason), []).append(reason)
    total = report["num_requests"]
    lines = []
    for reasons in sorted(kinds.values(), key=len, reverse=True):   # stable: first seen first
        every = ""
        if not lines and len(rejected) == total:
            every = (" (every request was rejected)" if len(kinds) == 1 else
                     f" (every request was rejected, for {len(kinds)} reasons)")
        lines.append(f"rejected {len(reasons)} of {total}{every}: {_one_text(reasons)}")
    return "\n".join(lines)


def number_text(value, digits: int = 4) -> str:
    """``value`` for a line of text: None as ``"n/a"``, an int as it is, a
    float to ``digits`` significant digits (0.09424083769633508 ->
    ``"0.09424"``, 2356.1228521072185 -> ``"2356"``), a float with more
    integer digits than that rounded to an integer (123456.7 -> ``"123457"``)."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        text = f"{value:.{digits}g}"
        return f"{value:.0f}" if "e+" in text else text
    return str(value)


def format_goodput(g: dict) -> str:
    """One line of a `goodput` result: SLO-valid requests, request goodput
    and the three attainments, numbers to 4 significant digits
    (`number_text`, as scripts/compare.py prints them)."""
    return (f"goodput: {g['valid']}/{g['offered']} SLO-valid, "
            f"{number_text(g.get('request_goodput'))} req/s; attainment offered "
            f"{number_text(g['offered_attainment'])}, admitted "
            f"{number_text(g['admitted_attainment'])}, completion-conditioned "
            f"{number_text(g['completion_conditioned_attainment'])}")


def format_spec_decode(stats: dict, speculative: str) -> str:
    """One line of speculative decoding's counters (``SpecCounts.stats``:
    the report's ``engine_outcomes["spec_decode"]``) under the setting
    ``speculative``: decode rows that drafted, draft tokens verified, those
    accepted, and the acceptance rate (accepted / draft tokens, to 4
    significant digits; n/a before any draft)."""
    drafted = stats["num_draft_tokens"]
    rate = stats["num_accepted_tokens"] / drafted if drafted else None
    return (f"speculative decoding {speculative}: {stats['num_drafts']} drafts, "
            f"{drafted} draft tokens, {stats['num_accepted_tokens']} accepted, "
            f"acceptance rate {number_text(rate)}")
