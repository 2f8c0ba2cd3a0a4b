"""Engine behaviour on the tiny random-weight model (black-box scenarios).

Engines with equal (model, engine) configs share compiled programs, so the
tests reuse a handful of configs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import llama, quant
from serving.cli import launch
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.kv.pages import NULL_PAGE
from tests.serving.engine_testing import CFG, prompts as _prompts

BASE = EngineConfig.preset("tiny", min_bucket=8)   # 4 seqs, 16-token budget, chunk cap 8,
                                                   # token buckets 8 and 16
SMALL_CHUNKS = dataclasses.replace(BASE, long_prefill_token_threshold=3)
ONE_BUCKET = EngineConfig.preset("tiny")      # the preset's one 16-row bucket: one step
                                              # program per kernel path
FEW_PAGES = dataclasses.replace(BASE, num_pages=12)   # 11 usable pages of 4 rows
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _run(params, config, prompts, sampling=GREEDY, model_cfg=CFG):
  engine = Engine(model_cfg, params, config)
  reqs = engine.generate(prompts, sampling)
  return engine, reqs


def _assert_all_pages_free(engine):
  """No page is referenced; each is free or cached and evictable, once."""
  pages = engine.pages
  assert np.all(np.asarray(pages.page_table) == NULL_PAGE)
  assert not np.asarray(pages.refcount).any()
  free = np.asarray(pages.free_stack)[: int(pages.num_free)].tolist()
  cached = np.flatnonzero(np.asarray(pages.cached)).tolist()
  assert sorted(free + cached) == list(range(1, engine.config.num_pages))


def test_the_test_model_reads_its_context(params):
  """Guards every exactness test here: with the same last token, different
  prefixes must give different greedy continuations (a random model at
  layer_scale 1 repeats its last token and would hide any KV-cache error)."""
  prompts = [p[:-1] + [77] for p in _prompts([10] * 4, seed=9)]
  _, reqs = _run(params, BASE, prompts)
  outputs = {tuple(r.output_token_ids) for r in reqs}
  assert len(outputs) == len(prompts)
  flat = llama.init_params(CFG, jax.random.PRNGKey(1))
  _, repeat = _run(flat, BASE, prompts[:1])
  assert repeat[0].output_token_ids == [77] * GREEDY.max_tokens


def test_batch_invariance_alone_mixed_and_across_chunk_sizes(params):
  prompts = _prompts([5, 17, 3, 30, 9, 12])
  alone = [_run(params, BASE, [p])[1][0].output_token_ids for p in prompts]
  _, mixed = _run(params, BASE, prompts)
  _, chunked = _run(params, SMALL_CHUNKS, prompts)
  assert [r.output_token_ids for r in mixed] == alone
  assert [r.output_token_ids for r in chunked] == alone
  assert all(len(t) == GREEDY.max_tokens for t in alone)


@pytest.mark.extended        # ~60 s; the int8 weights run by default
def test_bfloat16_weights_keep_tokens_batch_invariant(params):
  """bfloat16 weights (native bfloat16 GEMMs, ``llama.linear``, padded to
  their 4-row class): each request's tokens alone (1-row decode buckets)
  equal its tokens beside the others."""
  params16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  config = dataclasses.replace(BASE, dtype="bfloat16")
  prompts = _prompts([5, 17, 3], seed=7)
  alone = [_run(params16, config, [p])[1][0].output_token_ids for p in prompts]
  _, mixed = _run(params16, config, prompts)
  assert [r.output_token_ids for r in mixed] == alone
  assert len(set(map(tuple, alone))) == len(alone)


@pytest.mark.extended   # ~25 s; test_quant checks int8 rows bitwise at every bucket
def test_int8_weights_keep_tokens_batch_invariant(params):
  """``weights="int8"``: the engine quantizes the float32 parameters
  (``models.quant``; the caller's tree left float32) and each request's
  greedy tokens alone equal its tokens beside the others (exact int32
  sums, per-row activation scales)."""
  config = dataclasses.replace(BASE, weights="int8")
  prompts = _prompts([5, 17, 3], seed=7)
  engine, mixed = _run(params, config, prompts)
  assert quant.is_quantized(engine.params) and not quant.is_quantized(params)
  assert engine.params["lm_head"].q.dtype == jnp.int8
  alone = [_run(params, config, [p])[1][0].output_token_ids for p in prompts]
  assert [r.output_token_ids for r in mixed] == alone
  assert len(set(map(tuple, alone))) == len(alone)
  assert all(len(t) == GREEDY.max_tokens for t in alone)
  params16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  with pytest.raises(ValueError, match="float32"):
    Engine(CFG, params16, config)


@pytest.mark.extended   # ~18 s; test_quant checks the int8 GEMMs bitwise
def test_int8_gemm_amx_and_xla_give_the_same_tokens(params):
  """``int8_gemm``: the AMX kernel (weights in the tile layout, each layer's
  stack indexed inside the kernel) and XLA's GEMM give every request the
  same greedy tokens (the same bits); "amx" where it cannot run and unknown
  values are refused by name."""
  from models import amx
  prompts = _prompts([5, 17, 3], seed=11)
  xla_engine, xla = _run(params, dataclasses.replace(BASE, weights="int8", int8_gemm="xla"),
                         prompts)
  assert xla_engine.params["lm_head"].layout == "kn"
  with pytest.raises(ValueError, match="int8_gemm must be one of"):
    dataclasses.replace(BASE, weights="int8", int8_gemm="tiles")
  with pytest.raises(ValueError, match="int8_gemm must be 'auto' or 'xla' with weights 'dense'"):
    dataclasses.replace(BASE, int8_gemm="amx")
  if not amx.available():
    with pytest.raises(ValueError, match="int8_gemm 'amx'"):
      Engine(CFG, params, dataclasses.replace(BASE, weights="int8", int8_gemm="amx"))
    pytest.skip(f"AMX int8 kernel unavailable: {amx.unavailable_reason()}")
  amx_engine, tiled = _run(params, dataclasses.replace(BASE, weights="int8", int8_gemm="amx"),
                           prompts)
  assert amx_engine.params["lm_head"].layout == "tiles"
  assert [r.output_token_ids for r in tiled] == [r.output_token_ids for r in xla]
  assert all(r.outcome == "completed" for r in tiled)


@pytest.mark.extended
def test_decode_gemm_xla_keeps_tokens_batch_invariant_and_native_resolves(params):
  """``decode_gemm``: with "xla" (the path of CPUs without the kernel) each
  request's tokens alone equal its tokens beside the others, as with the
  default (``test_batch_invariance_alone_mixed_and_across_chunk_sizes``:
  "native" where it runs). "native" is refused by name where it cannot run
  or with bfloat16, int8 or a mesh; "auto" resolves to "xla" for bfloat16."""
  from models import rowgemm
  config = dataclasses.replace(BASE, decode_gemm="xla")
  prompts = _prompts([5, 17, 3], seed=7)
  engine, mixed = _run(params, config, prompts)
  assert engine.decode_gemm == "xla" and llama.HEAD_PANELS not in engine.params
  alone = [_run(params, config, [p])[1][0].output_token_ids for p in prompts]
  assert [r.output_token_ids for r in mixed] == alone
  with pytest.raises(ValueError, match="decode_gemm must be one of"):
    dataclasses.replace(BASE, decode_gemm="mkl")
  for bad in (dict(dtype="bfloat16"), dict(weights="int8")):
    with pytest.raises(ValueError, match="decode_gemm must be 'auto' or 'xla' with dtype"):
      dataclasses.replace(BASE, decode_gemm="native", **bad)
  params16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  assert Engine(CFG, params16, dataclasses.replace(BASE, dtype="bfloat16")).decode_gemm == "xla"
  # The simulated executor runs no GEMM: nothing to resolve, build or refuse.
  simulated = dataclasses.replace(BASE, executor="simulated", decode_gemm="native")
  assert Engine(CFG, params, simulated).decode_gemm is None
  if not rowgemm.available():
    with pytest.raises(ValueError, match="decode_gemm 'native'"):
      Engine(CFG, params, dataclasses.replace(BASE, decode_gemm="native"))
    pytest.skip(f"float32 row kernel unavailable: {rowgemm.unavailable_reason()}")
  native = Engine(CFG, params, BASE)
  assert native.decode_gemm == "native"
  assert native.params[llama.HEAD_PANELS].shape == (CFG.vocab_size // 64, CFG.d_model, 64)
  assert isinstance(native.params["layers"]["mlp"]["w_up"], tuple)


def test_preemption_recomputes_and_keeps_tokens(params):
  prompts = _prompts([14, 13, 12, 11], seed=3)
  _, reference = _run(params, BASE, prompts)
  engine, preempted = _run(params, FEW_PAGES, prompts)
  assert engine.num_preemptions > 0
  assert sum(r.num_preemptions for r in preempted) == engine.num_preemptions
  assert [r.output_token_ids for r in preempted] == [r.output_token_ids for r in reference]
  assert all(r.outcome == "completed" for r in preempted)
  _assert_all_pages_free(engine)


FEW_PAGES_SWAP = dataclasses.replace(FEW_PAGES, preemption_mode="swap")


@pytest.mark.extended
def test_bfloat16_kv_cache_is_stored_as_bits_and_swaps_them_back(params):
  """``kv_dtype="bfloat16"`` with float32 weights: the cache is stored as
  bfloat16 bits (uint16, ``attention.ragged.KV_BITS``; the attention and
  model tests check its values), a request's tokens do not depend on its
  batch, and swap preemption brings the bits back exactly (the tokens of a
  run with ample pages)."""
  kv16 = dataclasses.replace(BASE, kv_dtype="bfloat16")
  prompts = _prompts([14, 13, 12, 11], seed=3)
  engine, mixed = _run(params, kv16, prompts)
  assert engine.kv.k.dtype == engine.kv.v.dtype == jnp.uint16
  assert _run(params, kv16, prompts[1:2])[1][0].output_token_ids == mixed[1].output_token_ids
  engine, swapped = _run(params, dataclasses.replace(FEW_PAGES_SWAP, kv_dtype="bfloat16"),
                         prompts)
  assert engine.num_preemptions > 0 and engine.swap.stats()["swapped_in"] > 0
  assert [r.output_token_ids for r in swapped] == [r.output_token_ids for r in mixed]


@pytest.mark.parametrize("policy", [
    "sarathi_serve", pytest.param("vllm_v1", marks=pytest.mark.extended)])
def test_swap_preemption_preserves_kv_exactly_and_keeps_tokens(params, policy):
  """§0x0C exact preservation: the victim's pages go to host memory and come
  back, so it resumes at its frontier with no REBUILD rows, and every request
  emits the tokens it emits with ample pages."""
  prompts = _prompts([14, 13, 12, 11], seed=3)
  ample = dataclasses.replace(BASE, policy=policy)
  _, reference = _run(params, ample, prompts)
  engine, swapped = _run(params, dataclasses.replace(FEW_PAGES_SWAP, policy=policy),
                         prompts)
  assert engine.num_preemptions > 0
  assert [r.output_token_ids for r in swapped] == [r.output_token_ids for r in reference]
  assert all(r.outcome == "completed" for r in swapped)
  stats = engine.swap.stats()
  assert stats["swapped_out"] == stats["swapped_in"] == engine.num_preemptions
  assert stats["bytes_out"] == stats["bytes_in"] > 0
  assert stats["fallbacks_to_recompute"] == 0 and engine.swap.used_bytes == 0
  # No rebuild: not one row recomputed, per request and in the ledger.
  assert all(r.recompute_tokens == 0 for r in swapped)
  assert int(jnp.sum(engine.state.recompute_rows)) == 0
  resumed = [r for r in swapped if r.num_preemptions]
  assert resumed and all(r.queue_record.queue_state == "RUNNING" for r in resumed)
  assert all(r.queue_record.suspension_epoch == r.num_preemptions for r in resumed)
  _assert_all_pages_free(engine)


def test_recompute_preemption_rebuilds_what_swap_preserves(params):
  prompts = _prompts([14, 13, 12, 11], seed=3)
  engine, reqs = _run(params, FEW_PAGES, prompts)
  rebuilt = sum(r.recompute_tokens for r in reqs)
  # The ledger's recompute rows (REBUILD rows, and prompt rows re-run after a
  # preemption during prefill) are exactly the ResumeTickets' overhead, and
  # service counts every prompt and output row once.
  assert rebuilt > 0 and int(jnp.sum(engine.state.recompute_rows)) == rebuilt
  served = sum(len(r.prompt_token_ids) + len(r.output_token_ids) - 1 for r in reqs)
  assert int(jnp.sum(engine.state.service_rows)) == served
  assert engine.swap.stats()["swapped_out"] == 0


def test_swap_space_too_small_falls_back_to_recompute(params):
  prompts = _prompts([14, 13, 12, 11], seed=3)
  _, reference = _run(params, BASE, prompts)
  tiny_swap = dataclasses.replace(FEW_PAGES_SWAP, swap_space_mb=1e-6)
  engine, reqs = _run(params, tiny_swap, prompts)
  stats = engine.swap.stats()
  assert stats["swapped_out"] == 0 and stats["fallbacks_to_recompute"] > 0
  assert sum(r.recompute_tokens for r in reqs) > 0
  assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in reference]


def test_abort_while_swapped_out_cancels_and_drops_the_copy(params):
  engine = Engine(CFG, params, FEW_PAGES_SWAP)
  prompts = _prompts([14, 13, 12, 11], seed=3)
  reqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
  while engine.has_unfinished() and engine.swap.stats()["swapped_out"] == 0:
    engine.step()
  victim = next(r for r in reqs if engine.swap.get(r.request_id) is not None)
  engine.abort(victim.request_id)
  assert victim.outcome == "cancelled" and victim.queue_record.queue_state == "CANCELLED"
  assert engine.swap.get(victim.request_id) is None and engine.swap.used_bytes == 0
  engine.run()
  assert all(r.finished for r in reqs)
  _assert_all_pages_free(engine)


def test_request_that_can_never_fit_is_rejected_and_others_finish(params):
  engine = Engine(CFG, params, FEW_PAGES)
  big = engine.add_request("big", _prompts([40])[0], SamplingParams(max_tokens=20))
  ok = engine.add_request("ok", _prompts([6])[0], GREEDY)
  engine.run(max_iterations=100)
  assert big.outcome == "rejected" and "needs 15 KV pages" in big.finish_reason
  assert ok.outcome == "completed" and len(ok.output_token_ids) == 6
  _assert_all_pages_free(engine)


def test_abort_at_every_lifecycle_stage_frees_every_page(params):
  config = dataclasses.replace(BASE, max_request_slots=4)
  engine = Engine(CFG, params, config)
  prompts = _prompts([20, 20, 3, 3, 3, 3, 3], seed=5)
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, ignore_eos=True))
  engine.abort("r6")                          # pending on the host (no slot yet)
  engine.step()                               # r0 prefilling (chunk cap 8 < 20)
  assert engine.requests["r0"].slot >= 0 and not engine.requests["r0"].output_token_ids
  engine.abort("r0")                          # mid-prefill
  for _ in range(4):
    engine.step()
  assert engine.requests["r2"].output_token_ids
  engine.abort("r2")                          # mid-decode
  engine.abort("r5")                          # waiting in a slot or on the host
  engine.run(max_iterations=200)
  outcomes = {rid: r.outcome for rid, r in engine.requests.items()}
  assert outcomes == {"r0": "cancelled", "r1": "completed", "r2": "cancelled",
                      "r3": "completed", "r4": "completed", "r5": "cancelled",
                      "r6": "cancelled"}
  _assert_all_pages_free(engine)


def test_stop_rules(params):
  prompt = _prompts([7], seed=9)[0]
  _, [free_run] = _run(params, BASE, [prompt], SamplingParams(max_tokens=8, ignore_eos=True))
  tokens = free_run.output_token_ids
  assert free_run.finish_reason == "length" and len(tokens) == 8
  # A stop token ends the request where it is first generated.
  stop = tokens[2]
  first = tokens.index(stop)
  _, [stopped] = _run(params, BASE, [prompt], SamplingParams(max_tokens=8, stop_token_ids=(stop,)))
  assert stopped.finish_reason == "stop" and stopped.output_token_ids == tokens[: first + 1]
  # EOS: make the model's first greedy token its EOS.
  eos_cfg = dataclasses.replace(CFG, eos_token_ids=(tokens[0],))
  _, [eos] = _run(params, BASE, [prompt], SamplingParams(max_tokens=8), model_cfg=eos_cfg)
  assert eos.finish_reason == "eos" and eos.output_token_ids == tokens[:1]
  _, [ignored] = _run(params, BASE, [prompt], SamplingParams(max_tokens=8, ignore_eos=True),
                      model_cfg=eos_cfg)
  assert ignored.output_token_ids == tokens
  # min_tokens masks EOS until enough tokens were emitted.
  _, [held] = _run(params, BASE, [prompt], SamplingParams(max_tokens=8, min_tokens=3),
                   model_cfg=eos_cfg)
  assert len(held.output_token_ids) >= 3 and tokens[0] not in held.output_token_ids[:3]


def test_seeded_sampling_is_repeatable_and_independent_of_the_batch(params):
  prompts = _prompts([6, 9, 4], seed=11)
  hot = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
  _, together = _run(params, BASE, prompts, hot)
  alone = [_run(params, BASE, [p], hot)[1][0].output_token_ids for p in prompts]
  assert [r.output_token_ids for r in together] == alone
  other = SamplingParams(max_tokens=6, temperature=1.0, seed=8, ignore_eos=True)
  _, reseeded = _run(params, BASE, prompts, other)
  assert [r.output_token_ids for r in reseeded] != alone


@pytest.mark.parametrize("prompt, sampling, match", [
    ([], GREEDY, "prompt_token_ids must be non-empty"),
    ([5] * 64, GREEDY, "max_model_len=64"),
    ([5, CFG.vocab_size], GREEDY, r"prompt_token_ids must be in \[0, 512\)"),
    ([5], SamplingParams(stop_token_ids=tuple(range(9))), "stop_token_ids holds at most 8"),
])
def test_bad_requests_name_the_field(params, prompt, sampling, match):
  engine = Engine(CFG, params, BASE)
  with pytest.raises(ValueError, match=match):
    engine.add_request("bad", prompt, sampling)
  assert not engine.has_unfinished()


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), r"max_tokens must be in \[1, 2\*\*31\)"),
    (dict(top_k=2**40), r"top_k must be in \[0, 2\*\*31\)"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(temperature=-1.0), "temperature must be finite and in \\[0, 3.403e\\+38\\]"),
    (dict(temperature=float("inf")), "temperature must be finite and in \\[0, 3.403e\\+38\\]"),
])
def test_bad_sampling_params_name_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kwargs)


def test_bad_weights_settings_name_the_field():
  with pytest.raises(ValueError, match=r"EngineConfig.weights must be one of \('dense', "
                                       r"'int8'\), got 'int4'"):
    EngineConfig(weights="int4")
  with pytest.raises(ValueError, match=r"EngineConfig.weights must be 'dense' when dtype is "
                                       r"'bfloat16' .*float32.*got 'int8'"):
    EngineConfig(weights="int8", dtype="bfloat16")
  with pytest.raises(ValueError, match=r"EngineConfig.weights must be 'dense' with mesh "
                                       r"'model:2' \(int8 weights run on one device.*got 'int8'"):
    EngineConfig(weights="int8", mesh="model:2")
  assert EngineConfig(weights="dense", dtype="bfloat16", mesh="model:2").weights == "dense"
  assert dataclasses.replace(BASE, weights="int8").weights == "int8"


def test_priority_beyond_int32_is_refused_before_it_reaches_the_device(params):
  engine = Engine(CFG, params, BASE)
  with pytest.raises(ValueError, match=r"priority must be in \[-2\*\*31, 2\*\*31\)"):
    engine.add_request("p", [5, 6], GREEDY, priority=2**40)
  assert not engine.has_unfinished() and "p" not in engine.requests


def test_duplicate_request_id_is_refused(params):
  engine = Engine(CFG, params, BASE)
  engine.add_request("a", [5, 6], GREEDY)
  with pytest.raises(ValueError, match="already in use"):
    engine.add_request("a", [5, 6], GREEDY)


def test_compiled_programs_are_bounded_by_the_buckets(params):
  engine, reqs = _run(params, BASE, _prompts([3, 25, 7, 16, 2, 11, 9, 30], seed=13),
                      SamplingParams(max_tokens=12, ignore_eos=True))
  assert engine.num_iterations > 20
  programs = engine.compiled_programs()
  assert programs["arrive"] == 1
  assert programs["step"] <= len(BASE.token_buckets) == 2
  assert "execute" not in programs and "publish" not in programs
  assert sum(programs.values()) <= 16


def test_an_iteration_plans_once_and_runs_one_step_program(params):
  """Without preemption every iteration is one plan program, one step
  program in the bucket of the rows bound (``PlanFacts.rows_bound``), and two fetches
  (the plan's facts, the step's), one where the plan made with the last
  step was taken (``plan_ahead``); a second engine of the same config
  compiles nothing and gives the same tokens, and a late arrival changes
  nothing of the early request's tokens."""
  prompts = _prompts([3, 25, 7, 16, 2, 11], seed=21)
  sampling = SamplingParams(max_tokens=9, ignore_eos=True)
  first, reqs = _run(params, BASE, prompts, sampling)
  assert first.num_iterations > 10
  assert set(first.buckets_used) == set(BASE.token_buckets)
  assert first.policy_evaluations == first.num_iterations
  assert first.host_fetches == 2 * first.num_iterations - first.plan_ahead.used
  assert first.plan_ahead.used >= 5
  # Every decode-only iteration (at most 4 rows, bound included) ran in the
  # 8-row bucket.
  assert first.buckets_used[8] >= sampling.max_tokens - 1
  assert first.compiled_programs()["plan"] == 1
  before = first.compiled_programs()
  again, reqs2 = _run(params, BASE, prompts, sampling)
  assert again.compiled_programs() == before
  assert again.host_fetches == first.host_fetches
  assert [r.output_token_ids for r in reqs2] == [r.output_token_ids for r in reqs]
  late = Engine(CFG, params, BASE)
  early = late.add_request("early", prompts[0], sampling)
  while len(early.output_token_ids) < 3:
    late.step()
  late.add_request("late", prompts[1], sampling)
  late.run()
  assert late.buckets_used[16] >= 1
  assert late.policy_evaluations == late.num_iterations
  assert late.requests["late"].output_token_ids == reqs[1].output_token_ids
  assert early.output_token_ids == reqs[0].output_token_ids


def test_the_plan_log_changes_no_token_and_no_clock(params):
  """Keeping the plan log adds one fetch per iteration and nothing else: on
  a clock that ticks 1 ms per reading, every token and every emission time
  match a run without it, and each finished slot's device clocks equal the
  host's emission times of its request (the launch stamps corrected one
  iteration late)."""
  prompts = _prompts([3, 12, 7, 5], seed=22)
  runs = []
  for log in (False, True):
    ticks = iter(range(10**6))
    engine = Engine(CFG, params, BASE, clock=lambda: next(ticks) / 1000.0)
    engine.record_plans = log
    reqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=2 + 3 * i,
                                                          ignore_eos=True))
            for i, p in enumerate(prompts)]
    engine.run()
    assert engine.host_fetches == ((3 if log else 2) * engine.num_iterations
                                   - engine.plan_ahead.used)
    assert len(engine.plan_log) == (engine.num_iterations if log else 0)
    engine.step()          # nothing left: the pending correction is applied
    state = jax.device_get(engine.state)
    runs.append(([r.output_token_ids for r in reqs], [r.token_times_ms for r in reqs],
                 state.first_token_ms, state.last_token_ms))
    for r in reqs[:-1]:
      assert state.first_token_ms[r.slot] == np.float32(r.token_times_ms[0])
      assert state.last_token_ms[r.slot] == np.float32(r.token_times_ms[-1])
  (tok_a, times_a, first_a, last_a), (tok_b, times_b, first_b, last_b) = runs
  assert tok_a == tok_b and times_a == times_b
  np.testing.assert_array_equal(first_a, first_b)
  np.testing.assert_array_equal(last_a, last_b)


@dataclasses.dataclass(frozen=True)
class _CountingPolicy:
  """A registered policy whose every evaluation on the device appends to
  ``calls`` (a ``jax.debug.callback``, so a plan computed and thrown away
  counts too); everything else is the inner policy's."""

  inner: object
  calls: list = dataclasses.field(compare=False, hash=False)

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def __call__(self, manifest, state, alloc):
    jax.debug.callback(lambda: self.calls.append(1))
    return self.inner(manifest, state, alloc)


# Extended (~38 s on a 2-core EPYC): test_plan_ahead's count of policy
# evaluations (each a plan run or one made ahead) holds the claim by default.
@pytest.mark.extended
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_policy_is_evaluated_once_per_iteration(params, monkeypatch, mode):
  """Counted on the device, under forced preemptions (recompute, or swap:
  pages copied out and written back), KV pressure that preempts, a prefix
  cache that evicts, and a request the policy can never schedule: each
  ``step()`` evaluates the policy exactly once (planning ahead off: it
  evaluates the next iteration's policy early, ``test_plan_ahead``), and
  the plan program and each bucket's step program are traced once."""
  from serving.engine import programs as programs_lib
  calls = []
  real = programs_lib.make_policy
  monkeypatch.setattr(programs_lib, "make_policy",
                      lambda name, budgets: _CountingPolicy(real(name, budgets), calls))
  # A config no other test builds: its programs hold the counting policy.
  config = dataclasses.replace(BASE, policy="orca", num_pages=14, force_preempt_every=4,
                               preemption_mode=mode, num_clients=7)
  engine = Engine(CFG, params, config)
  engine.plan_ahead.enabled = False
  shared = _prompts([12], seed=50)[0]
  # Two waves: the second's prompts need the pages the first left cached.
  waves = [[shared + p for p in _prompts([3, 1, 2], seed=51)] + _prompts([9, 10], seed=52),
           [shared + _prompts([2], seed=55)[0]] + _prompts([12, 13], seed=54)]
  sampling = SamplingParams(max_tokens=10, ignore_eos=True)
  reqs, steps = [], 0
  wide = engine.add_request("wide", _prompts([20], seed=53)[0], GREEDY)   # > budget 16
  for wave in waves:
    reqs += [engine.add_request(f"r{len(reqs) + i}", p, sampling) for i, p in enumerate(wave)]
    while engine.has_unfinished():
      before = len(calls)
      engine.step()
      steps += 1
      assert len(calls) == before + 1
  assert wide.outcome == "rejected" and all(r.outcome == "completed" for r in reqs)
  assert engine.policy_evaluations == steps == engine.num_iterations + 1
  assert engine.num_preemptions > 0
  assert engine.prefix_cache.evictions > 0
  if mode == "swap":
    assert engine.swap.swapped_in > 0
  else:      # (under swap, KV pressure evicts the shared pages before wave 2)
    assert engine.prefix_cache.hits > 0
  programs = engine.compiled_programs()
  assert programs["plan"] == 1 and programs["step"] <= len(BASE.token_buckets)
  _assert_all_pages_free(engine)
  # The same tokens as without forced preemption and KV pressure.
  _, plain = _run(params, dataclasses.replace(BASE, policy="orca"), waves[0] + waves[1],
                  sampling)
  assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in plain]


# ~30 s; test_the_policy_is_evaluated_once_per_iteration counts the programs under preemption
@pytest.mark.extended
def test_preempting_iterations_share_the_step_programs(params):
  """Preemption, swap and forced preemptions add no model program: each
  settled plan runs in the step program of its bucket, and the slot
  writers read no policy and are shared with every other policy."""
  prompts = _prompts([3, 25, 7, 16], seed=14)
  first, _ = _run(params, BASE, prompts)
  assert set(first.buckets_used) == set(BASE.token_buckets)
  other = dataclasses.replace(BASE, policy="vtc", force_preempt_every=3,
                              preemption_mode="swap", long_prefill_token_threshold=5)
  engine, reqs = _run(params, other, prompts)
  assert all(r.outcome == "completed" for r in reqs) and engine.num_preemptions > 0
  assert engine._programs.arrive is first._programs.arrive
  programs = engine.compiled_programs()
  assert programs["step"] <= len(BASE.token_buckets) and programs["plan"] == 1
  assert "execute" not in programs


@pytest.mark.extended   # ~17 s: a regression run of its own
def test_a_growing_slot_table_keeps_the_pending_emission_correction():
  """The emissions of the iteration before the slot table grows move from
  their launch stamp to their publication time, as any iteration's do."""
  engine = Engine(CFG, None, dataclasses.replace(BASE, executor="simulated",
                                                 max_request_slots=4,
                                                 enable_prefix_caching=False))
  first = [engine.add_request(f"a{i}", p, GREEDY)
           for i, p in enumerate(_prompts([3] * 4, seed=40))]
  engine.step()                    # every prompt in one step: first tokens
  assert all(len(r.output_token_ids) == 1 for r in first) and engine.num_slots == 4
  for i, p in enumerate(_prompts([3] * 4, seed=41)):
    engine.add_request(f"b{i}", p, GREEDY)
  engine.step()                    # grows to 8 slots, then plans
  assert engine.num_slots == 8
  first_ms = np.asarray(jax.device_get(engine.state.first_token_ms))
  assert [first_ms[r.slot] for r in first] == [np.float32(r.token_times_ms[0]) for r in first]


def test_policy_that_can_never_schedule_a_request_rejects_it(params):
  # ORCA runs a whole prompt in one iteration: a 20-token prompt can never
  # fit the 16-token budget, so it is rejected and the rest keep running.
  engine = Engine(CFG, params, dataclasses.replace(BASE, policy="orca", executor="simulated"))
  wide = engine.add_request("wide", _prompts([20])[0], GREEDY)
  ok = engine.add_request("ok", _prompts([5])[0], GREEDY)
  news = []
  for _ in range(50):
    if not engine.has_unfinished():
      break
    news += engine.step()
  assert wide.outcome == "rejected" and "can never schedule" in wide.finish_reason
  # The step that rejects it says so (the server answers from this news).
  ends = [(o.request_id, o.outcome) for o in news if o.finished]
  assert ends == [("wide", "rejected"), ("ok", "completed")]
  assert ok.outcome == "completed" and len(ok.output_token_ids) == GREEDY.max_tokens
  _assert_all_pages_free(engine)


def test_fresh_engine_reuses_compiled_programs(params):
  # Bucket 16 is first compiled on an engine's later step; a fresh engine
  # whose first step needs bucket 16 must not compile it again.
  config = dataclasses.replace(BASE, max_request_slots=6, executor="simulated")
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x)), params)  # as loaded
  warm = Engine(CFG, params, config)
  warm.generate(_prompts([5], seed=30), GREEDY)
  warm.generate(_prompts([5, 17], seed=31), GREEDY)
  assert 16 in warm.buckets_used
  compiles = []
  listener = lambda event, seconds, **kw: (
      compiles.append(event) if "backend_compile" in event else None)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    fresh = Engine(CFG, params, config)
    fresh.generate(_prompts([5, 17], seed=31), GREEDY)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert fresh.buckets_used.get(16, 0) >= 1
  assert compiles == []


def test_warmup_borrows_the_engines_kv_cache(params, monkeypatch):
  """``launch.warmup``'s throwaway engines (one per slot-table size) run on
  the engine's own KV cache, allocating none of theirs (a server with
  glibc's freed pages kept held every copy: ~3 GB each on SmolLM2), and the
  warmed engine's tokens are a fresh engine's: the warm-up's stale rows
  are never read."""
  from serving.engine import programs as programs_lib
  made = []
  real = programs_lib.kv_cache
  monkeypatch.setattr(programs_lib, "kv_cache", lambda *a: made.append(1) or real(*a))
  config = dataclasses.replace(BASE, max_request_slots=4, max_queued_requests=8)
  engine = Engine(CFG, params, config)
  assert len(made) == 1
  launch.warmup(engine, num_requests=6)                  # slot tables 4 and 8
  assert len(made) == 1
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(engine.kv))
  prompts = _prompts([9, 14, 3], seed=41)
  warmed = [r.output_token_ids for r in engine.generate(prompts, GREEDY)]
  fresh = [r.output_token_ids for r in Engine(CFG, params, config).generate(prompts, GREEDY)]
  assert warmed == fresh
  with pytest.raises(ValueError, match="needs an engine that has not run"):
    launch.warmup(engine)                 # its pages hold the requests' prefixes


def test_nothing_compiles_after_warmup(params):
  """``launch.warmup`` compiles the plan program and each bucket's step
  program once: a later run that uses every bucket, hits the prefix cache,
  keeps the plan log and evicts compiles nothing."""
  config = BASE
  engine = Engine(CFG, params, config)
  launch.warmup(engine)
  before = engine.compiled_programs()
  assert before["step"] == len(config.token_buckets) and before["plan"] == 1
  compiles = []
  listener = lambda event, seconds, **kw: (
      compiles.append(event) if "backend_compile" in event else None)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    prompts = _prompts([9, 14, 3], seed=40)
    reqs = engine.generate(prompts, GREEDY)
    reqs += engine.generate(prompts[:1], GREEDY)   # a prefix hit
    engine.record_plans = True               # the plan log
    reqs += engine.generate(prompts[1:2], GREEDY)
    for r in reqs:
      engine.evict(r.request_id)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert set(engine.buckets_used) == set(config.token_buckets)
  assert reqs[3].prefix_hit_tokens > 0
  assert compiles == [] and engine.compiled_programs() == before

