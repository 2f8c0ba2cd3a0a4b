"""Simulated replicas behind the router on one virtual timeline
(``serving.harness.cluster_sim``), on the tiny model's config (no weights):
the step path, and the loop path (``Engine.simulate`` between the router's
events) against it."""

import dataclasses

import numpy as np
import pytest

from serving.engine import cost_model as cost_lib
from serving.harness import synthetic
from serving.harness import cluster_sim
from serving.harness.cluster_sim import replay_cluster, router_for
from serving.http.router import Router
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


# Token times of the two paths agree to this (ms): the loop runs the host's
# float64 clock arithmetic on the device, where XLA may round a step time's
# last bit otherwise (``serving.engine.sim_loop``; seen: <= 2e-13 ms here).
TIME_TOL_MS = 1e-9


def _engines(n, cost_file, **overrides):
  cfg = EngineConfig.preset("tiny", executor="simulated", cost_model=cost_file, **overrides)
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
  records, duration_s, placement, _, path = replay_cluster(
      engines, router_for(engines, "round_robin"), wl)
  assert path["path"] == "step" and "enable_prefix_caching" in path["why"]
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
    records, duration_s, placement, log, _ = replay_cluster(
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
    records, duration_s, placement, _, _ = replay_cluster(
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


def _both_paths(cost_file, n, wl, router=None, monkeypatch=None):
  """``replay_cluster`` on the step path and on the loop path, over ``n``
  tiny replicas the loop covers (prefix caching off; 16 KV pages; a forced
  preemption every 7th decision, which the loop hands to ``Engine.step``)
  behind ``router(engines)`` (default: ``prefix_aware``): ``{loop:
  (records, duration_s, placement, route_log, path, engines, steps)}``,
  ``steps`` the ``Engine.step`` calls (counted through ``monkeypatch``
  when given, else None)."""
  out = {}
  for loop in (False, True):
    engines = _engines(n, cost_file, enable_prefix_caching=False, num_pages=16,
                       force_preempt_every=7)
    made = router(engines) if router else router_for(engines, "prefix_aware")
    steps = None
    if monkeypatch is not None:
      steps, step = [0], Engine.step
      def counted(self, step=step, steps=steps):
        steps[0] += 1
        return step(self)
      monkeypatch.setattr(Engine, "step", counted)
    out[loop] = replay_cluster(engines, made, wl, loop=loop) + (engines, steps and steps[0])
    if monkeypatch is not None:
      monkeypatch.undo()
  return out


def _assert_same_outcomes(out, wl):
  """The loop path placed every request on the same replica by the same
  decision, and each replica ran the same iterations: the same tokens,
  outcomes, preemptions and iteration counts, times to a step time's last
  bit (``_both_paths``' ``out``)."""
  step, loop = out[False], out[True]
  assert [e.num_iterations for e in loop[5]] == [e.num_iterations for e in step[5]]
  assert [e.num_preemptions for e in loop[5]] == [e.num_preemptions for e in step[5]]
  assert min(e.num_preemptions for e in loop[5]) > 0
  assert loop[2] == step[2]
  key = lambda d: (d["request_id"], d["replica"], d["tie_key"])
  assert [key(d) for d in loop[3]] == [key(d) for d in step[3]]
  assert max(d["waited_ms"] for d in step[3]) > 0
  np.testing.assert_allclose([d["waited_ms"] for d in loop[3]],
                             [d["waited_ms"] for d in step[3]], rtol=0, atol=TIME_TOL_MS)
  assert loop[1] == pytest.approx(step[1], abs=TIME_TOL_MS / 1000.0)
  assert [r.request_id for r in loop[0]] == [s.request_id for s in wl.requests]
  for a, b in zip(step[0], loop[0]):
    assert (a.outcome, a.finish_reason, a.output_token_ids, a.num_preemptions) == (
        b.outcome, b.finish_reason, b.output_token_ids, b.num_preemptions), a.request_id
    assert a.outcome == "completed"
    np.testing.assert_allclose(b.token_times_s, a.token_times_s, rtol=0,
                               atol=TIME_TOL_MS / 1000.0)
    assert b.ttft_s == pytest.approx(a.ttft_s, abs=TIME_TOL_MS / 1000.0)
    assert (a.tpot_s is None) == (b.tpot_s is None)
    if a.tpot_s is not None:
      assert b.tpot_s == pytest.approx(a.tpot_s, abs=TIME_TOL_MS / 1000.0)


def test_mixed_replicas_take_the_loop_with_the_step_paths_outcomes(cost_file, monkeypatch):
  """A burst that queues at the router at times (2 x 8 places): the loop
  path gives the step path's outcomes, and runs each replica alone in
  program calls, between arrivals and, while requests wait, up to an
  ending; ``Engine.step`` runs only the iterations the loop hands to the
  host (here the forced preemptions), not one per event."""
  wl = _workload(n=24, rate_scale=30.0, seed=6)
  out = _both_paths(cost_file, 2, wl, monkeypatch=monkeypatch)
  step, loop = out[False], out[True]
  _assert_same_outcomes(out, wl)
  total = sum(e.num_iterations for e in loop[5])
  unused = {"calls": 0, "loop_iterations": 0, "host_iterations": 0, "loop_fraction": None,
            "exits": {}}
  assert step[4] == {"path": "step", "why": "loop=False was asked for",
                     "iterations_stepped": total, "runs": 0, "loop_runs": [unused] * 2}
  assert step[6] == total
  assert loop[4]["path"] == "loop" and loop[4]["why"] == ""
  assert loop[4]["iterations_stepped"] == 0
  # Engine.loop_runs: every iteration ran in the loop or was handed to the
  # host (the forced preemptions), and each loop call says why it returned.
  runs = loop[4]["loop_runs"]
  assert sum(r["loop_iterations"] + r["host_iterations"] for r in runs) == total
  assert 0 < sum(r["host_iterations"] for r in runs) <= loop[6]
  assert all(r["calls"] > 0 for r in runs)
  assert sum(r["exits"].get("HOST", 0) for r in runs) > 0
  assert set(step[2].values()) == {0, 1}
  # Each run stops at an arrival (per replica), an ending, or with nothing left.
  assert 0 < loop[6] < total / 3 and loop[4]["runs"] <= 3 * len(wl)


def test_an_overloaded_replica_takes_the_loop_while_requests_wait(cost_file, monkeypatch):
  """One replica (8 places) under a burst far above its rate: requests wait
  at the router most of the time, each placed at the end of the iteration
  that ends one before it. The loop path runs the replica up to each such
  ending (``until_end``) with the step path's outcomes, and most
  iterations in the loop program: ``Engine.step`` runs only those the loop
  hands to the host (the forced preemptions and their re-admissions, about
  a quarter here)."""
  wl = _workload(n=32, rate_scale=50.0, seed=5)
  out = _both_paths(cost_file, 1, wl, monkeypatch=monkeypatch)
  step, loop = out[False], out[True]
  _assert_same_outcomes(out, wl)
  total = loop[5][0].num_iterations
  assert step[6] == step[4]["iterations_stepped"] == total
  waited = sum(d["waited_ms"] > 0 for d in step[3])
  assert waited > len(wl) / 2
  assert loop[4]["iterations_stepped"] == 0
  assert loop[6] < total / 3
  # Each run stops at an arrival, an ending, or with nothing left.
  assert loop[4]["runs"] <= 2 * len(wl)


@pytest.mark.parametrize("at,replicas", [(0, 1), (3, 2)])
def test_a_request_that_never_fits_frees_its_place_on_both_paths(cost_file, at, replicas):
  """A prompt whose KV pages exceed the cache (60 + 4 - 1 rows: 16 pages of
  4, one more than the 15 there are) is ended at once by the engine
  (``rejected``): its router place frees at its placement, and the router
  places the next waiting request there at once (before, it waited for the
  next event; at first, with the replica idle), so the requests behind it
  run on the places there are (one per replica). Placed from the queue
  while requests wait (``at`` 3 of a burst over two replicas), the loop
  path, whose other replica ran ahead to its own ending, agrees."""
  wl = _workload(n=6, rate_scale=50.0, seed=2)
  order = sorted(wl.requests, key=lambda s: (s.arrival_s, s.request_id))
  long = dataclasses.replace(order[at], prompt_token_ids=[2] * 60, max_tokens=4)
  wl = dataclasses.replace(wl, requests=tuple(long if s is order[at] else s
                                              for s in wl.requests))
  places = lambda engines: Router([1] * replicas, [0] * replicas,
                                  engines[0].config.page_size, "round_robin")
  out = _both_paths(cost_file, replicas, wl, places)
  for records, _, _, log, *_ in out.values():
    assert [r.outcome for r in records] == [
        "rejected" if r.request_id == long.request_id else "completed" for r in records]
    arrival_ms = {s.request_id: s.arrival_s * 1000.0 for s in wl.requests}
    placed_ms = [arrival_ms[d["request_id"]] + d["waited_ms"] for d in log]
    k = [d["request_id"] for d in log].index(long.request_id)
    if at:        # placed from the queue; the next one took its place at once
      assert log[k]["waited_ms"] > 0 and log[k + 1]["waited_ms"] > 0
      assert placed_ms[k + 1] == pytest.approx(placed_ms[k], abs=1e-9)
      assert log[k + 1]["replica"] == log[k]["replica"]
  assert out[True][4]["path"] == "loop"
  key = lambda d: (d["request_id"], d["replica"], d["tie_key"])
  assert [key(d) for d in out[True][3]] == [key(d) for d in out[False][3]]
  np.testing.assert_allclose([d["waited_ms"] for d in out[True][3]],
                             [d["waited_ms"] for d in out[False][3]], rtol=0, atol=TIME_TOL_MS)
  for a, b in zip(out[False][0], out[True][0]):
    assert a.output_token_ids == b.output_token_ids
    np.testing.assert_allclose(b.token_times_s, a.token_times_s, rtol=0,
                               atol=TIME_TOL_MS / 1000.0)


def test_runs_record_their_path(cost_file):
  """``simulate_mixed`` records the path it took (``loop`` as given); the
  refusal that keeps the loop away is the path's ``why`` (prefix caching:
  ``test_one_replica_replays_exactly_as_the_engine_alone``). P/D pools
  always step and say why (the role)."""
  wl = _workload(n=3)
  cfg = EngineConfig.preset("tiny", executor="simulated", cost_model=cost_file,
                            enable_prefix_caching=False, num_pages=16, force_preempt_every=7)
  runs = [cluster_sim.simulate_mixed(CFG, cfg, wl, 2, "round_robin", "tiny", loop=loop)[0]
          for loop in (True, False)]
  assert runs[0]["path"]["path"] == "loop" and runs[0]["path"]["why"] == ""
  assert runs[0]["path"]["iterations_stepped"] == 0 and runs[0]["path"]["runs"] > 0
  assert runs[1]["path"]["path"] == "step"
  assert runs[0]["iterations"] == runs[1]["iterations"] == runs[1]["path"][
      "iterations_stepped"] > 0
  prefill = [Engine(CFG, None, dataclasses.replace(cfg, role="prefill"),
                    clock=VirtualClock())]
  path = cluster_sim.pd_path(prefill)
  assert path["path"] == "step"
  assert path["why"].startswith("P/D pools: EngineConfig.role must be 'mixed' for the loop")
