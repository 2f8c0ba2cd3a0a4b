"""The OpenAI server under requests that try to break it or each other:
reused request ids, numbers too large for a float, a forged arrival
header, more distinct users than the engine's identity table, a recompute
preemption's own pages, a burst past the warmed-up slot table, and the
engine thread's death. Real HTTP on 127.0.0.1, the real engine on the tiny
model."""

import asyncio
import dataclasses
import json
import threading
import time

import httpx
import pytest

from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.http.protocol import ARRIVAL_HEADER, TENANT_HEADER
from serving.http.server import OpenAIServer
from tests.serving.engine_testing import CFG, HttpApp, tiny_tokenizer
from tests.serving.engine_testing import wait_until as _wait
from tests.serving.test_server import MODEL, _Served

TOK = tiny_tokenizer()
HUGE = "1" + "0" * 400            # an integer no float holds
LONG = "1" + "0" * 4999           # past Python's int-conversion limit (4300 digits)


def _slow(monkeypatch, engine, delay_s=0.02):
  step = engine.step

  def slow_step():
    time.sleep(delay_s)
    return step()

  monkeypatch.setattr(engine, "step", slow_step)


def test_a_reused_request_id_cancels_nobody(served, monkeypatch):
  """Two live requests with one ``x-request-id``: both complete, each
  echoes the id; the engine keys them apart."""
  _slow(monkeypatch, served.server.engine)
  body = {"model": MODEL, "prompt": "the end", "max_tokens": 2}
  long = {**body, "max_tokens": 30, "ignore_eos": True, "stream": True}
  with served.http.stream("POST", "/v1/completions", json=long,
                          headers={"x-request-id": "dup"}) as first:
    lines = first.iter_lines()
    assert next(lines).startswith("data: ")
    again = served.http.post("/v1/completions", json=body, headers={"x-request-id": "dup"})
    assert again.status_code == 200, again.text
    assert again.headers["x-request-id"] == "dup" and again.json()["id"] == "cmpl-dup"
    rest = [l[6:] for l in lines if l.startswith("data: ")]
  assert rest[-1] == "[DONE]"
  chunks = [json.loads(l) for l in rest[:-1]]
  assert not any("error" in c for c in chunks)
  assert sum(len(c["choices"]) for c in chunks) == 29      # 30 tokens less the first
  assert first.headers["x-request-id"] == "dup"
  monkeypatch.undo()
  _wait(served.pages_free)


NUMBERS = ["temperature", "top_p", "slo_ttft_ms", "slo_tbt_ms", "seed", "min_tokens",
           "max_tokens", "max_completion_tokens", "n", "best_of", "top_k", "priority",
           "logprobs"]


@pytest.mark.parametrize("field", NUMBERS)
@pytest.mark.parametrize("sign", ["", "-"])
@pytest.mark.parametrize("number", [HUGE, LONG], ids=["401", "5000"])
def test_a_huge_integer_is_400_naming_the_field(served, field, sign, number):
  raw = ('{"model": "%s", "prompt": "hi", "%s": %s%s}' % (MODEL, field, sign, number)).encode()
  r = served.http.post("/v1/completions", content=raw,
                       headers={"content-type": "application/json"})
  assert r.status_code == 400, r.text
  error = r.json()["error"]
  assert error["param"] == field, r.text
  if number is LONG:
    assert error["message"].startswith(f"'{field}' must be"), r.text
    assert "an integer of 5000 digits" in error["message"], r.text


@pytest.mark.parametrize("body, param", [
    ('"prompt": [1, %s]', "prompt"), ('"prompt": [[1], [2, %s]]', "prompt[1]"),
    ('"prompt": "hi", "stop_token_ids": [%s]', "stop_token_ids"),
    ('"prompt": "hi", "stream_options": {"include_usage": %s}, "stream": true',
     "include_usage")])
def test_an_integer_past_the_conversion_limit_inside_a_field_names_it(served, body, param):
  raw = ('{"model": "%s", %s}' % (MODEL, body % LONG)).encode()
  r = served.http.post("/v1/completions", content=raw,
                       headers={"content-type": "application/json"})
  assert r.status_code == 400, r.text
  assert r.json()["error"]["param"] == param, r.text
  assert "Exceeds the limit" not in r.text


def test_an_integer_past_the_conversion_limit_in_template_variables_names_it(served):
  raw = ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
         '"chat_template_kwargs": {"a": [1, {"b": %s}]}}' % (MODEL, LONG)).encode()
  r = served.http.post("/v1/chat/completions", content=raw,
                       headers={"content-type": "application/json"})
  assert r.status_code == 400, r.text
  assert r.json()["error"]["param"] == "chat_template_kwargs.a[1].b", r.text
  assert "got one of 5000" in r.json()["error"]["message"]


def test_the_arrival_header_is_ignored_unless_trusted_and_then_bounded(served, monkeypatch):
  ttft_sum = ("vllm:time_to_first_token_seconds_sum", ())
  body = {"model": MODEL, "prompt": "the end", "max_tokens": 2, "ignore_eos": True}
  before = served.metrics().get(ttft_sum, 0.0)
  for value in ("-inf", repr(time.monotonic() - 1000.0)):
    r = served.http.post("/v1/completions", json=body, headers={ARRIVAL_HEADER: value})
    assert r.status_code == 200, r.text
  assert served.metrics()[ttft_sum] - before < 100.0       # neither counted
  monkeypatch.setattr(served.server, "trust_front_headers", True)
  for value in ("-inf", "nan", "inf", repr(time.monotonic() - 1e6), "soon",
                repr(time.monotonic() + 60)):
    r = served.http.post("/v1/completions", json=body, headers={ARRIVAL_HEADER: value})
    assert r.status_code == 400, (value, r.text)
    assert r.json()["error"]["param"] == ARRIVAL_HEADER
  before = served.metrics()[ttft_sum]
  r = served.http.post("/v1/completions", json=body,
                       headers={ARRIVAL_HEADER: repr(time.monotonic() - 5.0)})
  assert r.status_code == 200
  assert served.metrics()[ttft_sum] - before >= 5.0
  # A front's tenant header is a tenant (guard.prefix_salt ends it at '|').
  for value in ("a|b", ""):
    r = served.http.post("/v1/completions", json=body, headers={TENANT_HEADER: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == TENANT_HEADER, r.text


@pytest.fixture(scope="module")
def preempting(params):
  """A server whose engine preempts (recompute) one running request every
  third decision; its identity table holds 4 clients (the tiny preset)."""
  s = _Served.__new__(_Served)
  s.server = OpenAIServer(Engine(CFG, params, EngineConfig.preset("tiny", force_preempt_every=3)),
                          TOK, MODEL, max_waiting=8)
  HttpApp.__init__(s, s.server.app, join_timeout_s=30)
  yield s
  s.close()


async def _gather(url, bodies):
  async with httpx.AsyncClient(base_url=url, timeout=120) as client:
    return await asyncio.gather(*[client.post("/v1/completions", json=b) for b in bodies])


def test_more_distinct_users_than_the_identity_table_all_complete(preempting, monkeypatch):
  """8 running users, 4 identity places: the users past the table share
  the overflow bucket; none is refused."""
  assert preempting.server.engine.config.num_clients == 4
  _slow(monkeypatch, preempting.server.engine, 0.01)
  bodies = [{"model": MODEL, "prompt": f"the {'ab' * (i + 1)}", "max_tokens": 6,
             "ignore_eos": True, "user": f"end-user-{i}"} for i in range(8)]
  results = asyncio.run(_gather(preempting.url, bodies))
  assert [r.status_code for r in results] == [200] * 8, [r.text for r in results]
  assert all(r.json()["usage"]["completion_tokens"] == 6 for r in results)
  monkeypatch.undo()
  _wait(preempting.pages_free)


def test_cached_tokens_never_count_a_preempted_requests_own_pages(preempting):
  """Unique prompts of 5 pages, preempted (recompute) and resumed from
  their own cached pages: none took a page from another request."""
  engine = preempting.server.engine
  before = engine.num_preemptions
  bodies = [{"model": MODEL, "prompt": list(range(10 + 40 * i, 30 + 40 * i)),
             "max_tokens": 12, "ignore_eos": True} for i in range(4)]
  results = asyncio.run(_gather(preempting.url, bodies))
  assert [r.status_code for r in results] == [200] * 4
  assert engine.num_preemptions > before
  assert [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results] == [0] * 4
  _wait(preempting.pages_free)


def test_a_burst_to_the_live_bound_compiles_nothing_after_warmup(params):
  """Warmed up to the server's capacity (serve.py), the engine has every
  slot-table size the live bound (8 slots + 8 waiting) can grow it to: a
  burst of that many requests grows the table and compiles nothing more
  (no stream stalls on a compile)."""
  from serving.cli import launch
  from serving.engine import programs as programs_lib
  config = EngineConfig.preset("tiny")
  s = _Served.__new__(_Served)
  s.server = OpenAIServer(Engine(CFG, params, config), TOK, MODEL, max_waiting=8)
  launch.warmup(s.server.engine, num_requests=s.server.capacity)
  engine = s.server.engine
  resize, sizes = engine._resize, []
  engine._resize = lambda size: (sizes.append(size), resize(size))
  traced = lambda: {size: dict(programs_lib.programs(
      CFG, dataclasses.replace(config, max_request_slots=size)).cache_sizes())
                    for size in (8, 16, 32)}
  HttpApp.__init__(s, s.server.app, join_timeout_s=30)
  try:
    before = traced()
    bodies = [{"model": MODEL, "prompt": f"burst {i}", "max_tokens": 2, "ignore_eos": True}
              for i in range(s.server.capacity)]
    results = asyncio.run(_gather(s.url, bodies))
    assert [r.status_code for r in results] == [200] * len(bodies)
    assert max(sizes) == 16, sizes                             # it grew
    assert traced() == before
  finally:
    s.close()


# The injected fault is raised on the engine thread on purpose.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_fails_every_request_and_stops_the_server(params, monkeypatch):
  """The step raises while a stream and a whole request run and a third
  waits in the command queue: each ends with an error (no request left
  without an outcome) and the server stops (its launcher then exits
  non-zero)."""
  s = _Served.__new__(_Served)
  s.server = OpenAIServer(Engine(CFG, params, EngineConfig.preset("tiny", force_preempt_every=3)),
                          TOK, MODEL, max_waiting=8)
  HttpApp.__init__(s, s.server.app, join_timeout_s=30)
  s.server.stop_with(s.uvicorn)
  engine = s.server.engine
  step = engine.step
  gate, entered, armed = threading.Event(), threading.Event(), threading.Event()

  def failing_step():
    if armed.is_set():
      entered.set()
      gate.wait(30)
      raise RuntimeError("injected device fault")
    return step()

  monkeypatch.setattr(engine, "step", failing_step)
  results = {}
  body = {"model": MODEL, "prompt": "the end", "max_tokens": 20, "ignore_eos": True}

  def stream():
    with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
      results["stream"] = [l[6:] for l in r.iter_lines() if l.startswith("data: ")]

  def whole(name):
    results[name] = httpx.post(s.url + "/v1/completions", json=body, timeout=60)

  try:
    threads = [threading.Thread(target=stream), threading.Thread(target=whole, args=("a",))]
    for t in threads:
      t.start()
    _wait(lambda: len(s.server.loop._live) == 2)
    armed.set()
    assert entered.wait(30)
    threads.append(threading.Thread(target=whole, args=("queued",)))
    threads[-1].start()
    _wait(lambda: s.server.loop._commands.qsize() == 1)
    gate.set()
    for t in threads:
      t.join(timeout=60)
      assert not t.is_alive(), "a request got no outcome"
    assert results["stream"][-1] == "[DONE]"
    assert "injected device fault" in json.loads(results["stream"][-2])["error"]["message"]
    for name in ("a", "queued"):
      assert results[name].status_code == 500, results[name].text
      assert "engine" in results[name].json()["error"]["message"]
    s.thread.join(timeout=30)
    assert not s.thread.is_alive(), "the server kept running"
    assert isinstance(s.server.loop.error, RuntimeError)
  finally:
    gate.set()
    s.close()
