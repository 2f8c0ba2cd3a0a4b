"""Every policy's schedule and tokens on one mixed workload; JSON.

  python scripts/schedule_log.py --out=/tmp/schedules.json
  python scripts/schedule_log.py --out=/tmp/new.json --compare=/tmp/schedules.json

What a change to the engine loop owes: the same plans (the plan log: every
iteration's scheduled intervals, admissions and preemptions by request id)
and the same tokens, for every registered policy (or the ``--policies``
given, your own as ``path/to/file.py:Class`` too). The workload is built to
reach the loop's rare paths on the tiny random-weight model (float32,
``layer_scale`` 8): 14 requests in three waves (added once 0, 6 and 14
iterations have run), four sharing a 12-token prefix (prefix hits), three priorities,
three clients, TTFT / TPOT SLOs, a KV cache of ``--num_pages`` pages (KV
pressure: preemption and prefix-cache eviction), recompute and swap
preemption. The engine runs on a ``VirtualClock`` (each step charged the
cost model's time), so every run of a commit repeats bit for bit. Each
policy runs twice, with and without the plan log: the tokens must not
depend on it.

Writes ``{"meta", "runs": {"POLICY/MODE": {"plan_log", "tokens",
"tokens_without_log", "outcomes", "preemptions", "prefix_hits",
"evictions", "iterations"}}}``; ``--compare`` reports every run whose
plan log, tokens or outcomes differ from an earlier file's and exits 1 if
any does.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from absl import flags

from models import llama
from models.config import get_config
from scheduler import policies
from scheduler.registry import POLICIES
from serving import cli
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.engine.sim_executor import VirtualClock

FLAGS = flags.FLAGS
flags.DEFINE_list("policies", sorted(POLICIES), "Policies to run: registered names, or "
                  "your own as module:Class or path/to/file.py:Class.")
flags.DEFINE_list("modes", ["recompute", "swap"], "Preemption modes to run.")
flags.DEFINE_integer("num_pages", 24, "KV pages (4 rows each; one is the null page).")
flags.DEFINE_string("out", "/tmp/schedule_log.json", "JSON path.")
flags.DEFINE_string("compare", None, "An earlier output to compare against.")

WAVES = (0, 6, 14)        # iterations run before each wave is added


def workload():
  """[(wave, request_id, prompt, SamplingParams, add_request keywords)]."""
  cfg = get_config("tiny")
  rng = np.random.default_rng(7)
  ids = lambda n: rng.integers(3, cfg.vocab_size, size=n).tolist()
  shared = ids(12)
  out = []
  lengths = [3, 25, 7, 16, 2, 11, 30, 9, 14, 5]
  for i, n in enumerate(lengths + [4, 6, 8, 10]):
    prompt = shared + ids(n) if i >= len(lengths) else ids(n)
    wave = i % len(WAVES)
    sampling = SamplingParams(max_tokens=4 + (i * 5) % 9, ignore_eos=True)
    kw = dict(priority=i % 3, client=f"c{i % 3}",
              slo_ttft_ms=200.0 + 50 * i if i % 2 else None,
              slo_tpot_ms=40.0 if i % 4 == 1 else None)
    out.append((wave, f"r{i}", prompt, sampling, kw))
  return out


def run(params, policy: str, mode: str, log: bool) -> dict:
  config = EngineConfig.preset("tiny", min_bucket=8, policy=policy,
                               num_pages=FLAGS.num_pages, preemption_mode=mode)
  engine = Engine(get_config("tiny"), params, config, clock=VirtualClock())
  engine.record_plans = log
  requests, work = {}, workload()
  calls = 0
  while len(requests) < len(work) or engine.has_unfinished():
    for wave, request_id, prompt, sampling, kw in work:
      if WAVES[wave] <= engine.num_iterations and request_id not in requests:
        requests[request_id] = engine.add_request(request_id, prompt, sampling, **kw)
    engine.step()
    calls += 1
    if calls > 5000:
      raise RuntimeError(f"{policy}/{mode}: no end after 5000 calls")
  return dict(
      plan_log=[{k: v for k, v in p.items() if k != "decision_id"} for p in engine.plan_log],
      tokens={k: r.output_token_ids for k, r in requests.items()},
      outcomes={k: [r.outcome, r.finish_reason] for k, r in requests.items()},
      preemptions=engine.num_preemptions,
      prefix_hits={k: r.prefix_hit_tokens for k, r in requests.items()},
      evictions=engine.prefix_cache.evictions, iterations=engine.num_iterations)


def main(argv):
  del argv
  policies.check_policy_flag("--policies", FLAGS.policies)
  params = llama.init_params(get_config("tiny"), jax.random.PRNGKey(1), layer_scale=8)
  runs = {}
  for policy in FLAGS.policies:
    for mode in FLAGS.modes:
      logged = run(params, policy, mode, log=True)
      logged["tokens_without_log"] = run(params, policy, mode, log=False)["tokens"]
      runs[f"{policy}/{mode}"] = logged
      print(f"{policy}/{mode}: {logged['iterations']} iterations, "
            f"{logged['preemptions']} preemptions, {logged['evictions']} evictions, "
            f"{sum(v > 0 for v in logged['prefix_hits'].values())} prefix hits", flush=True)
  # As JSON reads it back (tuples become lists), so that runs compare equal
  # to an earlier file's.
  runs = json.loads(json.dumps(runs))
  out = {"meta": {"argv": sys.argv[1:], "jax": jax.__version__}, "runs": runs}
  with open(FLAGS.out, "w") as f:
    json.dump(out, f, indent=1)
  bad = [k for k, r in runs.items() if r["tokens"] != r["tokens_without_log"]]
  if FLAGS.compare:
    with open(FLAGS.compare) as f:
      old = json.load(f)["runs"]
    for key, r in runs.items():
      if key not in old:
        continue
      for field in ("plan_log", "tokens", "outcomes", "preemptions", "prefix_hits"):
        if r[field] != old[key][field]:
          bad.append(f"{key}: {field}")
    print(f"compared {len(set(runs) & set(old))} runs with {FLAGS.compare}")
  print("differ: " + (", ".join(bad) if bad else "none"))
  return 1 if bad else 0


if __name__ == "__main__":
  cli.run(main)
