"""The OpenAI front over engine actors (``serving.http.ray_engines``): one
``OpenAIServer`` whose engine is ``RayEngines``, a stand-in for ``Engine``'s
host API that places each request on an actor and streams its tokens back.

Design: request handling keeps one home. ``serving.http.server`` parses,
guards, formats and counts; ``serving.http.engine_loop.EngineLoop`` (here
``RayLoop``) detokenizes, matches stop strings and pushes events, exactly
as over one engine; only the engine under it differs. ``RayEngines`` offers
what the loop and ``ServerMetrics`` read of an ``Engine`` (``add_request``,
``step``, ``abort``, ``finish``, ``evict``, ``requests``, ``config``, the
clock) and keeps a mirror of each request (``RemoteRequest``); its
``step`` waits (at most ``ray_engines.POLL_S`` plus a margin) for the
actors' news and returns it as ``RequestOutput``s. Gauges are the sums of
the actors' latest ``stats``.

Placement: ``serving.http.router.Router`` (``router_for`` the actors'
facts), as the HTTP replica front uses it: a request waits at the front
while every engine of its pool is full, and is placed when a place frees.
With prefill and decode pools, the P/D router the simulated cluster runs
too (``router.pd_router_for``, one decision per stage: ``_PDStage``).

Prefill/decode (a ``decode`` pool given): requests go to the prefill pool;
a prefill engine ends each one "handoff" after its first token (the client
gets that token at once) and ``ray.put``s its ``KVHandoff``; the front
places the request on a decode engine with a second router and hands that
engine the object reference (never the bytes: the decode actor fetches
them from Ray's object store), whose engine ``add_handoff``s it and
streams the rest. The client sees one stream.

Faults: an actor that dies (a crash, ``ray.kill``, a node lost) fails
every request it held, each with an error event to its client, counted in
``iterserve:engine_actor_failures`` by pool; its router place is marked
down and comes back when Ray has restarted it (its next ``poll``
answers). A request placed on an actor that died before it took the
request is placed again. A handoff the decode engine refuses (a checksum
mismatch, a bad field, its queue full) fails the request, counted in
``iterserve:kv_handoff_failures`` by reason; its prefill pages were freed
when the handoff was taken. Every wait on an actor is bounded.

Names: every pool counts its engines from 0, so an engine is named by role
and index (``ray_engines.engine_name``: "prefill-0", "decode-0"): the
``engine`` of ``GET /router``'s engines and decisions, a record's ``engine``
and ``decode_engine``, and in errors. A record holds its API key's
``tenant``; with keys a caller sees only its own (``guard.own_records``).

Clocks: the front's clock is ``time.monotonic()``; an actor gets how long
ago its request arrived at the front (``waited_ms``), so TTFT on a remote
node counts from the front's arrival but for the transit time.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from typing import Dict, List, Optional

import prometheus_client as prom
import ray
from fastapi import Request as HttpRequest
from ray.exceptions import GetTimeoutError, RayActorError

from serving.engine.requests import RequestOutput
from serving.http import ray_engines
from serving.http.engine_loop import EngineLoop
from serving.http.guard import own_records
from serving.http.metrics import ServerMetrics
from serving.http import router as router_lib
from serving.http.router import RouteCost, router_for
from serving.http.server import OpenAIServer

# Seconds an RPC to an actor (submit, add_handoff) may take before the
# actor is taken as lost.
CALL_TIMEOUT_S = 120.0
# Seconds between polls of an engine that is down.
RETRY_S = 1.0
# Route records kept for ``GET /router``.
MAX_RECORDS = 10_000


@dataclasses.dataclass
class RemoteRequest:
  """The front's mirror of one request (the ``Request`` fields the loop and
  the metrics read). ``stage``: waiting (at the front), prefill (on an
  engine of the entry pool), transfer (handed off, not yet on a decode
  engine), decode, ended."""

  request_id: str
  prompt_token_ids: List[int]
  sampling: object
  arrival_ms: float
  spec: dict
  output_token_ids: List[int] = dataclasses.field(default_factory=list)
  token_times_ms: List[float] = dataclasses.field(default_factory=list)
  outcome: Optional[str] = None
  finish_reason: str = ""
  prefix_hit_tokens: int = 0
  prompt_logprobs: object = None
  queued_ms: Optional[float] = None
  slot: int = -1
  stage: str = "waiting"
  replica: Optional[int] = None            # its engine in the entry pool
  decode_replica: Optional[int] = None
  handoff: Optional[list] = None           # [ObjectRef] while in transfer
  record: dict = dataclasses.field(default_factory=dict)

  @property
  def finished(self) -> bool:
    return self.outcome is not None


class _PDStage:
  """One stage ("prefill" or "decode") of a P/D router
  (``router_lib.PDRouter``) behind the verbs ``RayEngines`` uses of a
  ``Router`` (``submit``, ``dispatch``, ``withdraw``, ``first_token``,
  ``replica_down``, ``replica_up``): a request waits here, in arrival order,
  while the P/D router finds the stage full. ``end`` frees a request's place
  (no outcome: its prefill is done and its KV taken)."""

  cost = None

  def __init__(self, pd, stage: str, configs: List):
    self.pd, self.stage, self.configs = pd, stage, configs
    self.policy = pd.policy
    self._waiting: "collections.OrderedDict[str, tuple]" = collections.OrderedDict()

  def submit(self, request_id, prompt_token_ids, max_tokens, arrival_ms, rerouted_from=(),
             salt=""):
    del rerouted_from
    self._waiting[request_id] = (prompt_token_ids, max_tokens, arrival_ms, salt)

  def withdraw(self, request_id: str) -> None:
    self._waiting.pop(request_id, None)

  def first_token(self, request_id: str) -> None:
    del request_id                # a prefill engine's first token comes with its handoff

  def dispatch(self, now_ms: float) -> List[dict]:
    decisions = []
    for rid, (prompt, max_tokens, arrival_ms, salt) in list(self._waiting.items()):
      if self.stage == "prefill":
        engine = self.pd.route_prefill(rid, prompt, max_tokens, now_ms, salt=salt)
      else:
        engine = self.pd.route_decode(rid, len(prompt), max_tokens, now_ms)
      if engine is None:          # the stage is full: the rest wait in order
        break
      del self._waiting[rid]
      decisions.append(dict(request_id=rid, replica=engine, waited_ms=now_ms - arrival_ms,
                            score_ms=None, tie_key=self.pd.last["tie_key"]))
    return decisions

  def end(self, request_id: str, outcome: Optional[str], reason: str = "") -> None:
    if outcome is None:
      self.pd.prefill_done(request_id, time.monotonic() * 1e3)
    else:
      self.pd.finished(request_id, time.monotonic() * 1e3,
                       {"completed": "completed", "cancelled": "aborted"}.get(outcome, "failed"),
                       reason)

  def replica_down(self, replica: int) -> List[str]:
    return self.pd.engine_down(self.stage, replica)

  def replica_up(self, replica: int, capacity: int, cache_pages: int) -> None:
    del capacity, cache_pages     # the P/D router reads the engine's config
    self.pd.engine_up(self.stage, replica, self.configs[replica])


class _Pool:
  """One pool's actors, router and liveness on the front."""

  def __init__(self, pool: ray_engines.Pool, policy: str, cost: RouteCost, router=None):
    self.role, self.actors = pool.role, pool.actors
    self.names = [ray_engines.engine_name(pool.role, i) for i in range(len(pool.actors))]
    self.configs = [f["config"] for f in pool.facts]
    self.router = router or router_for([dataclasses.asdict(c) for c in self.configs], policy,
                                       cost)
    self.polls: Dict[int, object] = {}            # replica -> its poll in flight
    self.stats: Dict[int, dict] = {}
    self.down_since: Dict[int, float] = {}
    self.retry_at: Dict[int, float] = {}          # replica -> when to poll it again

  def poll(self, i: int) -> None:
    self.polls[i] = self.actors[i].poll.remote(ray_engines.POLL_S)

  def free(self, request_id: str, outcome: Optional[str] = None, reason: str = "") -> None:
    """Frees the request's place in this pool's router (``outcome`` None:
    it left the pool alive, handed off)."""
    if isinstance(self.router, _PDStage):
      self.router.end(request_id, outcome, reason)
    else:
      self.router.finished(request_id)


class RayEngines:
  """The engine actors behind one front (module docstring).

  Args:
    entry: the pool new requests go to (mixed engines, or prefill ones).
    decode: the decode pool (P/D), or None.
    policy, cost: the routers' policy and cost model (both pools).
    route_log: a file that gets each request's route record (one JSON line)
      when it ends; None: none.
  """

  def __init__(self, entry: ray_engines.Pool, decode: Optional[ray_engines.Pool] = None,
               policy: str = "prefix_aware", cost: RouteCost = RouteCost(),
               route_log: Optional[str] = None):
    self.route_log = route_log
    routers = [None, None]
    if decode is not None:             # one P/D router, two stages
      configs = [[f["config"] for f in p.facts] for p in (entry, decode)]
      pd = router_lib.pd_router_for(*configs, policy=policy, max_log=MAX_RECORDS)
      routers = [_PDStage(pd, "prefill", configs[0]), _PDStage(pd, "decode", configs[1])]
    self.entry = _Pool(entry, policy, cost, routers[0])
    self.decode = _Pool(decode, policy, cost, routers[1]) if decode is not None else None
    self.pools = [p for p in (self.entry, self.decode) if p is not None]
    c = self.entry.configs[0]
    self.config = dataclasses.replace(
        c, max_request_slots=sum(x.max_request_slots for x in self.entry.configs),
        role="mixed")
    self.model_cfg = entry.facts[0]["model_cfg"]
    self.requests: Dict[str, RemoteRequest] = {}
    self.failures: "collections.Counter[tuple]" = collections.Counter()
    self.records: "collections.deque[dict]" = collections.deque(maxlen=MAX_RECORDS)
    # Held while the loop thread writes, or ``report`` reads, records and stats.
    self.lock = threading.Lock()
    self._outputs: List[RequestOutput] = []
    self._acks: Dict[object, tuple] = {}        # add_handoff in flight -> (id, replica)
    for pool in self.pools:
      for i in range(len(pool.actors)):
        pool.poll(i)

  def report(self) -> dict:
    """``GET /router``: the policy, every engine (its name, pool, index in
    the pool, liveness and latest stats) and the route records (a snapshot;
    the front gives a caller only its tenant's)."""
    with self.lock:
      engines = [dict(engine=pool.names[i], replica=i, pool=pool.role,
                      alive=i not in pool.down_since,
                      **{k: v for k, v in pool.stats.get(i, {}).items() if k != "replica"})
                 for pool in self.pools for i in range(len(pool.actors))]
      records = list(self.records)
    cost = self.entry.router.cost
    return {"policy": self.entry.router.policy,
            "cost": dataclasses.asdict(cost) if cost is not None else None, "replicas": engines,
            "requests": records}

  # -------------------------------------------------- the Engine's face
  clock = staticmethod(time.monotonic)

  def now_ms(self) -> float:
    return time.monotonic() * 1e3

  def has_unfinished(self) -> bool:
    """A request is live, an end is not yet returned by ``step``, or an
    engine is down (the loop keeps stepping, so that its return is seen)."""
    return (bool(self._outputs) or any(p.down_since for p in self.pools)
            or any(not r.finished for r in self.requests.values()))

  def add_request(self, request_id: str, prompt_token_ids, sampling, *, arrival_ms=None,
                  priority: int = 0, client: str = "default", tenant: Optional[str] = None,
                  **extra) -> RemoteRequest:
    """Queues the request at the front and places it if an engine has room.
    ``tenant``: its API key's (kept in its route record only; None: none).

    Raises:
      ValueError: the id is live here; the engine's refusal (e.g.
        ``QueueFull``) when it was placed at once and refused.
    """
    if request_id in self.requests:
      raise ValueError(f"request_id {request_id!r} is already live")
    now = self.now_ms()
    arrival = now if arrival_ms is None else arrival_ms
    spec = dict(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                sampling=sampling, priority=priority, client=client, extra=extra)
    req = RemoteRequest(request_id, list(prompt_token_ids), sampling, arrival, spec)
    req.record = dict(request_id=request_id, tenant=tenant, arrival_ms=arrival, replica=None,
                      engine=None, decode_replica=None, decode_engine=None, rerouted_from=[],
                      decisions=[], outcome=None)
    self.requests[request_id] = req
    self._route(self.entry, req)
    refusal = self._place(self.entry, only=request_id)
    if refusal is not None:
      del self.requests[request_id]
      raise refusal
    return req

  def step(self) -> List[RequestOutput]:
    """Places what waits, then waits (bounded) for the actors' news; returns
    each request's new tokens and ends, as ``Engine.step`` would."""
    for pool in self.pools:
      for i, at in list(pool.retry_at.items()):
        if time.monotonic() >= at:
          del pool.retry_at[i]
          pool.poll(i)
      self._place(pool)
    refs = {ref: (pool, i) for pool in self.pools for i, ref in pool.polls.items()}
    refs.update(dict.fromkeys(self._acks))
    if not refs:
      time.sleep(ray_engines.POLL_S)
    else:
      ready, _ = ray.wait(list(refs), num_returns=1, timeout=ray_engines.POLL_S + 0.2)
      if ready:
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
      for ref in ready:
        if ref in self._acks:
          self._acked(ref)
        else:
          self._collect(pool=refs[ref][0], i=refs[ref][1], ref=ref)
    for pool in self.pools:
      self._place(pool)
    outputs, self._outputs = self._outputs, []
    return outputs

  def abort(self, request_id: str) -> None:
    self._stop(request_id, "cancelled", "abort")

  def finish(self, request_id: str, reason: str = "stop") -> RequestOutput:
    req = self.requests[request_id]
    if not req.finished:
      if not req.output_token_ids:
        raise ValueError(f"request {request_id!r}: finish needs at least one output token")
      self._stop(request_id, "completed", reason)
    return RequestOutput(request_id, [], True, req.outcome, req.finish_reason)

  def evict(self, request_id: str) -> RemoteRequest:
    req = self.requests[request_id]
    if not req.finished:
      raise ValueError(f"request {request_id!r} is live; abort or finish it first")
    return self.requests.pop(request_id)

  # ------------------------------------------------------------ placing
  def _route(self, pool: _Pool, req: RemoteRequest) -> None:
    max_tokens = max(1, min(req.sampling.max_tokens, self.config.max_model_len))
    pool.router.submit(req.request_id, req.prompt_token_ids, max_tokens, req.arrival_ms,
                       rerouted_from=req.record["rerouted_from"],
                       salt=req.spec["extra"].get("cache_salt", ""))

  def _place(self, pool: _Pool, only: Optional[str] = None) -> Optional[BaseException]:
    """Places waiting requests of ``pool`` while an engine has room; returns
    the refusal of ``only`` (the request being added) when it was placed
    and refused, so that ``add_request`` raises it."""
    refusal = None
    for decision in pool.router.dispatch(self.now_ms()):
      rid, i = decision["request_id"], decision["replica"]
      req = self.requests.get(rid)
      if req is None or req.finished:          # aborted while waiting
        pool.free(rid, "cancelled")
        continue
      req.record["decisions"].append(dict(
          pool=pool.role, replica=i, engine=pool.names[i], waited_ms=decision["waited_ms"],
          score_ms=decision["score_ms"], tie_key=decision["tie_key"]))
      waited_ms = self.now_ms() - req.arrival_ms
      if pool is self.decode:         # acknowledged in a later step (``_acked``)
        ack = pool.actors[i].add_handoff.remote(rid, req.handoff, waited_ms)
        self._acks[ack] = (rid, i)
        req.handoff, req.decode_replica = None, i
        req.record.update(decode_replica=i, decode_engine=pool.names[i])
        continue
      try:
        spec = dict(req.spec, waited_ms=waited_ms)
        result = ray.get(pool.actors[i].submit.remote([spec]), timeout=CALL_TIMEOUT_S)[0]
      except (RayActorError, GetTimeoutError):     # it died before taking the request
        self._lost(pool, i)
        req.record["rerouted_from"].append(i)
        self._route(pool, req)
        continue
      req.replica, req.stage = i, "prefill"
      req.record.update(replica=i, engine=pool.names[i])
      if isinstance(result, BaseException):
        pool.free(rid, "rejected")
        if rid == only:
          refusal = result
          continue
        self._end(req, "rejected", str(result))
      elif isinstance(result, dict):            # rejected at once by the engine
        self._end(req, result["outcome"], result["finish_reason"])
    return refusal

  def _acked(self, ref) -> None:
    """A decode engine answered a handoff: the request decodes there, or
    fails with the engine's refusal (counted by reason). A request that
    ended here meanwhile (aborted in transfer) is aborted there too."""
    rid, i = self._acks.pop(ref)
    try:
      result = ray.get(ref, timeout=CALL_TIMEOUT_S)
    except (RayActorError, GetTimeoutError):
      self._lost(self.decode, i)            # fails it, if still live
      return
    req = self.requests.get(rid)
    if req is None or req.finished:
      if result is None:
        self.decode.actors[i].abort.remote(rid)
      return
    if result is None:
      req.stage = "decode"
      # Transfer as the request lives it: from the handoff reaching the front
      # to the decode engine holding the record (placement wait, the call,
      # the transport's fetch and the checks).
      req.record["transfer_ms"] = self.now_ms() - req.record["handoff_ms"]
      return
    reason = type(result).__name__
    self.failures[("kv_handoff", reason)] += 1
    self._end(req, "failed", f"handoff refused by engine {self.decode.names[i]}: {reason}: "
              f"{result}")

  # ---------------------------------------------------------- the news
  def _collect(self, pool: _Pool, i: int, ref) -> None:
    try:
      news = ray.get(ref, timeout=CALL_TIMEOUT_S)
    except (RayActorError, GetTimeoutError):
      del pool.polls[i]
      if i in pool.down_since:         # still down (restarting, or gone): later
        pool.retry_at[i] = time.monotonic() + RETRY_S
      else:
        self._lost(pool, i)
        pool.poll(i)                   # answers once Ray has restarted it
      return
    if i in pool.down_since:          # back (restarted): placed on again
      del pool.down_since[i]
      c = pool.configs[i]
      pool.router.replica_up(i, c.max_request_slots,
                             c.num_pages - 1 if c.enable_prefix_caching else 0)
    with self.lock:
      pool.stats[i] = news["stats"]
    pool.poll(i)
    for update in news["updates"]:
      self._apply(pool, i, update)

  def _apply(self, pool: _Pool, i: int, u: dict) -> None:
    req = self.requests.get(u["request_id"])
    if req is None or req.finished:            # ended here (abort, stop string)
      return
    now = self.now_ms()
    if u.get("queued_ms") is not None and req.queued_ms is None:
      req.queued_ms, req.prefix_hit_tokens = u["queued_ms"], u["prefix_hit_tokens"]
      req.prompt_logprobs = u["prompt_logprobs"]
      req.slot = i
    new = u["new_token_ids"]
    if new:
      if not req.output_token_ids:
        pool.router.first_token(req.request_id)
      req.output_token_ids.extend(new)
      req.token_times_ms.extend([now] * len(new))
    handoff = (u["finished"] and u["finish_reason"] == "handoff"
               and self.decode is not None and pool is self.entry)
    if handoff:
      pool.free(req.request_id)
      req.stage, req.handoff = "transfer", u["handoff"]
      req.record["handoff_ms"] = now
      self._route(self.decode, req)
      self._outputs.append(RequestOutput(req.request_id, new, False, None, "",
                                         u["new_logprobs"]))
      return
    if u["finished"]:
      self._settle(req, u["outcome"], u["finish_reason"])
    self._outputs.append(RequestOutput(req.request_id, new, u["finished"], u["outcome"],
                                       u["finish_reason"], u["new_logprobs"]))

  # ---------------------------------------------------------- endings
  def _holder(self, req: RemoteRequest):
    """(pool, replica) holding ``req`` now (in transfer: the decode engine
    it was handed to, once placed), or None (waiting at the front)."""
    if req.stage == "prefill":
      return self.entry, req.replica
    if req.stage == "decode" or (req.stage == "transfer" and req.decode_replica is not None):
      return self.decode, req.decode_replica
    return None

  def _settle(self, req: RemoteRequest, outcome: str, reason: str) -> None:
    """Marks ``req`` ended and frees its router places."""
    req.outcome, req.finish_reason = outcome, reason
    for pool in self.pools:
      pool.router.withdraw(req.request_id)
      pool.free(req.request_id, outcome, reason)
    req.handoff, req.stage = None, "ended"
    req.record.update(outcome=outcome, reason=reason)
    with self.lock:
      self.records.append(req.record)
    if self.route_log:
      with open(self.route_log, "a") as f:
        f.write(json.dumps(req.record) + "\n")

  def _stop(self, request_id: str, outcome: str, reason: str) -> None:
    """Ends a live request here (abort, a stop string) and on its engine."""
    req = self.requests.get(request_id)
    if req is None or req.finished:
      return
    holder = self._holder(req)
    if holder is not None:
      pool, i = holder
      if outcome == "cancelled":
        pool.actors[i].abort.remote(request_id)
      else:
        pool.actors[i].finish.remote(request_id, reason)
    self._settle(req, outcome, reason)

  def _end(self, req: RemoteRequest, outcome: str, reason: str) -> None:
    """Ends ``req`` for a reason of the front's (a lost engine, a refused
    handoff): its final output is the next step's."""
    self._settle(req, outcome, reason)
    self._outputs.append(RequestOutput(req.request_id, [], True, outcome, reason))

  def _lost(self, pool: _Pool, i: int) -> None:
    """Engine ``i`` of ``pool`` died: every request it held fails."""
    if i in pool.down_since:
      return
    pool.down_since[i] = time.monotonic()
    pool.router.replica_down(i)
    with self.lock:
      pool.stats.pop(i, None)
    for req in list(self.requests.values()):
      if not req.finished and self._holder(req) == (pool, i):
        self.failures[("engine_actor", pool.role)] += 1
        self._end(req, "failed", f"engine {pool.names[i]} died (its actor exited); "
                  f"the request failed")


class RayLoop(EngineLoop):
  """``EngineLoop`` over ``RayEngines``: queue time as the actors measured it."""

  def _stamp_queue_time(self, start_ms: float, outputs) -> None:
    for rid, live in self._live.items():
      req = self.engine.requests[rid]
      if live.queued_ms is None and req.queued_ms is not None:
        live.queued_ms, live.cached_tokens = req.queued_ms, req.prefix_hit_tokens
        self.metrics.queue_time.observe(max(live.queued_ms, 0.0) / 1e3)


class RayMetrics(ServerMetrics):
  """``ServerMetrics`` with the gauges summed over the actors, and the
  front's fault counters."""

  def __init__(self, model_name: str, capacity: int):
    super().__init__(model_name, capacity)
    self.actor_failures = prom.Counter(
        "iterserve:engine_actor_failures", "Requests failed because their engine actor "
        "died, by pool.", ["model_name", "pool"], registry=self.registry)
    self.handoff_failures = prom.Counter(
        "iterserve:kv_handoff_failures", "Requests failed because a decode engine refused "
        "their KV handoff, by reason.", ["model_name", "reason"], registry=self.registry)
    self._failures_seen: "collections.Counter[tuple]" = collections.Counter()
    self._counted: Dict[tuple, dict] = {}         # (pool, replica) -> counters seen

  def _count(self, key: tuple, stats: dict) -> None:
    """Adds an engine's counter increases since last seen (a restarted
    engine's counters start again from zero)."""
    seen = self._counted.get(key, {})
    for name, counter in (("prefix_cache_queries", self.prefix_queries),
                          ("prefix_cache_hits", self.prefix_hits),
                          ("prefill_tokens_computed", self.prefill_computed),
                          ("num_preemptions", self.preemptions)):
      value, before = stats[name], seen.get(name, 0)
      counter.inc(value - before if value >= before else value)
    self._counted[key] = stats

  def observe_engine(self, engine: RayEngines, unslotted: int) -> None:
    stats = [s for pool in engine.pools for s in pool.stats.values()]
    total = lambda key: sum(s[key] for s in stats)
    self.running.set(total("running"))
    self.suspended.set(total("suspended"))
    self.waiting.set(total("waiting") + unslotted)
    pages = sum(s["num_pages"] - 1 for s in stats)
    self.kv_usage.set(1.0 - (total("free_pages") + total("evictable_pages")) / pages
                      if pages else 0.0)
    self.kv_pages_peak.set(max((s["num_pages"] - 1 - s["free_pages"] - s["evictable_pages"]
                                for s in stats), default=0))
    for pool in engine.pools:
      for i, s in pool.stats.items():
        self._count((pool.role, i), s)
    for key, value in engine.failures.items():
      if value > self._failures_seen[key]:
        kind, label = key
        counter = self.actor_failures if kind == "engine_actor" else self.handoff_failures
        counter.labels(self._model, label).inc(value - self._failures_seen[key])
        self._failures_seen[key] = value


class RayFront(OpenAIServer):
  """The OpenAI server over ``RayEngines`` (module docstring); ``GET
  /router`` gives the route records and each engine's latest stats."""

  def __init__(self, engines: RayEngines, tokenizer, model_name: str, **kwargs):
    super().__init__(engines, tokenizer, model_name, **kwargs)
    self.metrics = RayMetrics(model_name, self.metrics.capacity)
    self.loop = RayLoop(engines, tokenizer, self.metrics, on_death=self._engine_died)

  def _parse(self, raw: bytes, chat: bool, tenant: Optional[str]):
    """``OpenAIServer._parse``; the tenant goes to the route record."""
    parsed = super()._parse(raw, chat, tenant)
    parsed.extra["tenant"] = tenant
    return parsed

  def _build_app(self):
    app = super()._build_app()

    @app.get("/router")
    async def router_report(request: HttpRequest):
      """``RayEngines.report`` with the caller's own route records only
      (``guard.own_records``: with keys, its key's tenant's)."""
      report = self.engine.report()
      return dict(report, requests=own_records(request.scope, report["requests"]))

    return app

def run_ray_front(build_for_role, tokenizer, model_name: str, *, replicas: int = 0,
                  prefill_replicas: int = 0, decode_replicas: int = 0,
                  ray_address: Optional[str] = None, replica_cpus: float = 1.0,
                  max_restarts: int = 3, kv_transport: str = "object_store",
                  policy: str = "prefix_aware",
                  cost: RouteCost = RouteCost(), route_log: Optional[str] = None,
                  max_waiting: int = 64, sock=None,
                  host: str = "127.0.0.1", port: int = 8000, **server_kwargs) -> int:
  """Starts (or joins) Ray, starts the engine actors (``replicas`` mixed
  ones, or ``prefill_replicas`` + ``decode_replicas``; ``build_for_role(role)``
  gives each pool's engine builder; ``kv_transport`` one of
  ``ray_transfer.TRANSPORTS``), serves the front on ``sock`` until
  interrupted, then stops the actors. Returns the exit status.

  Raises:
    RuntimeError: an engine actor did not start (its error named).
  """
  from serving.http.server import bind_socket

  ray_engines.init_ray(ray_address)
  if replicas:
    plan = [("mixed", replicas)]
  else:
    plan = [("prefill", prefill_replicas), ("decode", decode_replicas)]
  pools = []
  try:
    for role, num in plan:
      pools.append(ray_engines.start_engines(build_for_role(role), num, role=role,
                                             max_restarts=max_restarts,
                                             num_cpus=replica_cpus, transport=kv_transport))
    engines = RayEngines(*pools, policy=policy, cost=cost, route_log=route_log)
    front = RayFront(engines, tokenizer, model_name, max_waiting=max_waiting, **server_kwargs)
    shape = (f"{replicas} engine actors" if replicas else
             f"{prefill_replicas} prefill + {decode_replicas} decode engine actors")
    print(f"serving {model_name!r} over {shape} ({policy}) on http://{host}:{port}/v1",
          flush=True)
    try:
      return front.serve(sock if sock is not None else bind_socket(host, port))
    except KeyboardInterrupt:         # uvicorn re-raises the signal it shut down on
      return 0
  finally:
    ray_engines.stop_engines(pools)
