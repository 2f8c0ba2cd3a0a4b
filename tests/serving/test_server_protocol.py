"""The OpenAI server's protocol surface that clients (lm-evaluation-harness,
``vllm bench serve``, guidellm, AIPerf, the openai client) rely on: the
tokenizer endpoints, batched prompts, ``object`` fields, stream options,
cached-token usage, ``x-request-id``, unknown fields refused and the abort
counter. Real HTTP on 127.0.0.1, the real engine on the tiny model; the
body rules of ``max_completion_tokens`` and ``top_k`` on the parser alone."""

import json

import numpy as np
import pytest

from serving.http.parsing import RequestParser
from serving.http.protocol import BadRequest, whole_int
from tests.serving.engine_testing import CFG, CHAT_TEMPLATE
from tests.serving.engine_testing import wait_until as _wait
from tests.serving.test_server import MODEL, TOK, _greedy_text, openai_client


def _sse(served, body, path="/v1/completions", headers=None):
  """(response headers, chunks) of one streamed request."""
  with served.http.stream("POST", path, json={"model": MODEL, **body},
                          headers=headers) as r:
    assert r.status_code == 200, r.read()
    lines = [l[6:] for l in r.iter_lines() if l.startswith("data: ")]
    response_headers = dict(r.headers)
  assert lines[-1] == "[DONE]"
  return response_headers, [json.loads(l) for l in lines[:-1]]


def test_tokenizer_endpoints_as_lm_eval_reads_them(served):
  info = served.http.get("/tokenizer_info").json()
  assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<|im_end|>",
                                                                      None, None)
  assert info["chat_template"] == CHAT_TEMPLATE and info["model_max_length"] == 64
  # lm-eval's remote tokenizer finds the EOS id by tokenizing its text.
  eos = served.http.post("/tokenize", json={"prompt": info["eos_token"],
                                            "add_special_tokens": False}).json()
  assert eos["tokens"] == [1]
  text = "the heart of it"
  ids = served.http.post("/tokenize", json={"prompt": text,
                                            "add_special_tokens": False}).json()["tokens"]
  assert ids == TOK.encode(text, add_special_tokens=False) and len(ids) > 3
  back = served.http.post("/detokenize", json={"model": MODEL, "tokens": ids})
  assert back.status_code == 200 and back.json() == {"prompt": text}
  with_specials = served.http.post("/detokenize", json={"tokens": [2] + ids + [1]}).json()
  assert with_specials["prompt"] == "<|im_start|>" + text + "<|im_end|>"
  for path, body, param in [("/detokenize", {"tokens": [0, 512]}, "tokens"),
                            ("/detokenize", {"tokens": "abc"}, "tokens"),
                            ("/detokenize", {"tokens": [3], "skip": True}, "skip"),
                            ("/tokenize", {"prompt": "x", "add_special_tokens": 1},
                             "add_special_tokens"),
                            ("/tokenize", {"prompt": ["a", "b"]}, "prompt")]:
    r = served.http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)


def test_batched_prompts_one_choice_each_in_index_order(served, params):
  client = openai_client(served)
  texts = ["the heart", "of it all", "ab"]
  expected = [_greedy_text(params, TOK.encode(t), 5)[1] for t in texts]
  got = client.completions.create(model=MODEL, prompt=texts, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
  assert [c.index for c in got.choices] == [0, 1, 2]
  assert [c.text for c in got.choices] == expected
  assert got.usage.prompt_tokens == sum(len(TOK.encode(t)) for t in texts)
  assert got.usage.completion_tokens == 15
  as_ids = client.completions.create(model=MODEL, prompt=[TOK.encode(t) for t in texts],
                                     max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
  assert [c.text for c in as_ids.choices] == expected
  # Streamed: chunks of the choices interleave; each index adds up to its text.
  _, chunks = _sse(served, {"prompt": texts, "max_tokens": 5, "temperature": 0,
                            "ignore_eos": True, "stream": True})
  streamed = ["", "", ""]
  for chunk in chunks:
    for c in chunk["choices"]:
      streamed[c["index"]] += c["text"]
  assert streamed == expected
  finishes = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
  assert sorted(c["index"] for c in finishes) == [0, 1, 2]
  mixed = served.http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", [5]]})
  assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "prompt"
  bad = served.http.post("/v1/completions", json={"model": MODEL, "prompt": [[5], [600]]})
  assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt[1]"


def test_object_fields_and_max_completion_tokens(served, params):
  client = openai_client(served)
  got = client.completions.create(model=MODEL, prompt="the end", max_tokens=2)
  assert got.object == "text_completion"
  messages = [{"role": "user", "content": "hi"}]
  chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                        max_completion_tokens=3,
                                        extra_body={"ignore_eos": True})
  assert chat.object == "chat.completion" and chat.usage.completion_tokens == 3
  _, chunks = _sse(served, {"messages": messages, "max_completion_tokens": 3,
                            "stream": True}, path="/v1/chat/completions")
  assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
  _, chunks = _sse(served, {"prompt": "the end", "max_tokens": 3, "stream": True})
  assert {c["object"] for c in chunks} == {"text_completion"}


def _parser():
  """The server's parser for the tiny model's 64-token context (no engine)."""
  return RequestParser(TOK, MODEL, max_model_len=64, vocab_size=CFG.vocab_size,
                       max_stop_ids=8, capacity=16)


def test_max_completion_tokens_wins_over_max_tokens():
  """OpenAI deprecates max_tokens for max_completion_tokens; with both the
  latter is the bound (vLLM's ``max_completion_tokens or max_tokens``), and
  a too-long request names it."""
  messages = [{"role": "user", "content": "hi"}]
  for chat, body in [(True, {"messages": messages}), (False, {"prompt": [5, 6]})]:
    both = _parser().parse({**body, "max_completion_tokens": 2, "max_tokens": 3}, chat)
    assert [s.max_tokens for s in both.samplings] == [2]
    assert both.max_tokens_field == "max_completion_tokens"
    legacy = _parser().parse({**body, "max_completion_tokens": None, "max_tokens": 3}, chat)
    assert [s.max_tokens for s in legacy.samplings] == [3]
    assert legacy.max_tokens_field == "max_tokens"
    with pytest.raises(BadRequest, match="maximum context length is 64") as e:
      _parser().parse({**body, "max_completion_tokens": 70, "max_tokens": 3}, chat)
    assert e.value.param == "max_completion_tokens"
    with pytest.raises(BadRequest, match="'max_tokens' must be int"):
      _parser().parse({**body, "max_completion_tokens": 2, "max_tokens": "3"}, chat)


def test_an_integer_field_takes_a_float_without_fraction_only():
  """``3.0`` is 3 where an int is wanted (pydantic's lax mode, as vLLM
  reads it); ``3.5``, ``inf`` and ``nan`` are refused naming the field."""
  parsed = _parser().parse({"prompt": [5, 6], "max_tokens": 3.0, "n": 2.0, "seed": 7.0,
                            "top_k": -1.0}, chat=False)
  assert [s.max_tokens for s in parsed.samplings] == [3, 3]
  assert [s.seed for s in parsed.samplings] == [7, 8]
  assert parsed.samplings[0].top_k == 0
  assert all(type(s.max_tokens) is int for s in parsed.samplings)
  for field, value in [("max_tokens", 3.5), ("n", float("inf")), ("seed", float("nan"))]:
    with pytest.raises(BadRequest) as e:
      _parser().parse({"prompt": [5, 6], field: value}, chat=False)
    assert str(e.value) == f"'{field}' must be int (a whole number), got {value!r}"
    assert e.value.param == field


def test_whole_int_is_the_one_reading_of_an_int_field():
  """The parser and the replica front's load estimate read int fields alike."""
  for value, expected in [(3, 3), (3.0, 3), (-2.0, -2), (True, None), (3.5, None),
                          ("3", None), (float("nan"), None), (float("inf"), None), (None, None)]:
    assert whole_int(value) == expected and (expected is None or type(whole_int(value)) is int)


def test_top_k_minus_one_is_off_and_the_refusal_says_so():
  for top_k, expected in [(-1, 0), (0, 0), (5, 5)]:
    parsed = _parser().parse({"prompt": [5, 6], "top_k": top_k}, chat=False)
    assert parsed.samplings[0].top_k == expected
  for top_k in (-2, 2**31):
    with pytest.raises(BadRequest) as e:
      _parser().parse({"prompt": [5, 6], "top_k": top_k}, chat=False)
    assert str(e.value) == f"'top_k' must be in [-1, 2**31) (-1 or 0 = off), got {top_k}"
    assert e.value.param == "top_k"


def test_stream_options_usage_only_when_asked_and_continuous(served):
  body = {"prompt": "the end", "max_tokens": 4, "ignore_eos": True, "stream": True}
  _, plain = _sse(served, {**body, "stream_options": {"include_usage": False}})
  assert all("usage" not in c for c in plain)
  _, chunks = _sse(served, {**body, "stream_options": {"include_usage": True,
                                                       "continuous_usage_stats": True}})
  *rest, last = chunks
  assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
  counts = [c["usage"]["completion_tokens"] for c in rest]
  assert counts == sorted(counts) and counts[-1] == 4 and counts[0] >= 1
  prompt_tokens = len(TOK.encode("the end"))
  assert {c["usage"]["prompt_tokens"] for c in chunks} == {prompt_tokens}
  for extra, param in [({"stream": False, "stream_options": {"include_usage": True}},
                        "stream_options"),
                       ({"stream_options": {"include_usage": True, "chunky": 1}},
                        "stream_options.chunky")]:
    r = served.http.post("/v1/completions", json={"model": MODEL, **body, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(served):
  """13 prompt tokens in 4-row pages: a repeat maps 3 cached pages (12 rows;
  one prompt token is always computed)."""
  prompt = list(np.random.default_rng(30).integers(3, 512, size=13))
  body = {"model": MODEL, "prompt": [int(t) for t in prompt], "max_tokens": 2,
          "ignore_eos": True}
  first = served.http.post("/v1/completions", json=body).json()["usage"]
  second = served.http.post("/v1/completions", json=body).json()["usage"]
  assert first["prompt_tokens_details"] == {"cached_tokens": 0}
  assert second["prompt_tokens_details"] == {"cached_tokens": 12}
  assert second["prompt_tokens"] == 13


def test_x_request_id_is_the_request_id_and_is_echoed(served):
  body = {"model": MODEL, "prompt": "the end", "max_tokens": 2}
  r = served.http.post("/v1/completions", json=body, headers={"x-request-id": "bench-7"})
  assert r.status_code == 200
  assert r.json()["id"] == "cmpl-bench-7" and r.headers["x-request-id"] == "bench-7"
  headers, chunks = _sse(served, {**body, "stream": True},
                         headers={"x-request-id": "bench-8"})
  assert headers["x-request-id"] == "bench-8"
  assert {c["id"] for c in chunks} == {"cmpl-bench-8"}
  bad = served.http.post("/v1/completions", json=body, headers={"x-request-id": "x" * 300})
  assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-id"
  # A UTF-8 id is refused naming it as sent (it read 'hÃ©llo').
  bad = served.http.post("/v1/completions", json=body,
                         headers={"x-request-id": "héllo".encode()})
  assert bad.status_code == 400 and bad.json()["error"]["message"].endswith("got 'héllo'")


def test_unknown_fields_are_refused_and_null_stop_accepted(served):
  for path, body, param in [
      ("/v1/completions", {"prompt": "hi", "guided_json": {}}, "guided_json"),
      ("/v1/completions", {"prompt": "hi", "messages": []}, "messages"),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                "prompt": "hi"}, "prompt"),
  ]:
    r = served.http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "never ignored" in error["message"]
  ok = served.http.post("/v1/completions", json={
      "model": MODEL, "prompt": "hi", "max_tokens": 3, "stop": None, "ignore_eos": True})
  assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_a_cancelled_request_counts_as_abort_in_request_success(served):
  key = ("vllm:request_success_total", (("finished_reason", "abort"),))
  before = served.metrics().get(key, 0)
  with served.http.stream("POST", "/v1/completions", json={
      "model": MODEL, "prompt": "the end", "max_tokens": 50, "ignore_eos": True,
      "stream": True}) as r:
    for line in r.iter_lines():
      if line.startswith("data: "):
        break                                    # one chunk, then hang up
  _wait(lambda: served.metrics().get(key, 0) == before + 1)
  _wait(served.pages_free)
