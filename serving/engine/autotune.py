"""Kernels chosen by measurement: what ``"auto"`` means for a launcher.

``EngineConfig.attention_impl`` and ``decode_gemm`` default to ``"auto"``;
an ``Engine`` built directly maps them by rule (``attention.ragged.resolve_impl``,
``programs.resolve_decode_gemm``: the native kernels where they build). A
launcher instead asks ``choose``: on first start for a machine
(``fingerprint``: backend, device, CPU model and vector extensions, jax
version) and a model shape (``shape_key``), it times every implementation
that can run on the model's own shapes, per token bucket, within a stated
budget, keeps the table under ``--cache_dir/autotune/``, prints it once and
uses the winner; later starts read the table. An explicit flag value
(``--attention_impl=blocked_dot``) is never replaced.

One implementation per engine, not one per bucket: implementations round
differently, and a request's tokens must not depend on the bucket its rows
ran in (``models.llama.row_tiled``); the winner is the least total time over
the buckets, each bucket weighted once.

What is timed (each the fastest of ``REPS`` calls after a warm one):
  attention: one decode mix (min(T, max_num_seqs) sequences of one row at
    ``context`` cached tokens) and one prompt chunk (T rows after
    ``context`` rows) per token bucket T, through
    ``attention.ragged.ragged_paged_attention`` with the model's heads,
    head_dim and the engine's page size;
  decode GEMM (float32, dense weights, one device): the generated rows'
    largest projection (d_model x ffn_dim) at 1, 8 and 32 rows (the row
    tile), ``models.rowgemm.matmul`` against XLA's dot.

A measurement on a loaded machine is not kept: with a 1-minute load
average above ``MAX_LOAD`` nothing is timed, the rule decides, and a line
says so. Timings only choose; the bits of a run are those of the chosen
implementation, which every report records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attention import native as native_attention
from attention import ragged
from models import rowgemm
from serving.engine import host_cpu

MAX_LOAD = 1.5          # 1-minute load average above which nothing is timed
REPS = 3
BUDGET_S = 30.0         # default time budget of one choice (compiles included)


def default_budget_s() -> float:
  """The launchers' ``--autotune_budget_s`` default: ``BUDGET_S``, or
  ``$ITERSERVE_AUTOTUNE_BUDGET_S`` (the test suite sets 0: its launches
  choose by rule, and one test asks for a measurement)."""
  return float(os.environ.get("ITERSERVE_AUTOTUNE_BUDGET_S", BUDGET_S))


def fingerprint() -> dict:
  """The machine as its timings depend on it: JAX backend and device kind,
  CPU model, cores, vector/matrix extensions and instruction-set cap
  (``host_cpu.host_cpu``), jax version."""
  cpu = host_cpu.host_cpu()
  return {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
          "cpu": cpu["model"], "cores": cpu["cores"], "extensions": cpu["extensions"],
          "max_isa": cpu["max_isa"], "jax": jax.__version__}


def shape_key(model_cfg, config) -> dict:
  """The shapes a choice depends on: heads, head_dim, widths, page size,
  dtypes, token buckets, sequence budget, context."""
  c = config
  return {"n_heads": model_cfg.n_heads, "n_kv_heads": model_cfg.n_kv_heads,
          "head_dim": model_cfg.head_dim, "d_model": model_cfg.d_model,
          "ffn_dim": model_cfg.ffn_dim, "page_size": c.page_size, "dtype": c.dtype,
          "kv_dtype": c.kv_cache_dtype, "weights": c.weights,
          "buckets": list(c.token_buckets), "max_num_seqs": c.max_num_seqs,
          "max_model_len": c.max_model_len}


def measure(candidates: Dict[str, Callable[[int], Callable[[], object]]],
            buckets: Sequence[int], budget_s: float, *,
            timer: Callable[[], float] = time.perf_counter,
            on_cell: Optional[Callable[[], None]] = None) -> Dict[str, Dict[int, Optional[float]]]:
  """ms per call of every candidate at every bucket.

  Args:
    candidates: name -> ``make(bucket)``, which returns a call to time
      (jitted; its first call compiles).
    buckets: the buckets to time, in order.
    budget_s: once this much ``timer`` time has passed, cells left are None.
    timer: seconds (``time.perf_counter``; a fake in tests).
    on_cell: called after each cell (a progress bar).

  Returns:
    {name: {bucket: ms or None}}: the fastest of ``REPS`` calls after one
    warm call; None where the budget ran out.
  """
  start = timer()
  table: Dict[str, Dict[int, Optional[float]]] = {n: {} for n in candidates}
  for bucket in buckets:                 # bucket-major: a cut budget cuts every candidate
    for name, make in candidates.items():
      if timer() - start > budget_s:
        table[name][bucket] = None
        continue
      call = make(bucket)
      jax.block_until_ready(call())
      best = float("inf")
      for _ in range(REPS):
        t = timer()
        jax.block_until_ready(call())
        best = min(best, timer() - t)
      table[name][bucket] = best * 1e3
      if on_cell is not None:
        on_cell()
  return table


def pick(table: Dict[str, Dict[int, Optional[float]]]) -> str:
  """The candidate with the least total ms over the buckets every
  candidate was timed at (ties: the first listed).

  Raises:
    ValueError: no bucket was timed for every candidate.
  """
  names = list(table)
  common = [b for b in table[names[0]]
            if all(table[n].get(b) is not None for n in names)]
  if not common:
    raise ValueError("no token bucket was timed for every candidate (raise the budget)")
  return min(names, key=lambda n: (sum(table[n][b] for b in common), names.index(n)))


def _attention_call(impl: str, model_cfg, config, num_rows: int, mix: str):
  c = config
  rng = np.random.default_rng(0)
  context = max(1, min(c.max_model_len // 4, c.max_model_len - num_rows - 1))
  if mix == "decode":
    seqs = [(context, 1)] * min(num_rows, c.max_num_seqs)
  else:
    seqs = [(context, num_rows)]
  per_seq = -(-(context + num_rows) // c.page_size)
  num_pages = len(seqs) * per_seq + 1
  dtype = jnp.bfloat16 if c.dtype == "bfloat16" else jnp.float32
  shape = (num_pages, c.page_size, model_cfg.n_kv_heads, model_cfg.head_dim)
  k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  table = np.zeros((len(seqs), per_seq), np.int32)
  kv_lens = np.zeros(len(seqs), np.int32)
  cu = np.zeros(len(seqs) + 1, np.int32)
  for s, (history, q_len) in enumerate(seqs):
    kv_lens[s] = history + q_len
    table[s] = 1 + s * per_seq + np.arange(per_seq)
    cu[s + 1] = cu[s] + q_len
  q = jnp.asarray(rng.standard_normal((num_rows, model_cfg.n_heads, model_cfg.head_dim),
                                      np.float32), dtype)
  fn = jax.jit(lambda *a: ragged.ragged_paged_attention(
      *a, sm_scale=model_cfg.head_dim ** -0.5, impl=impl))
  args = (q, k, v, jnp.asarray(kv_lens), jnp.asarray(table), jnp.asarray(cu),
          jnp.int32(len(seqs)))
  return lambda: fn(*args)


def attention_candidates(model_cfg, config) -> Dict[str, Callable]:
  """The CPU attention implementations that can run this model: native
  (where it builds and takes head_dim), blocked_dot, blocked; each timed on
  a decode mix and a prompt chunk per bucket."""
  names = ["blocked_dot", "blocked"]
  if (native_attention.unavailable_reason() is None
      and model_cfg.head_dim in native_attention.HEAD_DIMS):
    names.insert(0, "native")

  def make(impl):
    def at(bucket):
      decode = _attention_call(impl, model_cfg, config, bucket, "decode")
      prompt = _attention_call(impl, model_cfg, config, bucket, "prompt")
      return lambda: (decode(), prompt())
    return at
  return {n: make(n) for n in names}


def decode_gemm_candidates(model_cfg, config) -> Dict[str, Callable]:
  """native (``models.rowgemm``, where it builds) and xla, on the model's
  d_model x ffn_dim projection; the bucket is the row count (1, 8, 32)."""
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((model_cfg.d_model, model_cfg.ffn_dim), np.float32))
  out = {"xla": lambda rows: _gemm(jax.jit(jnp.dot), rows, w, rng)}
  if rowgemm.available():
    out = {"native": lambda rows: _gemm(jax.jit(rowgemm.matmul), rows, w, rng), **out}
  return out


def _gemm(fn, rows, w, rng):
  x = jnp.asarray(rng.standard_normal((rows, w.shape[0]), np.float32))
  return lambda: fn(x, w)


def _rule(field: str, model_cfg, config) -> str:
  """What "auto" runs by rule (no measurement)."""
  if field == "attention_impl":
    return ragged.resolve_impl("auto", head_dim=model_cfg.head_dim)
  from serving.engine import programs      # the engine's rule, one definition
  return programs.resolve_decode_gemm(config)


@dataclasses.dataclass(frozen=True)
class Choice:
  """One field's choice: ``value`` (the implementation used), ``how``
  ("measured", "cached", "flag", "rule": load too high or nothing to
  time), the ms table and the file it is kept in."""

  field: str
  value: str
  how: str
  table: Optional[dict] = None
  path: Optional[str] = None

  def line(self) -> str:
    if self.table is None:
      return f"autotune: {self.field}={self.value} ({self.how})"
    cells = "; ".join(f"{n}: " + ", ".join("-" if ms is None else f"{b}:{ms:.2f}"
                                           for b, ms in row.items())
                      for n, row in self.table.items())
    return (f"autotune: {self.field}={self.value} ({self.how}; ms by bucket: {cells}"
            f"{'; kept in ' + self.path if self.path else ''})")


def choose(model_cfg, config, cache_dir: str, budget_s: float = BUDGET_S, *,
           timer: Callable[[], float] = time.perf_counter,
           load: Callable[[], float] = lambda: os.getloadavg()[0],
           say: Callable[[str], None] = print, candidates: Optional[dict] = None):
  """``config`` with its "auto" kernels chosen by measurement on this
  machine (see the module docstring). Returns ``(config, [Choice])``.

  Args:
    cache_dir: where tables are kept (``autotune/`` under it); "" keeps
      none (every start measures).
    budget_s: time budget per field (compiles included).
    timer, load: clocks and load average (fakes in tests).
    say: prints each choice once (when measured or read from the cache).
    candidates: field -> ``measure``'s candidates (tests); default the
      implementations that can run here.
  """
  fields = {"attention_impl": (attention_candidates, list(config.token_buckets))}
  if config.dtype == "float32" and config.weights == "dense" and not config.mesh:
    fields["decode_gemm"] = (decode_gemm_candidates, [1, 8, 32])
  if config.executor == "simulated" or jax.default_backend() != "cpu":
    return config, []
  choices = []
  for field, (make, buckets) in fields.items():
    if getattr(config, field) != "auto":
      choices.append(Choice(field, getattr(config, field), "flag"))
      continue
    cands = (candidates or {}).get(field) or make(model_cfg, config)
    if len(cands) == 1:
      choices.append(Choice(field, next(iter(cands)), "rule: the only one that runs here"))
    else:
      key = {"field": field, "machine": fingerprint(), "shape": shape_key(model_cfg, config),
             "budget_s": budget_s}
      digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
      path = Path(cache_dir) / "autotune" / f"{field}-{digest}.json" if cache_dir else None
      if path is not None and path.is_file():
        kept = json.loads(path.read_text())
        choices.append(Choice(field, kept["choice"], "cached", kept["table"], str(path)))
      elif load() > MAX_LOAD:
        choices.append(Choice(field, "auto", f"the rule's {_rule(field, model_cfg, config)}: "
                              f"1-minute load {load():.2f} > {MAX_LOAD}, a timing now would "
                              f"mislead; nothing kept"))
      else:
        table = measure(cands, buckets, budget_s, timer=timer)
        value = pick(table)
        if path is not None:
          path.parent.mkdir(parents=True, exist_ok=True)
          path.write_text(json.dumps({**key, "table": {n: {str(b): ms for b, ms in r.items()}
                                                       for n, r in table.items()},
                                      "choice": value, "load_avg": load()}, indent=1))
        choices.append(Choice(field, value, "measured", table,
                              None if path is None else str(path)))
    if choices[-1].value != "auto":
      config = dataclasses.replace(config, **{field: choices[-1].value})
  for c in choices:
    if c.how != "flag":
      say(c.line())
  return config, choices
