"""The scheduler's O(R) passes over slot vectors, native on the CPU:
``cumsum_i32`` (an inclusive prefix sum), ``suffix_min_i32``,
``inverse_permutation`` and ``stable_partition``.

The plan (the ledger's ranks, decode runs, victim and work walks, the
walk's skips), the page allocator (``serving/kv/pages.py``) and the
simulation loop's event log take prefix sums of per-slot counts and
permute the slots every iteration.
XLA:CPU lowers ``jnp.cumsum`` to tiled ``reduce-window``s with their pads and
copies, several operations each, and runs a scatter as a loop over its
updates; at 8,192-16,384 slots these were a fifth of a simulated iteration
(docs/archive/benchmarks-log.md "The overloaded hour's iteration"). On the
CPU backend, where the native kernels (``scheduler/native/scan_i32.cc``,
one pass each) build, each function runs its kernel as an FFI custom call;
elsewhere the ``jnp`` form beside it. Both give the same bits: integer sums
do not depend on their order, and a permutation's inverse and a stable
partition have one answer.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attention import native_build

CUMSUM_TARGET = "iterserve_cumsum_i32"
SUFFIX_MIN_TARGET = "iterserve_suffix_min_i32"
INVERSE_TARGET = "iterserve_inverse_permutation"
PARTITION_TARGET = "iterserve_stable_partition"
SCAN_KERNEL = native_build.Kernel(
    name="the scan kernels",
    source=Path(__file__).resolve().parent / "native" / "scan_i32.cc",
    targets=((CUMSUM_TARGET, "IterserveCumsumI32"),
             (SUFFIX_MIN_TARGET, "IterserveSuffixMinI32"),
             (INVERSE_TARGET, "IterserveInversePermutation"),
             (PARTITION_TARGET, "IterserveStablePartition")))


# Integer dtypes whose every value int32 holds: cast to int32 exactly.
_EXACT_IN_I32 = (jnp.int8, jnp.int16, jnp.int32, jnp.uint8, jnp.uint16)


def _vector(name: str, values, kinds: str, dtypes):
  """``values`` as a jax vector cast to int32 (bool kept), or ValueError
  naming ``name``, the rule and the dtype and shape given. A host array
  (numpy, a list) of a wider integer type is taken where its values fit
  in int32 (numpy's default int64), never truncated."""
  if not isinstance(values, jax.Array):
    host = np.asarray(values)
    if (host.ndim == 1 and host.dtype.kind in "iu" and host.dtype not in dtypes
        and jnp.int32 in dtypes and (host.size == 0 or (
            host.min() >= np.iinfo(np.int32).min and host.max() <= np.iinfo(np.int32).max))):
      host = host.astype(np.int32)
    values = host
  if values.ndim != 1 or values.dtype not in dtypes:
    raise ValueError(f"{name} must be {kinds}, got {values.dtype}{list(values.shape)}")
  values = jnp.asarray(values)
  return values if values.dtype == jnp.bool_ else values.astype(jnp.int32)


def cumsum_i32(values):
  """i32[n]: the inclusive prefix sum of ``values`` (bool[n] or i32[n]),
  ``out[i] = values[0] + ... + values[i]``, as int32 whatever
  ``jax_enable_x64`` says (``jnp.cumsum`` of int32 gives int64 under it:
  the values are the same while the sums fit in int32, which counts of
  slots, pages, rows and events do). An int32 overflow wraps as XLA's does.
  Narrower integers (int8/16, uint8/16) are cast to int32 first.

  Raises:
    ValueError: ``values`` is not a vector of bool or of an integer type
      int32 holds (an int64 or uint32 one would need a cast that can
      change values: the caller decides; a host array of one is taken
      where every value fits in int32).
  """
  values = _vector("cumsum_i32: values", values,
                   "a vector of bool or of int32 or a narrower integer",
                   _EXACT_IN_I32 + (jnp.bool_,))
  xla = lambda v: jnp.cumsum(v, dtype=jnp.int32)
  native = lambda v: jax.ffi.ffi_call(CUMSUM_TARGET, jax.ShapeDtypeStruct(v.shape, v.dtype),
                                      vmap_method="sequential")(v)
  return native_build.on_cpu(SCAN_KERNEL, native, xla, values.astype(jnp.int32))  # bool too


def suffix_min_i32(values):
  """i32[n]: ``out[i] = min(values[i:])`` for ``values`` (i32[n]),
  ``jax.lax.cummin(values, reverse=True)``.

  Raises:
    ValueError: ``values`` is not a vector of int32 or a narrower integer.
  """
  values = _vector("suffix_min_i32: values", values,
                   "a vector of int32 or a narrower integer", _EXACT_IN_I32)
  xla = lambda v: jax.lax.cummin(v, reverse=True)
  native = lambda v: jax.ffi.ffi_call(SUFFIX_MIN_TARGET, jax.ShapeDtypeStruct(v.shape, v.dtype),
                                      vmap_method="sequential")(v)
  return native_build.on_cpu(SCAN_KERNEL, native, xla, values)


def inverse_permutation(order):
  """i32[R]: ``pos[order[i]] = i`` for ``order`` (a permutation of
  0..R-1, int32 or a narrower integer). Every caller passes a permutation
  (a key order, its reverse, a stable partition of one); on an entry
  outside [0, R) the native kernel fails the program at run time
  (INVALID_ARGUMENT, naming the entry) where the ``jnp`` form (other
  backends) wraps a negative entry and drops one >= R. An in-range entry
  given twice is not checked: the result is then not an inverse of
  anything (natively each position takes its last ``i``, missing ones 0).

  Raises:
    ValueError: ``order`` is not a vector of int32 or a narrower integer.
  """
  order = _vector("inverse_permutation: order", order,
                  "a vector of int32 or a narrower integer", _EXACT_IN_I32)
  n = order.shape[0]
  xla = lambda o: jnp.zeros((n,), jnp.int32).at[o].set(jnp.arange(n, dtype=jnp.int32))
  native = lambda o: jax.ffi.ffi_call(INVERSE_TARGET, jax.ShapeDtypeStruct(o.shape, o.dtype),
                                      vmap_method="sequential")(o)
  return native_build.on_cpu(SCAN_KERNEL, native, xla, order)


def stable_partition(order, mask):
  """(walk, count): ``order`` (a permutation of the slots, int32 or a
  narrower integer) with the slots where ``mask`` (bool[R], by slot)
  holds first, each part in ``order``'s order, as i32[R], and i32[] how
  many hold. O(R): one pass natively; two prefix sums and a scatter in
  XLA. An entry outside [0, R) fails the native program at run time, as
  in ``inverse_permutation``.

  Raises:
    ValueError: ``order`` is not a vector of int32 or a narrower integer,
      ``mask`` not a vector of bool, or their lengths differ.
  """
  order = _vector("stable_partition: order", order,
                  "a vector of int32 or a narrower integer", _EXACT_IN_I32)
  mask = _vector("stable_partition: mask", mask, "a vector of bool", (jnp.bool_,))
  if mask.shape != order.shape:
    raise ValueError(f"stable_partition: mask must have order's length {order.shape[0]} "
                     f"(one flag per slot), got {mask.shape[0]}")
  num_slots = order.shape[0]

  def xla(order, mask):
    keep = mask[order]
    count = jnp.sum(keep, dtype=jnp.int32)
    first = jnp.cumsum(keep, dtype=jnp.int32) - 1
    rest = count + jnp.cumsum(~keep, dtype=jnp.int32) - 1
    dest = jnp.where(keep, first, rest)
    return jnp.zeros((num_slots,), jnp.int32).at[dest].set(order), count

  def native(order, mask):
    return jax.ffi.ffi_call(
        PARTITION_TARGET, (jax.ShapeDtypeStruct(order.shape, jnp.int32),
                           jax.ShapeDtypeStruct((), jnp.int32)),
        vmap_method="sequential")(order, mask)

  return native_build.on_cpu(SCAN_KERNEL, native, xla, order, mask)


def scan_impl() -> str:
  """What these functions run in this process on the default backend, for
  reports: "native" or "xla (why the kernels do not run)"."""
  reason = native_build.load(SCAN_KERNEL)
  return "native" if reason is None else f"xla ({reason})"
