"""Sampling: greedy, temperature, top-k, top-p, per-request seeds."""

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine.sampling import _filtered_logits, greedy_argmax, sample

sample_jit = jax.jit(sample)


def _call(logits, temperature=0.0, top_k=0, top_p=1.0, seed=0, index=0):
  n = logits.shape[0]
  full = lambda v, dt: jnp.full((n,), v, dt)
  return np.asarray(sample_jit(jnp.asarray(logits, jnp.float32), full(temperature, jnp.float32),
                               full(top_k, jnp.int32), full(top_p, jnp.float32),
                               full(seed, jnp.uint32), full(index, jnp.int32)))


def test_greedy_is_argmax_with_lowest_id_on_ties():
  logits = np.array([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0]])
  assert _call(logits).tolist() == [1, 0]


def test_top_k_and_top_p_masks_by_hand():
  row = jnp.log(jnp.array([0.1, 0.4, 0.2, 0.3]))
  keep = lambda k, p: np.isfinite(np.asarray(_filtered_logits(row, k, p))).tolist()
  assert keep(2, 1.0) == [False, True, False, True]
  # Descending mass 0.4, 0.3, 0.2, 0.1: p = 0.6 needs the first two.
  assert keep(0, 0.6) == [False, True, False, True]
  assert keep(0, 0.75) == [False, True, True, True]
  assert keep(3, 0.5) == [False, True, False, True]


def test_a_top_p_that_is_zero_in_float32_keeps_the_top_token():
  """top_p = 1e-45 passes SamplingParams' (0, 1] check but is 0 (or a
  denormal flushed to 0) in float32: the nucleus is the top token, so the
  draw is greedy's for every seed, never id 0 from an all -inf row."""
  from serving.engine.config import SamplingParams
  logits = np.random.default_rng(1).standard_normal((4, 50))
  logits[:, 0] = -9.0                                # id 0 is never the top
  SamplingParams(max_tokens=1, temperature=1.0, top_p=1e-45)        # accepted
  for top_p in (0.0, 1e-45, 1e-39):
    for seed in range(4):
      assert (_call(logits, temperature=1.0, top_p=top_p, seed=seed) == _call(logits)).all()
  row = jnp.log(jnp.array([0.1, 0.4, 0.2, 0.3]))
  assert np.isfinite(np.asarray(_filtered_logits(row, 0, 0.0))).tolist() == [
      False, True, False, False]


def test_a_temperature_beyond_float32_is_refused():
  import pytest
  from serving.engine.config import SamplingParams
  with pytest.raises(ValueError, match=r"temperature must be finite and in \[0, 3.403e\+38\]"):
    SamplingParams(max_tokens=1, temperature=1e300)
  SamplingParams(max_tokens=1, temperature=3e38)     # finite in float32


def test_top_k_one_equals_greedy_at_any_temperature():
  logits = np.random.default_rng(0).standard_normal((8, 50))
  assert (_call(logits, temperature=2.0, top_k=1, seed=3) == _call(logits)).all()
  # Tied top logits: the lowest id, as greedy, for every seed and temperature.
  tied = np.array([[0.0, 4.0, 1.0, 4.0, 4.0]] * 4)
  for seed in range(6):
    for t in (0.5, 1.0, 3.0):
      assert _call(tied, temperature=t, top_k=1, seed=seed).tolist() == [1] * 4


def test_seed_and_index_determine_the_draw():
  logits = np.zeros((1, 1000))
  a = [_call(logits, 1.0, seed=5, index=i)[0] for i in range(4)]
  assert a == [_call(logits, 1.0, seed=5, index=i)[0] for i in range(4)]
  assert len(set(a)) > 1
  assert a != [_call(logits, 1.0, seed=6, index=i)[0] for i in range(4)]


def test_temperature_sampling_follows_the_distribution():
  # 4000 draws (distinct output indices) from p = [0.5, 0.3, 0.2]: each
  # frequency within 4 standard errors of its probability.
  probs = np.array([0.5, 0.3, 0.2])
  logits = np.tile(np.log(probs), (4000, 1))
  n = logits.shape[0]
  draws = np.asarray(sample_jit(jnp.asarray(logits, jnp.float32), jnp.ones((n,)),
                                jnp.zeros((n,), jnp.int32), jnp.ones((n,)),
                                jnp.full((n,), 9, jnp.uint32), jnp.arange(n, dtype=jnp.int32)))
  freq = np.bincount(draws, minlength=3) / n
  assert np.all(np.abs(freq - probs) < 4 * np.sqrt(probs * (1 - probs) / n))


def test_greedy_argmax_matches_jnp_argmax_on_ties_nans_and_infinities():
  rng = np.random.default_rng(3)
  logits = rng.integers(-3, 4, size=(64, 257)).astype(np.float32)   # many ties
  logits[1, 7] = np.nan
  logits[1, 200] = np.nan                                           # first NaN wins
  logits[2, 9] = np.inf
  logits[2, 100] = np.inf
  logits[3] = -np.inf
  logits[4, :] = np.nan
  logits[5, 256] = 9.0                                              # last column
  got = np.asarray(jax.jit(greedy_argmax)(jnp.asarray(logits)))
  want = np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1))
  assert got.dtype == np.int32
  assert got.tolist() == want.tolist()
  assert got[:6].tolist() == [want[0], 7, 9, 0, 0, 256]
