"""Who may use a server, and how large a request may be, checked before any
route reads a byte of the body: ``Guard``, an ASGI middleware that the
OpenAI server and the router front both install.

In order, for every HTTP request:

1. Host: with an allow-list (``Access.allowed_hosts``; ``loopback_hosts``
   when the server is bound to a loopback address), a ``Host`` header whose
   name is not on it is HTTP 400 (a web page's DNS-rebinding request to a
   loopback server carries the attacker's name).
2. API key: with keys (``Access.api_keys``), every route but
   ``OPEN_PATHS`` needs ``Authorization: Bearer <key>``, else HTTP 401
   (``invalid_api_key``), compared in constant time. A key's tenant, when
   the key names one, goes to the route as ``TENANT_SCOPE_KEY``: the
   request's fairness identity and its prefix-cache salt.
3. A POST body must be JSON: ``Content-Type: application/json`` (any
   parameters), else HTTP 415.
4. A body larger than ``Access.max_body_bytes`` is HTTP 413, whether its
   ``Content-Length`` says so or it streams past the cap (read no further).

A front's ``GET /router`` shows a caller the route records of its own
tenant only (``own_records``): with keys, those whose ``tenant`` is the
caller's key's (a key without a tenant: the records of requests made
without one); without keys, every record. No key sees every tenant's: the
route log (``--route_log``, a file on the front's host) holds them all.

Every refusal is an OpenAI-style error body. Keys come from
``parse_api_keys``: comma-separated ``KEY`` or ``KEY:TENANT`` entries (the
``--api_key`` flag, the ``ITERSERVE_API_KEY`` variable, or one entry per
line of an ``--api_key_file``).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

# Routes open without a key: liveness for supervisors and load balancers,
# Prometheus scraping, and the engine facts a router front reads.
OPEN_PATHS = ("/health", "/metrics", "/engine")
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
LOOPBACK_ADDRESSES = ("127.0.0.1", "::1", "localhost")
# The tenant of a request's API key, in its ASGI scope (None: no tenant).
TENANT_SCOPE_KEY = "iterserve.tenant"


def loopback_hosts() -> Tuple[str, ...]:
  """The Host names a loopback-bound server answers."""
  return ("127.0.0.1", "localhost", "[::1]", "::1")


def is_loopback(host: str) -> bool:
  return host in LOOPBACK_ADDRESSES or host.startswith("127.")


def parse_api_keys(text: str, source: str = "--api_key") -> Dict[str, Optional[str]]:
  """``KEY[:TENANT]`` entries, comma- or newline-separated -> {key: tenant
  or None}. A key holds no ',', ':' or whitespace; a tenant is non-empty
  and holds no '|' (it ends its prefix-cache salt, ``prefix_salt``).

  Raises:
    ValueError: no entry, an empty key or tenant, a tenant with '|', a key
      given twice; the message names ``source`` and the entry's position
      (never the key).
  """
  entries = [e.strip() for e in text.replace("\n", ",").split(",")]
  entries = [e for e in entries if e]
  if not entries:
    raise ValueError(f"{source} must hold at least one KEY or KEY:TENANT entry")
  keys: Dict[str, Optional[str]] = {}
  for i, entry in enumerate(entries):
    key, _, tenant = entry.partition(":")
    if not key or any(c.isspace() for c in key) or (":" in entry and not tenant):
      raise ValueError(f"{source}: entry {i + 1} must be KEY or KEY:TENANT (a key without "
                       f"spaces, a non-empty tenant)")
    if "|" in tenant:
      raise ValueError(f"{source}: entry {i + 1}'s tenant must not hold '|'")
    if key in keys:
      raise ValueError(f"{source}: entry {i + 1} repeats a key")
    keys[key] = tenant or None
  return keys


def prefix_salt(tenant: Optional[str], salt: str) -> str:
  """The prefix-cache salt of a request (``Engine.add_request(cache_salt)``:
  hits only between requests of one salt) from its API key's tenant and
  its body's ``cache_salt`` ("" for none). A tenant's requests are salted
  ``tenant:TENANT|SALT``, so no other tenant hits its pages or learns from
  ``cached_tokens``; a request without a tenant keeps the unsalted shared
  chain (""), or ``salt:SALT``, which no tenant's salt begins with (a body
  salt of ``tenant:alice|`` cannot reach alice's pages). One home for the
  server and the replica front's cache model."""
  if tenant is not None:
    return f"tenant:{tenant}|{salt}"
  return f"salt:{salt}" if salt else ""


@dataclasses.dataclass(frozen=True)
class Access:
  """What ``Guard`` enforces.

  Attributes:
    api_keys: {key: tenant or None}; empty: no key needed.
    allowed_hosts: Host names accepted (without port; "*" anywhere: any);
      None: any.
    max_body_bytes: the largest request body (>= 1).
  """

  api_keys: Dict[str, Optional[str]] = dataclasses.field(default_factory=dict)
  allowed_hosts: Optional[Tuple[str, ...]] = None
  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

  def __post_init__(self):
    if self.max_body_bytes < 1:
      raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
    if any(t is not None and (not t or "|" in t) for t in self.api_keys.values()):
      raise ValueError("Access.api_keys: a tenant must be non-empty and hold no '|' "
                       "(it ends its prefix-cache salt, prefix_salt)")


def _error(status: int, message: str, kind: str, code: Optional[str] = None) -> Tuple:
  body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                               "code": code}}).encode()
  return status, body


def _host_name(value: str) -> str:
  """The name of a Host header value, its port dropped ("[::1]:80" -> "[::1]")."""
  if value.startswith("["):
    return value[:value.find("]") + 1] if "]" in value else value
  return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
  """ASGI middleware enforcing an ``Access`` (module docstring)."""

  def __init__(self, app, access: Access):
    self.app = app
    self.access = access
    self._keys: List[Tuple[bytes, Optional[str]]] = [
        (k.encode(), t) for k, t in access.api_keys.items()]

  def _tenant(self, headers: Dict[bytes, bytes]):
    """(allowed, tenant) for a request's ``Authorization`` header."""
    given = headers.get(b"authorization", b"")
    scheme, _, token = given.partition(b" ")
    if scheme.lower() != b"bearer" or not token:
      return False, None
    found, tenant = False, None
    for key, key_tenant in self._keys:          # every key compared: constant time
      if hmac.compare_digest(key, token.strip()):
        found, tenant = True, key_tenant
    return found, tenant

  def _refusal(self, scope, headers) -> Optional[Tuple]:
    a = self.access
    if a.allowed_hosts is not None and "*" not in a.allowed_hosts:
      host = _host_name(headers.get(b"host", b"").decode("latin-1").strip().lower())
      if host not in a.allowed_hosts:
        return _error(400, f"Host {host!r} is not one this server answers (--allowed_hosts)",
                      "invalid_request_error", "invalid_host")
    if self._keys and scope["path"] not in OPEN_PATHS:
      allowed, tenant = self._tenant(headers)
      if not allowed:
        return _error(401, "a valid API key is required: 'Authorization: Bearer <key>'",
                      "invalid_request_error", "invalid_api_key")
      scope[TENANT_SCOPE_KEY] = tenant
    if scope["method"] == "POST":
      kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
      if kind != b"application/json":
        return _error(415, f"the request body must be JSON (Content-Type: application/json), "
                           f"got {kind.decode('latin-1')[:60]!r}", "invalid_request_error",
                      "unsupported_media_type")
      length = headers.get(b"content-length")
      # Compared by digit count first: int() of a header longer than
      # Python's int-conversion limit raises (a 500, not this 413).
      digits = length.lstrip(b"0") if length is not None else b""
      if length is not None and (not length.isdigit() or len(digits) > 18
                                 or int(digits or b"0") > a.max_body_bytes):
        return self._too_large()
    return None

  def _too_large(self) -> Tuple:
    return _error(413, f"the request body is larger than {self.access.max_body_bytes} bytes "
                       f"(--max_body_bytes)", "invalid_request_error", "request_too_large")

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = dict(scope["headers"])
    refusal = self._refusal(scope, headers)
    if refusal is None and scope["method"] == "POST":
      body, refusal = await self._read(receive)
      if refusal is None:
        receive = _replay(body, receive)
    if refusal is not None:
      status, body = refusal
      await send({"type": "http.response.start", "status": status,
                  "headers": [(b"content-type", b"application/json"),
                              (b"content-length", str(len(body)).encode())]})
      await send({"type": "http.response.body", "body": body})
      return
    await self.app(scope, receive, send)

  async def _read(self, receive):
    """(the whole body, None), or (None, the 413) once it passes the cap."""
    chunks, size = [], 0
    while True:
      message = await receive()
      if message["type"] == "http.disconnect":
        return b"", None
      chunk = message.get("body", b"")
      size += len(chunk)
      if size > self.access.max_body_bytes:
        return None, self._too_large()
      chunks.append(chunk)
      if not message.get("more_body", False):
        return b"".join(chunks), None


def own_records(scope, records: Iterable[dict]) -> List[dict]:
  """The route records a ``GET /router`` caller may read (module docstring).

  Args:
    scope: the request's ASGI scope; ``Guard`` put the caller key's tenant
      in it (``TENANT_SCOPE_KEY``, None for a key without one) when the
      server has keys, and nothing when it has none.
    records: route records, each with a ``tenant`` (None: a request made
      without one).
  """
  if TENANT_SCOPE_KEY not in scope:              # no keys: every record
    return list(records)
  tenant = scope[TENANT_SCOPE_KEY]
  return [r for r in records if r.get("tenant") == tenant]


def _replay(body: bytes, receive):
  """A ``receive`` that gives ``body`` once, then the real channel (so a
  route still hears the client's disconnect)."""
  sent = False

  async def replay():
    nonlocal sent
    if not sent:
      sent = True
      return {"type": "http.request", "body": body, "more_body": False}
    return await receive()

  return replay


def access_from(api_keys: Dict[str, Optional[str]], host: str,
                allowed_hosts: Optional[Sequence[str]], max_body_bytes: int) -> Access:
  """The launcher's ``Access``: ``allowed_hosts`` as given (lower-cased), or,
  unset, ``loopback_hosts()`` when ``host`` is a loopback address (any
  Host otherwise)."""
  if allowed_hosts is None:
    hosts = loopback_hosts() if is_loopback(host) else None
  else:
    hosts = tuple(h.strip().lower() for h in allowed_hosts)
  return Access(api_keys=dict(api_keys), allowed_hosts=hosts, max_body_bytes=max_body_bytes)
