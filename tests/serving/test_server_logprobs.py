"""Logprobs over HTTP in OpenAI's shapes (completions: ``logprobs`` k;
chat: ``logprobs`` + ``top_logprobs``), whole and streamed, against the
float64 numpy model's raw ``log_softmax``; the openai client reads them."""

import json

import numpy as np
import openai
import pytest

from tests.models.llama_reference import dense_forward
from tests.serving.engine_testing import CFG
from serving.config import SamplingParams
from serving.engine import Engine
from tests.serving.test_server import BASE, MODEL, TOK, _greedy_text, _Served


@pytest.fixture(scope="module")
def served(params):
  s = _Served(params, max_waiting=64)
  yield s
  s.close()


def _client(served):
  return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


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
  got = _client(served).completions.create(
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
  got = _client(served).chat.completions.create(
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
  plain = _client(served).chat.completions.create(
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
