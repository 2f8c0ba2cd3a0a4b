"""Test-run setup.

No persistent XLA compilation cache in the test processes: two runs in a row
lost a worker to a segfault reading a cached executable that another worker
had written (``compilation_cache.get_executable_and_time``, the Pallas
interpret-mode path of ``test_engine_paths.py``, whose programs call back
into Python), and one to an abort while writing one. Each worker compiles
what its files need instead.

Launchers started by tests choose "auto" kernels by rule, not by a timing
(``serving.engine.autotune``; the tests of the measurement say so).
"""

import os

import jax


def pytest_configure(config):
  del config
  os.environ.setdefault("ITERSERVE_AUTOTUNE_BUDGET_S", "0")
  jax.config.update("jax_enable_compilation_cache", False)


# tests/ray imports Ray, whose native extension would share each test worker
# with jaxlib (workers that loaded it crashed at random in XLA compiles): it
# is collected only in the pytest process tests/serving/test_ray_subprocess.py
# starts with ITERSERVE_RAY_TESTS=1.
collect_ignore_glob = [] if os.environ.get("ITERSERVE_RAY_TESTS") else ["ray/*"]
