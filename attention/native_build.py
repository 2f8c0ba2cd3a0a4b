"""Building and loading the native C++ kernels (XLA FFI custom calls on CPU).

One module builds and loads every native kernel: the attention kernel
(``attention/native.py`` over ``attention/native/ragged_cpu.cc``), the
two GEMM kernels of ``models/`` (``models/amx.py`` over
``models/native/int8_amx.cc``, ``models/rowgemm.py`` over
``models/native/f32_rows.cc``), the key order's radix sort
(``scheduler/keys.py`` over ``scheduler/native/sort_u32.cc``) and the
scheduler's scans (``scheduler/scan.py`` over
``scheduler/native/scan_i32.cc``). Each of
those modules describes its kernel as a ``Kernel`` and asks ``load``
whether it runs here; the FFI handlers are registered by ``load`` and
nowhere else.

Why here: the packages' imports point down (``attention/`` imports no
other package, ``scheduler/`` only this builder, ``models/`` imports
``attention/``, ``serving/`` all of them; ``tests/test_layers.py``), so a
module that ``attention/native.py``, ``models/`` and ``scheduler/`` import
lives in ``attention/``, the lowest package with kernels (in ``models/`` it
would make ``attention/`` import upward). It is apart
from the attention kernel's module: the GEMM kernels import this builder,
not the attention kernel. It imports nothing of iterserve.

A library is compiled on first use with the system C++ compiler (``CXX``,
default ``g++``) and ``build_flags()`` (``-march=native``) into ``cache_dir()``:
``$XDG_CACHE_HOME/iterserve/native`` (default ``~/.cache/iterserve/native``;
``ITERSERVE_NATIVE_CACHE`` overrides the folder). Its file name,
``<source stem>-<key>.so``, carries a hash of the source's bytes, the flags,
the compiler, jax's version and the CPU's model and flags
(``library_name``), so a changed source or another machine builds anew.

XLA's own instruction-set cap, ``XLA_FLAGS=--xla_cpu_max_isa=AVX2``, caps the
native kernels too (``max_isa``, ``build_flags``): they are built without
AVX-512 (and AMX), so a machine that has it runs the code an AVX2-only CPU
would, XLA's and ours alike. Timings under the cap are of that code on this
machine's cores, caches and memory, not of an AVX2 machine.
The sources (``*.cc``) are package data of ``attention``, ``models`` and
``scheduler``: an installed package builds from its own copy.
``scripts/setup.sh`` builds all five once.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import jax

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
# The values XLA's --xla_cpu_max_isa accepts (jax 0.10.2; any other is
# warned about and ignored), and those below AVX-512, and what the native kernels
# leave out under them (``-D`` macros the sources test).
XLA_ISAS = ("SSE4_2", "AVX", "AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX", "AMX_FP16",
            "NEON", "SVE")
_CAPS = {"AVX2": ("-mno-avx512f", "-DITERSERVE_NO_AVX512"),
         "AVX": ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-DITERSERVE_NO_AVX512",
                 "-DITERSERVE_NO_AVX2"),
         "SSE4_2": ("-mno-avx512f", "-mno-avx", "-mno-avx2", "-mno-fma",
                    "-DITERSERVE_NO_AVX512", "-DITERSERVE_NO_AVX2")}


class NativeUnavailable(RuntimeError):
  """A native kernel could not be built or loaded (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One native kernel: its source and what ``load`` registers from it.

  Attributes:
    name: the kernel in reasons ("the AMX kernel").
    source: the C++ source, inside the installed package.
    targets: (FFI target name, handler symbol) pairs, registered for the
      CPU platform.
    probe: an ``extern "C" int`` symbol, nonzero when this CPU can run the
      kernel; None when building it is enough.
    missing: the reason when ``probe`` returns 0.
  """
  name: str
  source: Path
  targets: tuple[tuple[str, str], ...]
  probe: str | None = None
  missing: str = ""


def cache_dir() -> Path:
  """The folder of the built libraries (module docstring)."""
  env = os.environ.get("ITERSERVE_NATIVE_CACHE")
  if env:
    return Path(env)
  base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(base) / "iterserve" / "native"


def max_isa() -> str | None:
  """XLA:CPU's instruction-set cap as ``XLA_FLAGS`` sets it
  (``--xla_cpu_max_isa=AVX2``), upper case, or None where it sets none (the
  last one wins, as in XLA).

  Raises:
    ValueError: a value XLA does not know (it would warn and run uncapped).
  """
  cap = None
  for word in os.environ.get("XLA_FLAGS", "").split():
    name, _, value = word.partition("=")
    if name == "--xla_cpu_max_isa" and value:
      cap = value.upper()
  if cap is not None and cap not in XLA_ISAS:
    raise ValueError(f"XLA_FLAGS --xla_cpu_max_isa must be one of {', '.join(XLA_ISAS)} "
                     f"(any case), got {cap!r}")
  return cap


def build_flags() -> tuple[str, ...]:
  """The compiler flags of the native kernels: ``FLAGS``, plus, under an
  ``XLA_FLAGS`` cap of AVX2 or below (``max_isa``), the flags and macros
  that leave out what the cap excludes (AVX-512 and AMX; under AVX or
  SSE4_2 also AVX2 and FMA). A cap of AVX-512 or above changes nothing."""
  return FLAGS + _CAPS.get(max_isa() or "", ())


def _cpu_signature() -> str:
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    return platform.processor() + platform.machine()
  keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
  return "\n".join(sorted(set(keep)))


def _compiler() -> str:
  return os.environ.get("CXX", "g++")


def _source_bytes(kernel: Kernel) -> bytes:
  try:
    return kernel.source.read_bytes()
  except OSError as e:
    raise NativeUnavailable(
        f"{kernel.name}'s source {kernel.source} is missing ({e.strerror}): the package was "
        f"installed without its .cc package data") from None


def library_name(kernel: Kernel) -> str:
  """``<source stem>-<key>.so``, ``key`` the first 20 hex digits of a
  sha256 over the source's bytes, ``build_flags()``, the compiler, jax's version and
  the CPU's model and flags.

  Raises:
    NativeUnavailable: the source is missing.
  """
  key = hashlib.sha256(b"\0".join([
      _source_bytes(kernel), " ".join(build_flags()).encode(), _compiler().encode(),
      jax.__version__.encode(), _cpu_signature().encode()])).hexdigest()[:20]
  return f"{kernel.source.stem}-{key}.so"


def library_path(kernel: Kernel) -> Path:
  """Compiles ``kernel.source`` into ``cache_dir()`` if needed and returns
  the library's path (``library_name``).

  Raises:
    NativeUnavailable: the source is missing, there is no C++ compiler, or
      the compile failed (with its first error lines).
  """
  out = cache_dir() / library_name(kernel)
  if out.exists() and out.stat().st_size > 0:
    return out
  cxx = _compiler()
  if shutil.which(cxx) is None:
    raise NativeUnavailable(f"C++ compiler {cxx!r} not found (set CXX)")
  out.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
  os.close(fd)
  cmd = [cxx, *build_flags(), f"-I{jax.ffi.include_dir()}", str(kernel.source), "-o", tmp]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode != 0 or os.path.getsize(tmp) == 0:
    os.unlink(tmp)
    first = "; ".join(proc.stderr.strip().splitlines()[:8])
    empty = "" if proc.returncode else ", no library written"
    raise NativeUnavailable(f"compiling {kernel.source.name} with {cxx} failed (exit status "
                            f"{proc.returncode}{empty}){': ' + first if first else ''}")
  os.replace(tmp, out)             # atomic: concurrent builders agree
  return out


@functools.lru_cache(maxsize=None)
def load(kernel: Kernel) -> str | None:
  """Builds and loads ``kernel`` and registers its FFI targets, once per
  process: None when it runs here, else why not (the CPU backend only, a
  missing source, no compiler, a failed compile or load, or ``probe``
  returning 0)."""
  if jax.default_backend() != "cpu":
    return f"{kernel.name} runs on the CPU backend only (backend: {jax.default_backend()})"
  try:
    lib = ctypes.CDLL(str(library_path(kernel)))
  except (NativeUnavailable, OSError) as e:
    return str(e)
  if kernel.probe is not None and not getattr(lib, kernel.probe)():
    cap = max_isa()
    return kernel.missing + (f" (XLA_FLAGS caps the instruction set at {cap})"
                             if cap in _CAPS else "")
  for target, symbol in kernel.targets:
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  return None


def on_cpu(kernel: Kernel, native: Callable, default: Callable, *args):
  """``native(*args)`` (an FFI call of ``kernel``) where the program runs on
  the CPU and ``kernel`` loads here, else ``default(*args)``: through
  ``jax.lax.platform_dependent``, so a program lowered for another backend
  takes ``default``; where the kernel does not load (``load`` gives why),
  ``default`` alone is traced. For kernels whose result is ``default``'s
  bit for bit (the scheduler's sort and scans)."""
  if load(kernel) is not None:
    return default(*args)
  return jax.lax.platform_dependent(*args, cpu=native, default=default)


def resolve_choice(field: str, value: str, choices: tuple[str, ...], kernel: str,
                   unavailable_reason: Callable[[], str | None]) -> str:
  """``value`` of a config field choosing "auto", a native kernel or "xla",
  resolved to ``kernel`` or "xla": "auto" takes the kernel where
  ``unavailable_reason()`` is None.

  Raises:
    ValueError: a value not in ``choices``, or ``kernel`` where it cannot
      run (the message names ``field`` and says why).
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
