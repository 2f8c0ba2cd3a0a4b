"""Greedy tokens of a few short prompts per attention implementation; JSON.

  python scripts/greedy_tokens.py --impls=auto,pallas_tpu --out=/tmp/tokens.json
  python scripts/greedy_tokens.py --impls=pallas --compare=/tmp/cpu_tokens.json

Runs the same prompts (greedy, ``--max_tokens`` each, all requests in one
engine so prefill chunks and decode rows share iterations) once per
``--impls`` entry and writes ``{"meta", "tokens": {impl: [[ids...], ...]},
"match"}``. ``match`` compares every impl with the first one, and with
``--compare`` (an earlier output, e.g. the CPU run's) every impl with that
file's first impl. Exits 1 when any comparison differs.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags
import jax

from serving import cli
from serving.cli import launch
from serving.engine.config import SamplingParams
from serving.engine.engine import Engine

FLAGS = flags.FLAGS
flags.DEFINE_list("impls", ["auto", "pallas_tpu"], "attention_impl values to run.")
flags.DEFINE_list("prompts", ["The capital of France is",
                              "def fibonacci(n):",
                              "Continuous batching schedules LLM inference"],
                  "Raw text prompts (no chat template).")
flags.DEFINE_integer("max_tokens", 8, "Greedy tokens per prompt.")
flags.DEFINE_string("out", "/tmp/greedy_tokens.json", "JSON path.")
flags.DEFINE_string("compare", None, "An earlier output to compare against.")
launch.define_engine_flags()


def main(argv):
  del argv
  if not FLAGS.impls:
    raise ValueError("--impls must name at least one attention_impl")
  engine_cfg = launch.engine_config()
  cfg, params, tokenizer = launch.load_flags_model(engine_cfg)
  prompts = [tokenizer.encode(p) for p in FLAGS.prompts]
  sampling = SamplingParams(max_tokens=FLAGS.max_tokens, ignore_eos=True)
  tokens, seconds = {}, {}
  for impl in FLAGS.impls:
    t = time.perf_counter()
    engine = Engine(cfg, params, launch.engine_config(attention_impl=impl))
    tokens[impl] = [r.output_token_ids for r in engine.generate(prompts, sampling)]
    seconds[impl] = round(time.perf_counter() - t, 1)
    print(f"{impl}: {seconds[impl]} s (compile included)", flush=True)
    for text, ids in zip(FLAGS.prompts, tokens[impl]):
      print(f"  {text!r} -> {tokenizer.decode(ids)!r}")
  first = FLAGS.impls[0]
  match = {f"{impl}=={first}": tokens[impl] == tokens[first] for impl in FLAGS.impls[1:]}
  if FLAGS.compare:
    with open(FLAGS.compare) as f:
      other = json.load(f)
    base = other["meta"]["impls"][0]
    if other["meta"]["prompts"] != FLAGS.prompts or other["meta"]["max_tokens"] != FLAGS.max_tokens:
      raise ValueError(f"--compare={FLAGS.compare}: prompts or max_tokens differ from this run")
    for impl in FLAGS.impls:
      match[f"{impl}=={other['meta']['backend']}:{base}"] = tokens[impl] == other["tokens"][base]
  meta = {"model": FLAGS.model, "engine": FLAGS.engine, "dtype": engine_cfg.dtype,
          "backend": jax.default_backend(), "device": str(jax.devices()[0]),
          "impls": FLAGS.impls, "prompts": FLAGS.prompts, "max_tokens": FLAGS.max_tokens,
          "seconds": seconds, "jax": jax.__version__}
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump({"meta": meta, "tokens": tokens, "match": match}, f, indent=1)
  print(f"match: {match}\nwrote {FLAGS.out}")
  if not all(match.values()):
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
