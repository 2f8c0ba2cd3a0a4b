"""Greedy decoding through ``models.llama.forward`` for the real-model tests.

All prompts are prefilled in one packed iteration (``rows`` bucket), then
every step decodes one row per sequence (``decode_rows`` bucket).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from models import llama


def greedy(params, cfg, prompts, num_new, *, impl="blocked", rows=64, decode_rows=8,
           page_size=16):
  """Returns (generated ids per prompt, f32[num_new, vocab] logits per prompt)."""
  num_seqs = len(prompts)
  lengths = [len(p) for p in prompts]
  assert sum(lengths) <= rows and num_seqs <= decode_rows
  pages_per_seq = -(-(max(lengths) + num_new) // page_size)
  table = np.arange(num_seqs * pages_per_seq, dtype=np.int32).reshape(num_seqs, -1)
  kv = llama.init_kv_cache(cfg, num_seqs * pages_per_seq, page_size)

  def step(kv, parts, rows):
    """parts: per sequence (tokens, start position)."""
    tokens = np.zeros(rows, np.int32)
    positions = np.zeros(rows, np.int32)
    slots = np.full(rows, -1, np.int32)
    cu, kv_lens = [0], []
    for s, (toks, start) in enumerate(parts):
      lo = cu[-1]
      pos = np.arange(start, start + len(toks))
      tokens[lo:lo + len(toks)] = toks
      positions[lo:lo + len(toks)] = pos
      slots[lo:lo + len(toks)] = table[s, pos // page_size] * page_size + pos % page_size
      cu.append(lo + len(toks))
      kv_lens.append(start + len(toks))
    hidden, kv = llama.forward_jit(
        params, cfg, kv, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(slots),
        jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table), jnp.asarray(cu, jnp.int32),
        jnp.int32(num_seqs), attention_impl=impl)
    last = jnp.asarray(np.asarray(cu[1:]) - 1)
    return np.asarray(llama.compute_logits_jit(params, cfg, hidden[last])), kv

  logits, kv = step(kv, [(p, 0) for p in prompts], rows)
  out = [[] for _ in prompts]
  all_logits = [[] for _ in prompts]
  for i in range(num_new):
    for s in range(num_seqs):
      out[s].append(int(np.argmax(logits[s])))
      all_logits[s].append(logits[s])
    if i + 1 < num_new:
      logits, kv = step(kv, [([out[s][-1]], lengths[s] + i) for s in range(num_seqs)],
                        decode_rows)
  return out, [np.stack(x) for x in all_logits]
