"""float32 GEMMs of generated rows in a native kernel (``EngineConfig.decode_gemm``).

A decode step multiplies a few rows (1 to 32) by every weight. XLA:CPU's
float32 GEMM at 2-32 rows runs below the machine's memory and FMA limits
(docs/archive/benchmarks-log.md "float32 decode rows on a native kernel"
compares the two), and its rounding depends on the row count (one class
for 2..32 rows, another for 1).

``models/native/f32_rows.cc`` is a C++ XLA FFI custom call: every output is
one chain of fused multiply-adds in k order (``reference``), so a row's bits
depend on the row alone, at any row count, register blocking or thread
split, and rows past ``live`` need not be computed at all. It runs the
generated rows' (``row_tiled``'s) float32 projections and the LM head when
``decode_gemm`` resolves to "native" (``models.llama.linear``,
``compute_logits``); prompt rows keep XLA's large GEMM
(``models.llama.rowwise``). Its bits differ from XLA's: the choice is part
of a run's numerics, recorded in replay reports.

It needs an x86 CPU with AVX-512F, or AVX2 and FMA (8-lane vectors, the
same bits; ``vector_bits`` says which runs; ``XLA_FLAGS=--xla_cpu_max_isa=AVX2``
caps it as it caps XLA), and a C++ compiler (it is built and loaded by
``attention.native_build``, as every native kernel).
``decode_gemm = "auto"`` picks it where ``available()``; elsewhere XLA's
GEMM runs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attention import native_build

TARGET = "iterserve_f32_rows"
TARGET_PANELS = "iterserve_f32_rows_panels"
KERNEL = native_build.Kernel(
    name="the float32 row kernel",
    source=Path(__file__).resolve().parent / "native" / "f32_rows.cc",
    targets=((TARGET, "IterserveF32Rows"), (TARGET_PANELS, "IterserveF32RowsPanels")),
    probe="iterserve_f32_rows_available",
    missing="this CPU has neither AVX-512F nor AVX2 with FMA")
PANEL = 64   # columns per panel (one work item)
GEMMS = ("auto", "native", "xla")
# Most rows a call takes: the generated rows' tile (``models.llama.ROW_TILE``).
MAX_ROWS = 32


def unavailable_reason() -> str | None:
  """None when the kernel builds and runs here, else why not."""
  return native_build.load(KERNEL)


def vector_bits() -> int:
  """The kernel's vector width here: 512 (AVX-512F), 256 (AVX2 + FMA) or 0
  (it does not run here)."""
  if unavailable_reason() is not None:
    return 0
  return int(ctypes.CDLL(str(native_build.library_path(KERNEL))).iterserve_f32_rows_vector_bits())


def available() -> bool:
  """Whether ``decode_gemm="native"`` can run here."""
  return unavailable_reason() is None


def resolve(gemm: str) -> str:
  """``"native"`` or ``"xla"`` for ``EngineConfig.decode_gemm``.

  Raises:
    ValueError: an unknown value, or ``"native"`` where it cannot run (the
      message says why).
  """
  return native_build.resolve_choice("decode_gemm", gemm, GEMMS, "native", unavailable_reason)


def to_panels(w: jax.Array) -> jax.Array:
  """f32[K, N] row-major -> f32[ceil(N / 64), K, 64] panels (``matmul``'s
  panel layout): panel p holds columns [64 p, 64 p + 64), zero past N.
  Works on concrete and traced arrays."""
  k, n = w.shape
  p = -(-n // PANEL)
  padded = jnp.pad(jnp.asarray(w, jnp.float32), ((0, 0), (0, p * PANEL - n)))
  return padded.reshape(k, p, PANEL).transpose(1, 0, 2)


def matmul(x: jax.Array, w: jax.Array, *, n: int | None = None, live=None) -> jax.Array:
  """``x @ w``, every output one k-ordered fma chain (``reference``).

  Args:
    x: f32[M, K] rows.
    w: f32[K, N] row-major weight, or its ``to_panels`` f32[P, K, 64]
      (each work item then reads one contiguous panel: the LM head's
      [d_model, vocab] rows lie 196 KB apart).
    n: static, N of a panel weight (default ``64 P``).
    live: i32[] rows computed (a prefix; default M): the others are zero.

  Returns:
    f32[M, N]: the same bits for either layout, whatever ``live``.

  Raises:
    RuntimeError: if the kernel is unavailable (``unavailable_reason``).
    ValueError: operands that are not float32 of those shapes.
  """
  reason = unavailable_reason()
  if reason is not None:
    raise RuntimeError(f"float32 row kernel: {reason}")
  panels = w.ndim == 3
  k = w.shape[1] if panels else w.shape[0]
  if (x.ndim != 2 or w.ndim not in (2, 3) or x.shape[1] != k or (panels and w.shape[2] != PANEL)
      or x.dtype != jnp.float32 or w.dtype != jnp.float32):
    raise ValueError(f"x must be f32[M, K] and w f32[K, N] or f32[P, K, {PANEL}], got "
                     f"{x.dtype}{list(x.shape)} and {w.dtype}{list(w.shape)}")
  cols = w.shape[0] * PANEL if panels else w.shape[1]
  call = jax.ffi.ffi_call(TARGET_PANELS if panels else TARGET,
                          jax.ShapeDtypeStruct((x.shape[0], cols), jnp.float32))
  live = jnp.asarray(x.shape[0] if live is None else live, jnp.int32).reshape(())
  out = call(x, w, live)
  if panels and n is not None and n != cols:
    out = out[:, :n]
  return out


def _fma(a, b, c) -> np.ndarray:
  """float32 ``round(a * b + c)``, the sum formed in 80-bit long double
  (exact products; a double rounding only where a long double sum lands on
  a float32 rounding midpoint)."""
  return (a.astype(np.longdouble) * b.astype(np.longdouble)
          + c.astype(np.longdouble)).astype(np.float32)


def reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  """What ``matmul`` computes for ``w`` [K, N], in numpy: ``acc = fma(x[:,
  k], w[k], acc)`` for k = 0..K-1 from +0.

  For normal values only: the kernel runs on XLA:CPU's threads, which flush
  subnormal inputs and results to zero (``matmul([[1e-20]], [[1e-20]])`` is
  0 there, 1e-40 here), and ``_fma``'s long double sum can round twice."""
  x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
  acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
  for k in range(x.shape[1]):
    acc = _fma(x[:, k:k + 1], w[k][None, :], acc)
  return acc
