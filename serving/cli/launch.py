"""Shared absl flags and builders for the launchers in scripts/."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from attention import native, ragged
from models import amx, rowgemm
from models.config import ModelConfig
from models.loaders import load_model
from models.sharding import initialize_processes, make_mesh
from serving import cli
from serving.cli import hostmem
from serving.cli.model_spec import RANDOM_PREFIX, check_model_spec, model_config, random_model
from serving.harness import metrics, traces, workloads
from serving.harness import synthetic as synthetic_workloads
from serving.engine import autotune, speculative
from serving.engine import calibrations as cal_lib
from serving.engine import cost_model as cost_lib
from serving.engine.config import EngineConfig, preset_names
from serving.engine.engine import Engine
from serving.engine.programs import check_engine, resolve_decode_gemm
from serving.engine.sim_executor import VirtualClock
from serving.cli.warmup import warmup  # noqa: F401 (the launchers call launch.warmup)

FLAGS = flags.FLAGS
# The longest span of arrivals a replay takes, in virtual seconds as
# replayed: a trace window's length x --time_scale (sweep.py: / its rate
# scale), the synthetic workload's arrivals at --rate_scale. The engine's
# clocks are float64 seconds and ms since its start (serving.engine.clocks,
# the VirtualClock), whose resolution falls with the time they hold: 2**-19
# s ~ 2 us at 1e10 s (~300 years). Measured on 13 requests of the Azure conv
# trace, tiny model: the median gap between tokens (3 ms on profile:h100) is
# off by 0.04% at 1e10 s, by 1% at 1e11 s, 5% at 1e12 s, and 0 ms at 1e14 s;
# past ~3e35 s a device epoch's shift overflows float32 ms
# (clocks.EngineClocks.rebase) and the report's JSON gets inf.
MAX_REPLAY_SPAN_S = 1e10


def engine_preset_help() -> str:
  """An --engine flag's help: the presets in configs/, read when the flag is
  defined, and the JSON path it takes instead."""
  return (f"Engine preset: one of {', '.join(preset_names())} (configs/NAME.json), or the "
          f"path of a JSON file of EngineConfig fields.")


def _key_flags_of_caller(*names: str) -> None:
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
  _key_flags_of_caller("model", "engine")
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


def define_workload_flags() -> None:
  """--trace (or the synthetic default), its window, time scale and clips.
  The caller's ``--help`` lists the flags that choose the workload, its
  clips and its SLOs; ``--helpfull`` the synthetic draws and seed too."""
  flags.DEFINE_string("trace", None, "KIND:PATH with KIND in azure, mooncake, vtc; "
                      "unset = the embedded synthetic Azure-conv workload.")
  flags.DEFINE_integer("num_requests", 32, "Requests of the synthetic default workload.")
  flags.DEFINE_integer("clients", None, "Synthetic: clients c0..cN-1, equally likely.")
  flags.DEFINE_list("client_shares", None, "Synthetic: relative client weights W0,W1,... "
                    "(> 0; ck drawn with probability Wk / sum: 0.6,0.6 is two equal clients).")
  flags.DEFINE_integer("priorities", None, "Synthetic: priorities 0..N-1, equally likely.")
  flags.DEFINE_float("rate_scale", 0.1, "Synthetic default: fraction of the Azure "
                     "conv trace's arrival rate (5.53 req/s).")
  flags.DEFINE_float("time_scale", 1.0, "Multiply inter-arrival gaps (>1 = slower).")
  flags.DEFINE_list("window_s", None, "N: the trace's first N seconds of arrivals; A,B: "
                    "its arrivals in [t0+A, t0+B) seconds, t0 its first arrival.")
  flags.DEFINE_integer("max_requests", None, "Keep at most this many requests.")
  flags.DEFINE_integer("max_prompt_len", None, "Clip longer prompts (counted); default "
                       "512 for the synthetic workload, 1024 for traces.")
  flags.DEFINE_integer("max_output_len", None, "Cap output lengths; default 64 for the "
                       "synthetic workload, 512 for traces.")
  flags.DEFINE_integer("mooncake_block_tokens", None, "Mooncake only: tokens per hash "
                       "block (default 512); smaller shrinks prompts to fit a small "
                       "context and keeps which prompts share which prefix.")
  flags.DEFINE_integer("seed", 0, "Seed for prompt token ids and arrivals.",
                       lower_bound=0, upper_bound=2**32 - 1)
  flags.DEFINE_float("slo_ttft_ms", None, "Every request's TTFT SLO (ms, from arrival).")
  flags.DEFINE_float("slo_tpot_ms", None, "Every request's TPOT/TBT SLO (ms between tokens).")
  flags.DEFINE_string("slo_class", None, "Per-class SLOs NAME:TTFT_MS:TPOT_MS,...; a "
                      "request whose client names a class takes it, the others cycle "
                      "through the classes by arrival index.")
  _key_flags_of_caller("trace", "window_s", "time_scale", "max_requests", "num_requests",
                       "rate_scale", "max_prompt_len", "max_output_len", "slo_ttft_ms",
                       "slo_tpot_ms", "slo_class")


def check_workload_flags() -> None:
  """The values of define_workload_flags(), checked before any model loads,
  each refusal naming the flag and its rule (the loaders in
  serving.harness, a Python API, name their arguments instead). A trace's
  rows are read from the file (for its span; one request drawn for
  --window_s), so a window that holds no request, or a time scale that
  stretches the trace too far, is refused now too, not once the model has
  loaded.

  Raises:
    ValueError: an SLO flag not finite and > 0, --slo_class malformed or
      given with --slo_ttft_ms / --slo_tpot_ms, a flag of the other workload
      kind (--window_s, --time_scale, --max_requests, --mooncake_block_tokens
      apply to --trace only; --num_requests, --rate_scale to the synthetic
      workload only), a malformed --trace or one whose file is missing, a
      --window_s not N or A,B with 0 <= A < B finite (``parse_window``) or
      one no request of the trace is in, a --time_scale or --rate_scale not
      finite and > 0, a count or length below 1; a --time_scale or
      --rate_scale that stretches the arrivals (--window_s's length, the
      trace's or the synthetic workload's span) past MAX_REPLAY_SPAN_S
      (``check_replay_span``).
  """
  for name in ("slo_ttft_ms", "slo_tpot_ms"):
    value = FLAGS[name].value
    if value is not None and not (math.isfinite(value) and value > 0):
      raise ValueError(f"--{name} must be finite and > 0 (ms), got {value}")
  if FLAGS.slo_class is not None:
    if FLAGS.slo_ttft_ms is not None or FLAGS.slo_tpot_ms is not None:
      raise ValueError("give either --slo_ttft_ms / --slo_tpot_ms or --slo_class, not both")
    try:
      workloads.parse_slo_classes(FLAGS.slo_class)
    except ValueError as e:               # its messages start with the field, slo_class
      raise ValueError(f"--{e}") from None
  synthetic = FLAGS.trace is None
  given = lambda name: FLAGS[name].present
  wrong = [n for n in (("window_s", "time_scale", "max_requests", "mooncake_block_tokens")
                       if synthetic
                       else ("num_requests", "rate_scale", "clients", "client_shares",
                             "priorities")) if given(n)]
  if wrong:
    raise ValueError(
        f"--{wrong[0]} applies only {'with --trace' if synthetic else 'without --trace'}; "
        + ("the synthetic workload takes --num_requests, --rate_scale, --clients, "
           "--client_shares, --priorities" if synthetic
           else "a trace takes --window_s, --time_scale and --max_requests"))
  if synthetic:
    if FLAGS.num_requests < 1:
      raise ValueError(f"--num_requests must be >= 1, got {FLAGS.num_requests}")
    try:
      synthetic_workloads.client_shares(FLAGS.clients, FLAGS.client_shares)
    except ValueError as e:               # its messages start with the field
      raise ValueError(f"--{e}") from None
    if not (math.isfinite(FLAGS.rate_scale) and FLAGS.rate_scale > 0):
      raise ValueError(f"--rate_scale must be finite and > 0, got {FLAGS.rate_scale}")
  else:
    loader, path = traces.trace_loader(FLAGS.trace)
    blocks = FLAGS.mooncake_block_tokens
    if blocks is not None and loader is not traces.load_mooncake_trace:
      raise ValueError(f"--mooncake_block_tokens applies only to --trace=mooncake:PATH, "
                       f"got --trace={FLAGS.trace}")
    if blocks is not None and not 1 <= blocks <= traces.MOONCAKE_BLOCK_TOKENS:
      raise ValueError(f"--mooncake_block_tokens must be in [1, "
                       f"{traces.MOONCAKE_BLOCK_TOKENS}], got {blocks}")
    _flag_window()
    if not (math.isfinite(FLAGS.time_scale) and FLAGS.time_scale > 0):
      raise ValueError(f"--time_scale must be finite and > 0 (a factor on the trace's "
                       f"gaps), got {FLAGS.time_scale}")
    traces.trace_loader(FLAGS.trace, check_file=True)
  for name in ("max_requests", "max_prompt_len", "max_output_len", "clients", "priorities"):
    value = FLAGS[name].value
    if value is not None and value < 1:
      raise ValueError(f"--{name} must be >= 1, got {value}")
  # Last, what the flags' values need read from the trace or drawn.
  if synthetic:
    check_replay_span(f"--rate_scale={FLAGS.rate_scale:g}", f"the synthetic workload's "
                      f"{FLAGS.num_requests} arrivals", _synthetic_span_s())
    return
  _check_trace_span()
  if FLAGS.window_s is not None:       # a window with no request: refused now
    loader(path, window_s=_flag_window(), max_requests=1)


def check_replay_span(given: str, what: str, span_s: float) -> None:
  """Refuses a time or rate scale that stretches a replay's arrivals past
  ``MAX_REPLAY_SPAN_S``: ``span_s`` is ``what`` (a window or a trace's
  arrivals) as replayed, in seconds (inf where scaling overflowed): the
  one bound of --time_scale, the synthetic workload's --rate_scale and
  sweep.py's --rate_scales.

  Raises:
    ValueError: naming ``given`` (the flags as typed), the span and the
      bound with its reason.
  """
  if not span_s <= MAX_REPLAY_SPAN_S:
    raise ValueError(f"{given}: {what} would span {span_s:.3g} s as replayed; a replay spans "
                     f"at most {MAX_REPLAY_SPAN_S:g} s of virtual time (the engine's float64 "
                     f"clocks resolve ~2 us there; further on a step of a few ms is off by 1% "
                     f"and more)")


def parse_window(value) -> tuple:
  """A --window_s value, a list flag's strings or one string, as (A, B)
  seconds after the trace's first arrival: ``N`` is its first N seconds
  (0, N), ``A,B`` the arrivals in [A, B).

  Raises:
    ValueError: naming --window_s and its rule: not one or two numbers, or
      not 0 <= A < B with B finite.
  """
  parts = value.split(",") if isinstance(value, str) else list(value)
  try:
    numbers = [float(x) for x in parts]
  except ValueError:
    numbers = []
  if len(numbers) == 1:
    numbers = [0.0] + numbers            # N: the first N seconds
  if len(numbers) != 2 or not 0 <= numbers[0] < numbers[1] < math.inf:
    raise ValueError(f"--window_s must be N > 0 (the trace's first N seconds of arrivals) or "
                     f"A,B with 0 <= A < B (its arrivals in [A, B) seconds after the first), "
                     f"finite, got {','.join(parts)!r}")
  return numbers[0], numbers[1]


def _synthetic_span_s() -> float:
  """The synthetic workload's arrivals' span (s) at --rate_scale, drawn with
  one token a request (its arrivals do not depend on the lengths); inf
  where they overflow."""
  try:
    with np.errstate(over="ignore"):
      return synthetic_workloads.synthetic_azure_conv(
          FLAGS.num_requests, FLAGS.rate_scale, FLAGS.seed, max_prompt_len=1,
          max_output_len=1).duration_s
  except ValueError:      # its flags are checked: an arrival past float64's range
    return math.inf


def _check_trace_span() -> None:
  """--time_scale on --window_s's length, or on the trace's arrivals (read
  from the file, no prompt drawn) without it: ``check_replay_span``."""
  scale, window = FLAGS.time_scale, _flag_window()
  if window is not None:
    length = window[1] - window[0]
    given = f"--window_s={','.join(FLAGS.window_s)} x --time_scale={scale:g}"
    what = f"a window of {length:g} s"
  else:
    length = traces.arrival_span_s(FLAGS.trace)
    given, what = f"--time_scale={scale:g}", f"the trace's arrivals ({length:g} s, first to last)"
  check_replay_span(given, what, length * scale)


def _flag_window():
  """--window_s as (A, B), or None when not given (``parse_window``)."""
  return parse_window(FLAGS.window_s) if FLAGS.window_s is not None else None


def load_workload(vocab_size: int, max_model_len: int) -> workloads.Workload:
  """The workload of define_workload_flags(), fitted into the context
  (``workloads.fit_context``: prompt + output <= max_model_len, the output
  keeping min(requested, max_model_len // 2) tokens), with a one-line note
  when that cuts a request.

  Raises:
    ValueError: a flag ``check_workload_flags`` refuses, or a trace file
      that does not read.
  """
  check_workload_flags()
  synthetic = FLAGS.trace is None
  pick = lambda value, default_synthetic, default_trace: value if value is not None else (
      default_synthetic if synthetic else default_trace)
  common = dict(max_prompt_len=pick(FLAGS.max_prompt_len, 512, 1024),
                max_output_len=pick(FLAGS.max_output_len, 64, 512),
                seed=FLAGS.seed, vocab_size=vocab_size)
  workload = workloads.fit_context(_load_flag_workload(synthetic, common), max_model_len)
  note = workloads.fit_note(workload)
  if note:
    print(note)
  return _with_flag_slos(workload)


def slo_flags_given() -> bool:
  return (FLAGS.slo_ttft_ms is not None or FLAGS.slo_tpot_ms is not None
          or FLAGS.slo_class is not None)


def flag_goodput(records, duration_s: float):
  """A run's goodput block when ``slo_flags_given()``: each request judged by
  its own SLOs, the flags' limits named."""
  return metrics.goodput(records, ttft_ms=FLAGS.slo_ttft_ms, tpot_ms=FLAGS.slo_tpot_ms,
                         duration_s=duration_s, per_request=True)


def _with_flag_slos(workload: workloads.Workload) -> workloads.Workload:
  """Declares --slo_ttft_ms / --slo_tpot_ms / --slo_class on every request."""
  if not slo_flags_given():
    return workload
  classes = workloads.parse_slo_classes(FLAGS.slo_class) if FLAGS.slo_class else ()
  return workloads.with_slos(workload, ttft_ms=FLAGS.slo_ttft_ms,
                             tpot_ms=FLAGS.slo_tpot_ms, classes=classes)


def _load_flag_workload(synthetic: bool, common: dict) -> workloads.Workload:
  if synthetic:
    shares = synthetic_workloads.client_shares(FLAGS.clients, FLAGS.client_shares)
    return synthetic_workloads.synthetic_azure_conv(
        FLAGS.num_requests, FLAGS.rate_scale, **common, client_shares=shares,
        num_priorities=FLAGS.priorities or 1)
  loader, path = traces.trace_loader(FLAGS.trace)
  if FLAGS.mooncake_block_tokens is not None:
    common = dict(common, block_tokens=FLAGS.mooncake_block_tokens)
  return loader(path, time_scale=FLAGS.time_scale, window_s=_flag_window(),
                max_requests=FLAGS.max_requests, **common)


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
