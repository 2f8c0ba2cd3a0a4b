"""Mixture-of-experts routing and grouped GEMMs (models/moe.py) against
numpy references, and the batch invariance of the MoE model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import llama, moe
from models.config import ModelConfig

from generation import greedy


def _groups(rng, sizes, k=24, n=40):
  m = sum(sizes) + 5                       # 5 rows of no group at the end
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
  return x, w, np.asarray(sizes, np.int32)


def _reference(x, w, sizes):
  out = np.zeros((x.shape[0], w.shape[2]), np.float64)
  start = 0
  for e, size in enumerate(sizes):
    out[start:start + size] = x[start:start + size].astype(np.float64) @ w[e]
    start += size
  return out


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot"])
@pytest.mark.parametrize("sizes", [[3, 0, 17, 1], [0, 0, 0, 33], [16, 16, 16, 16], [0, 0, 0, 0]])
def test_grouped_matmul_is_each_group_times_its_weight(impl, sizes):
  x, w, group_sizes = _groups(np.random.default_rng(sum(sizes)), sizes)
  got = np.asarray(jax.jit(lambda a, b, g: moe.grouped_matmul(a, b, g, impl=impl))(
      x, w, group_sizes))
  want = _reference(x, w, sizes)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  assert not got[sum(sizes):].any()       # rows of no group are zeros


def test_tiled_rows_do_not_depend_on_their_group_mates():
  # A row's bits are the same whatever else its expert (or any expert) holds:
  # every tile is one 16-row GEMM.
  rng = np.random.default_rng(0)
  k, n = 32, 48
  w = rng.standard_normal((4, k, n)).astype(np.float32)
  row = rng.standard_normal((1, k)).astype(np.float32)
  run = jax.jit(lambda a, g: moe.grouped_matmul(a, w, g, impl="tiled"))
  outs = []
  # The row is always in expert 1's group, at different offsets in its tiles.
  for before, after, sizes in [(0, 0, [0, 1, 0, 0]), (5, 30, [2, 34, 0, 0]),
                               (20, 2, [0, 23, 0, 0]), (40, 0, [7, 34, 0, 0])]:
    x = np.concatenate([rng.standard_normal((before, k)), row,
                        rng.standard_normal((after, k))]).astype(np.float32)
    outs.append(np.asarray(run(x, np.asarray(sizes, np.int32)))[before])
  for out in outs[1:]:
    np.testing.assert_array_equal(out, outs[0])


def test_route_worked_example():
  # softmax([2, 0, 1, 0]) = [0.5761, 0.0780, 0.2119, 0.0780]; top-2 = experts
  # 0 and 2; renormalised: 0.5761 / 0.7880 = 0.7311 and 0.2689.
  logits = jnp.asarray([[2.0, 0.0, 1.0, 0.0]])
  weights, experts = moe.route(logits, 2, norm_topk_prob=True)
  assert experts.tolist() == [[0, 2]]
  top = 1 / (1 + np.e ** -1)
  np.testing.assert_allclose(np.asarray(weights), [[top, 1 - top]], rtol=1e-6)
  weights, _ = moe.route(logits, 2, norm_topk_prob=False)
  z = np.exp([2.0, 0.0, 1.0, 0.0]).sum()
  np.testing.assert_allclose(np.asarray(weights), [[np.e ** 2 / z, np.e / z]], rtol=1e-6)


def test_resolve_grouped():
  assert moe.resolve_grouped("auto", "cpu") == "tiled"
  assert moe.resolve_grouped("auto", "gpu") == "ragged_dot"
  assert moe.resolve_grouped("ragged_dot", "cpu") == "ragged_dot"
  with pytest.raises(ValueError, match="grouped GEMM impl"):
    moe.resolve_grouped("dense")


MOE_CFG = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=16, ffn_dim=48, max_position=256, eos_token_ids=(1,),
                      num_experts=6, experts_per_token=2, name="tiny-moe")


# ~30 s each on 2 cores; test_families checks the MoE families' logits and
# greedy tokens against transformers in the default run.
@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.extended),
                                   pytest.param(jnp.bfloat16, marks=pytest.mark.extended)])
def test_moe_model_rows_are_batch_invariant(dtype):
  # A request's logits (bits) and tokens alone equal those in a batch whose
  # other rows route to the same and to other experts.
  cfg = dataclasses.replace(MOE_CFG, norm_topk_prob=dtype == jnp.float32)
  params = llama.init_params(cfg, jax.random.PRNGKey(3), dtype, layer_scale=4.0)
  rng = np.random.default_rng(1)
  mine = rng.integers(2, 256, 11).tolist()
  others = [rng.integers(2, 256, n).tolist() for n in (23, 5, 17)]
  alone, alone_logits = greedy(params, cfg, [mine], 5)
  mixed, mixed_logits = greedy(params, cfg, others[:2] + [mine] + others[2:], 5)
  assert mixed[2] == alone[0]
  np.testing.assert_array_equal(mixed_logits[2], alone_logits[0])
