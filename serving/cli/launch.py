"""Shared absl flags and builders for the launchers in scripts/."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings

import jax
import jax.numpy as jnp
from absl import flags

from attention import native, ragged
from models import amx, rowgemm
from models.config import ModelConfig
from models.loaders import load_model
from models.sharding import initialize_processes, make_mesh
from serving import cli
from serving.cli import hostmem
from serving.cli.model_spec import RANDOM_PREFIX, check_model_spec, model_config, random_model
from serving.engine import autotune, speculative
from serving.engine import calibrations as cal_lib
from serving.engine import cost_model as cost_lib
from serving.engine.config import EngineConfig, preset_names
from serving.engine.engine import Engine
from serving.engine.programs import check_engine, resolve_decode_gemm
from serving.engine.sim_executor import VirtualClock
from serving.cli.warmup import warmup  # noqa: F401 (the launchers call launch.warmup)

FLAGS = flags.FLAGS


def engine_preset_help() -> str:
  """An --engine flag's help: the presets in configs/, read when the flag is
  defined, and the JSON path it takes instead."""
  return (f"Engine preset: one of {', '.join(preset_names())} (configs/NAME.json), or the "
          f"path of a JSON file of EngineConfig fields.")


def key_flags_of_caller(*names: str) -> None:
  """Lists flags ``names`` in ``--help`` of the module that called the
  define_*_flags function calling this (``--helpfull`` lists every flag)."""
  # absl keys a module's flags by its name, the script's path for __main__.
  caller = sys._getframe(2).f_globals.get("__name__")  # pylint: disable=protected-access
  for name in names:
    FLAGS.register_key_flag_for_module(sys.argv[0] if caller == "__main__" else caller,
                                       FLAGS[name])


def define_engine_flags() -> None:
  """--model, --engine preset, and overrides of its budgets. The caller's
  ``--help`` lists --model and --engine (the two choices every run makes);
  ``--helpfull`` lists the overrides too."""
  flags.DEFINE_string("model", "smollm2-135m", "A model with weights (smollm2-135m), a *.gguf "
                      "file or an HF directory; with --executor=simulated also a config "
                      "preset (tiny).")
  flags.DEFINE_string("engine", "cpu_default", engine_preset_help())
  key_flags_of_caller("model", "engine")
  flags.DEFINE_string("dtype", None, "Override the preset's dtype: float32 or bfloat16.")
  flags.DEFINE_integer("max_model_len", None, "Override the preset's context (prompt + "
                       "output tokens per request); at most the model's own.")
  flags.DEFINE_enum("weights", None, ["dense", "int8"], "Override the preset's weights: "
                    "dense (in --dtype) or int8 (int8 projection and LM-head weights, "
                    "per-row int8 activations, int32 sums: a quarter of the weight bytes; "
                    "needs --dtype=float32 and no --mesh).")
  flags.DEFINE_enum("int8_gemm", None, list(amx.GEMMS), "Override the preset's "
                    "int8 GEMM (--weights=int8): amx (Intel AMX tiles), xla, or auto (amx "
                    "where it runs); the same bits either way.")
  flags.DEFINE_enum("decode_gemm", None, list(rowgemm.GEMMS), "Override the preset's "
                    "GEMM of generated rows with float32 dense weights: native (a kernel "
                    "whose rows are k-ordered fma chains), xla, or auto (native where it "
                    "runs); they round differently.")
  flags.DEFINE_string("kv_dtype", None, "Override the preset's KV cache dtype: auto "
                      "(the dtype), float32 or bfloat16.")
  flags.DEFINE_string("policy", None, "Override the preset's scheduling policy: a "
                      "registered name, or your own as module:Class or "
                      "path/to/file.py:Class (checked by the conformance kit at load; "
                      "docs/writing-a-policy.md).")
  flags.DEFINE_integer("max_num_seqs", None, "Override: sequence budget per iteration.")
  flags.DEFINE_integer("max_num_batched_tokens", None, "Override: token budget per iteration.")
  flags.DEFINE_integer("long_prefill_token_threshold", None, "Override: prefill chunk cap.")
  flags.DEFINE_string("attention_impl", None, "Override: attention implementation.")
  flags.DEFINE_integer("prefill_chunk_rows", None, "Override: a token bucket of more rows "
                       "runs its model step as a scan over chunks of this many rows (a "
                       "multiple of 8; 0 = no chunking).")
  flags.DEFINE_integer("num_pages", None, "Override: physical KV pages, including the "
                       "null page (fewer pages = KV pressure and preemption).")
  flags.DEFINE_enum("reservation", None, ["policy", "max", "point", "quantile",
                                          "watermark"],
                    "Override: how admission reserves KV for the unknown output "
                    "length (§0x06): 'policy' (each policy's own rule), 'max' "
                    "(declared max_tokens), 'point' (mean of completed outputs), "
                    "'quantile' (their --reservation_quantile), 'watermark' "
                    "(quantile under num_pages - --watermark_pages).")
  flags.DEFINE_float("reservation_quantile", None, "Override: q of --reservation="
                     "quantile|watermark, in (0, 1].")
  flags.DEFINE_integer("watermark_pages", None, "Override: KV pages kept free at "
                       "admission while anything runs (the watermark W).")
  flags.DEFINE_string("preemption_mode", None, "Override: 'recompute' or 'swap' "
                      "(copy a preempted request's KV pages to host memory and back).")
  flags.DEFINE_float("swap_space_mb", None, "Override: host memory for swapped KV (MiB).")
  flags.DEFINE_integer("force_preempt_every", None, "Override: preempt one decoding "
                       "request every N decisions (0 = off).")
  flags.DEFINE_string("speculative", None, "Override: speculative decoding 'ngram:k=K,n=N', "
                      "'draft:MODEL,k=K' (docs/speculative-decoding.md) or '' (off).")
  flags.DEFINE_float("spec_acceptance", None, "Override: the simulated executor's "
                     "per-token draft acceptance rate in (0, 1] (with --speculative and "
                     "--executor=simulated; docs/speculative-decoding.md).")
  flags.DEFINE_integer("spec_seed", None, "Override: the seed of the simulated draft "
                       "acceptance draws (>= 0).")
  flags.DEFINE_enum("executor", None, ["model", "simulated"], "Override: 'simulated' "
                    "replaces only the model call (recorded output lengths, cost-model "
                    "step times on a virtual clock).")
  flags.DEFINE_enum("clock", None, ["wall", "virtual"], "Engine clock: 'virtual' advances "
                    "by the cost model's step time (default: virtual for the simulated "
                    "executor, wall otherwise).")
  flags.DEFINE_string("cost_model", None, "Override: the virtual clock's cost model: a "
                      "calibration JSON or profile:NAME (a100, h100: fitted to measured "
                      "operator timings; h200: h100's fit scaled to its peaks; tpu_v5e, "
                      "tpu_v6e: uncalibrated, published peaks x assumed efficiencies). "
                      "Default: the newest calibration of this device under "
                      "--cache_dir/calibration, else the shipped one.")
  flags.DEFINE_boolean("enable_prefix_caching", None, "Override: automatic prefix "
                       "caching (shared KV pages of equal prompt prefixes; on by default; "
                       "--noenable_prefix_caching for ablations).")
  flags.DEFINE_string("mesh", None, "Override: device mesh 'model:M' or 'data:1,model:M' "
                      "(tensor parallelism over M devices; on CPU set XLA_FLAGS="
                      "--xla_force_host_platform_device_count=M before starting).")
  flags.DEFINE_string("coordinator", None, "Multi-process JAX: HOST:PORT of process 0 "
                      "(jax.distributed; every process runs the same command with its "
                      "own --process_id, and --clock=virtual).")
  flags.DEFINE_integer("num_processes", 1, "Multi-process JAX: number of processes.")
  flags.DEFINE_integer("process_id", 0, "Multi-process JAX: this process's index.")
  flags.DEFINE_boolean("keep_freed_pages", True, "Serve every malloc from glibc's heap and "
                       "never trim it, so each step's XLA buffers reuse mapped pages "
                       "(serving.cli.hostmem; the process keeps its peak heap).")
  flags.DEFINE_string("cache_dir", ".cache/iterserve", "Converted-weight cache (orbax), "
                      "XLA compilation cache and kernel timings (autotune/).")
  flags.DEFINE_float("autotune_budget_s", autotune.default_budget_s(), "Seconds to choose "
                     "each 'auto' kernel by measurement (serving.engine.autotune); 0: by rule.")


def engine_config(**overrides) -> EngineConfig:
  """The --engine preset with the flags' overrides.

  Raises:
    ValueError: an unknown preset (``cli.check_engine_preset``), a
      a value the config refuses (``cli.run`` names an override's flag), a
      draft model refused (``check_draft_model``) or a bad ``--cost_model``.
  """
  if FLAGS.num_pages is not None and FLAGS.num_pages < 2:
    raise ValueError(f"--num_pages must be >= 2 (page 0 is the null page), got {FLAGS.num_pages}")
  names = ("dtype", "max_model_len", "weights", "int8_gemm", "decode_gemm", "kv_dtype", "policy",
           "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
           "attention_impl", "prefill_chunk_rows", "num_pages", "preemption_mode",
           "swap_space_mb", "reservation", "reservation_quantile", "watermark_pages",
           "force_preempt_every", "speculative", "spec_acceptance", "spec_seed", "executor",
           "cost_model", "enable_prefix_caching", "mesh")
  fields = {**{name: getattr(FLAGS, name) for name in names}, **overrides}
  cli.check_engine_preset("engine", FLAGS.engine)
  spec = fields["speculative"] or EngineConfig.preset_fields(FLAGS.engine).get("speculative", "")
  if spec.startswith("draft:"):       # a target that cannot be read is --model's, said first
    check_model_spec("--model", FLAGS.model, simulated=True)
  speculative.check_draft_model(FLAGS.model, spec)   # before the config's rules on a draft
  config = EngineConfig.preset(FLAGS.engine, **fields)
  check_cost_model()
  virtual = config.executor == "simulated" or FLAGS.clock == "virtual"
  if virtual and not config.cost_model and FLAGS.cache_dir:
    # A calibration scripts/calibrate.py made on this kind of device wins
    # over the shipped one.
    found = cal_lib.find_calibration(f"{FLAGS.cache_dir}/calibration",
                                     cal_lib.device_fingerprint(), config.dtype, FLAGS.engine)
    if found is not None:
      print(f"cost model: {found} (calibrated on this device)")
      config = dataclasses.replace(config, cost_model=str(found))
  return config


def check_cost_model() -> None:
  """Reads ``--cost_model`` (where given) before any model loads.

  Raises:
    ValueError: naming --cost_model: no such file or profile, a file that is
      not JSON (or not a file), or JSON that is not a cost model.
  """
  path = FLAGS.cost_model
  if not path:
    return
  try:
    cal_lib.load(path)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, TypeError) as e:
    raise ValueError(f"--cost_model {path!r} is not a cost model JSON (a calibration of "
                     f"scripts/calibrate.py, or profile:NAME): {e}") from None
  except ValueError as e:
    raise ValueError(f"--cost_model={path}: {e}") from None


def check_cache_dir() -> None:
  """Creates ``--cache_dir`` (where absent) and checks that it takes a file
  (``cli.make_dir``), before any model loads: JAX would only warn, on every
  compile, about a compilation cache it cannot write.

  Raises:
    ValueError: naming --cache_dir, when it cannot be created or written.
  """
  if FLAGS.cache_dir:
    cli.make_dir("cache_dir", FLAGS.cache_dir)


def load_flags_model(engine_cfg: EngineConfig, *, needs_tokenizer: bool = True):
  """Loads --model in the engine's dtype (and turns on the caches under
  --cache_dir). Returns (cfg, params, tokenizer); params is None for the
  simulated executor, which reads only the config and tokenizer
  (``model_spec.model_config``). A caller that does not use the tokenizer
  (``needs_tokenizer`` False) also takes a config preset without weights
  there (``tiny``), its tokenizer None.

  Raises:
    ValueError: naming --model, a model that cannot be found (no such file,
      a directory without config.json) or a config preset without the
      simulated executor (``check_model_spec``), before any kernel builds
      or weights load; the kernel checks' refusals
      (``check_attention_impl``, ``int8_gemm``, ``decode_gemm``,
      ``check_model_attention``); a context past the model's
      (``programs.check_engine``), before the ``model:`` line.
  """
  if not FLAGS.model.startswith(RANDOM_PREFIX):   # random_model names --model itself
    check_model_spec("--model", FLAGS.model, simulated=engine_cfg.executor == "simulated",
                     needs_tokenizer=needs_tokenizer)
  if FLAGS.keep_freed_pages:
    hostmem.keep_freed_pages()
  init_processes(engine_cfg)
  check_attention_impl(engine_cfg)
  gemm = int8_gemm(engine_cfg)
  rows = decode_gemm(engine_cfg)
  cli.use_compile_cache("cache_dir", FLAGS.cache_dir)
  dtype = jnp.bfloat16 if engine_cfg.dtype == "bfloat16" else jnp.float32
  t = time.perf_counter()
  if FLAGS.model.startswith(RANDOM_PREFIX):
    cfg, params, tokenizer = random_model(FLAGS.model, dtype,
                                          weights=engine_cfg.executor != "simulated")
  elif engine_cfg.executor == "simulated":   # no model runs: the config and tokenizer only
    (cfg, tokenizer), params = model_config(FLAGS.model), None
  else:
    cfg, params, tokenizer = load_model(
        FLAGS.model, dtype=dtype, cache_dir=f"{FLAGS.cache_dir}/weights" if FLAGS.cache_dir
        else None, mesh=make_mesh(engine_cfg.mesh))
  check_model_attention(engine_cfg, cfg)
  check_engine(cfg, engine_cfg)      # the context refused before the line below says it
  seconds = time.perf_counter() - t
  read = (f"loaded in {seconds:.1f} s" if params is not None else
          f"config and tokenizer read in {seconds:.1f} s (simulated executor: no weights)"
          if tokenizer is not None else "config preset (simulated executor: no weights)")
  print(f"model: {cfg.name} ({describe_model(cfg, engine_cfg.max_model_len)}) {read}; "
        f"attention: {attention_impl(engine_cfg, cfg.head_dim)}"
        + (f"; int8 GEMM: {gemm}" if gemm else "") + (f"; decode GEMM: {rows}" if rows else "")
        + (f" ({rowgemm.vector_bits()}-bit vectors)" if rows == "native" else ""))
  return cfg, params, tokenizer


def model_costs(cfg: ModelConfig, engine_cfg: EngineConfig) -> dict:
  """``serving.engine.cost_model.model_costs`` of ``cfg`` in the engine's weight and
  KV dtypes, as JSON (the calibration's meta and replay reports record it)."""
  return cost_lib.engine_model_costs(cfg, engine_cfg).to_json()


def describe_model(cfg: ModelConfig, max_model_len: int | None = None) -> str:
  """One phrase naming a model's family and shape, e.g. ``qwen3_moe, 2
  layers, d_model 64, 4 experts (top 2), context 512 (the model's 8192)``:
  the context served (``max_model_len``), and the model's where it differs."""
  experts = (f", {cfg.num_experts} experts (top {cfg.experts_per_token})"
             if cfg.is_moe else "")
  own = ("" if max_model_len in (None, cfg.max_position) else f" (the model's {cfg.max_position})")
  return (f"{cfg.family}, {cfg.n_layers} layers, d_model {cfg.d_model}{experts}, "
          f"context {max_model_len or cfg.max_position}{own}")


def decode_gemm(engine_cfg: EngineConfig) -> str | None:
  """``--decode_gemm`` resolved before any model loads (None for the
  simulated executor, which runs no model).

  Raises:
    ValueError: ``--decode_gemm=native`` where the kernel cannot run (why).
  """
  try:
    return resolve_decode_gemm(engine_cfg)
  except ValueError:
    raise ValueError(f"--decode_gemm=native: {rowgemm.unavailable_reason()}") from None


def int8_gemm(engine_cfg: EngineConfig) -> str | None:
  """``--int8_gemm`` resolved before any model loads (None without
  ``--weights=int8``).

  Raises:
    ValueError: ``--int8_gemm=amx`` where the AMX kernel cannot run (why).
  """
  if engine_cfg.weights != "int8" or engine_cfg.executor == "simulated":
    return None
  reason = amx.unavailable_reason() if engine_cfg.int8_gemm == "amx" else None
  if reason:
    raise ValueError(f"--int8_gemm=amx: {reason}")
  return amx.resolve(engine_cfg.int8_gemm)


def check_attention_impl(engine_cfg: EngineConfig) -> None:
  """Checks ``--attention_impl`` before any model loads; where ``auto``
  cannot take the native CPU kernel, says so in one ``warning:`` line on
  stderr (and not again when the engine resolves it).

  Raises:
    ValueError: ``--attention_impl=native`` off the CPU, or where the native
      kernel does not build (the reason, e.g. no C++ compiler).
  """
  impl, backend = engine_cfg.attention_impl, jax.default_backend()
  if engine_cfg.executor == "simulated" or impl not in ("auto", "native"):
    return
  if impl == "native" and backend != "cpu":
    raise ValueError(f"--attention_impl=native runs on the CPU only (backend: {backend})")
  reason = native.unavailable_reason() if backend == "cpu" else None
  if impl == "native" and reason:
    raise ValueError(f"--attention_impl=native: {reason}")
  if reason:
    print(f"warning: --attention_impl=auto: the native CPU kernel is unavailable ({reason}); "
          f"using blocked_dot", file=sys.stderr)
    attention_impl(engine_cfg, None)   # the engine's own resolution now stays silent


def check_model_attention(engine_cfg: EngineConfig, cfg: ModelConfig) -> None:
  """Checks ``--attention_impl=native`` against the loaded model, before
  anything compiles (``auto`` falls back by itself).

  Raises:
    ValueError: the native kernel does not take the model's ``head_dim``.
  """
  if (engine_cfg.executor != "simulated" and engine_cfg.attention_impl == "native"
      and cfg.head_dim not in native.HEAD_DIMS):
    raise ValueError(f"--attention_impl=native: the native kernel takes head_dim in "
                     f"{native.HEAD_DIMS}, model {cfg.name} has {cfg.head_dim} "
                     f"(--attention_impl=auto runs blocked_dot for it)")


def attention_impl(engine_cfg: EngineConfig, head_dim: int | None) -> str:
  """``--attention_impl`` resolved for this backend and ``head_dim``."""
  if engine_cfg.executor == "simulated":
    return "none (simulated executor)"
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return ragged.resolve_impl(engine_cfg.attention_impl, head_dim=head_dim)


def init_processes(engine_cfg: EngineConfig) -> None:
  """--coordinator / --num_processes / --process_id: joins a multi-process
  JAX run (``models.sharding.initialize_processes``) before JAX starts.

  Raises:
    ValueError: --num_processes > 1 without --coordinator, or without a
      virtual clock (the processes' host loops must decide alike).
  """
  if FLAGS.num_processes == 1 and FLAGS.coordinator is None:
    return
  if FLAGS.coordinator is None:
    raise ValueError("--num_processes > 1 needs --coordinator=HOST:PORT")
  if FLAGS.num_processes > 1 and (FLAGS.clock or ("virtual" if engine_cfg.executor ==
                                                  "simulated" else "wall")) != "virtual":
    raise ValueError("--num_processes > 1 needs --clock=virtual: every process runs the "
                     "same host loop, and wall clocks would make them decide apart")
  initialize_processes(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)


def build_engine(model: tuple | None = None, **overrides):
  """Loads the model (unless ``model``, ``load_flags_model``'s result, is
  given), builds the Engine: (engine, cfg, tokenizer).

  Raises:
    ValueError: ``engine_config``'s and ``engine_clock``'s refusals, before
      the model loads.
  """
  engine_cfg = engine_config(**overrides)
  engine_clock(engine_cfg)
  cfg, params, tokenizer = model if model is not None else load_flags_model(engine_cfg)
  if FLAGS.autotune_budget_s > 0 and FLAGS.cache_dir:    # "auto" kernels by measurement
    engine_cfg = autotune.choose(cfg, engine_cfg, FLAGS.cache_dir, FLAGS.autotune_budget_s)[0]
  return Engine(cfg, params, engine_cfg, clock=make_clock(engine_cfg)), cfg, tokenizer


def engine_clock(engine_cfg: EngineConfig) -> str:
  """The --clock flag resolved for ``engine_cfg``: ``"virtual"`` or
  ``"wall"`` (unset: virtual for the simulated executor, wall otherwise).
  Only a virtual clock reads a cost model (its step times advance it).

  Raises:
    ValueError: --clock=wall with the simulated executor; --cost_model on
      the wall clock (the model executor's step times are measured there,
      so the cost model would go unused).
  """
  clock = FLAGS.clock or ("virtual" if engine_cfg.executor == "simulated" else "wall")
  if clock == "wall" and engine_cfg.executor == "simulated":
    raise ValueError("--clock=wall: the simulated executor needs --clock=virtual "
                     "(its step times are modelled)")
  if clock == "wall" and FLAGS.cost_model:
    raise ValueError(f"--cost_model={FLAGS.cost_model} applies only with "
                     f"--executor=simulated (or --clock=virtual): the model executor on "
                     f"the wall clock measures its step times and reads no cost model")
  return clock


def make_clock(engine_cfg: EngineConfig):
  """The --clock flag as an engine clock: a fresh ``VirtualClock`` or
  ``time.monotonic`` (ValueError: ``engine_clock``'s refusals)."""
  return VirtualClock() if engine_clock(engine_cfg) == "virtual" else time.monotonic
