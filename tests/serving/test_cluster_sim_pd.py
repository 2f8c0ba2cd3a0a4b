"""Prefill and decode pools on one virtual timeline
(``serving.harness.cluster_sim.replay_pd``), on the tiny model's config (no
weights): every request ends, its tokens are those of one mixed engine, and
each transfer lasts latency + bytes / bandwidth."""

import dataclasses

import pytest

from serving.engine import cost_model as cost_lib
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.engine.profiles import Link
from serving.engine.sim_executor import VirtualClock
from serving.harness import cluster_sim, synthetic
from serving.harness.replay import replay
from serving.harness.workloads import RequestSpec, Workload
from tests.serving.engine_testing import CFG

LINK = Link(latency_ms=0.5, gbps=2.0)          # 2 GB/s = 2e6 bytes per ms


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("cost") / "cost.json"
  cost_lib.CostModel.of(step=5.0, rows=0.5, attention_gflop=2000.0).save(path)
  return str(path)


def _cfg(cost_file, role="mixed"):
  return EngineConfig.preset("tiny", executor="simulated", cost_model=cost_file, role=role)


def _pools(p, d, cost_file):
  return ([Engine(CFG, None, _cfg(cost_file, "prefill"), clock=VirtualClock())
           for _ in range(p)],
          [Engine(CFG, None, _cfg(cost_file, "decode"), clock=VirtualClock())
           for _ in range(d)])


def _workload(n=12, seed=3):
  return synthetic.synthetic_azure_conv(
      n, rate_scale=1.0, seed=seed, max_prompt_len=30, max_output_len=10,
      vocab_size=CFG.vocab_size, reserved_token_ids=frozenset({0, 1}))


def _run(p, d, policy, workload, cost_file):
  prefill, decode = _pools(p, d, cost_file)
  router = cluster_sim.pd_router_for(prefill, decode, policy)
  out = cluster_sim.replay_pd(prefill, decode, router, workload, LINK)
  return out, router, prefill, decode


@pytest.mark.parametrize("p,d,policy", [(1, 1, "distserve"), (1, 2, "round_robin"),
                                        (2, 1, "prefix_aware")])
def test_every_request_ends_with_the_tokens_of_one_mixed_engine(cost_file, p, d, policy):
  wl = _workload()
  (records, duration_s, placement, transfers), router, _, decode = _run(p, d, policy, wl,
                                                                        cost_file)
  mixed, _ = replay(Engine(CFG, None, _cfg(cost_file), clock=VirtualClock()), wl)
  by_id = {r.request_id: r for r in mixed}
  assert [r.request_id for r in records] == [s.request_id for s in wl.requests]
  for spec, rec in zip(wl.requests, records):
    assert rec.outcome == "completed", (rec.request_id, rec.finish_reason)
    assert rec.output_tokens == spec.max_tokens == by_id[spec.request_id].output_tokens
    assert rec.first_token_s >= rec.arrival_s and list(rec.token_times_s) == sorted(
        rec.token_times_s)
  # Every request with more than one token crossed once, and the router
  # logged a prefill choice, a decode choice and a completed end for it.
  crossed = [s.request_id for s in wl.requests if s.max_tokens > 1]
  assert sorted(t.request_id for t in transfers) == sorted(crossed)
  stages = [(q["request_id"], q["stage"]) for q in router.log]
  for rid in crossed:
    assert [s for r, s in stages if r == rid] == ["prefill", "decode", "end"]
  assert dict(router.outcomes) == {"completed": len(wl)}
  assert {placement[t.request_id][1] for t in transfers} == set(range(d))
  assert duration_s * 1000.0 >= max(t.end_ms for t in transfers)
  for e in decode:                              # every decode page back on its free stack
    assert not e.has_unfinished()


def test_a_transfer_lasts_latency_plus_bytes_over_bandwidth(cost_file):
  # One request, a 10-token prompt, 3 output tokens, at t = 0. The tiny
  # model's KV page: K and V x 2 layers x 4 rows x 2 KV heads x 16 dims x 4
  # bytes (float32) = 2,048 bytes; 10 rows take 3 pages = 6,144 bytes; over
  # the link: 0.5 ms + 6,144 / 2e6 ms = 0.503072 ms.
  spec = RequestSpec("r0", 0.0, tuple(range(3, 13)), 3)
  wl = Workload((spec,), "test", None, None, 1, 0, 0, 1.0, None, 0, None, None)
  (records, _, placement, transfers), _, prefill, decode = _run(1, 1, "distserve", wl,
                                                                 cost_file)
  (t,) = transfers
  assert (t.nbytes, t.src, t.dst, placement["r0"]) == (6144, 0, 0, (0, 0))
  assert t.end_ms - t.start_ms == pytest.approx(0.503072, abs=1e-9)
  first = prefill[0].requests["r0"]
  # The handoff leaves at the prefill step's end (its first token's time)
  # and arrives on the decode engine at the transfer's end.
  assert t.start_ms == first.token_times_ms[0]
  assert decode[0].requests["r0"].arrival_ms == t.end_ms
  (rec,) = records
  assert rec.output_tokens == 3 and rec.token_times_s[0] == first.token_times_ms[0] / 1000.0
  assert rec.token_times_s[1] * 1000.0 > t.end_ms


def test_same_inputs_same_outputs(cost_file):
  wl = _workload(n=10, seed=5)
  a = _run(2, 2, "distserve", wl, cost_file)
  b = _run(2, 2, "distserve", wl, cost_file)
  (ra, da, pa, ta), (rb, db, pb, tb) = a[0], b[0]
  assert [dataclasses.asdict(r) for r in ra] == [dataclasses.asdict(r) for r in rb]
  assert (da, pa, ta) == (db, pb, tb)
  assert list(a[1].log) == list(b[1].log)


def test_refuses_engines_of_the_wrong_role(cost_file):
  prefill, decode = _pools(1, 1, cost_file)
  router = cluster_sim.pd_router_for(prefill, decode, "distserve")
  with pytest.raises(ValueError, match="engine 0 must have role 'prefill', got 'decode'"):
    cluster_sim.replay_pd(decode, prefill, router, _workload(n=2), LINK)


def test_goodput_is_the_last_rate_before_the_first_failing_one():
  points = [(1.0, 0.99), (2.0, 0.90), (3.0, 0.85), (4.0, 0.95)]
  assert cluster_sim.goodput_bracket(points, 0.9) == dict(goodput=2.0, first_failing=3.0)
  assert cluster_sim.goodput_bracket(points[:2], 0.9) == dict(goodput=2.0, first_failing=None)
  assert cluster_sim.goodput_bracket([(1.0, 0.5)], 0.9) == dict(goodput=None,
                                                                first_failing=1.0)
