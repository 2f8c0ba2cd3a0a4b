"""Prefill/decode disaggregation: a request's prompt runs on a prefill engine,
which samples the first token and hands the request (its KV pages, a
``serving.kv.transfer.KVHandoff``) to a decode engine. A ``PDRouter``
makes the two choices. Like ``Router`` it is host-side and pure: no
clock of its own (every call takes ``now_ms``), no I/O; the caller (the HTTP
front, ``serving.harness.cluster_sim``) holds a request while a pool is
full and asks again after a notification frees a place.

The registry: ``PD_ROUTERS`` (name -> ``PDRouter`` subclass), built by
``pd_router_for``; ``register_pd_router`` adds one. ``serving.http.router``
re-exports these names.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from serving.http.route_model import POLICIES, ReplicaModel, check_request
from serving.kv.prefix_cache import chain_keys, root_key

PD_STAGES = ("prefill", "decode")
PD_OUTCOMES = ("completed", "failed", "aborted")


@dataclasses.dataclass
class _PDPlaced:
  engine: int
  tokens: int                   # prompt tokens (prefill) / KV rows received (decode)
  uncached_tokens: int          # prefill: tokens the engine computes; decode: 0
  pages: int                    # decode: KV pages it holds by its end; prefill: 0


class _PDEngineModel:
  """The router's view of one engine of a pool: capacity, KV pages, live
  requests and (prefill) the prefix-cache keys placed on it."""

  def __init__(self, facts: dict):
    self.capacity = int(facts["max_request_slots"])
    self.num_pages = int(facts["num_pages"]) - 1          # less the null page
    self.cache_pages = self.num_pages if facts["enable_prefix_caching"] else 0
    self.alive = True
    self.live: Dict[str, _PDPlaced] = {}
    self.cache = ReplicaModel(self.capacity, self.cache_pages)


def _engine_facts(config) -> dict:
  """An engine's facts as a dict (an ``EngineConfig`` or a dict of its fields
  such as a replica's ``/engine`` report)."""
  facts = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
  for key in ("max_request_slots", "num_pages", "page_size", "enable_prefix_caching"):
    if key not in facts:
      raise ValueError(f"engine facts lack {key!r} (an EngineConfig or its fields)")
  return facts


class PDRouter:
  """Routes each request to a prefill engine, then to a decode engine.

  The calls, in a request's life (``now_ms``: the caller's clock, ms)::

    route_prefill(rid, prompt_token_ids, max_tokens, now_ms, salt="") -> int | None
        # its prefill engine; None: every live prefill engine is full (hold
        # the request, ask again after a prefill_done / finished / failed)
    prefill_done(rid, now_ms)       # first token out, KV taken: the place frees
    route_decode(rid, tokens, max_tokens, now_ms) -> int | None
        # its decode engine (tokens: KV rows the handoff carries; max_tokens:
        # the request's own, the first token counted); None: decode pool full
    finished(rid, now_ms, outcome="completed")    # ended anywhere: place frees
    failed(rid, now_ms, reason="") / aborted(rid, now_ms)

  Each choice appends one record to ``log`` (and returns through
  ``last``): ``request_id``, ``stage`` ("prefill"/"decode"), ``engine``,
  ``policy``, ``now_ms``, ``tie_key`` (the chosen engine's order key) and
  ``facts`` (every engine of the pool as it stood: ``engine``, ``alive``,
  ``live``, ``capacity``; prefill: ``cached_tokens``, ``uncached_tokens``,
  ``queued_tokens`` = uncached prompt tokens placed there and not yet done;
  decode: ``num_pages``, ``held_pages``, ``free_pages``, ``need_pages``,
  ``fits``). A request ending (``finished``/``failed``/``aborted``) appends
  a record with ``stage`` "end", its ``outcome`` and the stage it left.

  A decode engine's ``held_pages`` counts, per request routed there, the
  pages its KV takes at its end, ``ceil((tokens + max_tokens) /
  page_size)``, capped at the engine's pages: the router's model, not the
  engine's report (it may free earlier).

  Subclasses choose: ``order_prefill(fact)`` and ``order_decode(fact)``
  return the sort key of an engine with room (least wins). Register a new
  one with ``register_pd_router``.

  Args:
    prefill: one ``EngineConfig`` (or dict of its fields) per prefill engine.
    decode: one per decode engine.
    max_log: records ``log`` keeps (None: all; the front bounds it).

  Raises:
    ValueError: an empty pool, page sizes that differ, facts lacking a field.
  """

  name = "base"

  def __init__(self, prefill: Sequence, decode: Sequence, max_log: Optional[int] = None):
    if not prefill or not decode:
      raise ValueError(f"a P/D router needs >= 1 prefill and >= 1 decode engine, got "
                       f"{len(prefill)} and {len(decode)}")
    facts = [_engine_facts(c) for c in list(prefill) + list(decode)]
    sizes = sorted({int(f["page_size"]) for f in facts})
    if len(sizes) != 1 or sizes[0] < 1:
      raise ValueError(f"every engine's page_size must be one value >= 1, got {sizes}")
    self.page_size = sizes[0]
    self.pools = {"prefill": [_PDEngineModel(f) for f in facts[:len(prefill)]],
                  "decode": [_PDEngineModel(f) for f in facts[len(prefill):]]}
    self.log: "collections.deque[dict]" = collections.deque(maxlen=max_log)
    self.last: Optional[dict] = None
    self.outcomes = collections.Counter()
    self._root = root_key("router", self.page_size)
    self._where: Dict[str, Tuple[str, int]] = {}          # request -> (stage, engine)
    self._cursor = {"prefill": len(prefill) - 1, "decode": len(decode) - 1}

  @property
  def policy(self) -> str:
    return self.name

  # ------------------------------------------------------------ choices
  def prefill_facts(self, keys: Sequence[bytes], prompt_len: int) -> List[dict]:
    """Per prefill engine: what ``order_prefill`` compares for this prompt."""
    limit = min(len(keys), (prompt_len - 1) // self.page_size)
    out = []
    for i, m in enumerate(self.pools["prefill"]):
      cached = m.cache.cached_pages(keys, limit) * self.page_size if m.alive else 0
      out.append(dict(engine=i, alive=m.alive, live=len(m.live), capacity=m.capacity,
                      cached_tokens=cached, uncached_tokens=prompt_len - cached,
                      queued_tokens=sum(p.uncached_tokens for p in m.live.values())))
    return out

  def decode_facts(self, tokens: int, max_tokens: int) -> List[dict]:
    """Per decode engine: what ``order_decode`` compares for this request."""
    out = []
    for i, m in enumerate(self.pools["decode"]):
      need = min(-(-(tokens + max_tokens) // self.page_size), m.num_pages)
      held = sum(p.pages for p in m.live.values())
      free = m.num_pages - held
      out.append(dict(engine=i, alive=m.alive, live=len(m.live), capacity=m.capacity,
                      num_pages=m.num_pages, held_pages=held, free_pages=free,
                      need_pages=need, fits=free >= need))
    return out

  def order_prefill(self, fact: dict) -> tuple:
    raise NotImplementedError

  def order_decode(self, fact: dict) -> tuple:
    raise NotImplementedError

  def _turn(self, stage: str, fact: dict) -> tuple:
    """Round robin's key: engines after the last one used, in turn."""
    n = len(self.pools[stage])
    return ((fact["engine"] - self._cursor[stage] - 1) % n,)

  def _decide(self, stage: str, request_id: str, facts: List[dict], now_ms: float,
              placed: "_PDPlaced") -> Optional[int]:
    room = [f for f in facts if f["alive"] and f["live"] < f["capacity"]]
    if not room:
      return None
    order = self.order_prefill if stage == "prefill" else self.order_decode
    best = min(room, key=order)
    e = best["engine"]
    placed.engine = e
    self.pools[stage][e].live[request_id] = placed
    self._where[request_id] = (stage, e)
    self.last = dict(request_id=request_id, stage=stage, engine=e, policy=self.name,
                     now_ms=float(now_ms), tie_key=list(order(best)), facts=facts)
    self._cursor[stage] = e
    self.log.append(self.last)
    return e

  # ------------------------------------------------------------- events
  def route_prefill(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int,
                    now_ms: float, salt: str = "") -> Optional[int]:
    """The prefill engine for a new request, or None while every live one is
    full (see the class docstring).

    Raises:
      ValueError: the id is already routed, an empty prompt, max_tokens not
        an int in [1, MAX_TOKENS], now_ms not finite.
    """
    check_request(request_id, prompt_token_ids, max_tokens, now_ms)
    if request_id in self._where:
      raise ValueError(f"request_id {request_id!r} is already routed")
    n = len(prompt_token_ids)
    root = self._root if not salt else hashlib.sha256(self._root + salt.encode()).digest()
    keys = chain_keys(root, prompt_token_ids, self.page_size, n // self.page_size)
    facts = self.prefill_facts(keys, n)
    placed = _PDPlaced(-1, n, 0, 0)
    e = self._decide("prefill", request_id, facts, now_ms, placed)
    if e is not None:
      placed.uncached_tokens = facts[e]["uncached_tokens"]
      self.pools["prefill"][e].cache.remember(keys)
    return e

  def prefill_done(self, request_id: str, now_ms: float) -> None:
    """The request's first token is out and its KV taken from its prefill
    engine: its place there frees. Unknown ids are a no-op."""
    del now_ms
    where = self._where.get(request_id)
    if where is not None and where[0] == "prefill":
      self.pools["prefill"][where[1]].live.pop(request_id, None)
      del self._where[request_id]

  def route_decode(self, request_id: str, tokens: int, max_tokens: int,
                   now_ms: float) -> Optional[int]:
    """The decode engine for a handed-off request (``tokens``: the KV rows
    its handoff carries), or None while every live one is full. A request
    still placed on a prefill engine leaves it first (``prefill_done``).

    Raises:
      ValueError: the request already has a decode engine, tokens < 1,
        max_tokens not an int in [1, MAX_TOKENS], now_ms not finite.
    """
    check_request(request_id, [0] * 1, max_tokens, now_ms)
    if not isinstance(tokens, (int, np.integer)) or tokens < 1:
      raise ValueError(f"request {request_id!r}: tokens must be an int >= 1, got {tokens!r}")
    where = self._where.get(request_id)
    if where is not None and where[0] == "decode":
      raise ValueError(f"request_id {request_id!r} is already on decode engine {where[1]}")
    self.prefill_done(request_id, now_ms)
    facts = self.decode_facts(int(tokens), int(max_tokens))
    placed = _PDPlaced(-1, int(tokens), 0, 0)
    e = self._decide("decode", request_id, facts, now_ms, placed)
    if e is not None:
      placed.pages = facts[e]["need_pages"]
    return e

  def finished(self, request_id: str, now_ms: float, outcome: str = "completed",
               reason: str = "") -> None:
    """The request ended (``outcome`` in ``PD_OUTCOMES``) wherever it was:
    its place frees and an "end" record is logged. Unknown ids are a no-op
    (a request of an engine that went down was already dropped)."""
    if outcome not in PD_OUTCOMES:
      raise ValueError(f"outcome must be one of {PD_OUTCOMES}, got {outcome!r}")
    where = self._where.pop(request_id, None)
    if where is None:
      return
    self.pools[where[0]][where[1]].live.pop(request_id, None)
    self.outcomes[outcome] += 1
    self.log.append(dict(request_id=request_id, stage="end", engine=where[1], policy=self.name,
                         now_ms=float(now_ms), outcome=outcome, left=where[0], reason=reason))

  def failed(self, request_id: str, now_ms: float, reason: str = "") -> None:
    self.finished(request_id, now_ms, "failed", reason)

  def aborted(self, request_id: str, now_ms: float) -> None:
    self.finished(request_id, now_ms, "aborted")

  def engine_down(self, stage: str, engine: int) -> List[str]:
    """Marks an engine dead; returns the ids placed on it (the caller fails
    or re-routes each). Its cache model is dropped."""
    m = self.pools[stage][engine]
    m.alive = False
    lost = sorted(m.live)
    for rid in lost:
      self._where.pop(rid, None)
    m.live.clear()
    m.cache.keys.clear()
    return lost

  def engine_up(self, stage: str, engine: int, config) -> None:
    """Marks an engine alive again with its (restarted) facts: no live
    requests, an empty cache model."""
    self.pools[stage][engine] = _PDEngineModel(_engine_facts(config))

  def stage_of(self, request_id: str) -> Optional[Tuple[str, int]]:
    """``(stage, engine)`` where the request is placed, or None."""
    return self._where.get(request_id)

  def has_room(self, stage: str) -> bool:
    return any(m.alive and len(m.live) < m.capacity for m in self.pools[stage])


class RoundRobinPD(PDRouter):
  """Each pool in turn: the next engine with room after the last one used."""

  name = "round_robin"

  def order_prefill(self, f: dict) -> tuple:
    return self._turn("prefill", f)

  def order_decode(self, f: dict) -> tuple:
    return self._turn("decode", f)


class PrefixAwarePD(PDRouter):
  """Prefill: the engine holding the longest cached prefix of the prompt
  (``-cached_tokens``), then the least ``queued_tokens``; decode: the least
  ``live`` (decode has no prefix to reuse: the KV comes with the handoff)."""

  name = "prefix_aware"

  def order_prefill(self, f: dict) -> tuple:
    return (-f["cached_tokens"], f["queued_tokens"], f["engine"])

  def order_decode(self, f: dict) -> tuple:
    return (f["live"], f["engine"])


class DistServePD(PDRouter):
  """DistServe-style pair choice (OSDI'24: the controller sends a request to
  the prefill instance with the shortest queue, and its KV to the least
  loaded decode instance).

  Prefill: the least prefill work the request would wait for and do,
  ``queued_tokens + uncached_tokens`` (uncached prompt tokens queued there,
  plus this prompt's tokens past its prefix hit there); ties: the larger
  prefix hit, fewer live, the lower index.
  Decode: an engine whose free KV pages fit the request's pages at its end
  (``fits``) first, then the least ``live`` (each live sequence adds to every
  decode step: the TPOT), then the most ``free_pages``, the lower index.
  """

  name = "distserve"

  def order_prefill(self, f: dict) -> tuple:
    return (f["queued_tokens"] + f["uncached_tokens"], -f["cached_tokens"], f["live"],
            f["engine"])

  def order_decode(self, f: dict) -> tuple:
    return (0 if f["fits"] else 1, f["live"], -f["free_pages"], f["engine"])


PD_ROUTERS: Dict[str, type] = {c.name: c for c in (RoundRobinPD, PrefixAwarePD, DistServePD)}


def register_pd_router(cls: type) -> type:
  """Adds a ``PDRouter`` subclass to ``PD_ROUTERS`` under ``cls.name`` (a
  decorator; a name already there is refused)."""
  if not (isinstance(cls, type) and issubclass(cls, PDRouter)):
    raise ValueError(f"register_pd_router: {cls!r} must be a PDRouter subclass")
  if cls.name in PD_ROUTERS:
    raise ValueError(f"register_pd_router: {cls.name!r} is already registered")
  PD_ROUTERS[cls.name] = cls
  return cls


def check_router_name(name: str, pd: bool, flag: str = "router") -> None:
  """Refuses a router name that is not registered for the serving mode
  (``pd``: prefill/decode pools, ``PD_ROUTERS``; else mixed replicas,
  ``POLICIES``): one line naming ``--flag`` and the choices."""
  names = sorted(PD_ROUTERS) if pd else sorted(POLICIES)
  if name not in names:
    mode = "prefill/decode replicas" if pd else "mixed replicas"
    raise ValueError(f"--{flag} must be one of {names} for {mode}, got {name!r}")


def pd_router_for(prefill_engine_configs: Sequence, decode_engine_configs: Sequence,
                  policy: str = "distserve", flag: str = "router",
                  max_log: Optional[int] = None) -> PDRouter:
  """The P/D router ``PD_ROUTERS[policy]`` over these engines (``EngineConfig``s
  or dicts of their fields). The one construction the P/D front and
  ``serving.harness.cluster_sim`` share.

  Raises:
    ValueError: an unknown policy (naming ``--flag`` and the choices), or
      what ``PDRouter`` refuses.
  """
  check_router_name(policy, pd=True, flag=flag)
  return PD_ROUTERS[policy](prefill_engine_configs, decode_engine_configs, max_log=max_log)
