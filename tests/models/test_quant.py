"""int8 weights (W8A8, ``models.quant``): the quantizers, the int8 GEMM
against numpy integer references, its batch invariance, the quantized
parameter tree, and the tiny model run on it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import llama, quant
from test_llama import NUM_PAGES, PAGE_SIZE, Seq, nan_cache, pack, run, seqs  # noqa: F401 (fixture)

# SmolLM2-135M's projection shapes K x N: q/o, k/v, gate/up, down.
SMOLLM2_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]
ROW_COUNTS = (2, 4, 32, 64, 256)

_linear = jax.jit(quant.linear)
_quantize_rows = jax.jit(quant.quantize_rows)


def _weight(rng, k, n):
  return quant.quantize_columns(0.02 * rng.standard_normal((k, n)).astype(np.float32))


def _rows(rng, m, k):
  """Random rows with an all-zero row and rows of very different magnitudes
  (1e-6 .. 1e4 times the others) among them."""
  x = rng.standard_normal((m, k)).astype(np.float32)
  x[1] = 0.0
  x[2] *= 1e-6
  x[3] *= 1e4
  x[m // 2] *= 1e-3
  x[-1] *= 300.0
  return x


def _is_qw(x):
  return isinstance(x, quant.QuantizedWeight)


def test_linear_equals_reference_linear_bitwise():
  """``quant.linear`` (jit) equals the numpy int64 ``reference_linear``
  bitwise on SmolLM2's projection shapes at several row counts, with an
  all-zero row and rows of very different magnitudes (the module docstring's
  claim)."""
  rng = np.random.default_rng(0)
  bad = []
  for k, n in SMOLLM2_SHAPES:
    w = _weight(rng, k, n)
    x = _rows(rng, max(ROW_COUNTS), k)
    for m in ROW_COUNTS:
      got = np.asarray(_linear(jnp.asarray(x[:m]), w))
      want = quant.reference_linear(x[:m], w)
      if not np.array_equal(got, want):
        bad.append((k, n, m, int((got != want).any(-1).sum())))
  assert not bad, f"(K, N, M, rows that differ): {bad}"


def test_linear_is_the_exact_integer_gemm_of_its_quantized_rows():
  """Whatever the rounding of its division, ``linear`` is the exact integer
  product of the rows ``quantize_rows`` gives (numpy int64 sums) times
  ``row_scale * col_scale`` in float32; and ``quantize_rows`` is a faithful
  symmetric quantizer: |a| <= 127, the row scale within 1 ulp of
  ``max|x| / 127`` (1 for the zero row), ``|x / scale - a| <= 1/2`` up to
  float32 rounding, and 127 reached on every nonzero row."""
  rng = np.random.default_rng(1)
  for k, n in SMOLLM2_SHAPES:
    w = _weight(rng, k, n)
    x = _rows(rng, max(ROW_COUNTS), k)
    for m in ROW_COUNTS:
      a, scale = map(np.asarray, _quantize_rows(jnp.asarray(x[:m])))
      assert a.dtype == np.int8 and scale.shape == (m, 1) and scale.dtype == np.float32
      acc = a.astype(np.int64) @ np.asarray(w.q, np.int64)
      want = acc.astype(np.float32) * (scale * np.asarray(w.col_scale))
      np.testing.assert_array_equal(np.asarray(_linear(jnp.asarray(x[:m]), w)), want,
                                    err_msg=f"K={k} N={n} M={m}")
    amax = np.abs(x).max(-1, keepdims=True).astype(np.float64)
    exact = np.where(amax > 0, amax / 127, 1.0)
    assert (np.abs(scale - exact) <= np.spacing(scale)).all()
    assert scale[1, 0] == 1.0 and not a[1].any()                  # the zero row
    assert np.abs(a).max() <= quant.QMAX
    live = amax[:, 0] > 0
    assert (np.abs(a[live]).max(-1) == quant.QMAX).all()
    err = np.abs(x / scale.astype(np.float64) - a)
    assert err.max() <= 0.5 + 127 * 2.0 ** -21, err.max()
  # The result is within quantization error of the float product (not garbage):
  # each operand off by <= half a step per element.
  x, w_f = x[4:36], np.asarray(w.q, np.float64) * np.asarray(w.col_scale)
  got = np.asarray(_linear(jnp.asarray(x), w), np.float64)
  bound = 0.5 * (np.abs(x).max(-1, keepdims=True) / 127) * np.abs(w_f).sum(0) * 1.001
  assert (np.abs(got - x @ w_f) <= bound).all()


def test_linear_row_does_not_depend_on_the_row_count_or_its_place():
  """A row's ``linear`` result under jit has the same bits at any row count
  M (2..64, 256) and as the first or the last row, beside random other rows
  of other magnitudes: the int32 sums are exact and its scale is its own."""
  rng = np.random.default_rng(2)
  for k, n in SMOLLM2_SHAPES:
    w = _weight(rng, k, n)
    row = rng.standard_normal((1, k)).astype(np.float32)
    want = np.asarray(_linear(jnp.asarray(np.concatenate([row, row])), w))[0]
    for m in (2, 3, 5, 8, 17, 32, 33, 64, 256):
      others = _rows(rng, max(m - 1, 4), k)[:m - 1] * rng.uniform(0.1, 10)
      for at, x in ((0, np.concatenate([row, others])), (m - 1, np.concatenate([others, row]))):
        got = np.asarray(_linear(jnp.asarray(x), w))[at]
        np.testing.assert_array_equal(got, want, err_msg=f"K={k} N={n} M={m} row {at}")


def test_int8_swiglu_row_does_not_depend_on_the_row_count_or_its_place():
  """SmolLM2's int8 SwiGLU MLP as the model runs it (``rowwise(...,
  exact=True)``: one GEMM over every row of the bucket, silu and the
  product between the projections) gives a row the same bits at any row
  count and place: the elementwise ops between the GEMMs round a row alike
  in every shape, as the model's one-GEMM int8 path needs."""
  rng = np.random.default_rng(7)
  w_gate, w_up, w_down = _weight(rng, 576, 1536), _weight(rng, 576, 1536), _weight(rng, 1536, 576)
  mlp = lambda h, _: quant.linear(jax.nn.silu(quant.linear(h, w_gate)) * quant.linear(h, w_up),
                               w_down)
  fn = jax.jit(lambda x: llama.rowwise(mlp, x, x.shape[0], exact=True))
  row = rng.standard_normal((1, 576)).astype(np.float32)
  want = np.asarray(fn(jnp.asarray(row)))[0]
  for m in (2, 4, 7, 32, 33, 64, 200, 256):
    others = rng.standard_normal((m - 1, 576)).astype(np.float32) * rng.uniform(0.1, 10)
    for at, x in ((0, np.concatenate([row, others])), (m - 1, np.concatenate([others, row]))):
      np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x)))[at], want,
                                    err_msg=f"M={m} row {at}")


def test_quantize_columns():
  rng = np.random.default_rng(3)
  w = 0.05 * rng.standard_normal((2, 96, 40)).astype(np.float32)
  w[1, :, 7] = 0.0                                          # an all-zero column
  w[0, :, 3] *= 1e-4
  qw = quant.quantize_columns(w)
  q, scale = np.asarray(qw.q), np.asarray(qw.col_scale)
  assert q.dtype == np.int8 and q.shape == w.shape
  assert scale.dtype == np.float32 and scale.shape == (2, 40)
  assert np.abs(q.astype(np.int32)).max() <= quant.QMAX
  assert scale[1, 7] == 1.0 and not q[1, :, 7].any()
  # Each dequantized value within half a step of w (plus float32 rounding of
  # w / scale, |w / scale| <= 127), the step the column's max|w| / 127.
  step = scale.astype(np.float64)[..., None, :]
  err = np.abs(q * step - w)
  assert (err <= step * (0.5 + 127 * 2.0 ** -23)).all()
  assert (err > 0.45 * step).any()          # the bound is tight: rounding, not exact
  amax = np.abs(w).max(-2)
  np.testing.assert_allclose(scale[amax > 0], amax[amax > 0] / 127, rtol=2 ** -23)
  assert (np.abs(q).max(-2)[amax > 0] == quant.QMAX).all()
  # contract_axis -1: a [..., N, K] array quantized as its transpose.
  qt = quant.quantize_columns(np.swapaxes(w, -1, -2), contract_axis=-1)
  np.testing.assert_array_equal(np.asarray(qt.q), q)
  np.testing.assert_array_equal(np.asarray(qt.col_scale), scale)
  for axis in (0, 1, -3, 2):
    with pytest.raises(ValueError, match="contract_axis must be -2 or -1"):
      quant.quantize_columns(w, contract_axis=axis)
  # int32 sums of K int8 products stay exact up to MAX_CONTRACTION.
  assert quant.MAX_CONTRACTION * quant.QMAX ** 2 <= 2 ** 31 - 1
  assert (quant.MAX_CONTRACTION + 1) * quant.QMAX ** 2 > 2 ** 31 - 1
  with pytest.raises(ValueError, match="contraction length 133145 exceeds 133144"):
    quant.quantize_columns(np.ones((quant.MAX_CONTRACTION + 1, 1), np.float32))


def test_quantize_params_of_the_tiny_model(tiny_cfg, tiny_params):
  assert tiny_cfg.tie_embeddings
  assert not quant.is_quantized(tiny_params)
  qp = quant.quantize_params(tiny_params, tiny_cfg.tie_embeddings)
  assert quant.is_quantized(qp) and not quant.is_quantized(tiny_params)
  flat_in = dict(jax.tree_util.tree_leaves_with_path(tiny_params["layers"]))
  flat_out = dict(jax.tree_util.tree_leaves_with_path(qp["layers"], is_leaf=_is_qw))
  assert flat_out.keys() == flat_in.keys()
  projections = set()
  for path, leaf in flat_out.items():
    name = path[-1].key
    orig = flat_in[path]
    if name == "scale":                                   # norm scales unchanged
      assert leaf.dtype == jnp.float32
      np.testing.assert_array_equal(np.asarray(leaf), np.asarray(orig))
      continue
    projections.add(name)
    assert _is_qw(leaf), name
    layers, k, n = orig.shape
    assert leaf.q.dtype == jnp.int8 and leaf.q.shape == (layers, k, n), name
    assert leaf.col_scale.dtype == jnp.float32 and leaf.col_scale.shape == (layers, n), name
    for layer in range(layers):              # stacked: each layer quantized on its own
      alone = quant.quantize_columns(orig[layer])
      np.testing.assert_array_equal(np.asarray(leaf.q[layer]), np.asarray(alone.q))
      np.testing.assert_array_equal(np.asarray(leaf.col_scale[layer]),
                                    np.asarray(alone.col_scale))
  assert projections == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
  for key in ("embed", "final_norm"):
    for a, b in zip(jax.tree_util.tree_leaves(qp[key]),
                    jax.tree_util.tree_leaves(tiny_params[key])):
      assert a.dtype == jnp.float32
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  head = qp["lm_head"]
  assert _is_qw(head) and head.q.dtype == jnp.int8
  assert head.q.shape == (tiny_cfg.d_model, tiny_cfg.vocab_size)
  assert head.col_scale.shape == (tiny_cfg.vocab_size,)
  tied = quant.quantize_columns(np.asarray(tiny_params["embed"]["embedding"]).T)
  np.testing.assert_array_equal(np.asarray(head.q), np.asarray(tied.q))
  assert quant.quantize_params(qp, tiny_cfg.tie_embeddings) is qp
  params16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), tiny_params)
  with pytest.raises(ValueError, match="float32"):
    quant.quantize_params(params16, tiny_cfg.tie_embeddings)


@pytest.fixture(scope="module")
def quantized(tiny_cfg, tiny_params):
  return quant.quantize_params(tiny_params, tiny_cfg.tie_embeddings)


def test_int8_model_logits_are_within_quantization_error_of_float32(
    tiny_cfg, tiny_params, quantized):
  """The tiny model on int8 weights gives logits close to float32's.

  Tolerance: symmetric int8 rounding leaves each weight (activation) off by
  U(+-step / 2), step = max|column (row)| / 127, so a projection's output
  is off by a relative rms of about (max / rms) / (127 sqrt(12)) per
  operand: ~2.5 / 440 ~ 0.6% for these 64..128-long Gaussian-like vectors,
  ~0.8% for both operands. Nine projections in series (2 layers x q/k/v, o,
  gate/up, down, then the head), adding in quadrature: ~2.5%. The bound is
  5% of the logits' std (measured: ~1.3%); the error is also above 0.1%,
  far above float32 reassociation (~1e-6), so the int8 path ran."""
  seq = Seq([4, 5], np.arange(8) * 7)
  batch = pack([(seq, 0, 8)])
  logits = {}
  for name, params in (("float32", tiny_params), ("int8", quantized)):
    hidden, kv = run(params, tiny_cfg, nan_cache(tiny_cfg), batch, "gather")
    assert hidden.dtype == jnp.float32 and kv.k.dtype == jnp.float32
    logits[name] = np.asarray(llama.compute_logits_jit(params, tiny_cfg, hidden[:8]))
  want, got = logits["float32"], logits["int8"]
  assert got.shape == want.shape == (8, tiny_cfg.vocab_size)
  assert np.isfinite(got).all()
  assert not np.array_equal(got, want)
  rel = np.sqrt(np.mean((got - want) ** 2)) / want.std()
  assert 1e-3 < rel < 0.05, rel
  assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_int8_projection_and_residual_add_do_not_depend_on_the_bucket():
  """The decoder block's ``x + row_tiled(linear)`` (the residual after an
  int8 projection) gives a row the same bits in a 2-row bucket (one GEMM)
  and in a 40-row one (32-row tiles in a loop); the minimal form of the
  model-level check below."""
  rng = np.random.default_rng(4)
  w = _weight(rng, 64, 64)
  h = rng.standard_normal((40, 64)).astype(np.float32)
  x = rng.standard_normal((40, 64)).astype(np.float32)
  fn = jax.jit(lambda x, h, n: x + llama.row_tiled(lambda r, _: quant.linear(r, w), h, n))
  small = np.asarray(fn(x[:2], h[:2], 2))
  big = np.asarray(fn(x, h, 2))[:2]
  np.testing.assert_array_equal(small, big)


@pytest.mark.parametrize("num_rows, classes", [
    (8, False),
    (40, False),
    (64, True),
    (256, True),
])
def test_int8_decode_row_does_not_depend_on_the_bucket(tiny_cfg, quantized, seqs, num_rows,  # noqa: F811 (the imported fixture)
                                                        classes):
  """int8 weights: a decode row's hidden state and logits are bitwise the
  same alone in a 1-row bucket (a 2-row GEMM) and beside other rows in
  8-, 40-, 64- and 256-row buckets, with and without the engine's row
  classes (``prompt_rows``): int8 projections have no bit classes, so every
  bucket runs each projection as one GEMM over all its rows (``rowwise``'s
  ``exact``)
  (``test_bfloat16_decode_row_does_not_depend_on_the_bucket``)."""
  kv = llama.init_kv_cache(tiny_cfg, NUM_PAGES, PAGE_SIZE)
  history = [(seqs["decode"], 0, 7), (seqs["chunk"], 0, 5)]
  _, kv = run(quantized, tiny_cfg, kv, pack(history), "gather")
  decode = (seqs["decode"], 7, 8)
  others = [(seqs["chunk"], 5, 9)] if num_rows == 8 else [(seqs["chunk"], 5, 9),
                                                          (seqs["prompt"], 0, 6)]
  hidden, logits = {}, {}
  for rows, parts in [(1, [decode]), (num_rows, [decode] + others)]:
    batch = pack(parts, num_rows=rows)
    if classes:     # serving.engine.executor's classes: the chunk and the prompt are prompt rows
      batch["prompt_rows"] = jnp.arange(rows) > 0
    got, _ = llama.forward_jit(quantized, tiny_cfg, jax.tree_util.tree_map(jnp.copy, kv),
                               **batch, attention_impl="blocked_dot")
    hidden[rows] = np.asarray(got)[0]
    logits[rows] = np.asarray(llama.compute_logits_jit(quantized, tiny_cfg, got))[0]
  np.testing.assert_array_equal(hidden[num_rows], hidden[1], err_msg=f"T={num_rows}")
  np.testing.assert_array_equal(logits[num_rows], logits[1], err_msg=f"T={num_rows}")


def _amx_or_skip():
  from models import amx
  reason = amx.unavailable_reason()
  if reason is not None:
    pytest.skip(f"AMX int8 kernel unavailable: {reason}")
  return amx


def _tiled(w):
  from models import amx
  return quant.QuantizedWeight(q=jnp.asarray(amx.to_tiles(np.asarray(w.q))),
                               col_scale=w.col_scale, layout="tiles")


def test_tile_layout_follows_its_formula_and_refuses_shapes_that_do_not_fit():
  """``amx.to_tiles`` permutes a [.., K, N] weight's bytes into B tiles:
  every element sits where the layout's formula puts it (each layer of a
  stack on its own); other shapes are refused by name."""
  from models import amx
  rng = np.random.default_rng(8)
  q = rng.integers(-127, 128, (2, 128, 64), dtype=np.int8)
  t = amx.to_tiles(q)
  assert t.shape == q.shape
  k, n = np.meshgrid(np.arange(128), np.arange(64), indexing="ij")
  offset = ((n // 16) * (128 // 64) + k // 64) * 1024 + 64 * ((k % 64) // 4) + 4 * (n % 16) + k % 4
  for layer in range(2):
    flat = t[layer].reshape(-1)
    assert sorted(offset.reshape(-1).tolist()) == list(range(128 * 64))
    np.testing.assert_array_equal(flat[offset], q[layer])
  assert amx.fits(576, 192) and not amx.fits(576, 200) and not amx.fits(100, 64)
  with pytest.raises(ValueError, match="does not fit the tiles"):
    amx.to_tiles(np.zeros((96, 64), np.int8))


def test_amx_linear_equals_reference_linear_bitwise():
  """The AMX kernel (weights in the tile layout) gives ``reference_linear``'s
  bits on SmolLM2's projection shapes and the LM head's, at row counts that
  fill, split and pad its 16- and 32-row blocks, an all-zero row and rows of
  very different magnitudes among them (1, 5, 17, 33, 256 rows); and a ``LayerWeight`` selects each
  layer of a stack."""
  _amx_or_skip()
  rng = np.random.default_rng(9)
  bad = []
  for k, n in SMOLLM2_SHAPES + [(576, 4096)]:
    w = _weight(rng, k, n)
    tiled = _tiled(w)
    x = _rows(rng, 256, k)
    for m in (1, 5, 17, 33, 256):
      got = np.asarray(_linear(jnp.asarray(x[:m]), tiled))
      if not np.array_equal(got, quant.reference_linear(x[:m], w)):
        bad.append((k, n, m))
  assert not bad, f"(K, N, M) that differ: {bad}"
  layers = [_weight(rng, 64, 96) for _ in range(3)]
  stack = quant.QuantizedWeight(q=jnp.stack([w.q for w in layers]),
                                col_scale=jnp.stack([w.col_scale for w in layers]))
  stack = _tiled(stack)
  x = _rows(rng, 8, 64)
  pick = jax.jit(lambda x, layer: quant.linear(x, quant.LayerWeight(stack=stack, layer=layer)))
  for i, w in enumerate(layers):
    np.testing.assert_array_equal(np.asarray(pick(jnp.asarray(x), i)),
                                  quant.reference_linear(x, w), err_msg=f"layer {i}")


def test_amx_params_give_the_xla_params_hidden_states(tiny_cfg, tiny_params, quantized, seqs):  # noqa: F811 (the fixture)
  """The tiny model quantized for the AMX kernel (every projection and the
  LM head in the tile layout, the stacks indexed by layer inside the
  kernel) gives the XLA path's hidden states, cache and logits bitwise."""
  _amx_or_skip()
  tiled = quant.quantize_params(tiny_params, tiny_cfg.tie_embeddings, gemm="amx")
  layouts = {w.layout for w in jax.tree_util.tree_leaves(tiled, is_leaf=_is_qw) if _is_qw(w)}
  assert layouts == {"tiles"}
  batch = pack([(seqs["chunk"], 0, 9), (seqs["prompt"], 0, 6)])
  out = {}
  for name, params in (("xla", quantized), ("amx", tiled)):
    hidden, kv = run(params, tiny_cfg, nan_cache(tiny_cfg), batch, "gather")
    out[name] = (np.asarray(hidden), np.asarray(kv.k), np.asarray(kv.v),
                 np.asarray(llama.compute_logits_jit(params, tiny_cfg, hidden[:15])))
  assert np.isfinite(out["amx"][0][:15]).all() and np.isfinite(out["amx"][3]).all()
  for a, b in zip(out["xla"], out["amx"]):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="gemm must be"):
    quant.quantize_params(tiny_params, tiny_cfg.tie_embeddings, gemm="tiles")


def test_int8_gemm_resolution():
  """``amx.resolve``: "xla" stays, "auto" is "amx" exactly where the kernel
  runs, "amx" where it cannot is refused with the reason, other values are
  refused by name."""
  from models import amx
  assert amx.resolve("xla") == "xla"
  assert amx.resolve("auto") == ("amx" if amx.available() else "xla")
  with pytest.raises(ValueError, match="int8_gemm must be one of"):
    amx.resolve("tiles")
  if not amx.available():
    with pytest.raises(ValueError, match="int8_gemm 'amx'"):
      amx.resolve("amx")
