"""Shared fixtures for the model tests: the tiny random-weight decoder."""

import jax
import numpy as np
import pytest

from models.config import get_config
from models.llama import init_params


def perturbed_params(cfg, seed):
  """Random weights with norm scales drawn around 1 (so they matter)."""
  params = init_params(cfg, jax.random.PRNGKey(seed))
  rng = np.random.default_rng(seed)

  def jitter(path, leaf):
    if path[-1].key == "scale":
      return leaf + 0.2 * rng.standard_normal(leaf.shape).astype(leaf.dtype)
    return leaf

  return jax.tree_util.tree_map_with_path(jitter, params)


@pytest.fixture(scope="session")
def tiny_cfg():
  return get_config("tiny")


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
  return perturbed_params(tiny_cfg, seed=0)
