"""Exact preservation of a preempted request's KV cache in host memory (§0x0C).

``preemption_mode="swap"``: when a plan preempts a request, the engine copies
the pages that hold its committed prefix ``[0, T_ready)`` to host memory
before they return to the free list; when a later plan re-admits the request,
fresh pages are allocated and the bytes are written back before the model
runs, so the request resumes at ``T_ready`` with no REBUILD rows. Each copy
carries the §0x0C binding ``(request_id, generation, snapshot digest,
suspension epoch)`` and the sha256 of its bytes; a copy whose binding or
bytes do not match is refused (``scheduler.preemption.StaleReceipt``).

Device side: two jitted programs, ``gather_pages`` (device -> host copy) and
``restore_pages`` (allocate + write), each compiled once per power-of-two
page count up to ``pages_per_seq``. Host side: ``SwapSpace``, a byte-bounded
store; a copy that does not fit makes the preemption fall back to recompute.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Dict

import jax.numpy as jnp
import numpy as np

from models import llama
from scheduler import preemption as pre
from serving.kv import pages as kv_pages


def page_bucket(num_pages: int, pages_per_seq: int) -> int:
  """Static page count a copy of ``num_pages`` pages is padded to."""
  if not 1 <= num_pages <= pages_per_seq:
    raise ValueError(f"num_pages must be in [1, {pages_per_seq}], got {num_pages}")
  return min(1 << (num_pages - 1).bit_length(), pages_per_seq)


def page_bytes(kv: llama.KVCache) -> int:
  """Bytes of one page across all layers, K and V (and a draft model's)."""
  k = kv.k
  own = 2 * k.shape[0] * int(np.prod(k.shape[2:])) * k.dtype.itemsize
  return own + (0 if kv.draft is None else page_bytes(kv.draft))


def gather_pages(kv: llama.KVCache, page_ids):
  """(k, v), each ``[L, n, page_size, kv_heads, head_dim]``: pages ``page_ids``
  (i32[n]) of every layer; with a draft model's cache (``kv.draft``), its
  pages too: (k, v, draft_k, draft_v)."""
  pages = (kv.k[:, page_ids], kv.v[:, page_ids])
  if kv.draft is not None:
    pages += (kv.draft.k[:, page_ids], kv.draft.v[:, page_ids])
  return pages


def reserve_pages(pages: kv_pages.PageState, release, slot, num_pages, *, bucket: int):
  """Frees the ``release`` slots' pages, then gives the empty ``slot``
  ``num_pages`` (<= the static ``bucket``) fresh pages, writing nothing
  (what ``restore_pages`` writes into; alone, a simulated engine's import,
  which holds no KV bytes). Returns ``pages``."""
  pages = kv_pages.deallocate(pages, release)
  num_slots = pages.page_table.shape[0]
  rows = jnp.where(jnp.arange(num_slots) == slot, num_pages * pages.page_size, 0)
  return kv_pages.allocate(pages, rows, max_new_per_slot=bucket)


def restore_pages(kv: llama.KVCache, pages: kv_pages.PageState, release, slot,
                  num_pages, k, v, draft_k=None, draft_v=None):
  """Frees the ``release`` slots' pages, then gives ``slot`` ``num_pages``
  fresh pages holding ``k`` / ``v`` (``[L, n_bucket, ...]``, rows beyond
  ``num_pages`` ignored), and ``draft_k`` / ``draft_v`` in the draft
  model's cache when given. Returns ``(kv, pages)``."""
  bucket = k.shape[1]
  pages = reserve_pages(pages, release, slot, num_pages, bucket=bucket)
  j = jnp.arange(bucket)
  ids = jnp.where(j < num_pages, pages.page_table[slot, jnp.minimum(
      j, pages.page_table.shape[1] - 1)], kv.k.shape[1])     # OOB -> dropped
  write = lambda cache, k, v: cache.replace(
      k=cache.k.at[:, ids].set(k.astype(cache.k.dtype), mode="drop"),
      v=cache.v.at[:, ids].set(v.astype(cache.v.dtype), mode="drop"))
  kv = write(kv, k, v)
  if draft_k is not None:
    kv = kv.replace(draft=write(kv.draft, draft_k, draft_v))
  return kv, pages


def digest(*arrays: np.ndarray) -> str:
  h = hashlib.sha256()
  for a in arrays:
    h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()


@dataclasses.dataclass
class Suspension:
  """Host record of one suspended request (§0x0C records plus the copy).

  Attributes:
    record: the request's QueueRecord (SUSPENDED_PRESERVED / _RECOMPUTE).
    intent, release, preservation: the facts that settled it
      (``preservation`` is None for a recompute intent).
    k, v: host copy ``[L, n_pages, page_size, kv_heads, head_dim]`` of the
      preserved prefix, or None for recompute.
    draft: the draft model's (k, v) copy of the same pages (speculative
      decoding with a draft model), or ().
    bytes_sha256: digest of ``k``, ``v`` and ``draft`` at copy time.
  """

  record: pre.QueueRecord
  intent: pre.PreemptionIntent
  release: pre.ReleaseResult
  preservation: pre.PreservationResult | None
  k: np.ndarray | None = None
  v: np.ndarray | None = None
  bytes_sha256: str = ""
  draft: tuple = ()

  @property
  def ready_tokens(self) -> int:
    """T_ready: exact prefix tokens preserved (0 for recompute)."""
    if self.preservation is None or self.preservation.status != pre.READY:
      return 0
    return self.preservation.exact_ready_prefix_tokens

  @property
  def nbytes(self) -> int:
    return 0 if self.k is None else sum(a.nbytes for a in (self.k, self.v, *self.draft))


class SwapSpace:
  """Byte-bounded host store of preserved KV copies, keyed by request id.

  Counters (for reports): ``swapped_out`` / ``swapped_in`` copies,
  ``bytes_out`` / ``bytes_in``, ``fallbacks`` (preservations refused for
  lack of space), ``peak_bytes``.
  """

  def __init__(self, capacity_bytes: int):
    self.capacity_bytes = int(capacity_bytes)
    self.used_bytes = 0
    self.peak_bytes = 0
    self._store: Dict[str, Suspension] = {}
    self.swapped_out = self.swapped_in = self.fallbacks = 0
    self.bytes_out = self.bytes_in = 0

  def fits(self, nbytes: int) -> bool:
    return self.used_bytes + nbytes <= self.capacity_bytes

  def put(self, request_id: str, s: Suspension) -> None:
    if request_id in self._store:
      raise ValueError(f"request {request_id!r} is already suspended")
    self._store[request_id] = s
    self.used_bytes += s.nbytes
    self.peak_bytes = max(self.peak_bytes, self.used_bytes)
    if s.k is not None:
      self.swapped_out += 1
      self.bytes_out += s.nbytes

  def get(self, request_id: str) -> Suspension | None:
    return self._store.get(request_id)

  def pop(self, request_id: str) -> Suspension | None:
    s = self._store.pop(request_id, None)
    if s is not None:
      self.used_bytes -= s.nbytes
    return s

  def restored(self, s: Suspension) -> None:
    """Counts a copy written back to the device."""
    self.swapped_in += 1
    self.bytes_in += s.nbytes

  def stats(self) -> dict:
    return dict(capacity_bytes=self.capacity_bytes, peak_bytes=self.peak_bytes,
                swapped_out=self.swapped_out, swapped_in=self.swapped_in,
                bytes_out=self.bytes_out, bytes_in=self.bytes_in,
                fallbacks_to_recompute=self.fallbacks)
