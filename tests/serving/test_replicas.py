"""Data-parallel replicas behind the router front: two real replica server
processes (tests/serving/replica_testing.py, the tiny model), real HTTP, the
official ``openai`` client, and a replica killed mid-run."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import replicas as replicas_module
from serving.replicas import ReplicaFront, route_summary, spawn_replica, wait_ready
from tests.serving.engine_testing import HttpApp, tiny_tokenizer
from tests.serving.engine_testing import free_port as _free_port, wait_until as _wait

ROOT = Path(__file__).resolve().parents[2]
TOK = tiny_tokenizer()
STEP_DELAY_MS = 30          # >= 30 ms per step: a 50-token request runs >= 1.5 s


class _Front(HttpApp):
  def __init__(self, urls, processes, facts, policy, log_path):
    self.front = ReplicaFront(urls, processes, facts, policy=policy, route_log=str(log_path))
    super().__init__(self.front.app)


@pytest.fixture(scope="module")
def replicas():
  argv = [sys.executable, "-m", "tests.serving.replica_testing",
          f"--step_delay_ms={STEP_DELAY_MS}"]
  ports = [_free_port(), _free_port()]
  processes = [spawn_replica(argv, port, cwd=str(ROOT)) for port in ports]
  urls = [f"http://127.0.0.1:{port}" for port in ports]
  try:
    facts = wait_ready(urls, processes, timeout_s=180)
    yield urls, processes, facts
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
      process.wait(timeout=30)


def _samples(text):
  """{(sample name, sorted labels): value} of a Prometheus text page."""
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for f in text_string_to_metric_families(text) for s in f.samples}


def _direct(url, body):
  """The same body sent to a replica itself (no front)."""
  return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()


def test_two_replicas_over_http_with_the_openai_client(replicas, tmp_path):
  urls, processes, facts = replicas
  # Processes not handed over: this front must not stop them when it closes.
  served = _Front(urls, [None, None], facts, "prefix_aware", tmp_path / "routes.jsonl")
  front = served.front
  try:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    (card,) = client.models.list().data
    assert card.id == "tiny" and card.created == front.created
    assert client.models.retrieve("tiny").model_dump() == card.model_dump()
    assert served.http.get("/v1/models/gpt-9").status_code == 404
    body = dict(model="tiny", prompt="the heart of it", max_tokens=7, temperature=0,
                extra_body={"ignore_eos": True})
    got = client.completions.create(**body)
    want = _direct(urls[1], {**{k: v for k, v in body.items() if k != "extra_body"},
                             "ignore_eos": True})
    assert got.choices[0].text == want["choices"][0]["text"]
    assert got.usage.completion_tokens == 7
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi there"}], max_tokens=5,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    # A long shared prefix follows the replica that holds it, whichever that is.
    shared = list(range(10, 42))                           # 32 tokens = 8 pages of 4
    first = served.http.post("/v1/completions", json={
        "model": "tiny", "prompt": shared + [5, 6], "max_tokens": 2, "ignore_eos": True})
    other = served.http.post("/v1/completions", json={
        "model": "tiny", "prompt": list(range(300, 334)), "max_tokens": 2})
    again = served.http.post("/v1/completions", json={
        "model": "tiny", "prompt": shared + [7, 8, 9], "max_tokens": 2, "ignore_eos": True})
    assert first.status_code == other.status_code == again.status_code == 200
    holder = int(first.headers["x-iterserve-replica"])
    assert int(again.headers["x-iterserve-replica"]) == holder
    report = served.http.get("/router").json()
    (record,) = [r for r in report["requests"] if r["prompt_tokens"] == 35]
    facts_then = record["decisions"][0]["facts"]
    assert facts_then[holder]["cached_tokens"] == 32
    assert facts_then[1 - holder]["cached_tokens"] == 0
    stats = report["replicas"][holder]
    assert stats["prefix_cache_hits"] >= 32               # the replica really hit
    assert all(r["outcome"] == "completed" for r in report["requests"])
    summary = route_summary(report)                        # the replay report's section
    assert sum(r["placed"] for r in summary["replicas"]) == len(report["requests"]) == 5
    hits = sum(r.get("prefix_cache_hits", 0) for r in report["replicas"])
    queries = sum(r.get("prefix_cache_queries", 0) for r in report["replicas"])
    assert summary["prefix_cache_hit_rate"] == pytest.approx(hits / queries)
    logged = [json.loads(l) for l in (tmp_path / "routes.jsonl").read_text().splitlines()]
    assert [r["request_id"] for r in logged] == [r["request_id"] for r in report["requests"]]
    # A client that hangs up before its whole response: cancelled at the
    # front and, through the closed upstream connection, on the replica.
    with pytest.raises(httpx.ReadTimeout):
      served.http.post("/v1/completions", timeout=0.5, json={
          "model": "tiny", "prompt": "the end", "max_tokens": 50, "ignore_eos": True})
    _wait(lambda: any(r["outcome"] == "cancelled" for r in front.records))
    (gone,) = [r for r in front.records if r["outcome"] == "cancelled"]
    sample = 'iterserve:requests_total{model_name="tiny",outcome="cancelled"} 1.0'
    _wait(lambda: sample in httpx.get(f"{urls[gone['replica']]}/metrics").text)
    assert front.router.replicas[gone["replica"]].live == {}
    assert served.http.get("/v1/completions").status_code == 405
    # The front's /metrics relays each replica's own series under its label.
    relayed = _samples(served.http.get("/metrics").text)
    for i, url in enumerate(urls):
      own = _samples(httpx.get(f"{url}/metrics").text)
      tokens = ("vllm:generation_tokens_total", (("model_name", "tiny"),))
      assert own[tokens] > 0
      assert relayed[(tokens[0], (("model_name", "tiny"), ("replica", str(i))))] == own[tokens]
      assert sum(1 for name, labels in relayed if ("replica", str(i)) in labels
                 and name.startswith("vllm:")) == sum(1 for n, _ in own if n.startswith("vllm:"))
    assert sum(v for (n, _), v in relayed.items() if n == "iterserve:router_requests_total") == 6
    bad = served.http.post("/v1/completions", json={"model": "tiny", "prompt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    lone = served.http.post(
        "/v1/chat/completions", headers={"content-type": "application/json"},
        content=b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}')
    assert lone.status_code == 400, lone.text
    assert lone.json()["error"]["param"] == "messages[0].content"
    assert "must be valid Unicode text without lone surrogates" in lone.text
    for method, path, status, message in (
        ("GET", "/nope", 404, "Not Found (GET /nope)"),
        ("GET", "/v1/completions", 405, "Method Not Allowed (GET /v1/completions)")):
      r = served.http.request(method, path)
      assert r.status_code == status
      assert r.json() == {"error": {"message": message, "type": "invalid_request_error",
                                    "param": None, "code": None}}
  finally:
    served.close()


def test_a_replica_error_reaches_the_client_in_the_openai_shape():
  """A plain-text 500 (an exception the replica did not map) is wrapped in
  an OpenAI error with its status; an OpenAI error body passes unchanged."""
  plain = replicas_module.relayed_error(1, 500, b"Internal Server Error")
  assert plain.status_code == 500
  assert json.loads(plain.body) == {"error": {
      "message": "replica 1 answered HTTP 500: 'Internal Server Error'",
      "type": "server_error", "param": None, "code": None}}
  body = (b'{"error": {"message": "m", "type": "invalid_request_error", "param": "prompt", '
          b'"code": null}}')
  same = replicas_module.relayed_error(0, 400, body, {"x-iterserve-replica": "0"})
  assert (same.status_code, same.body, same.headers["x-iterserve-replica"]) == (400, body, "0")


def test_a_replica_killed_mid_run_reroutes_or_fails_each_request(replicas, tmp_path):
  urls, processes, facts = replicas
  served = _Front(urls, processes, facts, "round_robin", tmp_path / "routes.jsonl")
  front = served.front
  body = lambda i, stream: {"model": "tiny", "prompt": f"the {'ab' * (i + 1)}",
                            "max_tokens": 50, "temperature": 0, "ignore_eos": True,
                            "stream": stream}
  results = {}

  def stream_one(name, i):
    with httpx.stream("POST", served.url + "/v1/completions", json=body(i, True),
                      timeout=60) as r:
      results[name] = {"replica": int(r.headers["x-iterserve-replica"]), "events": []}
      for line in r.iter_lines():
        if line.startswith("data: "):
          results[name]["events"].append(line[6:])

  def whole_one(name, i):
    r = httpx.post(served.url + "/v1/completions", json=body(i, False), timeout=60)
    results[name] = {"status": r.status_code, "json": r.json(), "headers": dict(r.headers)}

  try:
    # round_robin, placed one at a time: streams on 0 and 1, then whole
    # responses on 0 and 1.
    threads = []
    for name, fn, i, replica in (("s0", stream_one, 0, 0), ("s1", stream_one, 1, 1),
                                 ("w0", whole_one, 2, 0), ("w1", whole_one, 3, 1)):
      threads.append(threading.Thread(target=fn, args=(name, i)))
      threads[-1].start()
      want = 2 if name.startswith("w") else 1
      _wait(lambda: len(front.router.replicas[replica].live) == want)
    _wait(lambda: len(results.get("s1", {}).get("events", [])) >= 2)   # s1 has sent text
    processes[1].kill()
    for t in threads:
      t.join(timeout=60)
    # s1 had sent text: it fails, and says so, naming the replica.
    last = json.loads(results["s1"]["events"][-2])
    assert results["s1"]["events"][-1] == "[DONE]"
    assert last["error"]["code"] == "replica_failed" and "replica 1" in last["error"]["message"]
    # w1 had sent nothing: re-routed to replica 0, with the text replica 0 gives.
    w1 = results["w1"]
    assert w1["status"] == 200 and w1["headers"]["x-iterserve-rerouted-from"] == "1"
    assert w1["headers"]["x-iterserve-replica"] == "0"
    direct = _direct(urls[0], body(3, False))
    assert w1["json"]["choices"][0]["text"] == direct["choices"][0]["text"]
    assert w1["json"]["usage"]["completion_tokens"] == 50
    # Replica 0's requests never noticed; the front keeps serving on it.
    assert results["w0"]["status"] == 200 and results["s0"]["events"][-1] == "[DONE]"
    assert "error" not in json.loads(results["s0"]["events"][-2])
    assert served.http.get("/health").status_code == 200
    after = served.http.post("/v1/completions", json=body(4, False))
    assert after.status_code == 200 and after.headers["x-iterserve-replica"] == "0"
    # Nothing is lost: one record per request, each with its outcome.
    records = {r["request_id"]: r for r in served.http.get("/router").json()["requests"]}
    outcomes = sorted((r["outcome"], tuple(r["rerouted_from"])) for r in records.values())
    assert outcomes == [("completed", ()), ("completed", ()), ("completed", ()),
                        ("completed", (1,)), ("failed", ())]
    assert front.router.alive() == [0]
  finally:
    served.close()


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux >= 5.3")
def test_a_killed_replica_is_reaped_and_marked_down_at_once(monkeypatch, tmp_path):
  """No poll loop runs (_WATCH_S is a day), so only the exit watch can reap
  the SIGKILLed process and mark its replica down."""
  monkeypatch.setattr(replicas_module, "_WATCH_S", 86400.0)
  sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
  facts = dict(model="tiny", page_size=4, num_pages=64, max_request_slots=8,
               max_model_len=64, vocab_size=512, enable_prefix_caching=True)
  served = _Front([f"http://127.0.0.1:{_free_port()}"], [sleeper], [facts], "round_robin",
                  tmp_path / "routes.jsonl")
  try:
    assert served.front.router.alive() == [0]
    sleeper.kill()
    _wait(lambda: served.front.router.alive() == [], timeout_s=10)
    assert sleeper.returncode == -signal.SIGKILL           # reaped by the front
    assert not Path(f"/proc/{sleeper.pid}").exists()        # no zombie left
    (stats,) = served.http.get("/router").json()["replicas"]
    assert (stats["alive"], stats["exit_status"]) == (False, -signal.SIGKILL)
    assert served.http.get("/health").status_code == 503
  finally:
    served.close()
    if sleeper.poll() is None:
      sleeper.kill()
