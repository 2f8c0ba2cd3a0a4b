"""Shared pieces of the engine tests: the tiny model and its prompts."""

import numpy as np

from models.config import get_config

CFG = get_config("tiny")


def prompts(lengths, seed=0):
  """Random prompts (token ids in [3, vocab)) of the given lengths."""
  rng = np.random.default_rng(seed)
  return [rng.integers(3, CFG.vocab_size, size=n).tolist() for n in lengths]
