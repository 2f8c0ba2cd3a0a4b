"""The native CPU attention kernel (``impl="native"``, ``"auto"`` on CPU).

``attention/native/ragged_cpu.cc`` is a C++ XLA FFI custom call computing
``ragged_paged_attention`` over the paged cache directly: each work item (up
to 16 query rows of one sequence, every KV head) widens its own key blocks
from the pages into a cache-resident buffer, reading each key's page row
once, so no gathered copy of the K/V blocks is written to memory; the items
are spread over XLA's intra-op thread pool. Every query row runs the same
code whatever shares the launch
(the order of every sum is fixed by the row's position alone), so its bits
do not depend on the batch, its neighbours, the bucket or how its prompt was
chunked. The source file's header states the numerics.

The library is built and loaded by ``attention.native_build`` (the one
build-and-load module of the native kernels: compiler, flags, cache folder
and the hash naming a build are described there). ``scripts/setup.sh``
builds it once.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attention import native_build
from attention.native_build import NativeUnavailable

HEAD_DIMS = (16, 32, 64, 128, 256)
TARGET = "iterserve_ragged_attention"
KERNEL = native_build.Kernel(
    name="the native attention kernel",
    source=Path(__file__).resolve().parent / "native" / "ragged_cpu.cc",
    targets=((TARGET, "IterserveRaggedAttention"),))


def unavailable_reason() -> str | None:
  """None when the kernel builds and registers here, else why not."""
  return native_build.load(KERNEL)


def available() -> bool:
  """Whether ``impl="native"`` can run on this machine."""
  return unavailable_reason() is None


def ragged_attention(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                     num_seqs, *, sm_scale: float, soft_cap: float | None,
                     sliding_window: int | None, block_kv: int):
  """``ragged_paged_attention`` through the native kernel (CPU only).

  Args: as ``attention.ragged.ragged_paged_attention``; ``q`` of any float
  dtype (computed in float32), pages float32, bfloat16 or ``KV_BITS``;
  ``block_kv`` keys per block (a multiple of the page size).

  Returns:
    [T, n_q_heads, head_dim] in ``q.dtype``, zero padding rows.

  Raises:
    NativeUnavailable: if the library cannot be built or loaded.
  """
  reason = unavailable_reason()
  if reason is not None:
    raise NativeUnavailable(reason)
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
  out = call(q.astype(jnp.float32), k_pages, v_pages,
             kv_lens.astype(jnp.int32), page_table.astype(jnp.int32),
             cu_q_lens.astype(jnp.int32),
             jnp.reshape(num_seqs, (1,)).astype(jnp.int32),
             sm_scale=np.float32(sm_scale),
             soft_cap=np.float32(soft_cap or 0.0),
             sliding_window=np.int64(sliding_window or 0),
             block_kv=np.int64(block_kv))
  return out.astype(q.dtype)
