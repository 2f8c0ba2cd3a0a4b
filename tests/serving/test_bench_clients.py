"""The serving benchmark clients people point at vLLM and SGLang servers, replayed
against ours: the request bodies and headers they send and the way they read
the replies, written here from their source (not copied):

* ``vllm bench serve`` (vllm 0.34.0, ``vllm/benchmarks/lib/endpoint_request_func.py``:
  ``async_request_openai_completions`` for backend ``openai``,
  ``async_request_openai_chat_completions`` for ``openai-chat``;
  ``vllm/benchmarks/serve.py``: ``_align_prompts_to_server_tokenizer`` and the
  sampling flags ``--temperature/--top-p/--top-k/--min-p`` sent in the body).
  It splits the raw stream into SSE messages at blank lines, counts a chunk
  with ``choices`` as a token arrival (chat: only one whose delta carries
  content), reads ``usage`` from a chunk without choices, and fails a request
  that saw no token chunk or an ``error`` object.
* guidellm (0.8.1, ``guidellm/backends/openai/http.py`` and
  ``request_handlers.py``: ``TextCompletionsRequestHandler``,
  ``ChatCompletionsRequestHandler``): ``GET /health`` and ``/v1/models`` first,
  then streams with ``include_usage`` and ``continuous_usage_stats``, text as
  chat content parts, ``max_tokens`` / ``max_completion_tokens`` with
  ``ignore_eos``; it reads the reply line by line, keeps the last non-empty
  ``usage`` and stops at ``data: [DONE]``.

Real HTTP on 127.0.0.1, the real engine on the tiny model (docs/benchmarks.md,
"Benchmark clients", has the commands that ran the clients themselves)."""

import json

import pytest

from models.tokenizer import Tokenizer
from tests.serving.engine_testing import CHAT_TEMPLATE
from tests.serving.test_server import MODEL, TOK, _greedy_text

PROMPT = "the heart of it is here"
MESSAGES_TEXT = "say it again"


def _chat_prompt_tokens(text):
  """Prompt tokens of one user message rendered by the model's chat template."""
  rendered = TOK.apply_chat_template([{"role": "user", "content": text}])
  return len(TOK.encode(rendered, add_special_tokens=False))


# ------------------------------------------------------------ vllm bench serve
def _vllm_bench_read(served, path, body, headers, chat):
  """One streamed request as ``vllm bench serve`` reads it.

  Returns:
    dict: ``status``, ``success``, ``error``, ``text`` (the concatenated
    token texts), ``token_chunks`` (chunks it times: 1 TTFT + the ITL
    samples), ``output_tokens`` and ``prompt_len`` (from the usage chunk),
    ``ids`` (the chunks' ``id``) and ``echoed`` (the response's x-request-id).
  """
  out = {"text": "", "token_chunks": 0, "output_tokens": 0, "prompt_len": None,
         "error": None, "ids": set()}
  with served.http.stream("POST", path, json=body, headers=headers) as r:
    out["status"], out["echoed"] = r.status_code, r.headers.get("x-request-id")
    raw = b"".join(r.iter_bytes()).decode()
  if out["status"] != 200:
    out["success"] = False
    return out
  for message in (m.strip() for m in raw.split("\n\n")):
    if not message or message.startswith(":"):       # SSE comments are pings
      continue
    assert message.startswith("data: "), message
    payload = message[len("data: "):]
    if payload == "[DONE]":
      continue
    data = json.loads(payload)
    out["ids"].add(data.get("id"))
    choices = data.get("choices")
    if data.get("error"):
      out["error"] = data["error"]
    elif choices and not chat:                         # text may be "" here
      out["token_chunks"] += 1
      out["text"] += choices[0].get("text") or ""
    elif choices and _vllm_chat_has_output(choices[0]):
      out["token_chunks"] += 1
      out["text"] += choices[0]["delta"].get("content") or ""
    elif data.get("usage"):
      out["output_tokens"] = data["usage"].get("completion_tokens")
      out["prompt_len"] = data["usage"].get("prompt_tokens")
  out["success"] = out["error"] is None and out["token_chunks"] > 0
  return out


def _vllm_chat_has_output(choice):
  """A chat chunk vLLM's client times as a token: content (or reasoning,
  tool calls), or empty content without the opening chunk's ``role``."""
  delta = choice.get("delta")
  if not isinstance(delta, dict):
    return False
  if any(delta.get(k) for k in ("content", "reasoning", "reasoning_content",
                                "tool_calls", "function_call")):
    return True
  return delta.get("content") == "" and "role" not in delta


@pytest.mark.parametrize("logprobs", [None, 1])
def test_vllm_bench_serve_openai_backend_streams_completions(served, logprobs):
  """``--backend openai --ignore-eos --random-output-len 8`` (``--logprobs 1``
  too), request ``i`` named by ``--request-id-prefix``."""
  body = {"model": MODEL, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 8,
          "logprobs": logprobs, "stream": True, "stream_options": {"include_usage": True},
          "ignore_eos": True}
  got = _vllm_bench_read(served, "/v1/completions", body, {"x-request-id": "bench-5f-0"},
                         chat=False)
  assert got["status"] == 200 and got["success"], got
  assert got["output_tokens"] == 8
  assert got["prompt_len"] == len(TOK.encode(PROMPT))
  assert got["echoed"] == "bench-5f-0" and got["ids"] == {"cmpl-bench-5f-0"}
  assert got["token_chunks"] >= 8          # one chunk per token at least: 7 ITL samples
  whole = served.http.post("/v1/completions", json={
      **body, "stream": False, "stream_options": None}).json()
  assert got["text"] == whole["choices"][0]["text"]   # seed 0 both times: the same text


def test_vllm_bench_serve_openai_chat_backend_streams_chat(served):
  """``--backend openai-chat``: the prompt as one text content part,
  ``max_completion_tokens``, a JSON content type, an API key from
  ``OPENAI_API_KEY`` (ignored by this server)."""
  body = {"model": MODEL,
          "messages": [{"role": "user", "content": [{"type": "text", "text": MESSAGES_TEXT}]}],
          "max_completion_tokens": 8, "stream": True,
          "stream_options": {"include_usage": True}, "ignore_eos": True}
  headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-unused",
             "x-request-id": "bench-5f-1"}
  got = _vllm_bench_read(served, "/v1/chat/completions", body, headers, chat=True)
  assert got["status"] == 200 and got["success"], got
  assert got["output_tokens"] == 8
  assert got["prompt_len"] == _chat_prompt_tokens(MESSAGES_TEXT)
  assert 2 <= got["token_chunks"] <= 8     # the role chunk and the finish chunk not timed
  whole = served.http.post("/v1/chat/completions", json={
      **body, "stream": False, "stream_options": None}).json()
  assert got["text"] == whole["choices"][0]["message"]["content"]


def test_vllm_bench_serve_sampling_flags_at_their_off_values(served, params):
  """``--temperature 0 --top-p 1 --top-k -1 --min-p 0`` go in every body:
  greedy text; a ``--min-p`` this server cannot apply is refused, named."""
  body = {"model": MODEL, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 6,
          "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
          "ignore_eos": True, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "temperature": 0.0}
  got = _vllm_bench_read(served, "/v1/completions", body, {}, chat=False)
  assert got["success"] and got["output_tokens"] == 6, got
  assert got["text"] == _greedy_text(params, TOK.encode(PROMPT), 6)[1]
  refused = served.http.post("/v1/completions", json={**body, "min_p": 0.1})
  assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_p"


def test_chat_template_kwargs_reach_the_template(served, monkeypatch):
  """``--extra-body '{"chat_template_kwargs": {"enable_thinking": false}}'``
  (vLLM's help example): the variables render in the model's template;
  ``messages`` is the body's own and may not be set there."""
  messages = [{"role": "user", "content": MESSAGES_TEXT}]
  base = TOK.apply_chat_template(messages)
  monkeypatch.setattr(served.server.parser, "tokenizer", Tokenizer(
      TOK.backend, eos_token_id=1, chat_template=CHAT_TEMPLATE +
      "{% if enable_thinking is defined and not enable_thinking %}ab{% endif %}"))

  def tokens(**fields):
    r = served.http.post("/tokenize", json={"model": MODEL, "messages": messages, **fields})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]

  assert tokens() == TOK.encode(base, add_special_tokens=False)
  assert tokens(chat_template_kwargs={"enable_thinking": False}) == TOK.encode(
      base + "ab", add_special_tokens=False)
  no_prompt = TOK.apply_chat_template(messages, add_generation_prompt=False)
  assert no_prompt != base
  assert tokens(chat_template_kwargs={"add_generation_prompt": False}) == TOK.encode(
      no_prompt, add_special_tokens=False)
  monkeypatch.undo()
  ok = served.http.post("/v1/chat/completions", json={
      "model": MODEL, "messages": messages, "max_completion_tokens": 2, "ignore_eos": True,
      "chat_template_kwargs": {"enable_thinking": False}})
  assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2, ok.text
  for value, param in [({"messages": []}, "chat_template_kwargs.messages"),
                       ([1], "chat_template_kwargs")]:
    r = served.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "chat_template_kwargs": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_vllm_bench_serve_aligns_random_prompts_with_the_server_tokenizer(served):
  """Its random dataset's first prompt is tokenized by the server; a
  length that differs from the client's count makes it re-tokenize and
  detokenize every prompt."""
  r = served.http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT,
                                          "add_special_tokens": False})
  assert r.status_code == 200, r.text
  tokens = r.json()["tokens"]
  assert tokens == TOK.encode(PROMPT, add_special_tokens=False)
  back = served.http.post("/detokenize", json={"model": MODEL, "tokens": tokens[:3]})
  assert back.status_code == 200 and back.json()["prompt"] == TOK.decode(tokens[:3])


# ------------------------------------------------------------------ guidellm
def _guidellm_check(served):
  """guidellm's start: ``GET /health`` must succeed, the model is
  ``/v1/models``' first id when none is given."""
  assert served.http.get("/health").status_code == 200
  return served.http.get("/v1/models").json()["data"][0]["id"]


def _guidellm_stream(served, path, body, chat):
  """One streamed request as guidellm's handlers read it.

  Returns:
    (text, usage, iterations, done): the joined text, the last non-empty
    usage, the lines that carried text (its token iterations), and whether
    ``data: [DONE]`` ended the stream.
  """
  text, usage, iterations, done = "", None, 0, False
  with served.http.stream("POST", path, json=body) as r:
    assert r.status_code == 200, r.read()
    for line in r.iter_lines():
      line = line.strip()
      if not line.startswith("data:"):
        continue
      payload = line[len("data:"):].strip()
      if payload == "[DONE]":
        done = True
        break
      data = json.loads(payload)
      assert not data.get("error"), data
      choices = data.get("choices") or [{}]
      piece = (choices[0].get("delta") or {}).get("content") if chat else choices[0].get("text")
      if piece:
        text += piece
        iterations += 1
      usage = data.get("usage") or usage
  return text, usage, iterations, done


@pytest.mark.parametrize("chat", [False, True])
def test_guidellm_synthetic_requests_stream_with_continuous_usage(served, chat):
  """``--data kind=synthetic_text,output_tokens=8`` through
  ``request_format=/v1/completions`` and the default ``/v1/chat/completions``."""
  model = _guidellm_check(served)
  assert model == MODEL
  body = {"model": model, "stream": True,
          "stream_options": {"include_usage": True, "continuous_usage_stats": True},
          "ignore_eos": True}
  if chat:
    path, prompt_tokens = "/v1/chat/completions", _chat_prompt_tokens(MESSAGES_TEXT)
    body.update(max_completion_tokens=8, messages=[
        {"role": "user", "content": [{"type": "text", "text": MESSAGES_TEXT}]}])
  else:
    path, prompt_tokens = "/v1/completions", len(TOK.encode(PROMPT))
    body.update(max_tokens=8, prompt=PROMPT)
  text, usage, iterations, done = _guidellm_stream(served, path, body, chat)
  assert done and text.strip()
  # guidellm's counts: usage's prompt_tokens (prompt_tokens_details first) and
  # completion_tokens; the last usage it kept is the trailing, final one.
  details = usage.get("prompt_tokens_details") or {}
  assert (details.get("prompt_tokens") or usage["prompt_tokens"]) == prompt_tokens
  assert usage["completion_tokens"] == 8
  assert iterations == 8                   # one text-bearing line per token


def test_guidellm_non_streaming_chat(served):
  """``--backend ...,stream=false``: one JSON reply, text in
  ``choices[0].message.content``, counts in ``usage``."""
  body = {"model": MODEL, "max_completion_tokens": 8, "ignore_eos": True,
          "messages": [{"role": "user", "content": [{"type": "text", "text": MESSAGES_TEXT}]}]}
  r = served.http.post("/v1/chat/completions", json=body)
  assert r.status_code == 200, r.text
  reply = r.json()
  assert reply["id"] and reply["choices"][0]["message"]["content"].strip()
  assert reply["usage"]["completion_tokens"] == 8
  assert reply["usage"]["prompt_tokens"] == _chat_prompt_tokens(MESSAGES_TEXT)
