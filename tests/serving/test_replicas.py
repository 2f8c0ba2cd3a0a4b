"""Data-parallel replicas behind the router front: two real replica server
processes (tests/serving/replica_testing.py, the tiny model), real HTTP, the
official ``openai`` client, a replica killed mid-run, a front over replicas
given by URL (``serve.py --replica_urls``) and ``bench_serving.py`` against a
front."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.http import replicas as replicas_module
from serving.http.replica_launch import parse_replica_urls, wait_ready
from serving.http.replicas import ReplicaFront, route_summary
from tests.serving.engine_testing import HttpApp, tiny_tokenizer
from tests.serving.engine_testing import free_port as _free_port, wait_until as _wait
from tests.serving.fault_testing import report
from tests.serving.replica_testing import spawn_replica

ROOT = Path(__file__).resolve().parents[2]
TOK = tiny_tokenizer()
STEP_DELAY_MS = 30          # >= 30 ms per step: a 50-token request runs >= 1.5 s


class _Front(HttpApp):
  def __init__(self, urls, facts, policy, log_path):
    self.front = ReplicaFront(urls, facts, policy=policy, route_log=str(log_path))
    super().__init__(self.front.app)


@pytest.fixture(scope="module")
def replicas():
  argv = [sys.executable, "-m", "tests.serving.replica_testing",
          f"--step_delay_ms={STEP_DELAY_MS}"]
  ports = [_free_port(), _free_port()]
  processes = [spawn_replica(argv, port, cwd=str(ROOT)) for port in ports]
  urls = [f"http://127.0.0.1:{port}" for port in ports]
  try:
    facts = wait_ready(urls, timeout_s=180)
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
  served = _Front(urls, facts, "prefix_aware", tmp_path / "routes.jsonl")
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
    # A batch goes whole to one replica: one choice per prompt, index in
    # prompt order, each the text the replica gives that prompt alone; the
    # client's x-request-id reaches the replica and comes back.
    for k, batch in enumerate((["the heart", "of it all"], [[40, 41, 42], [50, 51]])):
      one = dict(model="tiny", max_tokens=3, temperature=0, ignore_eos=True)
      got = served.http.post("/v1/completions", json={**one, "prompt": batch},
                             headers={"x-request-id": f"batch-{k}"})
      assert got.status_code == 200, got.text
      assert got.headers["x-request-id"] == f"batch-{k}"
      assert got.json()["id"] == f"cmpl-batch-{k}"
      assert [c["index"] for c in got.json()["choices"]] == [0, 1]
      for choice, prompt in zip(got.json()["choices"], batch):
        assert choice["text"] == _direct(urls[0], {**one, "prompt": prompt})["choices"][0]["text"]
      (record,) = [r for r in front.records if r["client_request_id"] == f"batch-{k}"]
      assert record["prompt_tokens"] == got.json()["usage"]["prompt_tokens"]
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


def test_a_connection_reset_while_opening_is_a_replica_not_answering(monkeypatch):
  """A replica killed as the front connects can make anyio raise
  AttributeError (its socket is gone before its peer name is read): the
  front's transport raises it as httpx.ConnectError, so the health probe
  says "not answering" instead of the request failing with HTTP 500; any
  other error still propagates."""
  import asyncio
  import types
  raised = {"error": AttributeError("'NoneType' object has no attribute 'getpeername'")}

  async def opening(self, request):
    raise raised["error"]

  monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", opening)

  async def probe():
    async with httpx.AsyncClient(transport=replicas_module._ReplicaTransport()) as http:
      front = types.SimpleNamespace(http=http, urls=["http://127.0.0.1:9"])
      return await ReplicaFront._probe(front, 0)

  assert asyncio.run(probe()) is False
  raised["error"] = ValueError("a bug of ours")
  with pytest.raises(ValueError, match="a bug of ours"):
    asyncio.run(probe())


def test_bench_serving_against_a_front_reports_only_its_own_requests(replicas, tmp_path):
  """Two requests before the run, three in it: the report's router section
  counts the three (placements, records and prefix-cache counters since the
  run began), not the earlier two."""
  urls, _, facts = replicas
  served = _Front(urls, facts, "round_robin", tmp_path / "routes.jsonl")
  try:
    for prompt in ("before one", "before two"):
      assert served.http.post("/v1/completions", json={
          "model": "tiny", "prompt": prompt, "max_tokens": 2}).status_code == 200
    before = served.http.get("/router").json()
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_serving.py"), f"--url={served.url}",
         "--num_requests=3", "--rate_scale=20", "--max_prompt_len=12",
         "--max_output_len=3", f"--out={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    router = json.loads(out.read_text())["router"]
    assert [r["placed"] for r in router["replicas"]] == [2, 1]     # round robin from 0
    assert len(router["requests"]) == 3
    assert "(2 placed), replica 1: " in proc.stdout and "(1 placed));" in proc.stdout
    after = served.http.get("/router").json()
    assert len(after["requests"]) == 5
    for r, then, now in zip(router["replicas"], before["replicas"], after["replicas"]):
      assert r["prefix_cache_queries"] == (now.get("prefix_cache_queries", 0)
                                           - then.get("prefix_cache_queries", 0))
  finally:
    served.close()


def test_route_summary_counts_a_run_from_its_before_report():
  """Hand-worked: a replica restarted between the reports (its counters went
  down) counts from zero; requests already in ``before`` are left out."""
  rec = lambda rid, replica: dict(request_id=rid, replica=replica, rerouted_from=[])
  stats = lambda i, q, h: dict(replica=i, alive=True, prefix_cache_queries=q,
                               prefix_cache_hits=h)
  before = dict(policy="round_robin", cost={}, replicas=[stats(0, 10, 4), stats(1, 8, 8)],
                requests=[rec("route-0", 0), rec("route-1", 1)])
  after = dict(before, replicas=[stats(0, 30, 14), stats(1, 6, 2)],
               requests=[rec("route-0", 0), rec("route-1", 1), rec("route-2", 1)])
  summary = replicas_module.route_summary(after, before)
  assert [(r["placed"], r["prefix_cache_queries"], r["prefix_cache_hits"])
          for r in summary["replicas"]] == [(0, 20, 10), (1, 6, 2)]
  assert summary["prefix_cache_hit_rate"] == pytest.approx(12 / 26)
  assert [q["request_id"] for q in summary["requests"]] == ["route-2"]
  assert [r["placed"] for r in replicas_module.route_summary(after)["replicas"]] == [1, 2]


def test_route_summary_tells_prefill_and_decode_engines_apart():
  """Hand-worked, a prefill/decode front's report (pool indices both 0):
  each engine is counted by its name, its placements (prefill-0: the two
  records' prefill, decode-0: the one handed off) and its own counters'
  increase since ``before``."""
  stats = lambda pool, q, h: dict(engine=f"{pool}-0", replica=0, pool=pool, alive=True,
                                  prefix_cache_queries=q, prefix_cache_hits=h)
  rec = lambda rid, decode: dict(request_id=rid, replica=0, engine="prefill-0",
                                 decode_replica=0 if decode else None,
                                 decode_engine="decode-0" if decode else None,
                                 rerouted_from=[])
  before = dict(policy="distserve", cost=None, replicas=[stats("prefill", 10, 4),
                                                         stats("decode", 0, 0)],
                requests=[rec("r0", True)])
  after = dict(before, replicas=[stats("prefill", 30, 8), stats("decode", 2, 0)],
               requests=[rec("r0", True), rec("r1", True), rec("r2", False)])
  summary = replicas_module.route_summary(after, before)
  assert [(r["engine"], r["placed"], r["prefix_cache_queries"], r["prefix_cache_hits"])
          for r in summary["replicas"]] == [("prefill-0", 2, 20, 4), ("decode-0", 1, 2, 0)]
  assert summary["prefix_cache_hit_rate"] == pytest.approx(4 / 22)


def test_a_replica_killed_mid_run_reroutes_or_fails_each_request(replicas, tmp_path):
  urls, processes, facts = replicas
  served = _Front(urls, facts, "round_robin", tmp_path / "routes.jsonl")
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
    report("replica-killed-mid-stream", sent=5, outcomes={
        "completed": sum(o == "completed" and not r for o, r in outcomes),
        "rerouted_completed": sum(o == "completed" and bool(r) for o, r in outcomes),
        "failed_mid_stream": sum(o == "failed" for o, _ in outcomes)},
           without_outcome=5 - len(records))
    assert outcomes == [("completed", ()), ("completed", ()), ("completed", ()),
                        ("completed", (1,)), ("failed", ())]
    assert front.router.alive() == [0]
  finally:
    served.close()


def _front_over(urls, tmp_path, *extra):
  """``scripts/serve.py --replica_urls`` on a free port (stderr in a file)."""
  port = _free_port()
  log = open(tmp_path / f"front-{port}.log", "w")
  process = subprocess.Popen(
      [sys.executable, str(ROOT / "scripts" / "serve.py"), f"--port={port}",
       f"--replica_urls={','.join(urls)}", *extra], cwd=ROOT, stdout=log,
      stderr=subprocess.STDOUT)
  return process, f"http://127.0.0.1:{port}"


def test_a_front_refuses_bad_or_unreachable_replica_urls(tmp_path):
  for text, message in (
      ("http://127.0.0.1:8001/v1", "'http://127.0.0.1:8001/v1' must be http://HOST:PORT"),
      ("127.0.0.1:8001", "'127.0.0.1:8001' must be http://HOST:PORT"),
      ("http://127.0.0.1:8001,", "must be comma-separated http://HOST:PORT URLs"),
      ("http://a:1,http://a:1/", "names a replica twice")):
    with pytest.raises(ValueError, match="--replica_urls") as e:
      parse_replica_urls(text)
    assert message in str(e.value)
  url = f"http://127.0.0.1:{_free_port()}"                # nothing listens there
  process, _ = _front_over([url], tmp_path, "--replica_ready_timeout_s=0.5")
  assert process.wait(timeout=60) == 1
  (log,) = tmp_path.glob("front-*.log")
  assert f"error: --replica_urls: replicas ['{url}'] not ready within 0.5 s" in log.read_text()


@pytest.mark.extended
def test_a_front_over_replica_urls_marks_one_down_and_takes_it_back(tmp_path):
  """Two replica servers started on their own, a front given their URLs:
  one is killed (requests go on on the other; /metrics shows it down),
  restarted on the same port, and rejoins (a request lands on it again)."""
  argv = [sys.executable, "-m", "tests.serving.replica_testing",
          f"--cache_dir={tmp_path / 'xla'}"]     # the restarted replica compiles nothing
  ports = [_free_port(), _free_port()]
  urls = [f"http://127.0.0.1:{port}" for port in ports]
  processes = [spawn_replica(argv, port, cwd=str(ROOT)) for port in ports]
  front = None
  try:
    wait_ready(urls, timeout_s=180)
    front, front_url = _front_over(urls, tmp_path, "--router=round_robin",
                                   f"--route_log={tmp_path / 'routes.jsonl'}")
    _wait(lambda: _answers(front_url), timeout_s=60)
    body = {"model": "tiny", "prompt": "the heart", "max_tokens": 3, "temperature": 0}
    post = lambda: httpx.post(f"{front_url}/v1/completions", json=body, timeout=60)
    assert sorted(post().headers["x-iterserve-replica"] for _ in range(2)) == ["0", "1"]
    processes[1].kill()
    processes[1].wait(timeout=30)
    up = ("iterserve:router_replica_up", (("replica", "1"),))
    _wait(lambda: _samples(httpx.get(f"{front_url}/metrics").text)[up] == 0, timeout_s=30)
    served = [post() for _ in range(3)]
    assert [(r.status_code, r.headers["x-iterserve-replica"]) for r in served] == [
        (200, "0")] * 3
    processes[1] = spawn_replica(argv, ports[1], cwd=str(ROOT))
    wait_ready(urls[1:], timeout_s=180)
    _wait(lambda: _samples(httpx.get(f"{front_url}/metrics").text)[up] == 1, timeout_s=30)
    assert sorted(post().headers["x-iterserve-replica"] for _ in range(2)) == ["0", "1"]
    logged = [json.loads(l) for l in (tmp_path / "routes.jsonl").read_text().splitlines()]
    assert [r["replica"] for r in logged] == [0, 1, 0, 0, 0, 1, 0]     # round robin
    assert all(r["outcome"] == "completed" for r in logged)
  finally:
    for process in [front, *processes]:
      if process is not None and process.poll() is None:
        process.kill()
      if process is not None:
        process.wait(timeout=30)


def _answers(url):
  try:
    return httpx.get(f"{url}/health", timeout=2).status_code == 200
  except httpx.HTTPError:
    return False
