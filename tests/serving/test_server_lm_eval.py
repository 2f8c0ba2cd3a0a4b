"""lm-evaluation-harness against the server, offline: a multiple-choice task
and a generate-until task from local JSON files, through ``local-completions``
with ``tokenizer_backend=remote`` (the server's /tokenizer_info, /tokenize
and /detokenize) and batched token-id prompts. Its loglikelihoods equal the
engine's own prompt logprobs (``Engine.add_request(prompt_logprobs=True)``)
and its generations the engine's greedy text."""

import importlib.util
import json

import numpy as np
import pytest

from serving.engine.config import SamplingParams
from serving.engine.engine import Engine
from tests.serving.engine_testing import CFG
from tests.serving.test_server import BASE, MODEL, TOK, _Served

pytestmark = [
    pytest.mark.extended,       # ~1 min: lm-eval's imports and a fresh server
    pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                       reason="needs lm-evaluation-harness: pip install 'lm-eval[api]'"),
]

MC = [{"question": "the heart of", "choices": ["it", "ab", "all"], "answer": 0},
      {"question": "ab cd", "choices": ["ef", "gh"], "answer": 1}]
GEN = [{"question": "the end of", "answer": " it"}, {"question": "hi", "answer": "x"}]
MAX_GEN_TOKS = 6


def _write_tasks(root):
  """Two task YAMLs over JSON-lines files in ``root`` (no dataset download)."""
  for name, rows in (("mc", MC), ("gen", GEN)):
    (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  common = ("dataset_path: json\ntest_split: test\ndoc_to_text: question\n"
            "doc_to_target: answer\n")
  (root / "tiny_mc.yaml").write_text(
      f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root}/mc.jsonl\n"
      f"output_type: multiple_choice\ndoc_to_choice: choices\n"
      f"metric_list:\n  - metric: acc\n")
  (root / "tiny_gen.yaml").write_text(
      f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root}/gen.jsonl\n"
      f"output_type: generate_until\ngeneration_kwargs:\n  until: [\"\\n\"]\n"
      f"  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
      f"metric_list:\n  - metric: exact_match\n")


def _encode_pair(context, continuation):
  """lm-eval's split of a (context, continuation) pair into token ids
  (trailing context spaces move to the continuation; the whole is encoded)."""
  spaces = len(context) - len(context.rstrip())
  if spaces:
    context, continuation = context[:-spaces], context[-spaces:] + continuation
  whole = TOK.encode(context + continuation, add_special_tokens=False)
  context_ids = TOK.encode(context, add_special_tokens=False)
  return context_ids, whole[len(context_ids):]


def test_lm_eval_local_completions_scores_what_the_engine_computes(params, tmp_path,
                                                                   monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  import lm_eval
  from lm_eval.tasks import TaskManager

  _write_tasks(tmp_path)
  served = _Served(params, max_waiting=64)
  try:
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=dict(base_url=served.url + "/v1/completions", model=MODEL,
                        tokenizer_backend="remote", max_length=60, num_concurrent=1,
                        max_retries=1),
        tasks=["tiny_mc", "tiny_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, batch_size=2)
  finally:
    served.close()
  engine = Engine(CFG, params, BASE)
  scored = []
  for sample in results["samples"]["tiny_mc"]:
    for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
      context_ids, continuation_ids = _encode_pair(context, continuation)
      req = engine.add_request(f"s{len(scored)}", context_ids + continuation_ids,
                               SamplingParams(max_tokens=1), prompt_logprobs=True)
      scored.append((req, len(context_ids), resp[0]))
  engine.run()
  assert len(scored) == 5
  for req, ctxlen, (loglikelihood, is_greedy) in scored:
    tokens = req.prompt_logprobs
    assert loglikelihood == pytest.approx(float(np.sum(tokens.token[ctxlen:])), abs=1e-4)
    greedy = all(tokens.top_ids[j, 0] == t
                 for j, t in enumerate(req.prompt_token_ids) if j >= ctxlen)
    assert is_greedy == greedy
  choice = [int(np.argmax([r[0][0] for r in s["resps"]]))
            for s in results["samples"]["tiny_mc"]]
  accuracy = np.mean([c == s["doc"]["answer"] for c, s in
                      zip(choice, results["samples"]["tiny_mc"])])
  assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(accuracy)
  for sample in results["samples"]["tiny_gen"]:
    context = sample["arguments"][0][0]
    out = engine.generate([TOK.encode(context, add_special_tokens=False)],
                          SamplingParams(max_tokens=MAX_GEN_TOKS))[0]
    text = TOK.decode(out.output_token_ids, skip_special_tokens=True).split("\n")[0]
    assert sample["resps"][0][0] == text
