"""Simulated replicas behind the router on one virtual timeline
(``serving.harness.cluster_sim``), on the tiny model's config (no weights)."""

import dataclasses

import numpy as np
import pytest

from serving.engine import cost_model as cost_lib
from serving.harness import synthetic
from serving.harness.cluster_sim import replay_cluster, router_for
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.harness.replay import replay
from serving.engine.sim_executor import VirtualClock
from tests.serving.engine_testing import CFG


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("cost") / "cost.json"
  cost_lib.CostModel.of(step=5.0, rows=0.5, attention_gflop=2000.0).save(path)
  return str(path)


def _engines(n, cost_file):
  cfg = EngineConfig.preset("tiny", executor="simulated", cost_model=cost_file)
  return [Engine(CFG, None, cfg, clock=VirtualClock()) for _ in range(n)]


def _workload(n=12, rate_scale=1.0, seed=3):
  return synthetic.synthetic_azure_conv(
      n, rate_scale=rate_scale, seed=seed, max_prompt_len=30, max_output_len=10,
      vocab_size=CFG.vocab_size, reserved_token_ids=frozenset({0, 1}))


def test_one_replica_replays_exactly_as_the_engine_alone(cost_file):
  """Below the router's capacity every request is placed on arrival, so one
  replica's timeline is the single engine's: the same tokens at the same
  times (to float rounding: the idle jumps are summed in another order)."""
  wl = _workload()
  alone, alone_s = replay(_engines(1, cost_file)[0], wl)
  engines = _engines(1, cost_file)
  records, duration_s, placement, _ = replay_cluster(engines, router_for(engines,
                                                                          "round_robin"), wl)
  assert set(placement.values()) == {0}
  for a, b in zip(records, alone):
    assert a.output_token_ids == b.output_token_ids
    np.testing.assert_allclose(a.token_times_s, b.token_times_s, rtol=1e-12, atol=1e-12)
  assert [r.outcome for r in records] == ["completed"] * len(wl)
  assert duration_s == pytest.approx(alone_s, abs=1e-9)


def test_round_robin_alternates_and_replays_repeat(cost_file):
  wl = _workload(n=10)
  runs = []
  for _ in range(2):
    engines = _engines(2, cost_file)
    records, duration_s, placement, log = replay_cluster(
        engines, router_for(engines, "round_robin"), wl)
    runs.append(([r.token_times_s for r in records], duration_s, placement))
  assert runs[0] == runs[1]
  _, _, placement = runs[0]
  order = sorted(wl.requests, key=lambda s: (s.arrival_s, s.request_id))
  assert [placement[s.request_id] for s in order] == [i % 2 for i in range(len(order))]


def test_more_replicas_shorten_a_backlog(cost_file):
  """An overloaded arrival burst: four replicas finish sooner and the median
  TTFT falls; every request completes on every cluster size."""
  wl = _workload(n=24, rate_scale=50.0, seed=5)
  results = {}
  for n in (1, 4):
    engines = _engines(n, cost_file)
    records, duration_s, placement, _ = replay_cluster(
        engines, router_for(engines, "prefix_aware"), wl)
    assert all(r.outcome == "completed" for r in records)
    assert len(set(placement.values())) == n
    results[n] = (duration_s, float(np.median([r.ttft_s for r in records])))
  assert results[4][0] < results[1][0] and results[4][1] < results[1][1]


def test_refuses_an_engine_on_the_wall_clock(cost_file, params):
  cfg = EngineConfig.preset("tiny")
  engines = [Engine(CFG, params, cfg)]
  with pytest.raises(ValueError, match="fresh VirtualClock"):
    replay_cluster(engines, router_for(engines, "round_robin"), _workload(n=2))


def test_the_front_and_cluster_sim_build_the_same_router(cost_file):
  """One definition: the HTTP front's router and the simulator's are the
  same class from the same factory (mixed and P/D)."""
  from serving.http import router as router_lib
  from serving.http.replicas import ReplicaFront
  from serving.harness import cluster_sim
  engines = _engines(2, cost_file)
  facts = [dict(dataclasses.asdict(e.config), model="tiny", vocab_size=CFG.vocab_size)
           for e in engines]
  front = ReplicaFront(["http://127.0.0.1:1", "http://127.0.0.1:2"], facts,
                       policy="round_robin")
  sim = router_for(engines, "round_robin")
  assert type(front.router) is type(sim) is router_lib.Router
  assert cluster_sim.router_lib is router_lib
  assert (front.router.policy, [r.capacity for r in front.router.replicas]) == (
      sim.policy, [r.capacity for r in sim.replicas])
  for name, cls in router_lib.PD_ROUTERS.items():
    pd = cluster_sim.pd_router_for(engines[:1], engines[1:], name)
    assert type(pd) is cls and type(router_lib.pd_router_for(
        [facts[0]], [facts[1]], name)) is cls
