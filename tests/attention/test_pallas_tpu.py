"""The Mosaic TPU kernel (``impl="pallas_tpu"``) in TPU interpret mode.

Same batches as ``test_ragged.py`` (NaN in every page, table entry, page tail
and query row no sequence owns) against the numpy reference. Interpret mode
simulates HBM, VMEM, DMAs and semaphores on the CPU and fills fresh VMEM with
NaN; ``RACES`` adds the happens-before race detector, with DMAs applied only
at their wait so a read of a buffer before its wait sees the old contents.
"""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
from jax import export
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np
import pytest

from attention import ragged
from tests.attention.test_ragged import (CASES, SMALL_MIX, VARIANTS, attend,
                                         make_batch)

RACES = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait")


def kernel(args, races=False, **kw):
  """The kernel's rows as f32 numpy; with ``races``, asserts none found."""
  if races:
    kw["interpret"] = RACES
  out = attend(args, "pallas_tpu", **kw)
  if races:
    assert interpret_pallas_call.races is not None
    assert not interpret_pallas_call.races.races_found
  return out


def check(args, cu, num_live, races=False, **kw):
  out = kernel(args, races, **kw)
  kw = {k: v for k, v in kw.items() if k not in ("block_q", "block_kv")}
  ref = ragged.reference_attention(
      *(np.asarray(a.astype(jnp.float32)) if a.dtype == jnp.bfloat16 else a
        for a in args), sm_scale=args[0].shape[-1] ** -0.5, **kw)
  end = cu[num_live]
  tol = 2e-2 if args[0].dtype == jnp.bfloat16 else 2e-5
  np.testing.assert_allclose(out[:end], ref[:end], atol=tol, rtol=tol)
  np.testing.assert_array_equal(out[end:], 0.0)     # padding rows: zeros


# Shape families: CASES (T=64, S=16, page 16, GQA 9:3, head_dim 64, f32);
# the VARIANTS; several key blocks per slot (block_kv=32: two pages a block,
# both buffers in use); sliding window + soft cap; the chunked-prefill and
# invariance batches. One case of each runs with the race detector (whose
# results must also equal the plain interpret mode's bitwise).
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case):
  args, cu, n = make_batch(CASES[case], num_rows=64, max_seqs=16)
  check(args, cu, n, races=case == "mixed")


def test_empty_launch_gives_zeros():
  args, _, _ = make_batch(CASES["mixed"], num_rows=64, max_seqs=16)
  out = kernel(args[:-1] + (jnp.asarray(0, jnp.int32),))
  np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_match_reference(variant):
  args, cu, n = make_batch(SMALL_MIX, num_rows=28, max_seqs=5,
                           **VARIANTS[variant])
  check(args, cu, n, races=True)


@pytest.mark.parametrize("kw, races", [
    (dict(block_q=4, block_kv=32), True),
    (dict(block_q=2, block_kv=16), False),
    (dict(sliding_window=8, soft_cap=3.0), False),
    (dict(sliding_window=8, soft_cap=3.0, block_kv=16), True),
], ids=["multi_block", "page_blocks", "window_softcap", "window_skips_blocks"])
def test_options_match_reference(kw, races):
  args, cu, n = make_batch(SMALL_MIX, num_rows=28, max_seqs=5)
  check(args, cu, n, races=races, **kw)


def test_num_seqs_may_be_shape_1():
  args, cu, n = make_batch(SMALL_MIX, num_rows=28, max_seqs=5)
  check(args[:-1] + (jnp.asarray([n], jnp.int32),), cu, n)


def test_chunked_prefill_equals_full_prefill():
  """§0x09: chunks of 1, 5 and 12 rows give bitwise the full prompt's rows
  (key blocks of one page, so later rows walk several blocks)."""
  full_args, _, _ = make_batch([(9, 0, 12)], num_rows=16, max_seqs=3)
  full = kernel(full_args, races=True, block_kv=16)[:12]
  for chunk in (1, 5, 12):
    rows = []
    for start in range(0, 12, chunk):
      q_len = min(chunk, 12 - start)
      seqs = [(1, 40, 1), (9, start, q_len), (3, 5, 2)]
      args, cu, _ = make_batch(seqs, num_rows=16, max_seqs=3, seed=start)
      rows.append(kernel(args, block_kv=16)[cu[1]:cu[2]])
    np.testing.assert_array_equal(np.concatenate(rows), full,
                                  err_msg=f"chunk={chunk}")


@pytest.mark.extended   # ~15 s (interpret mode); test_matches_reference covers every case
def test_batch_invariance_is_bitwise():
  """A sequence's rows are identical alone and inside any mix."""
  others = [(1, 50, 1), (2, 0, 12), (3, 30, 9), (4, 200, 1)]
  for seq in [(11, 60, 19), (12, 130, 1)]:
    alone_args, _, _ = make_batch([seq], num_rows=24, max_seqs=1)
    alone = kernel(alone_args, races=True)[:seq[2]]
    for pos in (0, 4):
      mix = others[:pos] + [seq] + others[pos:]
      args, cu, _ = make_batch(mix, num_rows=48, max_seqs=5, seed=pos + 1)
      np.testing.assert_array_equal(kernel(args)[cu[pos]:cu[pos + 1]], alone,
                                    err_msg=f"{seq} at {pos}")


@hypothesis.settings(max_examples=4, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(
    seqs=st.lists(st.tuples(st.integers(0, 80), st.integers(1, 16)),
                  min_size=1, max_size=6),
    seed=st.integers(0, 99))
@pytest.mark.extended   # ~12 s (interpret mode); test_matches_reference covers every case
def test_random_ragged_batches_match_reference(seqs, seed):
  seqs = [(seed * 10 + i, h, q) for i, (h, q) in enumerate(seqs)]
  args, cu, n = make_batch(seqs, num_rows=96, max_seqs=6, page_size=8,
                           seed=seed)
  check(args, cu, n, block_q=8, block_kv=32)


@pytest.mark.slow
@pytest.mark.extended
def test_wide_batch_with_races_checked():
  """A wider launch: 40 sequences, T=256, head_dim 128, bf16, long
  histories (up to 12 key blocks of 32), all under the race detector."""
  seqs = [(20 + i, (53 * i) % 300, 1 if i % 3 else 1 + i % 14)
          for i in range(40)]
  args, cu, n = make_batch(seqs, num_rows=256, max_seqs=48, page_size=16,
                           heads=(8, 2), head_dim=128, dtype=jnp.bfloat16,
                           max_kv_len=480, pool_tokens=16384)
  check(args, cu, n, races=True, block_q=8, block_kv=32)


def test_race_detector_catches_a_read_before_its_wait():
  """Guards the race checks above: reading a VMEM buffer while the DMA
  into it is still in flight is reported."""
  def racy(x_hbm, o_ref, buf, sem):
    copy = pltpu.make_async_copy(x_hbm, buf, sem.at[0])
    copy.start()
    o_ref[...] = buf[...]
    copy.wait()

  x = jnp.ones((8, 128), jnp.float32)
  pl.pallas_call(
      racy, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      scratch_shapes=[pltpu.VMEM(x.shape, x.dtype),
                      pltpu.SemaphoreType.DMA((1,))],
      interpret=RACES)(x).block_until_ready()
  assert interpret_pallas_call.races.races_found


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_lowers_to_mosaic_for_tpu_without_a_device(dtype):
  """``jax.export`` for TPU on this CPU host: the kernel is serialised into
  a ``tpu_custom_call`` (Mosaic's own compile runs on the TPU host)."""
  args, _, _ = make_batch(SMALL_MIX, num_rows=28, max_seqs=5, dtype=dtype)
  fn = jax.jit(functools.partial(ragged.ragged_paged_attention, sm_scale=0.125,
                                 impl="pallas_tpu", interpret=False))
  module = export.export(fn, platforms=["tpu"])(*args).mlir_module()
  assert "stablehlo.custom_call @tpu_custom_call" in module
  assert "ragged_paged_attention_tpu_bq16_bkv128" in module


def test_tpu_compile_refuses_pages_below_the_sublane_tile():
  args, _, _ = make_batch(SMALL_MIX, num_rows=28, max_seqs=5, page_size=8,
                          dtype=jnp.bfloat16)
  fn = jax.jit(functools.partial(ragged.ragged_paged_attention, sm_scale=0.125,
                                 impl="pallas_tpu", interpret=False))
  with pytest.raises(ValueError, match="page_size=8 must be a multiple of 16"):
    export.export(fn, platforms=["tpu"])(*args)
