"""This machine's CPU as ``/proc/cpuinfo`` names it: its model name and
feature flags, read in one place for the autotuner's machine key
(``autotune.fingerprint``), a calibration's device fingerprint
(``calibrations.device_fingerprint``) and a benchmark's record of its host
(``scripts/bench_engine.py``)."""

from __future__ import annotations

import os
import platform
from typing import List, Optional, Tuple

from attention import native_build

# The vector/matrix extensions that decide XLA:CPU's GEMM kernels (and so
# their speed and their rows' bit classes), in the order reports list them.
EXTENSIONS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile",
              "amx_int8")


def read_cpuinfo(path: str = "/proc/cpuinfo") -> Tuple[Optional[str], List[str]]:
  """``(model name, flags)`` of the first processor ``path`` lists: the
  first ``model name`` line's value (None where there is none) and the
  first ``flags`` line's words in their order ([] where there is none);
  ``(None, [])`` where the file cannot be read (not Linux)."""
  model, flags = None, None
  try:
    with open(path) as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
          model = value.strip()
        elif key == "flags" and flags is None:
          flags = value.split()
        if model is not None and flags is not None:
          break
  except OSError:
    pass
  return model, flags or []


def host_cpu() -> dict:
  """The CPU a run measured: ``model`` (the model name, else Python's
  processor or machine name), ``cores`` (logical CPUs), ``extensions``
  (those of ``EXTENSIONS`` its flags hold, in that order) and ``max_isa``
  (XLA's instruction-set cap from ``XLA_FLAGS``, which caps the native
  kernels too: ``attention.native_build.max_isa``; None where none is set)."""
  model, flags = read_cpuinfo()
  seen = set(flags)
  return {"model": model if model is not None else platform.processor() or platform.machine(),
          "cores": os.cpu_count(), "extensions": [e for e in EXTENSIONS if e in seen],
          "max_isa": native_build.max_isa()}
