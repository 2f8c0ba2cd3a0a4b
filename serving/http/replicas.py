"""A router front over replica servers that already run (``serve.py
--replica_urls``): data-parallel engines behind one OpenAI endpoint
(FastAPI + httpx). Engines the front starts itself are Ray actors
(``serving.http.ray_front``), not this.

Each replica is a whole ``serving.http.server`` process (its own engine, its own
devices later), so request handling has one home: the replica parses and
validates the body, runs it, detokenizes and streams. The front only places
and relays: it asks a live replica for the prompt's token ids
(``POST /tokenize``), queues the request in ``serving.http.router.Router``, sends
the body unchanged to the chosen replica with the original arrival
(``ARRIVAL_HEADER``) and passes the response through byte for byte (SSE
streams included); a replica's error that is not an OpenAI error body (a
plain-text 500) is wrapped in one (``relayed_error``), so every error a
client sees has the OpenAI shape.

A replica that dies (a request to it fails at the transport and its
``/health`` does not answer, or its health checks fail) is marked down;
new requests go to the others. Each of its in-flight requests ends one of
two ways, and its route record says which:

* ``rerouted``: nothing of the response had reached the client (a whole
  response not yet returned, or a stream before its first chunk): it is
  placed again, keeping its original arrival, and runs from the start on
  another replica (same seed, same tokens: a request's tokens do not depend
  on the replica or its batches).
* ``failed``: part of a stream had been sent; the stream ends with an
  OpenAI-style error chunk naming the replica, then ``data: [DONE]``.

Every request gets one JSON line (``route_log``) when it ends: its
decisions (each with every replica's facts as they stood), the replica that
served it, what it was re-routed from, and its outcome (completed, failed,
refused, cancelled) and its API key's ``tenant``. ``GET /router`` returns
the same records (the last ``MAX_RECORDS``; the log keeps all; with keys,
only the caller's tenant's: ``guard.own_records``), the policy and each replica's
prefix-cache counters (scraped from its ``/metrics``), for the replay
report. ``GET /metrics`` is the front's ``iterserve:router_*`` series, then
every live replica's own series with a ``replica`` label
(``relayed_metrics``). A client that hangs up before its response is
cancelled where its request is: it leaves the router's queue, or the front
closes the upstream connection and the replica aborts it. The front holds at
most ``max_waiting`` requests waiting for a replica place; past that a
request gets HTTP 429.

Router events: a request's place frees when its response ends; its prefill
leaves the router's queue estimate at its first streamed chunk (a whole,
non-streamed response only tells the front at its end, so its prefill
counts as queued until then).

Clocks: the router's clock is ``time.monotonic()`` in ms. Replicas
(``replica_launch.run_remote_front``) share no clock with the front: they get
no arrival header (unless ``shared_clock``: a test's replicas on this host),
so their TTFT and queue time count from the forward, not from the front's
arrival (the time a request waited at the front is in its route record,
``waited_ms``).

Every replica is health-checked: every
``_HEALTH_S`` the front asks each one's ``/health``; one that fails
``_HEALTH_FAILS`` checks in a row (or a request's transport error, or a 5xx
answer, and one failed check) is marked down, its requests re-routed or
failed as above (a 5xx answer had sent nothing: that request is placed
again). One that is down and answers again rejoins once its ``/engine``
facts agree with the front's (model, page size, vocabulary, context): it
is placed on again, its router cache model starting empty (a restarted
replica's prefix cache is). ``iterserve:router_replica_up{replica}`` is 1
while a replica is up.

Admission and placement: the ``max_waiting`` bound is checked and the
request queued in the router with no await between (a burst cannot
overshoot it); ``max_tokens`` is clamped to the context for the estimate
(a larger value is the replica's 400 to give), and a request that leaves
placement by any path leaves the router's queue. The front runs the same
``guard.Guard`` as a server; a client's ``Authorization`` goes on to the
replica and its key's tenant as TENANT_HEADER (trusted only by replicas
the front spawned).

Request ids: the client's ``x-request-id`` goes to the replica (which names
its response by it and echoes it) and comes back on the front's response; the
route record keeps it as ``client_request_id``. Batched prompts (a list of
strings or of token-id lists) go whole to one replica, which runs one engine
request per prompt and returns one choice each, ``index`` in prompt order
(its own batch rule, unchanged): the front tokenizes each prompt and places
the batch as one request whose prompt is the prompts one after another (the
estimate's prefill counts every prompt's tokens; its cache facts match the
first prompt's leading pages), holding one router place.

Waiting for the replicas and serving the front over them is
``serving.http.replica_launch``. One file: ``ReplicaFront`` (about 480 of
its lines) is one state machine on one event loop: placing, relaying,
re-routing and watching replicas' health all read and write the router's
replica states, the pending placements and the route records, and each
step ends in ``_dispatch``; split across files it would share that state
through private attributes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import sys
import time
from typing import Dict, List, Optional, Sequence

import httpx
import prometheus_client as prom
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from serving.http.guard import TENANT_SCOPE_KEY, Access, Guard, own_records, prefix_salt
from serving.http.protocol import (ARRIVAL_HEADER, REQUEST_ID_HEADER, TENANT_HEADER,
                                   BadRequest, LongInt, Overloaded, Unavailable, _error_response,
                                   _sse, json_body, model_card, model_routes, openai_errors,
                                   whole_int)
from serving.http.router import RouteCost, router_for

_DISCONNECT_POLL_S = 0.25       # seconds between client disconnect checks
MAX_RECORDS = 10_000            # route records GET /router keeps (bounded memory)
_PROBE_TIMEOUT_S = 2.0
_HEALTH_S = 1.0                 # seconds between health checks of replicas given by URL
_HEALTH_FAILS = 2               # failed checks in a row that mark such a replica down
_AGREE = ("model", "page_size", "vocab_size", "max_model_len")   # a rejoining replica's


class _ReplicaTransport(httpx.AsyncHTTPTransport):
  """httpx's transport, with one more way a dying replica shows: a
  connection the replica's kernel resets while httpcore opens it can raise
  ``AttributeError`` from anyio (the socket is gone before its peer name is
  read). That is a replica not answering, so it is raised as
  ``httpx.ConnectError`` like a refused connection, and the probe, re-route
  and failure paths treat it as one."""

  async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
    try:
      return await super().handle_async_request(request)
    except AttributeError as e:
      raise httpx.ConnectError(f"connection lost while opening it ({e})",
                               request=request) from e


def relayed_error(replica: int, status: int, content: bytes,
                  headers: Optional[dict] = None) -> Response:
  """A replica's non-200 answer as the front returns it: its OpenAI error
  body unchanged, or, when the body is not one (e.g. a plain-text 500), the
  same status with an OpenAI error naming the replica and quoting its text."""
  try:
    body = json.loads(content)
  except (json.JSONDecodeError, UnicodeDecodeError):
    body = None
  if isinstance(body, dict) and isinstance(body.get("error"), dict):
    return Response(content, status_code=status, media_type="application/json",
                    headers=headers)
  text = content.decode("utf-8", "replace").strip()[:200]
  kind = "invalid_request_error" if status < 500 else "server_error"
  return JSONResponse({"error": {"message": f"replica {replica} answered HTTP {status}: "
                                            f"{text!r}", "type": kind, "param": None,
                                 "code": None}}, status_code=status, headers=headers)


def _stream_error(tail: bytes) -> Optional[dict]:
  """The ``error`` object of a stream's last event before ``[DONE]``, if any."""
  events = [e for e in tail.split(b"\n\n") if e.startswith(b"data: {")]
  try:
    return json.loads(events[-1][6:]).get("error") if events else None
  except json.JSONDecodeError:           # the tail cut an event: not an error event
    return None


class ReplicaFront:
  """The front's FastAPI app (see the module docstring).

  Args:
    urls: the replicas' base URLs, e.g. ``http://127.0.0.1:8001``.
    facts: each replica's ``GET /engine`` (``replica_launch.wait_ready``).
    policy: a ``serving.http.router.POLICIES`` name.
    cost: the router's ``RouteCost``.
    route_log: JSON-lines path for the per-request route records (None: off).
    max_waiting: requests that may wait at the front (>= 0).
    shared_clock: the replicas read the front's ``time.monotonic()`` (same
      host): each forward carries the request's arrival (ARRIVAL_HEADER).
    access: the ``guard.Access`` the front's ``Guard`` enforces. A client's
      ``Authorization`` goes on to the replica (replicas given by URL may
      check the same keys); its key's tenant goes as TENANT_HEADER.

  Raises:
    ValueError: replicas that serve different models or page sizes, or a
      bad policy / max_waiting.
  """

  def __init__(self, urls: Sequence[str], facts: Sequence[dict], *, policy: str = "prefix_aware",
               cost: RouteCost = RouteCost(), route_log: Optional[str] = None,
               max_waiting: int = 64, shared_clock: bool = True,
               access: Access = Access()):
    if not urls or len(urls) != len(facts):
      raise ValueError("urls and facts must be one entry per replica (>= 1)")
    for key in ("model", "page_size", "vocab_size"):
      values = {f[key] for f in facts}
      if len(values) != 1:
        raise ValueError(f"replicas must agree on {key}, got {sorted(values)}")
    if max_waiting < 0:
      raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
    self.urls, self.facts = list(urls), list(facts)
    self.model_name = facts[0]["model"]
    self.created = int(time.time())
    self.max_model_len = min(f["max_model_len"] for f in facts)
    self.router = router_for(facts, policy, cost)
    self.max_waiting = max_waiting
    self.route_log = route_log
    self.shared_clock = shared_clock
    self._failed_checks = [0] * len(urls)
    # The last MAX_RECORDS route records (the route log keeps them all).
    self.records: "collections.deque[dict]" = collections.deque(maxlen=MAX_RECORDS)
    self._futures: Dict[str, asyncio.Future] = {}
    self._ids = itertools.count()
    self._tokenize_turn = itertools.count()
    self.http: Optional[httpx.AsyncClient] = None
    r = self.registry = prom.CollectorRegistry()
    self._routed = prom.Counter("iterserve:router_requests", "Requests by final replica and "
                                "outcome.", ["replica", "outcome"], registry=r)
    self._reroutes = prom.Counter("iterserve:router_reroutes", "Placements re-done after a "
                                  "replica died.", registry=r)
    self._alive = prom.Gauge("iterserve:router_replicas_alive", "Replicas up.", registry=r)
    self._alive.set(len(urls))
    self._up = prom.Gauge("iterserve:router_replica_up", "1 while the replica is up (placed "
                          "on), 0 while down.", ["replica"], registry=r)
    for i in range(len(urls)):
      self._up.labels(str(i)).set(1)
    self.app = Guard(self._build_app(), access)

  # ---------------------------------------------------------- replicas
  async def _probe(self, replica: int) -> bool:
    try:
      reply = await self.http.get(f"{self.urls[replica]}/health", timeout=_PROBE_TIMEOUT_S)
      return reply.status_code == 200
    except httpx.HTTPError:
      return False

  def _down(self, replica: int) -> None:
    if self.router.replicas[replica].alive:
      self.router.replica_down(replica)
      self._alive.set(len(self.router.alive()))
      self._up.labels(str(replica)).set(0)
      print(f"replica {replica} ({self.urls[replica]}) stopped answering; it is down, "
            f"its requests are re-routed or failed", file=sys.stderr, flush=True)
    self._dispatch()

  async def _rejoin(self, replica: int) -> None:
    """A down replica given by URL answers /health again: it rejoins when
    its ``/engine`` facts agree with the front's (``_AGREE``), with its
    capacity and cache size as it now reports them and an empty cache model."""
    try:
      facts = (await self.http.get(f"{self.urls[replica]}/engine", timeout=10)).json()
      differ = [k for k in _AGREE if facts.get(k) != self.facts[replica][k]]
    except (httpx.HTTPError, ValueError) as e:
      differ = [f"/engine unreadable ({type(e).__name__})"]
    if differ:
      print(f"replica {replica} ({self.urls[replica]}) answers again but is kept down: "
            f"its {differ} differ from the front's", file=sys.stderr, flush=True)
      return
    self.facts[replica] = facts
    self.router.replica_up(replica, facts["max_request_slots"],
                           facts["num_pages"] - 1 if facts["enable_prefix_caching"] else 0)
    self._alive.set(len(self.router.alive()))
    self._up.labels(str(replica)).set(1)
    print(f"replica {replica} ({self.urls[replica]}) rejoined", file=sys.stderr, flush=True)
    self._dispatch()

  async def _health(self) -> None:
    """Every _HEALTH_S: checks every replica (one that runs but answers
    /health 503, its engine dead, is no better than one that exited); marks
    one down after _HEALTH_FAILS failed checks in a row, has a down one that
    answers rejoin (``_rejoin``)."""
    while True:
      await asyncio.sleep(_HEALTH_S)
      every = list(range(len(self.urls)))
      answers = await asyncio.gather(*(self._probe(i) for i in every))
      for i, ok in zip(every, answers):
        alive = self.router.replicas[i].alive
        self._failed_checks[i] = 0 if ok else self._failed_checks[i] + 1
        if alive and self._failed_checks[i] >= _HEALTH_FAILS:
          self._down(i)
        elif ok and not alive:
          await self._rejoin(i)

  async def _lost(self, replica: int) -> bool:
    """After a transport error: True (and marked down) if the replica is gone."""
    if not self.router.replicas[replica].alive or not await self._probe(replica):
      self._down(replica)
      return True
    return False

  # ----------------------------------------------------------- placing
  def _dispatch(self) -> None:
    for decision in self.router.dispatch(time.monotonic() * 1e3):
      future = self._futures.pop(decision["request_id"], None)
      if future is not None and not future.done():
        future.set_result(decision)
    if not self.router.alive():                  # nothing left to place on
      for rid, future in list(self._futures.items()):
        self.router.withdraw(rid)
        if not future.done():
          future.set_result(None)
      self._futures.clear()

  def _admit(self) -> None:
    """Raises Overloaded when a request submitted now would wait and
    ``max_waiting`` already do. Checked and followed by the submit with no
    await between (atomic on the event loop): the bound holds under a burst."""
    waiting = self.router.num_waiting()
    if (waiting > 0 or not self.router.has_room()) and waiting >= self.max_waiting:
      raise Overloaded(f"{waiting} requests wait for a replica, the bound (--max_waiting "
                       f"= {self.max_waiting}); retry later")

  async def _place(self, rid: str, ids: List[int], max_tokens: int, arrival_s: float,
                   rerouted_from: List[int], salt: str = "") -> Optional[dict]:
    """The placement decision for a request (None: no replica is alive).
    A first placement is admitted against ``max_waiting`` (a re-placement,
    already admitted, is not). Whatever happens, a request that does not
    leave here placed leaves the router's queue.

    Raises:
      Overloaded: ``max_waiting`` requests already wait.
    """
    future = asyncio.get_running_loop().create_future()
    try:
      if not rerouted_from:
        self._admit()
      self._futures[rid] = future
      self.router.submit(rid, ids, max_tokens, arrival_s * 1e3, rerouted_from, salt)
      self._dispatch()
      return await future
    finally:
      if not future.done():            # refused, failed, or the client went away
        self._futures.pop(rid, None)
        self.router.withdraw(rid)

  async def _tokenize(self, body: dict, raw: bytes, auth: dict):
    """(prompt ids, None): every prompt's token ids one after another (a
    batched prompt tokenized prompt by prompt, each ``/tokenize`` carrying
    only its prompt, and at most the replicas' live bound of prompts), and
    the longest prompt's length; or (None, the refusal to return)."""
    batch = body.get("prompt") if "messages" not in body else None
    if not (isinstance(batch, list) and len(batch) > 1
            and (all(isinstance(p, str) for p in batch)
                 or all(isinstance(p, list) for p in batch))):
      ids, refusal = await self._tokenize_one(raw, auth)
      return (None, refusal) if refusal is not None else ((ids, len(ids)), None)
    most = min(f.get("capacity", f["max_request_slots"]) for f in self.facts)
    if len(batch) > most:
      return None, _error_response(BadRequest(
          f"'prompt' holds {len(batch)} prompts; a batch holds at most {most} (the "
          f"replicas' live bound)", "prompt"))
    vocab = self.facts[0]["vocab_size"]
    for i, prompt in enumerate(batch):   # kept as a marker, not JSON to forward
      if isinstance(prompt, list) and any(isinstance(t, LongInt) for t in prompt):
        return None, _error_response(BadRequest(
            f"'prompt[{i}]' as token ids must be a non-empty list of ids in [0, {vocab})",
            f"prompt[{i}]"))
    ids, longest = [], 0
    for prompt in batch:
      one, refusal = await self._tokenize_one(json.dumps({"prompt": prompt}).encode(), auth)
      if refusal is not None:
        return None, refusal
      ids += one
      longest = max(longest, len(one))
    return (ids, longest), None

  async def _tokenize_one(self, raw: bytes, auth: dict):
    """(ids, None) from a live replica's /tokenize, or (None, its Response)."""
    for _ in range(len(self.urls)):
      alive = self.router.alive()
      if not alive:
        break
      replica = alive[next(self._tokenize_turn) % len(alive)]
      try:
        reply = await self.http.post(f"{self.urls[replica]}/tokenize", content=raw,
                                     headers={"content-type": "application/json", **auth})
      except httpx.TransportError:
        await self._lost(replica)
        continue
      if reply.status_code >= 500 and await self._lost(replica):
        continue                       # a replica whose engine died: ask another
      if reply.status_code != 200:
        return None, relayed_error(replica, reply.status_code, reply.content)
      return reply.json()["tokens"], None
    return None, _error_response(Unavailable("no replica is alive"))

  # ----------------------------------------------------------- serving
  def _end(self, record: dict, outcome: str, reason: str = "") -> None:
    """Closes a request's route record (once) and frees its place."""
    if record.get("outcome") is not None:
      return
    record.update(outcome=outcome, reason=reason, end_s=time.monotonic())
    self.router.finished(record["request_id"])
    self._dispatch()
    replica = record["replica"] if record["replica"] is not None else "none"
    self._routed.labels(str(replica), outcome).inc()
    self.records.append(record)
    if self.route_log:
      with open(self.route_log, "a") as f:
        f.write(json.dumps(record) + "\n")

  def _headers(self, record: dict, upstream: httpx.Response) -> dict:
    """The front's response headers: the replica that served, what it was
    re-routed from, and the replica's ``x-request-id`` echo."""
    headers = {"x-iterserve-replica": str(record["replica"])}
    if REQUEST_ID_HEADER in upstream.headers:
      headers[REQUEST_ID_HEADER] = upstream.headers[REQUEST_ID_HEADER]
    if record["rerouted_from"]:
      headers["x-iterserve-rerouted-from"] = ",".join(map(str, record["rerouted_from"]))
    return headers

  async def _serve(self, request: HttpRequest, path: str):
    arrival_s = time.monotonic()
    raw = await request.body()
    try:
      body = json_body(raw)
      if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
      self._admit()             # early refusal; the bound is enforced at placement
    except Exception as e:
      return _error_response(e)
    auth = {k: v for k, v in (("authorization", request.headers.get("authorization")),
                              (TENANT_HEADER, request.scope.get(TENANT_SCOPE_KEY)))
            if v is not None}
    tokenized, refusal = await self._tokenize(body, raw, auth)
    if refusal is not None:
      return refusal
    ids, longest = tokenized
    max_tokens = whole_int(body.get("max_completion_tokens") or body.get("max_tokens"))
    if max_tokens is None or max_tokens < 1:
      max_tokens = self.max_model_len - longest        # the replica checks the body
    # The estimate's figure, clamped to what the context allows: any larger
    # value is the replica's 400 to give, never an overflow here.
    max_tokens = min(max(1, max_tokens), self.max_model_len)
    stream = body.get("stream") is True
    # The replicas' salt (``OpenAIServer._parse``), for the router's cache model.
    salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else ""
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    salt = prefix_salt(tenant, salt)
    rid = f"route-{next(self._ids)}"
    record = dict(request_id=rid, client_request_id=request.headers.get(REQUEST_ID_HEADER),
                  tenant=tenant, path=path, arrival_s=arrival_s, prompt_tokens=len(ids),
                  max_tokens=max_tokens, stream=stream, replica=None, rerouted_from=[],
                  decisions=[], outcome=None)
    route = asyncio.ensure_future(self._route(record, raw, ids, auth, salt))
    while True:                     # a client that hangs up cancels its request
      done, _ = await asyncio.wait({route}, timeout=_DISCONNECT_POLL_S)
      if done:
        return route.result()
      if await request.is_disconnected():
        route.cancel()
        with contextlib.suppress(asyncio.CancelledError):
          await route
        self._end(record, "cancelled", "client disconnected before the response")
        return Response(status_code=499)

  async def _route(self, record: dict, raw: bytes, ids: List[int], auth: dict,
                   salt: str) -> Response:
    """Places the request, forwards it, re-places it while its replica dies
    before anything was sent; returns the response to relay. Cancelled (the
    client left): leaves the router's queue, and closing the upstream
    connection makes the replica cancel the request."""
    rid, path, stream = record["request_id"], record["path"], record["stream"]
    arrival_s, max_tokens = record["arrival_s"], record["max_tokens"]
    headers = {"content-type": "application/json", **auth}
    if self.shared_clock:
      headers[ARRIVAL_HEADER] = repr(arrival_s)
    if record["client_request_id"] is not None:
      headers[REQUEST_ID_HEADER] = record["client_request_id"]
    while True:
      try:
        decision = await self._place(rid, ids, max_tokens, arrival_s,
                                     record["rerouted_from"], salt)
      except Overloaded as e:
        self._end(record, "refused", str(e))
        return _error_response(e)
      if decision is None:
        self._end(record, "failed", "no replica is alive")
        return _error_response(Unavailable("no replica is alive"))
      record["decisions"].append(decision)
      record["replica"] = replica = decision["replica"]
      upstream = None
      try:
        upstream = await self.http.send(self.http.build_request(
            "POST", f"{self.urls[replica]}{path}", content=raw, headers=headers), stream=True)
        if upstream.status_code >= 500:
          content = await upstream.aread()
          await upstream.aclose()
          if await self._lost(replica):        # it answers /health no more: down
            record["rerouted_from"].append(replica)
            self._reroutes.inc()
            continue                           # nothing was sent: place again
          self._end(record, "failed", f"HTTP {upstream.status_code}")
          return relayed_error(replica, upstream.status_code, content,
                               self._headers(record, upstream))
        if upstream.status_code != 200 or not stream:
          content = await upstream.aread()
          await upstream.aclose()
          outcome = ("completed" if upstream.status_code == 200 else
                     "refused" if upstream.status_code in (400, 429) else "failed")
          self._end(record, outcome, f"HTTP {upstream.status_code}")
          if upstream.status_code != 200:
            return relayed_error(replica, upstream.status_code, content,
                                 self._headers(record, upstream))
          return Response(content, status_code=upstream.status_code,
                          media_type=upstream.headers.get("content-type"),
                          headers=self._headers(record, upstream))
        chunks = upstream.aiter_raw()
        first = await chunks.__anext__()
      except (httpx.TransportError, StopAsyncIteration) as e:
        if upstream is not None:
          await upstream.aclose()
        if await self._lost(replica):
          record["rerouted_from"].append(replica)
          self._reroutes.inc()
          continue                                   # nothing was sent: place again
        self._end(record, "failed", f"replica {replica}: {type(e).__name__}: {e}")
        return _error_response(RuntimeError(f"replica {replica} failed: {e}"))
      except asyncio.CancelledError:
        if upstream is not None:
          await upstream.aclose()
        raise
      self.router.first_token(rid)
      self._dispatch()
      return StreamingResponse(self._relay(record, upstream, chunks, first),
                               media_type="text/event-stream",
                               headers=self._headers(record, upstream))

  async def _relay(self, record: dict, upstream: httpx.Response, chunks, first: bytes):
    replica, tail = record["replica"], first[-4096:]
    try:
      yield first
      async for chunk in chunks:
        tail = (tail + chunk)[-4096:]
        yield chunk
      error = _stream_error(tail)
      self._end(record, "failed" if error else "completed",
                error["message"] if error else "")
    except httpx.TransportError as e:
      await self._lost(replica)
      message = (f"replica {replica} failed mid-stream ({type(e).__name__}); the request "
                 f"failed and was not re-routed (part of it was already sent)")
      self._end(record, "failed", message)
      yield _sse({"error": {"message": message, "type": "server_error", "param": None,
                            "code": "replica_failed"}})
      yield _sse("[DONE]")
    finally:
      self._end(record, "cancelled", "client disconnected")   # no-op once ended
      await upstream.aclose()

  # ---------------------------------------------------------------- app
  async def _scrape(self) -> List[Optional[list]]:
    """Each replica's metric families (its ``/metrics``, parsed), None for a
    replica that is down or did not answer within 10 s."""
    async def one(i: int) -> Optional[list]:
      if not self.router.replicas[i].alive:
        return None
      try:
        reply = await self.http.get(f"{self.urls[i]}/metrics", timeout=10)
        return list(text_string_to_metric_families(reply.text))
      except (httpx.HTTPError, ValueError):
        return None
    return list(await asyncio.gather(*(one(i) for i in range(len(self.urls)))))

  async def replica_stats(self) -> List[dict]:
    """Each replica's URL, liveness, live requests and prefix-cache counters."""
    out = []
    for i, families in enumerate(await self._scrape()):
      stats = dict(replica=i, url=self.urls[i], alive=self.router.replicas[i].alive,
                   live=len(self.router.replicas[i].live))
      for family in families or ():
        for s in family.samples:
          if s.name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            stats[s.name.split(":")[1].removesuffix("_total")] = s.value
      out.append(stats)
    return out

  async def relayed_metrics(self) -> bytes:
    """Every live replica's series (``vllm:*``, ``iterserve:requests*``), each
    sample with a ``replica`` label added, one family per name (Prometheus
    text); a replica that is down or does not answer is left out."""
    merged: Dict[str, Metric] = {}
    for i, families in enumerate(await self._scrape()):
      for family in families or ():
        into = merged.setdefault(family.name, Metric(family.name, family.documentation,
                                                     family.type, family.unit))
        into.samples += [s._replace(labels={**s.labels, "replica": str(i)})
                         for s in family.samples]

    class _Relayed:                # a collector: what generate_latest reads
      def collect(self):
        return list(merged.values())

    return prom.generate_latest(_Relayed())

  def _build_app(self) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_):
      limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
      self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                    transport=_ReplicaTransport(limits=limits))
      health = asyncio.create_task(self._health())
      yield
      health.cancel()
      await self.http.aclose()

    app = FastAPI(title="iterserve router", docs_url=None, redoc_url=None, lifespan=lifespan)
    openai_errors(app)

    @app.get("/health")
    async def health():
      return Response(status_code=200 if self.router.alive() else 503)

    model_routes(app, lambda: model_card(self.model_name, self.created, self.max_model_len,
                                         self.facts[0]["vocab_size"],
                                         family=self.facts[0].get("family"),
                                         max_position=self.facts[0].get("max_position")))

    @app.get("/metrics")
    async def metrics():
      """The front's ``iterserve:router_*`` series, then every live replica's
      own series with a ``replica`` label."""
      return Response(prom.generate_latest(self.registry) + await self.relayed_metrics(),
                      media_type=prom.CONTENT_TYPE_LATEST)

    @app.get("/router")
    async def router_report(request: HttpRequest):
      """The policy, each replica's stats and the caller's route records:
      with keys, only those of the caller key's tenant (a key without a
      tenant: those of requests made without one; ``guard.own_records``);
      without keys, every one."""
      return {"policy": self.router.policy, "cost": dataclasses.asdict(self.router.cost),
              "replicas": await self.replica_stats(),
              "requests": own_records(request.scope, self.records)}

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
      return await self._serve(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
      return await self._serve(request, "/v1/chat/completions")

    return app


def _served_by(record: dict) -> List:
  """The engines a route record ran on, by ``engine_key``: its replica (a
  front over named engines: its ``engine``, and its ``decode_engine`` under
  prefill/decode)."""
  if "engine" not in record:
    return [record["replica"]]
  return [e for e in (record["engine"], record.get("decode_engine")) if e is not None]


def engine_key(stats: dict):
  """An engine's key in a ``GET /router`` report: its ``engine`` name where
  the front names its engines (the Ray front: "prefill-0", "decode-0"; pool
  indices repeat across pools), else its ``replica`` index."""
  return stats.get("engine", stats["replica"])


def route_summary(router_report: dict, before: Optional[dict] = None) -> dict:
  """The replay report's ``router`` section from a front's ``GET /router``:
  policy, overall and per-replica prefix-cache hit rates (token units, the
  replicas' own counters), placements per replica (per engine, named by its
  ``engine`` where the front names them), re-routes, and every request's
  route record.

  Args:
    router_report: ``GET /router`` after the run.
    before: ``GET /router`` before it (None: count everything): then only
      the run's own requests (route records not in ``before``) and the
      counters' increase since ``before`` are counted. A replica's counter
      that went down (it restarted) counts from zero.
  """
  if before is not None:
    seen = {q["request_id"] for q in before["requests"]}
    then = {engine_key(r): r for r in before["replicas"]}
    router_report = dict(router_report, requests=[
        q for q in router_report["requests"] if q["request_id"] not in seen])
  replicas = []
  for r in router_report["replicas"]:
    key = engine_key(r)
    queries, hits = r.get("prefix_cache_queries", 0.0), r.get("prefix_cache_hits", 0.0)
    if before is not None:
      old = then.get(key, {})
      old_q, old_h = old.get("prefix_cache_queries", 0.0), old.get("prefix_cache_hits", 0.0)
      if queries >= old_q and hits >= old_h:
        queries, hits = queries - old_q, hits - old_h
    placed = sum(1 for q in router_report["requests"] if key in _served_by(q))
    named = {"engine": r["engine"]} if "engine" in r else {}
    replicas.append(dict(replica=r["replica"], **named, alive=r["alive"], placed=placed,
                         prefix_cache_queries=queries, prefix_cache_hits=hits,
                         prefix_cache_hit_rate=hits / queries if queries else 0.0))
  queries = sum(r["prefix_cache_queries"] for r in replicas)
  hits = sum(r["prefix_cache_hits"] for r in replicas)
  return dict(policy=router_report["policy"], cost=router_report["cost"],
              prefix_cache_hit_rate=hits / queries if queries else 0.0, replicas=replicas,
              rerouted=sum(1 for q in router_report["requests"] if q["rerouted_from"]),
              requests=router_report["requests"])
