"""Preemption on the host (§0x0C): what ``Engine`` does when a plan preempts
a request, and when a plan admits one that was preempted.

``Suspensions`` owns the swap space (``serving.kv.swap.SwapSpace``) and the
§0x0C record chain of every suspended request: QueueRecord ->
PreemptionIntent -> ReleaseResult -> PreservationResult, bound by
(request_id, generation, snapshot digest, suspension epoch), then on
re-admission the ResumeTicket. ``EngineConfig.preemption_mode`` says how a
victim is kept: "recompute" frees its pages and later rebuilds its prefix;
"swap" copies the pages to host memory first (the ``swap_out`` program) and
writes them back when it is re-admitted (``swap_in``), so it resumes exactly
where it stopped. Its verbs take the device tables they read or write and
return those they wrote.
"""

from __future__ import annotations

from typing import Callable, Dict

import numpy as np

from scheduler import preemption as pre
from serving.kv import pages as kv_pages
from serving.kv import swap as kv_swap


class Suspensions:
  """Suspended requests' records and preserved KV copies.

  Args:
    mode: ``EngineConfig.preemption_mode`` ("recompute" or "swap").
    swap_bytes: host memory for preserved copies.
    page_bytes: bytes of one KV page (all layers, K and V).
    page_size, pages_per_seq: the KV cache's page shape.
  """

  def __init__(self, mode: str, swap_bytes: int, page_bytes: int, page_size: int,
               pages_per_seq: int):
    self.mode = mode
    self.swap = kv_swap.SwapSpace(swap_bytes)
    self.page_bytes = page_bytes
    self.page_size = page_size
    self.pages_per_seq = pages_per_seq

  def forget(self, req) -> None:
    """``req`` ended: a copy it still had is void, its record cancelled."""
    suspended = self.swap.pop(req.request_id)
    if suspended is not None:
      req.queue_record = pre.cancel(suspended.record)

  def suspend(self, slots, preempt, decision_id, state, pages, kv, programs,
              fetch: Callable, policy_id: str) -> np.ndarray:
    """Settles the preemption of every ``preempt`` slot (bool[R]): its §0x0C
    records, and in "swap" mode a copy of its committed KV pages in host
    memory (recompute when the copy does not fit). Returns i32[R] preserved
    prefix tokens (the result's ``preserved_end``)."""
    preserved = np.zeros(len(slots), np.int32)
    if not preempt.any():
      return preserved
    computed, generation, held, table, decision_id = fetch((
        state.computed, state.generation, pages.pages_held, pages.page_table, decision_id))
    for slot in np.flatnonzero(preempt):
      req = slots[slot]
      target = int(computed[slot])
      snapshot = kv_swap.digest(np.asarray(
          req.prompt_token_ids + req.output_token_ids, np.int32))
      epoch = req.num_preemptions + 1
      record = pre.QueueRecord(req.request_id, int(generation[slot]), snapshot, epoch - 1)
      mode = pre.PRESERVE_EXACT if self.mode == "swap" else pre.RECOMPUTE
      intent = pre.PreemptionIntent(
          intent_id=f"{req.request_id}@{epoch}",
          binding=pre.Binding(req.request_id, int(generation[slot]), snapshot, epoch),
          mode=mode, fallback=pre.RECOMPUTE, semantic_target_tokens=target,
          reason="kv_pressure", policy_id=policy_id,
          decision_version=int(decision_id))
      record = pre.begin_preemption(record, intent)
      release = pre.ReleaseResult(record.binding, pre.READY,
                                  int(held[slot]) * self.page_bytes)
      k = v = preservation = None
      draft = ()
      if mode == pre.PRESERVE_EXACT:
        n = kv_pages.pages_for(target, self.page_size)
        if n == 0:
          preservation = pre.PreservationResult(record.binding, pre.READY, 0)
        elif self.swap.fits(n * self.page_bytes):
          ids = np.full(kv_swap.page_bucket(n, self.pages_per_seq), kv_pages.NULL_PAGE,
                        np.int32)
          ids[:n] = table[slot, :n]
          k, v, *draft = (np.array(a[:, :n]) for a in fetch(programs.swap_out(kv, ids)))
          draft = tuple(draft)
          preservation = pre.PreservationResult(record.binding, pre.READY, target)
        else:
          self.swap.fallbacks += 1
          preservation = pre.PreservationResult(record.binding, pre.FAILED, 0)
      record = pre.settle(record, intent, release, preservation)
      suspension = kv_swap.Suspension(
          record, intent, release, preservation, k, v,
          kv_swap.digest(k, v, *draft) if k is not None else "", draft)
      self.swap.put(req.request_id, suspension)
      req.queue_record = record
      preserved[slot] = suspension.ready_tokens
    return preserved

  def resume_admitted(self, slots, admit, preempt, kv, pages, programs,
                      rehit_tokens: Dict[str, int]):
    """Re-admits every admitted slot (bool[R]) whose request is suspended:
    derives its ResumeTicket and, for a preserved copy, writes the pages
    back before the model runs. ``rehit_tokens`` holds the prefix hits that
    mapped rows back (not recomputed). Returns ``(kv, pages)``."""
    for slot in np.flatnonzero(admit):
      req = slots[slot]
      s = self.swap.get(req.request_id)
      if s is None:
        continue
      self.swap.pop(req.request_id)
      record = pre.request_resume(s.record)
      allocation = pre.ReadinessReceipt(record.binding, "allocation", pre.READY)
      ticket = pre.derive_resume_ticket(record, s.intent, s.release, s.preservation,
                                        (allocation,))
      if ticket is None:
        raise RuntimeError(f"request {req.request_id!r}: resume facts incomplete")
      if s.k is not None:
        if kv_swap.digest(s.k, s.v, *s.draft) != s.bytes_sha256:
          raise pre.StaleReceipt(f"request {req.request_id!r}: preserved KV bytes do "
                                 f"not match their digest; refusing to resume from them")
        n = s.k.shape[1]
        pad = [(0, 0), (0, kv_swap.page_bucket(n, self.pages_per_seq) - n)] + [(0, 0)] * 3
        kv, pages = programs.swap_in(kv, pages, preempt, np.int32(slot), np.int32(n),
                                     *(np.pad(a, pad) for a in (s.k, s.v, *s.draft)))
        self.swap.restored(s)
      req.recompute_tokens += ticket.recompute_overhead_tokens - rehit_tokens.pop(
          req.request_id, 0)
      req.queue_record = pre.complete_resume(record, ticket)
    return kv, pages
