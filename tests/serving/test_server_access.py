"""Who may use the server and how much a request may ask, checked before
any work: API keys and their tenants (fairness identity, prefix-cache
salt), the Host allow-list, JSON-only bodies, the body-size and prompt
caps, the live bound on the tokenizer routes. Real HTTP on 127.0.0.1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.http import guard
from serving.http.server import OpenAIServer
from tests.serving.engine_testing import CFG, HttpApp, tiny_tokenizer

MODEL = "tiny"
KEYS = "key-a:tenant-a,key-b:tenant-b,key-plain"


@pytest.fixture(scope="module")
def guarded(params):
  access = guard.access_from(guard.parse_api_keys(KEYS), "127.0.0.1", None, 4096)
  server = OpenAIServer(Engine(CFG, params, EngineConfig.preset("tiny")), tiny_tokenizer(),
                        MODEL, max_waiting=8, access=access, max_prompt_chars=200)
  app = HttpApp(server.app, join_timeout_s=30)
  app.server = server
  yield app
  app.close()


def _auth(key):
  return {"authorization": f"Bearer {key}"}


def test_keys_guard_every_route_but_health_metrics_and_engine(guarded):
  for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                       ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                       ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
                       ("GET", "/v1/models/tiny")]:
    for headers in ({}, _auth("wrong"), {"authorization": "key-a"}):
      r = guarded.http.request(method, path, json={} if method == "POST" else None,
                               headers=headers)
      assert r.status_code == 401, (path, headers, r.text)
      assert r.json()["error"]["code"] == "invalid_api_key"
  for path in ("/health", "/metrics", "/engine"):
    assert guarded.http.get(path).status_code == 200, path
  client = openai.OpenAI(base_url=guarded.url + "/v1", api_key="key-plain", max_retries=0)
  assert [m.id for m in client.models.list().data] == [MODEL]
  got = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
  assert got.usage.completion_tokens == 2
  bad = openai.OpenAI(base_url=guarded.url + "/v1", api_key="key-c", max_retries=0)
  with pytest.raises(openai.AuthenticationError):
    bad.models.list()


def test_host_allow_list_json_only_and_body_cap(guarded):
  ok = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
  r = guarded.http.post("/v1/completions", json=ok, headers={**_auth("key-a"),
                                                             "host": "evil.example:80"})
  assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
  r = guarded.http.post("/v1/completions", json=ok, headers={**_auth("key-a"),
                                                             "host": "localhost"})
  assert r.status_code == 200, r.text
  r = guarded.http.post("/v1/completions", content=b'{"prompt": "hi"}',
                        headers={**_auth("key-a"), "content-type": "text/plain"})
  assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
  big = {"model": MODEL, "prompt": "x" * 5000}
  r = guarded.http.post("/v1/completions", json=big, headers=_auth("key-a"))
  assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]

  def chunks():                    # no Content-Length: the cap counts what streams in
    for _ in range(10):
      yield b" " * 1000

  r = guarded.http.post("/v1/completions", content=chunks(),
                        headers={**_auth("key-a"), "content-type": "application/json"})
  assert r.status_code == 413


def test_a_content_length_past_the_int_conversion_limit_is_413():
  """A Content-Length of 5000 digits (more than Python's int() converts) is
  too large, as any length past the cap: a 413, not a ValueError."""
  gate = guard.Guard(None, guard.access_from({}, "0.0.0.0", None, 4096))
  scope = {"method": "POST", "path": "/v1/completions"}
  for length, refused in ((b"4096", False), (b"0004096", False), (b"4097", True),
                          (b"9" * 5000, True), (b"0" * 5000 + b"1", False)):
    headers = {b"content-type": b"application/json", b"content-length": length}
    refusal = gate._refusal(scope, headers)
    assert (refusal is not None) == refused, length[:20]
    if refused:
      assert refusal[0] == 413


def test_prompt_caps_are_checked_before_tokenizing(guarded, monkeypatch):
  tok = guarded.server.tokenizer
  seen = []
  real = tok.encode
  monkeypatch.setattr(tok, "encode", lambda text, **k: seen.append(len(text)) or real(text, **k))
  for path, body, param in [
      ("/v1/completions", {"prompt": "ab" * 101}, "prompt"),
      ("/v1/completions", {"prompt": ["hi", "ab" * 101]}, "prompt[1]"),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 150},
                                             {"role": "user", "content": "b" * 51}]},
       "messages"),
      ("/tokenize", {"prompt": "ab" * 101}, "prompt"),
      ("/v1/completions", {"prompt": list(range(10, 80))}, "prompt"),
      ("/detokenize", {"tokens": list(range(10, 80))}, "tokens"),
  ]:
    r = guarded.http.post(path, json={"model": MODEL, **body}, headers=_auth("key-a"))
    assert r.status_code == 400, (path, r.text)
    assert r.json()["error"]["param"] == param, r.text
  assert all(n <= 200 for n in seen)          # no over-long prompt reached the tokenizer


def test_tenants_are_the_fairness_identity_and_isolate_the_prefix_cache(guarded, monkeypatch):
  engine = guarded.server.engine
  clients = []
  real = engine.add_request
  monkeypatch.setattr(engine, "add_request",
                      lambda *a, **k: clients.append(k["client"]) or real(*a, **k))
  prompt = list(range(100, 121))                    # 5 full pages of 4
  cached = lambda key, **extra: guarded.http.post("/v1/completions", headers=_auth(key), json={
      "model": MODEL, "prompt": prompt, "max_tokens": 1, "user": "self-declared",
      **extra}).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
  assert cached("key-a") == 0
  assert cached("key-b") == 0                        # another tenant: no hit
  assert cached("key-a") == 20                       # its own tenant: 5 pages
  assert cached("key-plain") == 0                    # no tenant: the unsalted chain
  assert cached("key-plain", cache_salt="s1") == 0   # cache_salt (vLLM's field)
  assert cached("key-plain", cache_salt="s2") == 0
  assert cached("key-plain", cache_salt="s1") == 20
  # A key without a tenant cannot forge a tenant's salt to reach its pages
  # (or learn from cached_tokens that the tenant sent this prefix).
  assert cached("key-plain", cache_salt="tenant:tenant-a|") == 0
  assert cached("key-plain", cache_salt="tenant:tenant-a|") == 20     # its own salt only
  assert clients == ["tenant-a", "tenant-b", "tenant-a"] + ["self-declared"] * 6
  r = guarded.http.post("/v1/completions", headers=_auth("key-a"), json={
      "model": MODEL, "prompt": "hi", "cache_salt": ""})
  assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_tokenizer_routes_count_against_the_live_bound(guarded):
  metrics = guarded.server.metrics
  metrics.admit(metrics.capacity)                    # the server is full
  try:
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
      r = guarded.http.post(path, json=body, headers=_auth("key-a"))
      assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
  finally:
    for _ in range(metrics.capacity):
      metrics.release()
  r = guarded.http.post("/tokenize", json={"prompt": "hi"}, headers=_auth("key-a"))
  assert r.status_code == 200 and r.json()["count"] >= 1


@pytest.mark.parametrize("text, message", [
    ("", "at least one"),
    ("a:", "entry 1 must be KEY or KEY:TENANT"),
    ("a b", "entry 1 must be KEY or KEY:TENANT"),
    ("a,a:t", "entry 2 repeats a key"),
    ("a:t,b:x|y", "entry 2's tenant must not hold '|'"),
])
def test_bad_key_lists_are_refused_naming_the_entry(text, message):
  with pytest.raises(ValueError, match=message):
    guard.parse_api_keys(text)
  assert guard.parse_api_keys("k1:t1,\nk2") == {"k1": "t1", "k2": None}
  with pytest.raises(ValueError, match="a tenant must be non-empty and hold no '|'"):
    guard.Access(api_keys={"k1": "a|b", "k2": "a"})       # built in code, not parsed


def test_own_records_keeps_the_callers_tenant_or_every_record_without_keys():
  """``guard.own_records``: a scope without the tenant key (a server without
  keys) keeps every record; with it, only the records of that tenant (None:
  the records of requests made without one)."""
  records = [dict(request_id="a", tenant="t1"), dict(request_id="b", tenant=None),
             dict(request_id="c", tenant="t2"), dict(request_id="d", tenant="t1")]
  rids = lambda scope: [r["request_id"] for r in guard.own_records(scope, records)]
  assert rids({"type": "http"}) == ["a", "b", "c", "d"]
  assert rids({guard.TENANT_SCOPE_KEY: "t1"}) == ["a", "d"]
  assert rids({guard.TENANT_SCOPE_KEY: None}) == ["b"]
  assert rids({guard.TENANT_SCOPE_KEY: "t3"}) == []


def _bench(url, tmp_path, *flags, env_key=None):
  """scripts/bench_serving.py against ``url``: 2 tiny requests; ``env_key``
  as OPENAI_API_KEY (None: unset). Returns (exit status, stderr, report)."""
  root = Path(__file__).resolve().parents[2]
  out = tmp_path / "bench.json"
  env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
  if env_key is not None:
    env["OPENAI_API_KEY"] = env_key
  proc = subprocess.run(
      [sys.executable, str(root / "scripts/bench_serving.py"), f"--url={url}/v1",
       "--num_requests=2", "--rate_scale=100", "--max_prompt_len=12", "--max_output_len=2",
       f"--out={out}", *flags], cwd=root, env=env, capture_output=True, text=True, timeout=300)
  report = json.loads(out.read_text()) if out.exists() else None
  if out.exists():
    out.unlink()
  return proc.returncode, proc.stderr, report


def test_bench_serving_sends_its_api_key_from_the_flag_or_openai_api_key(guarded, tmp_path):
  """``--api_key`` as a bearer token, else OPENAI_API_KEY (as ``vllm bench
  serve`` reads it; the flag wins); no key, or a refused one, is one error
  line before any request."""
  status, err, report = _bench(guarded.url, tmp_path, "--api_key=key-a")
  assert status == 0, err[-3000:]
  assert (report["completed"], report["failed"]) == (2, 0)
  status, err, report = _bench(guarded.url, tmp_path, env_key="key-plain")
  assert status == 0, err[-3000:]
  assert (report["completed"], report["failed"]) == (2, 0)
  for flags, env_key, given in (((), None, "none was given"),
                                (("--api_key=wrong",), "key-b", "the key given was refused"),
                                (("--api_key=",), "key-b", "none was given")):
    status, err, report = _bench(guarded.url, tmp_path, *flags, env_key=env_key)
    assert status == 2 and report is None, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"error: {guarded.url} needs an API key and {given}: --api_key=KEY or the "
        f"OPENAI_API_KEY environment variable")
