"""The OpenAI wire protocol the server and the router front share.

Headers (``x-request-id``, the front's arrival header), the refusals a
request can meet and their one mapping to an OpenAI-style error body and
HTTP status (``_error_body``: 429 overloaded, 400 bad input naming the field
and the rule, 404 unknown model, 503 no engine, 500 anything else), reading
a JSON body whose every string is valid Unicode text, the model card of
``GET /v1/models``, and the server-sent-event framing of a stream.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Optional, Tuple

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from serving.engine.requests import QueueFull

# A client's id for its request (vLLM, ``vllm bench serve``): the response's
# ``id`` is "cmpl-"/"chatcmpl-" + it, the engine's request id the same
# (choice i of a batched prompt or of n > 1: + "-i"), and the response carries it back.
REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 256

# A request forwarded by ``serving.http.replicas`` carries its original arrival as
# ``time.monotonic()`` seconds of the same host, so TTFT, queue time and the
# engine's SLO clocks count from the front's arrival, not the forward.
ARRIVAL_HEADER = "x-iterserve-arrival-s"
# A front forwards the tenant of the client's API key (``serving.http.guard``)
# to the replicas it owns, which trust it only with ``trust_front_headers``.
TENANT_HEADER = "x-iterserve-tenant"
# The oldest arrival a trusted front may forward (s before now).
MAX_ARRIVAL_AGE_S = 3600.0


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


class LongInt:
  """An integer in a request body with more digits than Python converts
  (``sys.get_int_max_str_digits()``, 4300 by default), which ``json.loads``
  would refuse with an error naming no field. ``json_body`` keeps it as this
  marker (its digit count) so the field's own check refuses it by name."""

  __slots__ = ("digits",)

  def __init__(self, digits: int):
    self.digits = digits

  def __repr__(self) -> str:
    return f"<an integer of {self.digits} digits>"


def refuse_long_ints(value: Any, path: str) -> None:
  """Raises BadRequest naming the first LongInt in ``value`` (its path
  below ``path``): for a field passed on whole, e.g. template variables."""
  stack = [(path, value)]
  while stack:
    where, item = stack.pop()
    if isinstance(item, LongInt):
      raise BadRequest(f"'{where}' must hold integers of at most "
                       f"{sys.get_int_max_str_digits()} digits, got one of {item.digits}",
                       where)
    if isinstance(item, dict):
      stack.extend((f"{where}.{k}", v) for k, v in reversed(list(item.items())))
    elif isinstance(item, list):
      stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(item))))


def _parse_int(text: str):
  """``json.loads``'s ``parse_int``: ``int(text)``, or a LongInt when the
  digits are past Python's int-conversion limit."""
  digits = len(text) - text.startswith("-")
  limit = sys.get_int_max_str_digits()
  if limit and digits > limit:
    return LongInt(digits)
  return int(text)


def whole_int(value) -> Optional[int]:
  """``value`` as an int field reads it: an int (never a bool), or a float
  with no fraction (``3.0`` is 3, as pydantic's lax mode reads it for
  vLLM); None for anything else."""
  if isinstance(value, float):
    return int(value) if value.is_integer() else None
  return value if isinstance(value, int) and not isinstance(value, bool) else None


def _get(body: dict, name: str, kinds, default=_MISSING, rule: str = ""):
  """``body[name]`` checked against ``kinds`` (bool is never an int here).
  Where an int is wanted and a float is not, a float is read by
  ``whole_int``."""
  value = body.get(name, _MISSING)
  if value is _MISSING or value is None:
    if default is _MISSING:
      raise BadRequest(f"'{name}' is required", name)
    return default
  kinds = kinds if isinstance(kinds, tuple) else (kinds,)
  names = "/".join(k.__name__ for k in kinds)
  if isinstance(value, LongInt):
    raise BadRequest(f"'{name}' must be {rule or names}, got an integer of {value.digits} "
                     f"digits (more than the {sys.get_int_max_str_digits()} an integer "
                     f"may hold here)", name)
  if int in kinds and float not in kinds and isinstance(value, float):
    if whole_int(value) is None:
      raise BadRequest(f"'{name}' must be {rule or names} (a whole number), got {value!r}",
                       name)
    value = whole_int(value)
  if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
    raise BadRequest(f"'{name}' must be {rule or names}, got {type(value).__name__}", name)
  return value


def _arrival_s(request: HttpRequest, trusted: bool) -> Optional[float]:
  """The ARRIVAL_HEADER value, or None: None unless ``trusted`` (the server
  runs behind a front of its own; anyone else could send the header to
  jump an aging or deadline queue or corrupt the latency histograms).
  Trusted, it must be a finite ``time.monotonic()`` reading not in the
  future and at most MAX_ARRIVAL_AGE_S old, else BadRequest naming it."""
  value = request.headers.get(ARRIVAL_HEADER)
  if value is None or not trusted:
    return None
  try:
    arrival_s = float(value)
  except ValueError:
    arrival_s = float("nan")
  now = time.monotonic()
  if not now - MAX_ARRIVAL_AGE_S <= arrival_s <= now:
    raise BadRequest(f"header '{ARRIVAL_HEADER}' must be a time.monotonic() reading (s) "
                     f"not in the future and at most {MAX_ARRIVAL_AGE_S:.0f} s old, got "
                     f"{value[:80]!r}", ARRIVAL_HEADER)
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
  home of that rule, for the server and the router front alike). An
  integer past Python's int-conversion limit is kept as a ``LongInt``, which
  every field check refuses by name (``json.loads`` alone raises a
  ValueError naming no field).

  Raises:
    BadRequest: not JSON, or a string with a lone surrogate (naming its field).
  """
  try:
    body = json.loads(raw, parse_int=_parse_int)
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


def _sse(payload) -> bytes:
  """One server-sent event: ``data: <payload>`` (a dict as JSON; a string,
  e.g. ``[DONE]``, as it is) and the blank line that ends it."""
  return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
