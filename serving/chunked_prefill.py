"""One long prompt's prefill as a ``lax.scan`` over chunk invocations (§0x09).

``chunked_prefill`` runs ``models.llama.forward`` once per fixed-size chunk
``[m * C, min((m + 1) * C, p))`` inside one compiled program: chunk ``m``
writes its rows' K/V into the sequence's pages and attends to the committed
rows ``[0, m * C)`` plus its own causal prefix, exactly the visibility of one
full prefill. Rows past the prompt are padding (no K/V write, never
sampled); whole chunks past the prompt run as empty invocations
(``num_seqs == 0``), so the prompt length is a run-time value and one program
serves every ``p <= num_chunks * C``.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from models import llama


def chunked_prefill(params, kv: llama.KVCache, tokens, prompt_len, page_table, *,
                    cfg, chunk_size: int, attention_impl: str = "gather"):
  """Prefills one sequence chunk by chunk under one ``lax.scan``.

  Args:
    params: model parameters.
    kv: the paged cache (``[L, num_pages, page_size, H_kv, d_h]``).
    tokens: i32[num_chunks * chunk_size] prompt ids, any value past the prompt.
    prompt_len: i32[] prompt tokens p, ``1 <= p <= tokens.shape[0]``.
    page_table: i32[pages_per_seq] the sequence's pages (covering p rows).
    cfg: static ``ModelConfig``; chunk_size: static rows per invocation C;
      attention_impl: static attention implementation.

  Returns:
    ``(kv, hidden, first_token)``: the cache with rows ``[0, p)`` committed,
    f32[d_model] final hidden state of row ``p - 1`` and i32[] the greedy
    first output token.

  Raises:
    ValueError: at trace time, if ``tokens`` is not a whole number of chunks.
  """
  if tokens.shape[0] % chunk_size:
    raise ValueError(f"tokens has {tokens.shape[0]} rows, not a multiple of "
                     f"chunk_size={chunk_size}")
  num_chunks = tokens.shape[0] // chunk_size
  page_size = kv.page_size
  prompt_len = jnp.asarray(prompt_len, jnp.int32)

  def invocation(carry, m):
    kv, last = carry
    start = m * chunk_size
    rows = start + jnp.arange(chunk_size, dtype=jnp.int32)
    valid = rows < prompt_len
    q_len = jnp.clip(prompt_len - start, 0, chunk_size)
    positions = jnp.where(valid, rows, 0)
    slot_mapping = jnp.where(
        valid, page_table[positions // page_size] * page_size + positions % page_size, -1)
    kv_lens = jnp.minimum(start + chunk_size, prompt_len)[None]
    cu_q_lens = jnp.stack([jnp.int32(0), q_len])
    hidden, kv = llama.forward(
        params, cfg, kv, jax.lax.dynamic_slice(tokens, (start,), (chunk_size,)),
        positions, slot_mapping, kv_lens, page_table[None], cu_q_lens,
        (q_len > 0).astype(jnp.int32), attention_impl=attention_impl)
    idx = prompt_len - 1 - start
    here = (idx >= 0) & (idx < chunk_size)
    last = jnp.where(here, hidden[jnp.clip(idx, 0, chunk_size - 1)], last)
    return (kv, last), None

  init = (kv, jnp.zeros((cfg.d_model,), jnp.float32))
  (kv, last), _ = jax.lax.scan(invocation, init, jnp.arange(num_chunks, dtype=jnp.int32))
  logits = llama.compute_logits(params, cfg, last[None])[0]
  return kv, last, jnp.argmax(logits).astype(jnp.int32)


chunked_prefill_jit = jax.jit(
    chunked_prefill, static_argnames=("cfg", "chunk_size", "attention_impl"))
chunked_prefill_jit.__doc__ = "``chunked_prefill`` under ``jax.jit``."
