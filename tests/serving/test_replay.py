"""Deterministic replay: same seed and workload -> same tokens and report."""

import jax

from models import llama
from models.config import get_config
from attention import native_build
from scheduler import keys
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

