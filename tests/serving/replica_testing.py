"""A replica server process on the tiny model, for the router tests.

  python -m tests.serving.replica_testing --port=8001 [--step_delay_ms=20] [--cache_dir=D]
      [--fail_at_step=N]

Serves ``serving.http.server.OpenAIServer`` over the tiny random model (the
``params`` fixture's weights, so its greedy tokens equal an in-process
engine's) and the tiny tokenizer, as model "tiny". ``--step_delay_ms`` sleeps
before each engine step, so that requests stay in flight long enough for a
test to kill the process mid-run; ``--fail_at_step`` makes the N-th step
raise (the server fails its requests and exits 1). ``--cache_dir`` keeps XLA's compiled
programs there, so that a replica restarted on the same directory compiles
nothing.
"""

import argparse
import subprocess
import sys
import time

import jax

from models import llama
from serving.cli import launch
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.http.server import OpenAIServer, bind_socket
from tests.serving.engine_testing import CFG, tiny_tokenizer


def spawn_replica(argv, port: int, cwd=None) -> subprocess.Popen:
  """Starts ``argv --port=port`` (a replica server for a ``--replica_urls``
  front); the test stops it."""
  return subprocess.Popen([*argv, f"--port={port}"], cwd=cwd)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--step_delay_ms", type=float, default=0.0)
  parser.add_argument("--cache_dir", default=None)
  parser.add_argument("--fail_at_step", type=int, default=0)
  args = parser.parse_args()
  if args.cache_dir:
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  params = llama.init_params(CFG, jax.random.PRNGKey(1), layer_scale=8)
  engine = Engine(CFG, params, EngineConfig.preset("tiny"))
  launch.warmup(engine)
  step, calls = engine.step, [0]

  def test_step():
    calls[0] += 1
    if calls[0] == args.fail_at_step:
      raise RuntimeError(f"injected fault at step {calls[0]}")
    time.sleep(args.step_delay_ms / 1e3)
    return step()

  engine.step = test_step
  server = OpenAIServer(engine, tiny_tokenizer(), "tiny", max_waiting=16,
                        trust_front_headers=True)
  sys.exit(server.serve(bind_socket("127.0.0.1", args.port)))


if __name__ == "__main__":
  main()
