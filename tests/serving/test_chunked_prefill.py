"""Chunked prefill as scanned chunk invocations equals one full prefill (§0x09).

Tiny model, chunk size 4, prompts of 12 (a multiple) and 10 (not) tokens.
Three paths write the same committed K/V and give the same first token:
``chunked_prefill_jit`` (one program, ``lax.scan`` over chunks), one full
prefill (one ``forward`` over every prompt row), and iteration-by-iteration
chunking as the engine runs it (a one-sequence plan per chunk, packed by
``serving.pack.pack`` and run by ``llama.forward``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import llama
from models.config import get_config
from scheduler import records as rec
from serving.chunked_prefill import chunked_prefill_jit
from serving.pack import pack

CFG = get_config("tiny")
CHUNK, ROWS, PAGE_SIZE, NUM_PAGES = 4, 16, 4, 8
TABLE = jnp.arange(1, 1 + ROWS // PAGE_SIZE, dtype=jnp.int32)


@pytest.fixture(scope="module")
def params():
  return llama.init_params(CFG, jax.random.PRNGKey(0), layer_scale=8)


def _cache():
  return llama.init_kv_cache(CFG, NUM_PAGES, PAGE_SIZE)


def _committed(kv, prompt_len):
  pos = np.arange(prompt_len)
  pages = np.asarray(TABLE)[pos // PAGE_SIZE]
  return (np.asarray(kv.k)[:, pages, pos % PAGE_SIZE],
          np.asarray(kv.v)[:, pages, pos % PAGE_SIZE])


def _first_token(params, hidden_row):
  return int(jnp.argmax(llama.compute_logits_jit(params, CFG, hidden_row[None])[0]))


def _full_prefill(params, tokens, prompt_len):
  rows = jnp.arange(ROWS, dtype=jnp.int32)
  valid = rows < prompt_len
  slot_mapping = jnp.where(valid, TABLE[rows // PAGE_SIZE] * PAGE_SIZE + rows % PAGE_SIZE, -1)
  hidden, kv = llama.forward_jit(
      params, CFG, _cache(), tokens, jnp.where(valid, rows, 0), slot_mapping,
      jnp.array([prompt_len], jnp.int32), TABLE[None],
      jnp.array([0, prompt_len], jnp.int32), jnp.int32(1), attention_impl="gather")
  return kv, _first_token(params, hidden[prompt_len - 1])


def _engine_chunking(params, tokens, prompt_len):
  """One plan per iteration: [c, min(c + CHUNK, p)), packed and executed."""
  kv, computed, hidden_last = _cache(), 0, None
  while computed < prompt_len:
    end = min(computed + CHUNK, prompt_len)
    one = lambda x: jnp.array([x], jnp.int32)
    plan = rec.IterationPlan(
        decision_id=jnp.int32(0), input_state_version=jnp.int32(0),
        selected=jnp.array([True]), generation=one(0), snapshot_version=one(0),
        start=one(computed), end=one(end), kind=one(rec.PREFILL_CHUNK),
        rank=one(0), admit=jnp.array([False]), preempt=jnp.array([False]),
        sort_key=jnp.zeros((1, 5), jnp.int32), num_tokens=jnp.int32(end - computed),
        num_seqs=jnp.int32(1), token_budget=CHUNK, seq_budget=1)
    packed = pack(plan, tokens[None], TABLE[None], PAGE_SIZE, num_rows=CHUNK, num_seqs=1)
    hidden, kv = llama.forward_jit(
        params, CFG, kv, packed.tokens, packed.positions, packed.slot_mapping,
        packed.kv_lens, packed.page_table, packed.cu_q_lens, packed.num_seqs,
        attention_impl="gather")
    hidden_last = hidden[packed.last_row[0]]
    computed = end
  return kv, _first_token(params, hidden_last)


@pytest.mark.parametrize("prompt_len", [12, 10])
def test_scanned_chunks_equal_full_prefill_and_engine_chunking(params, prompt_len):
  tokens = jnp.asarray((np.arange(ROWS) * 37 + 5) % CFG.vocab_size, jnp.int32)
  kv, _, token = chunked_prefill_jit(params, _cache(), tokens, jnp.int32(prompt_len),
                                     TABLE, cfg=CFG, chunk_size=CHUNK)
  full_kv, full_token = _full_prefill(params, tokens, prompt_len)
  iter_kv, iter_token = _engine_chunking(params, tokens, prompt_len)
  assert int(token) == full_token == iter_token
  k, v = _committed(kv, prompt_len)
  for other in (full_kv, iter_kv):
    ok, ov = _committed(other, prompt_len)
    np.testing.assert_allclose(k, ok, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v, ov, rtol=1e-5, atol=1e-6)
  # Nothing is written past the prompt (padding rows of the last chunk).
  tail = np.arange(prompt_len, ROWS)
  assert not np.asarray(kv.k)[:, np.asarray(TABLE)[tail // PAGE_SIZE],
                              tail % PAGE_SIZE].any()


def test_one_program_serves_every_prompt_length(params):
  tokens = jnp.ones((ROWS,), jnp.int32)
  before = chunked_prefill_jit._cache_size()
  for p in (3, 7, 16):
    chunked_prefill_jit(params, _cache(), tokens, jnp.int32(p), TABLE, cfg=CFG,
                        chunk_size=CHUNK)
  assert chunked_prefill_jit._cache_size() - before <= 1
  with pytest.raises(ValueError, match="multiple of chunk_size"):
    chunked_prefill_jit(params, _cache(), tokens[:10], jnp.int32(3), TABLE, cfg=CFG,
                        chunk_size=CHUNK)
