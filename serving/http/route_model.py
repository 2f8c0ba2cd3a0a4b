"""What the routers of mixed replicas (``serving.http.router``) and of
prefill/decode pools (``serving.http.pd_router``) share: the policy names of
mixed replicas, the bound on a request's ``max_tokens``, the model of one
engine's prefix cache, and the request checks."""

from __future__ import annotations

import collections
import math
from typing import Dict, Sequence

import numpy as np

POLICIES = ("prefix_aware", "round_robin")
MAX_TOKENS = 2**31 - 1          # the most max_tokens a request may carry here


class ReplicaModel:
  """The router's view of one replica: capacity, live requests, cache keys."""

  def __init__(self, capacity: int, cache_pages: int):
    self.capacity, self.cache_pages = capacity, cache_pages
    self.alive = True
    self.live: Dict[str, object] = {}     # request -> its placement record
    self.keys: "collections.OrderedDict[bytes, None]" = collections.OrderedDict()

  def cached_pages(self, keys: Sequence[bytes], limit: int) -> int:
    n = 0
    for key in keys[:limit]:
      if key not in self.keys:
        break
      n += 1
    return n

  def remember(self, keys: Sequence[bytes]) -> None:
    for key in keys:
      self.keys[key] = None
      self.keys.move_to_end(key)
    while len(self.keys) > self.cache_pages:
      self.keys.popitem(last=False)


def check_request(request_id, prompt_token_ids, max_tokens, now_ms,
                  clock: str = "now_ms") -> None:
  """Refuses an empty prompt, max_tokens not an int in [1, MAX_TOKENS] (a
  larger one would overflow the estimates' float arithmetic) or a clock
  that is not finite, naming the request and the field (``clock``: the
  name the caller gives ``now_ms``)."""
  if not prompt_token_ids:
    raise ValueError(f"request {request_id!r}: prompt_token_ids must be non-empty")
  if (not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool)
      or not 1 <= max_tokens <= MAX_TOKENS):
    shown = max_tokens if len(str(max_tokens)) < 40 else f"{str(max_tokens)[:20]}..."
    raise ValueError(f"request {request_id!r}: max_tokens must be an int in [1, "
                     f"{MAX_TOKENS}], got {shown}")
  if not math.isfinite(now_ms):
    raise ValueError(f"request {request_id!r}: {clock} must be finite, got {now_ms}")
