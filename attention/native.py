"""The native CPU attention kernel (``impl="native"``, ``"auto"`` on CPU).

``attention/native/ragged_cpu.cc`` is a C++ XLA FFI custom call computing
``ragged_paged_attention`` over the paged cache directly: each work item (up
to 16 query rows of one sequence, every KV head) widens its own key blocks
from the pages into a cache-resident buffer, reading each key's page row
once, so no gathered copy of the K/V blocks is written to memory; the items
are spread over XLA's intra-op thread pool. Every query row runs the same code whatever shares the launch
(the order of every sum is fixed by the row's position alone), so its bits
do not depend on the batch, its neighbours, the bucket or how its prompt was
chunked. The source file's header states the numerics.

The library is compiled on first use with the system C++ compiler (``CXX``,
default ``g++``) and ``-O3 -march=native`` into
``$XDG_CACHE_HOME/iterserve/native`` (default ``~/.cache/iterserve/native``;
``ITERSERVE_NATIVE_CACHE`` overrides the folder); the file name carries a
hash of the source, the flags, the compiler, jax's version and the CPU's
model and flags, so a changed source or another machine builds anew.
``scripts/setup.sh`` builds it once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = Path(__file__).resolve().parent / "native" / "ragged_cpu.cc"
TARGET = "iterserve_ragged_attention"
HEAD_DIMS = (16, 32, 64, 128, 256)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")


class NativeUnavailable(RuntimeError):
  """The native kernel could not be built or loaded (the message says why)."""


def _cache_dir() -> Path:
  env = os.environ.get("ITERSERVE_NATIVE_CACHE")
  if env:
    return Path(env)
  base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(base) / "iterserve" / "native"


def _cpu_signature() -> str:
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    return platform.processor() + platform.machine()
  keep = [ln for ln in text.splitlines()
          if ln.startswith(("model name", "flags"))]
  return "\n".join(sorted(set(keep)))


def library_path() -> Path:
  """Builds the attention kernel's library if needed and returns its path.

  Raises:
    NativeUnavailable: no C++ compiler, or the compile failed (with its
      first error lines).
  """
  return build_library(SOURCE)


def build_library(source_path: Path) -> Path:
  """Compiles the XLA FFI source ``source_path`` into the cache if needed.

  The library is named ``<stem>-<hash>.so``, the hash covering the source,
  the flags, the compiler, jax's version and the CPU (module docstring).

  Raises:
    NativeUnavailable: no C++ compiler, or the compile failed (with its
      first error lines).
  """
  cxx = os.environ.get("CXX", "g++")
  source = source_path.read_bytes()
  key = hashlib.sha256(b"\0".join([
      source, " ".join(FLAGS).encode(), cxx.encode(), jax.__version__.encode(),
      _cpu_signature().encode()])).hexdigest()[:20]
  out = _cache_dir() / f"{source_path.stem}-{key}.so"
  if out.exists() and out.stat().st_size > 0:
    return out
  if shutil.which(cxx) is None:
    raise NativeUnavailable(f"C++ compiler {cxx!r} not found (set CXX)")
  out.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
  os.close(fd)
  cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source_path), "-o", tmp]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode != 0 or os.path.getsize(tmp) == 0:
    os.unlink(tmp)
    first = "; ".join(proc.stderr.strip().splitlines()[:8])
    empty = "" if proc.returncode else ", no library written"
    raise NativeUnavailable(f"compiling {source_path.name} with {cxx} failed (exit status "
                            f"{proc.returncode}{empty}){': ' + first if first else ''}")
  os.replace(tmp, out)             # atomic: concurrent builders agree
  return out


def load_kernel(source_path: Path, what: str, probe: str, missing: str,
                targets: dict) -> str | None:
  """Builds and loads another FFI source with ``build_library`` and
  registers its handlers: None when it runs here, else why not.

  Args:
    source_path: the C++ source.
    what: the kernel's name in the reasons ("the AMX kernel").
    probe: an ``extern "C" int`` symbol, nonzero when this CPU can run it.
    missing: the reason when ``probe`` returns 0.
    targets: FFI target name -> handler symbol, registered for the CPU.
  """
  if jax.default_backend() != "cpu":
    return f"{what} runs on the CPU backend only (backend: {jax.default_backend()})"
  try:
    lib = ctypes.CDLL(str(build_library(source_path)))
  except (NativeUnavailable, OSError) as e:
    return str(e)
  if not getattr(lib, probe)():
    return missing
  for target, symbol in targets.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  return None


def resolve_choice(field: str, value: str, choices: tuple, kernel: str,
                   unavailable_reason) -> str:
  """``value`` of a config field choosing "auto", a native kernel or "xla",
  resolved to ``kernel`` or "xla": "auto" takes the kernel where
  ``unavailable_reason()`` is None.

  Raises:
    ValueError: a value not in ``choices``, or ``kernel`` where it cannot
      run (the message says why).
  """
  if value not in choices:
    raise ValueError(f"{field} must be one of {choices}, got {value!r}")
  if value == "xla":
    return "xla"
  reason = unavailable_reason()
  if reason is None:
    return kernel
  if value == kernel:
    raise ValueError(f"{field} {kernel!r}: {reason}")
  return "xla"


@functools.lru_cache(maxsize=None)
def _register() -> str:
  lib = ctypes.CDLL(str(library_path()))
  jax.ffi.register_ffi_target(
      TARGET, jax.ffi.pycapsule(lib.IterserveRaggedAttention), platform="cpu")
  return TARGET


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
  """None when the kernel builds and registers here, else why not."""
  try:
    _register()
  except (NativeUnavailable, OSError) as e:
    return str(e)
  return None


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
