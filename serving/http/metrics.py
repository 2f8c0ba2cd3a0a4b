"""Prometheus metrics of the OpenAI server (``GET /metrics``), vLLM's metric
names where one exists, and its admission counter (the live-request bound
behind HTTP 429).
"""

from __future__ import annotations

import threading
from typing import Optional

import jax
import numpy as np
import prometheus_client as prom

from scheduler import records as rec
from serving.engine.engine import Engine
from serving.http.protocol import Overloaded
from serving.kv import pages as kv_pages

_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                      1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class ServerMetrics:
  """Prometheus metrics (own registry), vLLM's names where one exists.

  Also the admission counter: ``admit`` reserves a live place or raises
  ``Overloaded``; the engine thread calls ``release`` when a request ends.
  """

  def __init__(self, model_name: str, capacity: int):
    self.capacity = capacity
    self._lock = threading.Lock()
    self.live = 0
    r = self.registry = prom.CollectorRegistry()
    L = ["model_name"]
    hist = lambda name, doc: prom.Histogram(name, doc, L, registry=r,
                                            buckets=_LATENCY_BUCKETS_S).labels(model_name)
    self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (s).")
    self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency (s).")
    self.tpot = hist("vllm:request_time_per_output_token_seconds",
                     "Time per output token after the first (s).")
    self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency (s).")
    self.queue_time = hist("vllm:request_queue_time_seconds",
                           "Time from arrival to an engine slot (s).")
    gauge = lambda name, doc: prom.Gauge(name, doc, L, registry=r).labels(model_name)
    self.running = gauge("vllm:num_requests_running", "Requests scheduled in the engine.")
    self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
    self.suspended = gauge("vllm:num_requests_swapped",
                           "Requests preempted and waiting to resume.")
    self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV pages in use.")
    count = lambda name, doc: prom.Counter(name, doc, L, registry=r).labels(model_name)
    self.preemptions = count("vllm:num_preemptions", "Preemptions.")
    self.prompt_tokens = count("vllm:prompt_tokens", "Prompt tokens of accepted requests.")
    self.generation_tokens = count("vllm:generation_tokens", "Generated tokens.")
    self._success = prom.Counter("vllm:request_success", "Completed requests by finish "
                                 "reason.", L + ["finished_reason"], registry=r)
    self._outcomes = prom.Counter("iterserve:requests", "Accepted requests by outcome.",
                                  L + ["outcome"], registry=r)
    self._refused = prom.Counter("iterserve:requests_refused", "Requests refused before "
                                 "acceptance, by reason.", L + ["reason"], registry=r)
    self.prefix_queries = count("vllm:prefix_cache_queries",
                                "Prompt tokens looked up in the prefix cache.")
    self.prefix_hits = count("vllm:prefix_cache_hits",
                             "Prompt tokens served from the prefix cache.")
    self.prefill_computed = count("iterserve:prefill_tokens_computed",
                                  "Prompt rows computed (prefill and rebuild; prefix-cache "
                                  "hits are not computed).")
    self.kv_pages_peak = gauge("iterserve:kv_pages_used_peak",
                               "Most KV pages requests held at the end of an iteration, "
                               "since the engine last went from idle to busy.")
    self.spec_drafts = count("vllm:spec_decode_num_drafts",
                             "Decode rows that verified draft tokens.")
    self.spec_draft_tokens = count("vllm:spec_decode_num_draft_tokens",
                                   "Draft tokens verified.")
    self.spec_accepted = count("vllm:spec_decode_num_accepted_tokens",
                               "Draft tokens accepted.")
    self._spec_per_pos = prom.Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by draft position.",
                                      L + ["position"], registry=r)
    self._spec_seen = None
    self._model = model_name
    self._preemptions_seen = 0
    self._prefix_seen = (0, 0)
    self._prefill_seen = 0
    self._peak, self._idle = 0, True

  def admit(self, count: int = 1) -> None:
    """Reserves ``count`` live places (one per choice), all or none."""
    with self._lock:
      if self.live + count > self.capacity:
        self.refused("overloaded")
        raise Overloaded(f"the server holds {self.live} requests, its bound "
                         f"(engine slots + --max_waiting = {self.capacity}); "
                         f"{count} more do not fit; retry later")
      self.live += count

  def release(self) -> None:
    with self._lock:
      self.live -= 1

  def refused(self, reason: str) -> None:
    self._refused.labels(self._model, reason).inc()

  def outcome(self, outcome: str, finish: Optional[str]) -> None:
    """Counts an accepted request's end: ``iterserve:requests`` by outcome;
    ``vllm:request_success`` by finish reason for a completed request
    ("stop", "length") and as "abort" for a cancelled one (vLLM counts a
    client's abort there too)."""
    self._outcomes.labels(self._model, outcome).inc()
    if outcome == "completed":
      self._success.labels(self._model, finish).inc()
    elif outcome == "cancelled":
      self._success.labels(self._model, "abort").inc()

  def finished(self, engine: Engine, req, finish: Optional[str]) -> None:
    """Counts a request's outcome and observes its latencies.

    TTFT and ITL observe every token a request emitted, whatever its end
    (vLLM observes them per iteration, as tokens appear). E2E latency and
    TPOT are per-request figures of requests that ran to their end: only
    ``completed`` requests are observed, as vLLM observes them only for
    requests the engine finished (``update_from_finished_request``; a client
    abort drops the request without it). A cancelled request's E2E would be
    the client's patience, not the server's latency.
    """
    self.outcome(req.outcome, finish)
    t = req.token_times_ms
    if t:
      self.ttft.observe((t[0] - req.arrival_ms) / 1e3)
      for a, b in zip(t, t[1:]):
        self.itl.observe((b - a) / 1e3)
    if req.outcome != "completed":
      return
    if len(t) > 1:
      self.tpot.observe((t[-1] - t[0]) / 1e3 / (len(t) - 1))
    self.e2e.observe((engine.now_ms() - req.arrival_ms) / 1e3)

  def observe_engine(self, engine: Engine, unslotted: int) -> None:
    """Gauges from the engine after a step (engine thread only);
    ``unslotted``: accepted requests not yet in an engine slot."""
    status, generation, (free, evictable, _) = jax.device_get((
        engine.state.status, engine.state.generation, kv_pages.page_census(engine.pages)))
    waiting = status == rec.WAITING
    self.running.set(int(np.sum(status == rec.RUNNING)))
    self.suspended.set(int(np.sum(waiting & (generation > 0))))
    self.waiting.set(int(np.sum(waiting & (generation == 0))) + unslotted)
    # Cached pages no request holds are reclaimable: free, as in vLLM.
    self.kv_usage.set(1.0 - int(free + evictable) / (engine.config.num_pages - 1))
    used = engine.config.num_pages - 1 - int(free + evictable)
    self._peak = used if self._idle else max(self._peak, used)
    self._idle = not engine.has_unfinished()
    self.kv_pages_peak.set(self._peak)
    self.prefill_computed.inc(engine.prefill_tokens_computed - self._prefill_seen)
    self._prefill_seen = engine.prefill_tokens_computed
    if engine.num_preemptions > self._preemptions_seen:
      self.preemptions.inc(engine.num_preemptions - self._preemptions_seen)
      self._preemptions_seen = engine.num_preemptions
    stats = engine.prefix_cache_stats()
    queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
    self.prefix_queries.inc(queries - self._prefix_seen[0])
    self.prefix_hits.inc(hits - self._prefix_seen[1])
    self._prefix_seen = (queries, hits)
    self._observe_spec(engine.spec_counts.stats())

  def _observe_spec(self, spec: dict) -> None:
    """Speculative decoding's counters (``SpecCounts``) since the last call."""
    seen = self._spec_seen or {k: 0 for k in spec}
    self.spec_drafts.inc(spec["num_drafts"] - seen["num_drafts"])
    self.spec_draft_tokens.inc(spec["num_draft_tokens"] - seen["num_draft_tokens"])
    self.spec_accepted.inc(spec["num_accepted_tokens"] - seen["num_accepted_tokens"])
    before = seen["accepted_per_pos"] or [0] * len(spec["accepted_per_pos"])
    for pos, (now, was) in enumerate(zip(spec["accepted_per_pos"], before)):
      if now > was:
        self._spec_per_pos.labels(self._model, str(pos)).inc(now - was)
    self._spec_seen = spec

