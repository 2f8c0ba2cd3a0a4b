"""Faults and load against the server, each case reporting its figures:
requests sent, outcomes by kind (client side and as the server counted
them), requests left without an outcome (must be 0) and KV pages back
after the drain (must be all). Bounded loops, 127.0.0.1 only.

By default a short soak (tiny-model traffic with random hang-ups at every
stage) and a client that never reads its stream; under ``-m extended``:
a long soak, SIGTERM with requests in flight, an engine exception
injected mid-step in a server process, and a replica killed mid-stream
behind the front (``test_replicas``). ``-s`` shows each case's
``fault-figures`` line (docs/benchmarks.md quotes one run).
"""

import asyncio
import collections
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.kv import pages as kv_pages
from serving.http.server import OpenAIServer
from tests.serving.engine_testing import CFG, HttpApp, free_port, tiny_tokenizer
from tests.serving.engine_testing import wait_until as _wait
from tests.serving.fault_testing import report

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
STAGES = ("none", "before_headers", "after_first_chunk", "mid_stream", "whole_timeout")


def _server_outcomes(url) -> dict:
  """{outcome or refused:reason: count} as the server's /metrics counts them."""
  out = collections.Counter()
  for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
    for s in family.samples:
      if s.name == "iterserve:requests_total":
        out[s.labels["outcome"]] += s.value
      elif s.name == "iterserve:requests_refused_total":
        out["refused:" + s.labels["reason"]] += s.value
  return {k: int(v) for k, v in out.items()}


def _pages_back(engine) -> tuple:
  """(pages free or evictable, usable pages): all back when equal."""
  free, evictable, _ = (int(n) for n in kv_pages.page_census(engine.pages))
  return free + evictable, engine.config.num_pages - 1


async def _one(client, rng, i) -> str:
  """One request with a random hang-up stage; returns its client outcome."""
  stage = STAGES[rng.randrange(len(STAGES))]
  stream = stage != "whole_timeout" and rng.random() < 0.7
  body = {"model": MODEL, "prompt": f"the {'ab' * (1 + i % 7)}", "max_tokens": rng.randint(1, 24),
          "ignore_eos": True, "stream": stream, "seed": i}
  if rng.random() < 0.1:                             # bad input: must be a 400, never 500
    body["temperature"] = int("1" + "0" * 400)
  try:
    if stage == "before_headers":
      task = asyncio.ensure_future(client.post("/v1/completions", json=body))
      await asyncio.sleep(rng.random() * 0.05)
      task.cancel()
      try:
        await task
      except asyncio.CancelledError:
        return "hung_up"
      return _kind(task.result())
    if not stream:
      timeout = rng.random() * 0.2 if stage == "whole_timeout" else 120
      try:
        r = await client.post("/v1/completions", json=body, timeout=timeout)
      except httpx.TimeoutException:
        return "hung_up"
      return _kind(r)
    async with client.stream("POST", "/v1/completions", json=body) as r:
      if r.status_code != 200:
        await r.aread()
        return _kind(r)
      seen, last = 0, None
      async for line in r.aiter_lines():
        if not line.startswith("data: "):
          continue
        seen += 1
        last = line
        if stage == "after_first_chunk" or (stage == "mid_stream" and seen == 3):
          return "hung_up"
      if last == "data: [DONE]":
        return "completed"
      return "stream_cut"
  except httpx.HTTPError as e:
    return f"transport:{type(e).__name__}"


def _kind(r: httpx.Response) -> str:
  if r.status_code == 200:
    return "completed"
  return f"http_{r.status_code}"


def _soak(served, num_requests: int, concurrency: int, seed: int) -> dict:
  rng = random.Random(seed)
  before = _server_outcomes(served.url)

  async def run():
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
      async def bounded(i):
        async with limit:
          return await _one(client, rng, i)
      return await asyncio.gather(*[bounded(i) for i in range(num_requests)])

  outcomes = collections.Counter(asyncio.run(run()))
  server = served.server
  _wait(lambda: server.metrics.live == 0 and not server.engine.requests, timeout_s=60)
  _wait(lambda: _pages_back(server.engine)[0] == _pages_back(server.engine)[1])
  after = _server_outcomes(served.url)
  counted = {k: after.get(k, 0) - before.get(k, 0) for k in after}
  free, usable = _pages_back(server.engine)
  figures = dict(sent=num_requests, client_outcomes=dict(sorted(outcomes.items())),
                 server_outcomes={k: v for k, v in sorted(counted.items()) if v},
                 without_outcome=server.metrics.live + len(server.engine.requests),
                 pages_back=f"{free}/{usable}")
  assert figures["without_outcome"] == 0 and free == usable
  assert not any(k.startswith(("http_5", "transport", "stream_cut")) for k in outcomes), outcomes
  assert counted.get("failed", 0) == 0
  # Every request the server accepted has exactly one outcome: what the
  # clients saw complete, the server counted completed (a hang-up after
  # the last token may still complete).
  assert counted.get("completed", 0) >= outcomes["completed"]
  return figures


@pytest.fixture(scope="module")
def soaked(params):
  s = HttpApp.__new__(HttpApp)
  s.server = OpenAIServer(Engine(CFG, params, EngineConfig.preset("tiny")), tiny_tokenizer(),
                          MODEL, max_waiting=8)
  HttpApp.__init__(s, s.server.app, join_timeout_s=30)
  yield s
  s.close()


def test_a_short_soak_with_hang_ups_at_every_stage(soaked):
  report("soak-short", **_soak(soaked, num_requests=60, concurrency=6, seed=0))


@pytest.mark.extended
def test_a_long_soak_with_hang_ups_at_every_stage(soaked):
  report("soak-long", **_soak(soaked, num_requests=2000, concurrency=12, seed=1))


def test_a_client_that_never_reads_its_stream_stalls_nobody(soaked):
  """A stream whose client reads nothing while other requests run: they
  all complete (the engine thread never waits on a client: each request's
  events queue on its handler, at most one per token); once it hangs up
  it ends (cancelled, or completed if its last token was out) and every
  page comes back."""
  server = soaked.server
  before = _server_outcomes(soaked.url)

  async def run():
    async with httpx.AsyncClient(base_url=soaked.url, timeout=120) as client:
      async with client.stream("POST", "/v1/completions", json={
          "model": MODEL, "prompt": "never read", "max_tokens": 48, "ignore_eos": True,
          "stream": True, "stream_options": {"include_usage": True,
                                             "continuous_usage_stats": True}}) as r:
        assert r.status_code == 200
        others = await asyncio.gather(*[client.post("/v1/completions", json={
            "model": MODEL, "prompt": f"other {i}", "max_tokens": 4, "ignore_eos": True})
                                        for i in range(10)])
      return [o.status_code for o in others]

  codes = asyncio.run(run())
  _wait(lambda: server.metrics.live == 0 and not server.engine.requests, timeout_s=60)
  free, usable = _pages_back(server.engine)
  after = _server_outcomes(soaked.url)
  counted = {k: after.get(k, 0) - before.get(k, 0) for k in after}
  report("never-reading-stream", sent=11, others=dict(collections.Counter(codes)),
         server_outcomes={k: v for k, v in sorted(counted.items()) if v},
         without_outcome=server.metrics.live, pages_back=f"{free}/{usable}")
  assert codes == [200] * 10 and free == usable and server.metrics.live == 0
  assert counted.get("completed", 0) + counted.get("cancelled", 0) == 11


def _spawn(extra=()):
  port = free_port()
  process = subprocess.Popen(
      [sys.executable, "-m", "tests.serving.replica_testing", f"--port={port}", *extra],
      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  url = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 300
  while True:
    assert process.poll() is None, process.stderr.read().decode()[-2000:]
    assert time.monotonic() < deadline
    try:
      if httpx.get(url + "/health", timeout=2).status_code == 200:
        return process, url
    except httpx.TransportError:
      time.sleep(0.3)


async def _streams(url, n, max_tokens):
  """n streams to completion or cut; each ('done' | 'error' | 'cut', chunks)."""
  async def one(client, i):
    events = []
    try:
      async with client.stream("POST", "/v1/completions", json={
          "model": MODEL, "prompt": f"the {'ab' * (i + 1)}", "max_tokens": max_tokens,
          "ignore_eos": True, "stream": True}) as r:
        if r.status_code != 200:
          return f"http_{r.status_code}"
        async for line in r.aiter_lines():
          if line.startswith("data: "):
            events.append(line[6:])
    except httpx.HTTPError:
      return "cut"
    if events and events[-1] == "[DONE]":
      return "error_event" if "error" in json.loads(events[-2]) else "completed"
    return "cut"

  async with httpx.AsyncClient(base_url=url, timeout=120) as client:
    return await asyncio.gather(*[one(client, i) for i in range(n)])


@pytest.mark.extended
def test_sigterm_drains_requests_in_flight_then_exits():
  process, url = _spawn(["--step_delay_ms=20"])
  try:
    async def run():
      task = asyncio.ensure_future(_streams(url, 6, 40))
      await asyncio.sleep(1.0)                  # all 6 running
      process.send_signal(signal.SIGTERM)
      return await task

    outcomes = collections.Counter(asyncio.run(run()))
    status = process.wait(timeout=60)
    report("sigterm-drain", sent=6, client_outcomes=dict(outcomes),
           without_outcome=6 - sum(outcomes.values()), exit_status=status)
    # Drained, then uvicorn re-raises the signal: the status of a SIGTERM.
    assert outcomes == {"completed": 6} and status in (0, -signal.SIGTERM)
  finally:
    if process.poll() is None:
      process.kill()


@pytest.mark.extended
def test_an_engine_exception_mid_step_fails_every_request_and_exits_non_zero():
  process, url = _spawn(["--step_delay_ms=20", "--fail_at_step=15"])
  try:
    outcomes = collections.Counter(asyncio.run(_streams(url, 6, 40)))
    status = process.wait(timeout=60)
    report("engine-exception", sent=6, client_outcomes=dict(outcomes),
           without_outcome=6 - sum(outcomes.values()), exit_status=status)
    assert set(outcomes) <= {"error_event", "http_500", "http_503"} and status == 1
    assert sum(outcomes.values()) == 6
  finally:
    if process.poll() is None:
      process.kill()
