"""Mixture-of-experts pieces: top-k routing and the grouped expert GEMM.

``models.llama.MoE`` routes each packed row to its top-k experts
(``route``), sorts the (row, expert) assignments by expert and runs each of
the expert MLP's three projections as one grouped GEMM
(``grouped_matmul``): the rows of group ``e`` (a contiguous run of the
sorted rows) times expert ``e``'s weight.

Two implementations of the grouped GEMM, the same contract:

* "ragged_dot": ``jax.lax.ragged_dot``, the primitive made for it; GPU and
  TPU lower it to a grouped GEMM kernel. XLA:CPU (jax 0.10.2) lowers it to
  a dense product of every row with every expert, masked: ``E`` times the
  work of the routed rows' GEMMs.
* "tiled" (the CPU default): the groups cut into ``GROUP_TILE``-row tiles
  (a group's last tile runs into the next group's rows, whose own tiles
  overwrite them later), one ``[GROUP_TILE, K] @ [K, N]`` GEMM per tile in
  a ``lax.fori_loop`` over the tiles that hold rows, the tile's expert
  weight read by index: only routed experts are read, and every row runs
  in a GEMM of exactly ``GROUP_TILE`` rows, so a row's bits never depend
  on how many rows share its expert (batch invariance, as ``row_tiled``
  keeps it for dense projections).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Rows of one tile of the "tiled" grouped GEMM: inside XLA:CPU's 2..32-row
# float32 GEMM bit class (``models.llama.row_tiled``) and >= 4 for bfloat16.
GROUP_TILE = 16
GROUPED_IMPLS = ("auto", "ragged_dot", "tiled")


def route(router_logits: jax.Array, experts_per_token: int, norm_topk_prob: bool):
  """Top-k routing of a mixture of experts.

  Softmax over all experts in float32, the ``experts_per_token`` largest
  kept (ties: the lower expert id), renormalised to sum 1 when
  ``norm_topk_prob`` (Mixtral always; Qwen3-MoE's flag) — transformers'
  ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``.

  Args:
    router_logits: [T, num_experts], any float dtype.
    experts_per_token: static k, 1 <= k <= num_experts.
    norm_topk_prob: static.

  Returns:
    ``(weights f32[T, k], experts i32[T, k])``, by decreasing weight.
  """
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, experts_per_token)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, experts.astype(jnp.int32)


def resolve_grouped(impl: str, backend: str | None = None) -> str:
  """The grouped GEMM ``impl`` runs: "auto" is "tiled" on CPU, else
  "ragged_dot". Raises ValueError for a name not in ``GROUPED_IMPLS``."""
  if impl not in GROUPED_IMPLS:
    raise ValueError(f"grouped GEMM impl must be one of {GROUPED_IMPLS}, got {impl!r}")
  if impl != "auto":
    return impl
  return "tiled" if (backend or jax.default_backend()) == "cpu" else "ragged_dot"


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   impl: str = "auto") -> jax.Array:
  """Row group ``e`` of ``x`` times ``w[e]``, for every group.

  Args:
    x: [M, K] rows sorted by group: group ``e`` is rows
      ``[sum(group_sizes[:e]), sum(group_sizes[:e + 1]))``; rows past
      ``sum(group_sizes)`` belong to no group.
    w: [E, K, N] one weight per group, the dtype of ``x``.
    group_sizes: i32[E] rows per group, summing to at most M.
    impl: static, one of ``GROUPED_IMPLS`` (module docstring).

  Returns:
    f32[M, N]: the float32 sums; rows of no group are zeros.

  Raises:
    ValueError: at trace time, shapes that disagree or an unknown impl.
  """
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
    raise ValueError(f"grouped_matmul needs x [M, K] and w [E, K, N], got {x.shape} "
                     f"and {w.shape}")
  if group_sizes.shape != (w.shape[0],):
    raise ValueError(f"group_sizes must be i32[{w.shape[0]}], got {group_sizes.shape}")
  if resolve_grouped(impl) == "ragged_dot":
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32),
                              preferred_element_type=jnp.float32)
  return _tiled(x, w, group_sizes.astype(jnp.int32))


def _tiled(x, w, group_sizes):
  num_rows, num_groups, tile = x.shape[0], w.shape[0], GROUP_TILE
  starts = jnp.cumsum(group_sizes) - group_sizes                   # i32[E]
  tiles = (group_sizes + tile - 1) // tile                        # i32[E]
  first_tile = jnp.cumsum(tiles) - tiles                          # i32[E]
  num_tiles = jnp.sum(tiles)
  total = jnp.sum(group_sizes)
  # Room for a last tile that starts at the final row.
  x = jnp.pad(x, ((0, tile), (0, 0)))

  def body(i, out):
    group = jnp.sum(first_tile + tiles <= i).astype(jnp.int32)    # tiles before i
    group = jnp.minimum(group, num_groups - 1)
    row = starts[group] + (i - first_tile[group]) * tile
    rows = jax.lax.dynamic_slice_in_dim(x, row, tile)
    weight = jax.lax.dynamic_index_in_dim(w, group, keepdims=False)
    y = jax.lax.dot_general(rows, weight, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return jax.lax.dynamic_update_slice_in_dim(out, y, row, 0)

  out = jnp.zeros((num_rows + tile, w.shape[2]), jnp.float32)
  out = jax.lax.fori_loop(0, num_tiles, body, out)[:num_rows]
  return jnp.where((jnp.arange(num_rows) < total)[:, None], out, 0.0)
