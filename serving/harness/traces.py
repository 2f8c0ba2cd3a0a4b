"""Real-trace loaders: Azure LLM inference CSV, VTC CSV and Mooncake JSONL,
each a `Workload` (`serving.harness.workloads`).

Loaders are pure functions of (path, options): the same file and options
give the same workload, bit for bit. Traces carry lengths and arrival times,
never text, so prompt token ids are drawn from a seeded numpy Generator:

* Azure / VTC: one stream per request, seeded by (seed, source tag, row
  index), so a request's prompt does not depend on which other rows a window
  or cap kept. A clipped prompt is the prefix of the unclipped one (numpy
  draws bounded integers sequentially; a test checks it).
* Mooncake: one fixed random block of `MOONCAKE_BLOCK_TOKENS` ids per hash id,
  seeded by (seed, source tag, hash id); a prompt is its blocks concatenated and
  cut to `input_length`, so requests that share leading hash ids share exactly
  that prompt prefix.

Shared replay options (see `_finalize` for the order they apply in):

* `window_s=(a, b)`: sort rows by timestamp (stable: ties keep file order), keep
  rows with `t0 + a <= ts < t0 + b` where t0 is the first timestamp of the
  file, and re-zero arrivals at the first kept row.
* `time_scale`: multiplies every inter-arrival gap (> 1 = slower arrivals); the
  load is scaled, never thinned by dropping rows.
* `max_requests`: keep the first N rows in arrival order.
* `max_prompt_len`: longer prompts are cut to it and flagged `clipped`.
* `max_output_len`: caps `max_tokens` (counted in `num_output_capped`).

Length rule: every prompt and output length in a trace must be >= 1.

Malformed input raises `WorkloadError` naming the file, line, field and rule.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import math
import re
from datetime import date
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from serving.harness.workloads import (
    _TAG_AZURE,
    _TAG_MOONCAKE,
    _TAG_VTC,
    DEFAULT_RESERVED_TOKEN_IDS,
    DEFAULT_VOCAB_SIZE,
    RequestSpec,
    Workload,
    WorkloadError,
    _check_options,
    _TokenSampler,
)

MOONCAKE_BLOCK_TOKENS = 512
# Each kind's timestamp unit: Azure's are ns, VTC's s, Mooncake's ms.
_UNITS_PER_SECOND = {"azure": 1e9, "vtc": 1.0, "mooncake": 1e3}


# --------------------------------------------------------------------------
# Reading and checking rows


@dataclasses.dataclass(frozen=True)
class _Row:
    index: int  # 0-based data row index in the file (prompt stream key).
    line: int  # 1-based line number in the file.
    ts: int | float  # timestamp in the source's own unit (exact for Azure).
    prompt_len: int
    output_len: int
    client: str = "default"
    request_id: str | None = None
    hash_ids: tuple[int, ...] = ()


def _read_bytes(path: str | Path) -> tuple[Path, bytes, str]:
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise WorkloadError(f"{path}: file not found") from None
    except OSError as e:
        raise WorkloadError(f"{path}: cannot read file: {e}") from None
    return path, data, hashlib.sha256(data).hexdigest()


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise WorkloadError(f"{path}: not UTF-8 text (byte {e.start})") from None


def _fail(path: Path, line: int, field: Optional[str], rule: str, value) -> WorkloadError:
    """``PATH:LINE: field 'F' RULE (got V)``; ``field`` None: the line as a whole."""
    what = "the line" if field is None else f"field {field!r}"
    return WorkloadError(f"{path}:{line}: {what} {rule} (got {value!r})")


def _parse_length(path: Path, line: int, field: str, text, *, json_value: bool = False) -> int:
    """A token length: an integer >= 1 (decimal digits in CSV text; a JSON int if json_value)."""
    if isinstance(text, bool):
        raise _fail(path, line, field, "must be an integer >= 1", text)
    if isinstance(text, int):
        value = text
    elif not json_value and isinstance(text, str) and re.fullmatch(r"[+-]?\d+", text.strip()):
        value = int(text.strip())
    else:
        raise _fail(path, line, field, "must be an integer >= 1", text)
    if value < 1:
        raise _fail(path, line, field, "must be an integer >= 1", text)
    return value


def _parse_seconds(path: Path, line: int, field: str, text) -> float:
    """A finite, non-negative number."""
    if isinstance(text, bool):
        raise _fail(path, line, field, "must be a finite number >= 0", text)
    try:
        value = float(text.strip() if isinstance(text, str) else text)
    except (TypeError, ValueError):
        raise _fail(path, line, field, "must be a finite number >= 0", text) from None
    if not (math.isfinite(value) and value >= 0.0):
        raise _fail(path, line, field, "must be a finite number >= 0", text)
    return value


_AZURE_TS = re.compile(r"(\d{4})-(\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")


def parse_azure_timestamp_ns(text: str) -> int:
    """Exact nanoseconds since 0001-01-01 00:00:00 of 'YYYY-MM-DD HH:MM:SS[.fffffff]'.

    The Azure traces write 100 ns resolution (7 fraction digits); up to 9 are
    accepted. Integer arithmetic, so differences are exact.

    Raises:
      ValueError: the text is not such a timestamp or names an invalid date/time.
    """
    m = _AZURE_TS.fullmatch(text.strip())
    if m is None:
        raise ValueError("expected 'YYYY-MM-DD HH:MM:SS.fffffff'")
    y, mo, d, hh, mm, ss = (int(g) for g in m.groups()[:6])
    if hh > 23 or mm > 59 or ss > 59:
        raise ValueError("time of day out of range")
    days = date(y, mo, d).toordinal()  # raises ValueError on a bad date
    frac_ns = int((m.group(7) or "").ljust(9, "0"))
    return ((days * 24 + hh) * 60 + mm) * 60 * 10**9 + ss * 10**9 + frac_ns


def _csv_rows(path: Path, text: str,
              required: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """Yields (line number, {column: field}) for each non-blank data row."""
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if header is None:
        raise WorkloadError(f"{path}:1: empty file, expected header with columns {list(required)}")
    header = [h.strip() for h in header]
    for name in required:
        if name not in header:
            raise WorkloadError(f"{path}:1: header lacks required column {name!r} (has {header})")
    for fields in reader:
        line = reader.line_num
        if not fields or all(not f.strip() for f in fields):
            continue
        if len(fields) < len(header):
            raise WorkloadError(f"{path}:{line}: field {header[len(fields)]!r} is missing "
                                f"(row has {len(fields)} fields, header has {len(header)})")
        if len(fields) > len(header):
            raise WorkloadError(f"{path}:{line}: row has {len(fields)} fields, header has "
                                f"{len(header)} (extra field {fields[len(header)]!r})")
        yield line, dict(zip(header, fields))


# --------------------------------------------------------------------------
# Shared replay pipeline


def _finalize(
    *,
    path: Path,
    sha256: str,
    source: str,
    rows: list[_Row],
    units_per_second: float,
    prompt_fn: Callable[[_Row, int], tuple[int, ...]],
    id_prefix: str,
    time_scale: float,
    window_s: tuple[float, float] | None,
    max_requests: int | None,
    max_prompt_len: int | None,
    max_output_len: int | None,
    seed: int,
) -> Workload:
    """Sort, window, re-zero, scale, cap, clip and build the Workload.

    `ts` offsets are taken in the row's exact unit and then divided by
    `units_per_second`, so integer timestamps give correctly rounded seconds.

    Raises:
        WorkloadError: no rows, or no row in `window_s` (the message gives the
            seconds from the first to the last arrival).
    """
    num_rows_read = len(rows)
    if not rows:
        raise WorkloadError(f"{path}: no data rows")
    rows = sorted(rows, key=lambda r: r.ts)  # stable: ties keep file order
    t0 = rows[0].ts
    if window_s is not None:
        a, b = window_s
        span_s = (rows[-1].ts - t0) / units_per_second  # first to last arrival
        rows = [r for r in rows if a <= (r.ts - t0) / units_per_second < b]
        if not rows:
            raise WorkloadError(
                f"{path}: no request in window_s={window_s} (seconds from the trace's first "
                f"arrival; its arrivals span {round(span_s, 3)} s, first to last)")
    if max_requests is not None:
        rows = rows[:max_requests]
    t_first = rows[0].ts
    requests, num_clipped, num_capped = [], 0, 0
    for r in rows:
        prompt_len = r.prompt_len if max_prompt_len is None else min(r.prompt_len, max_prompt_len)
        output_len = r.output_len if max_output_len is None else min(r.output_len, max_output_len)
        num_clipped += prompt_len < r.prompt_len
        num_capped += output_len < r.output_len
        requests.append(
            RequestSpec(
                request_id=r.request_id if r.request_id is not None else f"{id_prefix}-{r.index}",
                arrival_s=(r.ts - t_first) / units_per_second * time_scale,
                prompt_token_ids=prompt_fn(r, prompt_len),
                max_tokens=output_len,
                ignore_eos=True,
                client=r.client,
                clipped=prompt_len < r.prompt_len,
            )
        )
    return Workload(
        requests=tuple(requests),
        source=source,
        path=str(path),
        sha256=sha256,
        num_rows_read=num_rows_read,
        num_clipped=num_clipped,
        num_output_capped=num_capped,
        time_scale=float(time_scale),
        window_s=None if window_s is None else (float(window_s[0]), float(window_s[1])),
        seed=seed,
        max_prompt_len=max_prompt_len,
        max_output_len=max_output_len,
    )


# --------------------------------------------------------------------------
# Loaders


def load_azure_trace(
    path: str | Path,
    *,
    time_scale: float = 1.0,
    window_s: tuple[float, float] | None = None,
    max_requests: int | None = None,
    max_prompt_len: int | None = None,
    max_output_len: int | None = None,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    reserved_token_ids: frozenset[int] | Sequence[int] = DEFAULT_RESERVED_TOKEN_IDS,
) -> Workload:
    """Azure LLM inference trace CSV (2023: `TIMESTAMP,ContextTokens,GeneratedTokens`).

    TIMESTAMP is wall clock with 100 ns resolution, parsed exactly
    (`parse_azure_timestamp_ns`); arrival = ts - first ts (seconds, then
    windowed and scaled as the module docstring says). Request ids are
    "azure-<row index>"; client is "default".

    Raises:
      WorkloadError: missing file, missing column, bad timestamp, a length
        that is not an integer >= 1, or nothing left after filtering.
      ValueError: invalid options.
    """
    _check_options(time_scale, window_s, max_requests, max_prompt_len, max_output_len)
    sampler = _TokenSampler(vocab_size, reserved_token_ids)
    path, sha, rows = _azure_rows(path)
    return _finalize(
        path=path, sha256=sha, source="azure_llm_inference", rows=rows,
        units_per_second=_UNITS_PER_SECOND["azure"],
        prompt_fn=lambda r, n: sampler.draw((seed, _TAG_AZURE, r.index), n), id_prefix="azure",
        time_scale=time_scale, window_s=window_s, max_requests=max_requests,
        max_prompt_len=max_prompt_len, max_output_len=max_output_len, seed=seed,
    )


def _azure_rows(path: str | Path) -> tuple[Path, str, list[_Row]]:
    """An Azure trace's (path, sha256, rows), `ts` in ns (`load_azure_trace`)."""
    path, data, sha = _read_bytes(path)
    text = _decode(path, data)
    rows = []
    for line, f in _csv_rows(path, text, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        try:
            ts = parse_azure_timestamp_ns(f["TIMESTAMP"])
        except ValueError as e:
            raise _fail(path, line, "TIMESTAMP",
                        f"must be a timestamp 'YYYY-MM-DD HH:MM:SS.fffffff' ({e})",
                        f["TIMESTAMP"]) from None
        rows.append(_Row(index=len(rows), line=line, ts=ts,
                         prompt_len=_parse_length(path, line, "ContextTokens", f["ContextTokens"]),
                         output_len=_parse_length(path, line, "GeneratedTokens",
                                                  f["GeneratedTokens"])))
    return path, sha, rows


def load_vtc_trace(
    path: str | Path,
    *,
    time_scale: float = 1.0,
    window_s: tuple[float, float] | None = None,
    max_requests: int | None = None,
    max_prompt_len: int | None = None,
    max_output_len: int | None = None,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    reserved_token_ids: frozenset[int] | Sequence[int] = DEFAULT_RESERVED_TOKEN_IDS,
) -> Workload:
    """VTC CSV: `[req_id,] arrival_s, client, prompt_len, output_len`.

    `arrival_s` is seconds (float); `req_id`, when present, must be unique and
    becomes request_id "vtc-<req_id>" (else "vtc-<row index>"). Prompt streams
    are keyed by the row index, not by req_id.

    Raises:
      WorkloadError: missing file/column, non-numeric or negative arrival,
        a length not an integer >= 1, empty client, duplicate req_id, or
        nothing left after filtering.
      ValueError: invalid options.
    """
    _check_options(time_scale, window_s, max_requests, max_prompt_len, max_output_len)
    sampler = _TokenSampler(vocab_size, reserved_token_ids)
    path, sha, rows = _vtc_rows(path)
    return _finalize(
        path=path, sha256=sha, source="vtc", rows=rows, units_per_second=_UNITS_PER_SECOND["vtc"],
        prompt_fn=lambda r, n: sampler.draw((seed, _TAG_VTC, r.index), n), id_prefix="vtc",
        time_scale=time_scale, window_s=window_s, max_requests=max_requests,
        max_prompt_len=max_prompt_len, max_output_len=max_output_len, seed=seed,
    )


def _vtc_rows(path: str | Path) -> tuple[Path, str, list[_Row]]:
    """A VTC trace's (path, sha256, rows), `ts` in s (`load_vtc_trace`)."""
    path, data, sha = _read_bytes(path)
    text = _decode(path, data)
    rows, seen = [], {}
    for line, f in _csv_rows(path, text, ("arrival_s", "client", "prompt_len", "output_len")):
        request_id = None
        if "req_id" in f:
            rid = f["req_id"].strip()
            if not rid:
                raise _fail(path, line, "req_id", "must be non-empty", f["req_id"])
            if rid in seen:
                raise _fail(path, line, "req_id",
                            f"must be unique (first seen on line {seen[rid]})", rid)
            seen[rid] = line
            request_id = f"vtc-{rid}"
        client = f["client"].strip()
        if not client:
            raise _fail(path, line, "client", "must be non-empty", f["client"])
        rows.append(_Row(index=len(rows), line=line,
                         ts=_parse_seconds(path, line, "arrival_s", f["arrival_s"]),
                         prompt_len=_parse_length(path, line, "prompt_len", f["prompt_len"]),
                         output_len=_parse_length(path, line, "output_len", f["output_len"]),
                         client=client, request_id=request_id))
    return path, sha, rows


def load_mooncake_trace(
    path: str | Path,
    *,
    bucket_ms: float = 3000.0,
    time_scale: float = 1.0,
    window_s: tuple[float, float] | None = None,
    max_requests: int | None = None,
    max_prompt_len: int | None = None,
    max_output_len: int | None = None,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    reserved_token_ids: frozenset[int] | Sequence[int] = DEFAULT_RESERVED_TOKEN_IDS,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Workload:
    """Mooncake JSONL: `{"timestamp": ms, "input_length", "output_length", "hash_ids"}`.

    Timestamps are quantized to ~3 s buckets. Requests sharing one timestamp
    are spread evenly by FILE ORDER (deterministic, no jitter): the i-th of k
    arrives at ts + i * w / k, with w = min(bucket_ms, next distinct ts - ts)
    (w = bucket_ms for the last bucket), so spreading never reorders buckets.
    Windowing then applies to the spread times.

    `hash_ids` name the 512-token blocks of the prompt; the rule
    `len(hash_ids) == ceil(input_length / 512)` is checked. The prompt is the
    concatenation of one fixed random block per hash id (seeded by
    (seed, hash_id)), cut to input_length (and to max_prompt_len).

    `block_tokens` < 512 shrinks the trace to a smaller context while keeping
    its sharing structure: each hash id becomes `block_tokens` ids and a
    prompt's length scales to ceil(input_length * block_tokens / 512) (so it
    still spans the same hash ids); output lengths are not scaled.

    Raises:
      WorkloadError: missing file, invalid JSON, missing key, wrong type,
        negative timestamp, length not an integer >= 1, hash_ids length
        mismatch, or nothing left after filtering.
      ValueError: invalid options.
    """
    _check_options(time_scale, window_s, max_requests, max_prompt_len, max_output_len)
    if not (math.isfinite(bucket_ms) and bucket_ms >= 0):
        raise ValueError(f"bucket_ms={bucket_ms} must be finite and >= 0")
    if (isinstance(block_tokens, bool) or not isinstance(block_tokens, int)
            or not 1 <= block_tokens <= MOONCAKE_BLOCK_TOKENS):
        raise ValueError(
            f"block_tokens={block_tokens!r} must be an int in [1, {MOONCAKE_BLOCK_TOKENS}]")
    sampler = _TokenSampler(vocab_size, reserved_token_ids)
    path, sha, rows = _mooncake_rows(path, bucket_ms, block_tokens)
    blocks: dict[int, tuple[int, ...]] = {}

    def prompt(r: _Row, n: int) -> tuple[int, ...]:
        out: list[int] = []
        for h in r.hash_ids[: -(-n // block_tokens)]:
            block = blocks.get(h)
            if block is None:
                block = sampler.draw((seed, _TAG_MOONCAKE, h), MOONCAKE_BLOCK_TOKENS)[:block_tokens]
                blocks[h] = block
            out.extend(block)
        return tuple(out[:n])

    return _finalize(
        path=path, sha256=sha, source="mooncake", rows=rows,
        units_per_second=_UNITS_PER_SECOND["mooncake"], prompt_fn=prompt, id_prefix="mooncake",
        time_scale=time_scale, window_s=window_s, max_requests=max_requests,
        max_prompt_len=max_prompt_len, max_output_len=max_output_len, seed=seed,
    )


def _mooncake_rows(path: str | Path, bucket_ms: float = 3000.0,
                   block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> tuple[Path, str, list[_Row]]:
    """A Mooncake trace's (path, sha256, rows), `ts` in ms spread over its
    buckets, prompt lengths scaled to `block_tokens` (`load_mooncake_trace`)."""
    path, data, sha = _read_bytes(path)
    text = _decode(path, data)
    raw = []
    for line, line_text in enumerate(text.splitlines(), start=1):
        if not line_text.strip():
            continue
        try:
            obj = json.loads(line_text)
        except json.JSONDecodeError as e:
            raise _fail(path, line, None, f"must be one JSON object ({e.msg})",
                        line_text[:80]) from None
        if not isinstance(obj, dict):
            raise _fail(path, line, None, "must be a JSON object", line_text[:80])
        for key in ("timestamp", "input_length", "output_length", "hash_ids"):
            if key not in obj:
                raise _fail(path, line, key, "is required", None)
        if isinstance(obj["timestamp"], str):
            raise _fail(path, line, "timestamp", "must be a JSON number >= 0 (ms)",
                        obj["timestamp"])
        ts = _parse_seconds(path, line, "timestamp", obj["timestamp"])
        input_length = _parse_length(path, line, "input_length", obj["input_length"],
                                     json_value=True)
        output_length = _parse_length(path, line, "output_length", obj["output_length"],
                                      json_value=True)
        hash_ids = obj["hash_ids"]
        if not isinstance(hash_ids, list) or any(
                isinstance(h, bool) or not isinstance(h, int) for h in hash_ids):
            raise _fail(path, line, "hash_ids", "must be a list of integers", hash_ids)
        want = -(-input_length // MOONCAKE_BLOCK_TOKENS)
        if len(hash_ids) != want:
            raise _fail(path, line, "hash_ids",
                        f"must have ceil(input_length/{MOONCAKE_BLOCK_TOKENS}) = {want} entries, "
                        f"has {len(hash_ids)}",
                        len(hash_ids))
        raw.append((line, ts, input_length, output_length, tuple(hash_ids)))

    # Spread each same-timestamp group evenly over its bucket, in file order.
    order = sorted(range(len(raw)), key=lambda i: raw[i][1])
    spread_ms = [0.0] * len(raw)
    start = 0
    while start < len(order):
        ts = raw[order[start]][1]
        end = start
        while end < len(order) and raw[order[end]][1] == ts:
            end += 1
        width = bucket_ms if end == len(order) else min(bucket_ms, raw[order[end]][1] - ts)
        k = end - start
        for j in range(k):
            spread_ms[order[start + j]] = ts + width * j / k
        start = end
    scaled = lambda n: -(-n * block_tokens // MOONCAKE_BLOCK_TOKENS)
    rows = [_Row(index=i, line=line, ts=spread_ms[i], prompt_len=scaled(n_in), output_len=n_out,
                 hash_ids=h)
            for i, (line, _, n_in, n_out, h) in enumerate(raw)]
    return path, sha, rows


def arrival_span_s(spec: str, flag: str = "--trace") -> float:
    """Seconds from the first to the last arrival of the ``KIND:PATH`` trace
    ``spec`` (Mooncake's spread over their buckets as its loader spreads
    them), before any window or time scale: the span a replay of the whole
    trace scales. Reads the rows only, no prompt is drawn.

    Raises:
      ValueError: ``trace_loader``'s refusals of ``spec``, naming ``flag``.
      WorkloadError: as the loaders: the file missing or malformed, no rows.
    """
    _, path = trace_loader(spec, flag)
    kind = spec.partition(":")[0]
    read = {"azure": _azure_rows, "mooncake": _mooncake_rows, "vtc": _vtc_rows}[kind]
    path, _, rows = read(path)
    if not rows:
        raise WorkloadError(f"{path}: no data rows")
    stamps = [r.ts for r in rows]
    return (max(stamps) - min(stamps)) / _UNITS_PER_SECOND[kind]


def trace_loader(spec: str, flag: str = "--trace", *, check_file: bool = False):
  """``(loader, path)`` of a ``KIND:PATH`` trace spec (KIND azure, mooncake
  or vtc); with ``check_file``, PATH must name an existing file (checked
  before anything loads, where the loaders' own refusal would not name the
  flag).

  Raises:
    ValueError: naming ``flag``, when KIND is unknown or PATH empty, or
      (``check_file``) PATH is not a file.
  """
  loaders = {"azure": load_azure_trace, "mooncake": load_mooncake_trace, "vtc": load_vtc_trace}
  kind, _, path = spec.partition(":")
  if kind not in loaders or not path:
    raise ValueError(f"{flag} must be KIND:PATH with KIND in {sorted(loaders)}, got {spec!r}")
  if check_file and not Path(path).is_file():
    raise ValueError(f"{flag}: {path!r} (of {spec!r}) is not a file")
  return loaders[kind], path


__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "arrival_span_s",
    "load_azure_trace",
    "load_mooncake_trace",
    "load_vtc_trace",
    "parse_azure_timestamp_ns",
    "trace_loader",
]
