"""Engine throughput beside HF transformers `generate` on the same weights.

  python scripts/bench_engine.py --out=runs/bench_engine.json
  python scripts/bench_engine.py --model=~/models/Qwen2.5-0.5B-Instruct --sections=decode \
      --concurrency=8 --out=runs/bench_qwen.json

Sections (``--dtype``, float32 by default, for both engines; CPU, greedy,
ignore EOS; ``--weights=int8`` runs iterserve's int8 weights, and
``--hf_weights=dense,int8`` runs transformers both as it is and with torch's
dynamic int8 quantization, each beside the same iterserve run):
* prefill: tokens/s for one 512-token prompt (one output token).
* decode: output tokens/s with N concurrent requests (256-token prompts, 128
  output tokens), end to end and decode-only (minus the one-token run), each
  beside its memory roofline (``serving.harness.roofline``: the weight and
  KV bytes a decode step reads over the machine's measured read bandwidth,
  and the fraction of that floor the step reached).
* trace: 64 requests with Azure-conv prompt/output lengths (capped at
  1024/512), all arriving at t=0; transformers runs static left-padded batches
  of 32 that wait for their longest member, iterserve runs continuous
  batching with at most 32 running. Useful output tokens/s.
* gemm: the machine's float32 GEMM FLOP/s and the fraction a decode step
  achieves (model FLOPs per token x decode tokens/s / GEMM FLOP/s).
* breakdown: one decode iteration of N sequences split into its device
  programs' parts, each timed alone on the engine's shapes: the model
  (blocks), attention alone, the LM head, sampling, and the executor's rest.
* prefill_step: the model step (all blocks) of one prompt filling the
  largest bucket, its rows in the large GEMM class (as the engine runs
  them) and, for comparison, in 32-row tiles (the rule for generated rows).

Every decode run also records a per-iteration breakdown (``steps``): the
``plan`` program (tick, plan, checks) and the ``step`` program (execute,
apply) of each iteration, arrive and release, each timed with
``block_until_ready``; host time (everything else in ``Engine.step``) and
its fraction; round trips (blocking fetches) and programs per iteration;
plus the programs compiled during the run (XLA backend
compiles; none are expected after warm-up) and per function
(``Engine.compiled_programs``). ``--profile=DIR`` writes a JAX profiler
trace (TensorBoard and Perfetto ``.trace.json.gz``) of a few decode steps.
"""

import collections
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

# torch's OpenMP threads spin after each op by default, taking cores from
# XLA's threads in the same process; make them sleep instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from attention.ragged import IMPLS, KV_BITS, kv_float_dtype, ragged_paged_attention, resolve_impl
from models import amx, llama, quant, rowgemm
from models.loaders import load_model, resolve_model_path
from serving import cli
from serving.cli import hostmem
from serving.harness import synthetic
from serving.harness import traces
from serving.engine import cost_model as cost_lib
from serving.engine import host_cpu
from serving.harness import roofline as roofline_lib
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.engine.programs import resolve_decode_gemm
from serving.cli.launch import (check_attention_impl, check_model_attention, check_model_spec,
                                describe_model, engine_preset_help, model_costs, warmup)
from serving.cli.launch import decode_gemm as launch_decode_gemm
from serving.cli.launch import int8_gemm as launch_int8_gemm
from serving.engine.sampling import sample

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "runs/bench_engine.json", "Result JSON path.")
flags.DEFINE_string("model", "smollm2-135m", "Preset name, *.gguf file or HF directory "
                    "(as the launchers' --model); transformers loads the same source.")
SECTIONS = ("prefill", "decode", "trace", "gemm", "breakdown", "prefill_step")
flags.DEFINE_list("sections", list(SECTIONS),
                  "What to measure: any of " + ", ".join(SECTIONS) + ".")
flags.DEFINE_list("concurrency", ["1", "8", "32", "64"], "Decode concurrency levels.")
flags.DEFINE_integer("prompt_len", 256, "Decode section prompt length.")
flags.DEFINE_integer("output_len", 128, "Decode section output length.")
flags.DEFINE_integer("trace_requests", 64, "Trace section request count.")
flags.DEFINE_string("trace", str(Path(__file__).resolve().parents[2] / "shared/data/traces/"
                                 "azure2023/AzureLLMInferenceTrace_conv.csv"),
                    "Azure conv CSV for the trace section (synthetic lengths if absent).")
flags.DEFINE_bool("keep_freed_pages", True, "serving.cli.hostmem.keep_freed_pages before "
                  "anything loads (the launchers' default; both engines in the process share it).")
flags.DEFINE_bool("hf", True, "Also run HF transformers (needs the reference extra).")
flags.DEFINE_string("engine", "cpu_default", engine_preset_help())
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                  "Weights, activations and KV cache of iterserve and of transformers.")
flags.DEFINE_enum("weights", "dense", ["dense", "int8"],
                  "iterserve's weights: dense (in --dtype) or int8 "
                  "(EngineConfig.weights='int8').")
flags.DEFINE_list("hf_weights", [], "transformers peers run in the same process: dense "
                  "(in --dtype; JSON keys hf_*) and/or int8 (torch's dynamic int8 "
                  "quantization of every Linear, the LM head included; keys hf_int8_*). "
                  "Default: --weights.")
flags.DEFINE_enum("attention_impl", None, list(IMPLS),
                  "Override the preset's attention implementation (e.g. blocked_dot "
                  "against the CPU default, native).")
flags.DEFINE_enum("int8_gemm", "auto", list(amx.GEMMS),
                  "iterserve's int8 GEMM with --weights=int8 (EngineConfig.int8_gemm): "
                  "amx (Intel AMX tiles), xla, or auto.")
flags.DEFINE_enum("decode_gemm", "auto", list(rowgemm.GEMMS),
                  "iterserve's GEMM of generated rows with float32 dense weights "
                  "(EngineConfig.decode_gemm): native, xla, or auto.")
flags.DEFINE_enum("kv_dtype", "auto", ["auto", "float32", "bfloat16"],
                  "iterserve KV cache dtype (auto: --dtype).")
flags.DEFINE_integer("num_pages", 0, "KV pages per engine (0: the preset's); "
                     "smaller pools save memory on a shared machine.")
flags.DEFINE_integer("token_budget", 0, "Token budget and prefill chunk cap per iteration "
                     "(0: the preset's); buckets above the preset's prefill_chunk_rows run as "
                     "scanned chunks.")
flags.DEFINE_string("profile", "", "Write a JAX profiler trace of a few decode steps here.")
flags.DEFINE_integer("profile_steps", 4, "Steps in the --profile trace.")
flags.DEFINE_integer("profile_requests", 32, "Requests of the --profile trace (>= 1).")
flags.DEFINE_enum("profile_phase", "decode", ["decode", "prefill"],
                  "--profile traces --profile_requests' decode steps (after their prompts) "
                  "or their first steps (prompt chunks, then prompt chunks with decode rows).")
flags.DEFINE_list("breakdown_seqs", ["1", "8", "32"], "Breakdown section batch sizes.")
flags.DEFINE_integer("breakdown_context", 320, "Breakdown section KV rows per sequence.")

_COMPILES = cli.compile_counter()     # XLA backend compiles seen by this process
_LOAD_AT_START = list(os.getloadavg())   # before this process loads or compiles anything


class StepTimer:
  """Times an engine's iterations by phase (installs wrappers on one engine).

  Each jitted program the engine calls (``plan`` and ``step``; arrive and
  release) is timed with ``block_until_ready``; ``Engine.step`` is timed as
  a whole, and host time is the iteration minus its programs (bookkeeping,
  device_get round trips, the drain). Blocking adds no round trip: every
  iteration already fetches the facts of both programs. Per iteration it
  also counts the programs called and the blocking fetches
  (``Engine.host_fetches``).
  """

  PHASES = ("plan", "step", "arrive", "release")

  def __init__(self, engine):
    self.samples = collections.defaultdict(list)   # phase -> [ms]
    self.counts = collections.defaultdict(list)    # per-iteration counters
    self._inside = collections.Counter()
    self._calls = collections.Counter()
    programs = engine._programs                    # pylint: disable=protected-access
    engine._programs = dataclasses.replace(        # pylint: disable=protected-access
        programs, **{p: self._timed(p, getattr(programs, p)) for p in self.PHASES})
    step = engine.step

    def timed_step():
      self._inside.clear()
      self._calls.clear()
      buckets, fetches = dict(engine.buckets_used), engine.host_fetches
      t = time.perf_counter()
      out = step()
      ms = (time.perf_counter() - t) * 1e3
      b = [k for k, v in engine.buckets_used.items() if v != buckets.get(k, 0)]
      if b:
        self.samples[f"step[{b[0]}]"].append(ms)
        self.samples[f"host[{b[0]}]"].append(ms - sum(self._inside.values()))
        self.counts["round_trips"].append(engine.host_fetches - fetches)
        self.counts["programs"].append(sum(self._calls.values()))
      return out

    engine.step = timed_step

  def _timed(self, phase, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
      t = time.perf_counter()
      out = jax.block_until_ready(fn(*args, **kwargs))
      ms = (time.perf_counter() - t) * 1e3
      self.samples[phase].append(ms)
      self._inside[phase] += ms
      self._calls[phase] += 1
      return out
    return wrapped

  def summary(self):
    """{phase: {n, median_ms, total_ms}}, the host fraction per bucket and
    overall, and per iteration: round trips and programs."""
    out = {k: {"n": len(v), "median_ms": round(float(np.median(v)), 3),
               "total_ms": round(float(np.sum(v)), 1)}
           for k, v in sorted(self.samples.items())}
    for key in [k for k in self.samples if k.startswith("step[")]:
      b = key[5:-1]
      host = np.sum(self.samples[f"host[{b}]"])
      out[f"host_fraction[{b}]"] = round(float(host / np.sum(self.samples[key])), 4)
    steps = [v for k, v in self.samples.items() if k.startswith("step[")]
    hosts = [v for k, v in self.samples.items() if k.startswith("host[")]
    if steps:
      out["host_fraction"] = round(float(sum(map(np.sum, hosts)) /
                                         sum(map(np.sum, steps))), 4)
      out["round_trips_per_iteration"] = round(float(np.mean(self.counts["round_trips"])), 3)
      out["programs_per_iteration"] = round(float(np.mean(self.counts["programs"])), 3)
    return out


class StepGapTimer:
  """The host's time between steps, without blocking (installs wrappers on
  one engine): from the return of the fetch that brought a step program's
  facts to the next step program's dispatch, summed (``step_gap_s``). The
  device runs at most a plan program in a gap when the plan is made at
  launch (``StepTimer``'s ``plan`` time) and the small ``retick`` when it
  was made ahead; the rest of a gap (the drain, the next ``step()``'s host
  work, the plan's round trip) leaves the device idle."""

  def __init__(self, engine):
    self.step_gap_s, self._stepped, self._done = 0.0, False, None
    programs, fetch = engine._programs, engine._fetch   # pylint: disable=protected-access

    def step(*args, **kwargs):
      if self._done is not None:
        self.step_gap_s += time.perf_counter() - self._done
      self._stepped, self._done = True, None
      return programs.step(*args, **kwargs)

    def fetched(tree):
      out = fetch(tree)
      if self._stepped:                   # the step's facts
        self._stepped, self._done = False, time.perf_counter()
      return out

    engine._programs = dataclasses.replace(programs, step=step)  # pylint: disable=protected-access
    engine._fetch = fetched                        # pylint: disable=protected-access


def _prompts(lengths, vocab_size, seed=0):
  """Random prompts of the given lengths, ids in [20, min(40000, vocab_size))."""
  rng = np.random.default_rng(seed)
  return [rng.integers(20, min(40000, vocab_size), size=n).tolist() for n in lengths]


def _engine(cfg, params, **overrides):
  overrides.setdefault("dtype", FLAGS.dtype)
  overrides.setdefault("kv_dtype", FLAGS.kv_dtype)
  overrides.setdefault("weights", FLAGS.weights)
  overrides.setdefault("int8_gemm", FLAGS.int8_gemm)
  overrides.setdefault("decode_gemm", FLAGS.decode_gemm)
  if FLAGS.attention_impl:
    overrides.setdefault("attention_impl", FLAGS.attention_impl)
  if FLAGS.num_pages:
    overrides.setdefault("num_pages", FLAGS.num_pages)
  if FLAGS.token_budget:
    overrides.setdefault("max_num_batched_tokens", FLAGS.token_budget)
    overrides.setdefault("long_prefill_token_threshold", FLAGS.token_budget)
  return Engine(cfg, params, EngineConfig.preset(FLAGS.engine, **overrides))


def iterserve_run(cfg, params, prompts, outputs, timer=False, idle=False, plan_ahead=True,
                  **overrides):
  """Seconds to finish all requests (all arriving at t=0); outputs checked.

  With ``timer``, the engine's ``StepTimer`` is left in ``engine.step_timer``
  and the XLA compiles during the run in ``engine.compiles_during_run``;
  with ``idle``, its ``StepGapTimer`` in ``engine.idle_timer``. ``plan_ahead``:
  ``Engine.plan_ahead.enabled``.
  """
  engine = _engine(cfg, params, **overrides)
  engine.plan_ahead.enabled = plan_ahead
  if timer:
    engine.step_timer = StepTimer(engine)
  if idle:
    engine.idle_timer = StepGapTimer(engine)
  compiles = _COMPILES.programs
  t = time.perf_counter()
  for i, (p, n) in enumerate(zip(prompts, outputs)):
    engine.add_request(f"b{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
  engine.run()
  seconds = time.perf_counter() - t
  engine.compiles_during_run = _COMPILES.programs - compiles
  engine.kv = None                 # free the cache before the next engine
  got = [len(r.output_token_ids) for r in engine.requests.values()]
  assert got == list(outputs), "every request must produce its output length"
  return seconds, engine


def hf_run(model, torch, prompts, new_tokens):
  """Seconds for one static left-padded batch generating ``new_tokens``."""
  width = max(len(p) for p in prompts)
  ids = torch.zeros((len(prompts), width), dtype=torch.long)
  mask = torch.zeros_like(ids)
  for i, p in enumerate(prompts):
    ids[i, width - len(p):] = torch.tensor(p)
    mask[i, width - len(p):] = 1
  t = time.perf_counter()
  with torch.inference_mode():
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
  return time.perf_counter() - t


def load_hf(weights="dense"):
  """transformers' model in ``--dtype`` (bfloat16 runs oneDNN's bfloat16 GEMMs);
  ``weights="int8"``: every Linear through torch's dynamic int8 quantization
  (int8 weights, activations quantized per call)."""
  import torch
  import transformers
  path, _ = resolve_model_path(FLAGS.model)
  source = dict(pretrained_model_name_or_path=str(path)) if path.is_dir() else dict(
      pretrained_model_name_or_path=str(path.parent), gguf_file=path.name)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      **source, dtype=getattr(torch, FLAGS.dtype)).eval()
  if weights == "int8":
    from torch.ao.quantization import quantize_dynamic
    model = quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
  return model, torch


def gemm_flops_per_s():
  a = jnp.ones((1024, 2048), jnp.float32)
  b = jnp.ones((2048, 2048), jnp.float32)
  f = jax.jit(lambda a, b: a @ b)
  f(a, b).block_until_ready()
  t, n = time.perf_counter(), 20
  for _ in range(n):
    f(a, b).block_until_ready()
  return n * 2 * 1024 * 2048 * 2048 / (time.perf_counter() - t)


def flops_per_token(cfg):
  """FLOPs (2 per multiply-add) of one row's projections, MLP (MoE: router
  and its top-k experts) and LM head (``serving.engine.cost_model.model_costs``)."""
  costs = cost_lib.model_costs(cfg)
  return costs.gemm_flops_per_row + costs.lm_head_flops_per_row


def _time_ms(fn, *args, reps=5):
  """Min wall ms of ``fn(*args)`` over ``reps`` calls after one warm call."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t)
  return best * 1e3


def breakdown(cfg, params, num_seqs, ecfg):
  """Parts of one decode iteration of ``num_seqs`` sequences, each timed alone.

  Shapes are the engine's (``ecfg``): token bucket, ``max_num_seqs``,
  the KV pool; each sequence has ``--breakdown_context``
  KV rows on its own pages. ``model_ms`` is ``llama.forward`` (all blocks,
  with attention); ``attention_ms`` is ``ragged_paged_attention`` for every
  layer alone; ``blocks_minus_attention_ms`` is the difference (projections,
  MLP, norms, RoPE, KV writes); ``lm_head_ms`` the logits of the sampled
  rows; ``sampling_ms`` greedy sampling of ``max_num_seqs`` rows.
  """
  ctx = FLAGS.breakdown_context
  bucket = ecfg.bucket_for(num_seqs)
  ps, seqs = ecfg.page_size, ecfg.max_num_seqs
  pages_per_seq = ecfg.pages_per_seq
  rng = np.random.default_rng(0)
  used = -(-ctx // ps)
  num_pages = seqs * used + 1       # only the pages read: the pool size costs nothing
  perm = rng.permutation(num_pages - 1) + 1                       # page 0: null
  table = np.zeros((seqs, pages_per_seq), np.int32)
  table[:, :used] = perm.reshape(seqs, used)
  table = jnp.asarray(table)
  kv_lens = jnp.asarray([ctx if i < num_seqs else 0 for i in range(seqs)], jnp.int32)
  cu = jnp.asarray(np.minimum(np.arange(seqs + 1), num_seqs), jnp.int32)
  rows = np.arange(bucket)
  positions = jnp.asarray(np.where(rows < num_seqs, ctx - 1, 0), jnp.int32)
  slot_mapping = jnp.asarray(np.where(
      rows < num_seqs, np.asarray(table)[np.minimum(rows, seqs - 1), (ctx - 1) // ps] * ps
      + (ctx - 1) % ps, -1), jnp.int32)
  tokens = jnp.asarray(rng.integers(20, min(1000, cfg.vocab_size), size=bucket), jnp.int32)
  kv = llama.init_kv_cache(cfg, num_pages, ps, jnp.dtype(ecfg.kv_cache_dtype))
  fill = jnp.full(kv.k.shape, 0.01, kv_float_dtype(kv.k.dtype))
  if kv.k.dtype == KV_BITS:            # a bfloat16 cache is stored as bits
    fill = jax.lax.bitcast_convert_type(fill, KV_BITS)
  kv = llama.KVCache(k=fill, v=fill + 0)
  num = jnp.int32(num_seqs)
  impl = ecfg.attention_impl

  # kv donated, as the engine's execute does: without donation every call
  # copies the whole KV pool, which would dominate the step.
  fwd_jit = jax.jit(lambda p, kv: llama.forward(
      p, cfg, kv, tokens, positions, slot_mapping, kv_lens, table, cu, num,
      attention_impl=impl, decode_gemm=resolve_decode_gemm(ecfg)), donate_argnums=(1,))

  def fwd(p, kv_box):
    hidden, kv_box[0] = fwd_jit(p, kv_box[0])
    return hidden
  q = jnp.full((bucket, cfg.n_heads, cfg.head_dim), 0.01, jnp.dtype(ecfg.dtype))

  @jax.jit
  def attn(k, v):
    flat = (cfg.n_layers * num_pages,) + k.shape[2:]
    k, v = k.reshape(flat), v.reshape(flat)

    def layer(carry, l):
      out = ragged_paged_attention(q + carry, k, v, kv_lens, table + l * num_pages,
                                   cu, num, sm_scale=cfg.sm_scale, impl=impl,
                                   soft_cap=cfg.attn_softcap)
      return carry + out[0, 0, 0] * 0, None
    return jax.lax.scan(layer, jnp.float32(0), jnp.arange(cfg.n_layers))[0]

  # As the executor: the head's rows are min(max_num_seqs, bucket), the
  # live ones only.
  hidden = jnp.full((min(ecfg.max_num_seqs, bucket), cfg.d_model), 0.01, jnp.dtype(ecfg.dtype))
  head = jax.jit(lambda p, h: llama.compute_logits(p, cfg, h, num,
                                                 decode_gemm=resolve_decode_gemm(ecfg)))
  logits = jnp.resize(head(params, hidden), (seqs, cfg.vocab_size))
  z = jnp.zeros((seqs,), jnp.float32)
  samp = jax.jit(lambda lg: sample(lg, z, z.astype(jnp.int32), z + 1,
                                   z.astype(jnp.uint32), z.astype(jnp.int32)))
  row = {"num_seqs": num_seqs, "bucket": bucket, "context": ctx,
         "model_ms": _time_ms(fwd, params, [llama.KVCache(k=kv.k + 0, v=kv.v + 0)]),
         "attention_ms": _time_ms(attn, kv.k, kv.v),
         "lm_head_ms": _time_ms(head, params, hidden),
         "sampling_ms": _time_ms(samp, logits)}
  row["blocks_minus_attention_ms"] = row["model_ms"] - row["attention_ms"]
  kv_bytes = (2 * num_seqs * ctx * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
              * jnp.dtype(kv_float_dtype(kv.k.dtype)).itemsize)
  row["attention_kv_gb_per_s"] = kv_bytes / row["attention_ms"] / 1e6
  return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def prefill_step(cfg, params, ecfg):
  """Model step ms of one prompt filling the largest bucket, interleaved
  so both variants see the same machine load: prompt rows in the large
  GEMM class (``prompt_rows``, the engine's rule), and every row in 32-row
  tiles; with ``prefill_chunk_rows`` as the engine scans it."""
  rows = ecfg.max_num_batched_tokens
  ps = ecfg.page_size
  pages = -(-rows // ps)
  table = jnp.zeros((ecfg.max_num_seqs, ecfg.pages_per_seq), jnp.int32).at[0, :pages].set(
      jnp.arange(1, pages + 1, dtype=jnp.int32))
  pos = jnp.arange(rows, dtype=jnp.int32)
  tokens = jnp.asarray(np.random.default_rng(0).integers(20, min(1000, cfg.vocab_size),
                                                         size=rows), jnp.int32)
  kv_lens = jnp.zeros((ecfg.max_num_seqs,), jnp.int32).at[0].set(rows)
  cu = jnp.full((ecfg.max_num_seqs + 1,), rows, jnp.int32).at[0].set(0)
  kv = llama.init_kv_cache(cfg, pages + 1, ps, jnp.dtype(ecfg.dtype))
  chunk = ecfg.prefill_chunk_rows or None
  step = {name: jax.jit(lambda p, kv, pr=pr: llama.forward(
      p, cfg, kv, tokens, pos, pos + ps, kv_lens, table, cu, jnp.int32(1),
      attention_impl=ecfg.attention_impl, prompt_rows=pr, chunk_rows=chunk,
      decode_gemm=resolve_decode_gemm(ecfg))[0])
          for name, pr in (("large", pos >= 0), ("tiled", None))}
  best = {name: _time_ms(fn, params, kv, reps=1) for name, fn in step.items()}
  for _ in range(4):
    for name, fn in step.items():
      best[name] = min(best[name], _time_ms(fn, params, kv, reps=1))
  return {"bucket": rows, "chunk_rows": chunk, "prompt_rows_large_ms": round(best["large"], 1),
          "all_rows_tiled_ms": round(best["tiled"], 1),
          "tiled_over_large": round(best["tiled"] / best["large"], 3),
          "load_average": list(os.getloadavg())}


def _decode_rate(tokens: int, whole_s: float, prefill_s: float):
  """Decode-phase tokens/s: the tokens after each request's first over the
  whole run's time less a one-token run's (its prefill). None when the
  one-token run took as long as the whole run (a loaded machine): the
  difference then measures noise, not decoding."""
  return tokens / (whole_s - prefill_s) if whole_s > prefill_s else None


def main(argv):
  del argv
  for name in FLAGS.sections:
    if name not in SECTIONS:
      raise ValueError(f"--sections entries must be among {', '.join(SECTIONS)}, got {name!r}")
  for w in FLAGS.hf_weights:
    if w not in ("dense", "int8"):
      raise ValueError(f"--hf_weights entries must be dense or int8, got {w!r}")
  for name in ("profile_steps", "profile_requests"):
    if getattr(FLAGS, name) < 1:
      raise ValueError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  # The launchers' refusals, before any model loads: the flags' combination
  # (EngineConfig), --attention_impl=native and --int8_gemm=amx where their
  # kernels cannot run.
  cli.check_engine_preset("engine", FLAGS.engine)
  check_model_spec("--model", FLAGS.model)
  probe = EngineConfig.preset(FLAGS.engine, dtype=FLAGS.dtype, weights=FLAGS.weights,
                              int8_gemm=FLAGS.int8_gemm, decode_gemm=FLAGS.decode_gemm,
                              attention_impl=FLAGS.attention_impl)
  check_attention_impl(probe)
  int8_gemm = launch_int8_gemm(probe)
  decode_gemm = launch_decode_gemm(probe)
  kept = hostmem.keep_freed_pages() if FLAGS.keep_freed_pages else False
  hf_weights = (FLAGS.hf_weights or [FLAGS.weights]) if FLAGS.hf else []
  cfg, params, _ = load_model(FLAGS.model, dtype=jnp.dtype(FLAGS.dtype),
                              cache_dir=".cache/iterserve/weights")
  check_model_attention(probe, cfg)
  print(f"model: {cfg.name} ({describe_model(cfg)})", flush=True)
  if FLAGS.weights == "int8":         # once, not per engine (Engine would quantize)
    params = quant.quantize_params(params, cfg.tie_embeddings, gemm=int8_gemm)
  params = llama.split_layers(params)   # the engine's layout, for every section
  if launch_decode_gemm(probe) == "native":
    params = llama.with_head_panels(params, cfg)
  peers = {"hf" if w == "dense" else f"hf_{w}": load_hf(w) for w in hf_weights}
  scratch = _engine(cfg, params)
  if set(FLAGS.sections) & {"prefill", "decode", "trace"} or FLAGS.profile:
    warmup(scratch)
  out = {"jax_version": jax.__version__, "device": str(jax.devices()[0]),
         "host_cpu": host_cpu.host_cpu(),
         "model": FLAGS.model, "family": cfg.family,
         "model_costs": model_costs(cfg, scratch.config),
         "engine_preset": FLAGS.engine, "dtype": FLAGS.dtype, "weights": FLAGS.weights,
         "int8_gemm": int8_gemm, "decode_gemm": decode_gemm,
         "kv_dtype": FLAGS.kv_dtype, "keep_freed_pages": kept,
         "attention_impl": resolve_impl(scratch.config.attention_impl, head_dim=cfg.head_dim),
         "token_buckets": list(scratch.config.token_buckets),
         "load_average_at_start": _LOAD_AT_START, "load_average": list(os.getloadavg()),
         "compiled_programs_after_warmup": scratch.compiled_programs(),
         "xla_compiles_during_warmup": _COMPILES.programs}

  if "prefill" in FLAGS.sections:
    length = min(512, scratch.config.max_model_len - 1)
    prompt = _prompts([length], cfg.vocab_size)
    s, _ = iterserve_run(cfg, params, prompt, [1])
    row = {"prompt_tokens": length, "iterserve_tokens_per_s": length / s}
    for name, hf in peers.items():
      hf_run(*hf, prompt, 1)
      row[f"{name}_tokens_per_s"] = length / hf_run(*hf, prompt, 1)
    out["prefill"] = row
    print("prefill", row)

  if "decode" in FLAGS.sections:
    out["decode"] = []
    read_bps = roofline_lib.read_bytes_per_s()
    out["memory_read_gb_per_s"] = read_bps / 1e9
    for n in map(int, FLAGS.concurrency):
      prompts = _prompts([FLAGS.prompt_len] * n, cfg.vocab_size, seed=n)
      total = n * FLAGS.output_len
      # At least 32 running sequences (at most the preset's token budget).
      seqs = min(max(32, n), scratch.config.max_num_batched_tokens)
      shape = dict(max_num_seqs=seqs, max_request_slots=max(128, n))
      s, engine = iterserve_run(cfg, params, prompts, [FLAGS.output_len] * n, timer=True,
                                **shape)
      s1, _ = iterserve_run(cfg, params, prompts, [1] * n, **shape)
      row = {"concurrency": n, "iterserve_output_tokens_per_s": total / s,
             "iterserve_decode_tokens_per_s": _decode_rate(total - n, s, s1),
             "iterserve_iterations": engine.num_iterations,
             "steps": engine.step_timer.summary(),
             "compiles_during_run": engine.compiles_during_run,
             "compiled_programs": engine.compiled_programs()}
      # Planning ahead against planning at launch, alternated, nothing blocked.
      for ahead in (True, False, True, False):
        s_a, e_a = iterserve_run(cfg, params, prompts, [FLAGS.output_len] * n, idle=True,
                                 plan_ahead=ahead, **shape)
        runs = row.setdefault("plan_ahead" if ahead else "plan_at_launch", {})
        for key, value in (("output_tokens_per_s", total / s_a),
                           ("step_gap_fraction", e_a.idle_timer.step_gap_s / s_a),
                           ("step_gap_ms", e_a.idle_timer.step_gap_s * 1e3 / e_a.num_iterations),
                           ("round_trips_per_iteration", e_a.host_fetches / e_a.num_iterations),
                           ("plans_taken", e_a.plan_ahead.used),
                           ("plans_dropped", e_a.plan_ahead.dropped)):
          runs.setdefault(key, []).append(round(value, 4))
      row["roofline"] = roofline_lib.decode_roofline(
          cost_lib.engine_model_costs(cfg, engine.config), n,
          FLAGS.prompt_len + FLAGS.output_len / 2, row["iterserve_decode_tokens_per_s"],
          read_bps)
      for name, hf in peers.items():
        h = hf_run(*hf, prompts, FLAGS.output_len)
        h1 = hf_run(*hf, prompts, 1)
        row[f"{name}_output_tokens_per_s"] = total / h
        row[f"{name}_decode_tokens_per_s"] = _decode_rate(total - n, h, h1)
        row[f"speedup{name[2:]}"] = row["iterserve_output_tokens_per_s"] / (total / h)
      out["decode"].append(row)
      print("decode", row)

  if "breakdown" in FLAGS.sections:
    out["breakdown"] = [breakdown(cfg, params, int(n), scratch.config)
                        for n in FLAGS.breakdown_seqs]
    for row in out["breakdown"]:
      print("breakdown", row)

  if "prefill_step" in FLAGS.sections:
    out["prefill_step"] = prefill_step(cfg, params, scratch.config)
    print("prefill_step", out["prefill_step"])

  if FLAGS.profile:
    n = FLAGS.profile_requests
    engine = _engine(cfg, params)
    for i, p in enumerate(_prompts([FLAGS.prompt_len] * n, cfg.vocab_size, seed=n)):
      engine.add_request(f"p{i}", p, SamplingParams(max_tokens=64, ignore_eos=True))
    if FLAGS.profile_phase == "decode":
      for _ in range(n * FLAGS.prompt_len // engine.config.max_num_batched_tokens + 2):
        engine.step()                # prefill everything; decode from here
    with jax.profiler.trace(FLAGS.profile, create_perfetto_trace=True):
      for _ in range(FLAGS.profile_steps):
        with jax.profiler.TraceAnnotation("engine.step"):
          engine.step()
    out["profile_dir"] = FLAGS.profile
    print(f"profile trace in {FLAGS.profile}")

  if "trace" in FLAGS.sections:
    n = FLAGS.trace_requests
    if Path(FLAGS.trace).exists():
      wl = traces.load_azure_trace(FLAGS.trace, max_requests=n, max_prompt_len=1024,
                                   max_output_len=512, vocab_size=cfg.vocab_size)
      source = FLAGS.trace
    else:
      wl = synthetic.synthetic_azure_conv(n, 1.0, max_prompt_len=1024, max_output_len=512,
                                          vocab_size=cfg.vocab_size)
      source = "synthetic_azure_conv"
    prompts = [list(s.prompt_token_ids) for s in wl]
    outputs = [s.max_tokens for s in wl]
    useful = sum(outputs)
    s, engine = iterserve_run(cfg, params, prompts, outputs, timer=True)
    row = {"source": source, "requests": n, "prompt_tokens": sum(map(len, prompts)),
           "output_tokens": useful, "iterserve_seconds": s,
           "iterserve_output_tokens_per_s": useful / s,
           "iterserve_preemptions": engine.num_preemptions,
           "iterserve_iterations": engine.num_iterations,
           "buckets_used": dict(sorted(engine.buckets_used.items())),
           "steps": engine.step_timer.summary()}
    for name, hf in peers.items():
      h = sum(hf_run(*hf, prompts[i:i + 32], max(outputs[i:i + 32]))
              for i in range(0, n, 32))
      row[f"{name}_seconds"] = h
      row[f"{name}_output_tokens_per_s"] = useful / h
      row[f"speedup{name[2:]}"] = (useful / s) / (useful / h)
    out["trace"] = row
    print("trace", row)

  if "gemm" in FLAGS.sections:
    peak = gemm_flops_per_s()
    row = {"gemm_gflops": peak / 1e9, "flops_per_token": flops_per_token(cfg)}
    decode32 = [r for r in out.get("decode", []) if r["concurrency"] == 32]
    if decode32:
      rate = decode32[0]["iterserve_decode_tokens_per_s"]
      row["decode32_fraction_of_gemm"] = (flops_per_token(cfg) * rate / peak
                                          if rate is not None else None)
    out["gemm"] = row
    print("gemm", row)

  out["load_average_end"] = list(os.getloadavg())
  Path(FLAGS.out).parent.mkdir(parents=True, exist_ok=True)
  Path(FLAGS.out).write_text(json.dumps(out, indent=2))
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  cli.run(main)
