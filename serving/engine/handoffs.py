"""Prefill/decode roles on the host (``EngineConfig.role``;
``serving.kv.transfer`` defines the record): what ``Engine`` does when a
prefill engine's request ends "handoff", and when a decode engine's policy
admits a request that was handed to it.

``Handoffs`` owns the records in both directions: ``sent`` (made on a
prefill engine, taken by ``Engine.take_handoffs``) and ``received`` (a
decode engine's, from ``Engine.add_handoff`` until its policy admits the
request and the pages are written). Its verbs take the device tables they
read or write and return those they wrote.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import jax
import jax.numpy as jnp
import numpy as np

from serving.kv import pages as kv_pages
from serving.kv import swap as kv_swap
from serving.kv import transfer

HANDOFF = "handoff"        # the finish reason of a request a prefill engine handed off


def hands_off(role: str, req, reason: str, max_model_len: int) -> bool:
  """Whether a request that just ended with ``reason`` (a ``FINISH_NAMES``
  name) on an engine of ``role`` goes on elsewhere: on a prefill engine, a
  "length" end after its first token, with more tokens asked for and room
  in the context (an EOS, a stop id, ``max_tokens`` 1 or a full context end
  it for real)."""
  return (role == "prefill" and reason == "length" and len(req.output_token_ids) == 1
          and req.sampling.max_tokens > 1
          and len(req.prompt_token_ids) + 1 < max_model_len)


class Handoffs:
  """A prefill or decode engine's handoff records.

  Args:
    role: ``EngineConfig.role``.
    page_size, pages_per_seq: the KV cache's page shape.
    page_bytes: bytes of one page (all layers, K and V).
    simulated: the engine runs the simulated executor (no KV bytes move).

  Counters: ``sent`` / ``received_total`` records and ``bytes_sent`` /
  ``bytes_received``.
  """

  def __init__(self, role: str, page_size: int, pages_per_seq: int, page_bytes: int,
               simulated: bool):
    self.role = role
    self.page_size = page_size
    self.pages_per_seq = pages_per_seq
    self.page_bytes = page_bytes
    self.simulated = simulated
    self.sent: List[transfer.KVHandoff] = []
    self.received: Dict[str, transfer.KVHandoff] = {}
    self.num_sent = self.num_received = self.bytes_sent = self.bytes_received = 0

  def forget(self, req) -> None:
    """``req`` ended: a record it still waited to be admitted with is void."""
    self.received.pop(req.request_id, None)

  def take(self) -> List[transfer.KVHandoff]:
    """The records made since the last call (and forgets them)."""
    out, self.sent = self.sent, []
    return out

  def export(self, ended, table, kv, programs, fetch: Callable) -> None:
    """Copies the pages of every request in ``ended`` (the requests a step
    just ended) that ended "handoff" into a sealed ``KVHandoff``. Runs after
    that step and before any later program writes KV: its pages went back
    to the free stack with their bytes intact. ``table``: the step's
    ``StepFacts.handoff`` (i32[R, P] on the host)."""
    for req in ended:
      if req.finish_reason != HANDOFF:
        continue
      p = len(req.prompt_token_ids)
      n = kv_pages.pages_for(p, self.page_size)
      k = v = None
      if not self.simulated:
        ids = np.full(kv_swap.page_bucket(n, self.pages_per_seq), kv_pages.NULL_PAGE,
                      np.int32)
        ids[:n] = table[req.slot, :n]
        k, v = fetch(programs.swap_out(kv, ids))
        k, v = np.array(k[:, :n]), np.array(v[:, :n])
      s = req.sampling
      record = transfer.KVHandoff(
          request_id=req.request_id, prompt_token_ids=tuple(req.prompt_token_ids),
          first_token=int(req.output_token_ids[0]), sampling=s, priority=req.priority,
          client=req.client, cache_salt=req.cache_salt,
          slo_ttft_ms=None if req.slo_ttft_ms == float("inf") else req.slo_ttft_ms,
          slo_tpot_ms=None if req.slo_tpot_ms == float("inf") else req.slo_tpot_ms,
          arrival_ms=req.arrival_ms, first_token_ms=req.token_times_ms[0],
          first_logprobs=req.output_logprobs[0] if req.output_logprobs else None,
          tokens=p, page_size=self.page_size, num_pages=n, nbytes=n * self.page_bytes,
          k=k, v=v)
      self.sent.append(record.sealed())
      self.num_sent += 1
      self.bytes_sent += n * self.page_bytes

  def admit(self, h: transfer.KVHandoff, arrival_ms: float, config, kv, vocab_size: int,
            table, prefix):
    """``Engine.add_handoff``: checks ``h`` (``transfer.check``), accepts its
    request into ``table`` (``RequestTable``) with its first token, keys its
    prompt pages in ``prefix`` (a ``PrefixBook`` or None) under its salt,
    and keeps the record until the request is admitted. Returns the
    Request (ended at once, "rejected", when it can never fit)."""
    c = config
    if c.role != "decode":
      raise ValueError(f"add_handoff needs EngineConfig.role='decode', got {c.role!r}")
    transfer.check(h, page_size=c.page_size, kv_shape=kv.k.shape, kv_dtype=kv.k.dtype,
                   simulated=self.simulated, max_model_len=c.max_model_len,
                   vocab_size=vocab_size)
    req = table.accept(h.request_id, h.prompt_token_ids, h.sampling, arrival_ms, h.priority,
                       h.client, h.slo_ttft_ms, h.slo_tpot_ms, h.first_logprobs is not None,
                       False)
    if not req.finished:
      req.cache_salt, req.received_tokens = h.cache_salt, h.tokens
      req.output_token_ids.append(int(h.first_token))
      req.token_times_ms.append(req.arrival_ms)
      if h.first_logprobs is not None:
        req.output_logprobs.append(h.first_logprobs)
      if prefix is not None:
        prefix.salt(req, h.cache_salt)
      self.received[req.request_id] = h
      table.pending.append(req)
    return req

  def import_admitted(self, slots, admit, preempt, kv, pages, programs):
    """Writes the pages of every admitted slot (bool[R]) whose request was
    handed over into fresh pages of this cache (the allocator picks them:
    page ids are remapped), before the model runs; ``preempt`` (bool[R])
    slots' pages are released first, as the plan says. Returns
    ``(kv, pages)``."""
    for slot in np.flatnonzero(admit):
      h = self.received.pop(slots[slot].request_id, None)
      if h is None:
        continue
      n = h.num_pages
      bucket = kv_swap.page_bucket(n, self.pages_per_seq)
      if h.k is None:
        pages = programs.reserve(pages, preempt, np.int32(slot), np.int32(n), bucket=bucket)
      else:
        pad = [(0, 0), (0, bucket - n)] + [(0, 0)] * 3
        pad_to = jnp.pad if isinstance(h.k, jax.Array) else np.pad   # on its device
        kv, pages = programs.swap_in(kv, pages, preempt, np.int32(slot), np.int32(n),
                                     pad_to(h.k, pad), pad_to(h.v, pad))
      self.num_received += 1
      self.bytes_received += h.nbytes
    return kv, pages

  def stats(self) -> dict:
    return dict(handoffs_sent=self.num_sent, handoffs_received=self.num_received,
                handoff_bytes_sent=self.bytes_sent,
                handoff_bytes_received=self.bytes_received)
