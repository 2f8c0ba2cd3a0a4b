"""A cluster in the simulator: N simulated replicas behind the router, one
virtual timeline.

The same ``serving.http.router.Router`` that ``serve.py --replicas`` runs behind
its HTTP front places each request; each replica is an ``Engine`` on the
simulated executor with its own ``VirtualClock`` (every step advances it by
the cost model's time). The replicas share one timeline by discrete events,
each at a virtual time (ms):

* an arrival at its trace time: the router queues it and places what it can;
* a step's start, for a replica that has work, at its clock (the end of its
  last step, or the time work reached it while idle): the engine steps and
  its clock moves to the step's end;
* that step's end: its first tokens and endings reach the router
  (``first_token``, ``finished``), which places waiting requests on freed
  places.

The earliest event runs first; at equal times an arrival goes before a
step's end, which goes before a step's start; replicas tie on their
index. A request placed on an idle replica advances that replica's clock to
the placement time; one placed on a busy replica waits for its next step
(its arrival stays its trace time).

Same inputs, same outputs: no wall clock is read, so a cluster replay is
bit-for-bit repeatable.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

from serving.engine.config import SamplingParams
from serving.engine.engine import Engine
from serving.engine.requests import QueueFull
from serving.harness.metrics import RequestRecord
from serving.harness.replay import _record, _refused
from serving.http import router as router_lib
from serving.http.router import Router
from serving.engine.sim_executor import VirtualClock
from serving.harness.workloads import Workload


def router_for(engines: Sequence[Engine], policy: str, cost=None) -> Router:
  """The router ``serve.py --replicas`` builds (``serving.http.router.router_for``)
  over these engines' configs."""
  return router_lib.router_for([dataclasses.asdict(e.config) for e in engines], policy, cost)


def replay_cluster(engines: Sequence[Engine], router: Router, workload: Workload
                   ) -> Tuple[List[RequestRecord], float, Dict[str, int], List[dict]]:
  """Replays ``workload`` over the replicas (see the module docstring).

  Args:
    engines: fresh engines on ``VirtualClock`` clocks at time 0, equal page
      sizes (one per replica).
    router: a fresh ``Router`` over them (``router_for``).
    workload: the requests, arrivals in s from the start.

  Returns:
    ``(records, duration_s, placement, route_log)``: one RequestRecord per
    request in workload order (times in s from the start); the time of the
    last event (s); request id -> replica; the router's decisions in order.

  Raises:
    ValueError: an engine without a virtual clock, or clocks not at 0.
  """
  for i, e in enumerate(engines):
    if not isinstance(e.clock, VirtualClock) or e.now_ms() != 0.0:
      raise ValueError(f"replay_cluster: engine {i} needs a fresh VirtualClock clock at 0")
  specs = sorted(workload.requests, key=lambda s: (s.arrival_s, s.request_id))
  by_id = {s.request_id: s for s in specs}
  placement: Dict[str, int] = {}
  refused: Dict[str, str] = {}
  route_log: List[dict] = []
  seen_first = set()

  def place(now_ms: float) -> None:
    for d in router.dispatch(now_ms):
      route_log.append({k: d[k] for k in ("request_id", "replica", "waited_ms", "tie_key")})
      spec, r = by_id[d["request_id"]], d["replica"]
      engine = engines[r]
      if not engine.has_unfinished() and engine.now_ms() < now_ms:
        engine.clock.advance((now_ms - engine.now_ms()) / 1000.0)
      placement[spec.request_id] = r
      engine.realized_output_tokens[spec.request_id] = spec.max_tokens
      try:
        engine.add_request(spec.request_id, spec.prompt_token_ids,
                           SamplingParams(max_tokens=spec.max_tokens,
                                          ignore_eos=spec.ignore_eos),
                           arrival_ms=spec.arrival_s * 1000.0, priority=spec.priority,
                           client=spec.client, slo_ttft_ms=spec.slo_ttft_ms,
                           slo_tpot_ms=spec.slo_tpot_ms)
      except (ValueError, QueueFull) as e:
        refused[spec.request_id] = str(e)
        router.finished(spec.request_id)

  # Events (time ms, rank, replica): 0 an arrival, 1 a step's end (its
  # outputs reach the router), 2 a step's start. A step runs the engine at
  # once (its clock moves to the step's end) and holds its outputs until
  # then, so the router never hears of an ending before its time.
  held: Dict[int, list] = {}
  i, end_ms = 0, 0.0
  while True:
    events = []
    if i < len(specs):
      events.append((specs[i].arrival_s * 1000.0, 0, -1))
    for r, e in enumerate(engines):
      if r in held:
        events.append((e.now_ms(), 1, r))
      elif e.has_unfinished():
        events.append((e.now_ms(), 2, r))
    if not events:
      if router.num_waiting():
        raise RuntimeError(f"replay_cluster: {router.num_waiting()} requests wait with "
                           f"every replica idle")
      break
    now, kind, r = min(events)
    end_ms = max(end_ms, now)
    if kind == 0:
      spec = specs[i]
      i += 1
      router.submit(spec.request_id, spec.prompt_token_ids, spec.max_tokens, now)
    elif kind == 2:
      held[r] = engines[r].step()
      continue
    else:
      for out in held.pop(r):
        rid = out.request_id
        if out.new_token_ids and rid not in seen_first:
          seen_first.add(rid)
          router.first_token(rid)
        if out.finished:
          router.finished(rid)
    place(now)
  records = [_refused(s, refused[s.request_id]) if s.request_id in refused
             else _record(engines[placement[s.request_id]], s, 0.0)
             for s in workload.requests]
  return records, end_ms / 1000.0, placement, route_log
