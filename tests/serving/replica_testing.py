"""A replica server process on the tiny model, for the router tests.

  python -m tests.serving.replica_testing --port=8001 [--step_delay_ms=20] [--cache_dir=D]

Serves ``serving.http.server.OpenAIServer`` over the tiny random model (the
``params`` fixture's weights, so its greedy tokens equal an in-process
engine's) and the tiny tokenizer, as model "tiny". ``--step_delay_ms`` sleeps
before each engine step, so that requests stay in flight long enough for a
test to kill the process mid-run. ``--cache_dir`` keeps XLA's compiled
programs there, so that a replica restarted on the same directory compiles
nothing.
"""

import argparse
import time

import jax
import uvicorn

from models import llama
from serving.cli import launch
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.http.server import OpenAIServer
from tests.serving.engine_testing import CFG, tiny_tokenizer


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--step_delay_ms", type=float, default=0.0)
  parser.add_argument("--cache_dir", default=None)
  args = parser.parse_args()
  if args.cache_dir:
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  params = llama.init_params(CFG, jax.random.PRNGKey(1), layer_scale=8)
  engine = Engine(CFG, params, EngineConfig.preset("tiny"))
  launch.warmup(engine)
  if args.step_delay_ms > 0:
    step = engine.step

    def slow_step():
      time.sleep(args.step_delay_ms / 1e3)
      return step()

    engine.step = slow_step
  server = OpenAIServer(engine, tiny_tokenizer(), "tiny", max_waiting=16)
  uvicorn.run(server.app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
  main()
