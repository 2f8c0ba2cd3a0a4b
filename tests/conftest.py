"""Test-run setup: one XLA persistent compilation cache per test run.

The engine tests compile the same small programs (equal model and engine
configs) in every process; with ``pytest -n 2`` each xdist worker would
compile them again. The controlling process makes a fresh temporary cache
directory, the workers inherit it through the environment, so a program
compiled by one worker is read from the cache by the other; the directory
is removed when the run ends (nothing is written into the repository, and
a later run starts cold, so no test depends on an earlier run).
"""

import os
import shutil
import tempfile

import jax

_ENV = "ITERSERVE_TEST_XLA_CACHE"


def pytest_configure(config):
  # Launchers started by tests choose "auto" kernels by rule, not by a
  # timing (``serving.engine.autotune``); tests of the measurement say so.
  os.environ.setdefault("ITERSERVE_AUTOTUNE_BUDGET_S", "0")
  if _ENV not in os.environ:           # the controlling (or only) process
    os.environ[_ENV] = tempfile.mkdtemp(prefix="iterserve-xla-")
    config._iterserve_xla_cache = os.environ[_ENV]
  jax.config.update("jax_compilation_cache_dir", os.environ[_ENV])
  # Only programs that take a second to compile are written: they are the
  # ones worth sharing, and each write serializes an executable (XLA:CPU's
  # serialization has crashed a worker twice in this suite, at random, in
  # ``put_executable_and_time``; fewer writes, fewer chances).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  made = getattr(config, "_iterserve_xla_cache", None)
  if made:
    shutil.rmtree(made, ignore_errors=True)
    os.environ.pop(_ENV, None)


# tests/ray imports Ray, whose native extension would share each test worker
# with jaxlib (workers that loaded it crashed at random in XLA compiles): it
# is collected only in the pytest process tests/serving/test_ray_subprocess.py
# starts with ITERSERVE_RAY_TESTS=1.
collect_ignore_glob = [] if os.environ.get("ITERSERVE_RAY_TESTS") else ["ray/*"]

