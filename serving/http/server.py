"""OpenAI-compatible HTTP server over one ``Engine`` (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream`` true: server-sent events in OpenAI's chunk format ending with
``data: [DONE]``, or false), ``GET /v1/models`` and ``GET /v1/models/{id}``,
``GET /health``, ``GET /metrics`` (Prometheus text; vLLM's metric names where
one exists), the tokenizer endpoints in vLLM's shapes (``POST /tokenize``: a
body's prompt token ids, with ``add_special_tokens``; ``POST /detokenize``:
``{tokens}`` -> ``{prompt}``; ``GET /tokenizer_info``: special tokens and
chat template, what lm-evaluation-harness's remote tokenizer reads) and, for
a router front (``serving.http.replicas``), ``GET /engine`` (page size, pages,
slots). Every response and chunk has OpenAI's ``object`` field. A stream
carries ``usage`` only when ``stream_options.include_usage`` is true: null
on every chunk (or, with ``continuous_usage_stats``, the counts so far),
then one last chunk with no choices and the usage (OpenAI). Usage gives
``prompt_tokens_details.cached_tokens``, the prompt tokens the request took
from the prefix cache. A batched prompt (a list of strings or of token-id
lists) is one engine request per prompt and one choice each, ``index`` in
prompt order.

Parallel sampling: ``n`` > 1 gives each prompt n choices, each its own
engine request, prompt-major (choice ``index`` = prompt_i * n + j);
``best_of`` is accepted only equal to ``n`` (every copy is returned, none
ranked). Copy j samples with seed ``(seed + j) mod 2**32`` (``seed``
absent: 0, as for one choice), so the copies differ and each is the same
request sent alone with n 1 and that seed. The prompt is prefilled once:
with prefix caching on, copies 1..n-1 wait in the server until copy 0 has
computed its prompt (its first output token, or its end), then enter the
engine and take every full prompt page from the prefix cache
(``EngineLoop``); a request that asks for prompt logprobs (echo with
logprobs) takes no prefix hit, so each of its copies prefills. Usage counts
each prompt once (its tokens, and as ``cached_tokens`` the most any of its
copies took from the cache) and the completion tokens of every copy.

The ``x-request-id`` header, when sent, names the request (its ``id`` is
"cmpl-"/"chatcmpl-" + it) and comes back on the response. A body field the
endpoint does not read is a 400 naming it, never ignored.

Logprobs (completions ``logprobs`` k, chat ``logprobs`` + ``top_logprobs``;
k <= ``MAX_LOGPROBS``) are the engine's: the raw model logits'
``log_softmax`` (vLLM's default "raw_logprobs": before temperature,
top-k/top-p and the min_tokens stop mask), float32, computed on the device
from the logits the sampler read (``serving.engine.executor.StepLogprobs``), one
entry per generated token (``completion_tokens``; a stop string's tokens
too), streamed with the chunks. ``echo`` puts the prompt first: its text,
and with logprobs its tokens' (from the prefill rows; the first token has
none; such a request takes no prefix hit). ``max_tokens: 0`` with echo
scores the prompt alone: the engine runs one token, which is dropped.

Threads: one engine thread owns the ``Engine``. Between iterations it drains
a command queue (add, abort), runs one ``step``, detokenizes each request's
new tokens, matches its stop strings on the text and pushes events to the
request's asyncio queue on the HTTP event loop. When nothing is live it
blocks on the command queue (no spin). HTTP handlers never touch engine
state: they validate the body, enqueue an add, and read their queue.

Request lifecycle: every request the server accepts ends completed,
cancelled (client disconnected: aborted at the next iteration boundary,
its KV pages freed), rejected or failed, and ``/metrics`` counts each. Once
its final event is out the request and, if idle, its client are evicted
from the engine's host tables (bounded memory for a long-running server).

Overload: at most ``max_request_slots + max_waiting`` requests are live at
once (``max_waiting`` wait for an engine slot); past that a request gets
HTTP 429 with an OpenAI-style error body (``_error_response`` is the one
place that maps a refusal to its HTTP status). Bad input gets HTTP 400
naming the field and the rule, as vLLM does for a prompt plus max_tokens
beyond the context (both numbers in the message; never silently cut).

Text rules: ``IncrementalDetokenizer`` (one rule for an unfinished UTF-8
character, stream and final text alike); stop strings match across token
boundaries on the text, the matched text is not returned (OpenAI), and the
request ends ``completed`` with finish_reason "stop" through
``Engine.finish``. While streaming, the last ``len(longest stop) - 1``
characters are held back until they can no longer start a stop string, so
the concatenated deltas always equal the non-streamed text.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import itertools
import json
import queue
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

import jax
import numpy as np
import prometheus_client as prom
import uvicorn
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from scheduler import records as rec
from serving.engine.config import SamplingParams
from serving.kv import pages as kv_pages
from serving.engine.engine import Engine
from serving.engine.requests import QueueFull, TokenLogprobs
from serving.engine.sampling import MAX_LOGPROBS

MAX_STOP_STRINGS = 8
# Chat roles the OpenAI API defines for text messages ("developer" is its
# newer name for "system").
CHAT_ROLES = ("system", "developer", "user", "assistant")
# OpenAI request fields this server does not implement, with the values that
# mean "off" (accepted); any other value is a 400 naming the field, never
# silently ignored.
UNSUPPORTED_FIELDS = {
    "suffix": (None,), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "min_p": (None, 0), "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, False),
}
MAX_STOP_STRING_CHARS = 256
# Body fields each endpoint reads; with UNSUPPORTED_FIELDS (at their off
# values) they are all a body may hold: any other field is a 400 naming it.
_COMMON_FIELDS = frozenset({
    "model", "n", "best_of", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "seed", "min_tokens", "ignore_eos", "stop", "stop_token_ids", "stream", "stream_options",
    "priority", "client", "tenant", "user", "slo_ttft_ms", "slo_tbt_ms"})
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "chat_template_kwargs"}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
# A client's id for its request (vLLM, ``vllm bench serve``): the response's
# ``id`` is "cmpl-"/"chatcmpl-" + it, the engine's request id the same
# (choice i of a batched prompt or of n > 1: + "-i"), and the response carries it back.
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 256
# Seconds between disconnect checks of a non-streaming request.
_DISCONNECT_POLL_S = 0.25
_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                      1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class BadRequest(Exception):
  """A request body that breaks a rule: HTTP 400 naming ``param``."""

  def __init__(self, message: str, param: Optional[str] = None):
    super().__init__(message)
    self.param = param


class Overloaded(Exception):
  """The waiting queue is full: HTTP 429 (nothing accepted is dropped)."""


class Unavailable(Exception):
  """No engine can take the request now (every replica is down): HTTP 503."""


class UnknownModel(BadRequest):
  """The body names a model this server does not serve (HTTP 400)."""


# Refusals that mean "full, retry later" (HTTP 429): the server's own bound,
# and any queue-full error the engine's ``add_request`` raises.
OVERLOAD_ERRORS: tuple = (Overloaded, QueueFull)


def _error_body(exc: Exception) -> Tuple[int, dict]:
  """The one mapping from a refusal to an OpenAI-style error: (HTTP status,
  ``{"error": {...}}``). OVERLOAD_ERRORS -> 429; UnknownModel -> 404 (as
  OpenAI and vLLM); Unavailable -> 503; BadRequest, and the engine's
  ValueError naming a bad field -> 400; the app's own HTTPException (an
  unknown path, a wrong method) -> its status (404, 405); anything else ->
  500. A stream that already started sends the body as its last event."""
  message = str(exc)
  if isinstance(exc, OVERLOAD_ERRORS):
    status, kind, code, param = 429, "rate_limit_error", "server_overloaded", None
  elif isinstance(exc, UnknownModel):
    status, kind, code, param = 404, "invalid_request_error", "model_not_found", exc.param
  elif isinstance(exc, Unavailable):
    status, kind, code, param = 503, "server_error", "service_unavailable", None
  elif isinstance(exc, BadRequest):
    status, kind, code, param = 400, "invalid_request_error", None, exc.param
  elif isinstance(exc, ValueError):
    status, kind, code, param = 400, "invalid_request_error", None, None
  elif isinstance(exc, HTTPException):
    status, code, param, message = exc.status_code, None, None, exc.detail
    kind = "invalid_request_error" if status < 500 else "server_error"
  else:
    status, kind, code, param = 500, "server_error", None, None
  return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error_response(exc: Exception) -> JSONResponse:
  """``_error_body`` as a JSON response with its status."""
  status, body = _error_body(exc)
  return JSONResponse(body, status_code=status,
                      headers=exc.headers if isinstance(exc, HTTPException) else None)


def openai_errors(app: FastAPI) -> None:
  """Makes ``app`` answer every error in the OpenAI shape (``_error_body``):
  an unknown path (404) or a wrong method (405, with its ``Allow`` header)
  instead of FastAPI's ``{"detail": ...}``, and an unexpected exception
  (500) instead of a plain-text "Internal Server Error"."""

  @app.exception_handler(HTTPException)
  async def http_error(request: HttpRequest, exc: HTTPException):
    return _error_response(HTTPException(
        exc.status_code, f"{exc.detail} ({request.method} {request.url.path})", exc.headers))

  @app.exception_handler(Exception)
  async def server_error(request: HttpRequest, exc: Exception):
    return _error_response(RuntimeError(f"{request.method} {request.url.path} failed: "
                                        f"{type(exc).__name__}: {exc}"))


# ----------------------------------------------------------------- bodies
_MISSING = object()


def _get(body: dict, name: str, kinds, default=_MISSING, rule: str = ""):
  """``body[name]`` checked against ``kinds`` (bool is never an int here)."""
  value = body.get(name, _MISSING)
  if value is _MISSING or value is None:
    if default is _MISSING:
      raise BadRequest(f"'{name}' is required", name)
    return default
  kinds = kinds if isinstance(kinds, tuple) else (kinds,)
  if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
    names = "/".join(k.__name__ for k in kinds)
    raise BadRequest(f"'{name}' must be {rule or names}, got {type(value).__name__}", name)
  return value


@dataclasses.dataclass
class ParsedRequest:
  """A validated request: its choices' prompts and sampling, stop strings,
  streaming and routing. With ``n`` copies per prompt, choice i is copy
  ``i % n`` of prompt ``i // n``."""

  prompts: List[List[int]]   # prompt token ids, one list per choice (``index`` order)
  samplings: List[SamplingParams]       # one per choice (max_tokens, seed may differ)
  stop: List[str]
  stream: bool
  include_usage: bool
  priority: int
  client: str
  extra: Dict[str, Any]      # engine keyword arguments (e.g. SLO targets)
  prompt_field: str = "prompt"          # or "messages": the body field of the prompt
  max_tokens_field: str = "max_tokens"  # or "max_completion_tokens", as the body named it
  continuous_usage: bool = False        # usage on every chunk (include_usage too)
  # Alternatives per token when logprobs are asked (completions ``logprobs``,
  # chat ``top_logprobs``), None when not.
  logprobs: Optional[int] = None
  # ``echo``: each prompt's text (its string, or its ids decoded), which the
  # choice's text starts with (and, with logprobs, its tokens' logprobs).
  echo_texts: Optional[List[str]] = None
  score_only: bool = False   # max_tokens 0 with echo: the prompt alone is returned
  n: int = 1                 # copies of each prompt (choices = prompts * n)

  @property
  def num_prompts(self) -> int:
    return len(self.prompts) // self.n

  def prompt_tokens(self) -> int:
    """Prompt tokens of the request, each prompt counted once."""
    return sum(len(p) for p in self.prompts[::self.n])


# ------------------------------------------------------------- per request
class _Live:
  """Server-side state of one engine request, choice ``index`` of its HTTP
  request (owned by the engine thread after add)."""

  def __init__(self, rid: str, index: int, parsed: ParsedRequest, detok,
               events: asyncio.Queue, loop: asyncio.AbstractEventLoop):
    self.rid = rid
    self.index = index
    self.parsed = parsed
    self.prompt_token_ids = parsed.prompts[index]
    self.sampling = parsed.samplings[index]
    self.detok = detok
    self.events = events
    self.loop = loop
    self.text = ""          # text so far, stop-string match removed
    self.sent = 0           # characters of ``text`` already pushed
    # (token id, ``engine.TokenLogprobs``) of every output token, when asked,
    # and how many of them were pushed.
    self.logprobs: List[tuple] = []
    self.logprobs_sent = 0
    # ``echo``: the prompt's text and its (token id, logprobs or None)
    # entries, set and pushed with the first output token.
    self.echo_text = ""
    self.echo_logprobs: List[tuple] = []
    self.echoed = False
    self.queued_ms: Optional[float] = None
    # Original arrival (``time.monotonic()`` s) when a front forwarded it.
    self.arrival_s: Optional[float] = None
    # Copy j > 0 of a prompt: the id of copy 0, which computes the prompt
    # first (``EngineLoop`` holds this copy back until then); else None.
    self.leader: Optional[str] = None

  def push(self, event: dict) -> None:
    event["index"] = self.index
    self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineLoop:
  """The thread that owns the engine (see the module docstring).

  Parallel sampling's prompt sharing lives here: a copy whose ``leader``
  (copy 0 of its prompt) is live and whose prompt can hit the prefix cache
  is accepted but held on the host; when the leader emits its first token
  (its prompt is computed and its full pages cached) or ends, the held
  copies enter the engine, which maps those pages into their tables. A
  held copy that is aborted enters the engine and is cancelled there, so
  every copy ends with an engine outcome and is counted once.

  Args:
    engine: the Engine (used from this thread only once ``start`` ran).
    tokenizer: ``models.tokenizer.Tokenizer``.
    metrics: ``ServerMetrics``.
  """

  def __init__(self, engine: Engine, tokenizer, metrics: "ServerMetrics"):
    self.engine = engine
    self.tokenizer = tokenizer
    self.metrics = metrics
    self._commands: "queue.Queue[tuple]" = queue.Queue()
    self._live: Dict[str, _Live] = {}
    self._held: Dict[str, _Live] = {}             # held copies by id
    self._waiting: Dict[str, List[_Live]] = {}    # leader id -> its held copies
    self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
    self._stopping = False
    self.error: Optional[BaseException] = None

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    self._stopping = True
    self._commands.put(("stop",))
    self._thread.join(timeout=30)

  def add(self, lives: List[_Live]) -> None:
    """Adds the engine requests of one HTTP request (its choices) between
    two iterations, in ``index`` order."""
    self._commands.put(("add", lives))

  def abort(self, rid: str) -> None:
    self._commands.put(("abort", rid))

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and self.error is None

  # --------------------------------------------------------- engine thread
  def _run(self) -> None:
    try:
      while not self._stopping:
        block = not self.engine.has_unfinished()
        if self._drain_commands(block):
          self.metrics.observe_engine(self.engine, self._unslotted())
        if self._stopping:
          break
        if self.engine.has_unfinished():
          start_ms = self.engine.now_ms()
          outputs = self.engine.step()
          self._stamp_queue_time(start_ms, outputs)
          # Gauges first: a client that sees its last event sees them too.
          self.metrics.observe_engine(self.engine, self._unslotted())
          if self._deliver(outputs):           # stop strings freed slots
            self.metrics.observe_engine(self.engine, self._unslotted())
      while self._live or self._held:     # shutting down: end what is live
        self._abort(next(iter(self._held or self._live)))
    except BaseException as e:          # the engine broke: fail every live request
      self.error = e
      for live in list(self._live.values()) + list(self._held.values()):
        live.push({"type": "error", "status": 500,
                   "error": f"engine failed: {type(e).__name__}: {e}"})
        self.metrics.outcome("failed", "engine error")
        self.metrics.release()
      self._live.clear()
      self._held.clear()
      self._waiting.clear()
      raise

  def _unslotted(self) -> int:
    """Live requests with no engine slot yet (held copies included)."""
    return (sum(1 for rid in self._live if self.engine.requests[rid].slot < 0)
            + len(self._held))

  def _drain_commands(self, block: bool) -> int:
    """Runs queued commands (blocking for the first when ``block``); returns
    how many ran."""
    ran = 0
    while True:
      try:
        command = self._commands.get(block=block)
      except queue.Empty:
        return ran
      block = False
      ran += 1
      if command[0] == "stop":
        self._stopping = True
        return ran
      if command[0] == "add":
        self._add_all(command[1])
      elif command[0] == "abort":
        self._abort(command[1])

  def _add_all(self, lives: List[_Live]) -> None:
    """Adds one HTTP request's choices; each pushes its first event
    (accepted, refused, or the end of a request rejected at once). After a
    refusal the choices before it are cancelled and those after it are
    never added (the handler answers with the refusal). A copy whose
    leader is live is held (``_hold``)."""
    for i, live in enumerate(lives):
      if live.leader in self._live and self._shares_prompt(live):
        self._hold(live)
        continue
      if not self._add(live):
        for done in lives[:i]:
          self._abort(done.rid)
        for never in lives[i + 1:]:
          self.metrics.release()
        return

  def _shares_prompt(self, live: _Live) -> bool:
    """Whether ``live`` can take its prompt's full pages from the prefix
    cache once its leader computed them: caching on, no prompt logprobs
    (such a request takes no hit), and at least one full page before the
    prompt's last token."""
    c = self.engine.config
    return (c.enable_prefix_caching and not live.parsed.extra.get("prompt_logprobs")
            and len(live.prompt_token_ids) > c.page_size)

  def _hold(self, live: _Live) -> None:
    """Accepts a copy without adding it to the engine yet."""
    self._held[live.rid] = live
    self._waiting.setdefault(live.leader, []).append(live)
    live.push({"type": "accepted"})

  def _release(self, leader: str) -> None:
    """Adds the copies held for ``leader`` to the engine."""
    for live in self._waiting.pop(leader, []):
      del self._held[live.rid]
      self._add(live, accepted=True)

  def _release_one(self, live: _Live) -> None:
    """Adds one held copy to the engine ahead of its leader's signal."""
    del self._held[live.rid]
    self._waiting[live.leader].remove(live)
    self._add(live, accepted=True)

  def _add(self, live: _Live, accepted: bool = False) -> bool:
    """Adds one engine request; False when the engine refused it. A held
    copy (``accepted``: its client already saw it accepted) that the
    engine refuses ends with that refusal as its "end" event."""
    p = live.parsed
    arrival_ms = None
    if live.arrival_s is not None and self.engine.clock is time.monotonic:
      arrival_ms = self.engine.now_ms() - (time.monotonic() - live.arrival_s) * 1e3
    try:
      if live.rid in self.engine.requests:
        raise BadRequest(f"header '{REQUEST_ID_HEADER}' names request {live.rid!r}, "
                         f"which is still live; request ids must be unique",
                         REQUEST_ID_HEADER)
      req = self.engine.add_request(live.rid, live.prompt_token_ids, live.sampling,
                                    arrival_ms=arrival_ms, priority=p.priority,
                                    client=p.client, **p.extra)
    except Exception as e:          # refused by the engine: never accepted
      if accepted:
        live.push({"type": "end", "outcome": "rejected", "reason": str(e), "exc": e,
                   "finish_reason": None})
      else:
        live.push({"type": "refused", "exc": e})
      self.metrics.refused("overloaded" if isinstance(e, OVERLOAD_ERRORS) else "bad_request")
      self.metrics.release()
      return False
    self._live[live.rid] = live
    self.metrics.prompt_tokens.inc(len(live.prompt_token_ids))
    if req.finished:          # rejected at once (can never fit the KV cache): its
      self._end(live, req)    # "end" is the first event, a 400 before any stream
      return True
    if not accepted:
      live.push({"type": "accepted"})
    return True

  def _stamp_queue_time(self, start_ms: float, outputs) -> None:
    """Queue time (arrival -> start of the first iteration that scheduled
    the request) for requests first seen running or emitting in this step."""
    status = np.asarray(jax.device_get(self.engine.state.status))
    news = {o.request_id for o in outputs}
    for rid, live in self._live.items():
      if live.queued_ms is not None:
        continue
      req = self.engine.requests[rid]
      if rid in news or (req.slot >= 0 and status[req.slot] == rec.RUNNING):
        live.queued_ms = start_ms - req.arrival_ms
        self.metrics.queue_time.observe(max(live.queued_ms, 0.0) / 1e3)

  def _abort(self, rid: str) -> None:
    if rid in self._held:                 # into the engine, to be cancelled there
      self._release_one(self._held[rid])
    live = self._live.get(rid)
    if live is None:                      # already ended
      return
    self.engine.abort(rid)
    self._end(live, self.engine.requests[rid])

  def _deliver(self, outputs) -> bool:
    """Pushes each output's text to its client; True when a stop string
    ended a request here (``Engine.finish``)."""
    finished_here = False
    for out in outputs:
      live = self._live.get(out.request_id)
      if live is None:
        continue
      req = self.engine.requests[out.request_id]
      self.metrics.generation_tokens.inc(len(out.new_token_ids))
      if live.parsed.echo_texts is not None and not live.echoed:
        self._echo(live, req)
      if live.parsed.score_only:        # the one token the engine needs: dropped
        self._end(live, req)
        continue
      if out.new_logprobs:
        live.logprobs.extend(zip(out.new_token_ids, out.new_logprobs))
      piece = live.detok.push_many(out.new_token_ids)
      if out.finished:
        piece += live.detok.flush()
      # Like EOS and stop ids, stop strings count from min_tokens on.
      stopped = self._append(live, piece, check=len(req.output_token_ids) >=
                             live.sampling.min_tokens)
      if stopped and not out.finished:
        self.engine.finish(out.request_id, "stop")
        finished_here = True
      if stopped or out.finished:
        self._end(live, req, stop_string=stopped)
      else:
        self._push_text(live, len(req.output_token_ids), final=False)
      self._release(out.request_id)   # its prompt is computed: the copies start
    return finished_here

  def _echo(self, live: _Live, req) -> None:
    """Pushes the prompt's text and, with logprobs, its tokens' logprobs
    (the engine's ``Request.prompt_logprobs``, complete once the first
    output token is out; the first token has none) as the first delta."""
    live.echoed = True
    live.echo_text = live.parsed.echo_texts[live.index]
    if live.parsed.logprobs is not None:
      prompt = req.prompt_logprobs
      live.echo_logprobs = [(req.prompt_token_ids[0], None)] + [
          (t, TokenLogprobs(float(prompt.token[j]), prompt.top_ids[j], prompt.top[j]))
          for j, t in enumerate(req.prompt_token_ids) if j > 0]
    live.push({"type": "delta", "text": live.echo_text, "completion_tokens": 0,
               "logprobs": live.echo_logprobs})

  def _append(self, live: _Live, piece: str, check: bool) -> bool:
    """Adds ``piece`` to the text; when ``check``, True if a stop string
    ends in it (the text is then cut where the match starts)."""
    stops = live.parsed.stop
    if not piece:
      return False
    start = max(0, len(live.text) - max((len(s) for s in stops), default=0) + 1)
    live.text += piece
    if not check:
      return False
    hits = [i for i in (live.text.find(s, start) for s in stops) if i >= 0]
    if hits:
      live.text = live.text[:min(hits)]
      return True
    return False

  def _push_text(self, live: _Live, completion_tokens: int, final: bool) -> None:
    """Pushes the text not sent yet (all of it when ``final``, else all but
    what could still start a stop string) as a "delta" event, with the
    request's output tokens so far and the logprobs of the tokens not sent
    yet (with the next text, or at the end; so a chunk's logprobs may run
    ahead of its text while a stop string could still match)."""
    hold = 0 if final else max((len(s) for s in live.parsed.stop), default=1) - 1
    upto = max(live.sent, len(live.text) - hold)
    if upto > live.sent or (final and live.logprobs_sent < len(live.logprobs)):
      live.push({"type": "delta", "text": live.text[live.sent:upto],
                 "completion_tokens": completion_tokens,
                 "logprobs": live.logprobs[live.logprobs_sent:]})
      live.sent = upto
      live.logprobs_sent = len(live.logprobs)

  def _end(self, live: _Live, req, stop_string: bool = False) -> None:
    self._push_text(live, len(req.output_token_ids), final=True)
    outcome, reason = req.outcome, req.finish_reason
    finish = None
    if outcome == "completed":   # OpenAI: "stop" (EOS, stop id or string) or "length"
      finish = "length" if reason == "length" and not stop_string else "stop"
      if live.parsed.score_only:   # max_tokens 0: the length it asked for
        finish = "length"
    self.metrics.finished(self.engine, req, finish)
    live.push({"type": "end", "outcome": outcome, "reason": reason, "finish_reason": finish,
               "prompt_tokens": len(req.prompt_token_ids),
               "cached_tokens": req.prefix_hit_tokens,
               "completion_tokens": (0 if live.parsed.score_only else
                                     len(req.output_token_ids)),
               "text": live.echo_text + live.text,
               "logprobs": live.echo_logprobs + live.logprobs})
    del self._live[live.rid]
    self.engine.evict(live.rid)
    self.metrics.release()
    self._release(live.rid)         # a leader that ended: its copies start


# ---------------------------------------------------------------- metrics
class ServerMetrics:
  """Prometheus metrics (own registry), vLLM's names where one exists.

  Also the admission counter: ``admit`` reserves a live place or raises
  ``Overloaded``; the engine thread calls ``release`` when a request ends.
  """

  def __init__(self, model_name: str, capacity: int):
    self.capacity = capacity
    self._lock = threading.Lock()
    self.live = 0
    r = self.registry = prom.CollectorRegistry()
    L = ["model_name"]
    hist = lambda name, doc: prom.Histogram(name, doc, L, registry=r,
                                            buckets=_LATENCY_BUCKETS_S).labels(model_name)
    self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (s).")
    self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency (s).")
    self.tpot = hist("vllm:request_time_per_output_token_seconds",
                     "Time per output token after the first (s).")
    self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency (s).")
    self.queue_time = hist("vllm:request_queue_time_seconds",
                           "Time from arrival to an engine slot (s).")
    gauge = lambda name, doc: prom.Gauge(name, doc, L, registry=r).labels(model_name)
    self.running = gauge("vllm:num_requests_running", "Requests scheduled in the engine.")
    self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
    self.suspended = gauge("vllm:num_requests_swapped",
                           "Requests preempted and waiting to resume.")
    self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV pages in use.")
    count = lambda name, doc: prom.Counter(name, doc, L, registry=r).labels(model_name)
    self.preemptions = count("vllm:num_preemptions", "Preemptions.")
    self.prompt_tokens = count("vllm:prompt_tokens", "Prompt tokens of accepted requests.")
    self.generation_tokens = count("vllm:generation_tokens", "Generated tokens.")
    self._success = prom.Counter("vllm:request_success", "Completed requests by finish "
                                 "reason.", L + ["finished_reason"], registry=r)
    self._outcomes = prom.Counter("iterserve:requests", "Accepted requests by outcome.",
                                  L + ["outcome"], registry=r)
    self._refused = prom.Counter("iterserve:requests_refused", "Requests refused before "
                                 "acceptance, by reason.", L + ["reason"], registry=r)
    self.prefix_queries = count("vllm:prefix_cache_queries",
                                "Prompt tokens looked up in the prefix cache.")
    self.prefix_hits = count("vllm:prefix_cache_hits",
                             "Prompt tokens served from the prefix cache.")
    self.prefill_computed = count("iterserve:prefill_tokens_computed",
                                  "Prompt rows computed (prefill and rebuild; prefix-cache "
                                  "hits are not computed).")
    self.kv_pages_peak = gauge("iterserve:kv_pages_used_peak",
                               "Most KV pages requests held at the end of an iteration, "
                               "since the engine last went from idle to busy.")
    self._model = model_name
    self._preemptions_seen = 0
    self._prefix_seen = (0, 0)
    self._prefill_seen = 0
    self._peak, self._idle = 0, True

  def admit(self, count: int = 1) -> None:
    """Reserves ``count`` live places (one per choice), all or none."""
    with self._lock:
      if self.live + count > self.capacity:
        self.refused("overloaded")
        raise Overloaded(f"the server holds {self.live} requests, its bound "
                         f"(engine slots + --max_waiting = {self.capacity}); "
                         f"{count} more do not fit; retry later")
      self.live += count

  def release(self) -> None:
    with self._lock:
      self.live -= 1

  def refused(self, reason: str) -> None:
    self._refused.labels(self._model, reason).inc()

  def outcome(self, outcome: str, finish: Optional[str]) -> None:
    """Counts an accepted request's end: ``iterserve:requests`` by outcome;
    ``vllm:request_success`` by finish reason for a completed request
    ("stop", "length") and as "abort" for a cancelled one (vLLM counts a
    client's abort there too)."""
    self._outcomes.labels(self._model, outcome).inc()
    if outcome == "completed":
      self._success.labels(self._model, finish).inc()
    elif outcome == "cancelled":
      self._success.labels(self._model, "abort").inc()

  def finished(self, engine: Engine, req, finish: Optional[str]) -> None:
    """Counts a request's outcome and observes its latencies.

    TTFT and ITL observe every token a request emitted, whatever its end
    (vLLM observes them per iteration, as tokens appear). E2E latency and
    TPOT are per-request figures of requests that ran to their end: only
    ``completed`` requests are observed, as vLLM observes them only for
    requests the engine finished (``update_from_finished_request``; a client
    abort drops the request without it). A cancelled request's E2E would be
    the client's patience, not the server's latency.
    """
    self.outcome(req.outcome, finish)
    t = req.token_times_ms
    if t:
      self.ttft.observe((t[0] - req.arrival_ms) / 1e3)
      for a, b in zip(t, t[1:]):
        self.itl.observe((b - a) / 1e3)
    if req.outcome != "completed":
      return
    if len(t) > 1:
      self.tpot.observe((t[-1] - t[0]) / 1e3 / (len(t) - 1))
    self.e2e.observe((engine.now_ms() - req.arrival_ms) / 1e3)

  def observe_engine(self, engine: Engine, unslotted: int) -> None:
    """Gauges from the engine after a step (engine thread only);
    ``unslotted``: accepted requests not yet in an engine slot."""
    status, generation, (free, evictable, _) = jax.device_get((
        engine.state.status, engine.state.generation, kv_pages.page_census(engine.pages)))
    waiting = status == rec.WAITING
    self.running.set(int(np.sum(status == rec.RUNNING)))
    self.suspended.set(int(np.sum(waiting & (generation > 0))))
    self.waiting.set(int(np.sum(waiting & (generation == 0))) + unslotted)
    # Cached pages no request holds are reclaimable: free, as in vLLM.
    self.kv_usage.set(1.0 - int(free + evictable) / (engine.config.num_pages - 1))
    used = engine.config.num_pages - 1 - int(free + evictable)
    self._peak = used if self._idle else max(self._peak, used)
    self._idle = not engine.has_unfinished()
    self.kv_pages_peak.set(self._peak)
    self.prefill_computed.inc(engine.prefill_tokens_computed - self._prefill_seen)
    self._prefill_seen = engine.prefill_tokens_computed
    if engine.num_preemptions > self._preemptions_seen:
      self.preemptions.inc(engine.num_preemptions - self._preemptions_seen)
      self._preemptions_seen = engine.num_preemptions
    stats = engine.prefix_cache_stats()
    queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
    self.prefix_queries.inc(queries - self._prefix_seen[0])
    self.prefix_hits.inc(hits - self._prefix_seen[1])
    self._prefix_seen = (queries, hits)


# -------------------------------------------------------------------- app
# A request forwarded by ``serving.http.replicas`` carries its original arrival as
# ``time.monotonic()`` seconds of the same host, so TTFT, queue time and the
# engine's SLO clocks count from the front's arrival, not the forward.
ARRIVAL_HEADER = "x-iterserve-arrival-s"


def _arrival_s(request: HttpRequest) -> Optional[float]:
  """The ARRIVAL_HEADER value, or None; raises BadRequest unless it is a
  number of seconds not in the future."""
  value = request.headers.get(ARRIVAL_HEADER)
  if value is None:
    return None
  try:
    arrival_s = float(value)
  except ValueError:
    arrival_s = float("nan")
  if not arrival_s <= time.monotonic():
    raise BadRequest(f"header '{ARRIVAL_HEADER}' must be a time.monotonic() reading "
                     f"(s) not in the future, got {value!r}", ARRIVAL_HEADER)
  return arrival_s


def _is_text(s: str) -> bool:
  """Whether ``s`` is valid Unicode text: no lone UTF-16 surrogate (JSON's
  ``\\ud800`` escapes allow one; the tokenizer and the UTF-8 encoder do not)."""
  if s.isascii():
    return True
  try:
    s.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


def _check_text(body: Any) -> None:
  """Raises BadRequest naming the first string of a parsed body (a value or
  a key, at any depth) that is not valid Unicode text, e.g. ``prompt`` or
  ``messages[1].content``."""
  stack = [("", body)]
  while stack:
    path, value = stack.pop()
    if isinstance(value, str):
      if not _is_text(value):
        name = path or "the request body"
        raise BadRequest(f"'{name}' must be valid Unicode text without lone surrogates "
                         f"(an unpaired \\ud800-\\udfff escape), got {ascii(value)[:80]}",
                         path or None)
    elif isinstance(value, dict):
      for key, item in reversed(list(value.items())):
        key_path = f"{path}.{key}" if path else key
        if not _is_text(key):
          raise BadRequest(f"keys of '{path or 'the request body'}' must be valid Unicode "
                           f"text without lone surrogates, got {ascii(key)[:80]}",
                           path or None)
        stack.append((key_path, item))
    elif isinstance(value, list):
      stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))


def json_body(raw: bytes) -> Any:
  """A request body's JSON, every string in it valid Unicode text (the one
  home of that rule, for the server and the router front alike).

  Raises:
    BadRequest: not JSON, or a string with a lone surrogate (naming its field).
  """
  try:
    body = json.loads(raw)
    _check_text(body)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise BadRequest(f"the request body is not valid JSON ({e})") from None
  except RecursionError:
    raise BadRequest("the request body is nested too deeply") from None
  return body


def model_card(name: str, created: int, max_model_len: int, vocab_size: int, *,
               family: Optional[str] = None, max_position: Optional[int] = None) -> dict:
  """A served model as ``GET /v1/models`` lists it and ``GET /v1/models/{id}``
  returns it: OpenAI's model object, plus vLLM's ``max_model_len`` (tokens a
  request may hold here: the engine's context), the ``vocab_size`` that
  bounds prompt token ids, and, when given, the model's ``family`` (its HF
  ``model_type``, ``ModelConfig.family``) and ``max_position`` (the context
  the model itself was built for, ``ModelConfig.max_position``, tokens)."""
  card = {"id": name, "object": "model", "created": created, "owned_by": "iterserve",
          "max_model_len": max_model_len, "vocab_size": vocab_size}
  if family is not None:
    card["family"] = family
  if max_position is not None:
    card["max_position"] = max_position
  return card


def model_routes(app: FastAPI, card) -> None:
  """``GET /v1/models`` and ``GET /v1/models/{id}`` for the one model
  ``card()`` describes; another id is a 404 ``model_not_found`` (OpenAI)."""

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [card()]}

  @app.get("/v1/models/{model_id:path}")
  async def model(model_id: str):
    served = card()
    if model_id != served["id"]:
      return _error_response(UnknownModel(f"model {model_id!r} does not exist; this "
                                          f"server serves {served['id']!r}", "model"))
    return served


def _json_logprob(value: float) -> float:
  """A logprob as JSON carries it: float32 -> Python float; -inf (a token
  the model rules out) as -9999.0, as vLLM writes it (JSON has no inf)."""
  return max(float(value), -9999.0)


def _sse(payload) -> bytes:
  return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


class OpenAIServer:
  """The FastAPI app around an ``EngineLoop``.

  Args:
    engine: a fresh Engine (the loop thread owns it from ``start``).
    tokenizer: the model's Tokenizer.
    model_name: the name /v1/models lists and requests must use.
    max_waiting: requests that may wait for an engine slot (>= 0); more
      live requests than ``max_request_slots + max_waiting`` get HTTP 429.
    default_max_tokens: max_tokens when the body has none (None: the rest of
      the context, as vLLM).
  """

  def __init__(self, engine: Engine, tokenizer, model_name: str, *, max_waiting: int = 64,
               default_max_tokens: Optional[int] = None):
    if max_waiting < 0:
      raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
    self.engine = engine
    self.tokenizer = tokenizer
    self.model_name = model_name
    self.max_model_len = engine.config.max_model_len
    self.max_stop_ids = engine.config.max_stop_ids
    self.default_max_tokens = default_max_tokens
    self.metrics = ServerMetrics(model_name, engine.config.max_request_slots + max_waiting)
    self.loop = EngineLoop(engine, tokenizer, self.metrics)
    self._ids = itertools.count()
    self.created = int(time.time())
    self.app = self._build_app()

  # ------------------------------------------------------------- parsing
  def parse(self, body: Any, chat: bool) -> ParsedRequest:
    """Validates an OpenAI request body; raises BadRequest naming the field.

    Every body field is one this endpoint reads (``COMPLETION_FIELDS``,
    ``CHAT_FIELDS``) or an unimplemented one at its off value
    (``UNSUPPORTED_FIELDS``); any other field is a 400 naming it.
    """
    if not isinstance(body, dict):
      raise BadRequest("the request body must be a JSON object")
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for field in body:
      if field not in known and field not in UNSUPPORTED_FIELDS:
        raise BadRequest(f"'{field}' is not a field this server reads for "
                         f"{'chat completions' if chat else 'completions'} (unknown "
                         f"fields are refused, never ignored)", field)
    model = _get(body, "model", str, self.model_name)
    if model != self.model_name:
      raise UnknownModel(f"model {model!r} does not exist; this server serves "
                         f"{self.model_name!r}", "model")
    n = _get(body, "n", int, 1)
    if n < 1:
      raise BadRequest(f"'n' must be >= 1 (choices per prompt), got {n}", "n")
    best_of = _get(body, "best_of", int, None)
    if best_of is not None and best_of != n:
      raise BadRequest(f"'best_of' must equal 'n' (got best_of={best_of}, n={n}): this "
                       f"server returns every sampled copy and does not rank copies",
                       "best_of")
    for field, neutral in UNSUPPORTED_FIELDS.items():
      if field in body and body[field] not in neutral:
        raise BadRequest(f"'{field}' is not supported by this server (accepted only as "
                         f"{' or '.join(json.dumps(v) for v in neutral)})", field)
    if chat:
      prompts, texts = [self._chat_prompt(body)], None
    else:
      prompts, texts = self._completion_prompts(body)
    logprobs = self._logprobs_field(body, chat)
    echo = not chat and _get(body, "echo", bool, False)
    max_tokens = _get(body, "max_tokens", int, None)
    if max_tokens is None:
      max_tokens = _get(body, "max_completion_tokens", int, None)
      field = "max_completion_tokens"
    else:
      field = "max_tokens"
    # The field a "too long" refusal names: the one the body gave (default max_tokens).
    max_tokens_field = field if field in body else "max_tokens"
    score_only = echo and max_tokens == 0
    if score_only:     # the engine computes one token (the prompt's last row samples)
      max_tokens = 1
    if max_tokens is not None and max_tokens < 1:
      raise BadRequest(f"'{field}' must be >= 1 (0 only with 'echo': true, a request "
                       f"that scores its prompt), got {max_tokens}", field)
    prompt_field = "messages" if chat else "prompt"
    lengths = []          # each prompt's max_tokens (the body's, or the default)
    for i, ids in enumerate(prompts):
      wanted = max_tokens
      if wanted is None:  # the rest of the context (or the server's default)
        wanted = min(self.default_max_tokens or self.max_model_len - len(ids),
                     self.max_model_len - len(ids))
        if wanted < 1:
          wanted = 1      # the prompt fills the context: refused below
      if len(ids) + wanted > self.max_model_len:
        name = prompt_field if len(prompts) == 1 else f"{prompt_field}[{i}]"
        raise BadRequest(
            f"This model's maximum context length is {self.max_model_len} tokens. "
            f"However, you requested {len(ids) + wanted} tokens ({len(ids)} in the "
            f"{name}, {wanted} in the completion). Please reduce the length of the "
            f"{name} or completion.",
            field if len(ids) < self.max_model_len else name)
      lengths.append(wanted)
    temperature = float(_get(body, "temperature", (int, float), 1.0, "a number"))
    top_p = float(_get(body, "top_p", (int, float), 1.0, "a number"))
    top_k = _get(body, "top_k", int, 0)
    top_k = 0 if top_k == -1 else top_k            # vLLM spells "off" as -1
    seed = _get(body, "seed", int, 0)
    min_tokens = _get(body, "min_tokens", int, 0)
    ignore_eos = _get(body, "ignore_eos", bool, False)
    stop = _get(body, "stop", (str, list), [], "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
      raise BadRequest("'stop' must hold non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
      raise BadRequest(f"'stop' holds at most {MAX_STOP_STRINGS} strings of at most "
                       f"{MAX_STOP_STRING_CHARS} characters", "stop")
    stop_ids = _get(body, "stop_token_ids", list, [], "a list of token ids")
    vocab = self.engine.model_cfg.vocab_size
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
               for t in stop_ids):
      raise BadRequest(f"'stop_token_ids' must be token ids in [0, {vocab})",
                       "stop_token_ids")
    if len(stop_ids) > self.max_stop_ids:
      raise BadRequest(f"'stop_token_ids' holds at most {self.max_stop_ids} ids, got "
                       f"{len(stop_ids)}", "stop_token_ids")
    try:
      sampling = SamplingParams(max_tokens=max(lengths), temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed, min_tokens=min_tokens,
                                stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos)
      samplings = [dataclasses.replace(sampling, max_tokens=m) for m in lengths]
    except ValueError as e:         # "SamplingParams.top_p must be in (0, 1], got 2.0"
      field_name = str(e).split(" ", 1)[0].split(".")[-1]
      if field_name == "max_tokens":
        field_name = field
      raise BadRequest(f"'{field_name}' {str(e).split(' ', 1)[1]}", field_name) from None
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, None, "an object")
    if options is not None and not stream:
      raise BadRequest("'stream_options' is only allowed with 'stream': true",
                       "stream_options")
    options = options or {}
    for key in options:
      if key not in STREAM_OPTIONS:
        raise BadRequest(f"'stream_options.{key}' is not a stream option this server "
                         f"reads (one of {list(STREAM_OPTIONS)})", f"stream_options.{key}")
    include_usage = _get(options, "include_usage", bool, False)
    continuous = _get(options, "continuous_usage_stats", bool, False)
    priority = _get(body, "priority", int, 0)
    if not -2**31 <= priority < 2**31:
      raise BadRequest(f"'priority' must be in [-2**31, 2**31) (an int32; lower runs "
                       f"first), got {priority}", "priority")
    client = (_get(body, "client", str, None) or _get(body, "tenant", str, None)
              or _get(body, "user", str, "default"))
    extra = {}
    # Body field -> Engine.add_request keyword (§0x07: the TBT limit is the
    # per-token SLO the engine calls slo_tpot_ms).
    for field, keyword in (("slo_ttft_ms", "slo_ttft_ms"), ("slo_tbt_ms", "slo_tpot_ms")):
      value = _get(body, field, (int, float), None, "a number of ms")
      if value is None:
        continue
      if value <= 0:
        raise BadRequest(f"'{field}' must be > 0 ms, got {value}", field)
      extra[keyword] = float(value)
    if logprobs is not None:
      extra["logprobs"] = True
      if echo:                  # from the prefill rows; no prefix hit (Engine)
        extra["prompt_logprobs"] = True
    echo_texts = None
    if echo:
      echo_texts = [t if t is not None else
                    self.tokenizer.decode(ids, skip_special_tokens=True)
                    for t, ids in zip(texts, prompts)]
    if len(prompts) * n > self.metrics.capacity:
      raise BadRequest(f"{len(prompts)} prompt(s) x n={n} is {len(prompts) * n} choices; "
                       f"a request holds at most {self.metrics.capacity} (the server's "
                       f"live bound)", "n")
    # Choice i = copy i % n of prompt i // n, copy j seeded (seed + j) mod 2**32.
    prompts = [ids for ids in prompts for _ in range(n)]
    samplings = [dataclasses.replace(sp, seed=(seed + j) % 2**32)
                 for sp in samplings for j in range(n)]
    if echo_texts is not None:
      echo_texts = [t for t in echo_texts for _ in range(n)]
    return ParsedRequest(prompts, samplings, stop, stream, include_usage, priority, client,
                         extra, prompt_field=prompt_field,
                         max_tokens_field=max_tokens_field,
                         continuous_usage=include_usage and continuous, logprobs=logprobs,
                         echo_texts=echo_texts, score_only=score_only, n=n)

  @staticmethod
  def _logprobs_field(body: dict, chat: bool) -> Optional[int]:
    """The alternatives per token a body asks for, None when it asks for no
    logprobs: completions ``logprobs`` (an int k; null or false: none),
    chat ``logprobs`` (bool) with ``top_logprobs`` (k, default 0). At most
    ``MAX_LOGPROBS`` (the device program's static top-k)."""
    rule = f"an int in [0, {MAX_LOGPROBS}]"
    if chat:
      wanted = _get(body, "logprobs", bool, False)
      k = _get(body, "top_logprobs", int, 0, rule)
      field = "top_logprobs"
      if k and not wanted:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
      field = "logprobs"
      if body.get("logprobs") is False:       # the legacy "off"
        return None
      k = _get(body, "logprobs", int, None, rule)
      wanted = k is not None
    if not wanted:
      return None
    if not 0 <= k <= MAX_LOGPROBS:
      raise BadRequest(f"'{field}' must be in [0, {MAX_LOGPROBS}] (the most "
                       f"alternatives per token this server computes), got {k}", field)
    return k

  def _completion_prompts(self, body: dict) -> Tuple[List[List[int]], List[Optional[str]]]:
    """The body's ``prompt`` as token ids, one list per choice, and each
    prompt's string (None for token ids): a string or a list of token ids
    is one prompt; a list of strings or a list of token-id lists is a batch
    (at most the server's live bound)."""
    prompt = _get(body, "prompt", (str, list), rule="a string or a list of token ids")
    if isinstance(prompt, str):
      return [self._one_prompt(prompt, "prompt", True)], [prompt]
    if not prompt:
      raise BadRequest("'prompt' must be non-empty", "prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
      return [self._one_prompt(prompt, "prompt", True)], [None]
    if not (all(isinstance(p, str) for p in prompt) or
            all(isinstance(p, list) for p in prompt)):
      raise BadRequest("'prompt' must be a string, a list of token ids, a list of strings "
                       "or a list of token-id lists (not a mix)", "prompt")
    if len(prompt) > self.metrics.capacity:
      raise BadRequest(f"'prompt' holds {len(prompt)} prompts; a batch holds at most "
                       f"{self.metrics.capacity} (the server's live bound)", "prompt")
    return ([self._one_prompt(p, f"prompt[{i}]" if len(prompt) > 1 else "prompt", True)
             for i, p in enumerate(prompt)],
            [p if isinstance(p, str) else None for p in prompt])

  def _one_prompt(self, prompt, name: str, add_special_tokens: bool) -> List[int]:
    """One prompt (a string, or a list of token ids) as token ids."""
    if isinstance(prompt, str):
      if not prompt:
        raise BadRequest(f"'{name}' must be non-empty", name)
      return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    vocab = self.engine.model_cfg.vocab_size
    if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and
                             0 <= t < vocab for t in prompt):
      raise BadRequest(f"'{name}' as token ids must be a non-empty list of ids in "
                       f"[0, {vocab})", name)
    return list(prompt)

  def _chat_prompt(self, body: dict, add_special_tokens: bool = False) -> List[int]:
    messages = _get(body, "messages", list, rule="a list of messages")
    if not messages:
      raise BadRequest("'messages' must hold at least one message", "messages")
    clean = []
    for i, m in enumerate(messages):
      if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest(f"'messages[{i}]' must be an object with a 'role' string",
                         f"messages[{i}].role")
      if m["role"] not in CHAT_ROLES:
        raise BadRequest(f"'messages[{i}].role' must be one of {list(CHAT_ROLES)}, got "
                         f"{m['role']!r}", f"messages[{i}].role")
      content = m.get("content")
      if isinstance(content, list):      # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(c, dict) and c.get("type") == "text" and
                   isinstance(c.get("text"), str) for c in content):
          raise BadRequest(f"'messages[{i}].content' parts must be text parts",
                           f"messages[{i}].content")
        content = "".join(c["text"] for c in content)
      if not isinstance(content, str):
        raise BadRequest(f"'messages[{i}].content' must be a string (text content is "
                         f"required)", f"messages[{i}].content")
      clean.append({"role": m["role"], "content": content})
    # vLLM's extra variables for the template (e.g. {"enable_thinking": false}).
    variables = _get(body, "chat_template_kwargs", dict, {}, "an object")
    if "messages" in variables:
      raise BadRequest("'chat_template_kwargs' may not set 'messages' (the body's field)",
                       "chat_template_kwargs.messages")
    try:
      text = self.tokenizer.apply_chat_template(
          clean, **{"add_generation_prompt": True, **variables})
    except Exception as e:          # jinja2 raise_exception in the template
      raise BadRequest(f"'messages' rejected by the chat template: {e}", "messages") from None
    return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

  # ---------------------------------------------------------------- app
  def _build_app(self) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_):
      self.loop.start()
      yield
      self.loop.stop()

    app = FastAPI(title="iterserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    openai_errors(app)

    @app.get("/health")
    async def health():
      if not self.loop.alive:
        return Response(status_code=503)
      return Response(status_code=200)

    cfg = self.engine.model_cfg
    model_routes(app, lambda: model_card(self.model_name, self.created, self.max_model_len,
                                         cfg.vocab_size, family=cfg.family,
                                         max_position=cfg.max_position))

    @app.get("/engine")
    async def engine_facts():
      """What a router needs to model this replica."""
      c = self.engine.config
      return {"model": self.model_name, "max_model_len": c.max_model_len,
              "vocab_size": self.engine.model_cfg.vocab_size,
              "family": self.engine.model_cfg.family,
              "max_position": self.engine.model_cfg.max_position,
              "page_size": c.page_size, "num_pages": c.num_pages,
              "max_request_slots": c.max_request_slots,
              "capacity": self.metrics.capacity,
              "enable_prefix_caching": c.enable_prefix_caching}

    @app.post("/tokenize")
    async def tokenize(request: HttpRequest):
      """The prompt token ids a completion (``prompt``) or chat (``messages``)
      body would run with; 400 naming the field as for the request itself.
      ``add_special_tokens`` (vLLM's default: true for a prompt, false for
      messages, whose template writes its own) adds the tokenizer's BOS. A
      whole request body may be sent (a router front does): the fields
      other than these are left to the request itself."""
      try:
        body = json_body(await request.body())
        if not isinstance(body, dict):
          raise BadRequest("the request body must be a JSON object")
        chat = "messages" in body
        special = _get(body, "add_special_tokens", bool, not chat)
        if chat:
          ids = self._chat_prompt(body, add_special_tokens=special)
        else:
          prompt = _get(body, "prompt", (str, list), rule="a string or a list of token ids")
          if (isinstance(prompt, list) and len(prompt) == 1
              and isinstance(prompt[0], (str, list))):
            prompt = prompt[0]            # a batch of one
          if isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
            raise BadRequest("'prompt' must be one prompt here (a string or a list of "
                             "token ids); tokenize a batch prompt by prompt", "prompt")
          ids = self._one_prompt(prompt, "prompt", special)
      except Exception as e:          # BadRequest: 400 naming the field; else 500
        return _error_response(e)
      return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: HttpRequest):
      """``{"tokens": [ids]}`` -> ``{"prompt": text}`` (vLLM's shape; special
      tokens kept, as vLLM decodes them)."""
      try:
        body = json_body(await request.body())
        if not isinstance(body, dict):
          raise BadRequest("the request body must be a JSON object")
        for field in body:
          if field not in ("model", "tokens"):
            raise BadRequest(f"'{field}' is not a field of /detokenize (model, tokens)",
                             field)
        model = _get(body, "model", str, self.model_name)
        if model != self.model_name:
          raise UnknownModel(f"model {model!r} does not exist; this server serves "
                             f"{self.model_name!r}", "model")
        tokens = _get(body, "tokens", list, rule="a list of token ids")
        vocab = self.engine.model_cfg.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                   for t in tokens):
          raise BadRequest(f"'tokens' must be token ids in [0, {vocab})", "tokens")
      except Exception as e:
        return _error_response(e)
      return {"prompt": self.tokenizer.decode(tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
      """The tokenizer's special tokens and chat template, as vLLM's
      ``/tokenizer_info`` gives them (what lm-evaluation-harness's remote
      tokenizer reads): ``eos_token``, ``bos_token`` (None when the model
      prepends none), ``pad_token`` (None: the engine pads nothing),
      ``chat_template`` (None without one) and ``model_max_length``."""
      tok = self.tokenizer
      name = lambda i: None if i is None else tok.id_to_token(i)
      return {"tokenizer_class": "tokenizers.Tokenizer",
              "eos_token": name(tok.eos_token_id), "bos_token": name(tok.bos_token_id),
              "pad_token": None, "unk_token": None, "chat_template": tok.chat_template,
              "model_max_length": self.max_model_len}

    @app.get("/metrics")
    async def metrics():
      return Response(prom.generate_latest(self.metrics.registry),
                      media_type=prom.CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
      return await self._serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
      return await self._serve(request, chat=True)

    return app

  def _request_id(self, request: HttpRequest, chat: bool) -> Tuple[str, str]:
    """(the request's id, the ``x-request-id`` value its response carries):
    "cmpl-"/"chatcmpl-" + the client's ``x-request-id`` header, or + a fresh
    one (echoed back either way). Raises BadRequest naming the header when
    it is empty, too long or not printable ASCII."""
    kind = "chatcmpl" if chat else "cmpl"
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
      rid = f"{kind}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
      return rid, rid
    if not (0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isascii()
            and given.isprintable()):
      raise BadRequest(f"header '{REQUEST_ID_HEADER}' must be 1..{MAX_REQUEST_ID_CHARS} "
                       f"printable ASCII characters, got {given[:80]!r}", REQUEST_ID_HEADER)
    return f"{kind}-{given}", given

  async def _serve(self, request: HttpRequest, chat: bool):
    """One completion or chat request: parse, admit every choice, add them
    to the engine in one command, then answer (whole or streamed)."""
    echo_id = None
    try:
      rid, echo_id = self._request_id(request, chat)
      parsed = self.parse(json_body(await request.body()), chat)
      arrival_s = _arrival_s(request)
      if not self.loop.alive:
        raise RuntimeError("the engine thread has stopped")
      self.metrics.admit(len(parsed.prompts))
    except BadRequest as e:
      self.metrics.refused("bad_request")
      return self._with_id(_error_response(e), echo_id)
    except Exception as e:
      return self._with_id(_error_response(e), echo_id)
    events: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    n = len(parsed.prompts)
    lives = [_Live(rid if n == 1 else f"{rid}-{i}", i, parsed,
                   self.tokenizer.detokenizer(skip_special_tokens=True), events, loop)
             for i in range(n)]
    for i, live in enumerate(lives):
      live.arrival_s = arrival_s
      if i % parsed.n:                 # a copy: copy 0 of its prompt computes it first
        live.leader = lives[i - i % parsed.n].rid
    self.loop.add(lives)
    for _ in range(n):          # first events come in index order, all before any delta
      first = await events.get()
      if first["type"] == "accepted":
        continue
      self._abort_all(lives)
      if first["type"] == "refused":
        error = first["exc"]
      elif first["type"] == "end":       # rejected at once: can never fit the KV cache
        error = self._unfinished(parsed, first)
      else:
        error = RuntimeError(first["error"])
      return self._with_id(_error_response(error), echo_id)
    if parsed.stream:
      return StreamingResponse(self._stream(rid, lives, parsed, events, chat),
                               media_type="text/event-stream",
                               headers={REQUEST_ID_HEADER: echo_id})
    return self._with_id(await self._complete(request, rid, lives, parsed, events, chat),
                         echo_id)

  @staticmethod
  def _with_id(response, echo_id: Optional[str]):
    """``response`` (a Response, or a dict made one) with ``x-request-id``."""
    if isinstance(response, dict):
      response = JSONResponse(response)
    if echo_id is not None:
      response.headers[REQUEST_ID_HEADER] = echo_id
    return response

  def _abort_all(self, lives: List[_Live]) -> None:
    """Cancels every choice still live (an ended one is left as it is)."""
    for live in lives:
      self.loop.abort(live.rid)

  def _unfinished(self, parsed: ParsedRequest, end: dict) -> Exception:
    """The error of a request that ended without completing (its "end"
    event). ``rejected`` is a 400 naming the field to shorten: the engine
    rejects on arrival a request whose KV rows, prompt + max_tokens - 1, need
    more pages than the cache has, and a policy rejects one it can never
    schedule (ORCA: a whole-prompt prefill wider than the token budget, a
    reservation larger than the cache). ``param`` is the prompt when the
    prompt alone (one output token) needs more pages than the cache has, or
    when the whole request fits the cache and the prompt is wider than the
    token budget; else max_tokens. ``failed`` or ``cancelled``: a server
    error (500). A held copy that the engine refused: that refusal."""
    if "exc" in end:
      return end["exc"]
    message = f"request {end['outcome']}: {end['reason']}"
    if end["outcome"] != "rejected":
      return RuntimeError(message)
    c = self.engine.config
    index = end.get("index", 0)
    prompt_len = len(parsed.prompts[index])
    prompt_i = index // parsed.n
    fits = lambda max_tokens: kv_pages.pages_for(
        min(rec.kv_rows(prompt_len, max_tokens), c.max_model_len - 1),
        c.page_size) <= c.num_pages - 1
    too_long = not fits(1) or (fits(parsed.samplings[index].max_tokens)
                               and prompt_len > c.max_num_batched_tokens)
    prompt_field = (parsed.prompt_field if parsed.num_prompts == 1 else
                    f"{parsed.prompt_field}[{prompt_i}]")
    return BadRequest(message, prompt_field if too_long else parsed.max_tokens_field)

  def _head(self, rid: str, chat: bool, chunk: bool) -> dict:
    """The fields every response and chunk starts with; ``object`` is
    "text_completion" (OpenAI's legacy completions, chunks too),
    "chat.completion" or "chat.completion.chunk"."""
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}

  @staticmethod
  def _usage(prompt_tokens: int, completion_tokens: int,
             cached_tokens: Optional[int] = None) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` (the
    prompt tokens served from the prefix cache) when given."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
      usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage

  @staticmethod
  def _final_usage(parsed: ParsedRequest, ends: Dict[int, dict]) -> dict:
    """Usage of a request that completed: each prompt's tokens once (and,
    as cached, the most any of its copies took from the prefix cache),
    completion tokens summed over every choice."""
    cached = {}
    for i, e in ends.items():
      cached[i // parsed.n] = max(cached.get(i // parsed.n, 0), e["cached_tokens"])
    return OpenAIServer._usage(parsed.prompt_tokens(),
                               sum(e["completion_tokens"] for e in ends.values()),
                               sum(cached.values()))

  def _token_text(self, token_id: int) -> str:
    """A token's own text as logprobs name it (special tokens kept; a piece
    of a UTF-8 character shows as U+FFFD, its ``bytes`` are exact)."""
    return self.tokenizer.decode([token_id])

  def _completion_logprobs(self, entries, k: int, offset: int = 0) -> dict:
    """OpenAI's legacy completion ``logprobs`` for ``entries`` ((token id,
    ``TokenLogprobs`` or None) each; None: the prompt's first token, which
    has none): ``tokens``, ``token_logprobs``, ``top_logprobs`` (the k most
    likely tokens plus the chosen one, so up to k + 1: text -> logprob; of
    tokens with the same text, the likeliest's) and
    ``text_offset`` (each token's start in the text, from ``offset``)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in entries:
      text = self._token_text(token_id)
      tokens.append(text)
      offsets.append(offset)
      offset += len(text)
      if lp is None:
        values.append(None)
        tops.append(None)
        continue
      values.append(_json_logprob(lp.logprob))
      top = {}        # tokens with the same text (pieces of a character): the likeliest
      for t, v in zip(lp.top_ids[:k], lp.top[:k]):
        top.setdefault(self._token_text(int(t)), _json_logprob(v))
      top.setdefault(text, _json_logprob(lp.logprob))
      tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}

  def _chat_logprobs(self, entries, k: int) -> dict:
    """OpenAI's chat ``logprobs``: ``content``, one entry per token (its
    text, logprob, UTF-8 ``bytes`` and the k most likely tokens)."""
    def one(token_id, logprob):
      return {"token": self._token_text(token_id), "logprob": _json_logprob(logprob),
              "bytes": list(self.tokenizer.token_bytes(token_id))}
    return {"content": [
        {**one(token_id, lp.logprob),
         "top_logprobs": [one(int(t), v) for t, v in zip(lp.top_ids[:k], lp.top[:k])]}
        for token_id, lp in entries]}

  def _logprobs(self, parsed: ParsedRequest, chat: bool, entries, offset: int = 0):
    """The ``logprobs`` of a choice or chunk for ``entries``; None when the
    request asked for none."""
    if parsed.logprobs is None:
      return None
    if chat:
      return self._chat_logprobs(entries, parsed.logprobs)
    return self._completion_logprobs(entries, parsed.logprobs, offset)

  def _choice(self, index: int, chat: bool, text: str, finish_reason: Optional[str],
              chunk: bool, logprobs=None) -> dict:
    """One choice of a response (``chunk``: of a stream chunk, a ``delta``
    for chat)."""
    if not chat:
      return {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": finish_reason}
    if chunk:
      delta = {"content": text} if text or finish_reason is None else {}
      return {"index": index, "delta": delta, "logprobs": logprobs,
              "finish_reason": finish_reason}
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason}

  async def _complete(self, request: HttpRequest, rid: str, lives: List[_Live],
                      parsed: ParsedRequest, events: asyncio.Queue, chat: bool):
    """The whole response once every choice ended; a client that hangs up
    cancels every choice; a choice that did not complete answers the
    request with its error (the others are cancelled)."""
    checked = time.monotonic()
    ends: Dict[int, dict] = {}
    while len(ends) < len(lives):
      try:
        event = await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
      except asyncio.TimeoutError:
        event = None
      if time.monotonic() - checked >= _DISCONNECT_POLL_S:
        checked = time.monotonic()
        if await request.is_disconnected():      # abort at the next boundary
          self._abort_all(lives)
          return Response(status_code=499)
      if event is None:
        continue
      if event["type"] == "error":
        return _error_response(RuntimeError(event["error"]))
      if event["type"] != "end":
        continue
      if event["outcome"] != "completed":
        self._abort_all(lives)
        return _error_response(self._unfinished(parsed, event))
      ends[event["index"]] = event
    choices = [self._choice(i, chat, e["text"], e["finish_reason"], chunk=False,
                            logprobs=self._logprobs(parsed, chat, e["logprobs"]))
               for i, e in sorted(ends.items())]
    return {**self._head(rid, chat, False), "choices": choices,
            "usage": self._final_usage(parsed, ends)}

  async def _stream(self, rid: str, lives: List[_Live], parsed: ParsedRequest,
                    events: asyncio.Queue, chat: bool):
    """Server-sent events: each choice's deltas as they come (``index``
    tells them apart), its finish chunk, then, with ``include_usage``, one
    last chunk with no choices and the usage (OpenAI; ``usage`` is null on
    the chunks before it, or with ``continuous_usage_stats`` the counts so
    far), then ``[DONE]``. A choice that did not complete ends the stream
    with its error (the others are cancelled)."""
    ends: Dict[int, dict] = {}
    counts = [0] * len(lives)
    offsets = [0] * len(lives)         # text_offset of each choice's next token
    prompt_tokens = parsed.prompt_tokens()
    done = False
    try:
      head = self._head(rid, chat, True)
      if parsed.include_usage:             # OpenAI: null on every chunk but the last
        head["usage"] = None

      def chunk(choice):
        out = {**head, "choices": [choice]}
        if parsed.continuous_usage:
          out["usage"] = self._usage(prompt_tokens, sum(counts))
        return _sse(out)

      if chat:
        for i in range(len(lives)):
          yield chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                       "logprobs": None, "finish_reason": None})
      while len(ends) < len(lives):
        event = await events.get()
        i = event["index"]
        if event["type"] == "error":
          done = True
          yield _sse({"error": {"message": event["error"], "type": "server_error",
                                "param": None, "code": None}})
          break
        if event["type"] == "delta":
          counts[i] = event["completion_tokens"]
          logprobs = self._logprobs(parsed, chat, event["logprobs"], offsets[i])
          if logprobs is not None and not chat:
            offsets[i] += sum(len(t) for t in logprobs["tokens"])
          yield chunk(self._choice(i, chat, event["text"], None, chunk=True,
                                   logprobs=logprobs))
          continue
        if event["outcome"] != "completed":        # "end"
          done = True
          self._abort_all(lives)
          yield _sse(_error_body(self._unfinished(parsed, event))[1])
          break
        ends[i] = event
        counts[i] = event["completion_tokens"]
        yield chunk(self._choice(i, chat, "", event["finish_reason"], chunk=True))
      else:
        done = True
        if parsed.include_usage:
          yield _sse({**head, "choices": [], "usage": self._final_usage(parsed, ends)})
      yield _sse("[DONE]")
    finally:
      if not done:                         # client gone: abort at the next boundary
        self._abort_all(lives)


def bind_socket(host: str, port: int) -> socket.socket:
  """A TCP socket bound to ``host:port`` as uvicorn binds one (SO_REUSEADDR;
  IPv6 when ``host`` holds a ':'); port 0 picks a free port. A launcher
  binds before it loads a model, so that a port in use is refused at once.

  Raises:
    OSError: the address is in use, or ``host`` is not an address here.
  """
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError:
    sock.close()
    raise
  return sock


def serve_forever(app: FastAPI, sock: socket.socket) -> None:
  """Runs ``app`` under uvicorn on the bound ``sock`` until interrupted."""
  uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0):
  """Runs ``app`` under uvicorn in a daemon thread (tests, benchmarks).

  Returns:
    ``(server, thread, port)``: ``server.should_exit = True`` and
    ``thread.join()`` stop it; ``port`` is the bound port (0 picks a free one).
  """
  sock = bind_socket(host, port)
  server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  deadline = time.monotonic() + 60
  while not server.started:
    if not thread.is_alive() or time.monotonic() > deadline:
      raise RuntimeError("uvicorn did not start")
    time.sleep(0.01)
  return server, thread, sock.getsockname()[1]
