"""A bucket run as scanned chunk invocations equals one invocation, bitwise (§0x09).

``models.llama.forward(..., chunk_rows=C)`` runs a T-row packed iteration as
a ``lax.scan`` over C-row chunks, each writing its K/V before the next
attends. On the tiny model, a 40-row bucket mixing decode rows, prefill
chunks with committed history and whole prompts, with sequences cut by the
chunk boundaries, gives the same hidden states and the same cache bits for
C = 8 and 16 as one invocation; chunks past the live rows are skipped and
nothing is written past them. The engine-level check (a 30-token prompt
prefilled in one scanned iteration) is in test_engine_paths.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import llama
from models.config import get_config

CFG = get_config("tiny")
PAGE_SIZE, PAGES_PER_SEQ, MAX_SEQS, ROWS = 4, 8, 6, 40
# (committed rows, new rows): decode, whole prompt, decode, chunk with
# history, whole prompt; the packed rows cross the 8- and 16-row boundaries
# inside sequences.
SEQS = [(5, 1), (0, 13), (7, 1), (3, 9), (0, 6)]


@pytest.fixture(scope="module")
def params():
  return llama.init_params(CFG, jax.random.PRNGKey(0), layer_scale=8)


def _batch(rng):
  tokens, positions, slots, prompt = [], [], [], []
  kv_lens, table, cu = [], [], [0]
  for i, (committed, new) in enumerate(SEQS):
    pages = list(range(1 + i * PAGES_PER_SEQ, 1 + (i + 1) * PAGES_PER_SEQ))
    for pos in range(committed, committed + new):
      tokens.append(int(rng.integers(3, CFG.vocab_size)))
      positions.append(pos)
      slots.append(pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
      prompt.append(new > 1)
    kv_lens.append(committed + new)
    table.append(pages)
    cu.append(cu[-1] + new)
  pad, idle = ROWS - len(tokens), MAX_SEQS - len(SEQS)
  i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))
  batch = dict(tokens=i32(tokens + [0] * pad), positions=i32(positions + [0] * pad),
               slot_mapping=i32(slots + [-1] * pad),
               kv_lens=i32(kv_lens + [0] * idle),
               page_table=i32(table + [[0] * PAGES_PER_SEQ] * idle),
               cu_q_lens=i32(cu + [cu[-1]] * idle), num_seqs=jnp.int32(len(SEQS)))
  return batch, jnp.asarray(prompt + [False] * pad), len(tokens)


def test_scanned_chunks_equal_one_invocation_bitwise(params):
  rng = np.random.default_rng(0)
  batch, prompt_rows, num_live = _batch(rng)
  shape = (CFG.n_layers, 1 + MAX_SEQS * PAGES_PER_SEQ, PAGE_SIZE, CFG.n_kv_heads,
           CFG.head_dim)
  # Every slot holds random K/V: committed rows are read, and a write past
  # the live rows would show below.
  history = rng.standard_normal((2,) + shape).astype(np.float32)
  runs = {}
  for chunk_rows in (None, 8, 16):
    kv = llama.KVCache(k=jnp.asarray(history[0]), v=jnp.asarray(history[1]))
    hidden, kv = llama.forward_jit(params, CFG, kv, **batch, attention_impl="auto",
                                   prompt_rows=prompt_rows, chunk_rows=chunk_rows)
    runs[chunk_rows] = (np.asarray(hidden)[:num_live], np.asarray(kv.k), np.asarray(kv.v))
  for chunk_rows in (8, 16):
    for name, got, want in zip(("hidden", "k", "v"), runs[chunk_rows], runs[None]):
      np.testing.assert_array_equal(got, want, err_msg=f"{name}, chunk_rows={chunk_rows}")
  assert np.all(np.isfinite(runs[8][0]))
  # Only the live rows' slots changed.
  changed = np.any(runs[8][1] != history[0], axis=(0, 3, 4))
  written = np.asarray(batch["slot_mapping"])[:num_live]
  assert sorted(np.flatnonzero(changed.reshape(-1))) == sorted(written)


def test_chunk_rows_below_one_is_refused(params):
  batch, prompt_rows, _ = _batch(np.random.default_rng(1))
  kv = llama.init_kv_cache(CFG, 1 + MAX_SEQS * PAGES_PER_SEQ, PAGE_SIZE)
  with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
    llama.forward(params, CFG, kv, **batch, attention_impl="auto", chunk_rows=0)
