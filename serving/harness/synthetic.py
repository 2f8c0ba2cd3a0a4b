"""Synthetic workloads that need no trace file, each a seeded `Workload`
(`serving.harness.workloads`): `synthetic_azure_conv`, shaped like the Azure
2023 conversation trace from its summary figures, and
`synthetic_shared_prefix`, requests that share system prompts (the
prefix-caching workload). `synthetic_azure_conv` can also draw each
request's client and priority (`client_shares`, `num_priorities`: a
fairness or priority study without a trace); SLO classes are declared on
any workload by `workloads.with_slos` (`--slo_class`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from serving.harness.workloads import (
    _TAG_SYNTHETIC,
    _TAG_SYNTHETIC_ARRIVALS,
    _TAG_SYSTEM_PROMPT,
    _TAG_USER_TURN,
    DEFAULT_RESERVED_TOKEN_IDS,
    DEFAULT_VOCAB_SIZE,
    RequestSpec,
    Workload,
    _check_options,
    _TokenSampler,
)


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
    "length_quantiles": (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95,
                         0.99, 1.0),
    "prompt_len": (2, 29, 181, 207, 387, 403, 703, 1020, 1071, 1130, 1315, 2735, 4083, 4142, 14050),
    "output_len": (7, 16, 41, 54, 77, 91, 103, 129, 177, 384, 400, 424, 451, 601, 1000),
}


# Seeds the client and priority draws apart from arrivals and lengths, so a
# workload with clients has the same arrivals, lengths and prompts as one
# without.
_TAG_SYNTHETIC_TENANTS = 8


def check_tenants(client_shares: Sequence[float] | None, num_priorities: int) -> None:
    """Raises ValueError naming the argument unless every client share is
    finite and > 0 and ``num_priorities >= 1``."""
    if client_shares is not None:
        if not client_shares or any(not (math.isfinite(w) and w > 0) for w in client_shares):
            raise ValueError(f"client_shares={list(client_shares)} must be one or more "
                             f"weights, each finite and > 0")
    if num_priorities < 1:
        raise ValueError(f"num_priorities={num_priorities} must be >= 1")


def client_shares(num_clients: int | None,
                  weights: Sequence[str] | None) -> list[float] | None:
    """Client weights from a count (equal shares) or weight strings (which
    win); None when neither is given.

    Raises:
      ValueError: starting with the field, ``clients`` below 1 or
        ``client_shares`` not weights each finite and > 0.
    """
    if weights is None:
        if num_clients is not None and num_clients < 1:
            raise ValueError(f"clients must be >= 1, got {num_clients}")
        return None if num_clients is None else [1.0] * num_clients
    try:
        shares = [float(w) for w in weights]
        check_tenants(shares, 1)
    except ValueError:
        raise ValueError(f"client_shares must be weights W0,W1,... each finite and > 0, "
                         f"got {','.join(weights)!r}") from None
    return shares


def draw_tenants(seed: int, num_requests: int, client_shares: Sequence[float] | None,
                 num_priorities: int) -> tuple[list[str], list[int]]:
    """(clients, priorities) of ``num_requests`` requests: client ``c{k}``
    with probability ``client_shares[k] / sum`` (all "default" when None)
    and a priority uniform in ``[0, num_priorities)``, seeded by ``seed``."""
    check_tenants(client_shares, num_priorities)
    rng = np.random.default_rng(np.random.SeedSequence([seed, _TAG_SYNTHETIC_TENANTS]))
    if client_shares is None:
        clients = ["default"] * num_requests
    else:
        p = np.asarray(client_shares, np.float64)
        clients = [f"c{k}" for k in rng.choice(len(p), size=num_requests, p=p / p.sum())]
    priorities = rng.integers(0, num_priorities, size=num_requests).tolist()
    return clients, [int(x) for x in priorities]


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
    client_shares: Sequence[float] | None = None,
    num_priorities: int = 1,
) -> Workload:
    """A seeded workload shaped like the Azure 2023 conversation trace.

    Arrivals: a gamma renewal process with the trace's shape (0.871) and rate
    `5.530 * rate_scale` req/s (rate_scale > 1 = more load); first request at
    0 s. Lengths: independent inverse-CDF draws from the trace's quantiles
    (`AZURE_CONV_2023_SUMMARY`), then prompts cut to `max_prompt_len` (flagged
    clipped) and outputs capped at `max_output_len`. Needs no trace file.
    The Workload records `time_scale = 1 / rate_scale` (gaps relative to the
    trace's rate). Clients and priorities (`draw_tenants`): with
    `client_shares` each request's client is `c{k}` with probability
    proportional to `client_shares[k]` (else "default"); its priority is
    uniform in `[0, num_priorities)` (lower runs first). They are drawn apart
    from the rest, which does not change with them.

    The defaults (64 requests, ~0.55 req/s so ~2 min of arrivals, prompts
    <= 1024 and outputs <= 128 tokens) keep a replay on a 135M model on two
    CPU cores to a few minutes.

    Raises:
      ValueError: num_requests < 1, rate_scale not finite > 0, bad caps,
        client shares or priorities (`check_tenants`).
    """
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise ValueError(f"rate_scale={rate_scale} must be finite and > 0")
    _check_options(1.0, None, None, max_prompt_len, max_output_len)
    clients, priorities = draw_tenants(seed, num_requests, client_shares, num_priorities)
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
        n_in = int(prompt_lens[i])
        n_in = n_in if max_prompt_len is None else min(n_in, max_prompt_len)
        n_out = int(output_lens[i])
        n_out = n_out if max_output_len is None else min(n_out, max_output_len)
        num_clipped += n_in < prompt_lens[i]
        num_capped += n_out < output_lens[i]
        requests.append(RequestSpec(
            request_id=f"synthetic-{i}",
            arrival_s=float(arrivals[i]),
            prompt_token_ids=sampler.draw((seed, _TAG_SYNTHETIC, i), n_in),
            max_tokens=n_out,
            ignore_eos=True,
            client=clients[i],
            priority=priorities[i],
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
    "synthetic_azure_conv",
    "synthetic_shared_prefix",
]
