"""Test-run setup.

No persistent XLA compilation cache in the test processes. It once let the
two xdist workers share compiled programs, but writing an entry serializes
an executable, and XLA:CPU's serialization has aborted a worker at random
(``compilation_cache.put_executable_and_time``; three times in this suite);
under ``--dist loadfile`` a lost worker can leave the run waiting forever
(xdist's scheduler hands the replacement worker nothing). Each worker
compiles what its files need instead. Launchers that tests start in
subprocesses mostly run with ``--cache_dir=`` (no cache either).

Launchers started by tests choose "auto" kernels by rule, not by a timing
(``serving.engine.autotune``; the tests of the measurement say so).
"""

import os

import jax


def pytest_configure(config):
  del config
  os.environ.setdefault("ITERSERVE_AUTOTUNE_BUDGET_S", "0")
  jax.config.update("jax_enable_compilation_cache", False)
