"""The engine's prefix-cache bookkeeping (``EngineConfig.enable_prefix_caching``).

``PrefixBook`` owns the host side of automatic prefix caching: the
``PrefixCache`` table (content-hashed full prompt pages, refcounted,
evicted LRU), each live request's page keys, which preemption of a request
was looked up again and the hit it resumed from, and the requests whose
first chunk has not run yet (counted once it has). Its verbs take the
device tables they read or write (``pages``, ``state``), the engine's
programs and its counted fetch, and return the tables they wrote:

* ``map_hit``: a request entering a slot gets its longest cached prefix;
* ``rehit_preempted``: a recompute-preempted request looks its prompt up
  again once per preemption;
* ``unpin_waiting_hits``: waiting requests' hits are dropped when running
  requests' next rows would not fit otherwise;
* ``evict``: unreferenced cached pages go, least recently used first;
* ``after_step``: the prompt pages a step computed join the cache, and the
  requests whose first chunk ran are counted.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import numpy as np

from scheduler import records as rec
from serving.kv import pages as kv_pages
from serving.kv import prefix_cache as pc


class PrefixBook:
  """Prefix-cache bookkeeping of one engine.

  Args:
    cache: the ``PrefixCache`` (its key chain rooted in the model's identity).
    page_size, pages_per_seq: the KV cache's page shape.
  """

  def __init__(self, cache: pc.PrefixCache, page_size: int, pages_per_seq: int):
    self.cache = cache
    self.page_size = page_size
    self.pages_per_seq = pages_per_seq
    self.keys: Dict[str, List[bytes]] = {}       # live requests' page keys
    self.rehit_epoch: Dict[str, int] = {}        # preemption last looked up again
    self.rehit_tokens: Dict[str, int] = {}       # its hit, not recomputed on resume
    self.uncounted: Dict[str, object] = {}       # placed, first chunk not yet run

  def forget(self, req) -> None:
    """``req`` ended: its keys and records go (its cached pages stay)."""
    for table in (self.keys, self.rehit_epoch, self.rehit_tokens, self.uncounted):
      table.pop(req.request_id, None)

  def salt(self, req, salt: str) -> None:
    """``req``'s page keys are chained under ``salt``: it hits, and is hit
    by, only prompts of the same salt (``PrefixCache.keys_for``)."""
    self.keys[req.request_id] = self.cache.keys_for(req.prompt_token_ids, salt)

  def placed(self, req) -> None:
    """``req`` entered a slot: its first chunk will be counted."""
    self.uncounted[req.request_id] = req

  def hits(self, slots) -> np.ndarray:
    """i32[R] prefix-hit tokens of each slot's request."""
    return np.array([0 if r is None else r.prefix_hit_tokens for r in slots], np.int32)

  def map_hit(self, req, slot: int, pages, programs):
    """Maps the longest cached prefix of ``req``'s prompt into ``slot``'s
    (empty) page table. Returns ``(pages, hit tokens)``; sets
    ``req.prefix_hit_tokens``."""
    keys = self.keys.get(req.request_id)
    if keys is None:
      keys = self.keys[req.request_id] = self.cache.keys_for(req.prompt_token_ids)
    if req.prompt_logprobs is not None:    # every prompt row must run to be scored
      req.prefix_hit_tokens = 0
      return pages, 0
    hit = self.cache.match(keys, len(req.prompt_token_ids))
    if hit:
      ids = np.full(self.pages_per_seq, kv_pages.NULL_PAGE, np.int32)
      ids[:len(hit)] = hit
      pages = programs.map_prefix(pages, np.int32(slot), ids, np.int32(len(hit)))
    req.prefix_hit_tokens = len(hit) * self.page_size
    return pages, req.prefix_hit_tokens

  def rehit_preempted(self, slots, state, pages, programs, fetch: Callable, swap):
    """A recompute-preempted request (no preserved copy in ``swap``) looks
    its prompt up again once per preemption: its own cached pages, kept
    cached when it was preempted, or anyone's, are mapped back and it
    resumes from the hit. Returns ``(state, pages)``."""
    if not any(r is not None and r.num_preemptions
               and self.rehit_epoch.get(r.request_id) != r.num_preemptions
               for r in slots):
      return state, pages          # nobody to look up again: no round trip
    computed, held, status = fetch((state.computed, pages.pages_held, state.status))
    for slot, req in enumerate(slots):
      if (req is None or not req.num_preemptions or held[slot] or computed[slot]
          or status[slot] != rec.WAITING
          or self.rehit_epoch.get(req.request_id) == req.num_preemptions):
        continue
      suspended = swap.get(req.request_id)
      if suspended is not None and suspended.k is not None:
        continue                 # swap restores its exact copy instead
      self.rehit_epoch[req.request_id] = req.num_preemptions
      pages, hit = self.map_hit(req, slot, pages, programs)
      self.rehit_tokens[req.request_id] = hit
      if hit:
        state = programs.resume_prefix(state, np.int32(slot), np.int32(hit))
    return state, pages

  def unpin_waiting_hits(self, slots, state, pages, programs, fetch: Callable):
    """A waiting request's prefix hit pins cached pages in its table. When
    the running requests' next rows need more pages than are free or
    evictable, the hits of waiting requests are dropped, latest arrival
    first, until they fit: those pages become evictable again and the
    request's prefill starts from 0 (a hit never starves a running request
    into preempting itself). Returns ``(state, pages)``."""
    computed, held, status, census = fetch((
        state.computed, pages.pages_held, state.status, kv_pages.page_census(pages)))
    running = status == rec.RUNNING
    need = int(np.sum(running & (kv_pages.pages_for(computed + 1, self.page_size) > held)))
    short = need - int(census[0]) - int(census[1])
    if short <= 0:
      return state, pages
    refcount, table = fetch((pages.refcount, pages.page_table))
    refcount = np.array(refcount)
    pinned = [s for s, r in enumerate(slots)
              if r is not None and status[s] == rec.WAITING and held[s] > 0]
    for slot in sorted(pinned, key=lambda s: -slots[s].uid):
      if short <= 0:
        break
      ids = table[slot, :held[slot]]
      short -= int(np.sum(refcount[ids] == 1))
      refcount[ids] -= 1
      mask = np.zeros(len(slots), bool)
      mask[slot] = True
      pages = programs.unpin(pages, mask)
      state = programs.resume_prefix(state, np.int32(slot), np.int32(0))
      req = slots[slot]
      req.prefix_hit_tokens = 0
      self.rehit_tokens.pop(req.request_id, None)
    return state, pages

  def evict(self, count: int, refcount, pages, programs, fetch: Callable):
    """Evicts ``count`` unreferenced cached pages, least recently used
    first, so that the free stack covers the pages the plan allocates
    (``PlanFacts.evict``); ``refcount`` is i32[num_pages] (on the device)
    once the plan's preemptions released their pages. Returns ``pages``."""
    self.cache.evict(count, fetch(refcount))
    return programs.sync_cached(pages, self.cache.cached_mask())

  def after_step(self, slots, fetched, skip, pages, programs):
    """After a step, before its ended slots are released: counts the prompt
    of every request whose first chunk just ran, with the hit it ran from
    (``PrefixCache.count_use``, once per request), then adds the computed
    full prompt pages of every live slot to the cache and publishes the
    table when it changed or when the step program held pages for it
    (``serving.engine.programs``' step program held them: those the table did not take
    return to the free stack). Returns ``pages``.

    Args:
      fetched: the step's ``StepFacts.prefix`` on the host: (computed
        i32[R] as published, pages_held i32[R], page_table
        i32[R, pages_per_seq] before the step released any slot, marked
        bool[]: whether the step held pages for the host). A request's
        frontier starts at its hit (0 once the hit is dropped) and passes
        it with its first chunk; it was running before any preemption, so
        a resume lookup is never counted.
      skip: bool[R] slots whose pages are not to be added (failed logits).
    """
    computed, held, table, marked = fetched
    for request_id, req in list(self.uncounted.items()):
      if int(computed[req.slot]) > req.prefix_hit_tokens:
        self.cache.count_use(len(req.prompt_token_ids), req.prefix_hit_tokens)
        del self.uncounted[request_id]
    ps, added = self.page_size, 0
    for slot, req in enumerate(slots):
      if req is None or (skip is not None and skip[slot]):
        continue
      full = min(int(computed[slot]), len(req.prompt_token_ids), int(held[slot]) * ps) // ps
      if full:
        added += self.cache.register(self.keys[req.request_id][:full], table[slot, :full])
    if added or marked:
      pages = programs.sync_cached(pages, self.cache.cached_mask())
    return pages

  def stats(self) -> dict:
    return self.cache.stats()


def no_stats() -> dict:
  """``PrefixBook.stats``'s keys, all zero: caching off."""
  return dict(prefix_cache_queries=0, prefix_cache_hits=0, prefix_cache_hit_rate=0.0,
              prefix_cache_evictions=0, prefix_cache_pages=0)


def for_engine(model_cfg, config, decode_gemm) -> "PrefixBook | None":
  """The bookkeeping of an engine with ``config`` (an ``EngineConfig``):
  a cache of its pages keyed under the model's identity, or None with
  ``enable_prefix_caching`` off."""
  c = config
  if not c.enable_prefix_caching:
    return None
  root = pc.root_key(model_cfg, c.dtype, c.weights, c.page_size, decode_gemm)
  return PrefixBook(pc.PrefixCache(c.num_pages, c.page_size, root), c.page_size,
                    c.pages_per_seq)
