"""Host planning time against the number of waiting requests.

  python scripts/bench_planning.py --waiting=1024,4096   # every registered policy

Every accepted request holds a slot of the scheduler's table, so a policy's
plan reads all of them: this times one ``plan`` program (tick, policy, plan
validation, device-synchronised) on a tiny-model engine whose slot table
holds exactly ``N`` waiting requests (8-token prompts, one client per 16
requests), after one warm-up (compile) call. Writes a JSON of per-policy,
per-size median / min planning milliseconds, the load average before and
after, and whether each median is within ``LIMITS_MS`` (the planning cost
target: linear in the queue).
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from absl import flags

from models import llama
from models.config import get_config
from scheduler.registry import POLICIES
from serving import cli
from serving.harness import metrics
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine

FLAGS = flags.FLAGS
flags.DEFINE_list("waiting", ["1024", "4096"], "Waiting-queue sizes.")
flags.DEFINE_list("policies", sorted(POLICIES), "Registered policy names.")
flags.DEFINE_integer("repeats", 20, "Timed plan calls per (policy, size).")
flags.DEFINE_string("out", "runs/bench_planning.json", "Result JSON path.")

# Median plan milliseconds allowed at a queue size (2-core CPU host).
LIMITS_MS = {1024: 2.0, 4096: 8.0}


def time_plan(model_cfg, params, policy: str, num_waiting: int):
  """(compile_s, [plan_ms] * repeats) for ``num_waiting`` waiting requests."""
  config = EngineConfig.preset("tiny", policy=policy, max_request_slots=num_waiting,
                               max_queued_requests=num_waiting,
                               num_clients=max(4, num_waiting // 16))
  engine = Engine(model_cfg, params, config)
  sampling = SamplingParams(max_tokens=4, ignore_eos=True)
  for i in range(num_waiting):
    engine.add_request(f"r{i}", [3 + (i + j) % 200 for j in range(8)], sampling,
                       priority=i % 3, client=f"c{i // 16}")
  engine._fill_slots()        # every request into its slot, as a step begins
  no_stamp = engine.clocks.no_stamp(engine.num_slots, engine._placement)
  run = lambda: jax.block_until_ready(engine._programs.plan(   # tick, plan, checks
      engine.manifest, engine.state, engine.pages, engine._prefix_hits(), np.float32(0),
      no_stamp, np.float32(0), np.float32(0)))
  t = time.perf_counter()
  run()
  compile_s = time.perf_counter() - t
  times = []
  for _ in range(FLAGS.repeats):
    t = time.perf_counter()
    run()
    times.append((time.perf_counter() - t) * 1e3)
  return compile_s, times


def main(argv):
  del argv
  unknown = [p for p in FLAGS.policies if p not in POLICIES]
  if unknown:
    raise ValueError(f"--policies must name policies in {sorted(POLICIES)}, got {unknown}")
  model_cfg = get_config("tiny")
  params = llama.init_params(model_cfg, jax.random.PRNGKey(0))
  out = {"argv": sys.argv[1:], "load_average": os.getloadavg(),
         "device": str(jax.devices()[0]), "results": []}
  for policy in FLAGS.policies:
    for n in map(int, FLAGS.waiting):
      compile_s, times = time_plan(model_cfg, params, policy, n)
      median = statistics.median(times)
      row = dict(policy=policy, waiting=n, compile_s=compile_s,
                 plan_ms_median=median, plan_ms_min=min(times),
                 plan_us_per_request=median * 1e3 / n,
                 limit_ms=LIMITS_MS.get(n),
                 within_limit=None if n not in LIMITS_MS else median <= LIMITS_MS[n])
      out["results"].append(row)
      out["load_average_after"] = os.getloadavg()
      print(row, flush=True)
      metrics.write_report(FLAGS.out, out)


if __name__ == "__main__":
  cli.run(main)
