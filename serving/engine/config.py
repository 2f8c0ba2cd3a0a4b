"""Engine and sampling configuration (frozen, checked on construction).

Presets live as JSON in ``configs/`` and load with ``EngineConfig.preset``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Tuple

import numpy as np

from attention.ragged import IMPLS
from models.amx import GEMMS as INT8_GEMMS
from models.rowgemm import GEMMS as DECODE_GEMMS
from models.sharding import parse_mesh
from scheduler.policies import check_policy_name, check_reservation
from serving.engine import profiles as profile_lib
from serving.engine.speculative import Speculation

# How every accepted request ends, exactly one of these (the engine's
# ``Request.outcome``; reports count them in this order).
OUTCOMES = ("completed", "failed", "rejected", "cancelled")

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
PREEMPTION_MODES = ("recompute", "swap")
EXECUTORS = ("model", "simulated")
# An engine's place in a deployment (``HarnessConfig.role``).
ROLES = ("mixed", "prefill", "decode")
WEIGHTS = ("dense", "int8")
# The largest finite float32: the device's sampling parameters are float32.
_F32_MAX = float(np.finfo(np.float32).max)


def preset_names() -> list:
  """The engine presets ``EngineConfig.preset`` finds by name: the stems of
  ``configs/*.json``, sorted."""
  return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def bucket_index(buckets, num_rows, xp=np):
  """Index of the smallest of ``buckets`` (ascending) holding ``num_rows``
  rows, ``len(buckets)`` when none does; numpy on the host, ``jax.numpy``
  (i32[]) on the device."""
  return xp.sum(xp.asarray(buckets) < num_rows)


def _require(cond: bool, cls: str, field: str, rule: str, value) -> None:
  if not cond:
    raise ValueError(f"{cls}.{field} {rule}, got {value!r}")


# What a config field's annotation admits, and how its refusal names the
# type (the annotations are strings: ``from __future__ import annotations``).
# A bool is not a number here; an int is a float's value; numpy's integers
# and floats are ints and floats.
_FIELD_TYPES = {
    "int": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an int"),
    "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool),
              "a float (or an int)"),
    "str": (lambda v: isinstance(v, str), "a str"),
    "bool": (lambda v: isinstance(v, bool), "a bool"),
}


def _wrong_type(annotation: str, value):
  """How a refusal names the type a field annotated ``annotation`` wants
  (``"an int"``, ...) when ``value`` is not of it; None when it is, or when
  the annotation is not one of ``_FIELD_TYPES`` (the field's own rules
  check it)."""
  admits, name = _FIELD_TYPES.get(annotation, (lambda v: True, None))
  return None if admits(value) else name


def _check_types(config, cls: str) -> None:
  """Refuses the first field of the dataclass ``config`` whose value is not
  of its annotated type (``_wrong_type``), before any rule compares it.

  Raises:
    ValueError: ``<cls>.<field> must be <type>, got <value>``.
  """
  for f in dataclasses.fields(config):
    wanted = _wrong_type(f.type, getattr(config, f.name))
    _require(wanted is None, cls, f.name, f"must be {wanted}", getattr(config, f.name))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling and stopping rules.

  Attributes:
    max_tokens: output tokens to generate at most (>= 1).
    temperature: 0 means greedy (argmax); > 0 samples.
    top_k: keep the k most likely tokens (0 = off).
    top_p: nucleus mass in (0, 1] (1 = off).
    seed: per-request seed; same seed and prompt give the same tokens.
    min_tokens: EOS and stop tokens are masked until this many were emitted.
    stop_token_ids: extra token ids that end the request (reason "stop").
    ignore_eos: do not stop on EOS (benchmark replays).
  """

  max_tokens: int = 64
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  min_tokens: int = 0
  stop_token_ids: Tuple[int, ...] = ()
  ignore_eos: bool = False

  def __post_init__(self):
    c = "SamplingParams"
    _require(1 <= self.max_tokens < 2**31, c, "max_tokens", "must be in [1, 2**31)",
             self.max_tokens)
    # The engine holds it in float32: a larger value would be inf there.
    _require(math.isfinite(self.temperature) and 0.0 <= self.temperature <= _F32_MAX, c,
             "temperature", f"must be finite and in [0, {_F32_MAX:.4g}] (float32)",
             self.temperature)
    _require(0 <= self.top_k < 2**31, c, "top_k", "must be in [0, 2**31) (0 = off)",
             self.top_k)
    _require(0.0 < self.top_p <= 1.0, c, "top_p", "must be in (0, 1]", self.top_p)
    _require(0 <= self.seed < 2**32, c, "seed", "must be in [0, 2**32)", self.seed)
    _require(0 <= self.min_tokens <= self.max_tokens, c, "min_tokens",
             "must be in [0, max_tokens]", self.min_tokens)
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  """What the policy and the host's settling read: budgets, the slot table,
  KV reservation (§0x06), preemption (§0x0C), prefix caching.

  Attributes:
    max_num_seqs: sequence budget per iteration (S).
    max_num_batched_tokens: token budget per iteration (tau).
    long_prefill_token_threshold: per-request prefill chunk cap.
    max_request_slots: initial and smallest size R (>= S) of the
      scheduler's slot table. Every accepted, unfinished request holds a
      slot, so the policy sees the whole queue; the table doubles when full
      (one compiled program set per size) up to ``max_queued_requests``,
      and halves when a half would be at most three-quarters full.
    max_queued_requests: bound on accepted, unfinished requests; past it
      ``Engine.add_request`` raises ``QueueFull`` (a server's HTTP 429).
    watermark_pages: pages kept free at admission while anything runs (W of
      the §0x06 soft ceiling).
    reservation: how admission reserves KV for the unknown output length
      (§0x06, ``scheduler.admission``): "policy" (default: each policy's own
      rule, ORCA the declared maximum, the others on demand), "max"
      (declared max_tokens), "point" (ceil-mean of the output lengths of
      requests completed in this run), "quantile" (their nearest-rank
      ``reservation_quantile``), "watermark" (the quantile forecast under
      the soft ceiling, ``watermark_pages >= 1``). Before any request
      completed, every kind reserves the declared maximum. A decode row past
      the reserved frontier is an extension; when pages are short the
      victim rule preempts.
    reservation_quantile: q of "quantile" / "watermark", in (0, 1].
    policy: registered policy name, or a user's policy as
      ``module:Class`` or ``path/to/file.py:Class`` (``scheduler.policy_loader``;
      the conformance kit's fast profile runs on it when the engine is
      built, and a broken rule refuses it; docs/writing-a-policy.md).
    num_clients: size of the completed-service counter table.
    preemption_mode: how a preempted request's KV cache is recovered
      (§0x0C): "recompute" frees its pages and rebuilds the prefix later
      (REBUILD rows); "swap" copies the pages to host memory and back
      (exact preservation, no rebuild), falling back to recompute when the
      host swap space is full.
    swap_space_mb: host memory for preserved KV pages (MiB, "swap" only).
    force_preempt_every: 0, or N >= 2: every N-th decision preempts one
      decoding request (``scheduler.policy_forced``), a control for
      preemption/resume ablations and exactness checks.
    max_preemptions_per_request: a request preempted more often ends
      ``failed`` with that reason (no preemption livelock); 0 = no bound.
    enable_prefix_caching: automatic prefix caching (``serving.kv.prefix_cache``):
      full prompt pages are keyed by content and shared; a request starts
      its prefill after the longest cached prefix. On by default, as in
      vLLM; off for ablations.
    speculative: speculative decoding, "" (off) or "ngram:k=K,n=N"
      (``serving.engine.speculative.Speculation``: n-gram prompt lookup
      proposing up to K draft tokens per decode row). The policy is wrapped
      by ``scheduler.policy_speculative.FixedDraft``, which gives each
      decode row K drafts while its output cap, the token budget and the
      free pages allow; with ",adaptive=1,fixed_ms=F,row_ms=R" by
      ``AdaptiveDraft``, which picks one k' <= K per iteration by expected
      goodput. K + 1 <= the token budget. The simulated executor draws
      acceptance at ``spec_acceptance``.
  """

  max_num_seqs: int = 32
  max_num_batched_tokens: int = 256
  long_prefill_token_threshold: int = 256
  max_request_slots: int = 64
  max_queued_requests: int = 4096
  watermark_pages: int = 0
  reservation: str = "policy"
  reservation_quantile: float = 0.9
  policy: str = "sarathi_serve"
  num_clients: int = 64
  preemption_mode: str = "recompute"
  swap_space_mb: float = 1024.0
  force_preempt_every: int = 0
  max_preemptions_per_request: int = 64
  enable_prefix_caching: bool = True
  speculative: str = ""

  def __post_init__(self):
    _check_types(self, type(self).__name__)
    self._check_scheduler(type(self).__name__)

  @property
  def speculation(self):
    """The parsed ``speculative`` setting (``Speculation``), or None."""
    return Speculation.parse(self.speculative)

  def _check_scheduler(self, c: str) -> None:
    for f in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
              "num_clients"):
      _require(getattr(self, f) >= 1, c, f, "must be >= 1", getattr(self, f))
    _require(self.max_request_slots >= self.max_num_seqs, c, "max_request_slots",
             f"must be >= max_num_seqs ({self.max_num_seqs})", self.max_request_slots)
    _require(self.max_queued_requests >= self.max_request_slots, c,
             "max_queued_requests",
             f"must be >= max_request_slots ({self.max_request_slots})",
             self.max_queued_requests)
    _require(self.max_num_batched_tokens >= self.max_num_seqs, c,
             "max_num_batched_tokens", f"must be >= max_num_seqs ({self.max_num_seqs})",
             self.max_num_batched_tokens)
    _require(self.watermark_pages >= 0, c, "watermark_pages", "must be >= 0",
             self.watermark_pages)
    check_reservation(c, self.reservation, self.reservation_quantile, self.watermark_pages)
    check_policy_name(c, self.policy)
    _require(self.preemption_mode in PREEMPTION_MODES, c, "preemption_mode",
             f"must be one of {PREEMPTION_MODES}", self.preemption_mode)
    _require(self.swap_space_mb >= 0, c, "swap_space_mb", "must be >= 0",
             self.swap_space_mb)
    _require(self.force_preempt_every == 0 or self.force_preempt_every >= 2, c,
             "force_preempt_every", "must be 0 (off) or >= 2", self.force_preempt_every)
    _require(self.max_preemptions_per_request >= 0, c, "max_preemptions_per_request",
             "must be >= 0 (0 = no bound)", self.max_preemptions_per_request)
    spec = Speculation.parse(self.speculative, f"{c}.speculative")
    _require(spec is None or spec.k + 1 <= self.max_num_batched_tokens, c, "speculative",
             f"k must be <= max_num_batched_tokens - 1 = {self.max_num_batched_tokens - 1} "
             f"(a decode row and its drafts fit one token budget)", self.speculative)


@dataclasses.dataclass(frozen=True)
class ExecutorConfig:
  """What shapes the compiled model step and the KV cache: pages, context,
  buckets, numerics, kernels, the device mesh.

  Attributes:
    page_size: token rows per KV page.
    num_pages: physical KV pages, including the reserved null page.
    max_model_len: longest prompt + output (tokens).
    min_bucket: smallest token-row bucket (>= 2); buckets double up to the
      budget. Generated-token rows run their GEMMs in tiles of 2..32 rows
      and prompt rows in GEMMs of >= 64 rows (``models.llama.rowwise``), so
      small decode buckets keep a row's bits; 1 row would be a GEMM class
      of its own on CPU.
    attention_impl: "auto", or an implementation name of attention.ragged.
    dtype: "float32" or "bfloat16" for weights and activations.
    weights: "dense" (weights in ``dtype``) or "int8" (``models.quant``:
      int8 projection and LM-head weights with per-column scales, each
      projection's input rows quantized to int8 per row, int32 sums; a
      quarter of the weight bytes per step and still a request's tokens
      independent of its batch; its own numerics, not float32's). "int8"
      needs ``dtype`` "float32" (it is quantized from the float32 load) and
      one device (``mesh`` "").
    int8_gemm: the int8 GEMM of ``weights`` "int8" (``models.amx``): "amx"
      (Intel AMX tiles, weights stored in the tile layout and indexed by
      layer inside the kernel), "xla" (XLA:CPU's GEMM), or "auto" ("amx"
      where it runs, else "xla"). The same bits either way; a speed choice.
    decode_gemm: the GEMM of generated (non-prompt) rows' float32
      projections (``models.rowgemm``): "native" (a kernel whose rows are
      k-ordered fma chains: a row's bits independent of the row count at
      any count), "xla" (XLA:CPU's GEMM in 2..32-row tiles), or "auto"
      ("native" where it runs with ``dtype`` "float32", ``weights`` "dense"
      and no ``mesh``, else "xla"). The two round differently: part of a
      run's numerics (replay reports record it). Prompt rows run XLA's large
      GEMM either way.
    kv_dtype: the KV cache's dtype: "auto" (``dtype``), "float32" or
      "bfloat16" (on CPU stored as its bits, ``attention.ragged.KV_BITS``:
      half the bytes each decode step gathers; its own numerics, not
      float32's).
    max_stop_ids: stop token ids per request.
    prefill_chunk_rows: a token bucket of more rows runs its model step as a
      ``lax.scan`` over chunks of this many rows (``models.llama.forward``'s
      ``chunk_rows``): one program call with activations bounded by the
      chunk, the same bits as one invocation. A multiple of 8 (the attention
      kernel's query slots then line up with the whole bucket's; measured:
      chunks of 5-7 rows change a row's bits, 8, 16 and 24 do not), or 0 for
      no chunking.
    mesh: device mesh of the engine, ``"model:M"`` (or ``"data:1,model:M"``):
      tensor parallelism over M devices of this process (``models.sharding``:
      weights split Megatron-style, the KV cache on its KV-head axis,
      scheduler records replicated). ``""`` = one device.
  """

  page_size: int = 16
  num_pages: int = 2048
  max_model_len: int = 2048
  min_bucket: int = 64
  attention_impl: str = "auto"
  dtype: str = "float32"
  weights: str = "dense"
  int8_gemm: str = "auto"
  decode_gemm: str = "auto"
  kv_dtype: str = "auto"
  max_stop_ids: int = 8
  prefill_chunk_rows: int = 256
  mesh: str = ""

  def __post_init__(self):
    _check_types(self, type(self).__name__)
    self._check_executor(type(self).__name__)

  def _check_executor(self, c: str) -> None:
    for f in ("page_size", "num_pages", "max_model_len", "min_bucket"):
      _require(getattr(self, f) >= 1, c, f, "must be >= 1", getattr(self, f))
    _require(self.max_model_len >= 2, c, "max_model_len",
             "must be >= 2 (one prompt and one output token)", self.max_model_len)
    _require(self.min_bucket >= 2, c, "min_bucket",
             "must be >= 2 (a 1-row GEMM rounds differently on CPU)", self.min_bucket)
    _require(self.num_pages >= 2, c, "num_pages", "must be >= 2 (one is the null page)",
             self.num_pages)
    _require(self.dtype in ("float32", "bfloat16"), c, "dtype",
             "must be 'float32' or 'bfloat16'", self.dtype)
    _require(self.weights in WEIGHTS, c, "weights", f"must be one of {WEIGHTS}",
             self.weights)
    _require(self.weights == "dense" or self.dtype == "float32", c, "weights",
             f"must be 'dense' when dtype is {self.dtype!r} (int8 weights are quantized "
             f"from float32 and keep float32 activations)", self.weights)
    _require(self.weights == "dense" or not self.mesh, c, "weights",
             f"must be 'dense' with mesh {self.mesh!r} (int8 weights run on one device, "
             f"mesh '')", self.weights)
    _require(self.int8_gemm in INT8_GEMMS, c, "int8_gemm", f"must be one of {INT8_GEMMS}",
             self.int8_gemm)
    _require(self.int8_gemm != "amx" or self.weights == "int8", c, "int8_gemm",
             f"must be 'auto' or 'xla' with weights {self.weights!r} (the AMX kernel runs "
             f"int8 weights: set weights 'int8')", self.int8_gemm)
    _require(self.decode_gemm in DECODE_GEMMS, c, "decode_gemm",
             f"must be one of {DECODE_GEMMS}", self.decode_gemm)
    _require(self.decode_gemm != "native" or (self.dtype == "float32" and self.weights == "dense"
                                              and not self.mesh), c, "decode_gemm",
             f"must be 'auto' or 'xla' with dtype {self.dtype!r}, weights {self.weights!r}, "
             f"mesh {self.mesh!r} (the native kernel runs float32 dense weights on one "
             f"device)", self.decode_gemm)
    _require(self.kv_dtype in ("auto", "float32", "bfloat16"), c, "kv_dtype",
             "must be 'auto', 'float32' or 'bfloat16'", self.kv_dtype)
    _require(self.attention_impl in IMPLS, c, "attention_impl",
             f"must be one of {IMPLS}", self.attention_impl)
    _require(self.prefill_chunk_rows >= 0 and self.prefill_chunk_rows % 8 == 0, c,
             "prefill_chunk_rows", "must be 0 (off) or a positive multiple of 8",
             self.prefill_chunk_rows)
    parse_mesh(self.mesh)


@dataclasses.dataclass(frozen=True)
class HarnessConfig:
  """What the research harness swaps in: the executor kind and the virtual
  clock's cost model.

  Attributes:
    executor: "model" runs the model; "simulated" replaces only the model
      call (``serving.engine.sim_executor``: tokens up to each request's recorded
      output length, step time from the cost model on a virtual clock).
    cost_model: the step-time model of a virtual clock (``serving.engine.cost_model``):
      a calibration JSON, "profile:NAME" for an accelerator profile
      (``configs/accelerators``: a100, h100, h200, tpu_v5e, tpu_v6e), or "" for
      ``configs/calibration/cost_model_cpu.json``.
    role: "mixed" runs every request to its end; "prefill" runs a request's
      prompt, samples its first token and hands it off (finish reason
      "handoff", ``Engine.take_handoffs``); "decode" takes handed-off
      requests (``Engine.add_handoff``) and runs their decode rows
      (``serving.kv.transfer``; docs/scale-out.md).
    spec_acceptance: the simulated executor's per-token draft acceptance
      rate alpha, in (0, 1] with ``speculative`` set and the simulated
      executor (a verified row accepts the leading successes of
      Bernoulli(alpha) draws, ``sim_executor.accepted_drafts``); 0 (unset)
      otherwise: the model executor's drafts are accepted by its tokens.
    spec_seed: the seed of those draws (>= 0; with the request id and the
      output index it fixes each draw).
  """

  executor: str = "model"
  cost_model: str = ""
  role: str = "mixed"
  spec_acceptance: float = 0.0
  spec_seed: int = 0

  def __post_init__(self):
    _check_types(self, type(self).__name__)
    self._check_harness(type(self).__name__)

  def _check_harness(self, c: str) -> None:
    _require(self.executor in EXECUTORS, c, "executor", f"must be one of {EXECUTORS}",
             self.executor)
    _require(self.role in ROLES, c, "role", f"must be one of {ROLES}", self.role)
    _require(0.0 <= self.spec_acceptance <= 1.0, c, "spec_acceptance",
             "must be in [0, 1] (0: unset)", self.spec_acceptance)
    _require(self.spec_seed >= 0, c, "spec_seed", "must be an int >= 0", self.spec_seed)
    if self.cost_model.startswith("profile:"):
      profiles = profile_lib.profile_names()
      _require(self.cost_model[len("profile:"):] in profiles, c, "cost_model",
               f"must name a shipped accelerator profile, one of "
               f"{['profile:' + n for n in profiles]}", self.cost_model)
    elif self.cost_model:
      _require(Path(self.cost_model).is_file(), c, "cost_model",
               "must be an existing calibration JSON file, 'profile:NAME' or ''",
               self.cost_model)


@dataclasses.dataclass(frozen=True)
class EngineConfig(HarnessConfig, ExecutorConfig, SchedulerConfig):
  """An engine's whole configuration: its scheduler, executor and harness
  parts (``SchedulerConfig``, ``ExecutorConfig``, ``HarnessConfig``; each
  field is documented there) as one flat record, so presets, flags and
  reports name fields directly. ``scheduler_config``, ``executor_config``
  and ``harness_config`` give the parts.

  Raises:
    ValueError: ``EngineConfig.<field> <rule>, got <value>`` for the first
      field whose value is not of its type (``must be an int``, ...), else
      the first that breaks its part's rule or a rule across parts (the
      watermark within the KV cache).
  """

  def __post_init__(self):
    c = type(self).__name__
    _check_types(self, c)
    self._check_scheduler(c)
    self._check_executor(c)
    self._check_harness(c)
    simulated_spec = bool(self.speculative) and self.executor == "simulated"
    _require(not simulated_spec or 0.0 < self.spec_acceptance <= 1.0, c, "spec_acceptance",
             f"must be in (0, 1] with executor 'simulated' and speculative "
             f"{self.speculative!r} (the simulated drafts' acceptance rate)",
             self.spec_acceptance)
    draft = bool(self.speculative) and self.speculation.method == "draft"
    _require(not draft or self.executor == "simulated" or (not self.mesh and self.role == "mixed"),
             c, "speculative", "with a draft model runs on one device in a mixed engine (a "
             "mesh or a prefill/decode role would need the draft's KV split or handed off)",
             self.speculative)
    _require(simulated_spec or self.spec_acceptance == 0.0, c, "spec_acceptance",
             "must be 0 (unset) unless executor is 'simulated' and speculative is set "
             "(the model executor's tokens decide acceptance)", self.spec_acceptance)
    # Said of num_pages, the flag a user shrinks: with --watermark_pages set
    # alone, cli.flag_named adds "(set it with --num_pages)".
    _require(self.num_pages > self.watermark_pages, c, "num_pages",
             f"must be > watermark_pages = {self.watermark_pages} (page 0 is the null page; "
             f"the others must hold the pages kept free at admission: raise num_pages to at "
             f"least {self.watermark_pages + 1} or lower watermark_pages)", self.num_pages)

  def _part(self, cls):
    return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

  @property
  def scheduler_config(self) -> SchedulerConfig:
    return self._part(SchedulerConfig)

  @property
  def executor_config(self) -> ExecutorConfig:
    return self._part(ExecutorConfig)

  @property
  def harness_config(self) -> HarnessConfig:
    return self._part(HarnessConfig)

  @property
  def kv_cache_dtype(self) -> str:
    """The KV cache's dtype: ``kv_dtype``, or ``dtype`` for "auto"."""
    return self.dtype if self.kv_dtype == "auto" else self.kv_dtype

  @property
  def pages_per_seq(self) -> int:
    return -(-self.max_model_len // self.page_size)

  @property
  def token_buckets(self) -> Tuple[int, ...]:
    """Static token-row sizes the model step is compiled for."""
    buckets, size = [], min(self.min_bucket, self.max_num_batched_tokens)
    while size < self.max_num_batched_tokens:
      buckets.append(size)
      size *= 2
    buckets.append(self.max_num_batched_tokens)
    return tuple(buckets)

  def bucket_for(self, num_tokens: int) -> int:
    """The smallest token bucket holding ``num_tokens`` rows.

    Raises:
      ValueError: ``num_tokens`` exceeds the token budget.
    """
    i = int(bucket_index(self.token_buckets, num_tokens))
    if i == len(self.token_buckets):
      raise ValueError(f"num_tokens {num_tokens} exceeds the token budget "
                       f"{self.max_num_batched_tokens}")
    return self.token_buckets[i]

  def iteration_bucket(self, rows_bound, num_tokens, xp=np):
    """The token bucket an iteration runs in: that of its plan's
    ``PlanFacts.rows_bound`` (at least its rows and 1; at most the token
    budget), on the host (numpy: an int) or the device (``jax.numpy``:
    i32[] of traced i32[] facts); see ``Engine._execute`` for why the bound's
    bucket and not the plan's."""
    rows = xp.minimum(xp.maximum(xp.maximum(rows_bound, num_tokens), 1),
                      self.max_num_batched_tokens)
    if xp is np:
      return self.bucket_for(int(rows))
    buckets = xp.asarray(self.token_buckets, xp.int32)
    return buckets[xp.minimum(bucket_index(self.token_buckets, rows, xp), len(buckets) - 1)]

  @classmethod
  def preset(cls, name: str, **overrides) -> "EngineConfig":
    """Loads ``configs/<name>.json`` (or a JSON path) and applies overrides
    (those that are not None).

    Raises:
      ValueError: ``preset_fields``' refusals, or the config's (the class
        docstring) of the fields with the overrides.
    """
    fields = cls.preset_fields(name)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**fields)

  @classmethod
  def preset_fields(cls, name: str) -> dict:
    """The fields ``configs/<name>.json`` (or a JSON path) sets, each of its
    field's type but unchecked against the rules (``preset`` checks them).

    Raises:
      ValueError: no such preset; a file that cannot be read or is not JSON
        (naming it); JSON that is not an object; a field EngineConfig does
        not have; or ``<path>: EngineConfig.<field> must be <type>, got
        <value>`` for a value of the wrong type.
    """
    path = Path(name) if name.endswith(".json") else CONFIG_DIR / f"{name}.json"
    if not path.is_file():
      raise ValueError(f"engine preset {name!r} not found; known presets: {preset_names()}")
    try:
      fields = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
      raise ValueError(f"engine preset {str(path)!r} cannot be read ({e.strerror or e})") from None
    except ValueError as e:          # JSONDecodeError, UnicodeDecodeError
      raise ValueError(f"engine preset {str(path)!r} is not JSON ({e})") from None
    if not isinstance(fields, dict):
      raise ValueError(f"engine preset {str(path)!r} must hold a JSON object of EngineConfig "
                       f"fields, got a {type(fields).__name__}")
    fields.pop("description", None)
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    unknown = set(fields) - set(types)
    if unknown:
      raise ValueError(f"{path}: unknown EngineConfig fields {sorted(unknown)}")
    for field, value in fields.items():
      wanted = _wrong_type(types[field], value)
      if wanted is not None:
        raise ValueError(f"{path}: {cls.__name__}.{field} must be {wanted}, got {value!r}")
    return fields
