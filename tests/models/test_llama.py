"""Packed, paged forward of models.llama against the dense numpy reference."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_reference import dense_forward
from models import llama

PAGE_SIZE = 4
NUM_PAGES = 16
MAX_SEQS = 4
PAGES_PER_SEQ = 4
ROWS = 16


@dataclasses.dataclass
class Seq:
  pages: list      # physical pages, logical order
  tokens: np.ndarray  # the whole sequence


def pack(parts, num_rows=ROWS, pad_token=0, pad_position=0):
  """parts: list of (Seq, start, end): rows for positions [start, end)."""
  tokens, positions, slots, kv_lens, table, cu = [], [], [], [], [], [0]
  for seq, start, end in parts:
    for pos in range(start, end):
      tokens.append(seq.tokens[pos])
      positions.append(pos)
      slots.append(seq.pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
    kv_lens.append(end)
    table.append(seq.pages + [0] * (PAGES_PER_SEQ - len(seq.pages)))
    cu.append(cu[-1] + end - start)
  num_seqs = len(parts)
  pad = num_rows - len(tokens)
  tokens += [pad_token] * pad
  positions += [pad_position] * pad
  slots += [-1] * pad
  kv_lens += [0] * (MAX_SEQS - num_seqs)
  table += [[0] * PAGES_PER_SEQ] * (MAX_SEQS - num_seqs)
  cu += [cu[-1]] * (MAX_SEQS - num_seqs)
  i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))
  return dict(tokens=i32(tokens), positions=i32(positions), slot_mapping=i32(slots),
              kv_lens=i32(kv_lens), page_table=i32(table), cu_q_lens=i32(cu),
              num_seqs=jnp.int32(num_seqs))


def nan_cache(cfg):
  kv = llama.init_kv_cache(cfg, NUM_PAGES, PAGE_SIZE)
  return llama.KVCache(k=jnp.full_like(kv.k, jnp.nan), v=jnp.full_like(kv.v, jnp.nan))


def run(params, cfg, kv, batch, impl="blocked"):
  return llama.forward_jit(params, cfg, kv, **batch, attention_impl=impl)


def cached_rows(kv, seq, start, end):
  """[n_layers, end - start, n_kv, head_dim] K and V of positions [start, end)."""
  idx = [(seq.pages[p // PAGE_SIZE], p % PAGE_SIZE) for p in range(start, end)]
  k = np.stack([np.asarray(kv.k[:, page, off]) for page, off in idx], axis=1)
  v = np.stack([np.asarray(kv.v[:, page, off]) for page, off in idx], axis=1)
  return k, v


@pytest.fixture(scope="module")
def seqs(tiny_cfg):
  rng = np.random.default_rng(1)
  perm = [int(p) for p in rng.permutation(NUM_PAGES)]
  toks = lambda n: rng.integers(0, tiny_cfg.vocab_size, n)
  return {
      "decode": Seq(perm[0:2], toks(8)),      # history 7, one decode row
      "chunk": Seq(perm[2:5], toks(9)),       # history 5, chunk of 4
      "prompt": Seq(perm[5:7], toks(6)),      # whole prompt
  }


def build_mixed(impl, tiny_cfg, tiny_params, seqs):
  """Two iterations: history prefill, then a mixed batch."""
  kv = nan_cache(tiny_cfg)
  first = pack([(seqs["decode"], 0, 7), (seqs["chunk"], 0, 5)])
  hidden1, kv = run(tiny_params, tiny_cfg, kv, first, impl)
  parts = [(seqs["decode"], 7, 8), (seqs["chunk"], 5, 9), (seqs["prompt"], 0, 6)]
  second = pack(parts)
  kv_before = jax.tree_util.tree_map(np.asarray, kv)
  hidden2, kv = run(tiny_params, tiny_cfg, kv, second, impl)
  return dict(hidden1=np.asarray(hidden1), hidden2=np.asarray(hidden2), kv=kv,
              kv_before=kv_before, parts=parts, impl=impl)


@pytest.fixture(scope="module", params=["blocked", "gather"])
def mixed(request, tiny_cfg, tiny_params, seqs):
  return build_mixed(request.param, tiny_cfg, tiny_params, seqs)


def test_mixed_batch_matches_dense_reference(tiny_cfg, tiny_params, seqs, mixed):
  refs = {name: dense_forward(tiny_params, tiny_cfg, s.tokens) for name, s in seqs.items()}
  # Iteration 1 rows: decode seq [0, 7) then chunk seq [0, 5).
  np.testing.assert_allclose(mixed["hidden1"][:7], refs["decode"]["hidden"][:7], atol=2e-5)
  np.testing.assert_allclose(mixed["hidden1"][7:12], refs["chunk"]["hidden"][:5], atol=2e-5)
  row = 0
  for (seq, start, end), name in zip(mixed["parts"], ["decode", "chunk", "prompt"]):
    got = mixed["hidden2"][row:row + end - start]
    np.testing.assert_allclose(got, refs[name]["hidden"][start:end], atol=2e-5,
                               err_msg=name)
    logits = llama.compute_logits_jit(tiny_params, tiny_cfg, jnp.asarray(got))
    np.testing.assert_allclose(np.asarray(logits), refs[name]["logits"][start:end],
                               atol=2e-5, err_msg=name)
    k, v = cached_rows(mixed["kv"], seq, 0, end)
    np.testing.assert_allclose(k, refs[name]["k"], atol=2e-5, err_msg=name)
    np.testing.assert_allclose(v, refs[name]["v"], atol=2e-5, err_msg=name)
    row += end - start


def test_only_live_rows_write_the_cache(tiny_cfg, seqs, mixed):
  written = np.zeros((NUM_PAGES, PAGE_SIZE), bool)
  for seq in seqs.values():
    for pos in range(len(seq.tokens)):
      written[seq.pages[pos // PAGE_SIZE], pos % PAGE_SIZE] = True
  k = np.asarray(mixed["kv"].k)
  assert np.all(np.isnan(k[:, ~written])), "padding rows or page tails were written"
  assert not np.any(np.isnan(k[:, written]))
  # The second iteration left the first iteration's rows untouched.
  seq = seqs["decode"]
  before = mixed["kv_before"].k[:, seq.pages[0]]
  np.testing.assert_array_equal(k[:, seq.pages[0]], before)


def test_padding_rows_do_not_change_results(tiny_cfg, tiny_params, seqs):
  mixed = build_mixed("blocked", tiny_cfg, tiny_params, seqs)
  kv = nan_cache(tiny_cfg)
  first = pack([(seqs["decode"], 0, 7), (seqs["chunk"], 0, 5)])
  kv = run(tiny_params, tiny_cfg, kv, first)[1]
  # Twice the padding, and padding rows carrying arbitrary tokens/positions.
  batch = pack(mixed["parts"], num_rows=2 * ROWS, pad_token=5, pad_position=3)
  hidden, kv = run(tiny_params, tiny_cfg, kv, batch)
  np.testing.assert_allclose(np.asarray(hidden)[:11], mixed["hidden2"][:11], atol=1e-6)
  np.testing.assert_allclose(np.asarray(kv.k), np.asarray(mixed["kv"].k), atol=1e-6)
  np.testing.assert_allclose(np.asarray(kv.v), np.asarray(mixed["kv"].v), atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 10])
def test_chunked_prefill_equals_full_prefill(tiny_cfg, tiny_params, chunk):
  rng = np.random.default_rng(2)
  seq = Seq([9, 3, 12], rng.integers(0, tiny_cfg.vocab_size, 10))
  full_hidden, full_kv = run(tiny_params, tiny_cfg, nan_cache(tiny_cfg), pack([(seq, 0, 10)]))
  kv = nan_cache(tiny_cfg)
  for start in range(0, 10, chunk):
    end = min(start + chunk, 10)
    hidden, kv = run(tiny_params, tiny_cfg, kv, pack([(seq, start, end)]))
  np.testing.assert_allclose(np.asarray(hidden)[end - start - 1],
                             np.asarray(full_hidden)[9], atol=1e-5)
  for got, want in zip(cached_rows(kv, seq, 0, 10), cached_rows(full_kv, seq, 0, 10)):
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_untied_head_and_rope_theta(tiny_cfg, tiny_params):
  cfg = dataclasses.replace(tiny_cfg, tie_embeddings=False, rope_theta=500.0)
  head = jax.random.normal(jax.random.PRNGKey(3), (cfg.d_model, cfg.vocab_size)) * 0.02
  params = {**tiny_params, "lm_head": head}
  seq = Seq([1, 2], np.arange(7) * 11)
  hidden, _ = run(params, cfg, nan_cache(cfg), pack([(seq, 0, 7)]), "gather")
  ref = dense_forward(params, cfg, seq.tokens)
  np.testing.assert_allclose(np.asarray(hidden)[:7], ref["hidden"], atol=2e-5)
  logits = llama.compute_logits_jit(params, cfg, hidden[:7])
  np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=2e-5)


def test_bfloat16_params_track_float32(tiny_cfg, tiny_params):
  seq = Seq([4, 5], np.arange(8) * 7)
  batch = pack([(seq, 0, 8)])
  want, _ = run(tiny_params, tiny_cfg, nan_cache(tiny_cfg), batch, "gather")
  params16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), tiny_params)
  kv16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), nan_cache(tiny_cfg))
  got, kv16 = run(params16, tiny_cfg, kv16, batch, "gather")
  assert got.dtype == jnp.float32 and kv16.k.dtype == jnp.bfloat16
  err = np.abs(np.asarray(got)[:8] - np.asarray(want)[:8]).max()
  assert 0 < err < 0.1, err  # bf16 rounding (~3 significant digits), not garbage


def test_bfloat16_cache_is_stored_as_bits(tiny_cfg, tiny_params):
  # init_kv_cache stores a bfloat16 cache as its bits (XLA:CPU would widen a
  # bfloat16 pool for every gather); prefill then decode through it gives
  # the float bfloat16 cache's hidden rows and cache contents bitwise.
  assert llama.init_kv_cache(tiny_cfg, 2, PAGE_SIZE, jnp.bfloat16).k.dtype == jnp.uint16
  params16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), tiny_params)
  floats = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), nan_cache(tiny_cfg))
  bits = jax.tree_util.tree_map(lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16), floats)
  seq = Seq([4, 5, 9], np.arange(9) * 7)
  for batch in (pack([(seq, 0, 8)]), pack([(seq, 8, 9)])):
    want, floats = run(params16, tiny_cfg, floats, batch, "blocked_dot")
    got, bits = run(params16, tiny_cfg, bits, batch, "blocked_dot")
    assert bits.k.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for b, f in ((bits.k, floats.k), (bits.v, floats.v)):   # NaN pages included
      np.testing.assert_array_equal(np.asarray(b),
                                    np.asarray(jax.lax.bitcast_convert_type(f, jnp.uint16)))


def test_rope_matches_hand_worked_rotation():
  # head_dim 4, theta 100: pairs (0, 2) turn by pos * 1, (1, 3) by pos * 0.1.
  x = jnp.array([[[1.0, 2.0, 3.0, 4.0]]])
  got = np.asarray(llama.apply_rope(x, jnp.array([2]), 100.0))[0, 0]
  a, b = 2.0, 0.2
  want = [1 * np.cos(a) - 3 * np.sin(a), 2 * np.cos(b) - 4 * np.sin(b),
          3 * np.cos(a) + 1 * np.sin(a), 4 * np.cos(b) + 2 * np.sin(b)]
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_decode_step_updates_the_cache_in_place(tiny_cfg, impl="blocked"):
  # The donated cache must be aliased to the output and never copied: XLA's
  # scratch space does not grow with the number of pages.
  params = jax.eval_shape(lambda: llama.init_params(tiny_cfg, jax.random.PRNGKey(0)))
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  temp = {}
  for num_pages in (1024, 8192):
    kv = jax.eval_shape(lambda: llama.init_kv_cache(tiny_cfg, num_pages, PAGE_SIZE))
    cache_bytes = 2 * kv.k.size * 4
    compiled = llama.forward_jit.lower(
        params, tiny_cfg, kv, i32(8), i32(8), i32(8), i32(4), i32(4, 8), i32(5), i32(),
        attention_impl=impl).compile()
    stats = compiled.memory_analysis()
    assert stats.alias_size_in_bytes == cache_bytes
    temp[num_pages] = stats.temp_size_in_bytes
  assert temp[8192] <= temp[1024] + 4096, temp
  assert temp[8192] < cache_bytes / 8, temp


def test_row_tiled_rows_do_not_depend_on_the_bucket():
  """Every GEMM of ``row_tiled`` has 2..32 rows, so a row's bits are the
  same at any bucket T (one row, decode buckets, tiled prefill buckets with
  a padded last tile) and tiles past the live rows are not computed. The
  plain 64-row GEMM is checked to round differently, so the comparison
  can fail (SmolLM2's MLP shape)."""
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((576, 1536), np.float32))
  x = jnp.asarray(rng.standard_normal((100, 576), np.float32))
  fn = jax.jit(lambda x, n: llama.row_tiled(lambda h, _: h @ w, x, n))
  ref = np.asarray(fn(x[:2], 2))
  assert not np.array_equal(np.asarray(jax.jit(lambda x: x @ w)(x[:64]))[:2], ref)
  assert np.array_equal(np.asarray(fn(x[:1], 1)), ref[:1])
  for num_rows, num_live in [(4, 4), (32, 7), (64, 64), (100, 70)]:
    out = np.asarray(fn(x[:num_rows], num_live))
    np.testing.assert_array_equal(out[:2], ref, err_msg=f"T={num_rows}")
    if num_rows > 32:    # tiles of 32 holding a live row; later ones are zeros
      done = -(-num_live // 32) * 32
      for lo in range(0, done, 32):
        np.testing.assert_array_equal(out[lo:lo + 32], np.asarray(fn(x[lo:lo + 32], 32))[
            :num_rows - lo])
      assert not out[done:].any() and out[num_live:min(done, num_rows)].all()
  with pytest.raises(ValueError, match="tile must lie in"):
    llama.row_tiled(lambda h, _: h, x, 1, tile=33)


def test_rowwise_puts_prompt_rows_in_the_large_class_and_the_rest_in_tiles():
  """Prompt rows equal a plain 64-row GEMM whatever the bucket (padded when
  T < 64), the other live rows equal ``row_tiled`` alone, wherever they sit
  among the prompt rows; the two classes differ on SmolLM2's q/o shape, so
  the comparison can fail."""
  rng = np.random.default_rng(3)
  w = jnp.asarray(rng.standard_normal((576, 576), np.float32))
  x = rng.standard_normal((96, 576), np.float32)
  gemm = lambda h, _: h @ w
  large = np.asarray(jax.jit(lambda h: h @ w)(jnp.asarray(x[:64])))
  tiled = np.asarray(jax.jit(lambda h: llama.row_tiled(gemm, h, 2))(jnp.asarray(x[:2])))
  assert not np.array_equal(large[:2], tiled)
  fn = jax.jit(lambda h, p, n: llama.rowwise(gemm, h, n, llama.row_classes(p, n)))
  for num_rows, num_live, at in [(8, 6, [0, 3]), (96, 70, [10, 50]), (96, 96, [95, 40])]:
    rows = np.array(x[:num_rows])
    rows[at] = x[:2]                      # the two tiled rows, interleaved
    prompt = np.ones(num_rows, bool)
    prompt[at] = False
    out = np.asarray(fn(jnp.asarray(rows), jnp.asarray(prompt), jnp.int32(num_live)))
    live_prompt = np.flatnonzero(prompt[:num_live])
    padded = np.pad(rows, ((0, max(0, 64 - num_rows)), (0, 0)))   # a plain M >= 64 GEMM
    whole = np.asarray(jax.jit(lambda h: h @ w)(jnp.asarray(padded)))
    np.testing.assert_array_equal(out[live_prompt], whole[live_prompt])
    np.testing.assert_array_equal(out[at], tiled, err_msg=f"T={num_rows}")


def test_bfloat16_projection_is_a_native_gemm_within_rounding_of_float64():
  """``linear`` on bfloat16 operands multiplies them as they are (no float32
  copy of the weight in the compiled program, which a plain ``x @ w`` makes)
  and is within bfloat16 rounding of the float64 product: |error| <=
  2^-8 |x w| (the output's rounding) + K 2^-24 (|x| |w|) (float32
  accumulation)."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((40, 576)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((576, 1536)) * 0.05, jnp.bfloat16)
  widened = "f32[576,1536]"
  assert widened in jax.jit(lambda x, w: x @ w).lower(x, w).compile().as_text()
  assert widened not in jax.jit(llama.linear).lower(x, w).compile().as_text()
  got = jax.jit(llama.linear)(x, w)
  assert got.dtype == jnp.bfloat16
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want = x64 @ w64
  bound = 2.0 ** -8 * np.abs(want) + 576 * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64))
  err = np.abs(np.asarray(got, np.float64) - want)
  assert (err <= bound).all(), float((err / bound).max())
  assert err.max() > 0                         # rounded to bfloat16, not exact


def test_bfloat16_rows_round_alike_from_three_rows_and_row_tiled_pads_to_them():
  """The float32 accumulator of ``linear``'s bfloat16 GEMM (compared before
  its rounding to bfloat16, which would hide most differences) holds the
  same bits for a row at every row count M >= 3 wherever the row sits (the
  class ``row_tiled`` keeps bfloat16 GEMMs in, ``MIN_TILE_ROWS``); M = 2
  rounds apart on some shape on AVX-512 BF16 CPUs (the control, so the
  comparison can fail; a warning where the CPU rounds them alike),
  and ``row_tiled`` of 1 or 2 rows gives the M >= 3 bits."""
  rng = np.random.default_rng(6)
  gemm = lambda h, w: jax.lax.dot_general(h, w, (((1,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)
  fn = jax.jit(lambda x, w, n: llama.row_tiled(lambda h, _: gemm(h, w), x, n))
  plain = jax.jit(gemm)
  two_apart = []
  for k, n in [(576, 576), (64, 64), (64, 32), (128, 64)]:   # SmolLM2 q/o, tiny shapes
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((100, k)), jnp.bfloat16)
    ref = np.asarray(plain(x[:3], w))[:1]
    for m in (4, 7, 32, 33, 64, 100):
      np.testing.assert_array_equal(np.asarray(plain(x[:m], w))[:1], ref, err_msg=f"M={m}")
      np.testing.assert_array_equal(np.asarray(plain(jnp.roll(x[:m], m - 1, 0), w))[m - 1:],
                                    ref, err_msg=f"M={m}, last row")
    for num_rows in (1, 2):
      np.testing.assert_array_equal(np.asarray(fn(x[:num_rows], w, num_rows))[:1], ref)
    two_apart.append(not np.array_equal(np.asarray(plain(x[:2], w))[:1], ref))
  if not any(two_apart):
    # The CPU's bf16 GEMM kernels decide it: M = 2 rounds apart on AVX-512
    # BF16 Xeons, not on an AVX2-only AMD EPYC, where the control cannot show
    # the comparisons above would catch a row in the wrong class.
    warnings.warn("M = 2 rounds like M >= 3 on this CPU: the control is not "
                  "discriminating here")
  with pytest.raises(ValueError, match=r"tile must lie in \[4, 32\]"):
    llama.row_tiled(lambda h, _: h, x, 1, tile=3)


def test_bfloat16_decode_row_does_not_depend_on_the_bucket(tiny_cfg, tiny_params, seqs):
  """bfloat16 weights: a decode row's hidden state is bitwise the same alone
  in a 1-row bucket and beside other rows in 8- and 40-row buckets (every
  projection in one bfloat16 GEMM class, ``row_tiled``). At this model's
  size the bfloat16 rounding of each projection hides the 2-row GEMM's
  float32 differences; the GEMM-level test above is the one that sees them."""
  params16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), tiny_params)
  kv = llama.init_kv_cache(tiny_cfg, NUM_PAGES, PAGE_SIZE, jnp.bfloat16)
  history = [(seqs["decode"], 0, 7), (seqs["chunk"], 0, 5)]
  _, kv = run(params16, tiny_cfg, kv, pack(history), "gather")
  decode = (seqs["decode"], 7, 8)
  others = [(seqs["chunk"], 5, 9), (seqs["prompt"], 0, 6)]
  hidden = {}
  for num_rows, parts in [(1, [decode]), (8, [decode, others[0]]), (40, [decode] + others)]:
    got, _ = run(params16, tiny_cfg, jax.tree_util.tree_map(jnp.copy, kv),
                 pack(parts, num_rows=num_rows), "gather")
    hidden[num_rows] = np.asarray(got)[0]
  for num_rows in (8, 40):
    np.testing.assert_array_equal(hidden[num_rows], hidden[1], err_msg=f"T={num_rows}")


def test_decode_row_bits_with_other_weights(tiny_cfg, tiny_params, seqs):
  """A lone decode row (one layer, ``blocked_dot``, wk scaled by 1.0001) has the
  same hidden state in 4-, 8- and 16-row buckets.

  With a slot batch sized by the bucket this failed: XLA:CPU's exp rounded
  some scores apart between the 4- and the 8-row bucket's online-softmax
  arrays ``[W, Hkv, M]``; the tiny weights unscaled happened to pass."""
  cfg = dataclasses.replace(tiny_cfg, n_layers=1)
  layers = jax.tree_util.tree_map(lambda x: x[:1], tiny_params["layers"])
  layers["attn"] = dict(layers["attn"], wk=layers["attn"]["wk"] * np.float32(1.0001))
  params = dict(tiny_params, layers=layers)
  kv = llama.init_kv_cache(cfg, NUM_PAGES, PAGE_SIZE)
  _, kv = run(params, cfg, kv, pack([(seqs["decode"], 0, 7)]), "blocked_dot")
  hidden = {}
  for num_rows in (4, 8, 16):
    got, _ = run(params, cfg, jax.tree_util.tree_map(jnp.copy, kv),
                 pack([(seqs["decode"], 7, 8)], num_rows=num_rows), "blocked_dot")
    hidden[num_rows] = np.asarray(got)[0]
  for num_rows in (8, 16):
    np.testing.assert_array_equal(hidden[num_rows], hidden[4], err_msg=f"T={num_rows}")


def test_row_sum_does_not_depend_on_the_row_count():
  """``row_sum`` (RMSNorm's sum of squares) gives a row the same bits at
  any row count and equals the float64 sum to float32 rounding; XLA's own
  reduce is checked to round by the row count, so the test can fail."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((64, 576), np.float32))
  ours, xla = jax.jit(llama.row_sum), jax.jit(lambda x: jnp.sum(x, -1, keepdims=True))
  assert any(not np.array_equal(np.asarray(xla(x[:n])), np.asarray(xla(x))[:n])
             for n in (1, 8, 16))
  for n in (1, 3, 8, 16, 33):
    np.testing.assert_array_equal(np.asarray(ours(x[:n])), np.asarray(ours(x))[:n])
  np.testing.assert_allclose(np.asarray(ours(x))[:, 0],
                             np.asarray(x, np.float64).sum(-1), rtol=0, atol=1e-4)
