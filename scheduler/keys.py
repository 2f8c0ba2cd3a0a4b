"""The recorded tie-break key and the orders built on it.

A policy records, for every slot, the key it ordered the slots by
(``IterationPlan.sort_key``, i32[R, K]); ``validate`` replays it. This module
holds the default key (``sort_keys``: phase, priority, arrival, id,
generation), the stable identity tail every policy's key ends with
(``identity_keys``), the ascending order of a key (``key_order``), the
recompute-victim rank (``victim_rank``) and the u32 sort the key order
runs on (``sort_u32``); its permutation helpers (``inverse_permutation``,
``stable_partition``) live in ``scan`` and are re-exported here. It reads
only the records (no ledger, no policy), so ``validate`` and the ledger
both build on it.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attention import native_build
from scheduler import records as rec
from scheduler.scan import inverse_permutation, stable_partition  # noqa: F401 (re-exported)

SORT_TARGET = "iterserve_sort_u32"
SORT_KERNEL = native_build.Kernel(
    name="the u32 sort kernel",
    source=Path(__file__).resolve().parent / "native" / "sort_u32.cc",
    targets=((SORT_TARGET, "IterserveSortU32"),))


def sort_u32(values, ordered_low_bits: int = 0):
  """u32[n]: ``values`` (u32[n]) in ascending order, ``jax.lax.sort``'s
  result. ``ordered_low_bits`` (static, 0-32): the caller's word for the
  kernel that the values' low bits ascend along the vector (the key
  order's words hold the slot there), so it sorts on the bits above them
  only; the kernel checks it and sorts on every bit where it does not hold,
  so the result never depends on it. On the CPU backend, where the native kernel
  (``scheduler/native/sort_u32.cc``, a radix sort) builds, it runs as an FFI
  custom call: XLA:CPU's comparison sort is O(R log R), and at
  8,192-16,384 slots the key order's sorts were a quarter of a simulated
  iteration (docs/archive/benchmarks-log.md "The overloaded hour's
  iteration"). Elsewhere, or where the kernel does not build, ``jax.lax.sort``.
  Either gives the same values: a sort's result does not depend on how it
  sorts.

  Raises:
    ValueError: ``values`` is not a vector of uint32 (the kernel sorts its
      buffer as one array, where ``jax.lax.sort`` sorts the last axis), or
      ``ordered_low_bits`` is not a Python int in [0, 32] (static: under
      ``jax.jit`` pass it through ``static_argnums`` or a closure).
  """
  values = jnp.asarray(values)
  if values.ndim != 1 or values.dtype != jnp.uint32:
    raise ValueError(f"sort_u32: values must be u32[n], got {values.dtype}{list(values.shape)}")
  if (isinstance(ordered_low_bits, bool) or not isinstance(ordered_low_bits, (int, np.integer))
      or not 0 <= ordered_low_bits <= 32):
    raise ValueError(f"sort_u32: ordered_low_bits must be a static int in [0, 32], got "
                     f"{ordered_low_bits!r}")

  def native(v):
    return jax.ffi.ffi_call(SORT_TARGET, jax.ShapeDtypeStruct(v.shape, v.dtype),
                            vmap_method="sequential")(
                                v, ordered_low_bits=np.int32(ordered_low_bits))

  return native_build.on_cpu(SORT_KERNEL, native, jax.lax.sort, values)


def sort_impl() -> str:
  """What ``sort_u32`` runs in this process on the default backend, for
  reports: "native radix sort" or "jax.lax.sort (why the kernel does not
  run)"."""
  reason = native_build.load(SORT_KERNEL)
  return "native radix sort" if reason is None else f"jax.lax.sort ({reason})"


def phase_rank(manifest: rec.WorkloadManifest, state: rec.SchedulerState):
  """i32[R]: 0 decode, 1 running prefill/rebuild, 2 waiting, 3 no work."""
  target = rec.prefill_target(manifest, state)
  running = (state.status == rec.RUNNING) & state.ready
  decode = running & (state.emitted >= 1) & (
      state.computed == manifest.prompt_len + state.emitted - 1)
  partial = running & (state.computed < target)
  waiting = (state.status == rec.WAITING) & state.ready
  return jnp.select([decode, partial, waiting], [0, 1, 2], 3).astype(jnp.int32)


def sort_keys(manifest: rec.WorkloadManifest, state: rec.SchedulerState):
  """i32[R, 5]: the recorded tie-break key, columns ``SORT_KEY_FIELDS``."""
  return jnp.stack([phase_rank(manifest, state), manifest.priority,
                    manifest.arrival_seq, manifest.request_id,
                    state.generation], axis=1).astype(jnp.int32)


def key_order(keys):
  """i32[R]: slots in ascending lexicographic order of ``keys`` (i32[R, K],
  first column primary), ties by slot: ``jnp.lexsort``'s stable order.

  XLA:CPU sorts one array with ``std::sort`` on its values, but a sort of
  several (K key columns and an index) calls a compiled comparator per
  comparison: at R = 256, K = 5 ``jnp.lexsort`` took ~85 us a call on this
  project's 2-core CPU, this function ~14 us (docs/archive/benchmarks-log.md,
  "Decode runs, the packed policy key and page-allocation lanes"). So the key is packed
  into u32 words: each column less its minimum takes the bits of its range
  (0 for a constant column), the columns in order, the low digit word
  sorted first, then the high one, each word's lowest bits holding the slot
  (or its position after the first sort), so every sort key is unique and
  the two passes give the lexicographic order (LSD radix by words). Keys
  whose ranges need more than two words fall back to ``jnp.lexsort``. A
  column equal to an earlier one in every slot never decides (the id
  column is the arrival number's copy for every engine request) and takes
  no bits; keys that then fit one word take one sort: the default key of a
  16,384-slot table over an hour of requests needs 17-18 bits (phase 2,
  arrival 15, generation 0-1) of the 18 the slot leaves ("Fewer sorts over
  a large slot table" in docs/archive/benchmarks-log.md).
  """
  num_slots, num_keys = keys.shape
  if num_keys == 0:
    return jnp.arange(num_slots, dtype=jnp.int32)
  slot_bits = max(1, (num_slots - 1).bit_length())
  digit = 32 - slot_bits
  values = (keys - jnp.min(keys, axis=0)).astype(jnp.uint32)   # unsigned range
  copies = [jnp.any(jnp.stack([jnp.all(keys[:, i] == keys[:, j]) for i in range(j)]))
            if j else jnp.bool_(False) for j in range(num_keys)]
  values = jnp.where(jnp.stack(copies), jnp.uint32(0), values)
  bits = (32 - jax.lax.clz(jnp.max(values, axis=0))).astype(jnp.uint32)
  shift = jnp.cumsum(bits[::-1])[::-1] - bits       # bits of the later columns

  def packed(_):
    low = jnp.zeros((num_slots,), jnp.uint32)
    high = jnp.zeros((num_slots,), jnp.uint32)
    for j in range(num_keys):
      col, s = values[:, j], shift[j]
      in_low = s < digit
      low = low | jnp.where(in_low, (col << jnp.minimum(s, 31))
                            & jnp.uint32((1 << digit) - 1), 0)
      high = high | jnp.where(in_low, col >> jnp.minimum(digit - s, 31),
                              col << jnp.minimum(s - digit, 31))
    lane = jnp.arange(num_slots, dtype=jnp.uint32)
    mask = jnp.uint32((1 << slot_bits) - 1)
    first = sort_u32((low << slot_bits) | lane, slot_bits) & mask

    def second_word(_):
      second = sort_u32((high[first] << slot_bits) | lane, slot_bits) & mask
      return first[second]

    # An all-zero high word would sort to the identity: one sort is the order.
    return jax.lax.cond(jnp.any(high != 0), second_word, lambda _: first, None).astype(
        jnp.int32)

  def lexsort(_):
    return jnp.lexsort(tuple(keys[:, i] for i in reversed(range(num_keys)))).astype(
        jnp.int32)

  return jax.lax.cond(jnp.sum(bits) <= 2 * digit, packed, lexsort, None)


def identity_keys(manifest, state, *leading):
  """i32[R, len(leading) + 3]: ``leading`` columns, then arrival_seq,
  request_id and generation (the stable tail every policy shares)."""
  cols = list(leading) + [manifest.arrival_seq, manifest.request_id,
                          state.generation]
  return jnp.stack([jnp.asarray(col, jnp.int32) for col in cols], axis=1)


def victim_rank(manifest: rec.WorkloadManifest):
  """i32[R]: the recompute-victim key's rank, ``max(priority, arrival)``
  first out: a larger rank is evicted before a smaller one, whatever the
  policy's scheduling order (§0x0C, §0x0D). Among equal priorities the later
  arrival always goes first, so an earlier arrival is never evicted while a
  later one of the same priority keeps running."""
  return inverse_permutation(key_order(jnp.stack(
      [manifest.priority, manifest.arrival_seq, manifest.request_id], axis=1)))
