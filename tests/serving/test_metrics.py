"""Metrics: nearest-rank percentiles with sample gates, vLLM-style report, goodput."""

import json

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.harness import service_gap
from serving.harness.metrics import (
    RequestRecord,
    ServiceGap,
    build_report,
    client_service_gap,
    goodput,
    min_samples_for_percentile,
    percentile_nearest_rank,
    write_report,
)
from serving.harness.report_text import (
    format_goodput,
    format_rejections,
    format_spec_decode,
    format_table,
)


def _rec(rid, arrival_s, times, outcome="completed", prompt_tokens=10, **kw):
    return RequestRecord(
        request_id=rid, client=kw.pop("client", "default"), arrival_s=arrival_s,
        first_token_s=times[0] if times else None, token_times_s=tuple(times),
        prompt_tokens=prompt_tokens, output_tokens=len(times), outcome=outcome, **kw,
    )


def _example():
    """Hand-worked example (times in s).

    A: arrival 0, tokens 0.10 0.15 0.25 0.30 -> TTFT 100, E2EL 300,
       TPOT (300-100)/3 = 66.67, ITL 50 100 50 (ms).
    B: arrival 1, one token at 1.2 -> TTFT 200, E2EL 200, no TPOT, no ITL.
    C: arrival 2, tokens 2.05 2.25 -> TTFT 50, E2EL 250, TPOT 200, ITL 200.
    D: rejected. E: cancelled after one token (left out of latency stats).
    """
    return [
        _rec("A", 0.0, [0.10, 0.15, 0.25, 0.30], prompt_tokens=10, num_preemptions=1),
        _rec("B", 1.0, [1.2], prompt_tokens=20),
        _rec("C", 2.0, [2.05, 2.25], prompt_tokens=30, clipped=True),
        _rec("D", 2.5, [], outcome="rejected", prompt_tokens=40, finish_reason="queue_full"),
        _rec("E", 3.0, [3.1], outcome="cancelled", prompt_tokens=50, finish_reason="abort"),
    ]


@pytest.mark.parametrize("p,n", [(50, 2), (90, 10), (95, 20), (99, 100), (99.9, 1000), (75, 4)])
def test_sample_gate_is_reciprocal_tail_mass(p, n):
    assert min_samples_for_percentile(p) == n
    assert percentile_nearest_rank(list(range(n - 1)), p) is None
    assert percentile_nearest_rank(list(range(n)), p) is not None


def test_nearest_rank_values():
    assert percentile_nearest_rank([5.0], 50) is None
    assert percentile_nearest_rank([2.0, 1.0], 50) == 1.0  # rank ceil(1.0) = 1
    assert percentile_nearest_rank([4, 1, 3, 2, 5], 50) == 3.0  # rank ceil(2.5) = 3
    assert percentile_nearest_rank(range(1, 11), 90) == 9.0
    values = list(range(1, 101))
    assert percentile_nearest_rank(values, 99) == 99.0
    # 7/100*100 is 7.000000000000001 in floats; the rank must still be 7.
    assert percentile_nearest_rank(values, 7) == 7.0
    for bad in (0, 100, -1, 101):
        with pytest.raises(ValueError):
            percentile_nearest_rank(values, bad)
    with pytest.raises(ValueError, match="NaN"):
        percentile_nearest_rank([1.0, float("nan")], 50)


def test_article_tail_probe():
    values = [10.0] * 98 + [500.0] * 2
    assert sum(values) / len(values) == pytest.approx(19.8)
    assert percentile_nearest_rank(values, 95) == 10.0
    assert percentile_nearest_rank(values, 99) == 500.0
    assert percentile_nearest_rank(values[:99], 99) is None  # n = 99 < 100


def test_report_on_hand_example():
    r = build_report(_example(), duration_s=4.0, config={"policy": "fcfs"}, num_offered=5)
    assert (r["completed"], r["failed"], r["rejected"], r["cancelled"]) == (3, 0, 1, 1)
    assert r["num_requests"] == 5
    assert r["total_input_tokens"] == 60 and r["total_output_tokens"] == 7
    assert r["request_throughput"] == 0.75
    assert r["output_throughput"] == 1.75
    assert r["total_token_throughput"] == 16.75
    assert r["num_preemptions"] == 1 and r["num_clipped"] == 1
    approx = pytest.approx
    assert r["mean_ttft_ms"] == approx(350 / 3) and r["median_ttft_ms"] == approx(100)
    assert r["mean_e2el_ms"] == approx(250) and r["median_e2el_ms"] == approx(250)
    # TPOT: B (one output) is excluded, never counted as 0.
    assert r["num_samples_tpot_ms"] == 2
    assert r["mean_tpot_ms"] == approx((200 / 3 + 200) / 2)
    assert r["median_tpot_ms"] == approx(200 / 3)
    # ITL pools every gap: 50, 100, 50, 200.
    assert r["num_samples_itl_ms"] == 4
    assert r["mean_itl_ms"] == approx(100) and r["median_itl_ms"] == approx(50)
    assert r["std_itl_ms"] == approx((((50 - 100) ** 2 * 2 + 0 + 100 ** 2) / 4) ** 0.5)
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        for p in ("p90", "p95", "p99"):
            assert r[f"{p}_{name}"] is None
            assert f"{p}_{name}" in r["insufficient_sample"]
    assert "median_ttft_ms" not in r["insufficient_sample"]
    assert r["config"] == {"policy": "fcfs"}


def test_report_percentiles_once_sample_is_large_enough():
    # 100 requests; request i has TTFT 10 ms except two of 500 ms (the tail probe).
    records = [_rec(f"r{i}", float(i), [i + (0.5 if i >= 98 else 0.01), i + 0.6])
               for i in range(100)]
    r = build_report(records, duration_s=100.0)
    assert r["mean_ttft_ms"] == pytest.approx(19.8)
    assert r["p90_ttft_ms"] == pytest.approx(10) and r["p95_ttft_ms"] == pytest.approx(10)
    assert r["p99_ttft_ms"] == pytest.approx(500)
    assert r["insufficient_sample"] == []


def test_partition_must_close():
    records = _example()
    with pytest.raises(ValueError, match="partition does not close"):
        build_report(records, duration_s=4.0, num_offered=6)
    with pytest.raises(ValueError, match="duplicate request ids"):
        build_report(records + [records[0]], duration_s=4.0)
    with pytest.raises(ValueError, match="duration_s"):
        build_report(records, duration_s=0.0)


def test_record_validation():
    with pytest.raises(ValueError, match="outcome"):
        _rec("x", 0.0, [1.0], outcome="done")
    with pytest.raises(ValueError, match="completed with no output"):
        _rec("x", 0.0, [])
    with pytest.raises(ValueError, match="before arrival"):
        _rec("x", 1.0, [0.5])
    with pytest.raises(ValueError, match="non-decreasing"):
        _rec("x", 0.0, [1.0, 0.5])
    with pytest.raises(ValueError, match="output_tokens"):
        RequestRecord("x", "c", 0.0, 1.0, (1.0,), 3, 2, "completed")
    with pytest.raises(ValueError, match="first_token_s"):
        RequestRecord("x", "c", 0.0, 0.9, (1.0,), 3, 1, "completed")
    with pytest.raises(ValueError, match="2 output_token_ids but output_tokens=1"):
        RequestRecord("x", "c", 0.0, 1.0, (1.0,), 3, 1, "completed",
                      output_token_ids=(7, 8))


def test_report_with_no_completion_gates_everything():
    r = build_report([_rec("a", 0.0, [], outcome="rejected"), _rec("b", 0.0, [], outcome="failed")],
                     duration_s=1.0)
    assert (r["completed"], r["failed"], r["rejected"]) == (0, 1, 1)
    assert r["request_throughput"] == 0.0
    assert r["mean_ttft_ms"] is None and "mean_ttft_ms" in r["insufficient_sample"]


def test_goodput_line_rounds_to_4_significant_digits():
    """replay.py's goodput line: 1/3 prints as 0.3333, not 0.3333333333333333."""
    g = goodput(_example(), ttft_ms=150, tpot_ms=100, duration_s=3.0)
    assert format_goodput(g) == ("goodput: 1/5 SLO-valid, 0.3333 req/s; attainment offered "
                                 "0.2, admitted 0.25, completion-conditioned 0.3333")
    g = dict(g, offered_attainment=0.09424083769633508, admitted_attainment=None)
    assert "attainment offered 0.09424, admitted n/a," in format_goodput(g)


def test_spec_decode_line_gives_the_counts_and_the_rate_of_accepted_draft_tokens():
    """generate.py's and replay.py's speculation line: 10 of 28 draft tokens
    accepted is 0.3571; no draft yet has no rate (not 0)."""
    stats = {"num_drafts": 15, "num_draft_tokens": 28, "num_accepted_tokens": 10,
             "accepted_per_pos": [7, 3], "acceptance_rate": 10 / 28}
    assert format_spec_decode(stats, "ngram:k=2") == (
        "speculative decoding ngram:k=2: 15 drafts, 28 draft tokens, 10 accepted, "
        "acceptance rate 0.3571")
    none = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
            "accepted_per_pos": [0, 0, 0, 0], "acceptance_rate": 0.0}
    assert format_spec_decode(none, "ngram:k=4,n=3") == (
        "speculative decoding ngram:k=4,n=3: 0 drafts, 0 draft tokens, 0 accepted, "
        "acceptance rate n/a")


def test_goodput_denominators_on_hand_example():
    g = goodput(_example(), ttft_ms=150, tpot_ms=100, duration_s=4.0)
    # A valid; B misses TTFT (200); C misses TPOT (200); D rejected; E cancelled.
    assert (g["offered"], g["admitted"], g["completed"]) == (5, 4, 3)
    assert (g["valid"], g["missed"], g["rejected"], g["other"]) == (1, 2, 1, 1)
    assert g["offered"] == g["valid"] + g["missed"] + g["rejected"] + g["other"]
    assert g["offered_attainment"] == 0.2
    assert g["admitted_attainment"] == 0.25
    assert g["completion_conditioned_attainment"] == pytest.approx(1 / 3)
    assert g["request_goodput"] == 0.25 and g["token_goodput"] == 1.0
    # One-output B has no TPOT: a TPOT-only SLO cannot fail it.
    assert goodput(_example(), tpot_ms=1.0)["valid"] == 1
    assert goodput(_example(), e2el_ms=250)["valid"] == 2  # B 200, C 250 (<= limit)
    with pytest.raises(ValueError, match="at least one"):
        goodput(_example())


def test_goodput_article_saturation_fixture():
    # §0x07: 240 offered, 118 rejected, the 122 completed all meet the SLO.
    records = [_rec(f"ok{i}", 0.0, [0.01, 0.02]) for i in range(122)]
    records += [_rec(f"rej{i}", 0.0, [], outcome="rejected") for i in range(118)]
    g = goodput(records, ttft_ms=30, tpot_ms=20)
    assert g["completion_conditioned_attainment"] == 1.0
    assert round(100 * g["offered_attainment"], 3) == 50.833


def test_format_table_and_json(tmp_path):
    r = build_report(_example(), duration_s=4.0, config={"policy": "fcfs"})
    text = format_table(r)
    lines = text.splitlines()
    assert "Successful requests:" in lines[1] and lines[1].endswith(" 3")
    assert f"{'Mean TTFT (ms):':<40}{'116.67':>10}" in lines
    assert f"{'P99 TTFT (ms):':<40}{'n/a (n=3)':>10}" in lines
    assert f"{'Median TPOT (ms):':<40}{'66.67':>10}" in lines
    assert f"{'Median ITL (ms):':<40}{'50.00':>10}" in lines
    assert text.splitlines()[-1].startswith("insufficient_sample: p90_ttft_ms")
    path = tmp_path / "out" / "report.json"
    write_report(path, r)
    assert json.loads(path.read_text()) == r


def test_rejection_lines_count_each_reason_and_range_its_numbers():
    """One line per reason, the most frequent first; two reasons that differ
    in numbers only are one line, each differing number as its range (3 to
    12 compared as numbers, not as text), a shared one (9) as it is; the
    cancelled request is no rejection; every request rejected is said."""
    needs = "needs {} KV pages for {} KV rows (prompt + max_tokens - 1); the cache has 9"
    never = "policy fcfs can never schedule it (token budget 16, 9 KV pages)"
    records = [
        _rec("A", 0.0, [0.1, 0.2]),
        _rec("R1", 0.1, [], outcome="rejected", finish_reason=needs.format(12, 45)),
        _rec("R2", 0.2, [], outcome="rejected", finish_reason=never),
        _rec("R3", 0.3, [], outcome="rejected", finish_reason=needs.format(3, 10)),
        _rec("R4", 0.4, [], outcome="rejected"),
        _rec("E", 0.5, [0.6], outcome="cancelled", finish_reason="abort"),
    ]
    report = build_report(records, duration_s=1.0)
    assert format_rejections(report).splitlines() == [
        "rejected 2 of 6: " + needs.format("3 to 12", "10 to 45"),
        "rejected 1 of 6: " + never,
        "rejected 1 of 6: no reason given",
    ]
    assert format_rejections(build_report(records[:1], duration_s=1.0)) == ""
    every = build_report(records[1:4], duration_s=1.0)
    assert format_rejections(every).splitlines() == [
        "rejected 2 of 3 (every request was rejected, for 2 reasons): "
        + needs.format("3 to 12", "10 to 45"),
        "rejected 1 of 3: " + never,
    ]
    one = build_report(records[1:2], duration_s=1.0)
    assert format_rejections(one) == ("rejected 1 of 1 (every request was rejected): "
                                      + needs.format(12, 45))


def test_a_rejection_lines_at_least_bound_is_the_largest():
    """"raise num_pages ... to at least N" holds for every request of a line
    only at the largest N: that one is given, not a range."""
    needs = ("needs {} KV pages for {} KV rows (prompt + max_tokens - 1); the cache has 9 "
             "(num_pages 10 less page 0, the null page): raise num_pages (--num_pages) to at "
             "least {}")
    records = [_rec(f"R{n}", 0.1 * n, [], outcome="rejected",
                    finish_reason=needs.format(n, 16 * n - 5, n + 1)) for n in (36, 16, 20)]
    assert format_rejections(build_report(records, duration_s=1.0)) == (
        "rejected 3 of 3 (every request was rejected): " + needs.format("16 to 36", "251 to 571",
                                                                        37))


def test_goodput_metric_exactly_on_its_limit_passes():
    # 0.03 s of TTFT is 30.000000000000004 ms in binary floating point; a
    # request exactly on a 30 ms limit is SLO-valid, one 1 us over is not.
    on = _rec("on", 0.0, [0.03])
    over = _rec("over", 0.0, [0.030001])
    out = goodput([on, over], ttft_ms=30.0)
    assert out["valid"] == 1 and out["missed"] == 1


# --------------------------------------------------------------------------
# Client service gap


def _gap_example():
    """Hand-worked service gap (times in s, w_p = 1, w_q = 2).

    A: a1 arrives 0, prompt 3, tokens at 1, 2; a2 arrives 2.5, prompt 1, token at 4.
    B: b1 arrives 0.5, prompt 2, tokens at 3, 5; b2 arrives 5.5 and is rejected.
    Charges: A +5 at 1 (3 + 2), +2 at 2, +3 at 4 (1 + 2); B +4 at 3, +2 at 5.
    Backlogged: A on [0, 2] and [2.5, 4]; B on [0.5, 5] (b2 never waits).
    Joint interval [0.5, 2]: D = W_A - W_B is 0 before, 5 at 1, 7 at 2 -> 7 - 0 = 7
      (A ahead by 7 over [0.5, 2]).
    Joint interval [2.5, 4]: D is 7 at 2.5, 3 at 3, 6 at 4 -> 7 - 3 = 4
      (B ahead by 4 over [2.5, 3]).
    Gap = max(7, 4) = 7, pair (A, B), window (0.5, 2).
    Output tokens only (w_p = 0, w_q = 1): D 0, 1, 2 then 2, 1, 2 -> gap 2.
    """
    return [
        _rec("a1", 0.0, [1.0, 2.0], prompt_tokens=3, client="A"),
        _rec("a2", 2.5, [4.0], prompt_tokens=1, client="A"),
        _rec("b1", 0.5, [3.0, 5.0], prompt_tokens=2, client="B"),
        _rec("b2", 5.5, [], outcome="rejected", prompt_tokens=9, client="B"),
    ]


def test_service_gap_on_hand_example():
    assert client_service_gap(_gap_example()) == ServiceGap(7.0, ("A", "B"), (0.5, 2.0))
    out_only = client_service_gap(_gap_example(), w_p=0, w_q=1)
    assert out_only.gap == 2.0 and out_only.pair == ("A", "B")
    # Only the second joint interval: B leads by 4 from 2.5 to 3.
    late = [r for r in _gap_example() if r.request_id != "a1"]
    assert client_service_gap(late) == ServiceGap(4.0, ("B", "A"), (2.5, 3.0))


def test_service_gap_is_zero_without_overlap():
    # B arrives after A's last token; a rejected request of A in B's interval
    # does not make A backlogged.
    records = [
        _rec("a1", 0.0, [1.0, 2.0], prompt_tokens=50, client="A"),
        _rec("b1", 2.5, [3.0, 9.0], prompt_tokens=1, client="B"),
        _rec("a2", 4.0, [], outcome="rejected", client="A"),
    ]
    assert client_service_gap(records) == ServiceGap(0.0, None, None)
    assert client_service_gap([]) == ServiceGap(0.0, None, None)
    with pytest.raises(ValueError, match="w_q"):
        client_service_gap(records, w_q=-1)
    one = [_rec("a1", 0.0, [1.0, 2.0], client="A"), _rec("a2", 0.5, [3.0], client="A")]
    assert client_service_gap(one) == ServiceGap(0.0, None, None)    # no pair
    with pytest.raises(ValueError, match="w_p"):
        client_service_gap(one, w_p=math.nan)


def test_service_gap_unfinished_request_keeps_its_client_backlogged():
    # b1 never got a token (failed): B stays backlogged, so A's later service counts.
    records = [
        _rec("b1", 0.0, [], outcome="failed", client="B"),
        _rec("a1", 5.0, [6.0, 7.0], prompt_tokens=4, client="A"),
    ]
    assert client_service_gap(records) == ServiceGap(8.0, ("A", "B"), (5.0, 7.0))


def _flood(order):
    """§0x09A's client flood: A0..A7 and B0..B3 arrive at 0; event k of `order`
    (a client name) completes one request of that client at time k + 1: a
    zero-token prompt with one output token, 2 weighted units."""
    return [_rec(f"{c}{k}", 0.0, [k + 1.0], prompt_tokens=0, client=c)
            for k, c in enumerate(order)]


def test_service_gap_article_client_flood():
    assert client_service_gap(_flood("A" * 8 + "B" * 4)).gap == 16   # request FIFO
    assert client_service_gap(_flood("AB" * 4 + "A" * 4)).gap == 2    # least service


def _charges(records, w_p, w_q):
    """(time, client, weighted service) of every emitted token."""
    return [(t, r.client, w_q + (w_p * r.prompt_tokens if i == 0 else 0))
            for r in records for i, t in enumerate(r.token_times_s)]


def _brute_force_gap(records, w_p, w_q):
    """O(n^2) oracle: every pair, every [t1, t2] of event times in which both
    clients are backlogged throughout; service charged in [t1, t2]."""
    spans = {}
    for r in records:
        if r.outcome != "rejected":
            spans.setdefault(r.client, []).append(
                (r.arrival_s, r.token_times_s[-1] if r.token_times_s else math.inf))

    def covered(client, t1, t2):
        # Endpoints are integers (see _runs), so gaps between spans contain a
        # half-integer: checking those in [t1, t2] is exact.
        grid = [t1 + k / 2 for k in range(int(2 * (t2 - t1)) + 1)]
        return all(any(a <= t <= b for a, b in spans[client]) for t in grid)

    charges = _charges(records, w_p, w_q)
    times = sorted({t for t, _, _ in charges})
    best = 0.0
    for f, g in itertools.combinations(sorted(spans), 2):
        for t1, t2 in itertools.combinations_with_replacement(times, 2):
            if covered(f, t1, t2) and covered(g, t1, t2):
                d = sum(w * ((c == f) - (c == g)) for t, c, w in charges if t1 <= t <= t2)
                best = max(best, abs(d))
    return best


@st.composite
def _runs(draw):
    """Random runs on a coarse time grid (so events share times)."""
    records = []
    for i in range(draw(st.integers(1, 7))):
        client = draw(st.sampled_from("ABC"))
        arrival = draw(st.integers(0, 10))
        outcome = draw(st.sampled_from(["completed"] * 4 + ["rejected", "failed"]))
        n = 0 if outcome == "rejected" else draw(st.integers(0 if outcome == "failed" else 1, 4))
        times = sorted(draw(st.lists(st.integers(arrival, 14), min_size=n, max_size=n)))
        records.append(_rec(f"r{i}", float(arrival), [float(t) for t in times],
                            outcome=outcome, prompt_tokens=draw(st.integers(0, 5)), client=client))
    return records


@settings(max_examples=150, deadline=None)
@given(_runs(), st.sampled_from([(1, 2), (0, 1), (3, 1)]))
def test_service_gap_matches_brute_force(records, weights):
    w_p, w_q = weights
    got = client_service_gap(records, w_p=w_p, w_q=w_q)
    assert got.gap == _brute_force_gap(records, w_p, w_q)
    if got.gap:
        # The window reproduces the gap: the leader's lead grew by it over
        # [t1, t2] (window opening at t1) or (t1, t2].
        leader, trailer = got.pair
        t1, t2 = got.window_s
        lead = lambda keep: sum(w * ((c == leader) - (c == trailer))
                                for t, c, w in _charges(records, w_p, w_q) if keep(t))
        assert got.gap in (lead(lambda t: t1 <= t <= t2), lead(lambda t: t1 < t <= t2))
    else:
        assert got == ServiceGap(0.0, None, None)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from("AB"), min_size=2, max_size=12),
       st.lists(st.integers(0, 4), min_size=12, max_size=12))
def test_service_gap_against_fairness_ledger(order, prompts):
    """Two clients arriving at 0, one request completed per tick: with the
    cumulative ledgers of serving.harness.service_gap, max|W_A - W_B| over the
    backlogged cuts <= gap <= 2x that, with equality while one client leads
    throughout (the service difference starts at 0)."""
    records = [_rec(f"{c}{k}", 0.0, [k + 1.0], prompt_tokens=prompts[k], client=c)
               for k, c in enumerate(order)]
    w = {"A": 0, "B": 0}
    a, b, backlogged = [], [], []
    last = {c: max((k for k, x in enumerate(order) if x == c), default=-1) for c in "AB"}
    for k, c in enumerate(order):
        w[c] += prompts[k] + 2
        a.append(w["A"])
        b.append(w["B"])
        backlogged.append(k <= last["A"] and k <= last["B"])
    ledger = service_gap.max_backlogged_gap(a, b, backlogged)
    gap = client_service_gap(records).gap
    assert ledger <= gap <= 2 * ledger
    diffs = [x - y for x, y, on in zip(a, b, backlogged) if on]
    if all(d >= 0 for d in diffs) or all(d <= 0 for d in diffs):
        assert gap == ledger
