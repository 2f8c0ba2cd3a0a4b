"""Test-run setup.

No persistent XLA compilation cache in the test processes: each worker
compiles what its files need.

Each compiled XLA:CPU program holds about 17 memory mappings until it is
freed, and a test worker compiles thousands of programs. One worker held
64,486 mappings at 85% of a run and died in its next compile: at the
kernel's limit (``vm.max_map_count``, 65,530 by default) ``mmap`` fails and
XLA aborts or segfaults (CI lost a worker in both runs of one submission).
After a test that leaves a worker above ``_MAX_MAPS``, JAX's caches are
cleared so unreferenced executables unmap. Earlier crashes in compiles and
in cache reads, blamed on the persistent cache and on Ray's
extension, came late in runs too and were most likely the same limit.

Launchers started by tests choose "auto" kernels by rule, not by a timing
(``serving.engine.autotune``; the tests of the measurement say so).
"""

import gc
import os

import jax

_MAX_MAPS = 24_000
_clear_above = [_MAX_MAPS]


def _num_maps():
  with open("/proc/self/maps", "rb") as f:
    return sum(1 for _ in f)


def pytest_configure(config):
  del config
  os.environ.setdefault("ITERSERVE_AUTOTUNE_BUDGET_S", "0")
  jax.config.update("jax_enable_compilation_cache", False)


def pytest_runtest_teardown(item, nextitem):
  del item, nextitem
  if os.path.exists("/proc/self/maps") and _num_maps() > _clear_above[0]:
    jax.clear_caches()
    gc.collect()
    # Programs a live fixture still holds stay mapped: clear again only
    # after another _MAX_MAPS // 2 mappings, not after every test.
    _clear_above[0] = max(_MAX_MAPS, _num_maps() + _MAX_MAPS // 2)


# tests/ray imports Ray, whose native extension would share each test worker
# with jaxlib (workers that loaded it crashed at random in XLA compiles): it
# is collected only in the pytest process tests/serving/test_ray_subprocess.py
# starts with ITERSERVE_RAY_TESTS=1.
collect_ignore_glob = [] if os.environ.get("ITERSERVE_RAY_TESTS") else ["ray/*"]
