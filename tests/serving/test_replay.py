"""Deterministic replay: same seed and workload -> same tokens and report."""

import jax
import pytest

from models import llama
from models.config import get_config
from attention import native_build
from scheduler import keys
from scheduler import scan
from serving.harness import metrics
from serving.harness import synthetic
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.harness.replay import replay, run_config

CFG = get_config("tiny")
CONFIG = EngineConfig.preset("tiny")
# Fields that measure wall-clock time (or depend on how work was interleaved
# with it) and may differ between two runs of the same replay.
WALL_CLOCK = ("duration_s", "request_throughput", "output_throughput",
              "total_token_throughput", "num_samples_itl_ms")


def _workload():
  return synthetic.synthetic_azure_conv(
      10, rate_scale=1.0, seed=4, max_prompt_len=24, max_output_len=6,
      vocab_size=CFG.vocab_size, reserved_token_ids=frozenset({0, 1}))


def _replay(params):
  engine = Engine(CFG, params, CONFIG)
  wl = _workload()
  records, duration_s = replay(engine, wl, realtime=False)
  report = metrics.build_report(records, duration_s, run_config(engine, "tiny"),
                                num_offered=len(wl))
  tokens = {rid: r.output_token_ids for rid, r in engine.requests.items()}
  return tokens, report


def _stable(report):
  out = {k: v for k, v in report.items()
         if k not in WALL_CLOCK and not k.endswith(("_ms",)) and k != "config"}
  out["requests"] = [{k: v for k, v in r.items()
                      if k not in ("arrival_s", "first_token_s", "token_times_s")}
                     for r in report["requests"]]
  # The slot table grows with the queue depth, which a wall-clock replay
  # does not fix: its size and the programs compiled for it may differ.
  out["config"] = {k: v for k, v in report["config"].items()
                   if k not in ("bucket_histogram", "iterations", "preemptions", "swap",
                                 "recompute_tokens", "compiled_programs", "num_slots")}
  return out


def test_same_seed_and_workload_give_same_tokens_and_report():
  params = llama.init_params(CFG, jax.random.PRNGKey(2), layer_scale=8)
  tokens_a, report_a = _replay(params)
  tokens_b, report_b = _replay(params)
  assert tokens_a == tokens_b
  assert _stable(report_a) == _stable(report_b)
  wl = _workload()
  assert report_a["completed"] == len(wl) == 10
  assert [r["output_tokens"] for r in report_a["requests"]] == [s.max_tokens for s in wl]
  assert report_a["total_output_tokens"] == sum(s.max_tokens for s in wl)
  assert report_a["config"]["policy_id"] == "sarathi_serve"
  # Where it ran: the native sort where the kernel builds, else XLA's and why.
  sort = report_a["config"]["key_order_sort"]
  if native_build.load(keys.SORT_KERNEL) is None:
    assert sort == "native radix sort"
  else:
    assert sort.startswith("jax.lax.sort (") and sort.endswith(")")
  scans = report_a["config"]["scan_kernels"]
  if native_build.load(scan.SCAN_KERNEL) is None:
    assert scans == "native"
  else:
    assert scans.startswith("xla (") and scans.endswith(")")
  # The report carries every request's token ids, as the engine emitted them.
  assert {r["request_id"]: r["output_token_ids"] for r in report_a["requests"]} == {
      rid: tokens_a[rid] for rid in tokens_a}


def test_request_the_engine_refuses_is_recorded_rejected_and_the_replay_goes_on():
  import dataclasses
  params = llama.init_params(CFG, jax.random.PRNGKey(2), layer_scale=8)
  wl = _workload()
  too_long = dataclasses.replace(wl.requests[3], prompt_token_ids=(5,) * CONFIG.max_model_len)
  wl = dataclasses.replace(wl, requests=wl.requests[:3] + (too_long,) + wl.requests[4:])
  engine = Engine(CFG, params, CONFIG)
  records, duration_s = replay(engine, wl, realtime=False)
  report = metrics.build_report(records, duration_s, num_offered=len(wl))
  assert report["rejected"] == 1 and report["completed"] == len(wl) - 1
  rejected = [r for r in report["requests"] if r["outcome"] == "rejected"]
  assert rejected[0]["request_id"] == too_long.request_id
  assert "max_model_len=64" in rejected[0]["finish_reason"]



class _HandClock:
  """A wall clock that moves only when told (seconds): steps take no time."""

  def __init__(self):
    self.t = 100.0

  def __call__(self):
    return self.t


def test_a_replay_not_in_real_time_skips_idle_gaps_on_one_time_axis():
  """``realtime=False`` on the wall clock skips the idle gap before a late
  arrival by moving the engine clock past it: every record keeps its
  workload arrival, its tokens come after it, and ``duration_s`` spans the
  gap, as on a virtual clock. Before, the gap moved only the later
  requests' offsets, so the early ones were recorded arriving 53 s late
  and the duration (the engine's busy time) ended before their tokens."""
  import dataclasses
  from serving.harness import ledger
  params = llama.init_params(CFG, jax.random.PRNGKey(2), layer_scale=8)
  wl = _workload()
  arrivals = [0.0, 0.0, 52.0, 53.0]
  wl = dataclasses.replace(wl, requests=tuple(
      dataclasses.replace(r, arrival_s=a) for r, a in zip(wl.requests, arrivals)))
  clock = _HandClock()
  engine = Engine(CFG, params, CONFIG, clock=clock)
  clock.t += 40.0                    # load and compilation before the replay
  sampler = ledger.ResourceSampler(engine)
  records, duration_s = replay(engine, wl, realtime=False, on_progress=sampler,
                               origin_ms=sampler.origin_ms)
  assert [r.outcome for r in records] == ["completed"] * 4
  assert [r.arrival_s for r in records] == arrivals
  # Steps take no time on this clock: each request's tokens all come at its
  # arrival, and the replay ends at the last one.
  assert [r.token_times_s[-1] for r in records] == arrivals
  assert duration_s == 53.0
  # The sampler's rows are on the records' axis (not 40 s later): the last
  # one at the replay's end.
  t_ms = [row[0] for row in sampler.samples]
  assert t_ms[0] == 0.0 and t_ms[-1] == 53_000.0 and t_ms == sorted(t_ms)
  with pytest.raises(ValueError, match="ms >= 0"):
    engine.clocks.skip(-1.0)
  from serving.engine.clocks import EngineClocks
  from serving.engine.sim_executor import VirtualClock
  with pytest.raises(ValueError, match="a virtual clock advances"):
    EngineClocks(VirtualClock()).skip(1.0)
