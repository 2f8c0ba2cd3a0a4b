"""Replays a Workload against an Engine, honouring arrival times.

Each request is added when the engine clock reaches its arrival; its TTFT and
E2EL are measured from that intended arrival, so host lag counts against the
engine, not for it. When nothing is live the host sleeps until the next
arrival (``realtime=True``) or skips the gap (``realtime=False``: the engine
clock moves past it without waiting, so every time keeps its place, as on a
virtual clock; a busy engine still admits a request only once its time has
come).

On an engine with a virtual clock (``sim_executor.VirtualClock``) every
arrival is admitted by virtual time: the clock advances by each step's
modelled time, and jumps to the next arrival when nothing is live, so the
schedule, token times and report repeat bit for bit (``realtime`` is moot).
"""

from __future__ import annotations

import math
import platform
import time
from typing import Callable, List, Optional, Tuple

import jax

from scheduler import keys
from scheduler import scan
from scheduler.admission import estimator_name
from serving.engine.config import SamplingParams
from serving.engine import sim_loop
from serving.engine.engine import Engine
from serving.engine.requests import QueueFull
from serving.harness.metrics import RequestRecord
from serving.engine.sim_executor import VirtualClock
from serving.harness.workloads import Workload


# On the loop path, ``on_progress`` runs after at most this many iterations.
PROGRESS_ITERATIONS = 8 * sim_loop.LOOP_ITERATIONS


def path(engine: Engine, *, loop: bool = True, on_step: Optional[Callable] = None,
         step_ms: Optional[List[float]] = None) -> Tuple[str, str]:
  """Which path ``replay`` takes on ``engine`` with these arguments, and
  why: ("loop", "") runs many iterations per program call
  (``Engine.simulate``); ("step", reason) runs one ``engine.step()`` per
  iteration. Reports record it (``{"path": ..., "why": ...}``)."""
  if not isinstance(engine.clock, VirtualClock):
    return "step", "the engine runs on the wall clock"
  if not loop:
    return "step", "loop=False was asked for"
  if on_step is not None:
    return "step", "on_step reads every step's outputs"
  if step_ms is not None:
    return "step", "step_ms times every step"
  refusal = engine.loop_refusal()
  return ("step", refusal) if refusal is not None else ("loop", "")


def replay(engine: Engine, workload: Workload, *, realtime: bool = True,
           sampling: Callable = None, on_step: Optional[Callable] = None,
           step_ms: Optional[List[float]] = None, loop: bool = True,
           on_progress: Optional[Callable[[Engine], None]] = None,
           origin_ms: Optional[float] = None) -> Tuple[List[RequestRecord], float]:
  """Runs the workload to completion.

  A simulated engine on a virtual clock whose config the device loop
  covers (``Engine.loop_refusal``) runs many iterations per program call
  (``Engine.simulate``) unless ``loop`` is False or ``on_step`` or
  ``step_ms`` asks for every step: the same schedule and records (times
  to the last bit of a float64 step time, ``serving.engine.sim_loop``);
  ``path`` says which path a call takes and why.

  Args:
    engine: a fresh Engine.
    workload: requests with ``arrival_s`` offsets from the replay start.
    realtime: wait for wall-clock arrivals (True) or admit each request as
      soon as the engine is idle or its time has come (False: an idle gap
      is skipped, the engine clock moved past it, ``EngineClocks.skip``,
      so times and ``duration_s`` include it, as on a virtual clock).
    sampling: ``spec -> SamplingParams``; default greedy with the spec's
      ``max_tokens`` and ``ignore_eos``.
    on_step: called after every engine step with its RequestOutputs.
    step_ms: when given, the wall time (ms, ``time.perf_counter``) of every
      ``engine.step()`` call is appended to it, before ``on_step`` runs (on a
      virtual clock too: the host's time, not the modelled one).
    loop: allow ``Engine.simulate`` (False: one ``engine.step()`` per
      iteration).
    on_progress: called with the engine after every step on the step path,
      and on the loop path after every ``PROGRESS_ITERATIONS`` iterations at
      most, plus the rest of the loop call (up to ``sim_loop.LOOP_ITERATIONS``)
      that crossed them (a progress bar, ``ledger.ResourceSampler``): it does
      not take the loop away.
    origin_ms: the engine time (ms) the arrival offsets and the records'
      times count from; default the engine clock when the replay starts.
      ``ResourceSampler.origin_ms`` puts a sampler's rows on the records'
      axis.

  Returns:
    ``(records, duration_s)``: one RequestRecord per workload request, and
    the replay's wall time (s) from start to the last outcome. A request the
    engine refuses (e.g. a prompt that does not fit the context) is recorded
    as ``rejected`` with the engine's reason; the replay goes on.
  """
  sampling = sampling or (lambda spec: SamplingParams(
      max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos))
  specs = sorted(workload.requests, key=lambda s: s.arrival_s)
  virtual = isinstance(engine.clock, VirtualClock)
  for spec in specs:      # hidden truth for a simulated executor only
    engine.realized_output_tokens[spec.request_id] = spec.max_tokens
  start_ms = engine.now_ms() if origin_ms is None else origin_ms
  refused = {}
  i = 0
  if path(engine, loop=loop, on_step=on_step, step_ms=step_ms)[0] == "loop":
    i = len(specs)
    refused = _simulate(engine, specs, sampling, start_ms, on_progress)
  while i < len(specs) or engine.has_unfinished():
    now_ms = engine.now_ms() - start_ms
    while i < len(specs) and specs[i].arrival_s * 1000.0 <= now_ms:
      spec = specs[i]
      try:
        engine.add_request(spec.request_id, spec.prompt_token_ids, sampling(spec),
                           arrival_ms=start_ms + spec.arrival_s * 1000.0,
                           priority=spec.priority, client=spec.client,
                           slo_ttft_ms=spec.slo_ttft_ms, slo_tpot_ms=spec.slo_tpot_ms)
      except (ValueError, QueueFull) as e:
        refused[spec.request_id] = str(e)
      i += 1
    if not engine.has_unfinished():
      if i < len(specs):
        wait_ms = specs[i].arrival_s * 1000.0 - now_ms
        if virtual:
          engine.clock.advance(max(wait_ms, 0.0) / 1000.0)
        elif realtime:
          time.sleep(max(wait_ms, 0.0) / 1000.0)
        else:
          engine.clocks.skip(max(wait_ms, 0.0))
      continue
    if step_ms is None:
      outputs = engine.step()
    else:
      t = time.perf_counter()
      outputs = engine.step()
      step_ms.append((time.perf_counter() - t) * 1000.0)
    if on_step is not None:
      on_step(outputs)
    if on_progress is not None:
      on_progress(engine)
  duration_s = (engine.now_ms() - start_ms) / 1000.0
  return [_refused(spec, refused[spec.request_id]) if spec.request_id in refused
          else _record(engine, spec, start_ms) for spec in specs], duration_s


def _simulate(engine: Engine, specs, sampling: Callable, start_ms: float,
              on_progress: Optional[Callable]) -> dict:
  """``replay`` on ``Engine.simulate``: every request is added ahead of its
  arrival (``Engine.add_future_request``) while the queue bound cannot
  refuse it at its arrival; one that it might is added when its time has
  come, as ``replay`` adds every request. Returns {request id: reason} of
  the requests the engine refused."""
  refused, i = {}, 0
  arrival_ms = lambda spec: start_ms + spec.arrival_s * 1000.0

  def add(spec, method):
    method(spec.request_id, spec.prompt_token_ids, sampling(spec), arrival_ms=arrival_ms(spec),
           priority=spec.priority, client=spec.client, slo_ttft_ms=spec.slo_ttft_ms,
           slo_tpot_ms=spec.slo_tpot_ms)

  while i < len(specs) or engine.has_unfinished():
    while i < len(specs) and arrival_ms(specs[i]) <= engine.now_ms():
      try:
        add(specs[i], engine.add_request)
      except (ValueError, QueueFull) as e:
        refused[specs[i].request_id] = str(e)
      i += 1
    while i < len(specs):
      try:
        add(specs[i], engine.add_future_request)
      except QueueFull:
        break
      except ValueError as e:
        refused[specs[i].request_id] = str(e)
      i += 1
    engine.simulate(arrival_ms(specs[i]) if i < len(specs) else math.inf,
                    max_iterations=None if on_progress is None else PROGRESS_ITERATIONS)
    if on_progress is not None:
      on_progress(engine)
  return refused


def _refused(spec, reason: str) -> RequestRecord:
  return RequestRecord(
      request_id=spec.request_id, client=spec.client, arrival_s=spec.arrival_s,
      first_token_s=None, token_times_s=[], prompt_tokens=len(spec.prompt_token_ids),
      output_tokens=0, outcome="rejected", finish_reason=reason, clipped=spec.clipped,
      slo_ttft_ms=spec.slo_ttft_ms, slo_tpot_ms=spec.slo_tpot_ms)


def _record(engine: Engine, spec, origin_ms: float) -> RequestRecord:
  req = engine.requests[spec.request_id]
  times = [(t - origin_ms) / 1000.0 for t in req.token_times_ms]
  return RequestRecord(
      request_id=spec.request_id, client=spec.client,
      arrival_s=(req.arrival_ms - origin_ms) / 1000.0,
      first_token_s=times[0] if times else None, token_times_s=times,
      prompt_tokens=len(spec.prompt_token_ids), output_tokens=len(times),
      outcome=req.outcome, finish_reason=req.finish_reason,
      num_preemptions=req.num_preemptions, recompute_tokens=req.recompute_tokens,
      num_extensions=req.num_extensions,
      clipped=spec.clipped, output_token_ids=req.output_token_ids,
      prefix_hit_tokens=req.prefix_hit_tokens,
      slo_ttft_ms=spec.slo_ttft_ms, slo_tpot_ms=spec.slo_tpot_ms)


# Keys of ``run_outcomes``: what a run measured, never what the user set.
OUTCOME_KEYS = ("iterations", "bucket_histogram", "compiled_programs", "num_slots",
                "preemptions", "extensions", "recompute_tokens", "swap",
                "prefill_tokens_computed", "prefix_cache_queries", "prefix_cache_hits",
                "prefix_cache_hit_rate", "prefix_cache_evictions", "prefix_cache_pages",
                "spec_decode")


def run_config(engine: Engine, model_name: str) -> dict:
  """The configuration block of a report: what the user set (model, engine
  preset and overrides, policy, executor and cost model) and where it ran
  (versions, device). Two runs are compared on these (``serving.harness.ablation``);
  what the run measured is in ``run_outcomes``, never here."""
  c = engine.config
  return {
      "model": model_name,
      "dtype": c.dtype,
      "weights": c.weights,
      "int8_gemm": engine.int8_gemm,
      "decode_gemm": engine.decode_gemm,
      "kv_dtype": c.kv_cache_dtype,
      "token_buckets": list(c.token_buckets),
      "max_num_batched_tokens": c.max_num_batched_tokens,
      "max_num_seqs": c.max_num_seqs,
      "long_prefill_token_threshold": c.long_prefill_token_threshold,
      "page_size": c.page_size,
      "num_pages": c.num_pages,
      "max_model_len": c.max_model_len,
      "policy_id": engine.policy.policy_id,
      "policy_version": engine.policy.version,
      "attention_impl": c.attention_impl,
      "key_order_sort": keys.sort_impl(),
      "scan_kernels": scan.scan_impl(),
      "jax_version": jax.__version__,
      "device": str(jax.devices()[0]),
      "mesh": c.mesh,
      "num_processes": jax.process_count(),
      "platform": platform.platform(),
      "max_queued_requests": c.max_queued_requests,
      "preemption_mode": c.preemption_mode,
      "reservation": c.reservation,
      "reservation_estimator": estimator_name(c.reservation, c.reservation_quantile),
      "watermark_pages": c.watermark_pages,
      "force_preempt_every": c.force_preempt_every,
      "speculative": c.speculative,
      # The simulated drafts' acceptance and seed (only where they are set).
      **({"spec_acceptance": c.spec_acceptance, "spec_seed": c.spec_seed}
         if c.spec_acceptance else {}),
      "max_preemptions_per_request": c.max_preemptions_per_request,
      "executor": c.executor,
      "clock": "virtual" if engine.cost_model is not None else "wall",
      "cost_model": engine.cost_model.to_json() if engine.cost_model is not None else None,
      "enable_prefix_caching": c.enable_prefix_caching,
  }


def run_outcomes(engine: Engine) -> dict:
  """The engine's measured totals after a run (``OUTCOME_KEYS``): iterations
  and the token buckets they used, programs compiled and slot-table size
  reached, preemptions, §0x06 extensions, recomputed and swapped KV, prompt
  rows computed, the prefix cache's counters (vLLM's names; tokens,
  except ``prefix_cache_evictions`` and ``prefix_cache_pages``, in pages)
  and speculative decoding's (``SpecCounts.stats``; zeros without it).
  Outcomes differ between the runs a comparison ranks; they are never
  comparison coordinates."""
  return {
      "iterations": engine.num_iterations,
      "bucket_histogram": {str(k): v for k, v in sorted(engine.buckets_used.items())},
      "compiled_programs": engine.compiled_programs(),
      "num_slots": engine.num_slots,
      "preemptions": engine.num_preemptions,
      "extensions": sum(r.num_extensions for r in engine.requests.values()),
      "recompute_tokens": sum(r.recompute_tokens for r in engine.requests.values()),
      "swap": engine.swap.stats(),
      "prefill_tokens_computed": engine.prefill_tokens_computed,
      **engine.prefix_cache_stats(),
      "spec_decode": engine.spec_counts.stats(),
  }


FIDELITY_METRICS = {
    "ttft": lambda r: r.ttft_s,
    "tpot": lambda r: r.tpot_s,
    "e2el": lambda r: r.token_times_s[-1] - r.arrival_s if r.token_times_s else None,
}


def fidelity(measured: List[RequestRecord], simulated: List[RequestRecord],
             measured_s: float, simulated_s: float) -> dict:
  """How far a simulated replay is from a measured one of the same workload.

  Per request completed in both (matched by request id), the relative error
  ``|simulated - measured| / measured`` of TTFT, TPOT and E2EL; their median
  and p90 (None for a metric no request has), and the relative error of the
  replay duration.

  Args:
    measured, simulated: the two replays' records.
    measured_s, simulated_s: their durations (s).
  """
  import numpy as np      # pylint: disable=import-outside-toplevel
  sim = {r.request_id: r for r in simulated}
  pairs = [(m, sim[m.request_id]) for m in measured
           if m.outcome == "completed" and m.request_id in sim
           and sim[m.request_id].outcome == "completed"]
  out = {"requests": len(measured), "completed_in_both": len(pairs),
         "measured_duration_s": measured_s, "simulated_duration_s": simulated_s,
         "duration_rel_err": abs(simulated_s - measured_s) / measured_s if measured_s else None}
  for name, get in FIDELITY_METRICS.items():
    err = [abs(get(s) - get(m)) / get(m) for m, s in pairs
           if get(m) is not None and get(s) is not None and get(m) > 0]
    signed = [(get(s) - get(m)) / get(m) for m, s in pairs
              if get(m) is not None and get(s) is not None and get(m) > 0]
    out[name] = None if not err else {
        "median_rel_err": float(np.median(err)), "p90_rel_err": float(np.percentile(err, 90)),
        "median_signed_rel_err": float(np.median(signed)), "n": len(err),
        "measured_median_ms": float(np.median([get(m) for m, _ in pairs
                                               if get(m) is not None]) * 1e3)}
  return out
