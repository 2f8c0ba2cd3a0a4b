"""Speculative decoding through the engine: n-gram drafts verified in the
one ragged step leave every request's tokens as they are without
speculation (greedy and seeded, with prefix caching and preemptions), the
drafts that match are accepted, and a request's seeded tokens follow the
same distribution."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from models import llama
from serving.engine import speculative
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from tests.serving.engine_testing import CFG, assert_pages_free

BASE = EngineConfig.preset("tiny", min_bucket=8)     # page_size 4, 63 usable pages
SPEC = dataclasses.replace(BASE, speculative="ngram:k=3,n=2")
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=3)


def _repetitive_prompts(lengths, seed=0):
  """Prompts repeating a 3-token phrase: the n-gram proposer finds matches."""
  rng = np.random.default_rng(seed)
  return [(rng.integers(3, CFG.vocab_size, size=3).tolist() * 10)[:n] for n in lengths]


PROMPTS = _repetitive_prompts([14, 13, 12, 11, 5, 4])


def _run(params, config, sampling, prompts=PROMPTS, **kwargs):
  engine = Engine(CFG, params, config)
  reqs = [engine.add_request(f"r{i}", p, sampling, **kwargs) for i, p in enumerate(prompts)]
  engine.run()
  return [r.output_token_ids for r in reqs], engine, reqs


@pytest.fixture(scope="module")
def plain(params):
  return {name: _run(params, BASE, s)[0] for name, s in (("greedy", GREEDY),
                                                          ("seeded", SEEDED))}


EXTRAS = {"prefix_caching": {}, "no_prefix_caching": {"enable_prefix_caching": False},
          "recompute": {"force_preempt_every": 3},
          "swap": {"force_preempt_every": 3, "preemption_mode": "swap"}}
# The default suite runs one of the eight pairs (speculation under swap and
# greedy decoding: tests/serving/test_speculative_draft.py's default test);
# -m extended the rest.
DEFAULT_PAIRS = {("seeded", "recompute")}


@pytest.mark.parametrize("kind, extra", [
    pytest.param(kind, EXTRAS[name], id=f"{kind}-{name}",
                 marks=[] if (kind, name) in DEFAULT_PAIRS else [pytest.mark.extended])
    for kind in ("greedy", "seeded") for name in EXTRAS])
def test_tokens_with_speculation_equal_the_tokens_without(params, plain, kind, extra):
  sampling = GREEDY if kind == "greedy" else SEEDED
  tokens, engine, reqs = _run(params, dataclasses.replace(SPEC, **extra), sampling)
  assert tokens == plain[kind]
  assert all(len(t) == 16 for t in tokens)
  assert all(r.outcome == "completed" for r in reqs)
  counts = engine.spec_counts
  assert counts.num_draft_tokens > 0
  assert counts.num_accepted_tokens <= counts.num_draft_tokens
  # Position j accepted only after positions < j: a non-increasing profile.
  per_pos = counts.accepted_per_pos
  assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
  assert sum(per_pos) == counts.num_accepted_tokens
  if kind == "greedy":     # the repeated phrases make drafts match
    assert counts.num_accepted_tokens > 0
  if "force_preempt_every" in extra:
    assert engine.num_preemptions > 0
  assert_pages_free(engine)


def test_each_accepted_draft_saves_one_decode_row(params):
  """Over all requests, the decode rows scheduled with speculation are the
  rows without it less the drafts accepted (each verified row emits its
  accepted drafts and one token more)."""
  def decode_rows(config):
    engine = Engine(CFG, params, config)
    engine.record_plans = True
    for i, p in enumerate(PROMPTS):
      engine.add_request(f"r{i}", p, GREEDY)
    engine.run()
    rows = sum(kind == "decode_row" for entry in engine.plan_log
               for _, _, _, kind in entry["scheduled"])
    return rows, engine

  plain_rows, _ = decode_rows(BASE)
  spec_rows, engine = decode_rows(SPEC)
  accepted = engine.spec_counts.num_accepted_tokens
  assert accepted > 0
  assert spec_rows == plain_rows - accepted


def test_acceptance_facts_are_learned_per_request_and_client(params):
  _, engine, _ = _run(params, SPEC, GREEDY)
  state = engine.state
  counts = engine.spec_counts
  # Slots are reused, so per-request counters restart; the per-client
  # totals (every request is client 0) hold every verified draft.
  assert int(state.client_draft_tokens[0]) == counts.num_draft_tokens
  assert int(state.client_accepted_tokens[0]) == counts.num_accepted_tokens


def test_logprobs_with_speculation_equal_the_logprobs_without(params):
  _, _, plain_reqs = _run(params, BASE, GREEDY, logprobs=True)
  _, engine, spec_reqs = _run(params, SPEC, GREEDY, logprobs=True)
  assert engine.spec_counts.num_accepted_tokens > 0
  for a, b in zip(plain_reqs, spec_reqs):
    assert len(b.output_logprobs) == len(b.output_token_ids) == 16
    np.testing.assert_allclose([x.logprob for x in b.output_logprobs],
                               [x.logprob for x in a.output_logprobs], rtol=0, atol=1e-5)
    assert [x.top_ids.tolist() for x in b.output_logprobs] == [
        x.top_ids.tolist() for x in a.output_logprobs]


def test_stop_tokens_inside_accepted_drafts_end_the_request_there(params, plain):
  """A stop id among the tokens a verified row offers ends the request at
  it: nothing after it is published."""
  want = plain["greedy"][0]
  stop = want[5]
  first = want.index(stop)
  sampling = SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=(stop,))
  tokens, engine, reqs = _run(params, SPEC, sampling, prompts=PROMPTS[:1])
  assert tokens[0] == want[:first + 1]
  assert reqs[0].finish_reason == "stop"
  assert_pages_free(engine)


@pytest.mark.extended     # 300 seeded runs; the default run keeps the seeded token pair
def test_seeded_speculation_draws_from_the_same_distribution():
  """Requests with seeds 0..N-1 under speculation and seeds N..2N-1
  without: the tokens they draw at output indices 2 and 3 (which verified
  drafts produce) are two independent samples of one distribution each if
  speculation keeps the sampling distribution (chi-square tests of
  homogeneity, tokens seen fewer than 5 times pooled). The model is the
  tiny one at its default scale, peaked enough that drafts are accepted
  under top-k 3 sampling at temperature 1."""
  params = llama.init_params(CFG, jax.random.PRNGKey(0))
  n = 150

  def draws(config, seeds):
    engine = Engine(CFG, params, dataclasses.replace(config, max_request_slots=64))
    reqs = [engine.add_request(f"s{s}", PROMPTS[0], SamplingParams(
        max_tokens=4, ignore_eos=True, temperature=1.0, top_k=3, seed=s)) for s in seeds]
    engine.run()
    return np.array([r.output_token_ids for r in reqs]), engine

  spec, engine = draws(SPEC, range(n))
  base, _ = draws(BASE, range(n, 2 * n))
  assert engine.spec_counts.num_accepted_tokens >= 10
  for index in (2, 3):
    a, b = spec[:, index], base[:, index]
    tokens, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    common = tokens[counts >= 5]
    table = np.array([[np.sum(x == t) for t in common] + [np.sum(~np.isin(x, common))]
                      for x in (a, b)])
    table = table[:, table.sum(axis=0) > 0]
    assert table.shape[1] >= 3, table          # a distribution, not one token
    _, p_value, _, _ = stats.chi2_contingency(table)
    assert p_value > 1e-3, (index, p_value, table)


def test_ngram_proposer_takes_the_longest_latest_match():
  stream = jnp.array([[5, 6, 7, 9, 5, 6, 8, 5, 6, 0, 0, 0],
                      [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0],
                      [7, 8, 7, 8, 7, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
  length = jnp.array([9, 4, 5])
  drafts = speculative.ngram_drafts(stream, length, k=3, n=2)
  # Row 0: suffix (5, 6) last occurred at 4 -> 8, 5, 6. Row 1: no earlier
  # occurrence of 4 -> 4, 4, 4. Row 2: suffix (8, 7) at 1 -> 8, 7 and the
  # known tokens end there (clipped to the last known token, 7).
  assert drafts.tolist() == [[8, 5, 6], [4, 4, 4], [8, 7, 7]]


@pytest.mark.parametrize("text, message", [
    ("ngram:k=0", "k must be an int >= 1, got 'ngram:k=0'"),
    ("ngram:k=x", "k must be an int >= 1"),
    ("ngram:n=-1", "n must be an int in [1, 16]"),
    ("ngram:n=99999999999", "n must be an int in [1, 16]"),
    ("ngram:k=4,k=5", "gives k twice"),
    ("ngram:m=2", "options are k=K, n=N, adaptive=0|1"),
    ("ngram:k=4,adaptive=2", "adaptive must be 0 or 1"),
    ("ngram:k=4,adaptive=1", "adaptive=1 needs fixed_ms=F and row_ms=F"),
    ("ngram:k=4,adaptive=1,fixed_ms=0,row_ms=1", "fixed_ms must be a finite number > 0"),
    ("ngram:k=4,adaptive=1,fixed_ms=5,row_ms=-1", "row_ms must be a finite number >= 0"),
    ("ngram:k=4,adaptive=1,fixed_ms=inf,row_ms=1", "fixed_ms must be a finite number > 0"),
    ("ngram:k=4,fixed_ms=5,row_ms=1", "fixed_ms, row_ms and per_row apply only with adaptive=1"),
    ("ngram:k=4,per_row=1", "fixed_ms, row_ms and per_row apply only with adaptive=1"),
    ("ngram:k=4,adaptive=1,fixed_ms=5,row_ms=1,per_row=2", "per_row must be 0 or 1"),
    ("medusa", "must be ngram"),
    ("draft:,k=4", "draft needs its model first"),
    ("draft:k=4", "draft needs its model first"),
    ("draft:/some/model,k=4,n=2", "n applies to ngram only"),
    ("ngram:k=256", "max_num_batched_tokens - 1"),
])
def test_bad_settings_are_refused_naming_the_field(text, message):
  with pytest.raises(ValueError, match="EngineConfig.speculative") as err:
    dataclasses.replace(BASE, speculative=text)
  assert message in str(err.value)


def test_the_adaptive_setting_round_trips_and_wraps_the_policy(params):
  """``adaptive=1`` wraps the policy in AdaptiveDraft with the stated step
  time; its tokens are those without speculation."""
  from scheduler.policy_speculative import AdaptiveDraft
  text = "ngram:k=3,n=2,adaptive=1,fixed_ms=20,row_ms=0.1"
  spec = speculative.Speculation.parse(text)
  assert (spec.k, spec.n, spec.adaptive, spec.fixed_ms, spec.row_ms) == (3, 2, 1, 20.0, 0.1)
  assert str(spec) == text
  tokens, engine, _ = _run(params, dataclasses.replace(BASE, speculative=text), GREEDY,
                           prompts=PROMPTS[:3])
  policy = engine.policy
  assert isinstance(policy, AdaptiveDraft)
  assert (policy.k_max, policy.step_ms_fixed, policy.step_ms_per_row) == (3, 20.0, 0.1)
  assert tokens == _run(params, BASE, GREEDY, prompts=PROMPTS[:3])[0]
  assert engine.spec_counts.num_draft_tokens > 0


def test_server_streams_every_accepted_token_and_counts_drafts(params, plain):
  """Over HTTP, a completion with speculation streams the tokens of one
  without (usage counts them all), and /metrics carries vLLM's
  speculative-decoding counters, equal to the engine's."""
  from prometheus_client.parser import text_string_to_metric_families

  from serving.http.server import OpenAIServer
  from tests.serving.engine_testing import HttpApp, tiny_tokenizer

  tok = tiny_tokenizer()
  engine = Engine(CFG, params, SPEC)
  app = HttpApp(OpenAIServer(engine, tok, "tiny").app, join_timeout_s=30)
  try:
    for i, prompt in enumerate(PROMPTS[:3]):
      r = app.http.post("/v1/completions", json={
          "model": "tiny", "prompt": prompt, "max_tokens": 16, "ignore_eos": True,
          "temperature": 0})
      assert r.status_code == 200, r.text
      body = r.json()
      assert body["usage"]["completion_tokens"] == 16
      assert body["choices"][0]["text"] == tok.decode(plain["greedy"][i],
                                                      skip_special_tokens=True)
    text = app.http.get("/metrics").text
    samples = {(s.name, s.labels.get("position")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    counts = engine.spec_counts
    assert counts.num_accepted_tokens > 0
    assert samples["vllm:spec_decode_num_drafts_total", None] == counts.num_drafts
    assert samples["vllm:spec_decode_num_draft_tokens_total", None] == counts.num_draft_tokens
    assert samples["vllm:spec_decode_num_accepted_tokens_total", None] == (
        counts.num_accepted_tokens)
    assert samples["vllm:spec_decode_num_accepted_tokens_per_pos_total", "0"] == (
        counts.accepted_per_pos[0])
  finally:
    app.close()
