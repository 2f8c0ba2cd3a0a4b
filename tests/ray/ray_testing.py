"""Engine actors on the tiny model, for the Ray runtime's tests.

``TinyEngine`` is the picklable builder an ``EngineActor`` calls in its own
worker process: the tiny random model (the ``params`` fixture's weights, so
its greedy tokens equal an in-process engine's), the "tiny" engine preset,
an optional role, and an optional sleep before each step (so that requests
stay in flight long enough for a test to kill or abort them).
``ray_session`` starts a small local Ray and always shuts it down.
"""

import contextlib
import dataclasses
import os
import time

import jax

from models import llama
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from tests.serving.engine_testing import CFG

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_params():
  return llama.init_params(CFG, jax.random.PRNGKey(1), layer_scale=8)


def tiny_config(**overrides) -> EngineConfig:
  return dataclasses.replace(EngineConfig.preset("tiny"), **overrides)


class TinyEngine:
  """Builds the tiny engine (``overrides`` of the tiny preset, e.g. role)
  with ``step_delay_ms`` slept before each step."""

  def __init__(self, step_delay_ms: float = 0.0, **overrides):
    self.step_delay_ms, self.overrides = step_delay_ms, overrides

  def __call__(self) -> Engine:
    cache = os.path.join(ROOT, ".cache", "ray_tests_xla")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    engine = Engine(CFG, tiny_params(), tiny_config(**self.overrides))
    if self.step_delay_ms:
      step = engine.step

      def slow_step():
        time.sleep(self.step_delay_ms / 1e3)
        return step()

      engine.step = slow_step
    return engine


@contextlib.contextmanager
def ray_session(num_cpus: int = 2):
  """A local Ray for one test module (workers see this checkout first)."""
  import ray

  path = os.environ.get("PYTHONPATH", "")
  env = {"PYTHONPATH": ROOT + (os.pathsep + path if path else ""), "JAX_PLATFORMS": "cpu"}
  for attempt in range(2):        # a loaded machine can miss Ray's startup deadline once
    try:
      ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
               runtime_env={"env_vars": env})
      break
    except Exception:             # noqa: BLE001 - retried once, then raised
      ray.shutdown()
      if attempt:
        raise
  try:
    yield ray
  finally:
    ray.shutdown()
