"""The Ray tests (tests/ray), each run in a pytest process of its own, so
that no test worker of the suite loads Ray's native extension beside
jaxlib (see tests/ray/test_ray_replicas.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pytest(*args, timeout=1800):
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
      cwd=ROOT, capture_output=True, text=True, timeout=timeout,
      env=dict(os.environ, ITERSERVE_RAY_TESTS="1"))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
  return proc.stdout


def test_two_engine_actors_serve_the_tokens_of_one_engine():
  """That test, and the front's route records over stand-in actors (no Ray
  started: they share this process at little cost)."""
  out = _pytest("-m", "extended or not extended",
                "tests/ray/test_ray_replicas.py::test_two_engine_actors_serve_the_tokens_of_one_engine",
                "tests/ray/test_ray_front_records.py", timeout=900)
  assert "4 passed" in out


@pytest.mark.extended
def test_every_ray_test():
  out = _pytest("-m", "extended or not extended", "tests/ray")
  assert " passed" in out and "failed" not in out
