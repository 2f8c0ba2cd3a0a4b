"""OpenAI-compatible HTTP server over one ``Engine`` (FastAPI + uvicorn): the
app, its routes and the entry points that serve it.

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

The ``x-request-id`` header, when sent, names the response (its ``id`` is
"cmpl-"/"chatcmpl-" + it) and comes back on it; the engine keys every
request by a fresh internal id, so two requests may send the same value
and neither can cancel the other. A body field the endpoint does not read
is a 400 naming it, never ignored.

Access and limits (``guard.Guard``, before any route reads the body): API
keys (``Authorization: Bearer``) on every route but /health, /metrics and
/engine, a key's tenant as the request's fairness identity and
prefix-cache salt; the Host allow-list; JSON bodies only (415); the body
size cap (413). Then, before tokenizing, the prompt character cap; JSON
decoding, templating and tokenizing run on tokenizer threads, not the
event loop; /tokenize and /detokenize hold a live place like a request
(429 past the bound). ``cache_salt`` (vLLM's field): prefix-cache hits
only between requests of the same salt.

The engine's death: when a step raises, every request in flight (and
every one that arrives after) ends with an error, /health answers 503 and
the server stops (``serve`` returns 1: the launcher exits non-zero, so a
supervisor restarts it).

Logprobs (completions ``logprobs`` k, chat ``logprobs`` + ``top_logprobs``;
k <= ``MAX_LOGPROBS``) are the engine's raw logprobs, one entry per
generated token, streamed with the chunks (``responses`` gives their
source and shapes). ``echo`` puts the prompt first: its text, and with
logprobs its tokens' (from the prefill rows; the first token has none; such
a request takes no prefix hit). ``max_tokens: 0`` with echo scores the
prompt alone: the engine runs one token, which is dropped.

Overload: at most ``max_request_slots + max_waiting`` requests are live at
once (``max_waiting`` wait for an engine slot; the launcher warms the
engine up to that many, so no slot-table growth compiles while streams
run); past that a request gets HTTP 429 with an OpenAI-style error body
(``_error_response`` is the one place that maps a refusal to its HTTP
status). Bad input gets HTTP 400 naming the field and the rule, as vLLM
does for a prompt plus max_tokens beyond the context (both numbers in the
message; never silently cut).

Where the pieces live: ``protocol`` (errors and their HTTP statuses,
headers, JSON bodies, the model card, SSE framing; shared with the router
front), ``parsing`` (a body -> each choice's prompt ids and sampling),
``engine_loop`` (the thread that owns the engine, detokenizes, matches stop
strings and holds parallel copies until their prompt is cached),
``responses`` (response, chunk, usage and logprobs bodies), ``metrics``
(``/metrics`` and the live-request bound) and ``guard`` (keys, Host names,
body size).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import socket
import sys
import time
import uuid
from typing import Dict, List, Optional, Tuple

import prometheus_client as prom
import uvicorn
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from scheduler import records as rec
from serving.engine.engine import Engine
from serving.http import responses
from serving.http.engine_loop import EngineLoop, _Live
from serving.http.guard import TENANT_SCOPE_KEY, Access, Guard, prefix_salt
from serving.http.metrics import ServerMetrics
from serving.http.parsing import ParsedRequest, RequestParser
from serving.http.protocol import (MAX_REQUEST_ID_CHARS, REQUEST_ID_HEADER, TENANT_HEADER,
                                   BadRequest, Unavailable, UnknownModel, _arrival_s,
                                   _error_body, _error_response, _get, _sse, json_body,
                                   model_card, model_routes, openai_errors)
from serving.kv import pages as kv_pages

# Seconds between disconnect checks of a non-streaming request.
_DISCONNECT_POLL_S = 0.25
TOKENIZER_THREADS = 4


class OpenAIServer:
  """The FastAPI app around an ``EngineLoop``; ``parser`` checks its bodies.

  Args:
    engine: a fresh Engine (the loop thread owns it from ``start``).
    tokenizer: the model's Tokenizer.
    model_name: the name /v1/models lists and requests must use.
    max_waiting: requests that may wait for an engine slot (>= 0); more
      live requests than ``max_request_slots + max_waiting`` get HTTP 429.
    default_max_tokens: max_tokens when the body has none (None: the rest of
      the context, as vLLM).
    trust_front_headers: honour ARRIVAL_HEADER and TENANT_HEADER (a front
      of our own on this host forwards each request's arrival and its API
      key's tenant); off, both headers are ignored.
    access: the ``guard.Access`` its ``Guard`` enforces (keys, Host names,
      body size).
    max_prompt_chars: the longest prompt string (or chat messages' text in
      all) taken to the tokenizer (None: 32 characters per context token).
  """

  def __init__(self, engine: Engine, tokenizer, model_name: str, *, max_waiting: int = 64,
               default_max_tokens: Optional[int] = None, trust_front_headers: bool = False,
               access: Access = Access(), max_prompt_chars: Optional[int] = None):
    if max_waiting < 0:
      raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
    self.engine = engine
    self.tokenizer = tokenizer
    self.model_name = model_name
    self.max_model_len = engine.config.max_model_len
    self.metrics = ServerMetrics(model_name, engine.config.max_request_slots + max_waiting)
    self.parser = RequestParser(
        tokenizer, model_name, max_model_len=self.max_model_len,
        vocab_size=engine.model_cfg.vocab_size, max_stop_ids=engine.config.max_stop_ids,
        capacity=self.metrics.capacity, default_max_tokens=default_max_tokens,
        max_prompt_chars=max_prompt_chars or 32 * self.max_model_len)
    self.loop = EngineLoop(engine, tokenizer, self.metrics, on_death=self._engine_died)
    self.trust_front_headers = trust_front_headers
    self._uvicorn: Optional[uvicorn.Server] = None
    self._ids = itertools.count()
    self.created = int(time.time())
    # Tokenization and chat templating run here, never on the event loop
    # (a long prompt would stall every stream while it is tokenized).
    self._tokenizing = concurrent.futures.ThreadPoolExecutor(
        max_workers=TOKENIZER_THREADS, thread_name_prefix="tokenize")
    self.app = Guard(self._build_app(), access)

  def _build_app(self) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_):
      self.loop.start()
      yield
      self.loop.stop()
      self._tokenizing.shutdown(wait=False)

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
        raw = await request.body()
        with self._admitted():
          ids = await self._off_loop(self._tokenize_body, raw)
      except Exception as e:          # BadRequest: 400 naming the field; else 500
        return _error_response(e)
      return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: HttpRequest):
      """``{"tokens": [ids]}`` -> ``{"prompt": text}`` (vLLM's shape; special
      tokens kept, as vLLM decodes them)."""
      try:
        raw = await request.body()
        with self._admitted():
          return {"prompt": await self._off_loop(self._detokenize_body, raw)}
      except Exception as e:
        return _error_response(e)

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

  def _detokenize_body(self, raw: bytes) -> str:
    """``/detokenize``'s body -> its text (tokenizer thread)."""
    body = json_body(raw)
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
    if len(tokens) > self.max_model_len:
      raise BadRequest(f"'tokens' holds at most {self.max_model_len} ids (the context), "
                       f"got {len(tokens)}", "tokens")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
               for t in tokens):
      raise BadRequest(f"'tokens' must be integer token ids in [0, {vocab})", "tokens")
    return self.tokenizer.decode(tokens)

  def _tokenize_body(self, raw: bytes) -> List[int]:
    """``/tokenize``'s body -> the prompt token ids (tokenizer thread)."""
    body = json_body(raw)
    if not isinstance(body, dict):
      raise BadRequest("the request body must be a JSON object")
    chat = "messages" in body
    special = _get(body, "add_special_tokens", bool, not chat)
    if chat:
      return self.parser.chat_prompt(body, add_special_tokens=special)
    prompt = _get(body, "prompt", (str, list), rule="a string or a list of token ids")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]            # a batch of one
    if isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
      raise BadRequest("'prompt' must be one prompt here (a string or a list of "
                       "token ids); tokenize a batch prompt by prompt", "prompt")
    return self.parser.one_prompt(prompt, "prompt", special)

  @contextlib.contextmanager
  def _admitted(self):
    """One live place held while an engine-side helper route (tokenize,
    detokenize) works: past the live bound it is a 429 like a request."""
    self.metrics.admit(1)
    try:
      yield
    finally:
      self.metrics.release()

  async def _off_loop(self, fn, *args):
    """``fn(*args)`` on the tokenizer threads (JSON decoding, templating,
    tokenizing), so the event loop keeps serving streams meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

  def _parse(self, raw: bytes, chat: bool, tenant: Optional[str]) -> ParsedRequest:
    """A request body -> its ParsedRequest (tokenizer thread); with a
    tenant (the API key's), the tenant is the fairness identity and salts
    the prefix cache, whatever the body's ``user``/``client``/``tenant``."""
    parsed = self.parser.parse(json_body(raw), chat)
    if tenant is not None:
      parsed.client = tenant
    salt = prefix_salt(tenant, parsed.extra.get("cache_salt", ""))
    if salt:
      parsed.extra["cache_salt"] = salt
    return parsed

  def _tenant(self, request: HttpRequest) -> Optional[str]:
    """The request's tenant: its API key's (``Guard``), or, behind a front
    of our own, the one the front forwards (TENANT_HEADER)."""
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    if tenant is None and self.trust_front_headers:
      tenant = request.headers.get(TENANT_HEADER)
      if tenant is not None and (not tenant or "|" in tenant):
        raise BadRequest(f"the {TENANT_HEADER} header must be a non-empty tenant without '|'",
                         TENANT_HEADER)
    return tenant

  @property
  def capacity(self) -> int:
    """Live requests the server holds at most (engine slots + max_waiting):
    the slot-table size a launcher warms the engine up to."""
    return self.metrics.capacity

  def stop_with(self, server: uvicorn.Server) -> None:
    """Has the engine thread's death stop ``server`` (``serve``)."""
    self._uvicorn = server

  def _engine_died(self, error: BaseException) -> None:
    """Engine thread: every request it held has its error event; stop
    serving, so the process exits non-zero and a supervisor restarts it."""
    print(f"error: the engine thread failed ({type(error).__name__}: {error}); every "
          f"in-flight request was failed; the server stops", file=sys.stderr, flush=True)
    if self._uvicorn is not None:
      self._uvicorn.should_exit = True

  def serve(self, sock: socket.socket) -> int:
    """Serves on the bound ``sock`` until interrupted or the engine dies;
    returns the launcher's exit status (1 after the engine's death)."""
    server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
    self.stop_with(server)
    server.run(sockets=[sock])
    return 0 if self.loop.error is None else 1

  def _request_id(self, request: HttpRequest, chat: bool) -> Tuple[str, str, str]:
    """(the engine's key for the request, its response ``id``, the
    ``x-request-id`` value its response carries). The engine key is always
    fresh, so a client's id never names another request (two requests may
    send the same one; an abort reaches only its own). The ``id`` is
    "cmpl-"/"chatcmpl-" + the client's ``x-request-id`` header, or the key.
    Raises BadRequest naming the header when it is empty, too long or not
    printable ASCII."""
    kind = "chatcmpl" if chat else "cmpl"
    key = f"{kind}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
      return key, key, key
    if not (0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isascii()
            and given.isprintable()):
      # Header bytes arrive as latin-1 text: shown as the UTF-8 the client sent.
      shown = given[:80].encode("latin-1", "replace").decode("utf-8", "replace")
      raise BadRequest(f"header '{REQUEST_ID_HEADER}' must be 1..{MAX_REQUEST_ID_CHARS} "
                       f"printable ASCII characters, got {shown!r}", REQUEST_ID_HEADER)
    return key, f"{kind}-{given}", given

  async def _serve(self, request: HttpRequest, chat: bool):
    """One completion or chat request: parse, admit every choice, add them
    to the engine in one command, then answer (whole or streamed)."""
    echo_id = None
    try:
      key, rid, echo_id = self._request_id(request, chat)
      parsed = await self._off_loop(self._parse, await request.body(), chat,
                                    self._tenant(request))
      arrival_s = _arrival_s(request, self.trust_front_headers)
      if not self.loop.alive:
        raise Unavailable("the engine thread has stopped; the server is shutting down")
      self.metrics.admit(len(parsed.prompts))
    except BadRequest as e:
      self.metrics.refused("bad_request")
      return self._with_id(_error_response(e), echo_id)
    except Exception as e:
      return self._with_id(_error_response(e), echo_id)
    events: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    n = len(parsed.prompts)
    lives = [_Live(key if n == 1 else f"{key}-{i}", i, parsed,
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
    choices = [responses.choice(i, chat, e["text"], e["finish_reason"], chunk=False,
                                logprobs=responses.choice_logprobs(self.tokenizer, parsed, chat,
                                                                   e["logprobs"]))
               for i, e in sorted(ends.items())]
    return {**responses.head(rid, self.model_name, chat, False), "choices": choices,
            "usage": responses.final_usage(parsed, ends)}

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
      head = responses.head(rid, self.model_name, chat, True)
      if parsed.include_usage:             # OpenAI: null on every chunk but the last
        head["usage"] = None

      def chunk(choice):
        out = {**head, "choices": [choice]}
        if parsed.continuous_usage:
          out["usage"] = responses.usage(prompt_tokens, sum(counts))
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
          logprobs = responses.choice_logprobs(self.tokenizer, parsed, chat, event["logprobs"],
                                               offsets[i])
          if logprobs is not None and not chat:
            offsets[i] += sum(len(t) for t in logprobs["tokens"])
          yield chunk(responses.choice(i, chat, event["text"], None, chunk=True,
                                       logprobs=logprobs))
          continue
        if event["outcome"] != "completed":        # "end"
          done = True
          self._abort_all(lives)
          yield _sse(_error_body(self._unfinished(parsed, event))[1])
          break
        ends[i] = event
        counts[i] = event["completion_tokens"]
        yield chunk(responses.choice(i, chat, "", event["finish_reason"], chunk=True))
      else:
        done = True
        if parsed.include_usage:
          yield _sse({**head, "choices": [], "usage": responses.final_usage(parsed, ends)})
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
