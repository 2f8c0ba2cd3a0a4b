"""Workload loaders: exact arrivals, replay options, prompt ids, bad input."""

import csv
import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from serving.harness.synthetic import AZURE_CONV_2023_SUMMARY, synthetic_azure_conv
from serving.harness.traces import (
    MOONCAKE_BLOCK_TOKENS,
    load_azure_trace,
    load_mooncake_trace,
    load_vtc_trace,
    parse_azure_timestamp_ns,
)
from serving.harness.workloads import DEFAULT_RESERVED_TOKEN_IDS, WorkloadError


def _shared_dir() -> Path:
    env = os.environ.get("ITERSERVE_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "../shared"


def _trace(rel: str) -> Path:
    path = _shared_dir() / "data/traces" / rel
    if not path.is_file():
        pytest.skip(f"real trace {rel} not present under {_shared_dir()} (set ITERSERVE_SHARED)")
    return path


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:46.6805901,10,5
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:45.0000000,7,3
"""

VTC = """req_id,arrival_s,client,prompt_len,output_len
0,0.000000,a,13,199
1,0.5,b,36,137
2,0.5,a,5,1
3,2.25,c,20,4
"""


def _mooncake_text(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


MOONCAKE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 1024, "output_length": 7, "hash_ids": [0, 1]},
    {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0, 3]},
    {"timestamp": 3000, "input_length": 512, "output_length": 1, "hash_ids": [4]},
    {"timestamp": 5997, "input_length": 1, "output_length": 1, "hash_ids": [5]},
    {"timestamp": 5997, "input_length": 2, "output_length": 1, "hash_ids": [6]},
]


# --------------------------------------------------------------------------
# Azure


def test_azure_timestamp_is_exact_to_100ns():
    a = parse_azure_timestamp_ns("2023-11-16 18:15:46.6805900")
    assert parse_azure_timestamp_ns("2023-11-16 18:15:46.6805901") - a == 100
    assert parse_azure_timestamp_ns("2023-11-16 18:15:50.9951690") - a == 4_314_579_000
    # Across midnight and a month end.
    assert (parse_azure_timestamp_ns("2023-12-01 00:00:00.0000000")
            - parse_azure_timestamp_ns("2023-11-30 23:59:59.9999999")) == 100
    assert parse_azure_timestamp_ns("2023-11-16 18:15:47") - a == 319_410_000


def test_azure_sorts_rezeroes_and_keeps_row_identity(tmp_path):
    path = _write(tmp_path, "az.csv", AZURE)
    w = load_azure_trace(path)
    assert [r.request_id for r in w] == ["azure-3", "azure-0", "azure-1", "azure-2"]
    assert [r.arrival_s for r in w] == [0.0, 1.68059, 1.6805901, 5.995169]
    assert [r.prompt_len for r in w] == [7, 374, 10, 396]
    assert [r.max_tokens for r in w] == [3, 44, 5, 109]
    assert all(r.ignore_eos and r.client == "default" and r.priority == 0 and not r.clipped
               for r in w)
    assert w.num_rows_read == 4 and w.source == "azure_llm_inference"
    assert w.sha256 == hashlib.sha256(AZURE.encode()).hexdigest()


def test_azure_time_scale_multiplies_gaps(tmp_path):
    w = load_azure_trace(_write(tmp_path, "az.csv", AZURE), time_scale=2.0)
    assert [r.arrival_s for r in w] == [0.0, 3.36118, 3.3611802, 11.990338]
    assert w.time_scale == 2.0


def test_azure_window_is_half_open_and_rezeroes_at_first_kept(tmp_path):
    path = _write(tmp_path, "az.csv", AZURE)
    full = {r.request_id: r for r in load_azure_trace(path)}
    # Offsets from t0 are 0, 1.68059, 1.6805901, 5.995169.
    w = load_azure_trace(path, window_s=(1.0, 5.995169))
    assert [r.request_id for r in w] == ["azure-0", "azure-1"]
    assert w[0].arrival_s == 0.0 and w[1].arrival_s == pytest.approx(1e-7, abs=1e-12)
    # A request's prompt does not depend on which other rows were kept.
    assert w[0].prompt_token_ids == full["azure-0"].prompt_token_ids
    assert load_azure_trace(path, window_s=(0.0, 1.68059)).requests[0].request_id == "azure-3"
    assert len(load_azure_trace(path, window_s=(0.0, 1.68059))) == 1


def test_azure_caps_and_clipping(tmp_path):
    path = _write(tmp_path, "az.csv", AZURE)
    full = {r.request_id: r for r in load_azure_trace(path)}
    w = load_azure_trace(path, max_prompt_len=100, max_output_len=50, max_requests=3)
    assert [r.request_id for r in w] == ["azure-3", "azure-0", "azure-1"]
    assert [r.prompt_len for r in w] == [7, 100, 10]
    assert [r.clipped for r in w] == [False, True, False]
    assert [r.max_tokens for r in w] == [3, 44, 5]
    assert (w.num_clipped, w.num_output_capped) == (1, 0)
    # A clipped prompt is the prefix of the unclipped one.
    assert w[1].prompt_token_ids == full["azure-0"].prompt_token_ids[:100]
    w = load_azure_trace(path, max_prompt_len=100, max_output_len=50)
    assert (w.num_clipped, w.num_output_capped) == (2, 1)
    assert w[3].max_tokens == 50


def test_prompt_ids_are_seeded_and_avoid_reserved_ids(tmp_path):
    path = _write(tmp_path, "az.csv", AZURE)
    a = load_azure_trace(path, seed=1, vocab_size=40)
    b = load_azure_trace(path, seed=1, vocab_size=40)
    c = load_azure_trace(path, seed=2, vocab_size=40)
    assert a == b
    assert a[1].prompt_token_ids != c[1].prompt_token_ids
    ids = {t for r in a for t in r.prompt_token_ids}
    assert ids == set(range(17, 40))  # 787 draws over 23 allowed ids hit all of them
    assert min(DEFAULT_RESERVED_TOKEN_IDS) == 0 and 2 in DEFAULT_RESERVED_TOKEN_IDS
    custom = load_azure_trace(path, vocab_size=10, reserved_token_ids={0, 2, 5})
    assert {t for r in custom for t in r.prompt_token_ids} == {1, 3, 4, 6, 7, 8, 9}


# --------------------------------------------------------------------------
# VTC


def test_vtc_columns_clients_ties_and_scale(tmp_path):
    w = load_vtc_trace(_write(tmp_path, "vtc.csv", VTC), time_scale=0.5)
    assert [r.request_id for r in w] == ["vtc-0", "vtc-1", "vtc-2", "vtc-3"]
    assert [r.client for r in w] == ["a", "b", "a", "c"]
    assert [r.arrival_s for r in w] == [0.0, 0.25, 0.25, 1.125]
    assert [(r.prompt_len, r.max_tokens) for r in w] == [(13, 199), (36, 137), (5, 1), (20, 4)]


def test_vtc_without_req_id_and_window(tmp_path):
    text = "\n".join(",".join(line.split(",")[1:]) for line in VTC.splitlines()) + "\n"
    w = load_vtc_trace(_write(tmp_path, "vtc.csv", text), window_s=(0.5, 2.25))
    assert [r.request_id for r in w] == ["vtc-1", "vtc-2"]
    assert [r.arrival_s for r in w] == [0.0, 0.0]


# --------------------------------------------------------------------------
# Mooncake


def test_mooncake_spreads_buckets_by_file_order(tmp_path):
    w = load_mooncake_trace(_write(tmp_path, "mc.jsonl", _mooncake_text(MOONCAKE)))
    # Bucket 0 holds 3 requests over 3000 ms; the last bucket 2 over 3000 ms.
    assert [r.request_id for r in w] == [f"mooncake-{i}" for i in range(6)]
    assert [r.arrival_s for r in w] == [0.0, 1.0, 2.0, 3.0, 5.997, 7.497]
    w = load_mooncake_trace(_write(tmp_path, "mc.jsonl", _mooncake_text(MOONCAKE)), bucket_ms=0.0)
    assert [r.arrival_s for r in w] == [0.0, 0.0, 0.0, 3.0, 5.997, 5.997]


def test_mooncake_spread_never_crosses_next_bucket(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [i]}
            for i in range(2)]
    rows.append({"timestamp": 1000, "input_length": 1, "output_length": 1, "hash_ids": [9]})
    w = load_mooncake_trace(_write(tmp_path, "mc.jsonl", _mooncake_text(rows)))
    assert [r.arrival_s for r in w] == [0.0, 0.5, 1.0]


def test_mooncake_shared_prefix_is_shared_exactly(tmp_path):
    w = load_mooncake_trace(_write(tmp_path, "mc.jsonl", _mooncake_text(MOONCAKE)))
    r0, r1, r2, r3 = (np.asarray(w[i].prompt_token_ids) for i in range(4))
    assert [len(r) for r in (r0, r1, r2, r3)] == [1100, 1024, 600, 512]
    B = MOONCAKE_BLOCK_TOKENS
    # r0 and r1 share hash ids [0, 1]: exactly the first 1024 ids.
    np.testing.assert_array_equal(r0[: 2 * B], r1)
    # r0 and r2 share only hash id 0: the first 512 ids, and differ after.
    np.testing.assert_array_equal(r0[:B], r2[:B])
    assert np.mean(r0[B:600] != r2[B:600]) > 0.9
    # Different first hash id: nothing shared.
    assert np.mean(r0[:B] != r3) > 0.9
    # Same seed, hash id -> same block in another file; a new seed changes it.
    again = load_mooncake_trace(_write(tmp_path, "mc2.jsonl", _mooncake_text(MOONCAKE[2:3])))
    np.testing.assert_array_equal(np.asarray(again[0].prompt_token_ids)[:B], r0[:B])
    other = load_mooncake_trace(_write(tmp_path, "mc2.jsonl", _mooncake_text(MOONCAKE[2:3])),
                                seed=7)
    assert np.mean(np.asarray(other[0].prompt_token_ids)[:B] != r0[:B]) > 0.9


def test_mooncake_block_tokens_shrinks_lengths_and_keeps_the_sharing(tmp_path):
    full = load_mooncake_trace(_write(tmp_path, "mc.jsonl", _mooncake_text(MOONCAKE[:4])))
    w = load_mooncake_trace(_write(tmp_path, "mc.jsonl", _mooncake_text(MOONCAKE[:4])),
                            block_tokens=16)
    # ceil(n * 16 / 512) of 1100, 1024, 600, 512 tokens.
    assert [r.prompt_len for r in w] == [35, 32, 19, 16]
    r0, r1, r2, r3 = (np.asarray(w[i].prompt_token_ids) for i in range(4))
    np.testing.assert_array_equal(r0[:32], r1)            # hash ids [0, 1]
    np.testing.assert_array_equal(r0[:16], r2[:16])       # hash id 0 only
    assert np.mean(r0[16:19] != r2[16:19]) > 0.5 and np.mean(r0[:16] != r3) > 0.9
    # A block is the head of the full-size block of the same hash id.
    assert w[0].prompt_token_ids[:16] == full[0].prompt_token_ids[:16]
    with pytest.raises(ValueError, match="block_tokens=0 must be an int in"):
        load_mooncake_trace(_write(tmp_path, "mc.jsonl", _mooncake_text(MOONCAKE[:4])),
                            block_tokens=0)


def test_mooncake_clip_keeps_the_block_prefix(tmp_path):
    full = load_mooncake_trace(_write(tmp_path, "mc.jsonl", _mooncake_text(MOONCAKE)))
    w = load_mooncake_trace(_write(tmp_path, "mc.jsonl", _mooncake_text(MOONCAKE)),
                            max_prompt_len=700)
    assert [r.prompt_len for r in w] == [700, 700, 600, 512, 1, 2]
    assert [r.clipped for r in w] == [True, True, False, False, False, False]
    assert w.num_clipped == 2
    assert w[0].prompt_token_ids == full[0].prompt_token_ids[:700]


# --------------------------------------------------------------------------
# Bad input


def _bad_azure(row: str) -> str:
    return ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
            + row + "\n")


@pytest.mark.parametrize("text,line,field,rule", [
    (_bad_azure("2023-11-16 18:15:47.0,abc,4"), 3, "ContextTokens", "integer >= 1"),
    (_bad_azure("2023-11-16 18:15:47.0,12,-5"), 3, "GeneratedTokens", "integer >= 1"),
    (_bad_azure("2023-11-16 18:15:47.0,0,5"), 3, "ContextTokens", "integer >= 1"),
    (_bad_azure("2023-11-16 18:15:47.0,1.5,5"), 3, "ContextTokens", "integer >= 1"),
    (_bad_azure("2023-13-16 18:15:47.0,12,5"), 3, "TIMESTAMP", "timestamp"),
    (_bad_azure("2023-11-16T18:15:47,12,5"), 3, "TIMESTAMP", "timestamp"),
    (_bad_azure("2023-11-16 25:15:47.0,12,5"), 3, "TIMESTAMP", "timestamp"),
    (_bad_azure("2023-11-16 18:15:47.0,12"), 3, "GeneratedTokens", "missing"),
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6,374\n", 1, "GeneratedTokens",
     "required column"),
])
def test_azure_bad_input_names_file_line_field_rule(tmp_path, text, line, field, rule):
    path = _write(tmp_path, "bad.csv", text)
    with pytest.raises(WorkloadError) as e:
        load_azure_trace(path)
    msg = str(e.value)
    assert f"{path}:{line}:" in msg and repr(field) in msg and rule in msg


def _bad_vtc(row: str) -> str:
    return "req_id,arrival_s,client,prompt_len,output_len\n0,0.0,a,3,4\n" + row + "\n"


@pytest.mark.parametrize("text,line,field,rule", [
    (_bad_vtc("1,x,a,3,4"), 3, "arrival_s", "finite number >= 0"),
    (_bad_vtc("1,-1,a,3,4"), 3, "arrival_s", "finite number >= 0"),
    (_bad_vtc("1,nan,a,3,4"), 3, "arrival_s", "finite number >= 0"),
    (_bad_vtc("1,1.0,,3,4"), 3, "client", "non-empty"),
    (_bad_vtc("1,1.0,a,-3,4"), 3, "prompt_len", "integer >= 1"),
    (_bad_vtc("1,1.0,a,3,"), 3, "output_len", "integer >= 1"),
    (_bad_vtc("0,1.0,a,3,4"), 3, "req_id", "unique (first seen on line 2)"),
])
def test_vtc_bad_input_names_file_line_field_rule(tmp_path, text, line, field, rule):
    path = _write(tmp_path, "bad.csv", text)
    with pytest.raises(WorkloadError) as e:
        load_vtc_trace(path)
    msg = str(e.value)
    assert f"{path}:{line}:" in msg and repr(field) in msg and rule in msg


_GOOD = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0, 3]}


@pytest.mark.parametrize("bad,field,rule", [
    ({**_GOOD, "hash_ids": [0]}, "hash_ids", "ceil(input_length/512) = 2 entries, has 1"),
    ({**_GOOD, "hash_ids": [0, 1, 2]}, "hash_ids", "ceil(input_length/512) = 2 entries, has 3"),
    ({**_GOOD, "hash_ids": [0, "x"]}, "hash_ids", "list of integers"),
    ({**_GOOD, "input_length": -600}, "input_length", "integer >= 1"),
    ({**_GOOD, "input_length": "600"}, "input_length", "integer >= 1"),
    ({**_GOOD, "output_length": 0}, "output_length", "integer >= 1"),
    ({**_GOOD, "timestamp": -1}, "timestamp", ">= 0"),
    ({**_GOOD, "timestamp": "0"}, "timestamp", "JSON number"),
    ({k: v for k, v in _GOOD.items() if k != "output_length"}, "output_length", "required"),
    ("{not json", None, "the line must be one JSON object (Expecting property name"),
    ("[1, 2]", None, "the line must be a JSON object (got '[1, 2]')"),
])
def test_mooncake_bad_input_names_file_line_field_rule(tmp_path, bad, field, rule):
    line = bad if isinstance(bad, str) else json.dumps(bad)
    path = _write(tmp_path, "bad.jsonl", json.dumps(_GOOD) + "\n\n" + line + "\n")
    with pytest.raises(WorkloadError) as e:
        load_mooncake_trace(path)
    msg = str(e.value)
    assert f"{path}:3:" in msg and rule in msg
    assert (f"field {field!r}" in msg) == (field is not None)


def test_missing_file_and_empty_results(tmp_path):
    missing = tmp_path / "nope.csv"
    for load in (load_azure_trace, load_vtc_trace, load_mooncake_trace):
        with pytest.raises(WorkloadError, match=f"{missing}: file not found"):
            load(missing)
    header_only = _write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(WorkloadError, match="no data rows"):
        load_azure_trace(header_only)
    with pytest.raises(WorkloadError, match=r"no request in window_s=\(100.0, 200.0\)"):
        load_vtc_trace(_write(tmp_path, "vtc.csv", VTC), window_s=(100.0, 200.0))
    with pytest.raises(ValueError, match="time_scale"):
        load_vtc_trace(_write(tmp_path, "vtc.csv", VTC), time_scale=0.0)
    with pytest.raises(ValueError, match="window_s"):
        load_vtc_trace(_write(tmp_path, "vtc.csv", VTC), window_s=(2.0, 1.0))
    assert issubclass(WorkloadError, ValueError)


def test_an_empty_window_names_the_traces_span_of_arrivals(tmp_path):
    """A window past the end (or in a gap) says how long the trace is: the
    seconds from its first to its last arrival, in each loader's unit."""
    vtc = _write(tmp_path, "vtc.csv", VTC)  # arrivals 0 .. 2.25 s
    with pytest.raises(WorkloadError) as e:
        load_vtc_trace(vtc, window_s=(100.0, 200.0))
    assert str(e.value) == (
        f"{vtc}: no request in window_s=(100.0, 200.0) (seconds from the trace's first "
        f"arrival; its arrivals span 2.25 s, first to last)")
    with pytest.raises(WorkloadError, match=r"in window_s=\(1.0, 2.0\) .* span 2.25 s"):
        load_vtc_trace(vtc, window_s=(1.0, 2.0))  # a gap: 0.5 .. 2.25
    azure = _write(tmp_path, "azure.csv", AZURE)  # 18:15:45.0 .. 18:15:50.995169
    with pytest.raises(WorkloadError, match=r"its arrivals span 5.995 s, first to last"):
        load_azure_trace(azure, window_s=(60.0, 120.0))
    mooncake = _write(tmp_path, "mc.jsonl", _mooncake_text(MOONCAKE))  # spread: 0 .. 7.497 s
    with pytest.raises(WorkloadError, match=r"its arrivals span 7.497 s, first to last"):
        load_mooncake_trace(mooncake, window_s=(60.0, 120.0))


# --------------------------------------------------------------------------
# Synthetic default


def test_synthetic_default_is_seeded_and_capped():
    w = synthetic_azure_conv()
    assert w == synthetic_azure_conv()
    assert w != synthetic_azure_conv(seed=1)
    assert len(w) == 64 and w.path is None and w.source == "synthetic_azure_conv"
    assert w[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(w, w.requests[1:]))
    assert max(r.prompt_len for r in w) == 1024 and max(r.max_tokens for r in w) == 128
    assert w.num_clipped == sum(r.clipped for r in w) > 0
    assert all(r.prompt_len == 1024 for r in w if r.clipped)
    # ~64 arrivals at 0.553 req/s.
    assert 60.0 < w.duration_s < 200.0
    assert w.time_scale == 10.0


def test_synthetic_clients_and_priorities_are_drawn_apart():
    """Clients by share and priorities uniform, seeded apart from the rest:
    arrivals, lengths and prompts are those of the workload without them."""
    plain = synthetic_azure_conv(400, seed=5)
    w = synthetic_azure_conv(400, seed=5, client_shares=[3.0, 1.0], num_priorities=3)
    strip = lambda r: dataclasses.replace(r, client="default", priority=0)
    assert [strip(r) for r in w] == list(plain)
    assert {r.client for r in plain} == {"default"} and {r.priority for r in plain} == {0}
    assert w == synthetic_azure_conv(400, seed=5, client_shares=[3.0, 1.0], num_priorities=3)
    counts = {c: sum(r.client == c for r in w) for c in ("c0", "c1")}
    assert sum(counts.values()) == 400
    assert counts["c0"] / 400 == pytest.approx(0.75, abs=0.06)      # 3 : 1
    assert {r.priority for r in w} == {0, 1, 2}
    with pytest.raises(ValueError, match=r"client_shares=\[1.0, 0.0\] must be one or more"):
        synthetic_azure_conv(4, client_shares=[1.0, 0.0])
    with pytest.raises(ValueError, match="num_priorities=0 must be >= 1"):
        synthetic_azure_conv(4, num_priorities=0)


def test_client_shares_are_relative_weights_normalised_to_sum_to_one():
    """``--client_shares`` need not sum to 1: only their ratios count, so
    0.6,0.6 draws exactly the clients of 1,1 (two equal clients) and 6,2
    those of 3,1."""
    draw = lambda shares: [r.client for r in synthetic_azure_conv(
        200, seed=3, client_shares=shares)]
    assert draw([0.6, 0.6]) == draw([1.0, 1.0])
    assert draw([6.0, 2.0]) == draw([3.0, 1.0]) != draw([1.0, 1.0])
    assert set(draw([0.6, 0.6])) == {"c0", "c1"}


def test_synthetic_matches_the_summary_figures():
    n = 2000
    w = synthetic_azure_conv(n, rate_scale=2.0, seed=3, max_prompt_len=None, max_output_len=None)
    arrivals = np.array([r.arrival_s for r in w])
    gaps = np.diff(arrivals)
    rate = 2.0 * AZURE_CONV_2023_SUMMARY["rate_per_s"]
    assert (n - 1) / arrivals[-1] == pytest.approx(rate, rel=0.08)
    assert 0.95 < gaps.std() / gaps.mean() < 1.25  # gamma shape 0.871 -> CV 1.07
    prompts = np.array([r.prompt_len for r in w])
    outputs = np.array([r.max_tokens for r in w])
    assert np.median(prompts) == pytest.approx(1020, rel=0.1)
    assert np.median(outputs) == pytest.approx(129, rel=0.15)
    assert prompts.min() >= 2 and prompts.max() <= 14050
    assert outputs.min() >= 7 and outputs.max() <= 1000
    assert w.num_clipped == 0 and w.num_output_capped == 0


# --------------------------------------------------------------------------
# Real traces (skipped when the shared data folder is absent)


def test_summary_figures_recompute_from_the_real_conv_trace():
    path = _trace("azure2023/AzureLLMInferenceTrace_conv.csv")
    s = AZURE_CONV_2023_SUMMARY
    assert hashlib.sha256(path.read_bytes()).hexdigest() == s["sha256"]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    prompts = np.array([int(r["ContextTokens"]) for r in rows])
    outputs = np.array([int(r["GeneratedTokens"]) for r in rows])
    q = s["length_quantiles"]
    assert tuple(np.quantile(prompts, q, method="inverted_cdf").astype(int)) == s["prompt_len"]
    assert tuple(np.quantile(outputs, q, method="inverted_cdf").astype(int)) == s["output_len"]
    ts = [parse_azure_timestamp_ns(r["TIMESTAMP"]) for r in rows]
    span_s = (max(ts) - min(ts)) / 1e9
    assert len(rows) == s["num_requests"]
    assert span_s == pytest.approx(s["span_s"], abs=0.01)
    assert (len(rows) - 1) / span_s == pytest.approx(s["rate_per_s"], abs=0.001)


def test_real_azure_conv_first_hour_window():
    path = _trace("azure2023/AzureLLMInferenceTrace_conv.csv")
    w = load_azure_trace(path, window_s=(0.0, 60.0), max_prompt_len=64)
    assert w.num_rows_read == 19366 and w.sha256 == AZURE_CONV_2023_SUMMARY["sha256"]
    assert w[0].arrival_s == 0.0 and w[1].arrival_s == 4.314579  # rows 1 and 2 of the file
    assert w[0].max_tokens == 44 and w[0].clipped
    assert all(r.arrival_s < 60.0 for r in w)
    with open(path, newline="") as f:
        ts = [parse_azure_timestamp_ns(r["TIMESTAMP"]) for r in csv.DictReader(f)]
    t0 = min(ts)
    assert len(w) == sum(t - t0 < 60 * 10**9 for t in ts) == 191


def test_real_mooncake_shared_prefixes():
    path = _trace("mooncake/conversation_trace.jsonl")
    w = load_mooncake_trace(path, max_requests=200, max_prompt_len=2048)
    assert w.num_rows_read == 12031 and len(w) == 200
    # The first rows of the file all start with hash id 0.
    first = np.asarray(w[0].prompt_token_ids[:MOONCAKE_BLOCK_TOKENS])
    for r in w.requests[1:5]:
        np.testing.assert_array_equal(np.asarray(r.prompt_token_ids[:MOONCAKE_BLOCK_TOKENS]), first)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(w, w.requests[1:]))


def test_real_vtc_trace():
    path = _trace("vtc_lmsys/vtc_real_trace.csv")
    w = load_vtc_trace(path, max_prompt_len=256)
    assert len(w) == 1500 and len({r.client for r in w}) == 27
    assert w[0].request_id == "vtc-0" and w.duration_s == pytest.approx(600.0, abs=1e-6)
