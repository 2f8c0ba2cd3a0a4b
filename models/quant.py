"""int8 weights with dynamically quantized int8 activations (W8A8).

``EngineConfig.weights = "int8"``: every projection (q/k/v/o, the SwiGLU
MLP) and the LM head hold int8 weights with one float32 scale per output
column (symmetric, ``w ~= q * col_scale``); at each projection the input
rows are quantized to int8 with one scale per row (``x ~= a * row_scale``),
multiplied in int8 x int8 -> int32, and the int32 sums rescaled to float32
(``acc * (row_scale * col_scale)``). The embedding lookup, norms (q/k
norms included), the q/k/v/o biases, RoPE, attention and the KV cache stay
float32, and so do a mixture of experts' router and expert stacks
(``layers/moe/*``: their grouped GEMMs run in float32; the attention
projections and the LM head of a MoE model are int8). This is the per-channel weight,
per-token activation scheme of LLM.int8()'s vector-wise quantization
(Dettmers et al., 2022) without its float16 outlier columns, and of
SmoothQuant's per-token dynamic variant (Xiao et al., 2023) without the
smoothing.

Why on a CPU: a decode step reads every weight once, so int8 weights read
a quarter of the float32 bytes, and XLA:CPU's int8 GEMM of 2..32 rows runs
faster than its float32 one on the engine's shapes (measured in
docs/archive/benchmarks-log.md "int8 weights"). Why it keeps a request's tokens
batch-invariant: integer sums are exact in any order, and the row scale
depends on the row alone, so a row's result is the same bits whatever M,
tiling or neighbours its GEMM has (tested bitwise against a numpy int64
reference, ``reference_linear``). One GEMM row count is avoided: XLA:CPU's
one-row int8 GEMM is far slower than its two-row one, and
``models.llama.row_tiled`` never hands a GEMM fewer than 2 float32 rows.

Two GEMMs compute the same bits (``EngineConfig.int8_gemm``): XLA's, over
row-major weights, and ``models.amx``'s on Intel AMX tiles, over weights in
the tile layout (``QuantizedWeight.layout = "tiles"``), which it indexes by
layer inside the kernel (``LayerWeight``) instead of copying each layer's
slice of the stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models import amx

# int8 range used by both operands: symmetric, -127..127 (no -128), so a
# product of two values is at most 127^2 and K <= 2^31 / 127^2 = 133,144
# products fit an int32 sum exactly.
QMAX = 127
MAX_CONTRACTION = (2**31 - 1) // (QMAX * QMAX)
INV_QMAX = np.float32(1 / QMAX)
# Smallest row magnitude with a normal float32 scale (``quantize_rows``).
ROW_FLOOR = np.float32(np.finfo(np.float32).tiny * QMAX)

# Paths (last keys) of the projection weights quantized per output column.
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@struct.dataclass
class QuantizedWeight:
  """An int8 ``[..., K, N]`` weight and its per-column scales.

  Attributes:
    q: int8[..., K, N] in -127..127 (a leading stacked layer axis allowed),
      row-major (``layout`` "kn") or in ``models.amx``'s tile layout
      (``layout`` "tiles": the same shape, the bytes permuted).
    col_scale: f32[..., N] scale of each output column: ``w ~= q * col_scale``.
    layout: static, "kn" or "tiles".
  """

  q: jax.Array
  col_scale: jax.Array
  layout: str = struct.field(pytree_node=False, default="kn")


@struct.dataclass
class LayerWeight:
  """Layer ``layer`` of a projection's weights across the blocks.

  ``stack`` is a stacked ``QuantizedWeight`` (``q`` [L, K, N]), selected by
  ``linear``: inside the AMX kernel for the tile layout (no copy of the
  layer is made), by a slice of the stack otherwise. Or it is a tuple of L
  per-layer weights (float [K, N] arrays or ``QuantizedWeight``s, from
  ``models.llama.split_layers``), selected by ``models.llama.linear`` with a
  ``lax.switch`` whose branch runs the GEMM on that layer's own buffer.
  """

  stack: QuantizedWeight | tuple
  layer: jax.Array          # i32[]
  # The GEMM of a float32 weight's generated rows (at most
  # ``models.rowgemm.MAX_ROWS``): "native" (``models.rowgemm``) or "xla".
  row_gemm: str = struct.field(pytree_node=False, default="xla")


def quantize_columns(w, contract_axis: int = -2) -> QuantizedWeight:
  """Symmetric per-output-column int8 quantization of a float weight.

  Args:
    w: float[..., K, N] (``contract_axis`` -2) or float[..., N, K]
      (``contract_axis`` -1: a tied ``[vocab, d_model]`` embedding used as
      the LM head, transposed here to ``[d_model, vocab]``).
    contract_axis: the axis the projection sums over, -2 or -1.

  Returns:
    ``QuantizedWeight`` with ``q`` int8[..., K, N]: ``round(w / col_scale)``
    where ``col_scale = max_k |w[k, n]| / 127`` (1 for an all-zero column).

  Raises:
    ValueError: ``contract_axis`` not -2 or -1, or K above ``MAX_CONTRACTION``.
  """
  if contract_axis not in (-2, -1):
    raise ValueError(f"contract_axis must be -2 or -1, got {contract_axis}")
  w = np.asarray(jax.device_get(w), np.float32)
  if contract_axis == -1:
    w = np.swapaxes(w, -1, -2)
  if w.shape[-2] > MAX_CONTRACTION:
    raise ValueError(f"int8 weights: contraction length {w.shape[-2]} exceeds "
                     f"{MAX_CONTRACTION} (an int32 sum of int8 products would overflow)")
  amax = np.max(np.abs(w), axis=-2)
  scale = np.where(amax > 0, amax / QMAX, 1.0).astype(np.float32)
  q = np.clip(np.rint(w / scale[..., None, :]), -QMAX, QMAX).astype(np.int8)
  return QuantizedWeight(q=jnp.asarray(q), col_scale=jnp.asarray(scale))


def quantize_rows(x: jax.Array):
  """Symmetric per-row int8 quantization of activations.

  Written as products with reciprocals, as XLA:CPU computes a division by a
  value (``x / s`` becomes ``x * (1 / s)``), so the numpy reference
  (``reference_linear``) can follow it op for op.

  Args:
    x: f32[M, K].

  Returns:
    ``(a int8[M, K], row_scale f32[M, 1])`` with ``row_scale = max_k |x| *
    (1 / 127)`` (1 for a row whose largest magnitude is below ``ROW_FLOOR``,
    where the scale would be subnormal: such a row quantizes to zeros) and
    ``a = round(x * (1 / row_scale))`` clipped to +-127; each row's values
    depend only on that row.
  """
  amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  scale = jnp.where(amax >= ROW_FLOOR, amax * INV_QMAX, 1.0).astype(jnp.float32)
  inv = jnp.float32(1) / scale
  a = jnp.clip(jnp.round(x * inv), -QMAX, QMAX).astype(jnp.int8)
  return a, scale


def linear(x: jax.Array, w: QuantizedWeight | LayerWeight) -> jax.Array:
  """``x @ w`` for an int8 weight: rows quantized, int32 GEMM, rescaled.

  A weight in the tile layout runs ``models.amx.matmul`` (same bits; a
  ``LayerWeight`` passes the whole stack and the layer index). Otherwise:

  The rescale runs inside a ``lax.cond`` whose predicate always holds (the
  row scales are positive), so its float32 result is stored before any
  consumer reads it. Without that, XLA:CPU fuses the rescale's multiply into
  the next op and, in some fusions only, contracts it with a following add
  (the residual) into one FMA, a single rounding: a row's bits then depended
  on its bucket (one GEMM for <= 32 rows, a loop of tiles above). A float32
  GEMM's output is stored anyway.

  Args:
    x: f32[M, K] rows.
    w: ``QuantizedWeight`` with ``q`` int8[K, N], ``col_scale`` f32[N]; or a
      ``LayerWeight`` of a stack.

  Returns:
    f32[M, N]: ``float32(sum_k a[m, k] q[k, n]) * (row_scale[m] * col_scale[n])``.

  Raises:
    RuntimeError: a tile-layout weight where ``models.amx`` cannot run.
  """
  a, row_scale = quantize_rows(x.astype(jnp.float32))
  layer = None
  if isinstance(w, LayerWeight):
    w, layer = w.stack, w.layer
  if w.layout == "tiles":
    return amx.matmul(a, row_scale, w.q, w.col_scale, layer)
  if layer is not None:
    w = jax.tree_util.tree_map(lambda t: t[layer], w)
  acc = jax.lax.dot_general(a, w.q, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.int32)
  rescale = lambda: acc.astype(jnp.float32) * (row_scale * w.col_scale)
  never = lambda: jnp.zeros(acc.shape, jnp.float32)
  return jax.lax.cond(jnp.all(row_scale > 0), rescale, never)


def reference_linear(x, w: QuantizedWeight) -> np.ndarray:
  """numpy reference of ``linear``: the same row quantization in float32, op
  for op, the integer sums in int64, the same float32 rescale. f32[M, N]."""
  x = np.asarray(x, np.float32)
  amax = np.max(np.abs(x), axis=-1, keepdims=True)
  scale = np.where(amax >= ROW_FLOOR, amax * INV_QMAX, np.float32(1)).astype(np.float32)
  inv = (np.float32(1) / scale).astype(np.float32)
  a = np.clip(np.rint(x * inv), -QMAX, QMAX).astype(np.int64)
  acc = a @ np.asarray(w.q, np.int64)
  return acc.astype(np.float32) * (scale * np.asarray(w.col_scale, np.float32))


def is_quantized(params) -> bool:
  """True when ``params`` holds int8 projection weights (``quantize_params``)."""
  return isinstance(params.get("lm_head"), QuantizedWeight)


def quantize_params(params, tie_embeddings: bool, gemm: str = "xla"):
  """The W8A8 parameter tree of float parameters.

  Every projection weight of ``layers`` (``PROJECTIONS``) becomes a ``QuantizedWeight``
  (stacked: ``q`` int8[L, K, N], ``col_scale`` f32[L, N]); the LM head
  becomes ``lm_head`` = ``QuantizedWeight`` int8[d_model, vocab] (from the
  tied embedding when ``tie_embeddings``; the float embedding stays for the
  lookup). Norm scales, biases and MoE routers and experts stay float32.
  Already quantized trees are returned unchanged.

  Args:
    params: float32 tree (``models.llama``'s layout).
    tie_embeddings: the model config's ``tie_embeddings``.
    gemm: "xla" (row-major weights) or "amx" (``models.amx.resolve``): every
      weight whose shape fits the tiles is stored in the tile layout.

  Raises:
    ValueError: a parameter that is not float32 (bfloat16 trees are not
      quantized: quantize from the float32 load).
  """
  if is_quantized(params):
    return params
  if gemm not in ("xla", "amx"):
    raise ValueError(f"gemm must be 'xla' or 'amx', got {gemm!r}")
  for leaf in jax.tree_util.tree_leaves(params):
    if leaf.dtype != jnp.float32:
      raise ValueError(f"int8 weights are quantized from float32 parameters, got a "
                       f"{leaf.dtype} leaf: load the model with dtype float32")

  def place(w: QuantizedWeight) -> QuantizedWeight:
    if gemm != "amx" or not amx.fits(*w.q.shape[-2:]):
      return w
    return QuantizedWeight(q=jnp.asarray(amx.to_tiles(np.asarray(w.q))),
                           col_scale=w.col_scale, layout="tiles")

  def layer(path, leaf):
    key = getattr(path[-1], "key", None)
    return place(quantize_columns(leaf)) if key in PROJECTIONS else leaf

  out = dict(params)
  out["layers"] = jax.tree_util.tree_map_with_path(layer, params["layers"])
  if tie_embeddings:
    out["lm_head"] = place(quantize_columns(params["embed"]["embedding"], contract_axis=-1))
  else:
    out["lm_head"] = place(quantize_columns(params["lm_head"]))
  return out
