"""The launchers' warm-up: every program an engine will run, compiled
before the first request (``launch.warmup``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from serving.engine.config import SamplingParams
from serving.engine.engine import Engine
from serving.kv import transfer


def warmup(engine: Engine, num_requests: int = 0) -> dict:
  """Compiles every token-row bucket once, on throwaway engines of the same
  configs (which share compiled programs), for every slot-table size the
  engine can grow to while ``num_requests`` requests queue: per size the
  ``plan`` and every bucket's ``step`` program (``Engine.compile_buckets``),
  the arrival, release and prefix-cache writers (a decode engine's through
  a handoff) and the client eviction. Later, only preemptions and
  ``DEVICE_REBASE_MS`` compile (small model-free programs). The throwaway
  engines run on the engine's own KV cache (``Engine(kv=...)``: no copy of
  it is allocated, nor kept mapped by ``hostmem.keep_freed_pages``), so the
  engine must not have run yet.

  Returns:
    {bucket: seconds} summed over the sizes (compile + one empty run).
  Raises:
    ValueError: the engine has run or holds requests (the warm-up's rows
      would overwrite its pages).
  """
  if engine.num_iterations or engine.requests:
    raise ValueError("launch.warmup needs an engine that has not run: its throwaway "
                     "engines write the KV cache the engine lends them")
  c = engine.config
  sizes, size = [c.max_request_slots], c.max_request_slots
  while size < min(num_requests, c.max_queued_requests):
    size = min(2 * size, c.max_queued_requests)
    sizes.append(size)
  rng = np.random.default_rng(0)
  seconds = {}
  greedy = SamplingParams(max_tokens=2, ignore_eos=True)
  n = max(1, min(c.token_buckets[-1], c.max_model_len - 2))
  ids = rng.integers(20, min(1000, engine.model_cfg.vocab_size), size=n).tolist()
  for size in sizes:
    scratch = Engine(engine.model_cfg, engine.params,
                     dataclasses.replace(c, max_request_slots=size), kv=engine.kv)
    try:
      for bucket, s in scratch.compile_buckets().items():
        seconds[bucket] = round(seconds.get(bucket, 0.0) + s, 2)
      for name in ("warmup", "warmup-hit"):    # the second one hits the cache
        if c.role == "decode":                # takes handoffs only: zero pages will do
          scratch.add_handoff(transfer.zero_handoff(f"{name}-{size}", ids, greedy, scratch))
        else:
          scratch.add_request(f"{name}-{size}", ids, greedy)
        scratch.run()
      for request_id in list(scratch.requests):
        scratch.evict(request_id)
    finally:
      engine.kv = scratch.kv        # the steps donated the buffer they were lent
  print(f"compiled token buckets (s): {seconds} for slot tables {sizes}")
  return seconds
