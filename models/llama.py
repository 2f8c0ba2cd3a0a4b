"""The decoder of every served family (Llama, Qwen2/3, Mistral, Gemma 2/3,
Phi-3, Mixtral, Qwen3-MoE) over packed, paged rows.

One definition, the families by configuration (``models.config.ModelConfig``):
pre-RMSNorm blocks with RoPE (default, llama3, linear, yarn; partial
rotary), GQA with optional q/k/v/o biases and per-head q/k norms, per-layer
sliding windows (a ``lax.switch`` over the distinct windows, each static in
its branch), attention and final logit soft-caps, a gated MLP (SwiGLU or
GeGLU) or a mixture of experts (``MoE``: top-k routing, grouped expert GEMMs
with ``jax.lax.ragged_dot``), Gemma's ``1 + weight`` norms, sandwich norms
and scaled embeddings.

One call of ``forward`` runs every decoder block over a packed iteration: the
token rows of several sequences (decode rows, prefill chunks with committed
history, whole prompts) laid end to end, plus padding rows. Row-wise work
(norms, projections, MLP) runs over all rows in ``rowwise``: a prompt row
(position < its request's prompt length) in one GEMM of at least
``LARGE_GEMM_ROWS`` rows, every other row in ``row_tiled`` tiles of 2 (4 for
bfloat16) to 32 rows, so a row's bits depend only on its request and
position, never on the bucket or its neighbours; attention is request-local
and reads the paged KV cache through ``attention.ragged.ragged_paged_attention``.
Projections are ``linear``: bfloat16 weights run native bfloat16 GEMMs with
float32 accumulation.

The blocks' weights are stacked on a leading layer axis and run with
``flax.linen.scan`` (a ``lax.scan``), so one block is traced and compiled
whatever ``n_layers`` is. The projections are not sliced by the scan:
``forward`` hands them to the blocks as per-layer buffers (``split_layers``;
the engine stores them so) and each GEMM reads its layer's buffer through a
``lax.switch`` on the layer index (XLA:CPU copies a sliced layer out). The
whole KV cache travels in the scan carry as a
flat pool of ``n_layers * num_pages`` pages; layer ``l`` owns pages
``[l * num_pages, (l + 1) * num_pages)``. Each block scatters its rows into its
own pages and hands attention a page table shifted by ``l * num_pages``, so no
block slices out (copies) its layer's cache, and XLA updates the carry in place.

Conventions follow HF ``transformers``' modeling files of each family:
RMSNorm computed in float32 then scaled, RoPE with the rotate-half layout
(the first half of a head holds the "real" parts), cos/sin rounded to the
activation dtype. Weights are stored ``[in, out]`` (the transpose of torch's
Linear).

Parameter tree (``L = n_layers``, ``E = num_experts``; entries marked with a
switch exist only under it; ``lm_head`` only when embeddings are untied)::

  embed/embedding             [vocab, d_model]
  layers/attn_norm/scale      [L, d_model]
  layers/attn/wq              [L, d_model, n_heads * head_dim]
  layers/attn/wk              [L, d_model, n_kv_heads * head_dim]
  layers/attn/wv              [L, d_model, n_kv_heads * head_dim]
  layers/attn/wo              [L, n_heads * head_dim, d_model]
  layers/attn/bq, bk, bv      [L, q_dim], [L, kv_dim], [L, kv_dim]   qkv_bias
  layers/attn/bo              [L, d_model]                           o_bias
  layers/attn/q_norm/scale    [L, head_dim] (and k_norm)             qk_norm
  layers/post_attn_norm/scale [L, d_model]                           post_norms
  layers/mlp_norm/scale       [L, d_model]
  layers/mlp/w_gate, w_up     [L, d_model, ffn_dim]                  dense
  layers/mlp/w_down           [L, ffn_dim, d_model]                  dense
  layers/moe/router           [L, d_model, E]                        num_experts
  layers/moe/experts_gate, experts_up [L, E, d_model, ffn_dim]       num_experts
  layers/moe/experts_down     [L, E, ffn_dim, d_model]               num_experts
  layers/post_mlp_norm/scale  [L, d_model]                           post_norms
  final_norm/scale            [d_model]
  lm_head                     [d_model, vocab]

Norm scales are stored as HF stores them (Gemma's raw weight; ``RMSNorm``
adds the 1).

With int8 weights (``models.quant.quantize_params``) every ``layers/attn/w*``
and ``layers/mlp/w_*`` leaf is a ``QuantizedWeight`` (``q`` int8[L, K, N],
``col_scale`` f32[L, N]) and ``lm_head`` is one of int8[d_model, vocab], tied
embeddings included (the float32 embedding stays for the lookup). The int8
stacks are not sliced by the blocks' scan: ``forward`` passes them whole
(``_Batch.weights``) and each block's GEMM selects its layer
(``quant.LayerWeight``); the AMX kernel reads it in place.

One file: the decoder is one definition for every family, and its blocks,
the row-wise GEMM tiling and the paged KV writes are read together when a
row's bits are checked, so they stay side by side (the configs, the MoE
layer and the loaders live apart).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from attention.ragged import KV_BITS, ragged_paged_attention, write_kv_pages
from models import moe, quant, rowgemm, sharding
from models.config import ModelConfig, RopeConfig

_WEIGHT_INIT = nn.initializers.normal(stddev=0.02)

# Most rows in one GEMM of a row-wise map (``row_tiled``).
ROW_TILE = 32
# Fewest rows of a ``row_tiled`` GEMM, by operand dtype: XLA:CPU rounds a
# float32 row alike for every M in 2..32 but M = 1 apart; a bfloat16 row
# (``linear``'s native bfloat16 GEMM, float32 accumulation) alike for every
# M >= 3 but M = 1 and M = 2 each apart (measured, jax 0.10.2), and 3- or
# 4-row bfloat16 GEMMs cost about what 2 rows do.
MIN_TILE_ROWS = {jnp.dtype(jnp.float32): 2, jnp.dtype(jnp.bfloat16): 4}
# Fewest rows of a prompt rows' GEMM (``rowwise``): every M >= 64 is one
# float32 bit class on all projection shapes of SmolLM2 and the tiny model.
LARGE_GEMM_ROWS = 64


def row_tiled(fn, x: jax.Array, num_live, tile: int = ROW_TILE) -> jax.Array:
  """Applies the row-wise map ``fn`` to ``x`` in GEMMs of ``m`` to ``tile`` rows.

  XLA:CPU picks a float32 GEMM kernel, and so the summation order, by the
  row count M: on SmolLM2's and the tiny model's shapes a row's bits are
  the same for every M in 2..32 (whatever the other rows hold or where the
  row sits) but differ for M = 1 and for M >= 33 or >= 48 (measured, jax
  0.10.2; docs/archive/benchmarks-log.md "Decode without padding waste"). A bfloat16
  row (``linear``) rounds alike for every M >= 3, M = 1 and M = 2 apart
  (docs/archive/benchmarks-log.md "Native bfloat16 GEMMs"). ``m = MIN_TILE_ROWS[x.dtype]``
  (2 for float32, 4 for bfloat16); keeping every GEMM's M inside
  ``m..tile`` makes a row's result independent of its batch at any bucket
  size:

  * ``T <= tile`` rows (a decode bucket): one call of ``fn`` on all rows,
    zero-padded to ``m`` rows if ``T < m``;
  * ``T > tile``: ``x`` is cut into ``tile``-row tiles (zero-padded to a
    multiple) and ``fn`` runs once per tile holding a live row, in a
    ``fori_loop`` of ``ceil(num_live / tile)`` trips; later tiles are zeros.

  Args:
    fn: ``fn(rows, live)`` maps [M, K] -> [M, N] (or a tuple of such) row
      by row, no mixing of rows, for m <= M <= tile; ``live`` (i32[]) says
      how many leading rows of ``rows`` are live: the others' results are
      never used (``fn`` may skip them).
    x: [T, K] rows, float32 or bfloat16; rows at or beyond ``num_live`` are
      padding.
    num_live: i32[] live rows (a prefix of ``x``), 0 <= num_live <= T.
    tile: static, the most rows per GEMM (m..32 to stay in one bit class).

  Returns:
    ``fn``'s result for all T rows; padding rows hold unspecified finite
    values.

  Raises:
    ValueError: if ``x.dtype`` is neither float32 nor bfloat16, or ``tile``
      is not in [m, 32].
  """
  min_rows = MIN_TILE_ROWS.get(jnp.dtype(x.dtype))
  if min_rows is None:
    raise ValueError(f"x.dtype must be float32 or bfloat16 (a measured GEMM bit class), "
                     f"got {x.dtype}")
  if not min_rows <= tile <= 32:
    raise ValueError(f"tile must lie in [{min_rows}, 32] (one {x.dtype} GEMM bit class), "
                     f"got {tile}")
  num_rows = x.shape[0]
  tmap = jax.tree_util.tree_map
  if num_rows <= tile:
    live = jnp.clip(jnp.reshape(jnp.asarray(num_live, jnp.int32), ()), 0, num_rows)
    if num_rows < min_rows:                # too few rows: a bit class of their own
      padded = jnp.pad(x, ((0, min_rows - num_rows), (0, 0)))
      return tmap(lambda y: y[:num_rows], fn(padded, live))
    return fn(x, live)
  padded = -(-num_rows // tile) * tile
  if padded != num_rows:
    x = jnp.pad(x, ((0, padded - num_rows), (0, 0)))
  out_aval = jax.eval_shape(fn, jax.ShapeDtypeStruct((tile,) + x.shape[1:], x.dtype),
                            jax.ShapeDtypeStruct((), jnp.int32))
  num_live = jnp.clip(jnp.reshape(jnp.asarray(num_live, jnp.int32), ()), 0, num_rows)

  def body(i, out):
    rows = jax.lax.dynamic_slice_in_dim(x, i * tile, tile)
    live = jnp.clip(num_live - i * tile, 0, tile)
    return tmap(lambda o, y: jax.lax.dynamic_update_slice_in_dim(o, y, i * tile, 0),
                out, fn(rows, live))

  out = tmap(lambda a: jnp.zeros((padded,) + a.shape[1:], a.dtype), out_aval)
  out = jax.lax.fori_loop(0, (num_live + tile - 1) // tile, body, out)
  return tmap(lambda o: o[:num_rows], out)


@struct.dataclass
class RowClasses:
  """The GEMM bit class of each packed row (``row_classes``, ``rowwise``).

  Attributes:
    prompt: bool[T] live rows at prompt positions: computed in one GEMM of
      ``max(T, LARGE_GEMM_ROWS)`` rows (the large class).
    order: i32[T] a permutation putting the other live rows (generated
      tokens: decode rows, recompute of outputs after preemption) first, in
      packed order, then the rest.
    inverse: i32[T] the inverse permutation of ``order``.
    num_tiled: i32[] live rows that are not prompt rows (the ``row_tiled``
      class).
    any_prompt: bool[] some live row is a prompt row.
  """

  prompt: jax.Array
  order: jax.Array
  inverse: jax.Array
  num_tiled: jax.Array
  any_prompt: jax.Array


def row_classes(prompt_rows, num_live) -> RowClasses:
  """``RowClasses`` of T packed rows.

  Args:
    prompt_rows: bool[T] True for a row whose position is below its
      request's prompt length (padding rows: any value).
    num_live: i32[] live rows (a prefix), 0 <= num_live <= T.
  """
  rows = jnp.arange(prompt_rows.shape[0], dtype=jnp.int32)
  live = rows < num_live
  prompt = live & prompt_rows
  tiled = live & ~prompt_rows
  order = jnp.argsort(~tiled, stable=True).astype(jnp.int32)
  return RowClasses(prompt=prompt, order=order,
                    inverse=jnp.argsort(order).astype(jnp.int32),
                    num_tiled=jnp.sum(tiled, dtype=jnp.int32), any_prompt=jnp.any(prompt))


def rowwise(fn, x: jax.Array, num_live, classes: RowClasses | None = None, *,
            exact: bool = False) -> jax.Array:
  """Applies the row-wise map ``fn`` to ``x``, each row in its bit class.

  XLA:CPU's float32 GEMM rounds a row the same way for every row count M in
  2..32 and again for every M >= 64, the two classes differing (measured on
  every projection shape of SmolLM2 and the tiny model, jax 0.10.2;
  docs/archive/benchmarks-log.md "Prompt rows in the large GEMM class"); bfloat16's
  (``linear``) has one class for every M >= 3, so there both branches
  round alike. A large GEMM runs nearer the machine's GEMM ceiling than
  32-row tiles do. So:

  * prompt rows (``classes.prompt``): one GEMM over all T rows, zero-padded
    to ``LARGE_GEMM_ROWS`` when T is smaller, run only when some row is a
    prompt row (``lax.cond``);
  * the other live rows: gathered to the front (``classes.order``) and run
    in ``row_tiled`` tiles over those rows only, skipped when there are none.

  A row's result thus depends only on the row and its class, never on how
  many rows share the bucket or where it sits.

  ``exact=True`` (int8 weights, ``models.quant.linear``: integer sums, a
  row's scale its own) has no bit classes: every row runs in one GEMM over
  all T rows (two when T is 1), whatever ``classes`` says; the large GEMM is
  the fastest form, and a bucket's decode rows are not run a second time.

  Args:
    fn: ``fn(rows, live)`` maps [M, K] -> [M, N] (or a tuple of such) row
      by row; the first ``live`` rows are live (``row_tiled``).
    x: [T, K] rows; rows at or beyond ``num_live`` are padding.
    num_live: i32[] live rows (a prefix of ``x``).
    classes: the rows' ``RowClasses``; None: every row in the tiled class
      (``row_tiled``).
    exact: static; ``fn``'s row results do not depend on the row count.

  Returns:
    ``fn``'s result for all T rows; padding rows hold unspecified finite
    values.
  """
  num_rows = x.shape[0]
  tmap = jax.tree_util.tree_map
  all_rows = jnp.int32(num_rows)
  if exact:
    if num_rows >= 2:
      return fn(x, all_rows)
    return tmap(lambda y: y[:num_rows], fn(jnp.pad(x, ((0, 2 - num_rows), (0, 0))), all_rows))
  if classes is None:
    return row_tiled(fn, x, num_live)
  out_aval = jax.eval_shape(fn, jax.ShapeDtypeStruct((2,) + x.shape[1:], x.dtype),
                            jax.ShapeDtypeStruct((), jnp.int32))
  zeros = lambda: tmap(lambda a: jnp.zeros((num_rows,) + a.shape[1:], a.dtype), out_aval)

  def large():
    padded = max(num_rows, LARGE_GEMM_ROWS)
    rows = x if padded == num_rows else jnp.pad(x, ((0, padded - num_rows), (0, 0)))
    return tmap(lambda y: y[:num_rows], fn(rows, all_rows))

  def tiled():
    out = row_tiled(fn, x[classes.order], classes.num_tiled)
    return tmap(lambda y: y[classes.inverse], out)

  big = jax.lax.cond(classes.any_prompt, large, zeros)
  small = jax.lax.cond(classes.num_tiled > 0, tiled, zeros)
  return tmap(lambda a, b: jnp.where(classes.prompt[:, None], a, b), big, small)


def linear(x: jax.Array, w, live=None, bias=None) -> jax.Array:
  """The projection ``x @ w (+ bias)`` accumulated in float32, rounded to ``x.dtype``.

  Both operands bfloat16 run XLA:CPU's native bfloat16 GEMM (AMX/AVX512-BF16
  on CPUs that have them); a plain bfloat16 ``x @ w`` is instead widened to
  float32 on both operands, the [K, N] weight converted on every call, and
  the product rounded back. For float32 operands this is ``x @ w``: XLA's
  GEMM, or for a weight of a ``LayerWeight`` whose ``row_gemm`` is "native"
  and at most ``rowgemm.MAX_ROWS`` rows (generated rows: ``rowwise`` hands
  prompt rows' GEMMs at least ``LARGE_GEMM_ROWS``) ``models.rowgemm``'s
  kernel. An int8 weight (``models.quant.QuantizedWeight``) runs
  ``models.quant.linear``: rows quantized to int8, an int32 GEMM, rescaled
  to float32.

  Args:
    x: [M, K] rows, float32 or bfloat16 (float32 for an int8 weight).
    w: [K, N] weight, the same dtype, or a ``QuantizedWeight``; or a
      ``quant.LayerWeight`` (one layer of a stack, or of ``split_layers``'
      per-layer tuple).
    live: i32[] leading rows of ``x`` whose results are used (None: all);
      the native kernel computes only those (the others are zeros).
    bias: [N] or None; added to the float32 sums before rounding (as a
      fused ``addmm`` does: HF's q/k/v biases of Qwen2).

  Returns:
    [M, N] in ``x.dtype``.
  """
  if isinstance(w, quant.LayerWeight) and isinstance(w.stack, tuple):
    # One branch per layer, each a GEMM on that layer's own buffer: XLA:CPU
    # copies a slice of a stack (``w[layer]``) out before its GEMM, which
    # cost a float32 decode step twice the weight bytes' reading time.
    branches = [functools.partial(_linear_on, w=one, row_gemm=w.row_gemm) for one in w.stack]
    out = jax.lax.switch(w.layer, branches, x, live)
  else:
    out = _linear_on(x, live, w)
  if bias is None:
    return out.astype(x.dtype)
  return (out + bias.astype(jnp.float32)).astype(x.dtype)


def _linear_on(x: jax.Array, live, w, row_gemm: str = "xla") -> jax.Array:
  """``x @ w`` as float32 sums (the caller rounds)."""
  if isinstance(w, (quant.QuantizedWeight, quant.LayerWeight)):
    return quant.linear(x, w).astype(jnp.float32)
  # Generated rows only: ``rowwise`` hands a prompt row's GEMM at least
  # LARGE_GEMM_ROWS rows, a generated row's at most ROW_TILE.
  if (row_gemm == "native" and x.shape[0] <= rowgemm.MAX_ROWS
      and x.dtype == jnp.float32 and w.dtype == jnp.float32):
    return rowgemm.matmul(x, w, live=live)
  return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)


@struct.dataclass
class KVCache:
  """Paged key/value cache of every layer.

  Attributes:
    k: [n_layers, num_pages, page_size, n_kv_heads, head_dim] keys after RoPE.
    v: [n_layers, num_pages, page_size, n_kv_heads, head_dim] values.
    Both float32, or ``attention.ragged.KV_BITS`` (uint16) holding bfloat16
    bits: XLA:CPU would widen a bfloat16 cache to float32 for every gather.
    draft: with a draft model (speculative decoding), its own ``KVCache``
      of the same pages (its layers and heads), addressed by the same page
      table; None without. ``forward`` keeps it as it is.
  Page ``p`` of a sequence's page table addresses ``k[:, p]`` in every layer.
  """

  k: jax.Array
  v: jax.Array
  draft: "KVCache | None" = None

  @property
  def num_pages(self) -> int:
    return self.k.shape[1]

  @property
  def page_size(self) -> int:
    return self.k.shape[2]


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int,
                  dtype=jnp.float32) -> KVCache:
  """Zero-filled ``KVCache`` of ``num_pages`` pages of ``page_size`` token slots;
  a bfloat16 cache is stored as its bits (``KV_BITS``, see ``KVCache``)."""
  if jnp.dtype(dtype) == jnp.bfloat16:
    dtype = KV_BITS
  shape = (cfg.n_layers, num_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def rope_inv_freq(head_dim: int, theta: float) -> jax.Array:
  """f32[head_dim // 2] inverse frequencies ``theta ** (-2i / head_dim)``."""
  exponent = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  return 1.0 / (theta ** exponent)


def apply_rope(x: jax.Array, positions: jax.Array, rope, rotary_dim: int | None = None
               ) -> jax.Array:
  """Rotary position embedding, rotate-half layout (HF Llama convention).

  Args:
    x: [T, n_heads, head_dim] queries or keys.
    positions: i32[T] absolute position of each row.
    rope: a ``models.config.RopeConfig`` (the frequencies: default, llama3,
      linear or yarn scaling; yarn also scales cos and sin), or a float
      base ``theta`` (plain RoPE, ``theta ** (-2i / head_dim)``).
    rotary_dim: leading dimensions of each head that rotate (partial
      rotary, Phi-3); the rest pass through. None: all of ``head_dim``.

  Returns:
    ``x * cos + rotate_half(x) * sin`` in ``x.dtype`` over the rotary
    dimensions, where dimension ``i`` and ``i + rotary_dim // 2`` form one
    rotated pair with angle ``positions * inv_freq[i]`` (computed in
    float32; cos and sin rounded to ``x.dtype`` as transformers does).
  """
  dim = x.shape[-1] if rotary_dim is None else rotary_dim
  if isinstance(rope, RopeConfig):
    inv_freq, scale = jnp.asarray(rope.inv_freq(dim)), rope.cos_sin_scale
  else:
    inv_freq, scale = rope_inv_freq(dim, rope), 1.0
  half = dim // 2
  angles = positions.astype(jnp.float32)[:, None] * inv_freq
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  if scale != 1.0:
    cos, sin = cos * scale, sin * scale
  cos = cos[:, None, :].astype(x.dtype)
  sin = sin[:, None, :].astype(x.dtype)
  x1, x2, rest = x[..., :half], x[..., half:dim], x[..., dim:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def _write_rows(k_pool, v_pool, k, v, slots):
  """``write_kv_pages``, with 16-bit float pools scattered as uint16 bits.

  XLA:CPU has no native bfloat16/float16 scatter: it widens the whole pool
  to float32 and back around the scatter, which costs a full cache
  conversion per layer. Scattering the raw bits is exact and stays in place.
  """
  if k_pool.dtype.itemsize != 2 or not jnp.issubdtype(k_pool.dtype, jnp.floating):
    return write_kv_pages(k_pool, v_pool, k, v, slots)
  dtype = k_pool.dtype
  bits = lambda x: jax.lax.bitcast_convert_type(x.astype(dtype), jnp.uint16)
  k_bits, v_bits = write_kv_pages(bits(k_pool), bits(v_pool), bits(k), bits(v), slots)
  return (jax.lax.bitcast_convert_type(k_bits, dtype),
          jax.lax.bitcast_convert_type(v_bits, dtype))


@struct.dataclass
class _Batch:
  """Per-iteration metadata broadcast to every scanned block."""

  positions: jax.Array     # i32[T]
  slot_mapping: jax.Array  # i32[T]
  kv_lens: jax.Array       # i32[S]
  page_table: jax.Array    # i32[S, P]
  cu_q_lens: jax.Array     # i32[S + 1]
  num_seqs: jax.Array      # i32[]
  classes: RowClasses | None = None   # the rows' GEMM classes (``rowwise``)
  # int8 projection stacks ({"attn": {"wq": ...}, "mlp": {...}}, each
  # [L, K, N]), passed whole: a block selects its layer in its GEMM
  # (``quant.LayerWeight``; inside the AMX kernel for the tile layout)
  # instead of the scan slicing every stack.
  weights: Any = None
  # The GEMM of float32 projections' generated rows ("native": models.rowgemm).
  row_gemm: str = struct.field(pytree_node=False, default="xla")

  @property
  def num_live(self) -> jax.Array:
    """i32[] live (non-padding) rows: ``cu_q_lens[num_seqs]``."""
    return self.cu_q_lens[jnp.reshape(self.num_seqs, ())]


def row_sum(x: jax.Array) -> jax.Array:
  """Sums ``x`` [..., D] over its last axis in a fixed pairwise order.

  XLA:CPU's reduce picks its loop order by the whole shape: a row's float32
  sum of squares differs between 1-3 and 8-64 rows at width 576, between
  8-48 and 1-3 or 64 rows at width 64 (measured, jax 0.10.2). Halving the
  zero-padded row (width the next power
  of two) with elementwise adds, each exactly rounded, fixes the order, so
  a row's sum never depends on how many rows share the array.

  Returns:
    [..., 1] the sums, in ``x.dtype``.
  """
  width = x.shape[-1]
  padded = 1 << (width - 1).bit_length()
  if padded != width:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - width)])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x


class RMSNorm(nn.Module):
  """RMSNorm normalised in float32; the mean sums in ``row_sum``'s fixed
  order (a row's bits never depend on T).

  ``style`` "llama": ``scale * normed`` with ``normed`` rounded to ``dtype``
  first (HF ``LlamaRMSNorm``); "gemma": ``(1 + scale) * normed`` in float32,
  then rounded (HF ``Gemma2RMSNorm``, whose stored weight is ``scale``).
  Normalises over the last axis of any shape (the per-head q/k norms).
  """

  eps: float
  dtype: Any = jnp.float32
  style: str = "llama"

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.style == "gemma" else nn.initializers.ones
    scale = self.param("scale", init, (x.shape[-1],), self.dtype)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(row_sum(x32 * x32) / x.shape[-1] + self.eps)
    if self.style == "gemma":
      return (normed * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
    return scale * normed.astype(self.dtype)


def _norm(cfg: ModelConfig, dtype, name: str) -> RMSNorm:
  return RMSNorm(cfg.rms_eps, dtype, cfg.norm_style, name=name)


def _window_rope(cfg: ModelConfig, q, k, positions, window):
  """q and k rotated with the frequencies of a layer whose window is
  ``window`` (i32[], 0: global): one ``RopeConfig`` unless the sliding
  layers have their own (``cfg.rope_local``), then both, selected."""
  rope = lambda r: (apply_rope(q, positions, r, cfg.rotary_dim),
                    apply_rope(k, positions, r, cfg.rotary_dim))
  if cfg.rope_local is None:
    return rope(cfg.global_rope)
  (qg, kg), (ql, kl) = rope(cfg.global_rope), rope(cfg.rope_local)
  local = window > 0
  return jnp.where(local, ql, qg), jnp.where(local, kl, kg)


class Attention(nn.Module):
  """GQA self-attention of one block over packed rows and the paged cache
  (under ``shard_map`` over KV heads when ``mesh`` splits attention).

  Family switches (``ModelConfig``): q/k/v and output biases, per-head q/k
  RMSNorm before RoPE, RoPE variants and partial rotary, the scores' scale
  and soft cap, and the layer's sliding window (layers of different windows
  run one ``lax.switch`` branch each, the window static in each).
  """

  cfg: ModelConfig
  dtype: Any
  attention_impl: str
  mesh: Any = None

  @nn.compact
  def __call__(self, x, k_pool, v_pool, layer, batch: _Batch):
    cfg = self.cfg
    num_rows = x.shape[0]
    weight = functools.partial(_layer_weight, self, batch.weights, "attn", layer,
                               row_gemm=batch.row_gemm)
    wq = weight("wq", (cfg.d_model, cfg.q_dim))
    wk = weight("wk", (cfg.d_model, cfg.kv_dim))
    wv = weight("wv", (cfg.d_model, cfg.kv_dim))
    wo = weight("wo", (cfg.q_dim, cfg.d_model))
    bias = lambda name, width: self.param(name, _WEIGHT_INIT, (width,), self.dtype)
    bq, bk, bv = ((bias("bq", cfg.q_dim), bias("bk", cfg.kv_dim), bias("bv", cfg.kv_dim))
                  if cfg.qkv_bias else (None, None, None))
    bo = bias("bo", cfg.d_model) if cfg.o_bias else None
    exact = _is_int8(wq)
    q, k, v = rowwise(lambda h, n: (linear(h, wq, n, bq), linear(h, wk, n, bk),
                                    linear(h, wv, n, bv)),
                      x, batch.num_live, batch.classes, exact=exact)
    q = q.reshape(num_rows, cfg.n_heads, cfg.head_dim)
    k = k.reshape(num_rows, cfg.n_kv_heads, cfg.head_dim)
    v = v.reshape(num_rows, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      q = _norm(cfg, self.dtype, "q_norm")(q)
      k = _norm(cfg, self.dtype, "k_norm")(k)
    kinds = cfg.window_kinds
    windows = jnp.asarray([cfg.layer_window(i) for i in range(cfg.n_layers)], jnp.int32)
    q, k = _window_rope(cfg, q, k, batch.positions, windows[layer])

    # This layer's pages inside the flat pool of all layers.
    pages_per_layer = k_pool.shape[0] // cfg.n_layers
    first_page = layer * pages_per_layer
    slots = jnp.where(batch.slot_mapping >= 0,
                      batch.slot_mapping + first_page * k_pool.shape[1], -1)
    k_pool, v_pool = _write_rows(k_pool, v_pool, k, v, slots)

    def attend(window, q, k_pool, v_pool):
      fn = functools.partial(ragged_paged_attention, sm_scale=cfg.sm_scale,
                             impl=self.attention_impl, sliding_window=window or None,
                             soft_cap=cfg.attn_softcap)
      if self.mesh is not None:
        fn = sharding.attention_over_heads(fn, self.mesh)
      return fn(q, k_pool, v_pool, batch.kv_lens, batch.page_table + first_page,
                batch.cu_q_lens, batch.num_seqs)

    if len(kinds) == 1:
      out = attend(kinds[0], q, k_pool, v_pool)
    else:
      kind = jnp.asarray([kinds.index(cfg.layer_window(i)) for i in range(cfg.n_layers)],
                         jnp.int32)[layer]
      out = jax.lax.switch(kind, [functools.partial(attend, w) for w in kinds],
                           q, k_pool, v_pool)
    out = rowwise(lambda h, n: linear(h, wo, n, bo),
                  out.reshape(num_rows, cfg.q_dim).astype(self.dtype),
                  batch.num_live, batch.classes, exact=exact)
    return out, k_pool, v_pool


def _activation(cfg: ModelConfig):
  """The gate's activation: SiLU (SwiGLU) in the operand dtype, or tanh-GELU
  (GeGLU, HF ``gelu_pytorch_tanh``) computed in float32 and rounded."""
  if cfg.activation == "gelu_tanh":
    return lambda g: jax.nn.gelu(g.astype(jnp.float32), approximate=True).astype(g.dtype)
  return nn.silu


class MLP(nn.Module):
  """Gated MLP: ``(act(x W_gate) * (x W_up)) W_down`` (SwiGLU or GeGLU)."""

  cfg: ModelConfig
  dtype: Any

  @nn.compact
  def __call__(self, x, num_live, classes=None, layer=None, weights=None, row_gemm="xla"):
    cfg = self.cfg
    weight = functools.partial(_layer_weight, self, weights, "mlp", layer, row_gemm=row_gemm)
    w_gate = weight("w_gate", (cfg.d_model, cfg.ffn_dim))
    w_up = weight("w_up", (cfg.d_model, cfg.ffn_dim))
    w_down = weight("w_down", (cfg.ffn_dim, cfg.d_model))
    act = _activation(cfg)
    return rowwise(lambda h, n: linear(act(linear(h, w_gate, n)) * linear(h, w_up, n),
                                       w_down, n),
                   x, num_live, classes, exact=_is_int8(w_down))


class MoE(nn.Module):
  """Mixture-of-experts MLP (Mixtral, Qwen3-MoE): each row routed to its
  top-k experts (``models.moe.route``), the expert GEMMs grouped by expert.

  The T * k (row, expert) assignments are sorted by expert (stable, so by
  row within an expert) and run as three grouped GEMMs (gate, up, down;
  ``models.moe.grouped_matmul``: ``jax.lax.ragged_dot`` on accelerators,
  fixed-row tiles of the routed experts only on CPU) over
  ``[num_experts, ...]`` weight stacks; padding rows are routed to no group
  (their assignments sort last and come out zero). A row's k outputs are
  weighted and summed in expert-id order in the
  activation dtype, as transformers' expert loop accumulates. A row's result
  depends only on the row: routing is row-wise, and each assignment's
  grouped-GEMM row is the product of that row with its expert's weight.
  """

  cfg: ModelConfig
  dtype: Any

  @nn.compact
  def __call__(self, x, num_live, classes=None):
    cfg = self.cfg
    num_experts, k = cfg.num_experts, cfg.experts_per_token
    d, f = cfg.d_model, cfg.ffn_dim
    router = self.param("router", _WEIGHT_INIT, (d, num_experts), self.dtype)
    w_gate = self.param("experts_gate", _WEIGHT_INIT, (num_experts, d, f), self.dtype)
    w_up = self.param("experts_up", _WEIGHT_INIT, (num_experts, d, f), self.dtype)
    w_down = self.param("experts_down", _WEIGHT_INIT, (num_experts, f, d), self.dtype)
    num_rows = x.shape[0]
    logits = rowwise(lambda h, n: linear(h, router, n), x, num_live, classes)
    weights, experts = moe.route(logits, k, cfg.norm_topk_prob)   # [T, k]
    live = jnp.arange(num_rows, dtype=jnp.int32) < jnp.reshape(num_live, ())
    key = jnp.where(live[:, None], experts, num_experts).reshape(-1)   # [T * k]
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    rows = x[order // k]                                           # [T * k, d]
    grouped = lambda a, w: moe.grouped_matmul(a, w, group_sizes).astype(self.dtype)
    act = _activation(cfg)
    hidden = act(grouped(rows, w_gate)) * grouped(rows, w_up)
    out = grouped(hidden, w_down)                                  # sorted order
    out = out[jnp.argsort(order)].reshape(num_rows, k, d)          # [T, k, d]
    weighted = (out.astype(jnp.float32) * weights[..., None]).astype(self.dtype)
    by_expert = jnp.argsort(experts, axis=-1)
    total = jnp.zeros((num_rows, d), self.dtype)
    for j in range(k):
      total = total + jnp.take_along_axis(weighted, by_expert[:, j, None, None], axis=1)[:, 0]
    return total


def _is_int8(w) -> bool:
  if isinstance(w, quant.LayerWeight):
    w = w.stack[0] if isinstance(w.stack, tuple) else w.stack
  return isinstance(w, quant.QuantizedWeight)


def _layer_weight(module: nn.Module, weights, group: str, layer, name: str, shape, *,
                  row_gemm: str = "xla"):
  """A block's projection ``name``: layer ``layer`` of the weights in
  ``weights[group]`` (``_Batch.weights``: an int8 stack or a per-layer
  tuple) when they are there, else the module's own (scanned) parameter."""
  if weights is not None and name in weights.get(group, {}):
    return quant.LayerWeight(stack=weights[group][name], layer=layer, row_gemm=row_gemm)
  return module.param(name, _WEIGHT_INIT, shape, module.dtype)


class DecoderLayer(nn.Module):
  """One pre-norm block; the scan body. Carry: ``(x, k_pool, v_pool)``.

  ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; with ``cfg.post_norms``
  (Gemma 2/3) each branch's output is normed before its residual add; the
  MLP is a ``MoE`` when ``cfg.num_experts`` > 0.
  """

  cfg: ModelConfig
  dtype: Any
  attention_impl: str
  mesh: Any = None

  @nn.compact
  def __call__(self, carry, layer, batch: _Batch):
    cfg = self.cfg
    x, k_pool, v_pool = carry
    h = _norm(cfg, self.dtype, "attn_norm")(x)
    attn, k_pool, v_pool = Attention(cfg, self.dtype, self.attention_impl, self.mesh,
                                     name="attn")(h, k_pool, v_pool, layer, batch)
    if cfg.post_norms:
      attn = _norm(cfg, self.dtype, "post_attn_norm")(attn)
    x = x + attn
    h = _norm(cfg, self.dtype, "mlp_norm")(x)
    if cfg.is_moe:
      out = MoE(cfg, self.dtype, name="moe")(h, batch.num_live, batch.classes)
    else:
      out = MLP(cfg, self.dtype, name="mlp")(h, batch.num_live, batch.classes, layer,
                                            batch.weights, batch.row_gemm)
    if cfg.post_norms:
      out = _norm(cfg, self.dtype, "post_mlp_norm")(out)
    return (x + out, k_pool, v_pool), None


class Llama(nn.Module):
  """The decoder; ``__call__`` runs the blocks, ``logits`` the LM head."""

  cfg: ModelConfig
  dtype: Any = jnp.float32
  attention_impl: str = "gather"
  mesh: Any = None       # a Mesh that splits attention (``models.sharding``)
  # int8 projection weights and LM head (``models.quant.quantize_params``).
  # Flax checks a stored parameter's first leaf against the declared shape:
  # a ``QuantizedWeight``'s ``q`` has the float weight's [K, N] shape.
  quantized: bool = False

  def setup(self):
    cfg = self.cfg
    self.embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=self.dtype,
                          param_dtype=self.dtype, embedding_init=_WEIGHT_INIT)
    self.layers = nn.scan(
        DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
        in_axes=(0, nn.broadcast), length=cfg.n_layers,
    )(cfg, self.dtype, self.attention_impl, self.mesh)
    self.final_norm = RMSNorm(cfg.rms_eps, self.dtype, cfg.norm_style)
    if not cfg.tie_embeddings or self.quantized:
      self.lm_head = self.param("lm_head", _WEIGHT_INIT,
                                (cfg.d_model, cfg.vocab_size), self.dtype)

  def __call__(self, tokens, k_pool, v_pool, batch: _Batch):
    x = self.embed(tokens)
    if self.cfg.scale_embeddings:   # Gemma: sqrt(d_model) rounded to the dtype
      x = x * jnp.asarray(self.cfg.d_model ** 0.5, self.dtype)
    layer_ids = jnp.arange(self.cfg.n_layers, dtype=jnp.int32)
    (x, k_pool, v_pool), _ = self.layers((x, k_pool, v_pool), layer_ids, batch)
    return self.final_norm(x), k_pool, v_pool

  def logits(self, hidden, num_live=None):
    hidden = hidden.astype(self.dtype)
    # Tied: contract the [vocab, d_model] table's second axis; a transposed
    # copy (``embedding.T``) would be materialised outside the tile loop.
    if num_live is None:
      num_live = hidden.shape[0]
    if self.quantized:
      return row_tiled(lambda h, _: quant.linear(h, self.lm_head), hidden, num_live)
    if self.cfg.tie_embeddings:
      table, contract = self.embed.embedding, 1
    else:
      table, contract = self.lm_head, 0
    head = lambda h, _: jax.lax.dot_general(h, table, (((1,), (contract,)), ((), ())),
                                         preferred_element_type=jnp.float32)
    return row_tiled(head, hidden, num_live)

  def init_all(self, tokens, k_pool, v_pool, batch: _Batch):
    """Touches every parameter (used only by ``init_params``)."""
    hidden, _, _ = self(tokens, k_pool, v_pool, batch)
    return self.logits(hidden)


def soft_cap_logits(cfg: ModelConfig, logits: jax.Array) -> jax.Array:
  """``c * tanh(logits / c)`` with ``c = cfg.final_softcap`` (Gemma 2), in
  float32; the logits unchanged when the config has no cap."""
  if cfg.final_softcap is None:
    return logits
  cap = jnp.float32(cfg.final_softcap)
  return cap * jnp.tanh(logits.astype(jnp.float32) / cap)


def _params_dtype(params):
  return params["embed"]["embedding"].dtype


def forward(params, cfg: ModelConfig, kv: KVCache, tokens, positions,
            slot_mapping, kv_lens, page_table, cu_q_lens, num_seqs, *,
            attention_impl: str, mesh=None, prompt_rows=None, chunk_rows=None,
            decode_gemm: str = "xla"):
  """Runs every block over one packed iteration and writes its K/V.

  Args:
    params: parameter tree (module docstring); its embedding dtype (float32
      or bfloat16) is the activation dtype.
    cfg: the model's config (static under jit).
    kv: the paged cache; the current rows' K/V are written into it.
    tokens: i32[T] packed token ids (padding rows: any valid id).
    positions: i32[T] absolute position of each row (RoPE angle).
    slot_mapping: i32[T] ``page * page_size + offset`` cache slot of each row;
      negative for padding rows, which write nothing.
    kv_lens: i32[S] committed plus current rows of each sequence.
    page_table: i32[S, P] logical -> physical page of each sequence.
    cu_q_lens: i32[S + 1] packed row offsets of the sequences.
    num_seqs: i32[] live sequences; rows at or beyond ``cu_q_lens[num_seqs]``
      are padding.
    attention_impl: ``impl`` passed to ``ragged_paged_attention`` (static).
    mesh: static ``jax.sharding.Mesh`` whose ``model`` axis splits the
      attention heads (``models.sharding.attention_mesh``): attention then
      runs under ``shard_map`` per device; None: one program over all heads.
    prompt_rows: bool[T] rows whose position is a prompt position of their
      request (``position < prompt_len``): their row-wise GEMMs run in the
      large class, the other rows' in 2..32-row tiles (``rowwise``); None:
      every row in tiles (``row_tiled``).
    chunk_rows: static; when T exceeds it, the rows run as a ``lax.scan``
      over ``ceil(T / chunk_rows)`` chunk invocations (``_scanned_chunks``):
      bounded activations, the same bits as one invocation. None: one.
    decode_gemm: static; the GEMM of float32 projections' generated rows
      (tiles of at most ``ROW_TILE`` rows): "native" (``models.rowgemm``,
      the caller having checked that it is available) or "xla". Prompt rows
      run XLA's large GEMM either way.

  Returns:
    ``(hidden f32[T, d_model], kv)``: the final-normed hidden state of every
    row (padding rows hold unspecified finite values) and the updated cache.

  Raises:
    ValueError: if ``kv`` has not ``cfg.n_layers`` layers, ``chunk_rows``
      is below 1, or ``decode_gemm`` is neither "native" nor "xla".
  """
  dtype = _params_dtype(params)
  model = Llama(cfg, dtype=dtype, attention_impl=attention_impl, mesh=mesh,
                quantized=quant.is_quantized(params))
  num_layers, num_pages = kv.k.shape[:2]
  if num_layers != cfg.n_layers:
    raise ValueError(f"kv has {num_layers} layers, cfg.n_layers is {cfg.n_layers}")
  if chunk_rows is not None and chunk_rows < 1:
    raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
  if decode_gemm not in ("native", "xla"):
    raise ValueError(f"decode_gemm must be 'native' or 'xla', got {decode_gemm!r}")
  flat = (num_layers * num_pages,) + kv.k.shape[2:]
  # Already split by the engine (``split_layers``); split here otherwise,
  # which copies each layer once per call, as slicing in the scan did.
  params, stacks = _unscanned_weights(split_layers(params))
  params = {k: v for k, v in params.items() if k != HEAD_PANELS}
  batch = _Batch(positions=positions, slot_mapping=slot_mapping, kv_lens=kv_lens,
                 page_table=page_table, cu_q_lens=cu_q_lens, num_seqs=num_seqs,
                 weights=stacks, row_gemm=decode_gemm)

  def run(tokens, k_pool, v_pool, batch, prompt_rows):
    if prompt_rows is not None:
      batch = batch.replace(classes=row_classes(prompt_rows, batch.num_live))
    return model.apply({"params": params}, tokens, k_pool, v_pool, batch)

  prompt_rows = None if prompt_rows is None else jnp.asarray(prompt_rows, bool)
  args = (tokens, kv.k.reshape(flat), kv.v.reshape(flat), batch, prompt_rows)
  if chunk_rows is None or tokens.shape[0] <= chunk_rows:
    hidden, k_pool, v_pool = run(*args)
  else:
    hidden, k_pool, v_pool = _scanned_chunks(run, chunk_rows, *args)
  return hidden.astype(jnp.float32), kv.replace(k=k_pool.reshape(kv.k.shape),
                                                v=v_pool.reshape(kv.v.shape))


def _unscanned_weights(params):
  """Moves the projections the blocks' scan must not slice out of
  ``params["layers"]`` into ``{"attn": {...}, "mlp": {...}}`` for
  ``_Batch.weights``: int8 stacks (``QuantizedWeight``) and
  ``split_layers``' per-layer tuples; None when there are none."""
  layers = params.get("layers", {})
  moved, kept = {}, {}
  for group, leaves in layers.items():
    out = {k: w for k, w in leaves.items() if isinstance(w, (quant.QuantizedWeight, tuple))}
    if out:
      moved[group] = out
    kept[group] = {k: w for k, w in leaves.items() if k not in out}
  if not moved:
    return params, None
  return {**params, "layers": kept}, moved


def split_layers(params):
  """Stores every projection stack as a tuple of per-layer weights.

  ``layers/{attn,mlp}/w*`` [L, K, N] (float, or an int8 ``QuantizedWeight``
  in the row-major layout) becomes a tuple of L [K, N] weights, each its own
  buffer. ``forward`` then hands them to the blocks whole and each block's
  GEMM reads its layer's buffer in place (``linear``'s ``lax.switch``): a
  scanned block would copy its layer's slice of every stack first, as
  XLA:CPU does for a dynamic slice feeding a GEMM (a 1-row float32 decode
  step of SmolLM2 spent about half its time copying). The bits are the same
  (the same GEMM on the same values). Int8 stacks in the AMX tile layout stay
  stacked: the kernel indexes them by layer. Idempotent.

  Args:
    params: a parameter tree in this module's layout (device or host arrays,
      sharded or not).

  Returns:
    The tree with the projections split; every other leaf unchanged.
  """
  layers = params.get("layers")
  if layers is None:
    return params

  def split(w):
    if isinstance(w, tuple):
      return w
    if isinstance(w, quant.QuantizedWeight):
      if w.layout != "kn":
        return w
      return tuple(quant.QuantizedWeight(q=w.q[i], col_scale=w.col_scale[i])
                   for i in range(w.q.shape[0]))
    return tuple(w[i] for i in range(w.shape[0]))

  out = {group: {k: split(w) if k in quant.PROJECTIONS else w for k, w in leaves.items()}
         for group, leaves in layers.items()}
  return {**params, "layers": out}


def _chunk_batch(batch: _Batch, lo, chunk_rows: int) -> _Batch:
  """The attention descriptors of packed rows ``[lo, lo + chunk_rows)``.

  The sequences with rows in the chunk are a contiguous run of the packed
  sequences; they are renumbered from 0. A sequence cut by the chunk's end
  sees only its rows up to that end (``kv_lens`` minus its later rows), so
  the chunk attends to exactly the K/V rows the whole bucket's causal mask
  lets these rows see: the committed ones, earlier chunks' (already
  written) and its own.
  """
  cu, num_seqs = batch.cu_q_lens, jnp.reshape(batch.num_seqs, ())
  hi = lo + chunk_rows
  seq = jnp.arange(cu.shape[0] - 1, dtype=jnp.int32)
  live = seq < num_seqs
  starts, ends = cu[:-1], cu[1:]
  rows_in = jnp.where(live, jnp.clip(jnp.minimum(ends, hi) - jnp.maximum(starts, lo), 0), 0)
  first = jnp.sum(live & (ends <= lo), dtype=jnp.int32)
  count = jnp.sum(rows_in > 0, dtype=jnp.int32)
  src = jnp.minimum(first + seq, seq.shape[0] - 1)
  here = seq < count
  q_lens = jnp.where(here, rows_in[src], 0)
  kv_lens = jnp.where(here, batch.kv_lens[src] - (ends[src] - jnp.minimum(ends[src], hi)), 0)
  return _Batch(
      positions=jax.lax.dynamic_slice_in_dim(batch.positions, lo, chunk_rows),
      slot_mapping=jax.lax.dynamic_slice_in_dim(batch.slot_mapping, lo, chunk_rows),
      kv_lens=kv_lens, page_table=batch.page_table[src],
      cu_q_lens=jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                 jnp.cumsum(q_lens).astype(jnp.int32)]),
      num_seqs=count, weights=batch.weights, row_gemm=batch.row_gemm)


def _scanned_chunks(run, chunk_rows: int, tokens, k_pool, v_pool, batch: _Batch, prompt_rows):
  """``run`` over ``chunk_rows``-row chunks of the packed rows, one
  ``lax.scan`` step each (the pools in the carry, so chunk ``m`` writes its
  K/V before chunk ``m + 1`` attends); chunks past the live rows are
  skipped (``lax.cond``). Rows past T (padding to whole chunks) write
  nothing and are dropped. A row's bits equal one invocation's: its
  row-wise GEMMs stay in their class (``rowwise``) and attention sees the
  same K/V rows.
  """
  num_rows = tokens.shape[0]
  num_chunks = -(-num_rows // chunk_rows)
  pad = num_chunks * chunk_rows - num_rows
  padded = lambda x, fill: jnp.pad(x, (0, pad), constant_values=fill)
  batch = batch.replace(positions=padded(batch.positions, 0),
                        slot_mapping=padded(batch.slot_mapping, -1))
  tokens = padded(tokens, 0)
  if prompt_rows is not None:
    prompt_rows = padded(prompt_rows, False)
  num_live = batch.num_live
  hidden_aval = jax.eval_shape(lambda t, k, v, b, p: run(t, k, v, b, p)[0],
                               tokens[:chunk_rows], k_pool, v_pool,
                               _chunk_batch(batch, 0, chunk_rows),
                               None if prompt_rows is None else prompt_rows[:chunk_rows])

  def chunk(carry, m):
    k_pool, v_pool = carry
    lo = m * chunk_rows
    cut = lambda x: jax.lax.dynamic_slice_in_dim(x, lo, chunk_rows)

    def live():
      return run(cut(tokens), k_pool, v_pool, _chunk_batch(batch, lo, chunk_rows),
                 None if prompt_rows is None else cut(prompt_rows))

    def idle():
      return jnp.zeros(hidden_aval.shape, hidden_aval.dtype), k_pool, v_pool

    hidden, k_pool, v_pool = jax.lax.cond(lo < num_live, live, idle)
    return (k_pool, v_pool), hidden

  (k_pool, v_pool), hidden = jax.lax.scan(chunk, (k_pool, v_pool),
                                          jnp.arange(num_chunks, dtype=jnp.int32))
  return hidden.reshape((num_chunks * chunk_rows,) + hidden.shape[2:])[:num_rows], k_pool, v_pool


def compute_logits(params, cfg: ModelConfig, hidden, num_live=None, *,
                   decode_gemm: str = "xla") -> jax.Array:
  """f32[N, vocab] logits of ``hidden`` [N, d_model] (tied or untied head).

  The head runs in ``row_tiled`` GEMMs (2..32 rows), so a row's logits do
  not depend on N; with ``num_live`` (i32[], default N) only the tiles
  holding the first ``num_live`` rows are computed when N > 32 (rows of
  later tiles are zeros); ``cfg.final_softcap`` caps them (``soft_cap_logits``).
  With ``decode_gemm`` "native" (static) and
  float32 dense weights the head is one call of ``models.rowgemm``'s GEMM
  (its rows never depend on N; rows from ``num_live`` on are zeros) over
  the head in panels (``params[HEAD_PANELS]``, stored by
  ``with_head_panels``; made here, per call, when absent: the same bits).
  """
  if decode_gemm == "native" and _dense_float32(params):
    head = params.get(HEAD_PANELS)
    if head is None:
      head = head_panels(params, cfg)
    # One call over every row: the kernel's rows do not depend on M, and
    # rows past num_live are not computed (zeros).
    return soft_cap_logits(cfg, rowgemm.matmul(hidden.astype(jnp.float32), head,
                                               n=cfg.vocab_size, live=num_live))
  params = {k: v for k, v in params.items() if k != HEAD_PANELS}
  model = Llama(cfg, dtype=_params_dtype(params), quantized=quant.is_quantized(params))
  return soft_cap_logits(cfg, model.apply({"params": params}, hidden, num_live,
                                          method=Llama.logits))


# The LM head in ``models.rowgemm``'s panel layout, beside the parameters.
HEAD_PANELS = "lm_head_panels"


def _dense_float32(params) -> bool:
  return not quant.is_quantized(params) and _params_dtype(params) == jnp.float32


def head_panels(params, cfg: ModelConfig) -> jax.Array:
  """The LM head [d_model, vocab] (the tied embedding's transpose, or
  ``lm_head``) as ``rowgemm.to_panels`` f32[ceil(vocab / 64), d_model, 64]."""
  table = params["embed"]["embedding"].T if cfg.tie_embeddings else params["lm_head"]
  return rowgemm.to_panels(table)


def with_head_panels(params, cfg: ModelConfig):
  """``params`` plus the LM head in panels (``HEAD_PANELS``: a copy of the
  head, 113 MB for SmolLM2-135M in float32), for ``compute_logits`` with
  ``decode_gemm`` "native": a 64-column panel of the [576, 49152] head is
  then one contiguous read, where row-major rows lie 196 KB apart. Float32
  dense parameters only; others are returned unchanged."""
  if HEAD_PANELS in params or not _dense_float32(params):
    return params
  return {**params, HEAD_PANELS: head_panels(params, cfg)}


def init_params(cfg: ModelConfig, rng: jax.Array, dtype=jnp.float32, *,
                layer_scale: float = 1.0):
  """Random parameters (weights ~ N(0, 0.02), norm scales 1) in ``dtype``.

  ``layer_scale`` multiplies every decoder-layer weight (not the norms or
  the embedding). At 1 a small random model with tied embeddings is
  dominated by its own token embedding and greedily repeats its last token
  whatever the context; tests of KV-cache and attention exactness use 8, so
  that the next token depends on every cached row.
  """
  model = Llama(cfg, dtype=dtype)
  kv = init_kv_cache(cfg, 1, 1, dtype)
  flat = (cfg.n_layers,) + kv.k.shape[2:]
  one = jnp.zeros((1,), jnp.int32)
  batch = _Batch(positions=one, slot_mapping=one, kv_lens=one + 1,
                 page_table=jnp.zeros((1, 1), jnp.int32),
                 cu_q_lens=jnp.array([0, 1], jnp.int32), num_seqs=jnp.int32(1))
  init = jax.jit(lambda r: model.init(r, one, kv.k.reshape(flat), kv.v.reshape(flat),
                                      batch, method=Llama.init_all))
  params = init(rng)["params"]
  if layer_scale != 1.0:
    scale = lambda path, x: x if path[-1].key == "scale" else x * layer_scale
    params = dict(params, layers=jax.tree_util.tree_map_with_path(scale, params["layers"]))
  return params


forward_jit = jax.jit(forward, static_argnames=("cfg", "attention_impl", "mesh", "chunk_rows",
                                                "decode_gemm"),
                      donate_argnames=("kv",))
forward_jit.__doc__ = "``forward`` under ``jax.jit`` (cfg, impl static; kv donated)."
compute_logits_jit = jax.jit(compute_logits, static_argnames=("cfg", "decode_gemm"))
