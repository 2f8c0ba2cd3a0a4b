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
(its arrival stays its trace time). A request the engine ends at once
(refused, or rejected: it can never fit) frees its place at once, and the
router places the next waiting one there (as the HTTP front dispatches
after every ending).

Same inputs, same outputs: no wall clock is read, so a cluster replay is
bit-for-bit repeatable.

Two paths (``cluster_path``; runs record which ran and why): the step path
runs one ``engine.step()`` per step's start; the loop path, for replicas
``Engine.simulate`` covers (``Engine.loop_refusal``), runs each replica
alone, many iterations per program call, up to the next arrival and, while
a request waits at the router, up to its first ending (``replay_cluster``).
Both give the same placements, decisions, tokens,
outcomes and iteration counts, times to the last bit of a float64 step
time (``serving.engine.sim_loop``).

``replay_pd`` does the same for prefill/decode pools (below): a prefill
engine's finished prompt becomes a ``KVHandoff``, which the
``serving.http.router.PDRouter`` (the P/D front's router) sends to a decode
engine through a transfer event lasting the link's latency + bytes /
bandwidth. P/D pools always take the step path (``pd_path`` says why).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

from serving.engine import calibrations
from serving.engine import profiles
from serving.engine import sim_driver
from serving.engine.config import SamplingParams
from serving.engine.engine import Engine
from serving.engine.requests import QueueFull
from serving.harness import metrics
from serving.harness.metrics import RequestRecord
from serving.harness.replay import _record, _refused, run_config, run_outcomes
from serving.http import router as router_lib
from serving.http.router import Router
from serving.engine.sim_executor import VirtualClock
from serving.harness.workloads import Workload


def router_for(engines: Sequence[Engine], policy: str, cost=None) -> Router:
  """The router ``serve.py --replicas`` builds (``serving.http.router.router_for``)
  over these engines' configs."""
  return router_lib.router_for([dataclasses.asdict(e.config) for e in engines], policy, cost)


def _wake(engine: Engine, now_ms: float) -> None:
  """An idle engine that work reaches at ``now_ms`` has its clock moved
  there (a busy one takes the work at its next step)."""
  if not engine.has_unfinished() and engine.now_ms() < now_ms:
    engine.clock.advance((now_ms - engine.now_ms()) / 1000.0)


def _admit(engine: Engine, spec, now_ms: float) -> None:
  """Hands the workload's ``spec`` to ``engine`` at ``now_ms`` (``_wake``
  first), its output length fixed at ``max_tokens``.

  Raises:
    ValueError, QueueFull: the engine refused it.
  """
  _wake(engine, now_ms)
  engine.realized_output_tokens[spec.request_id] = spec.max_tokens
  engine.add_request(spec.request_id, spec.prompt_token_ids,
                     SamplingParams(max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos),
                     arrival_ms=spec.arrival_s * 1000.0, priority=spec.priority,
                     client=spec.client, slo_ttft_ms=spec.slo_ttft_ms,
                     slo_tpot_ms=spec.slo_tpot_ms)


def _events(specs, i: int, engines: Sequence[Engine], held: Dict[int, float],
            end_rank: int) -> list:
  """The events ``(time ms, rank, engine)`` both replays share: the arrival
  of ``specs[i]`` (rank 0, engine -1) while one is left; then for each
  engine a step's end (``end_rank``) at ``held[g]`` where it holds outputs
  not yet handed on, else a step's start (``end_rank + 1``) where it has
  work, at its clock."""
  events = [(specs[i].arrival_s * 1000.0, 0, -1)] if i < len(specs) else []
  for g, e in enumerate(engines):
    if g in held:
      events.append((held[g], end_rank, g))
    elif e.has_unfinished():
      events.append((e.now_ms(), end_rank + 1, g))
  return events


def cluster_path(engines: Sequence[Engine], *, loop: bool = True) -> Tuple[str, str]:
  """Which path ``replay_cluster`` takes over ``engines``, and why: ("loop",
  "") runs each replica many iterations per program call between the
  events the router acts on (``Engine.simulate``); ("step", reason) runs
  one ``engine.step()`` per event. Reports record it (``{"path": ...,
  "why": ...}``)."""
  if not loop:
    return "step", "loop=False was asked for"
  for r, e in enumerate(engines):
    refusal = e.loop_refusal()
    if refusal is not None:
      return "step", f"replica {r}: {refusal}"
  return "loop", ""


def _tell(router: Router, marks) -> None:
  """Hands the router a replica's first tokens and endings (``marks``:
  ``(ms, request_id, kind)``, ``Engine.simulate``'s)."""
  for _, rid, kind in marks:
    if kind == "first_token":
      router.first_token(rid)
    else:
      router.finished(rid)


def _by_step(marks) -> List[Tuple[float, list]]:
  """``marks`` grouped by the iteration that brought them: ``[(its end ms,
  its marks), ...]`` in time order."""
  groups: Dict[float, list] = {}
  for m in marks:
    groups.setdefault(m[0], []).append(m)
  return sorted(groups.items())


def replay_cluster(engines: Sequence[Engine], router: Router, workload: Workload, *,
                   loop: bool = True
                   ) -> Tuple[List[RequestRecord], float, Dict[str, int], List[dict], dict]:
  """Replays ``workload`` over the replicas (see the module docstring).

  The loop path (``cluster_path``) replaces each step's start by a run of
  its replica alone, many iterations per program call
  (``Engine.simulate``), up to the next arrival (the iterations that start
  before it) and, while a request waits at the router, up to the end of the
  first iteration that ends one of its requests (``until_end``). Nothing
  the other replicas do meanwhile can reach it: a request is placed only at
  an arrival, or at a step's end while requests wait, and then only on a
  replica with a free place; while one waits every replica is full
  (``place`` dispatches again after a placement the engine refuses at
  once), and a full replica's place frees only at its own ending. The
  run's first tokens and endings (``Engine.simulate``'s marks) are held
  and reach the router each at its iteration's end, in the step path's
  order of events, where waiting requests are placed as on the step path.
  Same records, placements, decisions, times and iterations as the step
  path (``tests/serving/test_cluster_sim.py``).

  Args:
    engines: fresh engines on ``VirtualClock`` clocks at time 0, equal page
      sizes (one per replica).
    router: a fresh ``Router`` over them (``router_for``).
    workload: the requests, arrivals in s from the start.
    loop: allow the loop path (False: one ``engine.step()`` per event).

  Returns:
    ``(records, duration_s, placement, route_log, path)``: one
    RequestRecord per request in workload order (times in s from the
    start); the time of the last event (s); request id -> replica; the
    router's decisions in order; ``{"path", "why"}`` (``cluster_path``) and
    ``iterations_stepped``, the iterations run one ``engine.step()`` per
    step's start (on the loop path: none), and ``runs``, the loop path's
    ``Engine.simulate`` calls (each one or more iterations; 0 on the step
    path).

  Raises:
    ValueError: an engine without a virtual clock, or clocks not at 0.
  """
  for i, e in enumerate(engines):
    if not isinstance(e.clock, VirtualClock) or e.now_ms() != 0.0:
      raise ValueError(f"replay_cluster: engine {i} needs a fresh VirtualClock clock at 0")
  path, why = cluster_path(engines, loop=loop)
  specs = sorted(workload.requests, key=lambda s: (s.arrival_s, s.request_id))
  by_id = {s.request_id: s for s in specs}
  placement: Dict[str, int] = {}
  refused: Dict[str, str] = {}
  route_log: List[dict] = []
  stepped = runs = 0

  def place(now_ms: float) -> None:
    # Until nothing is placed: a request the engine ends at once (refused,
    # or rejected: it never fits) frees its place for the next one now.
    while True:
      decisions = router.dispatch(now_ms)
      if not decisions:
        return
      for d in decisions:
        route_log.append({k: d[k] for k in ("request_id", "replica", "waited_ms", "tie_key")})
        spec, r = by_id[d["request_id"]], d["replica"]
        placement[spec.request_id] = r
        try:
          _admit(engines[r], spec, now_ms)
        except (ValueError, QueueFull) as e:
          refused[spec.request_id] = str(e)
          router.finished(spec.request_id)
        else:
          if engines[r].requests[spec.request_id].finished:   # rejected at once (never fits)
            router.finished(spec.request_id)

  # Events (time ms, rank, replica): 0 an arrival, 1 a step's end (its
  # outputs reach the router), 2 a step's start. A step (a run, on the loop
  # path) runs the engine at once and holds its news (marks) until each
  # iteration's end, so the router never hears of anything before its time.
  held: Dict[int, List[Tuple[float, list]]] = {}
  i, end_ms = 0, 0.0
  while True:
    events = _events(specs, i, engines, {g: h[0][0] for g, h in held.items()}, 1)
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
      marks: list = []
      e = engines[r]
      if path == "loop":
        stop = specs[i].arrival_s * 1000.0 if i < len(specs) else math.inf
        assert not (router.num_waiting() and router.has_room()), "place() left room"
        before = e.num_iterations
        e.simulate(stop, marks=marks, until_end=router.num_waiting() > 0)
        if e.num_iterations == before:
          raise RuntimeError(f"replay_cluster: replica {r} ran no iteration at {now} ms")
        steps = _by_step(marks)
        runs += 1
      else:
        sim_driver.step_marks(e, e.step(), marks)
        steps = [(e.now_ms(), marks)]
        stepped += 1
      if steps:
        held[r] = steps
      continue
    else:
      _tell(router, held[r].pop(0)[1])
      if not held[r]:
        del held[r]
    place(now)
  # The last event: a step's end is each replica's clock (the step path
  # met every one as an event).
  end_ms = max([end_ms] + [e.now_ms() for e in engines])
  records = [_refused(s, refused[s.request_id]) if s.request_id in refused
             else _record(engines[placement[s.request_id]], s, 0.0)
             for s in workload.requests]
  return (records, end_ms / 1000.0, placement, route_log,
          {"path": path, "why": why, "iterations_stepped": stepped, "runs": runs,
           "loop_runs": [e.loop_runs.summary() for e in engines]})


# ------------------------------------------------------ prefill/decode pools
#
# P/D on the same timeline: prefill engines (``EngineConfig.role ==
# "prefill"``) and decode engines (``"decode"``) behind a
# ``serving.http.router.PDRouter``. Events (time ms, rank, engine), the
# earliest first; at equal times, by rank:
#
# 0 an arrival: the request waits at the router (arrival order) and is
#   placed on a prefill engine when one has a place (``route_prefill``);
# 1 a transfer's end: the handoff reaches its decode engine
#   (``add_handoff(h, arrival_ms=end)``);
# 2 a step's end: its outputs reach the router; a prefill engine's handoffs
#   (``take_handoffs``, taken when its step ran, held until its end) wait
#   for a decode place (``route_decode``, in the order they came), and each
#   placed one starts a transfer lasting ``link.ms(handoff.nbytes)``
#   (latency + bytes / bandwidth, ``serving.engine.profiles.transfer_link``);
# 3 a step's start.
#
# Engines tie on their index (prefill engines first, then decode engines).
# Either pool's engine that is idle when work reaches it has its clock
# advanced to that time.


@dataclasses.dataclass
class Transfer:
  """One handoff's trip: from prefill engine ``src`` to decode engine
  ``dst``, ``nbytes`` bytes, from ``start_ms`` (its decode place chosen) to
  ``end_ms`` (``start_ms + link.ms(nbytes)``)."""

  request_id: str
  src: int
  dst: int
  nbytes: int
  start_ms: float
  end_ms: float


def pd_router_for(prefill: Sequence[Engine], decode: Sequence[Engine], policy: str,
                  flag: str = "router"):
  """The P/D router the P/D front builds (``serving.http.router.pd_router_for``)
  over these engines' configs."""
  return router_lib.pd_router_for([e.config for e in prefill], [e.config for e in decode],
                                  policy, flag=flag)


def _pd_record(spec, pre: Engine, dec: Engine) -> RequestRecord:
  """One request's record across its two engines: arrival and first token
  from the prefill engine, the following tokens (and the outcome) from the
  decode engine."""
  first = pre.requests[spec.request_id]
  req = dec.requests[spec.request_id]
  later = list(req.token_times_ms)
  if len(later) == len(req.output_token_ids):    # the decode side kept the first token's time
    later = later[1:]
  times = [t / 1000.0 for t in [first.token_times_ms[0]] + later]
  return RequestRecord(
      request_id=spec.request_id, client=spec.client, arrival_s=first.arrival_ms / 1000.0,
      first_token_s=times[0], token_times_s=times, prompt_tokens=len(spec.prompt_token_ids),
      output_tokens=len(times), outcome=req.outcome, finish_reason=req.finish_reason,
      num_preemptions=first.num_preemptions + req.num_preemptions,
      recompute_tokens=first.recompute_tokens + req.recompute_tokens,
      num_extensions=req.num_extensions, clipped=spec.clipped,
      output_token_ids=list(req.output_token_ids), prefix_hit_tokens=first.prefix_hit_tokens,
      slo_ttft_ms=spec.slo_ttft_ms, slo_tpot_ms=spec.slo_tpot_ms)


def pd_path(prefill: Sequence[Engine]) -> dict:
  """The path ``replay_pd`` takes: always one ``engine.step()`` per event.
  ``why``: the loop refuses a prefill or decode engine
  (``Engine.loop_refusal``: a handoff leaves a prefill engine, and enters a
  decode engine, between iterations), and a loop could not run a pool
  alone between router events anyway: each prefill step that finishes a
  prompt is such an event (its handoff is routed to a decode engine at
  that step's end, and a decode engine's next steps depend on when it
  arrives)."""
  refusal = prefill[0].loop_refusal() if prefill else None
  return {"path": "step",
          "why": (f"P/D pools: {refusal}" if refusal else "P/D pools") +
                 "; each finished prompt's handoff is routed at its prefill step's end"}


def replay_pd(prefill: Sequence[Engine], decode: Sequence[Engine], router, workload: Workload,
              link) -> Tuple[List[RequestRecord], float, Dict[str, Tuple[int, Optional[int]]],
                             List[Transfer]]:
  """Replays ``workload`` over prefill and decode pools (see above).

  Args:
    prefill: fresh prefill-role engines on ``VirtualClock`` clocks at 0.
    decode: fresh decode-role engines, the same way.
    router: a fresh ``PDRouter`` over them (``pd_router_for``); its ``log``
      holds every choice after the run.
    workload: the requests, arrivals in s from the start.
    link: the ``serving.engine.profiles.Link`` a handoff crosses.

  Returns:
    ``(records, duration_s, placement, transfers)``: one RequestRecord per
    request in workload order (times in s from the start); the time of the
    last event (s); request id -> (prefill engine, decode engine or None);
    the transfers in the order they started.

  Raises:
    ValueError: an engine without a fresh virtual clock, or of the wrong role.
  """
  engines = list(prefill) + list(decode)
  for i, e in enumerate(engines):
    want = "prefill" if i < len(prefill) else "decode"
    if e.config.role != want:
      raise ValueError(f"replay_pd: engine {i} must have role {want!r}, got "
                       f"{e.config.role!r}")
    if not isinstance(e.clock, VirtualClock) or e.now_ms() != 0.0:
      raise ValueError(f"replay_pd: engine {i} needs a fresh VirtualClock clock at 0")
  np_ = len(prefill)
  specs = sorted(workload.requests, key=lambda s: (s.arrival_s, s.request_id))
  by_id = {s.request_id: s for s in specs}
  placement: Dict[str, list] = {}
  refused: Dict[str, str] = {}                  # refused by a prefill engine
  dropped: Dict[str, str] = {}                  # handoffs a decode engine refused
  transfers: List[Transfer] = []
  waiting: List[str] = []                       # at the router, for a prefill place
  handoffs: List = []                           # KVHandoffs waiting for a decode place
  in_flight: List[Tuple[float, int, object]] = []   # (end ms, decode engine, handoff)

  def place(now_ms: float) -> None:
    while waiting:
      spec = by_id[waiting[0]]
      e = router.route_prefill(spec.request_id, spec.prompt_token_ids, spec.max_tokens,
                               now_ms)
      if e is None:
        break
      waiting.pop(0)
      placement[spec.request_id] = [e, None]
      try:
        _admit(prefill[e], spec, now_ms)
      except (ValueError, QueueFull) as err:
        refused[spec.request_id] = str(err)
        del placement[spec.request_id]
        router.failed(spec.request_id, now_ms, str(err))
    while handoffs:
      h = handoffs[0]
      d = router.route_decode(h.request_id, h.tokens, h.sampling.max_tokens, now_ms)
      if d is None:
        break
      handoffs.pop(0)
      placement[h.request_id][1] = d
      src = placement[h.request_id][0]
      end = now_ms + float(link.ms(h.nbytes))
      transfers.append(Transfer(h.request_id, src, d, int(h.nbytes), now_ms, end))
      in_flight.append((end, d, h))

  held: Dict[int, tuple] = {}
  i, end_ms = 0, 0.0
  while True:
    events = _events(specs, i, engines, {g: engines[g].now_ms() for g in held}, 2)
    if in_flight:
      end, d, _ = min(in_flight, key=lambda t: (t[0], t[1]))
      events.append((end, 1, np_ + d))
    if not events:
      stuck = len(waiting) + len(handoffs)
      if stuck:
        raise RuntimeError(f"replay_pd: {stuck} requests wait with every engine idle")
      break
    now, kind, g = min(events)
    end_ms = max(end_ms, now)
    if kind == 0:
      spec = specs[i]
      i += 1
      waiting.append(spec.request_id)
    elif kind == 1:
      k = min(range(len(in_flight)), key=lambda j: (in_flight[j][0], in_flight[j][1]))
      _, d, h = in_flight.pop(k)
      engine = decode[d]
      _wake(engine, now)
      engine.realized_output_tokens[h.request_id] = h.sampling.max_tokens
      try:
        req = engine.add_handoff(h, arrival_ms=now)
      except (ValueError, QueueFull) as err:
        dropped[h.request_id] = str(err)
        router.failed(h.request_id, now, str(err))
      else:
        if req.finished:                        # refused at once (it can never fit)
          dropped[h.request_id] = f"decode engine {d}: {req.finish_reason}"
          router.failed(h.request_id, now, dropped[h.request_id])
    elif kind == 3:
      outs = engines[g].step()
      held[g] = (outs, engines[g].take_handoffs() if g < np_ else [])
      continue
    else:
      outs, taken = held.pop(g)
      handed = {h.request_id for h in taken}
      for out in outs:
        if out.finished and out.request_id not in handed:
          req = engines[g].requests[out.request_id]
          outcome = req.outcome if req.outcome in ("failed",) else (
              "aborted" if req.outcome == "cancelled" else "completed")
          router.finished(out.request_id, now, outcome)
      for h in taken:
        router.prefill_done(h.request_id, now)
        handoffs.append(h)
    place(now)
  records = []
  for s in workload.requests:
    rid = s.request_id
    if rid in refused:
      records.append(_refused(s, refused[rid]))
      continue
    src, dst = placement[rid]
    if rid in dropped:                           # its first token only, then failed
      records.append(dataclasses.replace(_record(prefill[src], s, 0.0), outcome="failed",
                                         finish_reason=dropped[rid]))
    elif dst is None:                            # ended on the prefill engine
      records.append(_record(prefill[src], s, 0.0))
    else:
      records.append(_pd_record(s, prefill[src], decode[dst]))
  return records, end_ms / 1000.0, {k: tuple(v) for k, v in placement.items()}, transfers


def transfer_summary(transfers: Sequence[Transfer]) -> dict:
  """Counts and sizes of a run's transfers (ms and bytes: mean, max)."""
  if not transfers:
    return dict(count=0, total_bytes=0, mean_bytes=None, mean_ms=None, max_ms=None)
  ms = [t.end_ms - t.start_ms for t in transfers]
  nbytes = [t.nbytes for t in transfers]
  return dict(count=len(transfers), total_bytes=sum(nbytes), mean_bytes=sum(nbytes) / len(nbytes),
              mean_ms=sum(ms) / len(ms), max_ms=max(ms))


def route_counts(log) -> dict:
  """Choices per stage and engine from a router's log: ``{stage: {engine: n}}``
  (and ``end``: outcomes)."""
  out: Dict[str, Dict[str, int]] = {}
  for q in log:
    key = q["outcome"] if q["stage"] == "end" else str(q["engine"])
    out.setdefault(q["stage"], {}).setdefault(key, 0)
    out[q["stage"]][key] += 1
  return out


def simulate_mixed(cfg, engine_cfg, workload: Workload, n: int, policy: str,
                   model_name: str, *, loop: bool = True) -> Tuple[dict, List[RequestRecord]]:
  """One run of ``n`` mixed replicas (``engine_cfg``, simulated) behind the
  ``Router`` of ``policy``: ``(run, records)``, the run a JSON-ready dict
  (the global report, one per replica, iterations, the simulation's wall
  time, and ``path``: which path ``replay_cluster`` took and why, with
  ``loop`` as it has it)."""
  engines = [Engine(cfg, None, engine_cfg, clock=VirtualClock()) for _ in range(n)]
  router = router_for(engines, policy)
  t = time.perf_counter()
  records, duration_s, placement, _, path = replay_cluster(engines, router, workload,
                                                           loop=loop)
  wall_s = time.perf_counter() - t
  config = {**run_config(engines[0], model_name), "replicas": n, "route": policy,
            "workload": workload.describe()}
  report = metrics.build_report(records, duration_s, config, num_offered=len(workload))
  per_replica = []
  for r, engine in enumerate(engines):
    mine = [rec for rec in records if placement.get(rec.request_id) == r]
    one = metrics.build_report(mine, duration_s, {"replica": r}, num_offered=len(mine))
    one["engine_outcomes"] = run_outcomes(engine)
    per_replica.append(one)
  iterations = sum(e.num_iterations for e in engines)
  return ({"replicas": n, "gpus": n, "wall_s": wall_s, "iterations": iterations,
           "iterations_per_s": iterations / max(wall_s, 1e-9), "load_avg": os.getloadavg(),
           "path": path, "report": report, "per_replica": per_replica}, records)


def simulate_pd(cfg, engine_cfg, workload: Workload, p: int, d: int, policy: str, link,
                link_name: str, model_name: str, decode_cfg=None
                ) -> Tuple[dict, List[RequestRecord]]:
  """One P/D run: ``p`` prefill and ``d`` decode engines (``engine_cfg``
  with its role set; ``decode_cfg``, when given, for the decode engines)
  behind ``PD_ROUTERS[policy]``, handoffs over ``link``: ``(run,
  records)``, the run a JSON-ready dict (the global report, one per engine,
  the transfers, the router's choices per engine, and ``path``: always the
  step path, ``pd_path``)."""
  pre_cfg = dataclasses.replace(engine_cfg, role="prefill")
  dec_cfg = dataclasses.replace(decode_cfg or engine_cfg, role="decode")
  prefill = [Engine(cfg, None, pre_cfg, clock=VirtualClock()) for _ in range(p)]
  decode = [Engine(cfg, None, dec_cfg, clock=VirtualClock()) for _ in range(d)]
  router = pd_router_for(prefill, decode, policy)
  t = time.perf_counter()
  records, duration_s, placement, transfers = replay_pd(prefill, decode, router, workload,
                                                        link)
  wall_s = time.perf_counter() - t
  config = {**run_config(decode[0], model_name), "prefill_replicas": p, "decode_replicas": d,
            "prefill_policy": pre_cfg.policy, "router": policy, "link": link_name,
            "link_figures": dataclasses.asdict(link),
            "link_source": profiles.transfer_link_source(
                calibrations.load(engine_cfg.cost_model), link_name),
            "workload": workload.describe()}
  report = metrics.build_report(records, duration_s, config, num_offered=len(workload))
  per_engine = []
  for col, (stage, pool) in enumerate((("prefill", prefill), ("decode", decode))):
    for i, engine in enumerate(pool):
      mine = [rec for rec in records if placement.get(rec.request_id, (None, None))[col] == i]
      one = metrics.build_report(mine, duration_s, {"stage": stage, "engine": i},
                                 num_offered=len(mine))
      one["engine_outcomes"] = run_outcomes(engine)
      per_engine.append(one)
  iterations = sum(e.num_iterations for e in prefill + decode)
  return ({"prefill_replicas": p, "decode_replicas": d, "gpus": p + d, "wall_s": wall_s,
           "iterations": iterations, "iterations_per_s": iterations / max(wall_s, 1e-9),
           "load_avg": os.getloadavg(), "path": pd_path(prefill),
           "report": report, "per_engine": per_engine,
           "transfers": transfer_summary(transfers),
           "transfer_ms": {t.request_id: t.end_ms - t.start_ms for t in transfers},
           "routes": route_counts(router.log)}, records)


def goodput_bracket(points: Sequence[Tuple[float, float]], attainment: float) -> dict:
  """Goodput on a grid of rates (DistServe's criterion): from ``[(rate,
  share of requests within SLO), ...]`` in ascending rate, ``goodput``: the
  highest rate up to which every tested one keeps ``attainment`` (None:
  the lowest fails), and ``first_failing``: the first rate that does not
  (None: none failed). A rate that passes after a failing one does not
  count."""
  best, fail = None, None
  for rate, share in points:
    if share < attainment:
      fail = rate
      break
    best = rate
  return dict(goodput=best, first_failing=fail)
