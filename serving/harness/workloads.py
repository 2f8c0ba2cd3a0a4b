"""Workloads: immutable request lists loaded from real traces or synthesised.

A `Workload` is a tuple of `RequestSpec` in arrival order plus the facts needed
to reproduce it (source, file sha256, options). This module holds the record,
declared SLOs (`with_slos`), the context fit rule (`fit_context`) and what
every source shares: the seeded prompt-id sampler with its stream tags, and
the option checks. The sources are `serving.harness.traces` (Azure, VTC and
Mooncake trace files) and `serving.harness.synthetic` (seeded workloads that
need no file); each is a pure function of its options (and file): the same
inputs give the same workload, bit for bit.

Prompt token ids are drawn from a seeded numpy Generator, one stream per
(seed, source tag, key), so the streams of different sources never meet for
one seed; a draw is a prefix of any longer draw from the same stream.

`fit_context(workload, max_model_len)` fits prompt and output together
into an engine's context (`FIT_RULE`): a trace's long prompt is cut so that
its output keeps min(requested, max_model_len // 2) tokens, instead of
leaving one output token after a prompt clipped to the whole context.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Sequence

import numpy as np

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
        reserved = np.asarray(sorted(reserved_token_ids), dtype=np.int64)
        allowed = np.setdiff1d(np.arange(vocab_size), reserved)
        if allowed.size == 0:
            raise ValueError(f"every id in [0, {vocab_size}) is reserved")
        self._ids = np.empty(allowed.size, dtype=object)
        self._ids[:] = [int(i) for i in allowed]

    def draw(self, seed_words: Sequence[int], n: int) -> tuple[int, ...]:
        """n ids from the stream seeded by `seed_words`; a prefix of any longer draw."""
        rng = np.random.default_rng(np.random.SeedSequence(list(seed_words)))
        return tuple(self._ids[rng.integers(0, self._ids.size, size=n)])


# --------------------------------------------------------------------------
# Options every source checks


def _check_options(time_scale, window_s, max_requests, max_prompt_len, max_output_len):
    """Raises ValueError naming the first option out of range (their meaning:
    `serving.harness.traces`); a source that lacks one passes its neutral value."""
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


# --------------------------------------------------------------------------
# Fitting into an engine's context


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

__all__ = [
    "DEFAULT_RESERVED_TOKEN_IDS",
    "DEFAULT_VOCAB_SIZE",
    "RequestSpec",
    "Workload",
    "WorkloadError",
]
