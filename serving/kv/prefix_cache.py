"""Automatic prefix caching: the host's content table over shared KV pages.

A KV page that holds ``page_size`` prompt tokens gets a content key chained
from its predecessor, as in vLLM's hashed blocks::

  key_0 = sha256(root, tokens[0:P]),  key_i = sha256(key_{i-1}, tokens[iP:(i+1)P])

``root`` names everything else that changes the bytes of a page (model
config, dtype, page size), so two engines never share a key for different
bytes. Only full prompt pages are keyed; a request's last partial page and
its output pages stay private.

This module owns the key -> page table and the LRU order; ownership
(refcounts, the free stack) lives on the device in ``serving.kv.pages``
(see its docstring for the split and the page census). The engine drives it:

* ``match`` at slot admission: the longest run of leading keys present,
  capped so at least one prompt token is left to compute (its logits give
  the first output token). The hit pages are mapped into the slot's table
  and its computed frontier starts at the hit.
* ``register`` after each step: full prompt pages a live table holds whose
  rows are computed join the table (first page wins for a key).
* ``evict`` before a step that needs more pages than the free stack holds:
  least recently used first among pages no table holds (refcount 0); ties
  on the recorded key ``(last_use, -depth, page)``, so a replay evicts the
  same pages and a chain loses its tail before its head.

Counters (token units, as vLLM's ``prefix_cache_queries`` /
``prefix_cache_hits``), advanced by ``count_use`` when a request's first
chunk runs, once per request: ``queries`` its prompt tokens, ``hits`` the
cached tokens it ran from. A lookup alone counts nothing: a hit dropped
before use (``PrefixBook.unpin_waiting_hits``) served nothing, and the lookup
of a preempted request resuming from its own pages is no new hit (vLLM
keeps preempted requests out of its hit rate as well).
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Sequence

import numpy as np


def root_key(*identity) -> bytes:
  """Root of every key chain: the model/dtype/page-size identity."""
  return hashlib.sha256(repr(identity).encode()).digest()


def chain_keys(root: bytes, token_ids: Sequence[int], page_size: int,
               num_pages: int) -> List[bytes]:
  """Content keys of the first ``num_pages`` full pages of ``token_ids``.

  Raises:
    ValueError: ``num_pages`` full pages do not fit in ``token_ids``.
  """
  if num_pages * page_size > len(token_ids):
    raise ValueError(f"num_pages {num_pages} x page_size {page_size} exceeds the "
                     f"{len(token_ids)} tokens given")
  tokens = np.asarray(token_ids, np.int64)
  keys, prev = [], root
  for i in range(num_pages):
    prev = hashlib.sha256(prev + tokens[i * page_size:(i + 1) * page_size].tobytes()).digest()
    keys.append(prev)
  return keys


class PrefixCache:
  """Key -> page table with LRU bookkeeping (host side).

  Args:
    num_pages: physical pages (page ids index ``cached_mask``).
    page_size: token rows per page.
    root: ``root_key(...)`` of the engine's model/dtype.
  """

  def __init__(self, num_pages: int, page_size: int, root: bytes):
    self.num_pages, self.page_size, self.root = num_pages, page_size, root
    self._page_of: Dict[bytes, int] = {}
    self._key_of: Dict[int, bytes] = {}
    self._depth: Dict[int, int] = {}
    self._last_use: Dict[int, int] = {}
    self._clock = 0
    self.queries = self.hits = self.evictions = 0

  def __len__(self) -> int:
    return len(self._page_of)

  def keys_for(self, prompt: Sequence[int], salt: str = "") -> List[bytes]:
    """Keys of every full page of ``prompt``; a ``salt`` enters the chain's
    root, so prompts hit each other's pages only under the same salt."""
    root = self.root if not salt else hashlib.sha256(self.root + salt.encode()).digest()
    return chain_keys(root, prompt, self.page_size, len(prompt) // self.page_size)

  def match(self, keys: Sequence[bytes], prompt_len: int) -> List[int]:
    """Pages of the longest cached prefix of a prompt (``keys`` from
    ``keys_for``), leaving at least one prompt token to compute; touches the
    hit pages. Counts nothing (``count_use`` does, once the hit is used)."""
    limit = min(len(keys), (prompt_len - 1) // self.page_size)
    hit = []
    for key in keys[:limit]:
      page = self._page_of.get(key)
      if page is None:
        break
      hit.append(page)
    self._clock += 1
    for page in hit:
      self._last_use[page] = self._clock
    return hit

  def count_use(self, prompt_tokens: int, hit_tokens: int) -> None:
    """Counts one request's prompt, once, when its first chunk ran:
    ``prompt_tokens`` queried, ``hit_tokens`` (whole pages, < prompt_tokens)
    of them served from the cache.

    Raises:
      ValueError: ``hit_tokens`` outside [0, prompt_tokens) or not a
        multiple of ``page_size``.
    """
    if not (0 <= hit_tokens < prompt_tokens and hit_tokens % self.page_size == 0):
      raise ValueError(f"hit_tokens must be a multiple of page_size {self.page_size} "
                       f"in [0, prompt_tokens={prompt_tokens}), got {hit_tokens}")
    self.queries += prompt_tokens
    self.hits += hit_tokens

  def register(self, keys: Sequence[bytes], pages: Sequence[int]) -> int:
    """Adds ``(key, page)`` pairs for full computed pages a live table holds,
    in chain order (``keys[i]`` is page ``i`` of its prompt). A key already
    present keeps its page. Returns the pages added."""
    self._clock += 1
    added = 0
    for depth, (key, page) in enumerate(zip(keys, pages)):
      page = int(page)
      if key in self._page_of or page in self._key_of:
        if self._page_of.get(key) == page:
          self._last_use[page] = self._clock
        continue
      self._page_of[key], self._key_of[page] = page, key
      self._depth[page], self._last_use[page] = depth, self._clock
      added += 1
    return added

  def evict(self, count: int, refcount: np.ndarray) -> List[int]:
    """Removes ``count`` least recently used pages with ``refcount == 0``.

    Raises:
      RuntimeError: fewer than ``count`` pages are evictable (the plan was
        made against a view that counted them; a mismatch is a bug).
    """
    if count <= 0:
      return []
    idle = [p for p in self._key_of if refcount[p] == 0]
    if len(idle) < count:
      raise RuntimeError(f"prefix cache: {count} pages to evict, only {len(idle)} "
                         f"cached pages are unreferenced")
    idle.sort(key=lambda p: (self._last_use[p], -self._depth[p], p))
    victims = idle[:count]
    for page in victims:
      del self._page_of[self._key_of.pop(page)]
      del self._depth[page], self._last_use[page]
    self.evictions += count
    return victims

  def cached_mask(self) -> np.ndarray:
    """bool[num_pages]: pages whose key is in the table."""
    mask = np.zeros(self.num_pages, bool)
    mask[list(self._key_of)] = True
    return mask

  def stats(self) -> dict:
    rate = self.hits / self.queries if self.queries else 0.0
    return dict(prefix_cache_queries=self.queries, prefix_cache_hits=self.hits,
                prefix_cache_hit_rate=rate, prefix_cache_evictions=self.evictions,
                prefix_cache_pages=len(self))
