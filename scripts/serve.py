"""Serves a model over an OpenAI-compatible HTTP API (FastAPI + uvicorn).

  python scripts/serve.py                          # SmolLM2 on 127.0.0.1:8000
  python scripts/serve.py --port=8001 --max_waiting=128 --engine=cpu_small

Endpoints: /v1/completions, /v1/chat/completions (stream true/false),
/v1/models, /health, /metrics. See serving/server.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import uvicorn
from absl import app, flags

from serving import launch
from serving.server import OpenAIServer

FLAGS = flags.FLAGS
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_string("served_model_name", None, "Model name in the API (default: --model).")
flags.DEFINE_integer("max_waiting", 64, "Requests that may wait for an engine slot; "
                     "past that a request gets HTTP 429.")
flags.DEFINE_bool("warmup", True, "Compile every token bucket before listening.")
launch.define_engine_flags()


def main(argv):
  del argv
  engine, _, tokenizer = launch.build_engine()
  if FLAGS.warmup:
    launch.warmup(engine)
  server = OpenAIServer(engine, tokenizer, FLAGS.served_model_name or FLAGS.model,
                        max_waiting=FLAGS.max_waiting)
  print(f"serving {server.model_name!r} on http://{FLAGS.host}:{FLAGS.port}/v1", flush=True)
  uvicorn.run(server.app, host=FLAGS.host, port=FLAGS.port, log_level="warning")


if __name__ == "__main__":
  app.run(launch.exit_on_bad_input(main))
