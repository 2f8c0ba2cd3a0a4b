"""The Ray front's route records and ``GET /router`` engines
(``serving.http.ray_front.RayEngines``) over stand-in actors: no Ray runs
(``ray.get`` / ``ray.wait`` replaced), each actor answers what the test
queued. A prefill and a decode engine are both index 0 of their pools, so
every engine is named by role and index; a record keeps its tenant."""

import dataclasses
import time

from serving.engine.config import EngineConfig, SamplingParams
from serving.http import guard, ray_engines, ray_front
from serving.http.replicas import route_summary
from tests.serving.engine_testing import CFG, HttpApp, tiny_tokenizer


class _Ref:
  """A call's answer, computed when it is read (as a poll returns the news
  queued by then)."""

  def __init__(self, call):
    self.call = call


class _Method:
  """``remote`` runs the call at once (``lazy``: when its answer is read)."""

  def __init__(self, fn, lazy=False):
    self.fn, self.lazy = fn, lazy

  def remote(self, *args):
    if self.lazy:
      return _Ref(lambda: self.fn(*args))
    answer = self.fn(*args)
    return _Ref(lambda: answer)


class _Actor:
  """An engine actor's methods as the front calls them; ``news`` is what
  its next poll returns."""

  def __init__(self):
    self.news, self.calls = [], []
    self.poll = _Method(self._poll, lazy=True)
    self.submit = _Method(lambda specs: self.calls.append(("submit", specs)) or [None])
    self.add_handoff = _Method(lambda *a: self.calls.append(("add_handoff", a)))
    self.abort = self.finish = _Method(lambda *a: None)

  def _poll(self, timeout_s):
    del timeout_s
    updates, self.news = self.news, []
    stats = dict(running=0, suspended=0, waiting=0, free_pages=7, evictable_pages=0,
                 num_pages=8, prefix_cache_queries=0, prefix_cache_hits=0,
                 prefill_tokens_computed=0, num_preemptions=0)
    return dict(updates=updates, stats=stats)


class _Ray:
  @staticmethod
  def get(ref, timeout=None):
    del timeout
    return ref.call()

  @staticmethod
  def wait(refs, num_returns=1, timeout=None):
    del num_returns, timeout
    time.sleep(0.005)                 # the engine thread's loop: not a busy spin
    return list(refs), []


def _update(rid, tokens, finish_reason, **extra):
  return dict(request_id=rid, queued_ms=0.0, prefix_hit_tokens=0, prompt_logprobs=None,
              new_token_ids=tokens, new_logprobs=None, finished=True,
              finish_reason=finish_reason, outcome="completed", **extra)


def test_prefill_and_decode_engines_have_one_name_each_and_records_their_tenant(
    monkeypatch):
  monkeypatch.setattr(ray_front, "ray", _Ray)
  config = lambda role: dataclasses.replace(EngineConfig.preset("tiny"), role=role)
  actors = {"prefill": _Actor(), "decode": _Actor()}
  pools = [ray_engines.Pool(role, [actor], [dict(config=config(role), model_cfg=CFG)])
           for role, actor in actors.items()]
  engines = ray_front.RayEngines(*pools, policy="round_robin")
  sampling = SamplingParams(max_tokens=3, ignore_eos=True)
  engines.add_request("r0", [5, 6, 7, 8], sampling, tenant="tenant-a")
  engines.add_request("r1", [9, 10, 11], sampling)
  assert [c[0] for c in actors["prefill"].calls] == ["submit", "submit"]
  # r0 is handed off after its first token; r1 ends on the prefill engine.
  actors["prefill"].news = [_update("r0", [1], "handoff", handoff=["ticket"]),
                            _update("r1", [2], "stop")]
  engines.step()                                      # r0 placed on the decode engine
  assert [c[0] for c in actors["decode"].calls] == ["add_handoff"]
  engines.step()                                      # the decode engine took it
  actors["decode"].news = [_update("r0", [3, 4], "length")]
  engines.step()
  report = engines.report()
  assert [(e["engine"], e["pool"], e["replica"]) for e in report["replicas"]] == [
      ("prefill-0", "prefill", 0), ("decode-0", "decode", 0)]
  records = {q["request_id"]: q for q in report["requests"]}
  assert [records[r]["outcome"] for r in ("r0", "r1")] == ["completed", "completed"]
  r0, r1 = records["r0"], records["r1"]
  assert (r0["engine"], r0["replica"], r0["decode_engine"], r0["decode_replica"]) == (
      "prefill-0", 0, "decode-0", 0)
  assert [(d["pool"], d["engine"]) for d in r0["decisions"]] == [
      ("prefill", "prefill-0"), ("decode", "decode-0")]
  assert (r1["engine"], r1["decode_engine"]) == ("prefill-0", None)
  assert (r0["tenant"], r1["tenant"]) == ("tenant-a", None)
  summary = route_summary(report)
  assert [(r["engine"], r["placed"]) for r in summary["replicas"]] == [
      ("prefill-0", 2), ("decode-0", 1)]


def test_a_lost_engine_is_named_by_role_and_index(monkeypatch):
  monkeypatch.setattr(ray_front, "ray", _Ray)
  pool = ray_engines.Pool("mixed", [_Actor(), _Actor()],
                          [dict(config=EngineConfig.preset("tiny"), model_cfg=CFG)] * 2)
  engines = ray_front.RayEngines(pool, policy="round_robin")
  engines.add_request("r0", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
  engines.add_request("r1", [5, 6, 8], SamplingParams(max_tokens=3, ignore_eos=True))
  engines._lost(engines.entry, 1)
  assert engines.requests["r1"].finish_reason == (
      "engine mixed-1 died (its actor exited); the request failed")
  assert [q["engine"] for q in engines.records] == ["mixed-1"]


def test_router_gives_a_caller_its_own_tenants_records(monkeypatch):
  """The Ray front with keys: each request's record holds its key's tenant
  and a caller's ``GET /router`` lists only its tenant's (a key without a
  tenant: the requests made without one); every engine is listed."""
  monkeypatch.setattr(ray_front, "ray", _Ray)
  actor = _Actor()
  real = actor.submit.fn             # each request ends at once with two tokens

  def submit(specs):
    actor.news += [_update(s["request_id"], [7, 8], "length") for s in specs]
    return real(specs)

  actor.submit = _Method(submit)
  pool = ray_engines.Pool("mixed", [actor], [dict(config=EngineConfig.preset("tiny"),
                                                  model_cfg=CFG)])
  access = guard.Access(api_keys=guard.parse_api_keys("key-a:tenant-a,key-p"))
  front = ray_front.RayFront(ray_front.RayEngines(pool), tiny_tokenizer(), "tiny",
                             access=access)
  app = HttpApp(front.app, join_timeout_s=30)
  try:
    for key, rid in (("key-a", "a0"), ("key-p", "p0"), ("key-a", "a1")):
      r = app.http.post("/v1/completions", headers={
          "authorization": f"Bearer {key}", "x-request-id": rid},
          json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
      assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    for key, tenant, count in (("key-a", "tenant-a", 2), ("key-p", None, 1)):
      report = app.http.get("/router", headers={"authorization": f"Bearer {key}"}).json()
      assert [q["tenant"] for q in report["requests"]] == [tenant] * count
      assert [e["engine"] for e in report["replicas"]] == ["mixed-0"]
    assert app.http.get("/router").status_code == 401
  finally:
    app.close()
