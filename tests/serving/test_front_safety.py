"""The router front under requests that try to break it: a ``max_tokens``
no float holds, a burst at its waiting bound, and a local replica whose
engine died (it answers 5xx). The replicas are in-process servers on the
tiny model; the front and they talk real HTTP on 127.0.0.1."""

import asyncio

import httpx

from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.http import router as router_module
from serving.http.protocol import TENANT_HEADER as TENANT
from serving.http.replicas import ReplicaFront
from serving.http.server import OpenAIServer
from tests.serving.engine_testing import CFG, HttpApp, tiny_tokenizer
from tests.serving.engine_testing import wait_until as _wait

HUGE = "1" + "0" * 400
LONG = "1" + "0" * 4999          # past Python's int-conversion limit (4300 digits)


def _front(urls, **kwargs):
  facts = [httpx.get(f"{u}/engine", timeout=10).json() for u in urls]
  return HttpApp(ReplicaFront(urls, facts, **kwargs).app)


def test_a_huge_max_tokens_is_refused_and_the_front_keeps_placing(served):
  front = _front([served.url])
  try:
    for field in ("max_tokens", "max_completion_tokens"):
      raw = ('{"model": "tiny", "prompt": "hi", "%s": %s}' % (field, HUGE)).encode()
      r = front.http.post("/v1/completions", content=raw,
                          headers={"content-type": "application/json"})
      assert r.status_code == 400, r.text
      assert r.json()["error"]["param"] == field
    for body, param in ((f'"prompt": "hi", "temperature": {LONG}', "temperature"),
                        (f'"prompt": "hi", "max_tokens": -{LONG}', "max_tokens"),
                        (f'"prompt": [[1], [2, {LONG}]]', "prompt[1]")):
      r = front.http.post("/v1/completions", content=('{"model": "tiny", %s}' % body).encode(),
                          headers={"content-type": "application/json"})
      assert r.status_code == 400, r.text
      assert r.json()["error"]["param"] == param, r.text
    big = front.http.post("/v1/completions", json={"model": "tiny", "prompt": ["hi"] * 73,
                                                   "max_tokens": 1})
    assert big.status_code == 400 and big.json()["error"]["param"] == "prompt"   # 8 + 64
    assert "at most 72" in big.json()["error"]["message"]
    for _ in range(3):
      ok = front.http.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                    "max_tokens": 2})
      assert ok.status_code == 200, ok.text
    report = front.http.get("/router").json()
    assert [r["outcome"] for r in report["requests"]] == ["refused"] * 4 + ["completed"] * 3
  finally:
    front.close()


def test_a_burst_past_the_waiting_bound_admits_exactly_the_bound(served, monkeypatch):
  """One replica of 8 + 8 places behind a front that lets 2 wait: of 30
  concurrent requests, those refused are 429 and every other completes;
  the front never holds more than 2 waiting."""
  front_app = _front([served.url], max_waiting=2)
  try:
    peak = [0]
    real = router_module.Router.submit

    def submit(self, *a, **k):
      real(self, *a, **k)
      peak[0] = max(peak[0], self.num_waiting())

    monkeypatch.setattr(router_module.Router, "submit", submit)

    async def burst():
      async with httpx.AsyncClient(base_url=front_app.url, timeout=120) as client:
        return await asyncio.gather(*[client.post("/v1/completions", json={
            "model": "tiny", "prompt": "the heart", "max_tokens": 6, "ignore_eos": True,
            "seed": i}) for i in range(30)])

    codes = [r.status_code for r in asyncio.run(burst())]
    assert set(codes) <= {200, 429} and codes.count(200) >= 8, codes
    assert peak[0] <= 2 + 1          # the bound, and the one being placed
  finally:
    front_app.close()


def test_a_local_replica_answering_5xx_leaves_rotation_until_healthy(params, served):
  """A replica process of the front's own whose engine died answers every
  request 500 and /health 503: the front takes it out of rotation (its
  request re-placed on the healthy one) and back once /health is 200."""
  dead = OpenAIServer(Engine(CFG, params, EngineConfig.preset("tiny")), tiny_tokenizer(),
                      "tiny")
  dead_app = HttpApp(dead.app, join_timeout_s=30)
  front = None
  try:
    front = _front([dead_app.url, served.url], policy="round_robin")
    dead.loop.__class__ = type("Dead", (dead.loop.__class__,),
                               {"alive": property(lambda self: False)})
    for i in range(4):
      r = front.http.post("/v1/completions", json={"model": "tiny", "prompt": f"hi {i}",
                                                   "max_tokens": 2})
      assert r.status_code == 200, r.text
      assert r.headers["x-iterserve-replica"] == "1"
    up = 'iterserve:router_replica_up{replica="0"} 0.0'
    assert front.http.get("/metrics").text.count(up) == 1
    dead.loop.__class__ = dead.loop.__class__.__mro__[1]       # healthy again
    _wait(lambda: 'iterserve:router_replica_up{replica="0"} 1.0' in
          front.http.get("/metrics").text, timeout_s=20)
  finally:
    if front is not None:
      front.close()
    dead_app.close()


def test_a_front_with_keys_forwards_the_tenant_and_models_its_salt(served, monkeypatch):
  """The front checks the key; the key's tenant reaches a replica that
  trusts the front's headers as the engine client, and the router's cache
  model keys the tenant's prompt apart from the same prompt unsalted."""
  from serving.http import guard
  access = guard.Access(api_keys={"key-a": "tenant-a", "key-p": None})
  facts = [httpx.get(f"{served.url}/engine", timeout=10).json()]
  front_obj = ReplicaFront([served.url], facts, access=access)
  front = HttpApp(front_obj.app)
  engine = served.server.engine
  clients = []
  real = engine.add_request
  monkeypatch.setattr(engine, "add_request",
                      lambda *a, **k: clients.append(k["client"]) or real(*a, **k))
  monkeypatch.setattr(served.server, "trust_front_headers", True)
  try:
    body = {"model": "tiny", "prompt": list(range(200, 221)), "max_tokens": 1, "user": "me"}
    assert front.http.post("/v1/completions", json=body).status_code == 401
    assert front.http.get("/health").status_code == 200
    r = front.http.post("/v1/completions", json=body,
                        headers={"authorization": "Bearer key-a", TENANT: "forged"})
    assert r.status_code == 200, r.text
    assert clients == ["tenant-a"]
    keys = {k for m in front_obj.router.replicas for k in m.keys}
    submitted = []
    real_submit = front_obj.router.submit
    monkeypatch.setattr(front_obj.router, "submit",
                        lambda *a, **k: submitted.append(a[-1]) or real_submit(*a, **k))
    r = front.http.post("/v1/completions", json=body, headers={"authorization": "Bearer key-a"})
    assert r.status_code == 200 and submitted == ["tenant:tenant-a|"]
    record = front.http.get("/router", headers={"authorization": "Bearer key-a"}).json()
    assert record["requests"][-1]["decisions"][0]["facts"][0]["cached_tokens"] == 20
    assert len(keys) == 5
    r = front.http.post("/v1/completions", json={**body, "cache_salt": "x"},
                        headers={"authorization": "Bearer key-a"})
    assert r.status_code == 200 and submitted[-1] == "tenant:tenant-a|x"
    record = front.http.get("/router", headers={"authorization": "Bearer key-a"}).json()
    assert record["requests"][-1]["decisions"][0]["facts"][0]["cached_tokens"] == 0
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # The key without a tenant: its salt cannot be a tenant's (guard.prefix_salt),
    # in the front's cache model as on the replicas.
    r = front.http.post("/v1/completions", json={**body, "cache_salt": "tenant:tenant-a|"},
                        headers={"authorization": "Bearer key-p"})
    assert r.status_code == 200 and submitted[-1] == "salt:tenant:tenant-a|"
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    record = front.http.get("/router", headers={"authorization": "Bearer key-p"}).json()
    assert record["requests"][-1]["decisions"][0]["facts"][0]["cached_tokens"] == 0
  finally:
    front.close()


def test_router_shows_a_caller_only_its_own_tenants_records(served):
  """Three keys (two tenants and one without): each caller's ``GET /router``
  lists exactly the records of its own requests, each naming its tenant;
  no key is refused. Without keys every record is listed (the
  huge-max_tokens test above)."""
  from serving.http import guard
  access = guard.Access(api_keys=guard.parse_api_keys("key-a:tenant-a,key-b:tenant-b,key-p"))
  front = _front([served.url], access=access)
  try:
    sent = {"key-a": 2, "key-b": 1, "key-p": 1}
    ids = {}
    for key, count in sent.items():
      for i in range(count):
        r = front.http.post("/v1/completions", headers={
            "authorization": f"Bearer {key}", "x-request-id": f"{key}-{i}"},
            json={"model": "tiny", "prompt": f"hi {i}", "max_tokens": 1})
        assert r.status_code == 200, r.text
        ids.setdefault(key, []).append(f"{key}-{i}")
    tenants = {"key-a": "tenant-a", "key-b": "tenant-b", "key-p": None}
    for key, tenant in tenants.items():
      report = front.http.get("/router", headers={"authorization": f"Bearer {key}"}).json()
      assert [q["client_request_id"] for q in report["requests"]] == ids[key]
      assert [q["tenant"] for q in report["requests"]] == [tenant] * sent[key]
      assert len(report["replicas"]) == 1                   # the replicas' stats stay
    assert front.http.get("/router").status_code == 401
  finally:
    front.close()
