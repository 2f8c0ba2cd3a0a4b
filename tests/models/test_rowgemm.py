"""The float32 generated-row GEMM kernel (``models.rowgemm``): its fixed
k-ordered fma chains against a numpy reference, bit for bit; a row's bits
independent of the row count; its use in ``llama.forward``."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import llama, rowgemm
from tests.serving.engine_testing import CFG

pytestmark = pytest.mark.skipif(not rowgemm.available(),
                                reason=f"float32 row kernel unavailable: "
                                       f"{rowgemm.unavailable_reason()}")


# Wider than the tiny model: at d_model 64 XLA's few-row GEMM happens to
# compute the same k-ordered chain as the kernel, hiding which one ran.
WIDE = dataclasses.replace(CFG, d_model=192, ffn_dim=384, n_heads=12, n_kv_heads=4)


@pytest.fixture(scope="module")
def params():
  return llama.init_params(WIDE, jax.random.PRNGKey(1), layer_scale=4)


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("m, k, n", [(1, 64, 40), (3, 70, 130), (4, 96, 64), (5, 33, 17),
                                     (7, 96, 200), (32, 64, 72)])
def test_matches_the_fma_chain_reference_bitwise_in_both_layouts(m, k, n):
  """Every output is the k-ordered fma chain: row-major and panel weights,
  few rows (weight rows streamed whole) and many (register blocks), column
  tails that are not a multiple of 16 or 64."""
  rng = np.random.default_rng(m * 1000 + n)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  ref = rowgemm.reference(x, w)
  row_major = jax.jit(rowgemm.matmul)(x, w)
  panels = jax.jit(lambda a, b: rowgemm.matmul(a, b, n=n))(x, rowgemm.to_panels(w))
  np.testing.assert_array_equal(_bits(row_major), _bits(ref))
  np.testing.assert_array_equal(_bits(panels), _bits(ref))
  # Not XLA's order: the reference is a different computation from x @ w.
  np.testing.assert_allclose(ref, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)


def test_a_rows_bits_do_not_depend_on_the_row_count_or_live_rows():
  """SmolLM2's MLP shape: each of 32 rows alone, every prefix of 1..32 rows
  and the full call with ``live`` rows give the same bits per row; rows
  past ``live`` are zero."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((32, 576)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((576, 1536)) * 0.05, jnp.float32)
  call = jax.jit(rowgemm.matmul)
  full = np.asarray(call(x, w))
  for m in range(1, 33):
    np.testing.assert_array_equal(np.asarray(call(x[:m], w)), full[:m])
  alone = np.concatenate([np.asarray(call(x[i:i + 1], w)) for i in range(32)])
  np.testing.assert_array_equal(alone, full)
  live = jax.jit(lambda a, b, n: rowgemm.matmul(a, b, live=n))
  for n in (0, 1, 3, 4, 5, 31):
    out = np.asarray(live(x, w, jnp.int32(n)))
    np.testing.assert_array_equal(out[:n], full[:n])
    assert not out[n:].any()


def test_bad_operands_and_values_are_refused():
  x = jnp.zeros((2, 8), jnp.float32)
  with pytest.raises(ValueError, match=r"x must be f32\[M, K\] and w f32\[K, N\]"):
    rowgemm.matmul(x, jnp.zeros((9, 4), jnp.float32))
  with pytest.raises(ValueError, match="bfloat16"):
    rowgemm.matmul(x.astype(jnp.bfloat16), jnp.zeros((8, 4), jnp.bfloat16))
  with pytest.raises(ValueError, match="decode_gemm must be one of"):
    rowgemm.resolve("mkl")
  assert rowgemm.resolve("xla") == "xla" and rowgemm.resolve("auto") == "native"


def test_forward_prompt_rows_keep_xlas_bits_generated_rows_run_the_kernel(params):
  """``llama.forward(decode_gemm="native")``: prompt rows (XLA's large GEMM
  either way) are bitwise those of ``decode_gemm="xla"``; generated rows
  differ in rounding only. Per-layer weights (``split_layers``) give the
  stacked tree's bits."""
  t, ps = 8, 4
  kv = llama.init_kv_cache(WIDE, 8, ps, jnp.float32)
  tokens = jnp.arange(t, dtype=jnp.int32) + 3
  positions = jnp.arange(t, dtype=jnp.int32)
  table = jnp.zeros((2, 4), jnp.int32).at[0, :2].set(jnp.array([1, 2]))
  args = (tokens, positions, positions + ps, jnp.array([t, 0], jnp.int32), table,
          jnp.array([0, t, t], jnp.int32), jnp.int32(1))
  prompt = positions < 5                     # rows 0..4 prompt rows, 5..7 generated

  def run(p, gemm):
    return np.asarray(jax.jit(lambda p: llama.forward(
        p, WIDE, kv, *args, attention_impl="blocked_dot", prompt_rows=prompt,
        decode_gemm=gemm)[0])(p))

  xla, native = run(params, "xla"), run(params, "native")
  np.testing.assert_array_equal(native[:5], xla[:5])
  np.testing.assert_allclose(native[5:], xla[5:], rtol=2e-4, atol=2e-4)
  assert not np.array_equal(native[5:], xla[5:])
  np.testing.assert_array_equal(run(llama.split_layers(params), "native"), native)
  head = llama.with_head_panels(llama.split_layers(params), WIDE)
  logits = lambda p: np.asarray(jax.jit(lambda p, h: llama.compute_logits(
      p, WIDE, h, decode_gemm="native"))(p, jnp.asarray(native)))
  np.testing.assert_array_equal(logits(head), logits(params))
  np.testing.assert_allclose(logits(head), np.asarray(llama.compute_logits(
      params, WIDE, jnp.asarray(native))), rtol=2e-4, atol=2e-4)
