"""``serving.harness.closed_loop``: c requests live at a time on the engine
API, their tokens those of the same requests run at once; the
prompt-copying passages cut from a question file."""

import json

import pytest

from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.harness import closed_loop
from tests.serving.engine_testing import CFG, mixed_tokens, prompts, tiny_tokenizer

CONFIG = EngineConfig.preset("tiny")
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
PROMPTS = prompts([9, 3, 12, 6, 7])


@pytest.mark.parametrize("concurrency", [1, 2, 8])
def test_closed_loop_keeps_c_requests_live_and_their_tokens(params, concurrency):
  engine = Engine(CFG, params, CONFIG)
  run = closed_loop.run_closed_loop(engine, PROMPTS, GREEDY, concurrency, id_prefix="c-")
  assert list(run.output_token_ids) == [f"c-{i}" for i in range(5)]
  assert list(run.output_token_ids.values()) == mixed_tokens(params, CONFIG, PROMPTS,
                                                             [GREEDY] * 5)
  assert run.output_tokens == 25 and run.max_live == min(concurrency, 5)
  assert run.iterations == engine.num_iterations > 0
  # From the engine's own clocks: when a request arrived, fewer than c of
  # the ones added before it had not yet emitted their last token.
  reqs = [engine.requests[f"c-{i}"] for i in range(5)]
  for i, r in enumerate(reqs):
    running = [q for q in reqs[:i] if q.token_times_ms[-1] > r.arrival_ms]
    assert len(running) < concurrency, (i, len(running))
  if concurrency == 1:
    assert all(b.arrival_ms >= a.token_times_ms[-1] for a, b in zip(reqs, reqs[1:]))


def test_closed_loop_refuses_no_concurrency(params):
  with pytest.raises(ValueError, match="^concurrency must be >= 1, got 0$"):
    closed_loop.run_closed_loop(Engine(CFG, params, CONFIG), PROMPTS, GREEDY, 0)


def test_copy_prompt_begins_the_answer_with_the_first_words():
  tok = tiny_tokenizer()
  plain = closed_loop.copy_prompt_ids(tok, "a b c")
  primed = closed_loop.copy_prompt_ids(tok, "a b c", prime_words=2)
  text = tok.decode(plain)
  assert closed_loop.COPY_INSTRUCTION + "\n\na b c" in text
  assert tok.decode(primed) == text + "a b"


def test_mean_tpot_is_over_requests_of_two_tokens_or_more():
  run = closed_loop.ClosedLoopRun({"a": [1, 2, 3], "b": [4]},
                                  {"a": [0.0, 10.0, 30.0], "b": [5.0]}, 1.0, 3, 2)
  assert run.mean_tpot_ms == 15.0 and run.output_tokens == 4
  assert closed_loop.ClosedLoopRun({"b": [4]}, {"b": [5.0]}, 1.0, 1, 1).mean_tpot_ms is None


def test_copy_passages_start_at_each_question_and_run_on(tmp_path):
  path = tmp_path / "q.jsonl"
  path.write_text("\n".join(json.dumps({"turns": t}) for t in
                            (["a b  c", "ignored second turn"], ["d\ne"], ["f"])) + "\n\n")
  assert closed_loop.copy_passages(str(path), 4, 2) == ["a b", "d e", "f a", "a b"]
  assert closed_loop.copy_passages(str(path), 2, 8) == ["a b c d e f a b", "d e f a b c d e"]
  path.write_text('{"turns": ["x"]}\n{"turns": []}\n')
  with pytest.raises(ValueError, match=r"q.jsonl:2: each row must be JSON with a non-empty "):
    closed_loop.copy_passages(str(path), 1, 2)
  with pytest.raises(ValueError, match=r"nope.jsonl: cannot read \(No such file"):
    closed_loop.copy_passages(str(tmp_path / "nope.jsonl"), 1, 2)
