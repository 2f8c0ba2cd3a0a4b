"""Shared fixtures for the model tests: the tiny random-weight decoder."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_config
from models.llama import init_params


def perturbed_params(cfg, seed):
  """Random params in ``init_params``' layout: weights ~ N(0, 0.02), norm
  scales ~ 1 + N(0, 0.2) (so they matter). Shapes come from ``eval_shape``,
  values from numpy, so no init program is compiled."""
  shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    value = 1 + 0.2 * noise if path[-1].key == "scale" else 0.02 * noise
    return jnp.asarray(value, leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.fixture(scope="session")
def tiny_cfg():
  return get_config("tiny")


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
  return perturbed_params(tiny_cfg, seed=0)
