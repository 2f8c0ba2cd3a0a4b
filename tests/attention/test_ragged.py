"""Segmented ragged paged attention against the numpy reference (§0x04, §0x09).

Every page no sequence owns, every page-table entry beyond a sequence's pages
(they point at an explicitly reserved null page), every page tail beyond
``kv_len`` and every padding query row holds NaN, so a stray read poisons
the output. The Pallas kernel runs in interpret mode on CPU.
"""

import functools
import os
from pathlib import Path
import subprocess
import sys
import warnings

import hypothesis
from hypothesis import strategies as st
import jax
from jax import export
import jax.numpy as jnp
import numpy as np
import pytest

from attention import native, ragged

MAX_LEN = 512


def make_batch(seqs, *, num_rows=None, max_seqs=None, page_size=16,
               heads=(9, 3), head_dim=64, dtype=jnp.float32, seed=0,
               max_kv_len=320, pool_tokens=2048):
  """Builds a packed batch; ``seqs`` is ``[(key, history, q_len), ...]``.

  A sequence's K/V/Q at position ``t`` depend only on ``(key, t)``, so the
  same sequence can be split into chunks or mixed with others. Physical pages
  are shuffled by ``seed``; the last physical page is the reserved null page.
  The page table holds ``max_kv_len`` tokens per sequence and the pool
  ``pool_tokens``, so batches of equal ``num_rows``/``max_seqs`` share shapes.

  Returns:
    ``(args, cu_q_lens, num_seqs)``: ``args`` in ``ragged_paged_attention``
    order.
  """
  num_q_heads, num_kv_heads = heads
  num_live = len(seqs)
  max_seqs = max_seqs or num_live
  kv_lens = [h + q for _, h, q in seqs]
  num_rows = num_rows or sum(q for _, _, q in seqs)
  used = [-(-kv // page_size) for kv in kv_lens]
  pages_per_seq = max_kv_len // page_size
  num_pages = pool_tokens // page_size
  assert max(used) <= pages_per_seq and sum(used) + 2 < num_pages
  null_page = num_pages - 1
  rng = np.random.default_rng(seed)
  physical = rng.permutation(null_page)
  k_pages = np.full((num_pages, page_size, num_kv_heads, head_dim), np.nan,
                    np.float32)
  v_pages = k_pages.copy()
  table = np.full((max_seqs, pages_per_seq), null_page, np.int32)
  q = np.full((num_rows, num_q_heads, head_dim), np.nan, np.float32)
  cu = np.zeros(max_seqs + 1, np.int32)
  lens = np.full(max_seqs, 7, np.int32)            # unused slots: ignored
  start = 0
  for s, (key, history, q_len) in enumerate(seqs):
    data = np.random.default_rng(key)
    k_all = data.standard_normal((MAX_LEN, num_kv_heads, head_dim))
    v_all = data.standard_normal((MAX_LEN, num_kv_heads, head_dim))
    q_all = data.standard_normal((MAX_LEN, num_q_heads, head_dim))
    pages = physical[start:start + used[s]]
    start += used[s]
    table[s, :used[s]] = pages
    kv = kv_lens[s]
    for t in range(kv):
      k_pages[pages[t // page_size], t % page_size] = k_all[t]
      v_pages[pages[t // page_size], t % page_size] = v_all[t]
    q[cu[s]:cu[s] + q_len] = q_all[history:kv]
    cu[s + 1] = cu[s] + q_len
    lens[s] = kv
  cu[num_live + 1:] = cu[num_live]
  args = (jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype),
          jnp.asarray(v_pages, dtype), jnp.asarray(lens), jnp.asarray(table),
          jnp.asarray(cu), jnp.asarray(num_live, jnp.int32))
  return args, cu, num_live


def attend(args, impl, **kw):
  if impl == "native" and not native.available():
    pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
  kw.setdefault("sm_scale", args[0].shape[-1] ** -0.5)
  return np.asarray(ragged.ragged_paged_attention(*args, impl=impl, **kw)
                    .astype(jnp.float32))


def assert_matches_reference(args, cu, num_live, impl, **kw):
  out = attend(args, impl, **kw)
  kw.setdefault("sm_scale", args[0].shape[-1] ** -0.5)
  kw = {k: v for k, v in kw.items() if k not in ("block_q", "block_kv")}
  ref = ragged.reference_attention(*(np.asarray(a.astype(jnp.float32))
                                     if a.dtype == jnp.bfloat16 else a
                                     for a in args), **kw)
  end = cu[num_live]
  tol = 2e-2 if args[0].dtype == jnp.bfloat16 else 2e-5
  np.testing.assert_allclose(out[:end], ref[:end], atol=tol, rtol=tol)
  np.testing.assert_array_equal(out[end:], 0.0)     # padding rows: zeros


CASES = {  # name: [(key, history, q_len)]; all packed into T=64, S=16
    "decode16": [(k, (37 * k) % 90, 1) for k in range(16)],
    "prefill": [(1, 0, 20), (2, 0, 7), (3, 0, 33)],
    "mixed": [(1, 50, 1), (2, 0, 12), (3, 30, 9), (4, 100, 1), (5, 0, 5),
              (6, 17, 1), (7, 40, 18)],
    "page_cross": [(1, 15, 1), (2, 16, 1), (3, 14, 3), (4, 31, 2), (5, 0, 33)],
    "zero_q_len": [(1, 5, 3), (2, 10, 0), (3, 0, 4)],
}


@pytest.mark.parametrize("impl", ["native", "blocked", "blocked_dot", "gather", "pallas"])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case, impl):
  args, cu, n = make_batch(CASES[case], num_rows=64, max_seqs=16)
  assert_matches_reference(args, cu, n, impl)


@pytest.mark.parametrize("impl", ["native", "blocked", "blocked_dot", "gather", "pallas"])
def test_no_live_sequences_gives_zeros(impl):
  args, _, _ = make_batch(CASES["mixed"], num_rows=64, max_seqs=16)
  out = attend(args[:-1] + (jnp.asarray(0, jnp.int32),), impl)
  np.testing.assert_array_equal(out, 0.0)


VARIANTS = {  # together they cover page_size 8/16/32, GQA 9:3/8:1/4:4,
    # head_dim 64/128 and bf16/f32 (the CASES above are 16, 9:3, 64, f32)
    "page8_gqa8to1_head128_bf16": dict(page_size=8, heads=(8, 1),
                                       head_dim=128, dtype=jnp.bfloat16),
    "page32_mha4to4": dict(page_size=32, heads=(4, 4)),
}
SMALL_MIX = [(1, 50, 1), (2, 0, 12), (3, 30, 9), (4, 9, 1)]


# "blocked" (the portable XLA kernel blocked_dot refines) is checked on every
# case by test_matches_reference; its repeats on variants, options, chunkings
# and bfloat16 pages run in the extended profile.
@pytest.mark.parametrize("impl", ["native", pytest.param("blocked", marks=pytest.mark.extended),
                                  "blocked_dot", "pallas"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_match_reference(variant, impl):
  args, cu, n = make_batch(SMALL_MIX, num_rows=28, max_seqs=5,
                           **VARIANTS[variant])
  assert_matches_reference(args, cu, n, impl)


@pytest.mark.parametrize("impl, kw", [
    pytest.param("blocked", dict(sliding_window=8, soft_cap=3.0), marks=pytest.mark.extended,
                 id="window_softcap-blocked"),
    ("gather", dict(sliding_window=8, soft_cap=3.0)),
    ("pallas", dict(sliding_window=8, soft_cap=3.0)),
    ("blocked_dot", dict(sliding_window=8, soft_cap=3.0)),
    pytest.param("blocked", dict(block_q=4, block_kv=32), marks=pytest.mark.extended,
                 id="small_blocks-blocked"),
    ("pallas", dict(block_q=4, block_kv=32)),
    ("blocked_dot", dict(block_q=4, block_kv=32)),
    ("blocked_dot", dict(block_q=1, block_kv=16)),
    ("native", dict(sliding_window=8, soft_cap=3.0)),
    ("native", dict(block_kv=32)),
    ("native", dict(sliding_window=40, block_kv=16)),
], ids=["window_softcap-blocked", "window_softcap-gather",
        "window_softcap-pallas", "window_softcap-blocked_dot",
        "small_blocks-blocked", "small_blocks-pallas",
        "small_blocks-blocked_dot", "row_slots-blocked_dot",
        "window_softcap-native", "small_blocks-native", "window_blocks-native"])
def test_options_match_reference(kw, impl):
  args, cu, n = make_batch(SMALL_MIX, num_rows=28, max_seqs=5)
  assert_matches_reference(args, cu, n, impl, **kw)


@pytest.mark.parametrize("impl, chunks", [
    ("native", range(1, 25)),
    pytest.param("blocked", range(1, 25), marks=pytest.mark.extended),
    ("blocked_dot", range(1, 25)),
    ("pallas", (1, 5, 24))])
def test_chunked_prefill_equals_full_prefill(impl, chunks):
  """§0x09: any chunking of a 24-token prompt gives bitwise the same rows."""
  full_args, _, _ = make_batch([(9, 0, 24)], num_rows=64, max_seqs=16)
  full = attend(full_args, impl)[:24]
  for chunk in chunks:
    rows = []
    for start in range(0, 24, chunk):
      q_len = min(chunk, 24 - start)
      seqs = [(1, 40, 1), (9, start, q_len), (3, 5, 2)]
      args, cu, _ = make_batch(seqs, num_rows=64, max_seqs=16, seed=start)
      rows.append(attend(args, impl)[cu[1]:cu[2]])
    np.testing.assert_array_equal(np.concatenate(rows), full,
                                  err_msg=f"chunk={chunk}")


def test_native_chunking_is_bitwise_with_bf16_windows_and_head_groups():
  """``native`` computes up to 8 (row, query head) pairs per pass over a key
  block, reads bfloat16 pages directly for one-row items and widens them
  into a buffer for longer ones: with 10:2 heads (groups of 5 spanning
  rows), head_dim 32, a sliding window and 16-key blocks (rows of one pass
  seeing different keys), every chunking of a prompt still gives the full
  prefill's rows bitwise, and they match the reference."""
  variant = dict(heads=(10, 2), head_dim=32, dtype=jnp.bfloat16)
  kw = dict(sliding_window=10, block_kv=16)
  full_args, cu, n = make_batch([(9, 0, 24)], num_rows=64, max_seqs=16, **variant)
  full = attend(full_args, "native", **kw)[:24]
  assert_matches_reference(full_args, cu, n, "native", **kw)
  for chunk in (1, 2, 3, 5, 7, 16, 23):
    rows = []
    for start in range(0, 24, chunk):
      q_len = min(chunk, 24 - start)
      seqs = [(1, 40, 1), (9, start, q_len), (3, 5, 2)]
      args, cu, _ = make_batch(seqs, num_rows=64, max_seqs=16, seed=start, **variant)
      rows.append(attend(args, "native", **kw)[cu[1]:cu[2]])
    np.testing.assert_array_equal(np.concatenate(rows), full, err_msg=f"chunk={chunk}")


@pytest.mark.parametrize("impl", ["native", "blocked", "blocked_dot", "pallas"])
def test_batch_invariance_is_bitwise(impl):
  """A sequence's rows are identical alone and inside any mix."""
  others = [(1, 50, 1), (2, 0, 12), (3, 30, 9), (4, 200, 1)]
  for seq in [(11, 60, 19), (12, 130, 1)]:
    alone_args, _, _ = make_batch([seq], num_rows=24, max_seqs=1)
    alone = attend(alone_args, impl)[:seq[2]]
    for pos in (0, 2, 4):
      mix = others[:pos] + [seq] + others[pos:]
      args, cu, _ = make_batch(mix, num_rows=64, max_seqs=16, seed=pos + 1)
      np.testing.assert_array_equal(attend(args, impl)[cu[pos]:cu[pos + 1]],
                                    alone, err_msg=f"{seq} at {pos}")


@pytest.mark.parametrize("impl", ["native", pytest.param("blocked_dot",
                                                         marks=pytest.mark.extended)])
@pytest.mark.parametrize("variant", [
    dict(), dict(heads=(4, 4), head_dim=128, dtype=jnp.bfloat16,
                 page_size=8)], ids=["gqa9to3", "mha4to4_head128_bf16"])
def test_invariance_across_buckets_and_slot_counts(variant, impl):
  """``native`` and ``blocked_dot``: a sequence's rows are bitwise the same alone and mixed
  into packs of different T buckets (64/128/256) and slot counts, at any
  position, as decode rows, short chunks (row slots) or long chunks."""
  max_kv = 480
  others = [(20 + i, (53 * i) % 300, 1 if i % 3 else 1 + i % 14)
            for i in range(40)]
  for seq in [(11, 60, 19), (12, 130, 1), (13, 200, 3), (14, 0, 40)]:
    alone_args, _, _ = make_batch([seq], num_rows=40, max_seqs=1,
                                  max_kv_len=max_kv, pool_tokens=4096,
                                  **variant)
    alone = attend(alone_args, impl)[:seq[2]]
    for num_rows, num_others, max_seqs, pos in [
        (64, 6, 7, 3), (128, 30, 32, 30), (128, 30, 32, 11),
        (256, 12, 100, 12)]:
      mix = others[:num_others]
      mix = mix[:pos] + [seq] + mix[pos:]
      while sum(q for _, _, q in mix) > num_rows:
        mix.pop(-1 if mix[-1] != seq else 0)
        pos = mix.index(seq)
      args, cu, _ = make_batch(mix, num_rows=num_rows, max_seqs=max_seqs,
                               max_kv_len=max_kv, pool_tokens=16384,
                               seed=num_rows + pos, **variant)
      np.testing.assert_array_equal(
          attend(args, impl)[cu[pos]:cu[pos + 1]], alone,
          err_msg=f"{seq} at {pos} of {len(mix)}, T={num_rows}")


@pytest.mark.parametrize("impl", ["native"] + [pytest.param(i, marks=pytest.mark.extended)
                                               for i in ("blocked", "blocked_dot")])
def test_decode_row_bits_do_not_depend_on_small_buckets(impl):
  """A lone decode row is bitwise the same in the engine's small decode
  buckets (4, 8, 16, 32 rows), in the tiny model's shapes (4 / 2 heads,
  head_dim 16, 4-token pages). With the slot batch sized by the bucket
  (4 slots in a 4-row bucket, 8 in an 8-row one) XLA:CPU's exp rounded
  most of these rows apart between the 4- and the 8-row bucket."""
  variant = dict(heads=(4, 2), head_dim=16, page_size=4, max_kv_len=64,
                 pool_tokens=512)
  for key in range(8):
    seq = (40 + key, 3 + 5 * key, 1)
    rows = {}
    for num_rows in (4, 8, 16, 32):
      args, _, _ = make_batch([seq], num_rows=num_rows, max_seqs=4, seed=key,
                              **variant)
      rows[num_rows] = attend(args, impl)[0]
    for num_rows in (8, 16, 32):
      np.testing.assert_array_equal(rows[num_rows], rows[4],
                                    err_msg=f"{seq}, T={num_rows}")


@pytest.mark.extended
def test_blocked_dot_slot_height_does_not_change_bits():
  """The default 64-row prefill slots give the rows of 16-, 32- and 1-row
  slots bitwise (block_q=32 also moves 5..8-row chunks to row slots):
  the slot height is a speed choice only."""
  seqs = [(1, 50, 1), (2, 0, 70), (3, 30, 9), (4, 200, 1), (5, 140, 6),
          (6, 0, 130)]
  args, cu, n = make_batch(seqs, num_rows=256, max_seqs=8, max_kv_len=480,
                           pool_tokens=4096)
  out = attend(args, "blocked_dot")
  assert_matches_reference(args, cu, n, "blocked_dot")
  for block_q in (1, 16, 32):
    np.testing.assert_array_equal(attend(args, "blocked_dot", block_q=block_q),
                                  out, err_msg=f"block_q={block_q}")


def test_auto_picks_the_backend_kernel():
  if native.available():
    assert ragged.resolve_impl("auto", "cpu") == "native"
  else:
    with warnings.catch_warnings():        # warned once per process
      warnings.simplefilter("ignore")
      assert ragged.resolve_impl("auto", "cpu") == "blocked_dot"
  assert ragged.resolve_impl("auto", "cpu", head_dim=48) == "blocked_dot"
  assert ragged.resolve_impl("auto", "tpu") == "pallas_tpu"
  assert ragged.resolve_impl("auto", "gpu") == "pallas"


@pytest.mark.parametrize("impl", ["native", "gather", "pallas"])
def test_num_seqs_may_be_shape_1(impl):
  args, cu, n = make_batch(SMALL_MIX, num_rows=28, max_seqs=5)
  args = args[:-1] + (jnp.asarray([n], jnp.int32),)
  assert_matches_reference(args, cu, n, impl)


@hypothesis.settings(max_examples=15, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(
    seqs=st.lists(st.tuples(st.integers(0, 80), st.integers(1, 16)),
                  min_size=1, max_size=6),
    seed=st.integers(0, 99))
def test_random_ragged_batches_match_reference(seqs, seed):
  seqs = [(seed * 10 + i, h, q) for i, (h, q) in enumerate(seqs)]
  args, cu, n = make_batch(seqs, num_rows=96, max_seqs=6, page_size=8,
                           seed=seed)
  assert_matches_reference(args, cu, n, "blocked_dot")
  assert_matches_reference(args, cu, n, "native")


# ----------------------------------------------------------------------------
# write_kv_pages


@pytest.mark.parametrize("impl", ["native", pytest.param("blocked", marks=pytest.mark.extended),
                                  "blocked_dot", "gather"])
def test_bfloat16_bit_pages_equal_bfloat16_pages(impl):
  # A bfloat16 cache stored as its bits (KV_BITS, the CPU storage) gives the
  # float bfloat16 pages' rows bitwise, and the reference's values.
  args, cu, n = make_batch(CASES["mixed"], num_rows=64, max_seqs=16,
                           dtype=jnp.bfloat16)
  bits = tuple(jax.lax.bitcast_convert_type(a, ragged.KV_BITS)
               for a in args[1:3])
  bit_args = args[:1] + bits + args[3:]
  np.testing.assert_array_equal(attend(bit_args, impl), attend(args, impl))
  assert_matches_reference(bit_args, cu, n, impl)


def test_write_kv_pages_stores_bfloat16_bits():
  # Slot 5 is page 2 offset 1; slot -1 is padding (dropped).
  rows = jnp.asarray([[[1.0, -2.5, 3.0e-3]], [[7.0, 7.0, 7.0]],
                      [[0.1, 1e5, -0.0]]], jnp.float32)              # [3, 1, 3]
  pages = jnp.zeros((4, 2, 1, 3), ragged.KV_BITS)
  k, v = ragged.write_kv_pages(pages, pages, rows, -rows,
                               jnp.asarray([5, -1, 0], jnp.int32))
  assert k.dtype == v.dtype == ragged.KV_BITS
  as16 = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.bfloat16)
                              .astype(jnp.float32))
  want = np.zeros((4, 2, 1, 3), np.float32)
  want[2, 1] = np.asarray(rows[0].astype(jnp.bfloat16).astype(jnp.float32))
  want[0, 0] = np.asarray(rows[2].astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(as16(k), want)
  np.testing.assert_array_equal(as16(v), -want)
  assert as16(k)[0, 0, 0, 1] == 99840.0       # 1e5 rounded to bfloat16


def test_integer_pages_other_than_bits_are_refused():
  args, _, _ = make_batch(CASES["mixed"], num_rows=64, max_seqs=16)
  ints = tuple(a.astype(jnp.int32) for a in args[1:3])
  with pytest.raises(ValueError, match="k_pages dtype must be a float or uint16"):
    attend(args[:1] + ints + args[3:], "blocked_dot")


def test_write_kv_pages_writes_rows_and_drops_padding():
  k_pages = jnp.zeros((4, 8, 2, 16))
  v_pages = jnp.ones((4, 8, 2, 16))
  k_new = jnp.arange(3 * 2 * 16, dtype=jnp.float32).reshape(3, 2, 16) + 1
  slots = jnp.asarray([2 * 8 + 5, -1, 3 * 8 + 7], jnp.int32)
  k_out, v_out = ragged.write_kv_pages(k_pages, v_pages, k_new, -k_new, slots)
  expected_k = np.zeros((4, 8, 2, 16), np.float32)
  expected_v = np.ones((4, 8, 2, 16), np.float32)
  expected_k[2, 5], expected_k[3, 7] = k_new[0], k_new[2]
  expected_v[2, 5], expected_v[3, 7] = -k_new[0], -k_new[2]
  np.testing.assert_array_equal(k_out, expected_k)
  np.testing.assert_array_equal(v_out, expected_v)


# ----------------------------------------------------------------------------
# Validation


def _shape_error_cases():
  args, _, _ = make_batch(SMALL_MIX, num_rows=28, max_seqs=5)
  q, kp, vp, lens, table, cu, n = args
  return {
      "q": ((q[0],) + args[1:], {}),
      "v_pages": ((q, kp, vp[:, :4]) + args[3:], {}),
      "head_dim": ((q[..., :32],) + args[1:], {}),
      "n_q_heads": ((q[:, :8],) + args[1:], {}),
      "page_table": (args[:4] + (table[:3],) + args[5:], {}),
      "cu_q_lens": (args[:5] + (cu[:-1], n), {}),
      "kv_lens": (args[:3] + (lens.astype(jnp.float32),) + args[4:], {}),
      "sm_scale": (args, {"sm_scale": -1.0}),
      "sliding_window": (args, {"sliding_window": 0}),
      "impl": (args, {"impl": "fast"}),
  }


@pytest.mark.parametrize("name", list(_shape_error_cases()))
def test_inconsistent_shapes_raise_at_trace_time(name):
  args, kw = _shape_error_cases()[name]
  kw = {"sm_scale": 0.125, "impl": "blocked", **kw}
  with pytest.raises(ValueError, match=name):
    ragged.ragged_paged_attention(*args, **kw)


@pytest.mark.parametrize("name, edit", [
    ("q_len", lambda lens, table, cu, n: (lens.at[1].set(3), table, cu, n)),
    ("non-decreasing", lambda lens, table, cu, n: (
        lens, table, cu.at[2].set(0), n)),
    ("T=", lambda lens, table, cu, n: (lens, table, cu.at[4].set(99), n)),
    ("num_seqs", lambda lens, table, cu, n: (lens, table, cu, n + 9)),
    ("pages_per_seq", lambda lens, table, cu, n: (
        lens.at[0].set(500), table, cu, n)),
    ("page_table", lambda lens, table, cu, n: (
        lens, table.at[0, 0].set(10_000), cu, n)),
])
def test_value_errors_name_argument_and_rule(name, edit):
  args, _, _ = make_batch(SMALL_MIX, num_rows=28, max_seqs=5)
  lens, table, cu, n = edit(*args[3:])
  q, k_pages, _ = args[:3]
  with pytest.raises(ValueError, match=name):
    ragged.check_values(lens, table, cu, n, num_rows=q.shape[0],
                        page_size=k_pages.shape[1], num_pages=k_pages.shape[0])


# ----------------------------------------------------------------------------
# Lowering for accelerators


def test_pallas_kernel_lowers_to_triton_for_cuda():
  args, _, _ = make_batch(SMALL_MIX, num_rows=28, max_seqs=5)
  fn = jax.jit(functools.partial(ragged.ragged_paged_attention, sm_scale=0.125,
                                 impl="pallas", interpret=False))
  exported = export.export(fn, platforms=["cuda"], disabled_checks=[
      export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
  assert "__gpu$xla.gpu.triton" in exported.mlir_module()


_CAPPED_CASES = """
import sys
import numpy as np, jax.numpy as jnp
from attention import native
from tests.attention.test_ragged import capped_cases
assert native.available(), native.unavailable_reason()
np.savez(sys.argv[1], **capped_cases())
"""


def capped_cases():
  """Native outputs of every case at head_dim 16 (plain products into the
  lane fold) and 64, float32 and bfloat16 pages, float32 queries, soft cap
  on: ``{name: f32 array}``."""
  out = {}
  for name, seqs in CASES.items():
    for head_dim in (16, 64):
      for dtype in (jnp.float32, jnp.bfloat16):
        args, _, _ = make_batch(seqs, num_rows=64, max_seqs=16, dtype=dtype, head_dim=head_dim)
        args = (args[0].astype(jnp.float32),) + args[1:]
        out[f"{name}_{head_dim}_{jnp.dtype(dtype).name}"] = np.asarray(
            ragged.ragged_paged_attention(*args, impl="native", sm_scale=head_dim ** -0.5,
                                          soft_cap=3.0).astype(jnp.float32))
  return out


@pytest.mark.extended
def test_native_under_an_avx2_cap_gives_the_same_bits(tmp_path):
  """Built under ``XLA_FLAGS=--xla_cpu_max_isa=AVX2`` (no AVX-512: 16-lane
  values as pairs of 8-lane halves), the kernel computes the bits of this
  process's build on every case (``capped_cases``)."""
  if not native.available():
    pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
  root = Path(__file__).resolve().parents[2]
  path = tmp_path / "capped.npz"
  env = dict(os.environ, XLA_FLAGS="--xla_cpu_max_isa=AVX2", PYTHONPATH=str(root))
  proc = subprocess.run([sys.executable, "-c", _CAPPED_CASES, str(path)], env=env, cwd=root,
                        capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  got = np.load(path)
  want = capped_cases()
  assert sorted(got.files) == sorted(want) and len(want) == 20
  for key, value in want.items():
    assert value.any()
    np.testing.assert_array_equal(got[key].view(np.uint32), value.view(np.uint32), err_msg=key)
