"""serving.cli.hostmem: after ``keep_freed_pages`` a large allocation comes from
glibc's heap (no fresh mmap) and stays mapped after ``free``; checked in
fresh processes, since the setting is process-wide."""

import ctypes
import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Allocates and frees 64 MiB (numpy's data comes from malloc) and reports
# glibc's mallinfo2: bytes in mmapped chunks while it is held, and heap
# bytes still mapped after it is freed.
_PROBE = """
import ctypes, json, sys
import numpy as np
from serving.cli import hostmem
kept = hostmem.keep_freed_pages() if sys.argv[1] == "keep" else None
class Info(ctypes.Structure):
  _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
a = np.ones(1 << 24, np.float32)
held = libc.mallinfo2()
del a
freed = libc.mallinfo2()
print(json.dumps({"kept": kept, "mmapped_held": held.hblkhd, "arena_after_free": freed.arena}))
"""


def _probe(mode):
  out = subprocess.run([sys.executable, "-c", _PROBE, mode], cwd=ROOT, capture_output=True,
                       text=True, check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_keep_freed_pages_serves_large_allocations_from_the_heap():
  libc = ctypes.CDLL(ctypes.util.find_library("c"))
  if not hasattr(libc, "mallinfo2") or not hasattr(libc, "gnu_get_libc_version"):
    pytest.skip("needs glibc >= 2.33 (mallinfo2)")
  default, kept = _probe("default"), _probe("keep")
  assert kept["kept"] is True
  # glibc's default: the 64 MiB array is one mmapped chunk, unmapped on free.
  assert default["mmapped_held"] >= 64 << 20
  assert default["arena_after_free"] < 64 << 20
  # Kept: no mmapped chunk; the heap still holds the 64 MiB after the free.
  assert kept["mmapped_held"] < 1 << 20
  assert kept["arena_after_free"] >= 64 << 20
