"""Logprobs over HTTP in OpenAI's shapes (completions: ``logprobs`` k;
chat: ``logprobs`` + ``top_logprobs``), whole and streamed, against the
float64 numpy model's raw ``log_softmax``; the openai client reads them."""

import json

import numpy as np
import pytest

from tests.models.llama_reference import dense_forward
from tests.serving.engine_testing import CFG
from serving.engine.config import SamplingParams
from serving.engine.engine import Engine
from tests.serving.test_server import BASE, MODEL, TOK, _greedy_text, openai_client


def _reference_logprobs(params, tokens):
  logits = dense_forward(params, CFG, tokens)["logits"]
  top = logits.max(-1, keepdims=True)
  return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def _stream(served, body, path="/v1/completions"):
  with served.http.stream("POST", path, json={"model": MODEL, **body}) as r:
    assert r.status_code == 200, r.read()
    lines = [l[6:] for l in r.iter_lines() if l.startswith("data: ")]
  assert lines[-1] == "[DONE]"
  return [json.loads(l) for l in lines[:-1]]


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_completion_logprobs_are_raw_and_match_the_float64_model(served, params,
                                                                 temperature):
  """At temperature 0.8 the sampled tokens' logprobs are still the raw
  logits' (vLLM's default), not the tempered distribution's."""
  prompt = TOK.encode("the heart of it")
  got = openai_client(served).completions.create(
      model=MODEL, prompt=prompt, max_tokens=5, temperature=temperature, seed=3,
      logprobs=3, extra_body={"ignore_eos": True})
  choice = got.choices[0]
  lp = choice.logprobs
  ids = Engine(CFG, params, BASE).generate([prompt], SamplingParams(
      max_tokens=5, temperature=temperature, seed=3, ignore_eos=True))[0].output_token_ids
  assert lp.tokens == [TOK.decode([t]) for t in ids]
  ref = _reference_logprobs(params, prompt + ids)
  p = len(prompt)
  np.testing.assert_allclose(lp.token_logprobs, [ref[p - 1 + i, t] for i, t in
                                                 enumerate(ids)], atol=1e-4)
  for i, (token, top) in enumerate(zip(lp.tokens, lp.top_logprobs)):
    best = np.argsort(-ref[p - 1 + i], kind="stable")[:3]
    want = {}
    for t in best:                       # same text (a byte piece): the likeliest
      want.setdefault(TOK.decode([int(t)]), ref[p - 1 + i, t])
    want.setdefault(token, ref[p - 1 + i, ids[i]])
    assert set(top) == set(want)
    np.testing.assert_allclose([top[k] for k in want], list(want.values()), atol=1e-4)
  assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
  assert choice.text == TOK.decode(ids, skip_special_tokens=True)
  if temperature == 0:        # lm-eval's greedy check: the chosen is the best
    assert all(v == max(top.values()) for v, top in zip(lp.token_logprobs,
                                                         lp.top_logprobs))


def test_chat_logprobs_with_top_logprobs(served, params):
  messages = [{"role": "user", "content": "hi there"}]
  prompt = TOK.encode(TOK.apply_chat_template(messages), add_special_tokens=False)
  got = openai_client(served).chat.completions.create(
      model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
      top_logprobs=2, extra_body={"ignore_eos": True})
  content = got.choices[0].logprobs.content
  ids, _ = _greedy_text(params, prompt, 4)
  assert [c.token for c in content] == [TOK.decode([t]) for t in ids]
  ref = _reference_logprobs(params, prompt + ids)
  p = len(prompt)
  for i, c in enumerate(content):
    assert c.bytes == list(TOK.token_bytes(ids[i]))
    assert abs(c.logprob - ref[p - 1 + i, ids[i]]) < 1e-4
    best = np.argsort(-ref[p - 1 + i], kind="stable")[:2]
    assert [t.token for t in c.top_logprobs] == [TOK.decode([int(b)]) for b in best]
    np.testing.assert_allclose([t.logprob for t in c.top_logprobs], ref[p - 1 + i, best],
                               atol=1e-4)
  plain = openai_client(served).chat.completions.create(
      model=MODEL, messages=messages, max_tokens=2, temperature=0)
  assert plain.choices[0].logprobs is None


def test_streamed_logprobs_add_up_to_the_whole_response(served):
  body = {"prompt": "the end of", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
          "logprobs": 2}
  whole = served.http.post("/v1/completions", json={"model": MODEL, **body}).json()
  want = whole["choices"][0]["logprobs"]
  chunks = _stream(served, {**body, "stream": True})
  got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
  for chunk in chunks:
    for c in chunk["choices"]:
      if c["logprobs"] is not None:
        for key in got:
          got[key] += c["logprobs"][key]
  assert got == want
  # Chat: one content entry per token across the chunks.
  chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
          "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 1}
  whole = served.http.post("/v1/chat/completions", json={"model": MODEL, **chat}).json()
  chunks = _stream(served, {**chat, "stream": True}, path="/v1/chat/completions")
  content = [e for c in chunks for ch in c["choices"] if ch["logprobs"]
             for e in ch["logprobs"]["content"]]
  assert content == whole["choices"][0]["logprobs"]["content"]


@pytest.mark.parametrize("path,body,param,rule", [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "must be in [0, 20]"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs", "must be an int"),
    ("/v1/completions", {"prompt": "hi", "top_logprobs": 2}, "top_logprobs",
     "not a field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "must be in [0, 20]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
])
def test_bad_logprobs_fields_are_400_naming_them(served, path, body, param, rule):
  r = served.http.post(path, json={"model": MODEL, **body})
  assert r.status_code == 400, r.text
  error = r.json()["error"]
  assert error["param"] == param and rule in error["message"], error


def _engine_prompt_logprobs(params, prompt):
  """The engine's own prompt logprobs (``Engine.add_request(prompt_logprobs)``)."""
  engine = Engine(CFG, params, BASE)
  req = engine.add_request("direct", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                           logprobs=True, prompt_logprobs=True)
  engine.run()
  return req


def test_echo_with_logprobs_returns_the_engines_prompt_logprobs(served, params):
  """lm-evaluation-harness's loglikelihood request: token-id prompts,
  ``max_tokens: 1, logprobs: 1, echo: true``; the prompt's logprobs (the
  first token has none) then the generated token's, as the engine computes
  them directly (and the float64 model to 1e-4)."""
  prompts = [TOK.encode("the heart of it"), TOK.encode("ab cd ef gh ij")]
  got = served.http.post("/v1/completions", json={
      "model": MODEL, "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True,
      "temperature": 0, "seed": 1234}).json()
  for choice, prompt in zip(sorted(got["choices"], key=lambda c: c["index"]), prompts):
    direct = _engine_prompt_logprobs(params, prompt)
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    want = list(direct.prompt_logprobs.token[1:]) + [direct.output_logprobs[0].logprob]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, rtol=0, atol=1e-6)
    ref = _reference_logprobs(params, prompt + direct.output_token_ids)
    np.testing.assert_allclose(
        lp["token_logprobs"][1:],
        [ref[j - 1, t] for j, t in enumerate(prompt + direct.output_token_ids) if j],
        atol=1e-4)
    assert lp["tokens"] == [TOK.decode([t]) for t in prompt + direct.output_token_ids]
    for j, top in enumerate(lp["top_logprobs"][1:], start=1):
      assert lp["tokens"][j] in top and max(top.values()) >= lp["token_logprobs"][j]
    assert choice["text"] == (TOK.decode(prompt, skip_special_tokens=True) +
                              TOK.decode(direct.output_token_ids, skip_special_tokens=True))
  assert got["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_score_only_echo_and_echo_without_logprobs(served, params):
  """``max_tokens: 0`` with echo returns the prompt alone (its logprobs, no
  completion tokens); echo without logprobs prepends the prompt's string."""
  prompt = TOK.encode("of it all")
  direct = _engine_prompt_logprobs(params, prompt)
  scored = served.http.post("/v1/completions", json={
      "model": MODEL, "prompt": prompt, "max_tokens": 0, "logprobs": 0, "echo": True}).json()
  choice = scored["choices"][0]
  assert choice["text"] == "of it all" and choice["finish_reason"] == "length"
  assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
      list(direct.prompt_logprobs.token[1:]), abs=1e-6)
  assert len(choice["logprobs"]["tokens"]) == len(prompt)
  assert (scored["usage"]["prompt_tokens"], scored["usage"]["completion_tokens"]) == (
      len(prompt), 0)
  echoed = served.http.post("/v1/completions", json={
      "model": MODEL, "prompt": "of it all", "max_tokens": 3, "temperature": 0,
      "ignore_eos": True, "echo": True}).json()["choices"][0]
  _, text = _greedy_text(params, prompt, 3)
  assert echoed["text"] == "of it all" + text and echoed["logprobs"] is None
  # Streamed: the prompt comes first, and the chunks add up to the whole.
  chunks = _stream(served, {"prompt": "of it all", "max_tokens": 3, "temperature": 0,
                            "ignore_eos": True, "echo": True, "logprobs": 1,
                            "stream": True})
  texts = [c["choices"][0]["text"] for c in chunks]
  assert texts[0] == "of it all" and "".join(texts) == "of it all" + text
  first = chunks[0]["choices"][0]["logprobs"]
  assert first["token_logprobs"][0] is None and len(first["tokens"]) == len(prompt)
  bad = served.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                  "max_tokens": 0})
  assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
  assert "0 only with 'echo': true" in bad.json()["error"]["message"]


def test_echo_with_logprobs_takes_no_prefix_hit_but_others_do(served):
  """A cached prompt (13 tokens: 12 rows in 3 pages) is computed whole when
  its logprobs are asked: no None past the first token, 0 cached tokens."""
  prompt = [int(t) for t in np.random.default_rng(31).integers(3, 512, size=13)]
  # max_tokens 2: a request that ends in the step of its last prompt chunk
  # leaves that chunk's pages out of the cache (they join it after a step).
  body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
  served.http.post("/v1/completions", json=body)
  hit = served.http.post("/v1/completions", json=body).json()
  assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 12
  scored = served.http.post("/v1/completions", json={**body, "echo": True,
                                                     "logprobs": 1}).json()
  assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
  values = scored["choices"][0]["logprobs"]["token_logprobs"]
  assert values[0] is None and all(v is not None and v < 0 for v in values[1:])
  echo_only = served.http.post("/v1/completions", json={**body, "echo": True}).json()
  assert echo_only["usage"]["prompt_tokens_details"]["cached_tokens"] == 12
