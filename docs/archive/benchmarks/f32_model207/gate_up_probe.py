"""One layer's projections at 256 rows, separate weights against one
concatenated weight (q/k/v; gate/up with the SiLU), XLA dots on the CPU:
the best of 5 x 30 calls each (benchmarks-log.md, "Where a 256-row
prefill step goes"). Run alone: ``.venv/bin/python THIS_FILE``."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

ROWS, D, KV, FFN = 256, 576, 192, 1536        # SmolLM2-135M's shapes


def bench(f, *args, n=30):
  f(*args).block_until_ready()
  best = float("inf")
  for _ in range(5):
    t = time.perf_counter()
    for _ in range(n):
      r = f(*args)
    r.block_until_ready()
    best = min(best, (time.perf_counter() - t) / n)
  return best * 1e3


def main():
  rng = np.random.default_rng(0)
  weight = lambda n: jnp.asarray(rng.standard_normal((D, n)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((ROWS, D)), jnp.float32)
  wq, wk, wv, wg, wu = weight(D), weight(KV), weight(KV), weight(FFN), weight(FFN)
  wqkv, wgu = jnp.concatenate([wq, wk, wv], 1), jnp.concatenate([wg, wu], 1)

  def gate_up(h):
    return jax.nn.silu(h[:, :FFN]) * h[:, FFN:]

  cases = [
      ("qkv separate", lambda x, a, b, c: (x @ a).sum() + (x @ b).sum() + (x @ c).sum(),
       (x, wq, wk, wv)),
      ("qkv fused", lambda x, w: (x @ w).sum(), (x, wqkv)),
      ("gate/up separate", lambda x, a, b: (jax.nn.silu(x @ a) * (x @ b)).sum(), (x, wg, wu)),
      ("gate/up fused", lambda x, w: gate_up(x @ w).sum(), (x, wgu)),
  ]
  for name, f, args in cases:
    print(f"{name:18s} {bench(jax.jit(f), *args):.3f} ms")
  print("load", os.getloadavg())


if __name__ == "__main__":
  main()
