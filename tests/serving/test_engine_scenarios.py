"""Black-box engine scenarios users rely on (§0x0C, §0x0D, §0x09), on the
tiny random-weight model, read through the engine's plan log."""

import dataclasses

import pytest

from serving.kv import pages as kv_pages
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from tests.serving.engine_testing import CFG, prompts as _prompts

BASE = EngineConfig.preset("tiny")            # 4 seqs, 16-token budget, chunk cap 8
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, top_k=50, seed=7)


def _engine(params, config, model_cfg=CFG):
  engine = Engine(model_cfg, params, config)
  engine.record_plans = True
  return engine


def _add(engine, prompts, sampling, priorities=None):
  priorities = priorities or [0] * len(prompts)
  return [engine.add_request(f"r{i}", p, sampling, priority=q)
          for i, (p, q) in enumerate(zip(prompts, priorities))]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_forced_preemption_every_3_iterations_keeps_every_token(params, mode, sampling):
  prompts = _prompts([9, 5, 12, 7, 3], seed=5)
  reference = Engine(CFG, params, BASE).generate(prompts, sampling)
  forced = dataclasses.replace(BASE, force_preempt_every=3, preemption_mode=mode)
  engine = _engine(params, forced)
  reqs = _add(engine, prompts, sampling)
  engine.run()
  assert engine.policy.policy_id == "sarathi_serve+preempt_every_3"
  preempted = [e for e in engine.plan_log if e["preempted"]]
  assert len(preempted) >= 3
  assert all(e["decision_id"] % 3 == 2 for e in preempted)
  assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in reference]
  assert all(r.outcome == "completed" for r in reqs)
  kinds = {k for e in engine.plan_log for (_, _, _, k) in e["scheduled"]}
  # Recompute rebuilds the victims' prefixes; swap restores them exactly.
  assert ("rebuild" in kinds) == (mode == "recompute")


def test_priority_order_with_a_two_sequence_cap(params):
  """Queue order (priority, arrival): the two highest priorities (lowest
  values) are admitted first; nothing is preempted while pages suffice."""
  config = dataclasses.replace(BASE, max_num_seqs=2, policy="vllm_v1_priority")
  engine = _engine(params, config)
  reqs = _add(engine, _prompts([6, 6, 6, 6], seed=1), GREEDY, priorities=[3, 1, 2, 0])
  engine.run()
  first = engine.plan_log[0]
  assert first["admitted"] == ["r3", "r1"]
  admitted = [name for e in engine.plan_log for name in e["admitted"]]
  assert admitted == ["r3", "r1", "r2", "r0"]
  assert engine.num_preemptions == 0
  assert all(len(e["scheduled"]) <= 2 for e in engine.plan_log)
  assert all(r.outcome == "completed" for r in reqs)


def test_equal_priorities_are_pure_fcfs(params):
  config = dataclasses.replace(BASE, max_num_seqs=2, policy="vllm_v1_priority")
  engine = _engine(params, config)
  _add(engine, _prompts([6, 6, 6, 6], seed=1), GREEDY)
  engine.run()
  admitted = [name for e in engine.plan_log for name in e["admitted"]]
  assert admitted == ["r0", "r1", "r2", "r3"]


def test_lowest_priority_running_request_is_the_victim_and_resumes(params):
  """§0x0D PRIORITY victim = max(priority, arrival) among running requests;
  it is later rebuilt (prompt + generated tokens recomputed) and emits the
  tokens it emits with ample pages."""
  prompts = _prompts([8, 8, 8, 8], seed=2)
  ample = dataclasses.replace(BASE, policy="vllm_v1_priority")
  reference = Engine(CFG, params, ample).generate(prompts, GREEDY)
  engine = _engine(params, dataclasses.replace(ample, num_pages=12))
  reqs = _add(engine, prompts, GREEDY, priorities=[0, 1, 2, 3])
  engine.run()
  prio = {r.request_id: r.priority for r in reqs}
  events = [e for e in engine.plan_log if e["preempted"]]
  assert events
  for e in events:
    kept = [n for n in e["running"] if n not in e["preempted"]]
    assert min(prio[n] for n in e["preempted"]) >= max(prio[n] for n in kept)
  victim = events[0]["preempted"][0]
  rebuilt = [(s, t) for e in engine.plan_log for (n, s, t, k) in e["scheduled"]
             if n == victim and k == "rebuild"]
  # Preempted once (iteration 3) and readmitted only when its whole rebuild
  # fits (the readmission guard): by then the three decoders' fourth pages
  # (iteration 5) have evicted its 2 cached prompt pages from the 12, so the
  # rebuild recomputes all 8 prompt rows in one chunk. (Readmitted as soon
  # as its next chunk fit, it took the 2 cached pages back at once and was
  # pushed out again.) Prefix reuse on a rebuild: test_prefix_cache.py.
  assert [r.num_preemptions for r in reqs] == [0, 0, 0, 1] and victim == "r3"
  assert rebuilt == [(0, 8)]
  assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in reference]


@pytest.mark.extended   # ~18 s; test_policies_runtime checks the 400/400/224 plan
def test_long_prefill_threshold_400_three_800_token_prompts(params):
  """vLLM's long_prefill_token_threshold through the engine (§0x09): budget
  1024, threshold 400, three 800-token prompts: 400/400/224, then
  400/400/224, then 1/1/352."""
  model_cfg = dataclasses.replace(CFG, max_position=2048)
  config = dataclasses.replace(
      BASE, policy="vllm_v1", max_num_batched_tokens=1024,
      long_prefill_token_threshold=400, max_num_seqs=4, page_size=16,
      num_pages=256, max_model_len=1024, min_bucket=1024)
  engine = _engine(params, config, model_cfg)
  _add(engine, _prompts([800, 800, 800], seed=4), SamplingParams(max_tokens=3,
                                                               ignore_eos=True))
  for _ in range(3):
    engine.step()
  widths = [[t - s for (_, s, t, _) in e["scheduled"]] for e in engine.plan_log]
  assert widths == [[400, 400, 224], [400, 400, 224], [1, 1, 352]]
  engine.run()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemptions_per_request_are_bounded_and_reported(params, mode):
  """No preemption livelock: past max_preemptions_per_request a request ends
  ``failed`` with the reason; the others finish and every page is free."""
  config = dataclasses.replace(BASE, force_preempt_every=2, preemption_mode=mode,
                               max_preemptions_per_request=1)
  engine = _engine(params, config)
  reqs = _add(engine, _prompts([9, 5], seed=6), SamplingParams(max_tokens=8,
                                                                 ignore_eos=True))
  engine.run(max_iterations=200)
  failed = [r for r in reqs if r.outcome == "failed"]
  assert failed and all(r.num_preemptions == 2 for r in failed)
  assert all("max_preemptions_per_request" in r.finish_reason for r in failed)
  assert all(r.outcome in ("completed", "failed") for r in reqs)
  free, evictable, in_use = map(int, kv_pages.page_census(engine.pages))
  assert (free + evictable, in_use) == (config.num_pages - 1, 0)
  assert engine.swap.used_bytes == 0


def test_max_model_len_past_the_models_context_is_refused(params):
  # The tiny model's context is 512 tokens; an engine may not hold longer
  # requests (their positions were never trained, and dynamic RoPE, read as
  # plain RoPE within the context, would rescale past it).
  config = dataclasses.replace(BASE, max_model_len=CFG.max_position + 1,
                               num_pages=64)
  with pytest.raises(ValueError, match=r"EngineConfig.max_model_len \(513\) must not exceed "
                                       r"the model's context, ModelConfig.max_position \(512\)"):
    Engine(CFG, params, config)


def test_global_x64_is_refused_by_name(params):
  # Under jax_enable_x64 every policy's walk failed to trace at the first
  # step (int64 arithmetic in an int32 loop carry). The engine refuses it
  # when built, in a scope as well, and its programs refuse it when traced
  # (the flag turned on after the engine was built).
  import jax
  from scheduler import conformance
  refusal = r"jax_enable_x64 must be off where an Engine builds or traces its programs"
  jax.config.update("jax_enable_x64", True)
  try:
    with pytest.raises(ValueError, match=refusal + r" .* got on: unset JAX_ENABLE_X64"):
      Engine(CFG, params, BASE)
    with pytest.raises(ValueError, match=r"where the conformance kit builds"):
      conformance.check_policy("sarathi_serve")
  finally:
    jax.config.update("jax_enable_x64", False)
  with jax.enable_x64(True), pytest.raises(ValueError, match=refusal):
    Engine(CFG, params, BASE)
  engine = Engine(CFG, params, BASE)
  engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
  with jax.enable_x64(True), pytest.raises(ValueError, match=refusal):
    engine.step()
  while engine.has_unfinished():
    engine.step()
  assert engine.num_iterations >= 2


def test_an_adopted_kv_cache_of_other_configs_is_refused(params):
  # ``Engine(kv=...)`` adopts a cache (launch.warmup's engines borrow one);
  # one of other configs used to fail only inside the first step's program.
  engine = Engine(CFG, params, BASE)
  borrower = Engine(CFG, params, dataclasses.replace(BASE, max_request_slots=8), kv=engine.kv)
  assert borrower.kv is engine.kv
  pages = BASE.num_pages
  bigger = dataclasses.replace(BASE, num_pages=2 * pages)
  with pytest.raises(ValueError, match=r"Engine\(kv=\.\.\.\)\S+ must be float32\[.*"
                                       rf"\(num_pages={2 * pages}, page_size=.*got float32\["):
    Engine(CFG, params, bigger, kv=engine.kv)
  with pytest.raises(ValueError, match=r"Engine\(kv=\.\.\.\) must be a KV cache of these "
                                       r"configs' structure"):
    Engine(CFG, params, BASE, kv={"k": engine.kv})
