"""Prefix-cache counters and forced preemption, on the engine's settlement.

Both cases run the tiny model with pages of 16 rows, a 128-token context and
a 16-token budget and chunk cap:

* the prefix-cache counters count a request's prompt once, when its first
  chunk runs, with the hit it actually ran from: a lookup whose hit is
  dropped before use, or the lookup of a preempted request resuming, adds
  nothing (vLLM keeps preempted lookups out of its hit rate as well);
* a forced preemption never takes a request that has not emitted since its
  last preemption, so every preemption costs at most one rebuild and the
  request completes with the tokens of a run without preemption.
"""

import dataclasses

import pytest

from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from tests.serving.engine_testing import CFG, prompts as _prompts

CONFIG = EngineConfig.preset("tiny", page_size=16, max_model_len=128,
                             max_num_batched_tokens=16, long_prefill_token_threshold=16)
SHORT_OF_PAGES = dataclasses.replace(CONFIG, num_pages=9)   # 8 usable pages of 16 rows


def _run(params, config, prompts, sampling):
  engine = Engine(CFG, params, config)
  reqs = [engine.add_request(f"r{i}", p, sampling) for i, p in enumerate(prompts)]
  engine.run(max_iterations=400)
  return engine, reqs


@pytest.mark.extended   # ~24 s; tests/serving/test_prefix_cache.py counts hits by default
def test_a_dropped_resume_hit_is_not_counted_where_nothing_is_shared(params):
  """Two unrelated 40-token prompts on 8 pages: one is recompute-preempted,
  its resume lookup finds its own 2 prompt pages (32 tokens), the hit is
  dropped while it waits (the running request needs the pages) and it
  rebuilds from row 0. No page served anyone: 0 hits over the 80 prompt
  tokens, and the tokens are those of a run without caching."""
  sampling = SamplingParams(max_tokens=60, ignore_eos=True)
  prompts = _prompts([40, 40], seed=0)
  engine, reqs = _run(params, SHORT_OF_PAGES, prompts, sampling)
  assert [r.outcome for r in reqs] == ["completed", "completed"]
  assert [r.num_preemptions for r in reqs] == [0, 1]
  assert [r.prefix_hit_tokens for r in reqs] == [0, 0]     # the resume hit was dropped
  stats = engine.prefix_cache_stats()
  assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"],
          stats["prefix_cache_hit_rate"]) == (80, 0, 0.0)
  # Both prompts and the preempted one's whole rebuild (40 prompt rows and
  # its outputs up to the preemption) ran: nothing came from the cache.
  assert engine.prefill_tokens_computed == 80 + reqs[1].recompute_tokens > 80
  _, off = _run(params, dataclasses.replace(SHORT_OF_PAGES, enable_prefix_caching=False),
                prompts, sampling)
  assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in off]


@pytest.mark.extended    # ~1 min; tests/serving/test_prefix_cache.py counts shared hits by default
def test_a_used_hit_counts_once_and_a_resume_hit_of_its_own_pages_not_at_all(params):
  """A prompt sharing 2 pages with an earlier one counts its 32 hit tokens
  once; the earlier request, forced out and resuming from its own cached
  pages (prefix_hit_tokens 32, rows it does not recompute), adds no query
  and no hit; nor does the later request's own resume lookup."""
  head = _prompts([32], seed=5)[0]
  first, second = head + _prompts([8], seed=6)[0], head + _prompts([9], seed=7)[0]
  sampling = SamplingParams(max_tokens=12, ignore_eos=True)
  engine = Engine(CFG, params, dataclasses.replace(CONFIG, force_preempt_every=3))
  a = engine.add_request("a", first, sampling)
  engine.run(max_iterations=200)
  assert a.outcome == "completed" and a.num_preemptions > 0
  assert a.prefix_hit_tokens == 32            # its last resume ran from its own pages
  stats = engine.prefix_cache_stats()
  assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (40, 0)
  b = engine.add_request("b", second, SamplingParams(max_tokens=2, ignore_eos=True))
  engine.run(max_iterations=200)
  assert (b.outcome, b.num_preemptions, b.prefix_hit_tokens) == ("completed", 1, 32)
  stats = engine.prefix_cache_stats()
  assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (81, 32)
  assert stats["prefix_cache_hit_rate"] == pytest.approx(32 / 81)


@pytest.mark.parametrize("caching, prompt_len", [
    pytest.param(True, 40, marks=pytest.mark.extended),
    pytest.param(False, 40, marks=pytest.mark.extended),
    pytest.param(False, 20, marks=pytest.mark.extended)])
def test_forced_preemption_always_makes_progress_and_keeps_the_tokens(
    params, caching, prompt_len):
  """Preempting every 3rd decision, one 40-token prompt resumes from its 2
  cached pages: 17 rows rebuild in 2 chunks, so its first decode after each
  rebuild fell on the next forced decision and it was preempted again with
  nothing emitted, until max_preemptions_per_request failed it (65
  preemptions, 10 tokens). Without caching a 20-token prompt (rebuilt in 2
  chunks as well) livelocked the same way; a 40-token one (3-4 chunks)
  did not. Each forced preemption now follows at least one new token."""
  sampling = SamplingParams(max_tokens=12, ignore_eos=True)
  prompt = _prompts([prompt_len], seed=0)
  config = dataclasses.replace(CONFIG, enable_prefix_caching=caching)
  _, (want,) = _run(params, config, prompt, sampling)
  assert want.num_preemptions == 0 and len(want.output_token_ids) == 12
  engine, (req,) = _run(params, dataclasses.replace(config, force_preempt_every=3),
                        prompt, sampling)
  assert (req.outcome, req.finish_reason) == ("completed", "length")
  assert req.output_token_ids == want.output_token_ids
  # Each preemption follows a new token (the first one's is the prefill's)
  # and one more comes after the last: fewer preemptions than tokens.
  assert 0 < req.num_preemptions < len(req.output_token_ids)
  assert engine.num_preemptions == req.num_preemptions
