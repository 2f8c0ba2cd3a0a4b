"""The decode step's memory roofline: what a step must read, at the
machine's measured read bandwidth, against what it took.

A decode step of N sequences reads every weight the step's GEMMs use once
(``ModelCosts.weight_bytes_per_step``) and each sequence's cached K and V
(``kv_bytes_per_token`` x its context); no schedule or kernel can make it
faster than those bytes over the memory's read bandwidth. ``bench_engine.py``
reports the floor beside every decode figure and the fraction reached.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def read_bytes_per_s(mib: int = 512, reps: int = 5) -> float:
  """Measured memory read bandwidth (bytes/s): the fastest of ``reps``
  jitted sums over a float32 array of ``mib`` MiB (far beyond the caches),
  after one warm call. A measurement: take it on an idle machine."""
  x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
  f = jax.jit(jnp.sum)
  jax.block_until_ready(f(x))
  best = float("inf")
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f(x))
    best = min(best, time.perf_counter() - t)
  return x.nbytes / best


def decode_roofline(costs, concurrency: int, context: float, decode_tokens_per_s,
                    read_bps: float) -> dict:
  """The floor of one decode step beside the step measured.

  Args:
    costs: ``serving.engine.cost_model.ModelCosts`` of the engine.
    concurrency: sequences per decode step (N).
    context: mean cached tokens per sequence over the run.
    decode_tokens_per_s: measured decode tokens/s (None: not measured).
    read_bps: the machine's read bandwidth (bytes/s, ``read_bytes_per_s``).

  Returns:
    {weight_bytes_per_step, kv_bytes_per_step (N x context x KV bytes per
    token), floor_ms_weights (weights alone), floor_ms (weights and KV),
    step_ms (N / tokens/s), fraction (floor_ms / step_ms: 1.0 is at the
    roofline), fraction_weights}; the last three None without a rate.
  """
  weights = float(costs.weight_bytes_per_step)
  kv = concurrency * context * costs.kv_bytes_per_token
  row = {"weight_bytes_per_step": weights, "kv_bytes_per_step": kv,
         "floor_ms_weights": weights / read_bps * 1e3,
         "floor_ms": (weights + kv) / read_bps * 1e3,
         "step_ms": None, "fraction": None, "fraction_weights": None}
  if decode_tokens_per_s:
    row["step_ms"] = concurrency / decode_tokens_per_s * 1e3
    row["fraction"] = row["floor_ms"] / row["step_ms"]
    row["fraction_weights"] = row["floor_ms_weights"] / row["step_ms"]
  return row
