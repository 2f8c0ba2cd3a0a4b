"""Placing requests on data-parallel engine replicas: the routing decision.

Host-side and pure (no HTTP, no clock of its own: every call takes the time),
so a decision can be worked by hand and replayed. ``serving.http.replicas`` runs it
behind the OpenAI endpoint.

Estimated finish time (Preble-style: cache facts plus load, per replica r)::

  finish_ms(r) = queue_ms(r) + prefill_ms(r) + load_ms(r)
  queue_ms(r)   = prefill_ms_per_token * sum of uncached prompt tokens of the
                  requests placed on r that have not produced a first token
  prefill_ms(r) = prefill_ms_per_token * (prompt_len - cached_tokens(r))
  load_ms(r)    = decode_ms_per_token_per_seq * live(r) * max_tokens

``cached_tokens(r)`` comes from the router's own model of what r's prefix
cache holds: the chained page keys of ``serving.kv.prefix_cache.chain_keys`` for
every full prompt page placed on r, least recently placed dropped first once
more than r's KV pages are modelled; the longest run of leading keys present,
capped as the engine caps a hit (at least one prompt token left to compute).
It is an estimate: a replica may evict earlier than modelled.

``prefix_aware`` picks the replica with room that has the least
``finish_ms``, ties on the recorded key ``(finish_ms, live, replica)``.
``round_robin`` (the baseline) takes the next replica with room after the
last one used. Both log the same facts.

Waiting (§0x09A: identity = request, eligibility = waiting at the router,
guarantee = eventual placement): a request waits at the router while every
live replica is full. When a place frees, ``prefix_aware`` places the waiting
request with the least ``best finish_ms - aging * waited_ms`` first, so a
request whose prompt no replica holds (large uncached prefill) is passed over
by cache hits only for a bounded time: after ``waited_ms > (its finish_ms -
theirs) / aging`` it goes first. ``round_robin`` serves the queue in arrival
order. Ties on ``(arrival_ms, request_id)``. Requests keep their original
arrival clock: a re-routed request re-enters with its first arrival.

Prefill/decode pools (``PDRouter``, below): a registry of routers,
``PD_ROUTERS`` (name -> class: ``round_robin``, ``prefix_aware``,
``distserve``; ``register_pd_router`` adds one), built by ``pd_router_for``.
Each request gets a prefill engine, then, once its first token and KV
handoff exist, a decode engine; every choice is a logged record with the
facts it compared. Mixed replicas take ``POLICIES`` (``Router``);
``check_router_name`` refuses a name that is not registered for the mode.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from serving.kv.prefix_cache import chain_keys, root_key

POLICIES = ("prefix_aware", "round_robin")
MAX_TOKENS = 2**31 - 1          # the most max_tokens a request may carry here


@dataclasses.dataclass(frozen=True)
class RouteCost:
  """The linear cost model of a replica (ms; calibrate per machine).

  Attributes:
    prefill_ms_per_token: prefill time of one uncached prompt token.
    decode_ms_per_token_per_seq: what one more live sequence adds to each
      decode step of a request sharing the replica.
    aging: ms of estimated finish time forgiven per ms waited (> 0).
  """

  prefill_ms_per_token: float = 1.0
  decode_ms_per_token_per_seq: float = 0.5
  aging: float = 1.0

  def __post_init__(self):
    for name in ("prefill_ms_per_token", "decode_ms_per_token_per_seq", "aging"):
      value = getattr(self, name)
      if not value > 0:
        raise ValueError(f"RouteCost.{name} must be > 0, got {value}")


def router_for(facts: Sequence[dict], policy: str = "prefix_aware",
               cost: "RouteCost" = None) -> "Router":
  """The router over replicas described by their engine facts (dicts with
  ``max_request_slots``, ``num_pages``, ``enable_prefix_caching`` and
  ``page_size``, as a replica's ``/engine`` facts or its ``EngineConfig``
  gives them): each replica's request slots as its capacity, its KV pages
  less the null page as its prefix-cache model when caching is on. The one
  construction ``serve.py --replicas`` and ``serving.harness.cluster_sim`` share."""
  return Router([f["max_request_slots"] for f in facts],
                [f["num_pages"] - 1 if f["enable_prefix_caching"] else 0 for f in facts],
                facts[0]["page_size"], policy, cost if cost is not None else RouteCost())


@dataclasses.dataclass
class _Pending:
  request_id: str
  prompt_len: int
  max_tokens: int
  arrival_ms: float
  keys: List[bytes]
  rerouted_from: List[int]


@dataclasses.dataclass
class _Placed:
  replica: int
  uncached_tokens: int
  prefilling: bool = True


class _ReplicaModel:
  """The router's view of one replica: capacity, live requests, cache keys."""

  def __init__(self, capacity: int, cache_pages: int):
    self.capacity, self.cache_pages = capacity, cache_pages
    self.alive = True
    self.live: Dict[str, _Placed] = {}
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


class Router:
  """Places requests on replicas (see the module docstring).

  Args:
    capacities: per replica, requests it may hold at once (>= 1).
    cache_pages: per replica, KV pages its prefix cache can hold.
    page_size: tokens per KV page (the replicas' engine config).
    policy: one of ``POLICIES``.
    cost: the ``RouteCost``.

  Raises:
    ValueError: no replica, mismatched lists, a capacity < 1, an unknown
      policy, or page_size < 1.
  """

  def __init__(self, capacities: Sequence[int], cache_pages: Sequence[int], page_size: int,
               policy: str = "prefix_aware", cost: RouteCost = RouteCost()):
    if not capacities or len(capacities) != len(cache_pages):
      raise ValueError(f"capacities and cache_pages must be one entry per replica (>= 1), "
                       f"got {len(capacities)} and {len(cache_pages)}")
    if min(capacities) < 1:
      raise ValueError(f"capacities must be >= 1, got {list(capacities)}")
    if policy not in POLICIES:
      raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    self.policy, self.cost, self.page_size = policy, cost, page_size
    self.replicas = [_ReplicaModel(c, p) for c, p in zip(capacities, cache_pages)]
    self._root = root_key("router", page_size)
    self._waiting: Dict[str, _Pending] = {}
    self._placed: Dict[str, _Placed] = {}
    self._cursor = len(self.replicas) - 1        # round_robin: the last replica used

  # ------------------------------------------------------------- events
  def submit(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int,
             arrival_ms: float, rerouted_from: Sequence[int] = (), salt: str = "") -> None:
    """Queues a request (``arrival_ms``: its original arrival, router clock;
    ``salt``: its prefix-cache salt, so that the cache model, like the
    replicas' caches, finds its pages only under the same salt).

    Raises:
      ValueError: the id is waiting or placed, an empty prompt, max_tokens
        not an int in [1, MAX_TOKENS] (a larger one would overflow the
        estimate's float arithmetic at every later decision), arrival_ms
        not finite.
    """
    if request_id in self._waiting or request_id in self._placed:
      raise ValueError(f"request_id {request_id!r} is already routed")
    if not prompt_token_ids:
      raise ValueError(f"request {request_id!r}: prompt_token_ids must be non-empty")
    if (not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool)
        or not 1 <= max_tokens <= MAX_TOKENS):
      shown = max_tokens if len(str(max_tokens)) < 40 else f"{str(max_tokens)[:20]}..."
      raise ValueError(f"request {request_id!r}: max_tokens must be an int in [1, "
                       f"{MAX_TOKENS}], got {shown}")
    if not math.isfinite(arrival_ms):
      raise ValueError(f"request {request_id!r}: arrival_ms must be finite, got {arrival_ms}")
    n = len(prompt_token_ids)
    root = self._root if not salt else hashlib.sha256(self._root + salt.encode()).digest()
    keys = chain_keys(root, prompt_token_ids, self.page_size, n // self.page_size)
    self._waiting[request_id] = _Pending(request_id, n, int(max_tokens), float(arrival_ms),
                                         keys, list(rerouted_from))

  def withdraw(self, request_id: str) -> None:
    """Drops a waiting request (its client left, or nothing is alive)."""
    self._waiting.pop(request_id, None)

  def first_token(self, request_id: str) -> None:
    """The request's prefill is done: it leaves its replica's queue estimate."""
    placed = self._placed.get(request_id)
    if placed is not None:
      placed.prefilling = False

  def finished(self, request_id: str) -> None:
    """The request ended (any outcome): its place frees. Unknown ids are a no-op
    (a request of a replica that went down was already dropped)."""
    placed = self._placed.pop(request_id, None)
    if placed is not None:
      self.replicas[placed.replica].live.pop(request_id, None)

  def replica_down(self, replica: int) -> List[str]:
    """Marks a replica dead; returns the ids that were placed on it (their
    handlers re-route or fail each one). Its cache model is dropped."""
    model = self.replicas[replica]
    model.alive = False
    lost = sorted(model.live)
    for rid in lost:
      self._placed.pop(rid, None)
    model.live.clear()
    model.keys.clear()
    return lost

  def replica_up(self, replica: int, capacity: int, cache_pages: int) -> None:
    """Marks a replica that was down alive again (it came back, e.g.
    restarted): no live requests, an empty cache model, ``capacity``
    requests and ``cache_pages`` KV pages as it now reports them.

    Raises:
      ValueError: capacity < 1 or cache_pages < 0.
    """
    if capacity < 1 or cache_pages < 0:
      raise ValueError(f"replica {replica}: capacity must be >= 1 and cache_pages >= 0, "
                       f"got {capacity} and {cache_pages}")
    model = self.replicas[replica]
    model.capacity, model.cache_pages, model.alive = capacity, cache_pages, True
    model.live.clear()
    model.keys.clear()

  def num_waiting(self) -> int:
    return len(self._waiting)

  def has_room(self) -> bool:
    """Some live replica has a free place (a request submitted now, with
    nothing waiting, is placed at once)."""
    return any(r.alive and len(r.live) < r.capacity for r in self.replicas)

  def alive(self) -> List[int]:
    return [i for i, r in enumerate(self.replicas) if r.alive]

  # ----------------------------------------------------------- decision
  def facts(self, pending: _Pending) -> List[dict]:
    """Per replica: the estimate's terms (ms, tokens) for ``pending``."""
    c = self.cost
    limit = min(len(pending.keys), (pending.prompt_len - 1) // self.page_size)
    out = []
    for i, r in enumerate(self.replicas):
      cached = r.cached_pages(pending.keys, limit) * self.page_size if r.alive else 0
      uncached = pending.prompt_len - cached
      queue_ms = c.prefill_ms_per_token * sum(p.uncached_tokens for p in r.live.values()
                                              if p.prefilling)
      prefill_ms = c.prefill_ms_per_token * uncached
      load_ms = c.decode_ms_per_token_per_seq * len(r.live) * pending.max_tokens
      out.append(dict(replica=i, alive=r.alive, live=len(r.live), capacity=r.capacity,
                      cached_tokens=cached, uncached_tokens=uncached, queue_ms=queue_ms,
                      prefill_ms=prefill_ms, load_ms=load_ms,
                      finish_ms=queue_ms + prefill_ms + load_ms))
    return out

  def _open(self, facts: List[dict]) -> List[dict]:
    return [f for f in facts if f["alive"] and f["live"] < f["capacity"]]

  def _choose(self, facts: List[dict]) -> Optional[dict]:
    room = self._open(facts)
    if not room:
      return None
    if self.policy == "prefix_aware":
      return min(room, key=lambda f: (f["finish_ms"], f["live"], f["replica"]))
    n = len(self.replicas)
    return min(room, key=lambda f: (f["replica"] - self._cursor - 1) % n)

  def dispatch(self, now_ms: float) -> List[dict]:
    """Places waiting requests while a replica has room; returns one decision
    per placed request, in placement order: ``request_id``, ``stage``
    ("mixed": the replica runs prefill and decode), ``replica``,
    ``policy``, ``arrival_ms``, ``waited_ms``, ``score_ms`` (the aged order
    key; prefix_aware), ``tie_key``, ``rerouted_from`` and ``facts`` (every
    replica's terms as they stood)."""
    decisions = []
    while self._waiting:
      candidates = []
      for p in self._waiting.values():
        facts = self.facts(p)
        best = self._choose(facts)
        if best is None:
          return decisions                        # every live replica is full
        waited = max(now_ms - p.arrival_ms, 0.0)
        score = best["finish_ms"] - self.cost.aging * waited
        order = ((score, p.arrival_ms, p.request_id) if self.policy == "prefix_aware"
                 else (p.arrival_ms, p.request_id))
        candidates.append((order, p, facts, best, waited, score))
      order, p, facts, best, waited, score = min(candidates, key=lambda c: c[0])
      del self._waiting[p.request_id]
      r = best["replica"]
      placed = _Placed(r, best["uncached_tokens"])
      self._placed[p.request_id] = placed
      self.replicas[r].live[p.request_id] = placed
      self.replicas[r].remember(p.keys)
      tie_key = ([best["finish_ms"], best["live"], r] if self.policy == "prefix_aware"
                 else [(r - self._cursor - 1) % len(self.replicas)])
      self._cursor = r
      decisions.append(dict(request_id=p.request_id, stage="mixed", replica=r,
                            policy=self.policy,
                            arrival_ms=p.arrival_ms, waited_ms=waited,
                            score_ms=score if self.policy == "prefix_aware" else None,
                            tie_key=tie_key, rerouted_from=p.rerouted_from, facts=facts))
    return decisions


# ---------------------------------------------------------------- P/D routing
#
# Prefill/decode disaggregation: a request's prompt runs on a prefill engine,
# which samples the first token and hands the request (its KV pages, a
# ``serving.kv.transfer.KVHandoff``) to a decode engine. A ``PDRouter``
# makes the two choices. Like ``Router`` it is host-side and pure: no
# clock of its own (every call takes ``now_ms``), no I/O; the caller (the HTTP
# front, ``serving.harness.cluster_sim``) holds a request while a pool is
# full and asks again after a notification frees a place.

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
    self.cache = _ReplicaModel(self.capacity, self.cache_pages)


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
    _check_request(request_id, prompt_token_ids, max_tokens, now_ms)
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
    _check_request(request_id, [0] * 1, max_tokens, now_ms)
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


def _check_request(request_id, prompt_token_ids, max_tokens, now_ms) -> None:
  if not prompt_token_ids:
    raise ValueError(f"request {request_id!r}: prompt_token_ids must be non-empty")
  if (not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool)
      or not 1 <= max_tokens <= MAX_TOKENS):
    shown = max_tokens if len(str(max_tokens)) < 40 else f"{str(max_tokens)[:20]}..."
    raise ValueError(f"request {request_id!r}: max_tokens must be an int in [1, "
                     f"{MAX_TOKENS}], got {shown}")
  if not math.isfinite(now_ms):
    raise ValueError(f"request {request_id!r}: now_ms must be finite, got {now_ms}")


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
