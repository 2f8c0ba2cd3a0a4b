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

Prefill/decode pools (``serving.http.pd_router``, its names re-exported
here: ``PDRouter``, ``PD_ROUTERS``, ``pd_router_for``): a registry of routers,
``PD_ROUTERS`` (name -> class: ``round_robin``, ``prefix_aware``,
``distserve``; ``register_pd_router`` adds one), built by ``pd_router_for``.
Each request gets a prefill engine, then, once its first token and KV
handoff exist, a decode engine; every choice is a logged record with the
facts it compared. Mixed replicas take ``POLICIES`` (``Router``);
``check_router_name`` refuses a name that is not registered for the mode.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Dict, List, Optional, Sequence

from serving.http.pd_router import (PD_OUTCOMES, PD_ROUTERS, PD_STAGES,  # noqa: F401
                                     DistServePD, PDRouter, PrefixAwarePD, RoundRobinPD,
                                     check_router_name, pd_router_for, register_pd_router)
from serving.http.route_model import POLICIES, ReplicaModel, check_request
from serving.kv.prefix_cache import chain_keys, root_key



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
    self.replicas = [ReplicaModel(c, p) for c, p in zip(capacities, cache_pages)]
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
    check_request(request_id, prompt_token_ids, max_tokens, arrival_ms, clock="arrival_ms")
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
