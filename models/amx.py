"""int8 projections on Intel AMX tiles (``EngineConfig.int8_gemm = "amx"``).

``models/native/int8_amx.cc`` is a C++ XLA FFI custom call computing
``models.quant.linear``'s int32 GEMM and rescale on AMX int8 tiles. Integer
sums are exact in any order and the rescale is the same two float32
multiplies, so its output is bitwise that of the XLA path (tested); it is a
speed choice only. Two things make it faster than XLA:CPU's own int8 GEMM
on a decode step:

* the weights are stored in the tile layout (``to_tiles``), so a call reads
  them once, contiguously, with no packing pass;
* it takes a layer's weight as ``(stack, layer)``: a scanned model passes
  its whole ``[L, K, N]`` stack and the layer index, where slicing the
  stack in the scan copied every layer's weights on every step.

It needs an x86 CPU with AMX int8 (``amx_tile``, ``amx_int8``), a Linux
kernel that grants the tile state, and a C++ compiler (it is built and
loaded by ``attention.native_build``, as every native kernel).
``int8_gemm = "auto"`` picks it where ``available()``; elsewhere the XLA
path runs with the same bits.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attention import native_build

TARGET = "iterserve_int8_amx"
KERNEL = native_build.Kernel(
    name="the AMX kernel", source=Path(__file__).resolve().parent / "native" / "int8_amx.cc",
    targets=((TARGET, "IterserveInt8Linear"),), probe="iterserve_amx_available",
    missing="this CPU has no AMX int8 tiles, or the OS does not grant them")
# A weight runs on tiles when K is a multiple of TILE_K (one tile's depth)
# and N of TILE_N (one work item's columns).
TILE_K, TILE_N = 64, 32
GEMMS = ("auto", "amx", "xla")


def unavailable_reason() -> str | None:
  """None when the AMX kernel builds and runs here, else why not."""
  return native_build.load(KERNEL)


def available() -> bool:
  """Whether ``int8_gemm="amx"`` can run here."""
  return unavailable_reason() is None


def resolve(gemm: str) -> str:
  """``"amx"`` or ``"xla"`` for ``EngineConfig.int8_gemm``.

  Raises:
    ValueError: an unknown value, or ``"amx"`` where it cannot run (the
      message says why).
  """
  return native_build.resolve_choice("int8_gemm", gemm, GEMMS, "amx", unavailable_reason)


def fits(k: int, n: int) -> bool:
  """Whether a [K, N] weight runs on tiles (K % 64 == 0, N % 32 == 0)."""
  return k % TILE_K == 0 and n % TILE_N == 0


def to_tiles(q: np.ndarray) -> np.ndarray:
  """int8[..., K, N] in row-major order -> the same shape in the tile layout.

  A layer's bytes become its B tiles: k block ``kb`` (64 rows) and column
  block ``nb`` (16 columns) at byte ``(nb * K / 64 + kb) * 1024``, tile row
  ``r`` holding ``q[64 kb + 4 r + i, 16 nb + j]`` at byte ``4 j + i``.

  Raises:
    ValueError: if the shape does not ``fits``.
  """
  *lead, k, n = q.shape
  if not fits(k, n):
    raise ValueError(f"a [K, N] = [{k}, {n}] weight does not fit the tiles "
                     f"(K % {TILE_K} == 0 and N % {TILE_N} == 0)")
  t = q.reshape(*lead, k // 64, 16, 4, n // 16, 16)          # kb, r, i, nb, j
  nd = len(lead)
  perm = tuple(range(nd)) + tuple(nd + a for a in (3, 0, 1, 4, 2))   # nb, kb, r, j, i
  return np.ascontiguousarray(t.transpose(perm)).reshape(q.shape)


def matmul(a, row_scale, q_tiles, col_scale, layer=None):
  """``float32(a @ q[layer]) * (row_scale * col_scale[layer])`` on AMX tiles.

  Args:
    a: int8[M, K] quantized rows.
    row_scale: f32[M, 1].
    q_tiles: int8[L, K, N] (or [K, N]) in the tile layout.
    col_scale: f32[L, N] (or [N]).
    layer: i32[] the layer of the stack (None: a single [K, N] weight).

  Returns:
    f32[M, N].

  Raises:
    RuntimeError: if the kernel is unavailable (``unavailable_reason``).
  """
  reason = unavailable_reason()
  if reason is not None:
    raise RuntimeError(f"AMX int8 kernel: {reason}")
  if q_tiles.ndim == 2:
    q_tiles, col_scale = q_tiles[None], col_scale[None]
  layer = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((a.shape[0], q_tiles.shape[2]),
                                                       jnp.float32))
  return call(a, q_tiles, row_scale, col_scale, layer)
