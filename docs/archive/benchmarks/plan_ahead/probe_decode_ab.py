"""Steady-decode iteration time, planning ahead against planning at launch.

  PYTHONPATH=. .venv/bin/python docs/archive/benchmarks/plan_ahead/probe_decode_ab.py \\
      MODEL_DIR N OUT.json

N requests of 256 random prompt tokens (200 outputs each, ignore_eos) on the
``cpu_default`` preset; after 40 iterations (every prompt done at N <= 32)
the next 150 iterations are timed, the two settings alternated 3 times each
in one process, engines built afresh (programs compiled once, before).
"""

import json
import os
import sys
import time

import numpy as np

from models import llama
from models.loaders import load_model
from serving.engine import host_cpu
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine


def main(model_dir, n, out):
  load_at_start = list(os.getloadavg())
  cfg, params, _ = load_model(model_dir, cache_dir=".cache/iterserve/weights")
  params = llama.split_layers(params)
  config = EngineConfig.preset("cpu_default", max_num_seqs=32, max_request_slots=128)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(5, min(4000, cfg.vocab_size), 256).tolist() for _ in range(n)]

  def run(ahead):
    engine = Engine(cfg, params, config)
    engine.plan_ahead.enabled = ahead
    for i, p in enumerate(prompts):
      engine.add_request(f"r{i}", p, SamplingParams(max_tokens=200, ignore_eos=True))
    while engine.num_iterations < 40:
      engine.step()
    start, fetches, t = engine.num_iterations, engine.host_fetches, time.perf_counter()
    while engine.num_iterations < start + 150:
      engine.step()
    return {"ms_per_iteration": (time.perf_counter() - t) / 150 * 1e3,
            "round_trips_per_iteration": (engine.host_fetches - fetches) / 150}

  run(True), run(False)                   # compile both paths' programs
  rows = {"plan_ahead": [], "plan_at_launch": []}
  for ahead in (True, False) * 3:
    rows["plan_ahead" if ahead else "plan_at_launch"].append(run(ahead))
  result = {"model": model_dir, "requests": n, "host_cpu": host_cpu.host_cpu(),
            "load_average_at_start": load_at_start, "load_average_end": list(os.getloadavg()),
            **rows}
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result))


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
