"""Routing decisions on hand-worked facts (serving/http/router.py).

Cost model in every case: 1 ms per uncached prompt token, 0.5 ms per decode
token per live sequence on the replica, aging 1 ms per ms waited; page size 4.
"""

import pytest

from serving.http.router import RouteCost, Router

COST = RouteCost(prefill_ms_per_token=1.0, decode_ms_per_token_per_seq=0.5, aging=1.0)
SHARED = list(range(100, 116))                 # 16 tokens: four full pages


def _router(policy="prefix_aware", capacities=(4, 4), cache_pages=(100, 100), cost=COST):
  return Router(list(capacities), list(cache_pages), page_size=4, policy=policy, cost=cost)


def _place(router, rid, prompt, max_tokens=10, arrival_ms=0.0, now_ms=None):
  router.submit(rid, prompt, max_tokens, arrival_ms)
  (decision,) = router.dispatch(arrival_ms if now_ms is None else now_ms)
  assert decision["request_id"] == rid
  return decision


def test_shared_long_prefix_goes_to_the_replica_that_holds_it():
  router = _router()
  a = _place(router, "a", SHARED + [1, 2])
  # Equal facts (18 uncached tokens, empty replicas): the tie key picks 0.
  assert a["replica"] == 0 and a["tie_key"] == [18.0, 0, 0]
  router.first_token("a")
  b = _place(router, "b", SHARED + [7, 8, 9])
  f0, f1 = b["facts"]
  # Replica 0 holds the four shared pages: 3 uncached tokens, and "a" is live
  # there: load 0.5 ms x 1 live x 10 tokens.
  assert (f0["cached_tokens"], f0["uncached_tokens"]) == (16, 3)
  assert (f0["queue_ms"], f0["prefill_ms"], f0["load_ms"], f0["finish_ms"]) == (0, 3, 5, 8)
  assert (f1["cached_tokens"], f1["finish_ms"]) == (0, 19)
  assert b["replica"] == 0
  # round_robin places by turn, whatever the cache holds.
  rr = _router("round_robin")
  assert [_place(rr, r, SHARED + [i])["replica"] for i, r in enumerate("abc")] == [0, 1, 0]


def test_hit_is_capped_to_leave_one_prompt_token_and_queue_counts_prefill_ahead():
  router = _router(capacities=(4, 1))
  _place(router, "a", SHARED)                    # 16 tokens -> replica 0, still prefilling
  b = _place(router, "b", SHARED)                # the same 16 tokens again
  f0, f1 = b["facts"]
  # At most (16 - 1) // 4 = 3 pages hit; "a"'s 16 uncached tokens queue ahead.
  assert (f0["cached_tokens"], f0["uncached_tokens"], f0["queue_ms"]) == (12, 4, 16)
  assert f0["finish_ms"] == 16 + 4 + 0.5 * 1 * 10 == 25
  assert f1["finish_ms"] == 16 and b["replica"] == 1


def test_aging_eventually_sends_a_unique_prompt():
  def run(cost):
    """One replica, one place. "u" (40 unique tokens) waits from t=0; every
    10 ms the running request ends and a cache hit arrives (2 of 18 tokens
    uncached). Returns when "u" was placed (ms), or None by 200 ms."""
    router = _router(capacities=(1,), cache_pages=(100,), cost=cost)
    _place(router, "h0", SHARED + [0, 0])
    router.submit("u", list(range(300, 340)), 10, 0.0)
    running = "h0"
    for t in range(10, 201, 10):
      router.submit(f"h{t}", SHARED + [t, t], 10, t - 10)
      router.finished(running)
      (decision,) = router.dispatch(float(t))
      if decision["request_id"] == "u":
        return t, decision
      running = decision["request_id"]
    return None, None

  # At t: score(u) = 40 - t; a hit that arrived at t - 10 scores 2 - 10 = -8,
  # so u goes first once 40 - t < -8, i.e. at t = 50.
  t, decision = run(COST)
  assert t == 50
  assert (decision["waited_ms"], decision["score_ms"]) == (50.0, -10.0)
  # With (almost) no aging the hits always win: u starves over the horizon.
  assert run(RouteCost(aging=1e-9))[0] is None


def test_waiting_ties_break_on_arrival_then_request_id():
  router = _router(capacities=(1,), cache_pages=(0,))
  _place(router, "first", [5] * 8)
  for rid in ("y", "x"):                        # identical facts and arrival
    router.submit(rid, [9] * 8, 10, 1.0)
  router.finished("first")
  assert [d["request_id"] for d in router.dispatch(2.0)] == ["x"]
  router.finished("x")
  assert [d["request_id"] for d in router.dispatch(3.0)] == ["y"]


def test_full_replicas_hold_requests_and_a_dead_replica_gives_back_its_requests():
  router = _router(capacities=(1, 1))
  assert router.has_room()
  assert [_place(router, r, [i + 3] * 6)["replica"] for i, r in enumerate("ab")] == [0, 1]
  assert not router.has_room()          # a request submitted now would wait
  router.submit("c", [9] * 6, 10, 0.0)
  assert router.dispatch(1.0) == [] and router.num_waiting() == 1
  assert router.replica_down(1) == ["b"]
  assert router.dispatch(2.0) == []             # replica 0 still full
  router.finished("a")
  (c,) = router.dispatch(3.0)
  assert c["replica"] == 0 and c["facts"][1]["alive"] is False
  assert router.alive() == [0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy="fastest"), "policy must be one of"),
    (dict(capacities=(0, 4)), "capacities must be >= 1"),
    (dict(capacities=(4,)), "one entry per replica"),
])
def test_bad_router_arguments_name_the_field(kwargs, message):
  with pytest.raises(ValueError, match=message):
    _router(**kwargs)
  with pytest.raises(ValueError, match="RouteCost.aging must be > 0"):
    RouteCost(aging=0)
