"""Workloads: immutable request lists loaded from real traces or synthesised.

A `Workload` is a tuple of `RequestSpec` in arrival order plus the facts needed
to reproduce it (source, file sha256, options). Loaders are pure functions of
(path, options): the same file and options give the same workload, bit for bit.

Traces carry lengths and arrival times, never text, so prompt token ids are
drawn from a seeded numpy Generator:

* Azure / VTC / synthetic: one stream per request, seeded by
  (seed, source tag, row index), so a request's prompt does not depend on which
  other rows a window or cap kept. A clipped prompt is the prefix of the
  unclipped one (numpy draws bounded integers sequentially; a test checks it).
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

`fit_context(workload, max_model_len)` then fits prompt and output together
into an engine's context (`FIT_RULE`): a trace's long prompt is cut so that
its output keeps min(requested, max_model_len // 2) tokens, instead of
leaving one output token after a prompt clipped to the whole context.

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
from typing import Callable, Iterator, Sequence

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512
DEFAULT_VOCAB_SIZE = 49152  # SmolLM2 tokenizer.
# SmolLM2 keeps its special tokens (<|endoftext|>=0, <|im_start|>=1,
# <|im_end|>=2 (EOS), ...) in ids 0..16; random prompts never contain them.
DEFAULT_RESERVED_TOKEN_IDS = frozenset(range(17))

# Stream tags keep the prompt streams of different sources apart for one seed.
_TAG_AZURE, _TAG_VTC, _TAG_MOONCAKE, _TAG_SYNTHETIC = 1, 2, 3, 4
_TAG_SYNTHETIC_ARRIVALS = 5
_TAG_SYSTEM_PROMPT, _TAG_USER_TURN = 6, 7


class WorkloadError(ValueError):
    """A trace file is missing, malformed, or leaves no request after filtering."""


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    Attributes:
      request_id: unique within the workload.
      arrival_s: seconds from workload start (first request at 0.0 for traces).
      prompt_token_ids: prompt ids, len >= 1, each in [0, vocab_size) and not
        a reserved (special) id.
      max_tokens: output length to generate, >= 1.
      ignore_eos: True for trace replays (the trace fixes the output length).
      client: tenant name; "default" when the trace has none.
      priority: scheduling priority (0 unless a source says otherwise).
      clipped: the trace prompt was longer than `max_prompt_len` and was cut.
      slo_ttft_ms, slo_tpot_ms: declared SLO limits (ms; None = none): the
        first token from arrival, each later token from the previous one
        (§0x07); set by `with_slos`.
    """

    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = True
    client: str = "default"
    priority: int = 0
    clipped: bool = False
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def __post_init__(self):
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            limit = getattr(self, name)
            if limit is not None and not (math.isfinite(limit) and limit > 0):
                raise ValueError(f"{self.request_id}: {name}={limit} must be finite and > 0")
        if not self.prompt_token_ids:
            raise ValueError(f"{self.request_id}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"{self.request_id}: max_tokens={self.max_tokens} < 1")
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0.0):
            raise ValueError(f"{self.request_id}: arrival_s={self.arrival_s} not finite >= 0")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclasses.dataclass(frozen=True)
class Workload:
    """An immutable, arrival-ordered list of requests plus how it was made.

    Attributes:
      requests: `RequestSpec`s sorted by (arrival_s, file order).
      source: loader name, e.g. "azure_llm_inference", "mooncake", "vtc",
        "synthetic_azure_conv".
      path: the trace file read, or None for synthetic workloads.
      sha256: hex digest of that file's bytes, or None.
      num_rows_read: data rows parsed from the file (before any filter).
      num_clipped: requests whose prompt was cut to `max_prompt_len`.
      num_output_capped: requests whose output was cut to `max_output_len`.
      time_scale: multiplier applied to inter-arrival gaps.
      window_s: the (a, b) window applied, or None.
      seed: seed of the prompt-id (and synthetic arrival) streams.
      max_prompt_len / max_output_len: caps applied, or None.
      max_model_len: the context `fit_context` fitted the requests into, or
        None (not fitted).
      num_context_fitted: requests whose prompt or output `fit_context` cut.
    """

    requests: tuple[RequestSpec, ...]
    source: str
    path: str | None
    sha256: str | None
    num_rows_read: int
    num_clipped: int
    num_output_capped: int
    time_scale: float
    window_s: tuple[float, float] | None
    seed: int
    max_prompt_len: int | None
    max_output_len: int | None
    max_model_len: int | None = None
    num_context_fitted: int = 0

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[RequestSpec]:
        return iter(self.requests)

    def __getitem__(self, i: int) -> RequestSpec:
        return self.requests[i]

    @property
    def duration_s(self) -> float:
        """Arrival time of the last request (s)."""
        return self.requests[-1].arrival_s

    def describe(self) -> dict:
        """JSON-ready metadata (no token ids), e.g. for a metrics report's config."""
        return {
            "source": self.source,
            "path": self.path,
            "sha256": self.sha256,
            "num_rows_read": self.num_rows_read,
            "num_requests": len(self.requests),
            "num_clipped": self.num_clipped,
            "num_output_capped": self.num_output_capped,
            "time_scale": self.time_scale,
            "window_s": list(self.window_s) if self.window_s is not None else None,
            "seed": self.seed,
            "max_prompt_len": self.max_prompt_len,
            "max_output_len": self.max_output_len,
            "max_model_len": self.max_model_len,
            "num_context_fitted": self.num_context_fitted,
            "total_prompt_tokens": sum(r.prompt_len for r in self.requests),
            "total_max_tokens": sum(r.max_tokens for r in self.requests),
            "last_arrival_s": self.duration_s,
        }


# --------------------------------------------------------------------------
# Service-level objectives


@dataclasses.dataclass(frozen=True)
class SloClass:
    """A named pair of SLO limits (ms), e.g. interactive:500:100."""

    name: str
    ttft_ms: float
    tpot_ms: float


def parse_slo_classes(text: str) -> tuple[SloClass, ...]:
    """`NAME:TTFT_MS:TPOT_MS[,...]` -> SloClasses.

    Raises:
      ValueError: a malformed or empty entry, a limit not > 0, or a repeated name.
    """
    classes = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            raise ValueError(f"slo_class {text!r} has an empty entry; entries are "
                             f"NAME:TTFT_MS:TPOT_MS separated by single commas")
        parts = entry.split(":")
        try:
            name, ttft, tpot = parts[0], float(parts[1]), float(parts[2])
            if len(parts) != 3 or not name:
                raise IndexError
        except (IndexError, ValueError):
            raise ValueError(f"slo_class entry {entry!r} must be NAME:TTFT_MS:TPOT_MS") from None
        if not (math.isfinite(ttft) and ttft > 0 and math.isfinite(tpot) and tpot > 0):
            raise ValueError(f"slo_class {name!r}: limits must be finite and > 0 ms, "
                             f"got {ttft}:{tpot}")
        if name in {c.name for c in classes}:
            raise ValueError(f"slo_class {name!r} is given twice")
        classes.append(SloClass(name, ttft, tpot))
    if not classes:
        raise ValueError("slo_class needs at least one NAME:TTFT_MS:TPOT_MS entry")
    return tuple(classes)


def with_slos(
    workload: Workload,
    *,
    ttft_ms: float | None = None,
    tpot_ms: float | None = None,
    classes: Sequence[SloClass] = (),
) -> Workload:
    """The workload with declared SLOs on every request (§0x07).

    Either one pair of limits for all (`ttft_ms`, `tpot_ms`; either may be
    None), or `classes`, picked per request by this rule: a request whose
    client names a class takes that class; every other request takes the
    classes in the given order, cycling by its arrival index (request i
    takes class i mod len(classes)).

    Raises:
      ValueError: both forms given, or a limit not finite and > 0.
    """
    if classes and (ttft_ms is not None or tpot_ms is not None):
        raise ValueError("give either slo_ttft_ms / slo_tpot_ms or slo_class, not both")
    by_name = {c.name: c for c in classes}
    requests = []
    for i, spec in enumerate(workload.requests):
        if classes:
            c = by_name.get(spec.client, classes[i % len(classes)])
            limits = (c.ttft_ms, c.tpot_ms)
        else:
            limits = (ttft_ms, tpot_ms)
        requests.append(dataclasses.replace(spec, slo_ttft_ms=limits[0], slo_tpot_ms=limits[1]))
    return dataclasses.replace(workload, requests=tuple(requests))


# --------------------------------------------------------------------------
# Prompt token ids


class _TokenSampler:
    """Draws prompt ids uniformly from [0, vocab_size) minus reserved ids.

    Ids are handed out as shared Python int objects, so a workload holds one
    8-byte reference per prompt token rather than one int object per token.
    """

    def __init__(self, vocab_size: int, reserved_token_ids: frozenset[int] | Sequence[int]):
        if vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size} must be >= 1")
        allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(sorted(reserved_token_ids), dtype=np.int64))
        if allowed.size == 0:
            raise ValueError(f"every id in [0, {vocab_size}) is reserved")
        self._ids = np.empty(allowed.size, dtype=object)
        self._ids[:] = [int(i) for i in allowed]

    def draw(self, seed_words: Sequence[int], n: int) -> tuple[int, ...]:
        """n ids from the stream seeded by `seed_words`; a prefix of any longer draw."""
        rng = np.random.default_rng(np.random.SeedSequence(list(seed_words)))
        return tuple(self._ids[rng.integers(0, self._ids.size, size=n)])


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


def _fail(path: Path, line: int, field: str, rule: str, value) -> WorkloadError:
    return WorkloadError(f"{path}:{line}: field {field!r} {rule} (got {value!r})")


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


def _csv_rows(path: Path, text: str, required: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
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


def _check_options(time_scale, window_s, max_requests, max_prompt_len, max_output_len):
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale={time_scale} must be finite and > 0")
    if window_s is not None:
        a, b = window_s
        if not (0 <= a < b):
            raise ValueError(f"window_s={window_s} must satisfy 0 <= a < b")
    for name, v in (("max_requests", max_requests), ("max_prompt_len", max_prompt_len),
                    ("max_output_len", max_output_len)):
        if v is not None and v < 1:
            raise ValueError(f"{name}={v} must be >= 1 or None")


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
    """
    num_rows_read = len(rows)
    if not rows:
        raise WorkloadError(f"{path}: no data rows")
    rows = sorted(rows, key=lambda r: r.ts)  # stable: ties keep file order
    t0 = rows[0].ts
    if window_s is not None:
        a, b = window_s
        rows = [r for r in rows if a <= (r.ts - t0) / units_per_second < b]
        if not rows:
            raise WorkloadError(f"{path}: no request in window_s={window_s} (trace starts at offset 0)")
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


FIT_RULE = ("prompt + output <= max_model_len: the output keeps min(requested, "
            "max_model_len // 2) tokens, the prompt is cut to the rest, and the output "
            "then takes what the prompt leaves, up to its request")


def fit_context(workload: Workload, max_model_len: int) -> Workload:
    """Fits every request's prompt and output into a context of
    `max_model_len` tokens (the engine's rule: prompt + max_tokens <=
    max_model_len), by `FIT_RULE`. For a request of prompt P and output O
    (after `max_output_len`) and L = max_model_len:

      keep = min(O, L // 2);  prompt = min(P, L - keep);  output = min(O, L - prompt)

    so a request that fits is unchanged, and a trace's long prompt no longer
    takes the whole context and leaves one output token (which makes TPOT and
    ITL meaningless). A cut prompt is the prefix of the original (shared
    prefixes stay shared) and is flagged `clipped`; a cut output counts in
    `num_output_capped`.

    Args:
      workload: any workload.
      max_model_len: the context (tokens), >= 2.
    Returns:
      the fitted Workload (`max_model_len` set, `num_context_fitted` the
      requests it changed); `fit_note` says what it did in one line.
    Raises:
      ValueError: max_model_len < 2.
    """
    if max_model_len < 2:
        raise ValueError(f"fit_context: max_model_len={max_model_len} must be >= 2 "
                         f"(one prompt and one output token)")
    requests, clipped, capped, fitted = [], 0, 0, 0
    for r in workload.requests:
        keep = min(r.max_tokens, max_model_len // 2)
        n_in = min(r.prompt_len, max_model_len - keep)
        n_out = min(r.max_tokens, max_model_len - n_in)
        if (n_in, n_out) == (r.prompt_len, r.max_tokens):
            requests.append(r)
            continue
        fitted += 1
        clipped += n_in < r.prompt_len and not r.clipped
        capped += n_out < r.max_tokens
        requests.append(dataclasses.replace(
            r, prompt_token_ids=r.prompt_token_ids[:n_in], max_tokens=n_out,
            clipped=r.clipped or n_in < r.prompt_len))
    return dataclasses.replace(
        workload, requests=tuple(requests), num_clipped=workload.num_clipped + clipped,
        num_output_capped=workload.num_output_capped + capped,
        max_model_len=max_model_len, num_context_fitted=workload.num_context_fitted + fitted)


def fit_note(workload: Workload) -> str | None:
    """One line saying what `fit_context` cut (and by which rule), or None
    when it cut nothing."""
    if not workload.num_context_fitted:
        return None
    reqs, n = workload.requests, workload.max_model_len
    return (f"note: {workload.num_context_fitted} of {len(reqs)} requests cut to fit "
            f"max_model_len={n} (prompt + output <= {n}, each output keeping "
            f"min(requested, {n // 2}) tokens): prompts now "
            f"{min(r.prompt_len for r in reqs)}-{max(r.prompt_len for r in reqs)}, outputs "
            f"{min(r.max_tokens for r in reqs)}-{max(r.max_tokens for r in reqs)} tokens")


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
    path, data, sha = _read_bytes(path)
    text = _decode(path, data)
    rows = []
    for line, f in _csv_rows(path, text, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        try:
            ts = parse_azure_timestamp_ns(f["TIMESTAMP"])
        except ValueError as e:
            raise _fail(path, line, "TIMESTAMP", f"must be a timestamp 'YYYY-MM-DD HH:MM:SS.fffffff' ({e})",
                        f["TIMESTAMP"]) from None
        rows.append(_Row(index=len(rows), line=line, ts=ts,
                         prompt_len=_parse_length(path, line, "ContextTokens", f["ContextTokens"]),
                         output_len=_parse_length(path, line, "GeneratedTokens", f["GeneratedTokens"])))
    return _finalize(
        path=path, sha256=sha, source="azure_llm_inference", rows=rows, units_per_second=1e9,
        prompt_fn=lambda r, n: sampler.draw((seed, _TAG_AZURE, r.index), n), id_prefix="azure",
        time_scale=time_scale, window_s=window_s, max_requests=max_requests,
        max_prompt_len=max_prompt_len, max_output_len=max_output_len, seed=seed,
    )


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
                raise _fail(path, line, "req_id", f"must be unique (first seen on line {seen[rid]})", rid)
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
    return _finalize(
        path=path, sha256=sha, source="vtc", rows=rows, units_per_second=1.0,
        prompt_fn=lambda r, n: sampler.draw((seed, _TAG_VTC, r.index), n), id_prefix="vtc",
        time_scale=time_scale, window_s=window_s, max_requests=max_requests,
        max_prompt_len=max_prompt_len, max_output_len=max_output_len, seed=seed,
    )


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
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or not 1 <= block_tokens <= MOONCAKE_BLOCK_TOKENS:
        raise ValueError(f"block_tokens={block_tokens!r} must be an int in [1, {MOONCAKE_BLOCK_TOKENS}]")
    sampler = _TokenSampler(vocab_size, reserved_token_ids)
    path, data, sha = _read_bytes(path)
    text = _decode(path, data)
    raw = []
    for line, line_text in enumerate(text.splitlines(), start=1):
        if not line_text.strip():
            continue
        try:
            obj = json.loads(line_text)
        except json.JSONDecodeError as e:
            raise _fail(path, line, "<json>", f"must be one JSON object per line ({e.msg})", line_text[:80]) from None
        if not isinstance(obj, dict):
            raise _fail(path, line, "<json>", "must be a JSON object", line_text[:80])
        for key in ("timestamp", "input_length", "output_length", "hash_ids"):
            if key not in obj:
                raise _fail(path, line, key, "is required", None)
        if isinstance(obj["timestamp"], str):
            raise _fail(path, line, "timestamp", "must be a JSON number >= 0 (ms)", obj["timestamp"])
        ts = _parse_seconds(path, line, "timestamp", obj["timestamp"])
        input_length = _parse_length(path, line, "input_length", obj["input_length"], json_value=True)
        output_length = _parse_length(path, line, "output_length", obj["output_length"], json_value=True)
        hash_ids = obj["hash_ids"]
        if not isinstance(hash_ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in hash_ids):
            raise _fail(path, line, "hash_ids", "must be a list of integers", hash_ids)
        want = -(-input_length // MOONCAKE_BLOCK_TOKENS)
        if len(hash_ids) != want:
            raise _fail(path, line, "hash_ids",
                        f"must have ceil(input_length/{MOONCAKE_BLOCK_TOKENS}) = {want} entries, has {len(hash_ids)}",
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
    rows = [_Row(index=i, line=line, ts=spread_ms[i], prompt_len=scaled(n_in), output_len=n_out, hash_ids=h)
            for i, (line, _, n_in, n_out, h) in enumerate(raw)]

    blocks: dict[int, tuple[int, ...]] = {}

    def prompt(r: _Row, n: int) -> tuple[int, ...]:
        out: list[int] = []
        for h in r.hash_ids[: -(-n // block_tokens)]:
            block = blocks.get(h)
            if block is None:
                block = blocks[h] = sampler.draw((seed, _TAG_MOONCAKE, h), MOONCAKE_BLOCK_TOKENS)[:block_tokens]
            out.extend(block)
        return tuple(out[:n])

    return _finalize(
        path=path, sha256=sha, source="mooncake", rows=rows, units_per_second=1e3,
        prompt_fn=prompt, id_prefix="mooncake",
        time_scale=time_scale, window_s=window_s, max_requests=max_requests,
        max_prompt_len=max_prompt_len, max_output_len=max_output_len, seed=seed,
    )


# --------------------------------------------------------------------------
# Embedded synthetic default

# Summary figures of the Azure LLM inference trace 2023, conversation service:
# AzureLLMInferenceTrace_conv.csv (Azure/AzurePublicDataset @ b469a113,
# CC-BY-4.0), sha256 2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8.
# Computed once with numpy/scipy over all 19,366 rows:
#   * rate = (n - 1) / (last ts - first ts) with exact 100 ns timestamps
#     (3501.72 s span); inter-arrival gaps: mean 0.1808 s, CV 1.094; a gamma
#     fit (scipy.stats.gamma.fit, loc fixed at 0, MLE) gives shape 0.871,
#     i.e. slightly burstier than Poisson. Per-minute counts vary more than a
#     stationary renewal process would (std 82 around a mean of 328); the
#     synthetic process is stationary and does not model that drift.
#   * length quantiles: np.quantile(x, LENGTH_QUANTILES, method="inverted_cdf")
#     of ContextTokens and GeneratedTokens (observed values). Log-lengths of
#     prompt and output are nearly uncorrelated (Pearson 0.087), so the
#     synthetic workload samples them independently.
AZURE_CONV_2023_SUMMARY = {
    "sha256": "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
    "num_requests": 19366,
    "span_s": 3501.72,
    "rate_per_s": 5.530,
    "interarrival_gamma_shape": 0.871,
    "length_quantiles": (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
    "prompt_len": (2, 29, 181, 207, 387, 403, 703, 1020, 1071, 1130, 1315, 2735, 4083, 4142, 14050),
    "output_len": (7, 16, 41, 54, 77, 91, 103, 129, 177, 384, 400, 424, 451, 601, 1000),
}


def _sample_lengths(rng: np.random.Generator, n: int, knots: Sequence[int]) -> np.ndarray:
    """Inverse-CDF draws, linear in log-length between the summary quantiles. i64[n]."""
    q = np.asarray(AZURE_CONV_2023_SUMMARY["length_quantiles"])
    log_knots = np.log(np.asarray(knots, dtype=np.float64))
    values = np.exp(np.interp(rng.random(n), q, log_knots))
    return np.maximum(1, np.rint(values)).astype(np.int64)


def synthetic_azure_conv(
    num_requests: int = 64,
    rate_scale: float = 0.1,
    seed: int = 0,
    *,
    max_prompt_len: int | None = 1024,
    max_output_len: int | None = 128,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    reserved_token_ids: frozenset[int] | Sequence[int] = DEFAULT_RESERVED_TOKEN_IDS,
) -> Workload:
    """A seeded workload shaped like the Azure 2023 conversation trace.

    Arrivals: a gamma renewal process with the trace's shape (0.871) and rate
    `5.530 * rate_scale` req/s (rate_scale > 1 = more load); first request at
    0 s. Lengths: independent inverse-CDF draws from the trace's quantiles
    (`AZURE_CONV_2023_SUMMARY`), then prompts cut to `max_prompt_len` (flagged
    clipped) and outputs capped at `max_output_len`. Needs no trace file.
    The Workload records `time_scale = 1 / rate_scale` (gaps relative to the
    trace's rate).

    The defaults (64 requests, ~0.55 req/s so ~2 min of arrivals, prompts
    <= 1024 and outputs <= 128 tokens) keep a replay on a 135M model on two
    CPU cores to a few minutes.

    Raises:
      ValueError: num_requests < 1, rate_scale not finite > 0, bad caps.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise ValueError(f"rate_scale={rate_scale} must be finite and > 0")
    _check_options(1.0, None, None, max_prompt_len, max_output_len)
    sampler = _TokenSampler(vocab_size, reserved_token_ids)
    s = AZURE_CONV_2023_SUMMARY
    rng = np.random.default_rng(np.random.SeedSequence([seed, _TAG_SYNTHETIC_ARRIVALS]))
    shape = s["interarrival_gamma_shape"]
    mean_gap_s = 1.0 / (s["rate_per_s"] * rate_scale)
    gaps = rng.gamma(shape, mean_gap_s / shape, size=num_requests - 1)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps)])
    prompt_lens = _sample_lengths(rng, num_requests, s["prompt_len"])
    output_lens = _sample_lengths(rng, num_requests, s["output_len"])
    requests, num_clipped, num_capped = [], 0, 0
    for i in range(num_requests):
        n_in = int(prompt_lens[i]) if max_prompt_len is None else min(int(prompt_lens[i]), max_prompt_len)
        n_out = int(output_lens[i]) if max_output_len is None else min(int(output_lens[i]), max_output_len)
        num_clipped += n_in < prompt_lens[i]
        num_capped += n_out < output_lens[i]
        requests.append(RequestSpec(
            request_id=f"synthetic-{i}",
            arrival_s=float(arrivals[i]),
            prompt_token_ids=sampler.draw((seed, _TAG_SYNTHETIC, i), n_in),
            max_tokens=n_out,
            ignore_eos=True,
            clipped=bool(n_in < prompt_lens[i]),
        ))
    return Workload(
        requests=tuple(requests), source="synthetic_azure_conv", path=None, sha256=None,
        num_rows_read=0, num_clipped=int(num_clipped), num_output_capped=int(num_capped),
        time_scale=1.0 / rate_scale, window_s=None, seed=seed,
        max_prompt_len=max_prompt_len, max_output_len=max_output_len,
    )


def synthetic_shared_prefix(
    num_requests: int = 32,
    system_prompt_len: int = 256,
    num_system_prompts: int = 2,
    user_len: tuple[int, int] = (16, 64),
    max_output_len: int = 16,
    rate_per_s: float = 1.0,
    seed: int = 0,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    reserved_token_ids: frozenset[int] | Sequence[int] = DEFAULT_RESERVED_TOKEN_IDS,
) -> Workload:
    """Requests that share system prompts: the prefix-caching workload.

    Request i's prompt is system prompt ``i % num_system_prompts`` (a fixed
    draw of ``system_prompt_len`` ids per system prompt, seeded by (seed,
    tag, index)) followed by its own user turn of a uniform length in
    ``user_len`` (inclusive). Arrivals are a Poisson process at
    ``rate_per_s``; outputs are ``max_output_len`` tokens (ignore EOS).

    Raises:
      ValueError: a count or length below 1 (system_prompt_len may be 0),
        an empty user_len range, rate not finite > 0.
    """
    lo, hi = user_len
    if num_requests < 1 or num_system_prompts < 1 or max_output_len < 1:
        raise ValueError(f"num_requests={num_requests}, num_system_prompts="
                         f"{num_system_prompts} and max_output_len={max_output_len} must be >= 1")
    if system_prompt_len < 0 or not 1 <= lo <= hi:
        raise ValueError(f"system_prompt_len={system_prompt_len} must be >= 0 and user_len="
                         f"{user_len} a range 1 <= lo <= hi")
    if not (math.isfinite(rate_per_s) and rate_per_s > 0):
        raise ValueError(f"rate_per_s={rate_per_s} must be finite and > 0")
    sampler = _TokenSampler(vocab_size, reserved_token_ids)
    systems = [sampler.draw((seed, _TAG_SYSTEM_PROMPT, k), system_prompt_len)
               for k in range(num_system_prompts)]
    rng = np.random.default_rng(np.random.SeedSequence([seed, _TAG_SYNTHETIC_ARRIVALS]))
    arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate_per_s,
                                                                num_requests - 1))])
    lengths = rng.integers(lo, hi + 1, size=num_requests)
    requests = tuple(RequestSpec(
        request_id=f"shared-prefix-{i}", arrival_s=float(arrivals[i]),
        prompt_token_ids=systems[i % num_system_prompts] + sampler.draw(
            (seed, _TAG_USER_TURN, i), int(lengths[i])),
        max_tokens=max_output_len, ignore_eos=True) for i in range(num_requests))
    return Workload(
        requests=requests, source="synthetic_shared_prefix", path=None, sha256=None,
        num_rows_read=0, num_clipped=0, num_output_capped=0, time_scale=1.0,
        window_s=None, seed=seed, max_prompt_len=None, max_output_len=max_output_len)


__all__ = [
    "AZURE_CONV_2023_SUMMARY",
    "DEFAULT_RESERVED_TOKEN_IDS",
    "DEFAULT_VOCAB_SIZE",
    "MOONCAKE_BLOCK_TOKENS",
    "RequestSpec",
    "Workload",
    "WorkloadError",
    "load_azure_trace",
    "load_mooncake_trace",
    "load_vtc_trace",
    "parse_azure_timestamp_ns",
    "synthetic_azure_conv",
    "synthetic_shared_prefix",
]
