"""Engine logprobs: output and prompt tokens' raw logprobs from the device
program, against the float64 numpy model; independent of batch mates and
chunking; no change to tokens; no prefix hit for a prompt-logprob request."""

import numpy as np

from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.engine.sampling import MAX_LOGPROBS
from tests.models.llama_reference import dense_forward
from tests.serving.engine_testing import CFG, prompts

BASE = EngineConfig.preset("tiny")          # 8-token prefill chunks, 16-row bucket
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def _reference_logprobs(params, tokens):
  """f64[L, V] log_softmax of the float64 model's logits at each position."""
  logits = dense_forward(params, CFG, tokens)["logits"]
  top = logits.max(-1, keepdims=True)
  return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def _check_against_reference(params, req):
  seq = req.prompt_token_ids + req.output_token_ids
  ref = _reference_logprobs(params, seq)
  p = len(req.prompt_token_ids)
  if req.want_logprobs:
    got = np.array([lp.logprob for lp in req.output_logprobs])
    want = [ref[p - 1 + i, t] for i, t in enumerate(req.output_token_ids)]
    np.testing.assert_allclose(got, want, atol=1e-5)
  for i, lp in enumerate(req.output_logprobs):
    order = np.argsort(-ref[p - 1 + i], kind="stable")[:MAX_LOGPROBS]
    np.testing.assert_array_equal(lp.top_ids, order)
    np.testing.assert_allclose(lp.top, ref[p - 1 + i, order], atol=1e-5)
  if req.prompt_logprobs is not None:
    prompt = req.prompt_logprobs
    assert np.isnan(prompt.token[0]) and (prompt.top_ids[0] == -1).all()
    want = [ref[j - 1, req.prompt_token_ids[j]] for j in range(1, p)]
    np.testing.assert_allclose(prompt.token[1:], want, atol=1e-5)
    order = np.argsort(-ref[:p - 1], axis=-1, kind="stable")[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(prompt.top_ids[1:], order)
    np.testing.assert_allclose(prompt.top[1:], np.take_along_axis(ref[:p - 1], order, -1),
                               atol=1e-5)


def test_logprobs_equal_the_float64_model_and_leave_tokens_alone(params):
  """Prompts of 13, 5 and 20 tokens (the 20 in three 8-token chunks); the
  sampled one (temperature 0.8) reports raw logprobs, not tempered ones."""
  ps = prompts([13, 5, 20], seed=3)
  samplings = [GREEDY, SamplingParams(max_tokens=4, temperature=0.8, seed=5,
                                      ignore_eos=True), GREEDY]
  engine = Engine(CFG, params, BASE)
  asked = [engine.add_request(f"r{i}", p, s, logprobs=True, prompt_logprobs=i != 1)
           for i, (p, s) in enumerate(zip(ps, samplings))]
  plain = [engine.add_request(f"plain{i}", p, s)
           for i, (p, s) in enumerate(zip(ps, samplings))]
  engine.run()
  for req, twin in zip(asked, plain):
    assert req.output_token_ids == twin.output_token_ids
    assert twin.output_logprobs == [] and twin.prompt_logprobs is None
    assert len(req.output_logprobs) == 4
    _check_against_reference(params, req)
  assert asked[1].prompt_logprobs is None


def test_logprobs_do_not_depend_on_batch_mates_or_chunk_size(params):
  (p,) = prompts([19], seed=8)
  others = prompts([7, 11, 4], seed=9)

  def run(config, with_others):
    engine = Engine(CFG, params, config)
    req = engine.add_request("x", p, GREEDY, logprobs=True, prompt_logprobs=True)
    for i, o in enumerate(others if with_others else []):
      engine.add_request(f"o{i}", o, SamplingParams(max_tokens=6, ignore_eos=True),
                         logprobs=i % 2 == 0)
    engine.run()
    return req

  alone = run(BASE, False)
  for config, mates in [(BASE, True),
                        (EngineConfig.preset("tiny", long_prefill_token_threshold=4), True)]:
    got = run(config, mates)
    assert got.output_token_ids == alone.output_token_ids
    np.testing.assert_array_equal([l.logprob for l in got.output_logprobs],
                                  [l.logprob for l in alone.output_logprobs])
    np.testing.assert_array_equal(got.prompt_logprobs.token, alone.prompt_logprobs.token)
    np.testing.assert_array_equal(got.prompt_logprobs.top_ids, alone.prompt_logprobs.top_ids)


def test_a_prompt_logprob_request_takes_no_prefix_hit(params):
  """13 tokens in 4-row pages: a repeat would map 12 cached rows; one that
  wants prompt logprobs computes (and scores) them all, and the pages stay
  cached for the next plain repeat."""
  (p,) = prompts([13], seed=12)
  engine = Engine(CFG, params, BASE)
  first = engine.generate([p], GREEDY)[0]
  scored = engine.add_request("scored", p, GREEDY, prompt_logprobs=True)
  engine.run()
  again = engine.add_request("again", p, GREEDY)
  engine.run()
  assert (first.prefix_hit_tokens, scored.prefix_hit_tokens, again.prefix_hit_tokens) == (
      0, 0, 12)
  assert not np.isnan(scored.prompt_logprobs.token[1:]).any()
  assert scored.output_token_ids == first.output_token_ids == again.output_token_ids
  _check_against_reference(params, scored)

