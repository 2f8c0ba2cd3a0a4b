"""Prefill/decode routing on hand-worked facts (serving/http/router.py).

Every case: page size 4; two prefill engines (4 places, 100 KV pages with
the null page's excluded, prefix caching on) and two decode engines (4
places, 10 pages).
"""

import pytest

from serving.http import router as router_lib
from serving.http.router import PD_ROUTERS, PDRouter, pd_router_for

SHARED = list(range(100, 116))                 # 16 tokens: four full pages
PREFILL = dict(max_request_slots=4, num_pages=101, page_size=4, enable_prefix_caching=True)
DECODE = dict(max_request_slots=4, num_pages=11, page_size=4, enable_prefix_caching=True)


def _router(policy, prefill=(PREFILL, PREFILL), decode=(DECODE, DECODE)):
  return pd_router_for(list(prefill), list(decode), policy)


def test_registry_names_and_unknown_name_refused_naming_the_flag():
  assert sorted(PD_ROUTERS) == ["distserve", "prefix_aware", "round_robin"]
  assert all(issubclass(cls, PDRouter) and cls.name == n for n, cls in PD_ROUTERS.items())
  with pytest.raises(ValueError, match=r"--router must be one of \['distserve', "
                     r"'prefix_aware', 'round_robin'\] for prefill/decode replicas, "
                     r"got 'fastest'"):
    _router("fastest")
  with pytest.raises(ValueError, match=r"--route must be one of"):
    pd_router_for([PREFILL], [DECODE], "fastest", flag="route")
  # distserve is a P/D router only: mixed replicas refuse it by name.
  with pytest.raises(ValueError, match=r"--router must be one of \['prefix_aware', "
                     r"'round_robin'\] for mixed replicas, got 'distserve'"):
    router_lib.check_router_name("distserve", pd=False)
  with pytest.raises(ValueError, match="needs >= 1 prefill and >= 1 decode"):
    pd_router_for([PREFILL], [], "distserve")
  with pytest.raises(ValueError, match="page_size must be one value"):
    pd_router_for([PREFILL], [dict(DECODE, page_size=8)], "distserve")


def test_distserve_prefill_by_queued_uncached_tokens_and_prefix_hits():
  r = _router("distserve")
  assert r.route_prefill("a", SHARED + [1, 2], 10, 0.0) == 0     # 18 tokens each; index tie
  assert r.last["tie_key"] == [18, 0, 0, 0]
  # "b" shares a's four pages: engine 0 would compute 3 tokens (16 cached)
  # behind a's 18 queued = 21; engine 1 computes all 19 with nothing queued = 19.
  assert r.route_prefill("b", SHARED + [7, 8, 9], 10, 1.0) == 1
  f0, f1 = r.last["facts"]
  assert (f0["cached_tokens"], f0["uncached_tokens"], f0["queued_tokens"]) == (16, 3, 18)
  assert (f1["cached_tokens"], f1["uncached_tokens"], f1["queued_tokens"]) == (0, 19, 0)
  assert r.last["tie_key"] == [19, 0, 0, 1]
  # prefix_aware takes the prefix hit whatever is queued there.
  pa = _router("prefix_aware")
  pa.route_prefill("a", SHARED + [1, 2], 10, 0.0)
  assert pa.route_prefill("b", SHARED + [7, 8, 9], 10, 1.0) == 0
  # a's prefill ends: engine 0 has 0 queued and 16 of c's 17 tokens cached
  # (1 + 0 = 1); engine 1 has them cached too but b's 19 queued (1 + 19).
  r.prefill_done("a", 2.0)
  assert r.route_prefill("c", SHARED + [5], 2, 3.0) == 0
  assert [f["queued_tokens"] + f["uncached_tokens"] for f in r.last["facts"]] == [1, 20]


def test_distserve_decode_by_free_pages_then_load():
  r = _router("distserve")
  # a: 18 + 10 tokens at its end = 7 pages; both engines free 10: index tie.
  assert r.route_decode("a", 18, 10, 0.0) == 0
  # b: ceil(29 / 4) = 8 pages: engine 0 has 3 free (no fit), engine 1 has 10.
  assert r.route_decode("b", 19, 10, 1.0) == 1
  f0, f1 = r.last["facts"]
  assert (f0["held_pages"], f0["free_pages"], f0["need_pages"], f0["fits"]) == (7, 3, 8, False)
  assert (f1["free_pages"], f1["fits"], r.last["tie_key"]) == (10, True, [0, 0, -10, 1])
  # c: 5 pages fit nowhere (3 and 2 free), one live each: the most free pages.
  assert r.route_decode("c", 17, 2, 2.0) == 0
  assert [f["free_pages"] for f in r.last["facts"]] == [3, 2]
  assert r.last["tie_key"] == [1, 1, -3, 0]
  # a ends: engine 0 frees its 7 pages; d (3 pages) fits on both, 1 live
  # each: the most free pages (10 - 5 = 5 on engine 0 against 2).
  r.finished("a", 3.0)
  assert r.route_decode("d", 8, 4, 4.0) == 0
  assert [f["free_pages"] for f in r.last["facts"]] == [5, 2]


def test_full_pools_hold_requests_and_every_decision_is_logged():
  one = dict(PREFILL, max_request_slots=1)
  r = _router("round_robin", prefill=(one,), decode=(dict(DECODE, max_request_slots=1),))
  assert r.route_prefill("a", [1, 2, 3], 4, 0.0) == 0
  assert r.route_prefill("b", [1, 2, 3], 4, 0.0) is None        # pool full: held by the caller
  assert r.route_decode("a", 3, 4, 5.0) == 0                    # leaves the prefill engine
  assert r.stage_of("a") == ("decode", 0) and r.has_room("prefill")
  assert r.route_prefill("b", [1, 2, 3], 4, 5.0) == 0
  r.prefill_done("b", 6.0)
  assert r.route_decode("b", 3, 4, 6.0) is None                 # decode pool full
  r.aborted("a", 7.0)
  assert r.route_decode("b", 3, 4, 7.0) == 0
  r.failed("b", 8.0, reason="checksum")
  stages = [(q["request_id"], q["stage"], q.get("outcome")) for q in r.log]
  assert stages == [("a", "prefill", None), ("a", "decode", None), ("b", "prefill", None),
                    ("a", "end", "aborted"), ("b", "decode", None), ("b", "end", "failed")]
  assert dict(r.outcomes) == {"aborted": 1, "failed": 1}
  assert r.stage_of("a") is None and r.stage_of("b") is None
  assert r.route_prefill("c", [1], 1, 0.0) == 0
  with pytest.raises(ValueError, match="already routed"):
    r.route_prefill("c", [1], 1, 0.0)
  with pytest.raises(ValueError, match="max_tokens must be an int"):
    r.route_prefill("d", [1], 0, 0.0)
  with pytest.raises(ValueError, match="tokens must be an int >= 1"):
    r.route_decode("e", 0, 1, 0.0)


def test_round_robin_takes_each_pool_in_turn():
  r = _router("round_robin")
  assert [r.route_prefill(x, SHARED, 4, 0.0) for x in "abc"] == [0, 1, 0]
  assert [r.route_decode(x, 16, 4, 1.0) for x in "abc"] == [0, 1, 0]


def test_register_pd_router():
  class Last(router_lib.RoundRobinPD):
    name = "test_last"

    def order_prefill(self, f):
      return (-f["engine"],)

  try:
    router_lib.register_pd_router(Last)
    assert pd_router_for([PREFILL] * 3, [DECODE], "test_last").route_prefill(
        "a", [1], 1, 0.0) == 2
    with pytest.raises(ValueError, match="already registered"):
      router_lib.register_pd_router(Last)
  finally:
    PD_ROUTERS.pop("test_last", None)
