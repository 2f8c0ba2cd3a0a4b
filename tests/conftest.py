"""Test-run setup.

One persistent XLA compilation cache per test run, shared by the xdist
workers: a temporary directory the first process creates
(``ITERSERVE_TEST_XLA_CACHE``, inherited by the workers) and removes at the
end. Files compile the same tiny engines' programs again and again (the
same policies, buckets and model); loading one costs a fraction of
compiling it, which took the suite from 22.4 to 17.3 minutes on a 2-core
Xeon (AVX-512, AMX). Every program is stored (no minimum compile time). A run starts cold,
so no test depends on an earlier run's programs.

Each compiled XLA:CPU program holds about 17 memory mappings until it is
freed, and a test worker compiles thousands of programs. One worker held
64,486 mappings at 85% of a run and died in its next compile: at the
kernel's limit (``vm.max_map_count``, 65,530 by default) ``mmap`` fails and
XLA aborts or segfaults (CI lost a worker in both runs of one submission).
When a worker is above ``_MAX_MAPS`` at the end of a test file, JAX's
caches and the engine's program caches are cleared, so unreferenced
executables unmap (no file adds more than about 20,000). Only between
files: an engine a module fixture holds counts its compiles, and tests
assert those counts. Earlier crashes in compiles and in cache reads,
blamed on the persistent cache and on Ray's extension, came late in runs
too and were most likely the same limit.

Launchers started by tests choose "auto" kernels by rule, not by a timing
(``serving.engine.autotune``; the tests of the measurement say so).
"""

import gc
import os
import shutil
import tempfile

import jax

_MAX_MAPS = 20_000
_CACHE_ENV = "ITERSERVE_TEST_XLA_CACHE"


def _num_maps():
  with open("/proc/self/maps", "rb") as f:
    return sum(1 for _ in f)


_OWN_CACHE = []      # the directory this process made (and removes)


def pytest_configure(config):
  del config
  os.environ.setdefault("ITERSERVE_AUTOTUNE_BUDGET_S", "0")
  if not os.environ.get(_CACHE_ENV):
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="iterserve-test-xla-")
    _OWN_CACHE.append(os.environ[_CACHE_ENV])
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  del config
  for path in _OWN_CACHE:
    shutil.rmtree(path, ignore_errors=True)


def pytest_runtest_teardown(item, nextitem):
  if nextitem is not None and nextitem.path == item.path:
    return
  if os.path.exists("/proc/self/maps") and _num_maps() > _MAX_MAPS:
    from serving.engine import programs, sim_loop
    programs.programs.cache_clear()
    programs._executor.cache_clear()
    sim_loop.loop_program.cache_clear()
    jax.clear_caches()
    gc.collect()


# tests/ray imports Ray, whose native extension would share each test worker
# with jaxlib (workers that loaded it crashed at random in XLA compiles): it
# is collected only in the pytest process tests/serving/test_ray_subprocess.py
# starts with ITERSERVE_RAY_TESTS=1.
collect_ignore_glob = [] if os.environ.get("ITERSERVE_RAY_TESTS") else ["ray/*"]
