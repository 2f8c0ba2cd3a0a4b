"""Per-layer sliding windows, soft caps and the family switches on every
attention path: each implementation runs the same model and must give the
plain-jnp ``gather`` reference's logits and greedy tokens.

The model alternates windowed and global layers (Gemma 2's pattern) with
Gemma 3's local RoPE base on the windowed ones, attention and final soft
caps, q/k norms and a query scale other than ``head_dim ** -0.5``; prompts
are longer than the window, so a wrong window or cap changes the logits.
"""

import jax
import numpy as np
import pytest

from attention import native
from models import llama
from models.config import ModelConfig, RopeConfig

from generation import greedy

CFG = ModelConfig(
    vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
    ffn_dim=96, max_position=256, eos_token_ids=(1,), name="tiny-windows", family="gemma3_text",
    norm_style="gemma", post_norms=True, activation="gelu_tanh", scale_embeddings=True,
    qk_norm=True, attn_scale=0.2, attn_softcap=5.0, final_softcap=3.0,
    layer_windows=(6, 0, 6, 0), rope_theta=1e6,
    rope=RopeConfig(kind="linear", theta=1e6, factor=4.0),
    rope_local=RopeConfig(theta=1e4))


@pytest.fixture(scope="module")
def params():
  return llama.init_params(CFG, jax.random.PRNGKey(7), layer_scale=6.0)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(5)
  return [rng.integers(2, 256, n).tolist() for n in (21, 9, 14)]


@pytest.fixture(scope="module")
def reference(params, prompts):
  return greedy(params, CFG, prompts, 6, impl="gather")


IMPLS = ["blocked", "blocked_dot", "pallas", pytest.param("pallas_tpu", marks=pytest.mark.extended),
         pytest.param("native", marks=pytest.mark.skipif(
             native.unavailable_reason() is not None,
             reason=f"native kernel: {native.unavailable_reason()}"))]


@pytest.mark.parametrize("impl", IMPLS)
def test_every_attention_path_gives_the_reference(params, prompts, reference, impl):
  tokens, logits = greedy(params, CFG, prompts, 6, impl=impl)
  want_tokens, want_logits = reference
  assert tokens == want_tokens
  for got, want in zip(logits, want_logits):
    np.testing.assert_allclose(got, want, atol=2e-5)


# ~21 s; test_families checks the windowed and soft-capped families against transformers
@pytest.mark.extended
def test_windows_and_caps_change_the_logits(params, prompts):
  # The switches are live: all-global attention or no caps give other logits.
  import dataclasses  # pylint: disable=import-outside-toplevel
  want = greedy(params, CFG, prompts[:1], 1, impl="gather")[1]
  for change in (dict(layer_windows=(12, 0, 12, 0)), dict(attn_softcap=None),
                 dict(final_softcap=None), dict(rope_local=None)):
    cfg = dataclasses.replace(CFG, **change)
    _, got = greedy(params, cfg, prompts[:1], 1, impl="gather")
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) > 1e-3, change
