"""Parallel sampling over HTTP: ``n`` choices per prompt (``best_of`` = n),
whole and streamed, through the official ``openai`` client; each copy
checked against the same request sent alone with n 1 and seed + j, and the
prompt prefilled once (the copies share its pages through the prefix
cache)."""

import json

import pytest

from tests.serving.engine_testing import wait_until
from tests.serving.test_server import MODEL, TOK, openai_client

SEED = 7
PROMPT = "the heart of it all, and the rest of the story"
MESSAGES = [{"role": "user", "content": "tell me about the heart of it"}]


def _texts(response, chat=False):
  assert [c.index for c in response.choices] == list(range(len(response.choices)))
  return [c.message.content if chat else c.text for c in response.choices]


def _completion(served, **fields):
  body = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0,
              extra_body={"ignore_eos": True})
  body.update(fields)
  return openai_client(served).completions.create(**body)


def _chat(served, **fields):
  body = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0,
              extra_body={"ignore_eos": True})
  body.update(fields)
  return openai_client(served).chat.completions.create(**body)


def test_completion_copies_differ_repeat_and_equal_single_requests_seeded_seed_plus_j(
    served):
  got = _completion(served, n=4, seed=SEED)
  texts = _texts(got)
  assert len(set(texts)) == 4                       # the copies differ
  assert _texts(_completion(served, n=4, seed=SEED)) == texts      # reproducible
  alone = [_texts(_completion(served, n=1, seed=SEED + j))[0] for j in range(4)]
  assert texts == alone
  prompt_len = len(TOK.encode(PROMPT))
  assert got.usage.prompt_tokens == prompt_len      # once, not n times
  assert got.usage.completion_tokens == 4 * 6
  assert all(c.finish_reason == "length" for c in got.choices)
  # The copies after the first took every full page before the last token.
  assert got.usage.prompt_tokens_details.cached_tokens == (prompt_len - 1) // 4 * 4


@pytest.mark.extended        # the streamed chat test below covers chat by default
def test_chat_copies_differ_repeat_and_equal_single_requests(served):
  got = _chat(served, n=3, seed=SEED)
  texts = _texts(got, chat=True)
  assert len(set(texts)) == 3
  assert _texts(_chat(served, n=3, seed=SEED), chat=True) == texts
  assert texts == [_texts(_chat(served, seed=SEED + j), chat=True)[0] for j in range(3)]
  assert got.usage.completion_tokens == 3 * 6


def test_without_a_seed_copies_differ_as_seeds_0_to_n_minus_1(served):
  texts = _texts(_completion(served, n=3))
  assert len(set(texts)) == 3
  assert texts == [_texts(_completion(served, seed=j))[0] for j in range(3)]


def test_batched_prompts_are_prompt_major(served):
  prompts = [PROMPT, "a second prompt that is long enough to share pages"]
  got = _completion(served, prompt=prompts, n=2, seed=SEED)
  texts = _texts(got)
  want = [_texts(_completion(served, prompt=p, seed=SEED + j))[0]
          for p in prompts for j in range(2)]
  assert texts == want
  assert got.usage.prompt_tokens == sum(len(TOK.encode(p)) for p in prompts)
  assert got.usage.completion_tokens == 4 * 6


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_copies_carry_their_index_and_usage_sums_every_copy(served, chat):
  n = 3
  whole = (_chat if chat else _completion)(served, n=n, seed=SEED)
  stream = (_chat if chat else _completion)(served, n=n, seed=SEED, stream=True,
                                            stream_options={"include_usage": True})
  texts, finish = [""] * n, [None] * n
  chunks = list(stream)
  for c in chunks[:-1]:
    assert c.usage is None and len(c.choices) == 1
    choice = c.choices[0]
    texts[choice.index] += (choice.delta.content or "") if chat else choice.text
    if choice.finish_reason is not None:
      assert finish[choice.index] is None
      finish[choice.index] = choice.finish_reason
  assert texts == _texts(whole, chat)
  assert finish == ["length"] * n
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n * 6
  assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("body, param, rule", [
    ({"n": 0}, "n", ">= 1"),
    ({"n": 2, "best_of": 3}, "best_of", "must equal 'n'"),
    ({"best_of": 2}, "best_of", "must equal 'n'"),
    ({"n": 100}, "n", "live bound"),
])
def test_bad_n_and_best_of_are_refused_naming_the_field(served, body, param, rule):
  r = served.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **body})
  assert r.status_code == 400, r.text
  error = r.json()["error"]
  assert error["param"] == param and rule in error["message"]


def test_best_of_equal_to_n_is_n(served):
  got = served.http.post("/v1/completions", json={
      "model": MODEL, "prompt": PROMPT, "n": 2, "best_of": 2, "seed": SEED,
      "max_tokens": 6, "ignore_eos": True})
  assert got.status_code == 200
  assert [c["text"] for c in got.json()["choices"]] == _texts(
      _completion(served, n=2, seed=SEED))


# ------------------------------------------------------------- counts
def _counts(served):
  m = served.metrics()
  return (m[("iterserve:prefill_tokens_computed_total", ())],
          m[("vllm:prefix_cache_hits_total", ())],
          m[("iterserve:kv_pages_used_peak", ())])


def _run_counts(served, body):
  before = _counts(served)
  r = served.http.post("/v1/completions", json={"model": MODEL, "max_tokens": 6,
                                                "ignore_eos": True, "seed": SEED, **body})
  assert r.status_code == 200, r.text
  after = _counts(served)
  return after[0] - before[0], after[1] - before[1], after[2]


def test_n8_prefills_the_prompt_once_and_holds_fewer_pages_than_8_requests(served):
  """The prompt's rows are computed once for n = 8 (then each copy computes
  only the tokens past the last full page), against 8 times for 8
  independent requests with the same prompt (one batched body: they
  arrive together, so none can hit another's pages)."""
  wait_until(served.pages_free)
  ids = TOK.encode("once more: " + PROMPT)     # a prompt no other test sent
  p, hit = len(ids), (len(ids) - 1) // 4 * 4
  computed, hits, peak_n = _run_counts(served, {"prompt": ids, "n": 8})
  assert (computed, hits) == (p + 7 * (p - hit), 7 * hit)
  other = TOK.encode(PROMPT.upper())           # a prompt the cache does not hold
  computed, hits, peak_8 = _run_counts(served, {"prompt": [other] * 8})
  assert (computed, hits) == (8 * len(other), 0)
  assert peak_n < peak_8
  # Prompt logprobs need every prompt row scored: each copy prefills.
  computed, hits, _ = _run_counts(served, {"prompt": ids + [5], "n": 3, "echo": True,
                                           "logprobs": 1})
  assert (computed, hits) == (3 * (p + 1), 0)
  wait_until(served.pages_free)


def test_a_disconnect_cancels_every_copy(served):
  cancelled = ("iterserve:requests_total", (("outcome", "cancelled"),))
  before = served.metrics().get(cancelled, 0)
  body = {"model": MODEL, "prompt": PROMPT[:20], "n": 4, "max_tokens": 40, "seed": SEED,
          "ignore_eos": True, "stream": True}
  with served.http.stream("POST", "/v1/completions", json=body) as r:
    assert r.status_code == 200
    for line in r.iter_lines():
      if line.startswith("data: ") and json.loads(line[6:])["choices"]:
        break                                # hang up after the first chunk
  wait_until(lambda: served.metrics().get(cancelled, 0) == before + 4)
  wait_until(served.pages_free)
  assert not served.server.loop._live and not served.server.loop._held
