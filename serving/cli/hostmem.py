"""Host memory: let XLA:CPU's per-step buffers reuse already-mapped pages.

XLA:CPU allocates each program execution's output and temporary buffers
with ``malloc`` and frees them when the step ends. glibc serves an
allocation above its mmap threshold (128 KiB, adapting up to 32 MiB) with
freshly mapped pages and unmaps them on ``free``, so every step of the
engine faults its large buffers (the logits, the per-layer weight copies,
the prompt rows' activations) back in page by page, a measurable part of a
decode run (docs/archive/benchmarks-log.md, "The native CPU attention
kernel; host memory; ..."). ``keep_freed_pages`` turns off glibc's
mmap path (``M_MMAP_MAX = 0``) and its heap trimming (``M_TRIM_THRESHOLD``),
so freed buffers stay mapped and the next step reuses them. The cost: the process
keeps its peak heap (it is not returned to the OS).

The launchers call it (``--keep_freed_pages``, default on) before the model
loads; it changes the whole process's ``malloc``, so a library user calls
it explicitly.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 2**31 - 1        # bytes (mallopt takes an int): never trim


def keep_freed_pages() -> bool:
  """Serves every ``malloc`` from the heap and never trims it (glibc).

  Returns:
    True if glibc took both settings; False where the C library is not
    glibc (nothing is changed there).
  """
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name)
    mallopt = libc.mallopt
  except (OSError, AttributeError, TypeError):
    return False
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  mallopt.restype = ctypes.c_int
  ok = mallopt(_M_MMAP_MAX, 0) == 1
  return ok and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
