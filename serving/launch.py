"""Shared absl flags and builders for the launchers in scripts/."""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from models.loaders import load_model
from serving.config import EngineConfig, SamplingParams
from serving.engine import Engine

FLAGS = flags.FLAGS


def define_engine_flags() -> None:
  """--model, --engine preset, and overrides of its budgets."""
  flags.DEFINE_string("model", "smollm2-135m", "Preset name, *.gguf file or HF directory.")
  flags.DEFINE_string("engine", "cpu_default", "Engine preset in configs/ (or a JSON path).")
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Override the preset's dtype.")
  flags.DEFINE_string("policy", None, "Override the preset's scheduling policy.")
  flags.DEFINE_integer("max_num_seqs", None, "Override: sequence budget per iteration.")
  flags.DEFINE_integer("max_num_batched_tokens", None, "Override: token budget per iteration.")
  flags.DEFINE_integer("long_prefill_token_threshold", None, "Override: prefill chunk cap.")
  flags.DEFINE_string("attention_impl", None, "Override: attention implementation.")
  flags.DEFINE_string("preemption_mode", None, "Override: 'recompute' or 'swap' "
                      "(copy a preempted request's KV pages to host memory and back).")
  flags.DEFINE_float("swap_space_mb", None, "Override: host memory for swapped KV (MiB).")
  flags.DEFINE_integer("force_preempt_every", None, "Override: preempt one decoding "
                       "request every N decisions (0 = off).")
  flags.DEFINE_string("cache_dir", ".cache/iterserve",
                      "Converted-weight cache (orbax) and XLA compilation cache.")


def exit_on_bad_input(main):
  """Wraps an absl main: a ValueError (bad flag, file, model or request)
  prints one line naming the field and rule, and exits with status 2."""

  @functools.wraps(main)
  def guarded(argv):
    try:
      return main(argv)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)

  return guarded


def engine_config(**overrides) -> EngineConfig:
  """The --engine preset with the flags' overrides."""
  return EngineConfig.preset(
      FLAGS.engine, dtype=FLAGS.dtype, policy=FLAGS.policy,
      max_num_seqs=FLAGS.max_num_seqs, max_num_batched_tokens=FLAGS.max_num_batched_tokens,
      long_prefill_token_threshold=FLAGS.long_prefill_token_threshold,
      attention_impl=FLAGS.attention_impl, preemption_mode=FLAGS.preemption_mode,
      swap_space_mb=FLAGS.swap_space_mb, force_preempt_every=FLAGS.force_preempt_every,
      **overrides)


def build_engine(**overrides):
  """Loads the model and builds the Engine. Returns (engine, cfg, tokenizer)."""
  logging.set_verbosity(logging.WARNING)  # checkpoint libraries log per file
  if FLAGS.cache_dir:
    jax.config.update("jax_compilation_cache_dir", f"{FLAGS.cache_dir}/xla")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  engine_cfg = engine_config(**overrides)
  dtype = jnp.bfloat16 if engine_cfg.dtype == "bfloat16" else jnp.float32
  t = time.perf_counter()
  cfg, params, tokenizer = load_model(FLAGS.model, dtype=dtype,
                                      cache_dir=f"{FLAGS.cache_dir}/weights" if FLAGS.cache_dir else None)
  print(f"model: {cfg.name} ({cfg.n_layers} layers, d_model {cfg.d_model}) loaded in "
        f"{time.perf_counter() - t:.1f} s")
  return Engine(cfg, params, engine_cfg), cfg, tokenizer


def warmup(engine: Engine) -> dict:
  """Compiles every token-row bucket once, on a throwaway engine with the
  same configs (engines with equal configs share compiled programs).

  Returns {bucket: seconds} (compile + one tiny run; near zero when XLA's
  persistent compilation cache already holds the programs).
  """
  scratch = Engine(engine.model_cfg, engine.params, engine.config)
  c = engine.config
  rng = np.random.default_rng(0)
  seconds = {}
  for bucket in c.token_buckets:
    t = time.perf_counter()
    n = max(1, min(bucket, c.long_prefill_token_threshold, c.max_model_len - 2))
    scratch.add_request(f"warmup-{bucket}", rng.integers(20, 1000, size=n).tolist(),
                        SamplingParams(max_tokens=2, ignore_eos=True))
    scratch.run()
    seconds[bucket] = round(time.perf_counter() - t, 2)
  print(f"compiled token buckets (s): {seconds}")
  return seconds
