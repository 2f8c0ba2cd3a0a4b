"""The float32 generated-row GEMM kernel (``models.rowgemm``): its fixed
k-ordered fma chains against a numpy reference, bit for bit; a row's bits
independent of the row count; its use in ``llama.forward``."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import llama, rowgemm
from serving.engine import host_cpu
from tests.serving.engine_testing import CFG

pytestmark = pytest.mark.skipif(not rowgemm.available(),
                                reason=f"float32 row kernel unavailable: "
                                       f"{rowgemm.unavailable_reason()}")


ROOT = Path(__file__).resolve().parents[2]

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


_CAPPED = """
import sys
import numpy as np, jax, jax.numpy as jnp
from models import amx, rowgemm
rng = np.random.default_rng(7)
out = {"bits": np.int32(rowgemm.vector_bits()), "amx": np.str_(amx.unavailable_reason() or "")}
for m, k, n in SHAPES:
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  for live in sorted({m, max(m - 3, 0)}):
    out[f"{m}_{k}_{n}_{live}_rows"] = np.asarray(rowgemm.matmul(x, w, live=live))
    out[f"{m}_{k}_{n}_{live}_panels"] = np.asarray(
        rowgemm.matmul(x, rowgemm.to_panels(w), n=n, live=live))
np.savez(sys.argv[1], **out)
"""
_SHAPES = [(1, 64, 40), (2, 70, 130), (3, 33, 17), (5, 96, 200), (9, 64, 72), (32, 576, 1536)]


@pytest.mark.skipif(not {"avx2", "fma"} <= set(host_cpu.read_cpuinfo()[1]),
                    reason="the CPU has no AVX2 with FMA")
def test_the_avx2_path_under_xlas_cap_gives_the_same_bits(tmp_path):
  """Under ``XLA_FLAGS=--xla_cpu_max_isa=AVX2`` the kernel is built without
  AVX-512 and runs on 8-lane vectors (``vector_bits`` 256; the AMX kernel
  says the cap keeps it off): every output, both layouts, live rows or not,
  is the k-ordered fma chain, bit for bit."""
  path = tmp_path / "capped.npz"
  env = dict(os.environ, XLA_FLAGS="--xla_cpu_max_isa=AVX2", PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, "-c", f"SHAPES = {_SHAPES!r}\n{_CAPPED}", str(path)],
                        env=env, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  got = np.load(path)
  assert int(got["bits"]) == 256
  assert str(got["amx"]).endswith("(XLA_FLAGS caps the instruction set at AVX2)")
  rng = np.random.default_rng(7)
  for m, k, n in _SHAPES:
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    full = rowgemm.reference(x, w) if m * k * n < 10 ** 6 else np.asarray(rowgemm.matmul(x, w))
    for live in sorted({m, max(m - 3, 0)}):
      want = full.copy()
      want[live:] = 0
      for layout in ("rows", "panels"):
        np.testing.assert_array_equal(_bits(got[f"{m}_{k}_{n}_{live}_{layout}"]), _bits(want),
                                      err_msg=f"{m}x{k}x{n} live {live} {layout}")


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
