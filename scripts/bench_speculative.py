"""Speculative decoding against none on a prompt-copying workload, in one run.

  python scripts/bench_speculative.py --model=smollm2-135m --concurrency=1,8 \
      --speculative=,ngram:k=4,n=3 --out=runs/bench_speculative.json

(on an idle machine: a 1-minute load average above ``--max_load`` at the
start writes ``"refused": reason`` instead of timings, and exits 2).

For each setting in ``--speculative`` ('' = off; the settings are comma
separated, an item KEY=VALUE continuing the one before it) one engine is
built and warmed up (every token bucket compiled, ``launch.warmup``); for
each concurrency c in ``--concurrency`` it then runs ``--num_requests``
greedy requests (EOS honoured, at most ``--max_tokens`` tokens) in a closed
loop of c live requests (``serving.harness.closed_loop``). Each asks the
model to repeat a passage of ``--passage_words`` words cut from the MT-Bench
questions in ``--prompts`` word for word, its answer begun with the
passage's first ``--prime_words`` words. Per (setting, c): output tokens/s
(wall), mean TPOT, iterations, the acceptance rate and the spec-decode
counts of that run (``Engine.spec_counts``), the XLA compiles during it
(none expected after warm-up) and whether every request's tokens equal
those of the same request without speculation. The JSON also holds the
command line, the host CPU, jax's version and the load average at start
and end; a short table is printed.
"""

import dataclasses
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
from absl import flags

from serving import cli
from serving.cli import launch
from serving.engine import autotune, host_cpu
from serving.engine.config import SamplingParams
from serving.engine.engine import Engine
from serving.engine.speculative import Speculation
from serving.harness import closed_loop, metrics

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "runs/bench_speculative.json", "Result JSON path.")
flags.DEFINE_string("prompts", str(Path(__file__).resolve().parents[2] / "shared/data/"
                                   "prompts/mt_bench_questions.jsonl"),
                    "MT-Bench question JSONL whose first turns the passages are cut from "
                    "(read at run time).")
flags.DEFINE_list("concurrency", ["1", "8"], "Requests live at a time (a run each).")
flags.DEFINE_integer("num_requests", 8, "Requests per concurrency level.")
flags.DEFINE_integer("max_tokens", 128, "Output tokens per request at most.")
flags.DEFINE_integer("passage_words", 96, "Words of each passage to repeat.")
flags.DEFINE_integer("prime_words", 4, "The answer begins with the passage's first N words "
                     "(in the prompt; 0: none): SmolLM2-135M otherwise tends to answer the "
                     "question the passage asks instead of repeating it.")
flags.DEFINE_float("max_load", 1.5, "Refuse (no timings) when the 1-minute load average "
                   "at the start is above this.")
launch.define_engine_flags()
delattr(FLAGS, "speculative")    # the engine flags' single setting: here a list of them
flags.DEFINE_string("speculative", ",ngram:k=4,n=3", "Settings compared, comma separated: "
                    "'' (off, needed: the reference of the tokens), ngram:k=K,n=N or "
                    "draft:MODEL,k=K.")

_COMPILES = cli.compile_counter()     # XLA backend compiles seen by this process


def speculative_settings(text: str) -> list:
  """``--speculative``'s settings: ``",ngram:k=4,n=3"`` -> ``["", "ngram:k=4,n=3"]``.

  Raises:
    ValueError: naming --speculative: a setting ``Speculation.parse``
      refuses, one given twice, or no '' (off) among them.
  """
  settings = []
  for item in text.split(","):
    if settings and settings[-1] and "=" in item and ":" not in item:
      settings[-1] += "," + item
    else:
      settings.append(item)
  seen = [str(Speculation.parse(s, "--speculative") or "") for s in settings]
  if len(set(seen)) < len(seen):
    raise ValueError(f"--speculative names a setting twice, got {text!r}")
  if "" not in seen:
    raise ValueError(f"--speculative must include '' (off: every setting's tokens are "
                     f"compared with it), e.g. ',{text}', got {text!r}")
  return settings


def _check_flags():
  """The flags' values before the load check and before any model loads.
  Returns (settings, concurrency levels).

  Raises:
    ValueError: naming the flag and its rule.
  """
  settings = speculative_settings(FLAGS.speculative)
  if not FLAGS.concurrency or not all(c.isdigit() and int(c) >= 1 for c in FLAGS.concurrency):
    raise ValueError(f"--concurrency must be integers >= 1, got "
                     f"{','.join(FLAGS.concurrency)!r}")
  for name in ("num_requests", "max_tokens", "passage_words"):
    if FLAGS[name].value < 1:
      raise ValueError(f"--{name} must be >= 1, got {FLAGS[name].value}")
  if not 0 <= FLAGS.prime_words < FLAGS.passage_words:
    raise ValueError(f"--prime_words must be in [0, --passage_words), got {FLAGS.prime_words}")
  if not FLAGS.max_load > 0:
    raise ValueError(f"--max_load must be > 0, got {FLAGS.max_load}")
  if not os.path.isfile(FLAGS.prompts):
    raise ValueError(f"--prompts {FLAGS.prompts!r} is not a file (the MT-Bench questions, "
                     f"../shared/data/prompts/mt_bench_questions.jsonl beside the repository)")
  cli.check_creatable("out", FLAGS.out)
  launch.check_model_spec("--model", FLAGS.model)
  launch.check_cache_dir()
  for s in settings:                     # EngineConfig's rules (k + 1 within the budget)
    try:
      launch.engine_config(speculative=s)
    except ValueError as e:
      raise ValueError(str(e).replace("EngineConfig.speculative", "--speculative")) from None
  return settings, [int(c) for c in FLAGS.concurrency]


def _spec_delta(after: dict, before: dict) -> dict:
  """``SpecCounts.stats()`` of one run: ``after`` less ``before``."""
  out = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens",
                                           "num_accepted_tokens")}
  out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"],
                                                   before["accepted_per_pos"])]
  out["acceptance_rate"] = (out["num_accepted_tokens"] / out["num_draft_tokens"]
                            if out["num_draft_tokens"] else 0.0)
  return out


def measure(engine, prompts, levels, setting):
  """One closed loop per concurrency level on ``engine``. Returns ([row], {c: tokens})."""
  sampling = SamplingParams(max_tokens=FLAGS.max_tokens)
  rows, tokens = [], {}
  for c in levels:
    before, compiles = engine.spec_counts.stats(), _COMPILES.programs
    run = closed_loop.run_closed_loop(engine, prompts, sampling, c, id_prefix=f"c{c}-",
                                      cache_salt=f"c{c}")     # no prefix hits across levels
    spec = _spec_delta(engine.spec_counts.stats(), before)
    rows.append({"speculative": setting, "concurrency": c, "requests": len(prompts),
                 "output_tokens": run.output_tokens, "seconds": run.seconds,
                 "output_tokens_per_s": run.output_tokens / run.seconds,
                 "mean_tpot_ms": run.mean_tpot_ms, "iterations": run.iterations,
                 "acceptance_rate": spec.pop("acceptance_rate"), "spec_decode": spec,
                 "compiles_during_run": _COMPILES.programs - compiles})
    tokens[c] = list(run.output_token_ids.values())
    print(rows[-1], flush=True)
  return rows, tokens


def table(rows) -> str:
  fmt = lambda v, d: "n/a" if v is None else f"{v:.{d}f}"
  lines = [f"{'speculative':<16} {'c':>3} {'tok/s':>8} {'TPOT ms':>8} {'accept':>7} "
           f"{'iters':>6} same"]
  for r in rows:
    lines.append(f"{r['speculative'] or 'off':<16} {r['concurrency']:>3} "
                 f"{fmt(r['output_tokens_per_s'], 1):>8} {fmt(r['mean_tpot_ms'], 1):>8} "
                 f"{fmt(r['acceptance_rate'], 3):>7} {r['iterations']:>6} "
                 f"{r['same_tokens_as_off']}")
  return "\n".join(lines)


def main(argv):
  del argv
  settings, levels = _check_flags()
  out = {"command": shlex.join([sys.executable, *sys.argv]), "jax_version": jax.__version__,
         "host_cpu": host_cpu.host_cpu(), "load_average_start": list(os.getloadavg()),
         "max_load": FLAGS.max_load}
  if out["load_average_start"][0] > FLAGS.max_load:
    out["refused"] = (f"machine busy: 1-minute load average {out['load_average_start'][0]:.2f}"
                      f" > --max_load={FLAGS.max_load} (timings taken beside other jobs "
                      f"are wrong)")
    out["load_average_end"] = list(os.getloadavg())
    metrics.write_report(FLAGS.out, out)
    raise ValueError(f"{out['refused']}; wrote {FLAGS.out}")
  passages = closed_loop.copy_passages(FLAGS.prompts, FLAGS.num_requests, FLAGS.passage_words)
  base = launch.engine_config(speculative="")
  cfg, params, tokenizer = launch.load_flags_model(base)
  if FLAGS.autotune_budget_s > 0 and FLAGS.cache_dir:    # "auto" kernels by measurement
    base = autotune.choose(cfg, base, FLAGS.cache_dir, FLAGS.autotune_budget_s)[0]
  prompts = [closed_loop.copy_prompt_ids(tokenizer, p, FLAGS.prime_words) for p in passages]
  longest = max(map(len, prompts))
  if longest + FLAGS.max_tokens > base.max_model_len:
    raise ValueError(f"--max_tokens={FLAGS.max_tokens} after the longest prompt "
                     f"({longest} tokens) exceeds the engine's max_model_len="
                     f"{base.max_model_len} (lower --passage_words or --max_tokens)")
  out.update(model=FLAGS.model, engine_preset=FLAGS.engine, prompts=FLAGS.prompts,
             num_requests=FLAGS.num_requests, max_tokens=FLAGS.max_tokens,
             passage_words=FLAGS.passage_words,
             prime_words=FLAGS.prime_words, prompt_tokens=[len(p) for p in prompts],
             token_buckets=list(base.token_buckets), device=str(jax.devices()[0]))
  rows, tokens = [], {}
  for setting in settings:
    engine = Engine(cfg, params, dataclasses.replace(base, speculative=setting))
    launch.warmup(engine, num_requests=max(levels))
    got, tokens[setting] = measure(engine, prompts, levels, setting)
    rows += got
    engine.kv = None                     # free the cache before the next engine
  for r in rows:                         # each request's tokens against its own without
    mine, off = tokens[r["speculative"]][r["concurrency"]], tokens[""][r["concurrency"]]
    r["requests_differing"] = [f"c{r['concurrency']}-{i}" for i, (a, b)
                               in enumerate(zip(mine, off)) if a != b]
    r["same_tokens_as_off"] = not r["requests_differing"]
  out["runs"] = rows
  out["load_average_end"] = list(os.getloadavg())
  metrics.write_report(FLAGS.out, out)
  print(table(rows) + f"\nwrote {FLAGS.out}")


if __name__ == "__main__":
  cli.run(main)
