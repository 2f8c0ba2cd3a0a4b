"""Step-time cost model of one iteration: features from the model and the plan.

One file: the features, their fit, the accelerator profiles and the
calibration's device fingerprint are one contract (a calibration JSON is
read, checked against this device and evaluated by the same definitions
on the host and inside the simulated loop).

The modelled time of an iteration is a function of what the step computes
and moves, derived from the ``ModelConfig`` (``model_costs``) and the plan
(``plan_stats``), so that a fit holds across models and an accelerator's
published peaks give a first estimate without the accelerator:

  ======================  =============================================  =========
  feature                 what it counts                                 unit
  ======================  =============================================  =========
  step                    1 per iteration (host work, launch, sync)      step
  rows                    live token rows (per-row non-GEMM work)        row
  gemm_gflop              weight GEMMs over every row of the bucket      GFLOP
                          (the program runs the padded bucket)
  lm_head_gflop           the LM head on the rows that sample            GFLOP
  attention_gflop         query-key pairs (a chunk of c rows after s     GFLOP
                          cached keys: c*s + c(c+1)/2 pairs; a windowed
                          block sees at most its window)
  kv_read_gb              each scheduled sequence's cached K/V, read     GB
                          once per block per step
  weight_read_gb          the weights a step reads (MoE: every expert,   GB
                          an upper bound)
  prompt_gemm_gflop       the prompt rows' GEMM class: one GEMM over     GFLOP
                          the whole bucket, at least LARGE_GEMM_ROWS
                          rows, in a step with a prompt row
  extra_weight_read_gb    the weights read again by each GEMM pass past  GB
                          the first: a step with prompt rows and
                          generated rows (decode rows, recomputed
                          outputs) runs both classes, the generated rows
                          in tiles of ROW_TILE
  ======================  =============================================  =========

The last two say how this engine's row-wise projections run
(``models.llama.rowwise``: a row's bits depend only on its row class, so a
mixed step runs two GEMM passes); a calibration fits them beside the first
seven, and an accelerator profile leaves them at zero (one fused weight
pass per step, as a paper's engine would run).

``CostModel.coef_ms`` holds ms per unit of each feature (``step``'s is the
per-step term), so ``1000 / coef`` of a GFLOP or GB feature is the
throughput the fit measured (GFLOP/s, GB/s): the efficiencies of
``CostModel.efficiencies``. Two ways to combine the terms:

* ``"sum"``: every term adds (a fitted calibration; on a CPU the compute
  and memory phases of a step overlap little).
* ``"roofline"``: ``step + rows + max(compute terms, memory terms)``: an
  accelerator profile (``profile``), where a step is bound by the larger of
  its FLOPs at peak x efficiency and its bytes at bandwidth x efficiency
  (a fitted profile: the smooth bound ``CostModel.roofline_p``).

A fitted GPU profile (format 2, ``scripts/fit_profiles.py`` and
``serving.engine.profile_fit``, on measured per-operator GPU timings) adds
terms that depend on the model: a fixed time per GEMM and per row-wise
operator in every block, the row-wise operators' bytes, and under TP one
device's share plus the all-reduces. ``for_model`` (inside ``resolve``)
charges them into the ``step`` and ``rows`` coefficients for the model at
hand; ``all_reduce_ms`` and ``send_recv_ms`` are the collectives' one
definition. Where no calibration is named, ``resolve`` takes the shipped
CPU calibration of this machine's kind (``select_calibration``).

``scripts/calibrate.py`` measures the model executor on a grid and fits the
"sum" form by non-negative least squares (``fit``: ``scipy.optimize.nnls``);
the JSON names the models the grid ran, the dtype, engine preset, device
fingerprint (``device_fingerprint``) and load average. ``resolve`` is how
the engine takes one: a calibration fitted on one model predicts only that
model (its weight term cannot be told from the per-step term); one fitted on
two or more models, or a profile, predicts any model through its features.
Linear per-iteration cost models are what Vidur (Agrawal et al., MLSys 2024)
fits per operator; the roofline bound is Williams et al. (CACM 2009).

``model_costs(cfg)`` derives a model's cost features from its
``ModelConfig`` alone (FLOPs per row, weight and KV bytes, attention FLOPs
per query-key pair).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.sharding import parse_mesh
from models.llama import LARGE_GEMM_ROWS, ROW_TILE
from scheduler import records as rec

FEATURES = ("step", "rows", "gemm_gflop", "lm_head_gflop", "attention_gflop",
            "kv_read_gb", "weight_read_gb", "prompt_gemm_gflop", "extra_weight_read_gb")
COMPUTE = ("gemm_gflop", "lm_head_gflop", "attention_gflop", "prompt_gemm_gflop")
MEMORY = ("kv_read_gb", "weight_read_gb", "extra_weight_read_gb")
# Features a calibration written before the row-class features lacks: read
# as 0 (what that calibration's predictions already assumed).
ADDED_FEATURES = ("prompt_gemm_gflop", "extra_weight_read_gb")
COMBINES = ("sum", "roofline")
_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CALIBRATION = _CONFIGS / "calibration" / "cost_model_cpu.json"
PROFILE_DIR = _CONFIGS / "accelerators"
PROFILE_PREFIX = "profile:"
# Bytes per stored element of a weight or KV dtype name.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


@dataclasses.dataclass(frozen=True)
class ModelCosts:
  """A model's per-step cost features, from its config alone.

  FLOPs count a multiply-add as 2. Sums are over all ``n_layers`` blocks.
  Biases, norms, RoPE, activations, routing's top-k and sampling are left
  out (each under 1% of a projection's FLOPs at real widths).

  Attributes:
    gemm_flops_per_row: FLOPs of one token row's weight GEMMs in all blocks:
      the q/k/v/o projections plus the MLP (dense: gate, up, down of width
      ``ffn_dim``; MoE: the router's ``d_model x num_experts`` and the MLPs
      of the ``experts_per_token`` experts the row is routed to).
    lm_head_flops_per_row: FLOPs of the LM head for one live row
      (``2 * d_model * vocab_size``; the engine computes it for the rows
      that sample only).
    attention_flops_per_pair: FLOPs of one (query row, cached key) pair in
      all blocks: scores ``q . k`` and the weighted sum of ``v``
      (``4 * n_heads * head_dim`` per block). A windowed block (``windows``)
      counts only the keys inside its window: ``attention_flops``.
    kv_bytes_per_token: bytes one cached token holds in all blocks (K and
      V, ``2 * n_kv_heads * head_dim`` elements per block, in ``kv_dtype``).
    weight_bytes_per_step: bytes of the weights one model step reads, in
      ``weight_dtype``: every block's projections, norms and biases, the MLP
      (MoE: the router and every expert, an upper bound: a step reads only
      the experts its rows route to) and the LM head (the tied embedding
      counted once; an untied embedding is only gathered by row, not read).
    expert_bytes: bytes of one expert's three matrices in all blocks (0 for
      a dense model); a step whose rows hit ``h`` experts per block reads
      ``weight_bytes_per_step - (num_experts - h) * expert_bytes``.
    weight_bytes: every parameter (the embedding included), in
      ``weight_dtype``: the model's memory.
    windows: per block, its sliding window in tokens (0: global);
      ``ModelConfig.layer_windows`` or all zeros.
    weight_dtype, kv_dtype: the dtype names the byte counts are for (int8
      weights: one byte per element, per-column scales left out).
    tp: the tensor-parallel degree the engine runs (``EngineConfig.mesh``'s
      model axis). The fields above are the whole model's; a fitted
      profile charges one device's share (``for_model``).
    row_bytes_per_row: bytes one token row moves through a device's
      row-wise operators in all blocks (``ROW_OPS_PER_BLOCK``: two norms
      of ``d_model`` read and written, the residual add's two reads and
      one write, RoPE over the device's q and k heads, the MLP activation
      over its share of the width: gate and up read, one written), in the
      activation dtype (``activation_dtype``).
    all_reduce_bytes_per_row: bytes one row adds to each of a block's
      ``ALL_REDUCES_PER_BLOCK`` all-reduces under TP (``d_model`` in the
      activation dtype).
  """

  gemm_flops_per_row: int
  lm_head_flops_per_row: int
  attention_flops_per_pair: int
  kv_bytes_per_token: int
  weight_bytes_per_step: int
  expert_bytes: int
  weight_bytes: int
  windows: tuple
  weight_dtype: str
  kv_dtype: str
  tp: int = 1
  row_bytes_per_row: int = 0
  all_reduce_bytes_per_row: int = 0

  def attention_flops(self, num_keys: int) -> int:
    """FLOPs of one query row that attends ``num_keys`` cached keys (its own
    included), all blocks; a windowed block sees at most its window."""
    per_block = self.attention_flops_per_pair // len(self.windows)
    return sum(per_block * (min(num_keys, w) if w else num_keys) for w in self.windows)

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self), "windows": list(self.windows)}


def activation_dtype(weight_dtype: str) -> str:
  """The dtype a model's activations run in: its weights' (int8 weights
  compute in float32)."""
  return "float32" if weight_dtype == "int8" else weight_dtype


def model_costs(cfg: ModelConfig, weight_dtype: str = "float32",
                kv_dtype: str | None = None, tp: int = 1) -> ModelCosts:
  """The cost features of ``cfg`` (``ModelCosts``; a pure function).

  Args:
    cfg: the model's config (any family).
    weight_dtype: "float32", "bfloat16", "float16" or "int8".
    kv_dtype: the KV cache's dtype name; None: ``weight_dtype`` (int8
      weights keep a float32 cache).
    tp: tensor-parallel degree (>= 1): the per-device row-wise bytes.

  Raises:
    ValueError: a dtype name outside ``DTYPE_BYTES``, or ``tp < 1``.
  """
  if kv_dtype is None:
    kv_dtype = "float32" if weight_dtype == "int8" else weight_dtype
  for name, value in (("weight_dtype", weight_dtype), ("kv_dtype", kv_dtype)):
    if value not in DTYPE_BYTES:
      raise ValueError(f"model_costs: {name} must be one of {sorted(DTYPE_BYTES)}, "
                       f"got {value!r}")
  if not (isinstance(tp, int) and tp >= 1):
    raise ValueError(f"model_costs: tp must be an int >= 1, got {tp!r}")
  d, f, layers = cfg.d_model, cfg.ffn_dim, cfg.n_layers
  attn_weights = d * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * d
  expert = 3 * d * f                                       # gate, up, down
  if cfg.is_moe:
    mlp_flops = 2 * (d * cfg.num_experts + cfg.experts_per_token * expert)
    mlp_weights = d * cfg.num_experts + cfg.num_experts * expert
  else:
    mlp_flops, mlp_weights = 2 * expert, expert
  small = (2 + 2 * cfg.post_norms) * d                     # norm scales
  small += (cfg.q_dim + 2 * cfg.kv_dim) * cfg.qkv_bias + d * cfg.o_bias
  small += 2 * cfg.head_dim * cfg.qk_norm
  block = attn_weights + mlp_weights + small
  head = d * cfg.vocab_size
  step_elements = layers * block + d + head                # + final norm
  all_elements = step_elements + (0 if cfg.tie_embeddings else cfg.vocab_size * d)
  wb, kb = DTYPE_BYTES[weight_dtype], DTYPE_BYTES[kv_dtype]
  ab = DTYPE_BYTES[activation_dtype(weight_dtype)]
  width = f * (cfg.experts_per_token if cfg.is_moe else 1)
  # Norms 2 x (read + write) d, add 2 reads + 1 write of d, RoPE read and
  # write of the device's q and k, activation: gate and up read, one written.
  row_elements = 7 * d + (2 * (cfg.q_dim + cfg.kv_dim) + 3 * width) / tp
  return ModelCosts(
      gemm_flops_per_row=layers * (2 * attn_weights + mlp_flops),
      lm_head_flops_per_row=2 * head,
      attention_flops_per_pair=layers * 4 * cfg.n_heads * cfg.head_dim,
      kv_bytes_per_token=layers * 2 * cfg.kv_dim * kb,
      weight_bytes_per_step=step_elements * wb,
      expert_bytes=layers * expert * wb if cfg.is_moe else 0,
      weight_bytes=all_elements * wb,
      windows=tuple(cfg.layer_windows) or (0,) * layers,
      weight_dtype=weight_dtype, kv_dtype=kv_dtype, tp=tp,
      row_bytes_per_row=int(round(layers * row_elements * ab)),
      all_reduce_bytes_per_row=d * ab)


def engine_model_costs(cfg: ModelConfig, engine_config) -> ModelCosts:
  """``model_costs`` of ``cfg`` in an ``EngineConfig``'s weight and KV dtypes
  (int8 weights when ``engine_config.weights`` is "int8", else its
  ``dtype``; the cache in ``kv_cache_dtype``) and its mesh's model axis
  (the TP degree)."""
  weights = "int8" if engine_config.weights == "int8" else engine_config.dtype
  tp = parse_mesh(getattr(engine_config, "mesh", "") or "")["model"]
  return model_costs(cfg, weights, engine_config.kv_cache_dtype, tp=tp)


def plan_stats(plan: rec.IterationPlan, windows: tuple = (0,), prompt_len=None):
  """The plan's side of the step features, on device (``step_features``
  combines them with the model's ``ModelCosts`` on the host).

  Args:
    plan: the iteration's plan (selected intervals [start, end) per slot).
    windows: static, the model's distinct attention windows
      (``ModelConfig.window_kinds``; 0 = global), ascending.
    prompt_len: i32[R] each slot's prompt length (the manifest's), which
      splits rows into the prompt and generated GEMM classes; None: every
      non-decode row counts as a prompt row.
  Returns:
    f32[4 + 2 * len(windows)]: prefill rows (prompt and rebuild rows),
    decode rows, scheduled sequences, rows at prompt positions (below the
    request's prompt length); then per window w the query-key pairs
    one block of that window computes (a row at position j sees
    ``min(j + 1, w)`` keys, all ``j + 1`` for w = 0); then per window the
    cached keys one block reads (``min(end, w)`` per sequence).
  """
  sel = plan.selected
  start = plan.start.astype(jnp.float32)
  end = plan.end.astype(jnp.float32)
  rows = jnp.where(sel, end - start, 0.0)
  decode = sel & (plan.kind == rec.DECODE_ROW)
  prefill = jnp.sum(jnp.where(decode, 0.0, rows))
  if prompt_len is None:
    prompt_rows = prefill
  else:
    below = jnp.maximum(jnp.minimum(end, prompt_len.astype(jnp.float32)) - start, 0.0)
    prompt_rows = jnp.sum(jnp.where(sel, below, 0.0))
  out = [prefill, jnp.sum(decode).astype(jnp.float32), jnp.sum(sel).astype(jnp.float32),
         prompt_rows]
  pairs, keys = [], []
  for w in windows:
    if w == 0:
      pair = rows * (start + end + 1.0) / 2.0
      key = end
    else:       # sum over k in [start + 1, end] of min(k, w)
      lo, top = start + 1.0, jnp.minimum(end, float(w))
      ramp = jnp.where(top >= lo, (lo + top) * (top - lo + 1.0) / 2.0, 0.0)
      flat = jnp.maximum(end - jnp.maximum(start, float(w)), 0.0) * float(w)
      pair, key = ramp + flat, jnp.minimum(end, float(w))
    pairs.append(jnp.sum(jnp.where(sel, pair, 0.0)))
    keys.append(jnp.sum(jnp.where(sel, key, 0.0)))
  return jnp.stack(out + pairs + keys)


def step_features(stats, bucket: int, costs: ModelCosts, xp=np) -> np.ndarray:
  """f64[len(FEATURES)]: one step's ``FEATURES`` values; with ``xp``
  ``jax.numpy``, of traced ``stats`` and ``bucket`` in JAX's default float
  (float64 in a ``jax.enable_x64`` scope, where the simulated loop charges
  its steps on the device by this same definition).

  Args:
    stats: ``plan_stats`` of the step's plan (for ``costs``' windows).
    bucket: the token-row bucket the step needs (its GEMMs run every row).
    costs: the model's ``ModelCosts`` (in the engine's dtypes).
    xp: ``numpy`` (host) or ``jax.numpy`` (device).
  Raises:
    ValueError: ``stats`` is not for ``costs``' windows.
  """
  kinds = tuple(sorted(set(costs.windows)))
  dtype = xp.result_type(float)
  stats = xp.asarray(stats, dtype)
  bucket = xp.asarray(bucket, dtype)
  if stats.shape != (4 + 2 * len(kinds),):
    raise ValueError(f"step_features: stats of shape {stats.shape} do not match the model's "
                     f"{len(kinds)} window kind(s) {kinds}")
  prefill, decode, seqs, prompt = stats[:4]
  pairs, keys = stats[4:4 + len(kinds)], stats[4 + len(kinds):]
  generated = prefill + decode - prompt        # decode rows, recomputed outputs
  if costs.weight_dtype == "int8":      # one GEMM over every row (rowwise(exact=True))
    prompt_rows, passes = bucket, 1.0
  else:
    prompt_rows = xp.where(prompt > 0, xp.maximum(bucket, LARGE_GEMM_ROWS), 0.0)
    passes = (prompt > 0) + xp.ceil(generated / ROW_TILE)
  blocks = np.array([sum(1 for w in costs.windows if w == k) for k in kinds], np.float64)
  layers = len(costs.windows)
  pair_flops = xp.asarray(blocks * (costs.attention_flops_per_pair / layers), dtype)
  key_bytes = xp.asarray(blocks * (costs.kv_bytes_per_token / layers), dtype)
  return xp.stack([xp.asarray(v, dtype) for v in (
      1.0,
      prefill + decode,
      bucket * costs.gemm_flops_per_row / 1e9,
      seqs * costs.lm_head_flops_per_row / 1e9,
      (pairs @ pair_flops) / 1e9,
      (keys @ key_bytes) / 1e9,
      costs.weight_bytes_per_step / 1e9,
      prompt_rows * costs.gemm_flops_per_row / 1e9,
      xp.maximum(passes - 1.0, 0.0) * costs.weight_bytes_per_step / 1e9,
  )])


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Step-time model over ``FEATURES``.

  Attributes:
    coef_ms: ms per unit of each of ``FEATURES`` (``step``: ms per
      iteration; GFLOP and GB features: ms per GFLOP / GB), all >= 0.
    combine: "sum" (every term adds) or "roofline" (``step`` and ``rows``
      terms plus the larger of the ``COMPUTE`` and the ``MEMORY`` terms).
    min_step_ms: floor of a prediction (ms, >= 0).
    roofline_p: how "roofline" joins the compute and memory sums C and M:
      ``(C**p + M**p) ** (1/p)``; inf (default): ``max(C, M)``, the sharp
      roofline. A fitted profile's p (about 1.2-1.5) says a GEMM near its
      ridge point runs slower than either bound alone.
    tile: () or one value per feature of ``FEATURES``: a value > 0 rounds
      that feature up to a multiple of it before it is charged (a fitted
      profile's GEMM row tile: the GFLOP of one tile of rows, ``for_model``).
    meta: where it holds: ``models`` (the ``ModelCosts`` JSON of each model
      its fit ran; empty: stated model-independent, as a profile),
      ``device`` (``device_fingerprint``), dtype, engine preset, load
      average, grid, residuals, ``uncalibrated`` for a profile; carried
      into reports.
  Raises:
    ValueError: a coefficient count other than ``len(FEATURES)``, a
      negative coefficient, an unknown ``combine``, ``min_step_ms < 0`` or
      ``roofline_p < 1``.
  """

  coef_ms: tuple
  combine: str = "sum"
  min_step_ms: float = 0.0
  meta: dict = dataclasses.field(default_factory=dict, compare=False)
  roofline_p: float = math.inf
  tile: tuple = ()

  def __post_init__(self):
    if len(self.coef_ms) != len(FEATURES):
      raise ValueError(f"CostModel.coef_ms needs {len(FEATURES)} values {FEATURES}, "
                       f"got {len(self.coef_ms)}")
    if any(not c >= 0 for c in self.coef_ms):
      raise ValueError(f"CostModel.coef_ms must all be >= 0, got {self.coef_ms}")
    if self.combine not in COMBINES:
      raise ValueError(f"CostModel.combine must be one of {COMBINES}, got {self.combine!r}")
    if not self.min_step_ms >= 0:
      raise ValueError(f"CostModel.min_step_ms must be >= 0, got {self.min_step_ms}")
    if not self.roofline_p >= 1:
      raise ValueError(f"CostModel.roofline_p must be >= 1 (inf: max), got {self.roofline_p}")
    if self.tile and (len(self.tile) != len(FEATURES) or any(not t >= 0 for t in self.tile)):
      raise ValueError(f"CostModel.tile must be () or {len(FEATURES)} values >= 0, "
                       f"got {self.tile}")
    object.__setattr__(self, "tile", tuple(float(t) for t in self.tile))
    object.__setattr__(self, "coef_ms", tuple(float(c) for c in self.coef_ms))

  @classmethod
  def of(cls, combine: str = "sum", min_step_ms: float = 0.0, meta: Optional[dict] = None,
         **coef_ms) -> "CostModel":
    """A model from named coefficients (the rest 0), e.g.
    ``CostModel.of(step=5.0, rows=0.5)``; raises ValueError on an unknown name."""
    unknown = sorted(set(coef_ms) - set(FEATURES))
    if unknown:
      raise ValueError(f"CostModel.of: unknown feature(s) {unknown}; features are {FEATURES}")
    return cls(tuple(float(coef_ms.get(f, 0.0)) for f in FEATURES), combine, min_step_ms,
               dict(meta or {}))

  def terms_ms(self, features: Sequence[float], xp=np) -> Dict[str, float]:
    """Each feature's term (ms) of one step's ``FEATURES`` values (floats;
    with ``xp`` ``jax.numpy``, traced scalars)."""
    value = float if xp is np else (lambda x: x)
    out = {}
    for i, (f, c, x) in enumerate(zip(FEATURES, self.coef_ms, features)):
      x = value(x)
      if self.tile and self.tile[i] > 0:
        x = xp.ceil(x / self.tile[i] - 1e-9) * self.tile[i]
      out[f] = c * (float(x) if xp is np else x)
    return out

  def predict_ms(self, features: Sequence[float], xp=np) -> float:
    """Modelled step time (ms) of one step's ``FEATURES`` values: a float
    on the host; with ``xp`` ``jax.numpy``, a traced scalar (the simulated
    loop's step time on the device, float64 in its ``jax.enable_x64``
    scope, by the same definition)."""
    if self.meta.get("per_model") and not self.meta.get("for_model"):
      raise ValueError(f"cost model {self.meta.get('profile', '')!r} has per-model terms "
                       f"(fitted operator and collective costs): resolve(model, costs) "
                       f"first, which charges them for the model at hand")
    t = self.terms_ms(features, xp)
    if self.combine == "sum":
      total = sum(t.values())
    else:
      compute, memory = sum(t[f] for f in COMPUTE), sum(t[f] for f in MEMORY)
      if math.isinf(self.roofline_p):
        bound = xp.maximum(compute, memory)
      else:
        p = self.roofline_p
        bound = (compute ** p + memory ** p) ** (1.0 / p)
      total = t["step"] + t["rows"] + bound
    total = xp.maximum(self.min_step_ms, total)
    return float(total) if xp is np else total

  def efficiencies(self) -> Dict[str, float]:
    """Throughput each GFLOP / GB term stands for (GFLOP/s or GB/s:
    ``1000 / coef``; inf for a zero coefficient, a term the fit found free)."""
    return {f: (1000.0 / c if c > 0 else float("inf"))
            for f, c in zip(FEATURES, self.coef_ms) if f in COMPUTE + MEMORY}

  @property
  def models(self) -> list:
    """The ``ModelCosts`` JSON of each model the fit ran (empty: any model)."""
    return list(self.meta.get("models", []))

  def to_json(self) -> dict:
    out = {"features": list(FEATURES), "coef_ms": dict(zip(FEATURES, self.coef_ms)),
           "combine": self.combine, "min_step_ms": self.min_step_ms, "meta": self.meta}
    if not math.isinf(self.roofline_p):
      out["roofline_p"] = self.roofline_p
    if self.tile:
      out["tile"] = dict(zip(FEATURES, self.tile))
    return out

  def save(self, path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")


def from_json(d: dict, where: str) -> CostModel:
  """A ``CostModel`` from its JSON (``CostModel.to_json``).

  Raises:
    ValueError: naming ``where`` and the missing feature, e.g. a calibration
      of the old row-count form (re-run ``scripts/calibrate.py``).
  """
  coef = dict(d.get("coef_ms", {}))
  if all(f in coef for f in FEATURES if f not in ADDED_FEATURES):
    coef = {f: 0.0 for f in ADDED_FEATURES} | coef    # written before the row classes
  missing = [f for f in FEATURES if f not in coef]
  if missing:
    raise ValueError(f"{where}: cost model needs coef_ms for every feature {list(FEATURES)}; "
                     f"missing {missing} (a calibration of another form: re-run "
                     f"scripts/calibrate.py)")
  return CostModel(tuple(coef[f] for f in FEATURES), d.get("combine", "sum"),
                   float(d.get("min_step_ms", 0.0)), dict(d.get("meta", {})),
                   float(d.get("roofline_p", math.inf)),
                   tuple(d["tile"].get(f, 0.0) for f in FEATURES) if d.get("tile") else ())


def load(path=None) -> CostModel:
  """Reads a calibration JSON (default ``DEFAULT_CALIBRATION``, marked
  ``meta["chosen"] = "default"``: ``resolve`` then takes the shipped
  calibration of this machine's kind instead) or, for ``"profile:NAME"``,
  an accelerator profile (``profile``).

  Raises:
    ValueError: missing file or profile, or a file of another form.
  """
  if path and str(path).startswith(PROFILE_PREFIX):
    return profile(str(path)[len(PROFILE_PREFIX):])
  chosen = bool(path)
  path = Path(path) if path else DEFAULT_CALIBRATION
  if not path.exists():
    raise ValueError(f"cost model file {str(path)!r} not found (write one with "
                     f"scripts/calibrate.py, or use --cost_model={PROFILE_PREFIX}NAME for one of "
                     f"{profile_names()})")
  model = from_json(json.loads(path.read_text()), str(path))
  model.meta["path"] = path.name
  if not chosen:
    # None named: ``resolve`` picks the shipped calibration of this
    # machine's kind (``select_calibration``) for the model at hand.
    model.meta["chosen"] = "default"
  return model


def profile_names() -> list:
  """The accelerator profiles shipped in ``configs/accelerators``."""
  return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


# The operators of one block a fitted profile charges (the measured ones):
# four weight GEMMs (QKV, output, MLP up with its gate, down) and five
# row-wise operators (two norms, RoPE, the MLP activation, the residual add);
# under TP two all-reduces (after the output and the down projections).
GEMMS_PER_BLOCK = 4
ROW_OPS_PER_BLOCK = 5
ALL_REDUCES_PER_BLOCK = 2
PROFILE_FORMATS = (1, 2)
_PROFILE_KEYS = ("device", "source", "assumptions", "peak_tflops", "hbm_gbps", "step_ms",
                 "row_ms", "efficiency")
_FITTED_KEYS = ("operators", "collectives", "roofline_p", "fitted")


@dataclasses.dataclass(frozen=True)
class Link:
  """A transfer's time: ``latency_ms + bytes / (gbps * 1e6)`` ms (a
  latency-bandwidth model fitted to measured collective times)."""

  latency_ms: float
  gbps: float

  def ms(self, nbytes):
    """Time (ms) of a message of ``nbytes`` bytes (a float or an array)."""
    return self.latency_ms + nbytes / (self.gbps * 1e6)


def _link(d: dict, where: str) -> Link:
  try:
    link = Link(float(d["latency_ms"]), float(d["gbps"]))
  except (KeyError, TypeError, ValueError):
    raise ValueError(f"{where} must be {{'latency_ms': >= 0, 'gbps': > 0}}, got {d!r}") from None
  if not (link.latency_ms >= 0 and link.gbps > 0):
    raise ValueError(f"{where} must have latency_ms >= 0 and gbps > 0, got {d!r}")
  return link


def all_reduce_ms(model: CostModel, nbytes, workers: int):
  """Time (ms) of one all-reduce of ``nbytes`` bytes over ``workers`` devices
  of one node, from the profile's measured collectives (``Link`` of the
  largest fitted worker count <= ``workers``; 0 for one worker).

  Raises:
    ValueError: the model states no measured all-reduce (a profile not
      fitted, a CPU calibration), or ``workers`` below the smallest fitted.
  """
  if workers == 1:
    return 0.0 * nbytes
  table = model.meta.get("per_model", {}).get("collectives", {}).get("all_reduce")
  if not table:
    raise ValueError(f"cost model {model.meta.get('profile') or model.meta.get('path')!r} "
                     f"states no measured all-reduce times (a fitted GPU profile does)")
  fitted = sorted(int(w) for w in table)
  below = [w for w in fitted if w <= workers]
  if not below:
    raise ValueError(f"all_reduce_ms: workers must be 1 or >= {fitted[0]} (fitted for "
                     f"{fitted}), got {workers}")
  return _link(table[str(below[-1])], f"all_reduce[{below[-1]}]").ms(nbytes)


def send_recv_ms(model: CostModel, nbytes, *, same_node: bool = True):
  """Time (ms) to send ``nbytes`` bytes from one device to another (in the
  same node over NVLink, or ``same_node=False`` to another node), from the
  profile's measured send/recv: what a KV-cache transfer between replicas
  costs.

  Raises:
    ValueError: the model states no measured send/recv.
  """
  table = model.meta.get("per_model", {}).get("collectives", {}).get("send_recv")
  where = "same_node" if same_node else "other_node"
  if not table or where not in table:
    raise ValueError(f"cost model {model.meta.get('profile') or model.meta.get('path')!r} "
                     f"states no measured send/recv ({where}; a fitted GPU profile does)")
  return _link(table[where], f"send_recv[{where}]").ms(nbytes)


def read_profile(path) -> dict:
  """A profile JSON, checked (``profile`` builds the model of it).

  Format 1 (no ``format`` field): published peaks x stated efficiencies.
  Format 2 adds what a fit to measured operator timings gives
  (``scripts/fit_profiles.py``): ``operators`` (``gemm_op_ms`` and
  ``row_op_ms``, the fixed time of each GEMM and row-wise operator, and
  ``row_gbps``, the row-wise operators' bandwidth), ``collectives``
  (``all_reduce`` by worker count and ``send_recv`` by ``same_node`` /
  ``other_node``, each ``{latency_ms, gbps}``), ``roofline_p`` and
  ``fitted`` (what it was fitted to, and its held-out error).

  Raises:
    ValueError: naming the file and the missing or bad field.
  """
  p = json.loads(Path(path).read_text())
  fmt = p.get("format", 1)
  if fmt not in PROFILE_FORMATS:
    raise ValueError(f"profile {Path(path).name}: format must be one of {PROFILE_FORMATS}, "
                     f"got {fmt!r} (written by a newer version?)")
  need = _PROFILE_KEYS + (_FITTED_KEYS if fmt == 2 else ())
  missing = [k for k in need if k not in p]
  missing += [f"efficiency.{k}" for k in ("gemm", "lm_head", "attention", "memory")
              if k not in p.get("efficiency", {})]
  if fmt == 2:
    missing += [f"operators.{k}" for k in ("gemm_op_ms", "row_op_ms", "row_gbps")
                if k not in p.get("operators", {})]
  if missing:
    raise ValueError(f"profile {Path(path).name} (format {fmt}) lacks {missing}")
  return p


def profile(name: str) -> CostModel:
  """An accelerator's roofline cost model from its profile JSON
  (``read_profile``).

  Each compute and memory term's coefficient is ``1000 / (peak *
  efficiency)``. Format 1 is marked ``uncalibrated`` in its meta (and every
  report that carries it). Format 2 (fitted) carries its operator and
  collective terms in ``meta["per_model"]``: they depend on the model's
  blocks, widths and TP degree, so ``resolve`` (``for_model``) charges them
  before the model predicts.

  Raises:
    ValueError: no such profile (naming the ones there are), or a file
      ``read_profile`` refuses.
  """
  path = PROFILE_DIR / f"{name}.json"
  if not path.exists():
    raise ValueError(f"cost model profile {name!r} not found; profiles: {profile_names()}")
  p = read_profile(path)
  eff = p["efficiency"]
  flops_s = p["peak_tflops"] * 1e3            # GFLOP/s
  coef = dict(step=p["step_ms"], rows=p["row_ms"],
              gemm_gflop=1000.0 / (flops_s * eff["gemm"]),
              lm_head_gflop=1000.0 / (flops_s * eff["lm_head"]),
              attention_gflop=1000.0 / (flops_s * eff["attention"]),
              kv_read_gb=1000.0 / (p["hbm_gbps"] * eff["memory"]),
              weight_read_gb=1000.0 / (p["hbm_gbps"] * eff["memory"]))
  meta = dict(profile=name, models=[], device={"kind": p["device"]},
              source=p["source"], assumptions=p["assumptions"])
  if p.get("format", 1) == 1:
    return CostModel.of(combine="roofline", meta=dict(meta, uncalibrated=True), **coef)
  meta.update(fitted=p["fitted"], per_model=dict(operators=p["operators"],
                                                 collectives=p["collectives"]))
  model = CostModel.of(combine="roofline", meta=meta, **coef)
  return dataclasses.replace(model, roofline_p=float(p["roofline_p"]))


def for_model(model: CostModel, costs: ModelCosts) -> CostModel:
  """A roofline profile charged for one model at its TP degree.

  Every compute and memory term is one device's share (``1 / costs.tp`` of
  the model's FLOPs and bytes). A fitted profile (``meta["per_model"]``)
  adds, per step, with B blocks:

  * ``step``: ``(GEMMS_PER_BLOCK * B + 1) * gemm_op_ms`` (the LM head is one
    more GEMM) ``+ ROW_OPS_PER_BLOCK * B * row_op_ms``, and under TP
    ``ALL_REDUCES_PER_BLOCK * B`` all-reduce latencies;
  * ``rows`` (per live row): ``row_bytes_per_row / row_gbps`` and under TP
    the all-reduces' ``all_reduce_bytes_per_row`` at their bandwidth;
  * ``tile``: the GEMM features (``gemm_gflop``, ``lm_head_gflop``,
    ``prompt_gemm_gflop``) rounded up to whole tiles of ``gemm_row_tile``
    rows (``operators.gemm_row_tile``; 1 or absent: no rounding).

  A "sum" calibration (measured on this kind of device as it runs) is
  returned unchanged, as is a profile already charged.
  """
  if model.combine != "roofline" or model.meta.get("for_model"):
    return model
  coef = dict(zip(FEATURES, model.coef_ms))
  tp = costs.tp
  for f in COMPUTE + MEMORY:
    coef[f] /= tp
  meta = dict(model.meta, for_model=dict(tp=tp, blocks=len(costs.windows)))
  terms = model.meta.get("per_model")
  if terms:
    ops, blocks = terms["operators"], len(costs.windows)
    coef["step"] += ((GEMMS_PER_BLOCK * blocks + 1) * ops["gemm_op_ms"]
                     + ROW_OPS_PER_BLOCK * blocks * ops["row_op_ms"])
    coef["rows"] += costs.row_bytes_per_row / (ops["row_gbps"] * 1e6)
    if tp > 1:
      per_step = ALL_REDUCES_PER_BLOCK * blocks
      coef["step"] += per_step * all_reduce_ms(model, 0.0, tp)
      coef["rows"] += per_step * (all_reduce_ms(model, costs.all_reduce_bytes_per_row, tp)
                                  - all_reduce_ms(model, 0.0, tp))
    rows = float(ops.get("gemm_row_tile", 1.0))
    if rows > 1:
      per_row = dict(gemm_gflop=costs.gemm_flops_per_row,
                     prompt_gemm_gflop=costs.gemm_flops_per_row,
                     lm_head_gflop=costs.lm_head_flops_per_row)
      tile = tuple(rows * per_row[f] / 1e9 if f in per_row else 0.0 for f in FEATURES)
      model = dataclasses.replace(model, tile=tile)
  return dataclasses.replace(model, coef_ms=tuple(coef[f] for f in FEATURES), meta=meta)


def fit(features, step_ms, *, free: Sequence[str] = FEATURES, min_step_ms: float = 0.0,
        meta: Dict = None, nonnegative: bool = True) -> CostModel:
  """Least-squares fit of the "sum" model.

  With ``nonnegative`` (default) every coefficient is constrained to >= 0
  (``scipy.optimize.nnls``): a row, a FLOP or a byte never saves time, and
  on collinear grids an unconstrained fit can trade a large negative
  coefficient for a large positive one. Otherwise ``numpy.linalg.lstsq``
  (a negative result is then refused by ``CostModel``).

  Args:
    features: f64[N, len(FEATURES)] rows of ``step_features``.
    step_ms: f64[N] measured step times (ms).
    free: the features fitted; the others are held at 0 (a grid on one
      model cannot tell ``weight_read_gb`` from ``step``: leave it out).
  Returns:
    a CostModel whose ``meta`` adds the fit's RMS and max absolute residual
    (ms), the median relative residual, the number of samples and the
    RMS residual each fitted feature's removal would leave
    (``residual_without``: what each term earns).
  Raises:
    ValueError: shapes disagree, an unknown feature in ``free``, or fewer
      samples than unknowns.
  """
  x = np.asarray(features, np.float64)
  y = np.asarray(step_ms, np.float64)
  if x.ndim != 2 or x.shape[1] != len(FEATURES) or y.shape != (x.shape[0],):
    raise ValueError(f"fit needs features f64[N, {len(FEATURES)}] and step_ms f64[N], "
                     f"got {x.shape} and {y.shape}")
  unknown = sorted(set(free) - set(FEATURES))
  if unknown:
    raise ValueError(f"fit: unknown feature(s) in free: {unknown}; features are {FEATURES}")
  cols = [i for i, f in enumerate(FEATURES) if f in free]
  if x.shape[0] < len(cols) + 1:
    raise ValueError(f"fit needs at least {len(cols) + 1} samples, got {x.shape[0]}")

  def solve(use):
    a = x[:, use]
    if nonnegative:
      from scipy.optimize import nnls     # pylint: disable=import-outside-toplevel
      c, _ = nnls(a, y)
    else:
      c, *_ = np.linalg.lstsq(a, y, rcond=None)
    return c, y - a @ c

  coef_free, resid = solve(cols)
  coef = np.zeros(len(FEATURES))
  coef[cols] = coef_free
  without = {}
  for i in cols:
    if len(cols) > 1:
      without[FEATURES[i]] = float(np.sqrt(np.mean(solve([j for j in cols if j != i])[1] ** 2)))
  meta = dict(meta or {}, num_samples=int(x.shape[0]), free=[FEATURES[i] for i in cols],
              solver="nnls" if nonnegative else "lstsq",
              rms_residual_ms=float(np.sqrt(np.mean(resid ** 2))),
              max_abs_residual_ms=float(np.max(np.abs(resid))),
              median_rel_residual=float(np.median(np.abs(resid) / np.maximum(y, 1e-9))),
              residual_without=without)
  return CostModel(tuple(float(c) for c in coef), "sum", min_step_ms, meta)


def device_fingerprint() -> dict:
  """What a calibration holds for: the JAX backend and device kind and
  count, and on a CPU its model name, logical CPU count and a hash of its
  feature flags (``/proc/cpuinfo``; empty where there is none), with the
  sorted flags themselves (``flags``: what ``device_difference`` names).
  ``id`` is a short hash of the rest but ``flags`` (calibrations made before
  the list was stored keep their ids): equal ids, the same kind of machine."""
  import jax    # pylint: disable=import-outside-toplevel
  devices = jax.devices()
  fp = {"backend": jax.default_backend(), "kind": devices[0].device_kind,
        "count": len(devices)}
  if fp["backend"] == "cpu":
    name, flags = platform.processor(), []
    try:
      for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
          name = value.strip()
        elif key.strip() == "flags" and not flags:
          flags = sorted(value.split())
    except OSError:
      pass
    fp.update(cpu=name, cpus=os.cpu_count(),
              flags_sha=hashlib.sha256(" ".join(flags).encode()).hexdigest()[:12])
  fp["id"] = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
  if fp["backend"] == "cpu":
    fp["flags"] = flags
  return fp


# Fingerprint fields device_difference compares (``id`` hashes them).
_DEVICE_FIELDS = ("backend", "kind", "count", "cpu", "cpus", "flags_sha")
_MAX_FLAGS_NAMED = 5


def device_difference(made: dict, here: dict) -> str:
  """In words, how the device a calibration was ``made`` on differs from
  ``here`` (two ``device_fingerprint`` dicts), e.g. ``same CPU model (AMD
  EPYC, 2 CPUs) but other CPU feature flags (this one lacks avx512f)`` or
  ``another CPU model (AMD EPYC vs Intel Xeon)``. The flags that differ are
  named (at most 5) where both fingerprints hold the list; '' when no
  compared field differs. A field only one of them records (an older or
  hand-written fingerprint) is not compared."""
  differ = [k for k in _DEVICE_FIELDS
            if k in made and k in here and made[k] != here[k]]
  if not differ:
    return ""
  if {"backend", "kind"} & set(differ):
    return f"another kind of device ({made.get('kind', '?')} vs {here.get('kind', '?')})"
  if "cpu" in differ:
    return f"another CPU model ({made.get('cpu', '?')} vs {here.get('cpu', '?')})"
  parts = []
  if "count" in differ:
    parts.append(f"another device count ({made.get('count')} vs {here.get('count')})")
  if "cpus" in differ:
    parts.append(f"another CPU count ({made.get('cpus')} vs {here.get('cpus')})")
  if "flags_sha" in differ:
    parts.append("other CPU feature flags")
    if isinstance(made.get("flags"), list) and isinstance(here.get("flags"), list):
      lacks = sorted(set(made["flags"]) - set(here["flags"]))
      has = sorted(set(here["flags"]) - set(made["flags"]))
      shown_lacks = lacks[:_MAX_FLAGS_NAMED]
      shown_has = has[:_MAX_FLAGS_NAMED - len(shown_lacks)]
      words = [f"{verb} {', '.join(names)}" for verb, names in
               (("lacks", shown_lacks), ("has", shown_has)) if names]
      hidden = len(lacks) + len(has) - len(shown_lacks) - len(shown_has)
      if hidden:
        words.append(f"{hidden} more")
      if words:
        parts[-1] += f" (this one {'; '.join(words)})"
  if made.get("cpu"):
    cpus = "" if "cpus" in differ else f", {made.get('cpus')} CPUs"
    same = f"same CPU model ({made['cpu']}{cpus})"
  else:
    same = f"same kind of device ({made.get('kind', '?')})"
  return f"{same} but {' and '.join(parts)}"


CALIBRATION_DIR = _CONFIGS / "calibration"
# The vector ISA a CPU calibration holds for: the widest of these its flags
# name (the native kernels and XLA's CPU code differ most by it).
_ISAS = (("avx512f", "avx512"), ("avx2", "avx2"), ("asimd", "neon"))


def machine_kind(fingerprint: dict) -> Optional[dict]:
  """The kind of machine a ``device_fingerprint`` is, as calibrations are
  chosen by: ``{"cpu": model name, "cpus": logical CPUs, "isa": "avx512" |
  "avx2" | "neon" | "baseline"}``; None for a non-CPU backend or a
  fingerprint without its flag list (a calibration made before flags were
  stored states its ``machine_kind`` in its meta instead)."""
  if fingerprint.get("backend") != "cpu" or not isinstance(fingerprint.get("flags"), list):
    return None
  flags = set(fingerprint["flags"])
  isa = next((name for flag, name in _ISAS if flag in flags), "baseline")
  return {"cpu": fingerprint.get("cpu"), "cpus": fingerprint.get("cpus"), "isa": isa}


def _kind_words(kind: Optional[dict]) -> str:
  if not kind:
    return "not a CPU"
  isa = {"avx512": "AVX-512", "avx2": "AVX2", "neon": "NEON"}.get(kind["isa"], "no AVX2")
  return f"{kind['cpu']}, {kind['cpus']} CPUs, {isa}"


def shipped_calibrations(directory=CALIBRATION_DIR) -> list:
  """(path, meta) of every calibration JSON in ``directory`` that states its
  machine kind (``meta["machine_kind"]`` or a fingerprint with flags),
  sorted by file name."""
  out = []
  for path in sorted(Path(directory).glob("*.json")):
    try:
      d = json.loads(path.read_text())
    except (OSError, ValueError):
      continue
    meta = d.get("meta", {})
    if "coef_ms" in d and (meta.get("machine_kind") or machine_kind(meta.get("device", {}))):
      out.append((path, meta))
  return out


def select_calibration(fingerprint: dict, costs: Optional[ModelCosts] = None,
                       directory=CALIBRATION_DIR) -> tuple:
  """The shipped calibration for this machine: ``(path, "")``, or ``(None,
  line)`` where none holds, ``line`` saying why in one line and naming
  ``scripts/calibrate.py``.

  A calibration holds when its machine kind (``machine_kind``: CPU model,
  CPU count, vector ISA) is this fingerprint's, and it can predict
  ``costs``' model (fitted on two or more models, or on this one). One made
  on this very fingerprint (``id``) first, then one fitted on more models.
  """
  here = machine_kind(fingerprint)
  found, kinds, one_model = [], [], []
  for path, meta in shipped_calibrations(directory):
    kind = meta.get("machine_kind") or machine_kind(meta.get("device", {}))
    kinds.append(_kind_words(kind))
    if kind != here:
      continue
    models = [_costs_key(m) for m in meta.get("models", [])]
    if costs is not None and len(models) == 1 and models[0] != _costs_key(costs.to_json()):
      one_model.append(f"{path.name} (fitted on {meta.get('model', '?')} only)")
      continue
    found.append((meta.get("device", {}).get("id") == fingerprint.get("id"),
                  len(models), path.name, path))
  if found:
    return max(found)[3], ""
  why = (f"the one for this machine's kind cannot predict this model: {one_model[0]}"
         if one_model else f"none of this machine's kind ({_kind_words(here)}; shipped: "
                           f"{'; '.join(kinds) or 'none'})")
  return None, (f"cost model: no shipped CPU calibration holds here, {why}; using "
                f"{DEFAULT_CALIBRATION.name}, whose times may not hold here: fit one on an idle "
                f"machine with scripts/calibrate.py (--quick: a smaller grid)")


def find_calibration(directory, fingerprint: dict, dtype: str,
                     engine: str) -> Optional[Path]:
  """The calibration in ``directory`` made on this kind of device
  (``fingerprint["id"]``) for ``dtype`` and the ``engine`` preset: one
  fitted on several models first, then the newest; None when there is none.
  (Whether it may predict the model at hand is ``resolve``'s check.)"""
  found = []
  for path in Path(directory).glob("*.json") if Path(directory).is_dir() else ():
    try:
      meta = json.loads(path.read_text()).get("meta", {})
    except (OSError, ValueError):
      continue
    if (meta.get("device", {}).get("id") == fingerprint["id"] and meta.get("dtype") == dtype
        and meta.get("engine") == engine):
      found.append((len(meta.get("models", [])) > 1, meta.get("created", ""), path))
  return max(found)[2] if found else None


# ModelCosts fields a calibration's stored models may lack (written before
# them) or that do not change what a calibration predicts.
_NOT_KEYED = ("weight_bytes", "tp", "row_bytes_per_row", "all_reduce_bytes_per_row")


def _costs_key(costs: dict) -> dict:
  return {k: v for k, v in costs.items() if k not in _NOT_KEYED}


_SAID = set()


def say_once(line: str) -> None:
  """Prints ``line`` to stderr the first time this process says it (N
  replicas on one calibration warn once)."""
  if line not in _SAID:
    _SAID.add(line)
    print(line, file=sys.stderr)


def resolve(model: CostModel, costs: ModelCosts, *,
            fingerprint: Optional[dict] = None,
            say: Callable[[str], None] = print) -> CostModel:
  """Checks that ``model`` may predict ``costs``' model on this device.

  * A calibration fitted on exactly one model predicts only that model (its
    weight reads are folded into the per-step term): another model is
    refused. One fitted on two or more models, or one stating no models (a
    profile, a hand-written model), predicts any model through its
    features; a model it did not see gets a one-line note.
  * A calibration made on another device (``device_fingerprint`` id) gets
    a one-line warning naming what differs (``device_difference``); a
    profile (``uncalibrated``) a one-line note.
  * The default calibration (``load`` given no path) is replaced by the
    shipped one of this machine's kind for this model
    (``select_calibration``), said in one line; where none holds, one line
    says so and names ``scripts/calibrate.py``, and the default is kept.

  Args:
    model: the loaded cost model.
    costs: the engine model's ``ModelCosts``.
    fingerprint: this device's (default ``device_fingerprint()``).
    say: where the one-line notes go.
  Returns:
    ``model``, a profile charged for ``costs``' model (``for_model``).
  Raises:
    ValueError: a one-model calibration for another model, naming both.
  """
  if model.meta.get("chosen") == "default" and model.combine == "sum":
    fp = fingerprint or device_fingerprint()
    path, line = select_calibration(fp, costs)
    if path is None:
      say(line)
      model = dataclasses.replace(model, meta=dict(model.meta, chosen="default, none holds"))
    else:
      model = load(path)
      model.meta["chosen"] = f"by machine kind ({_kind_words(machine_kind(fp))})"
      say(f"cost model: {path.name}, the shipped calibration for this machine "
          f"({_kind_words(machine_kind(fp))})")
      fingerprint = fp
  seen = [_costs_key(m) for m in model.models]
  here = _costs_key(costs.to_json())
  where = model.meta.get("path") or model.meta.get("profile") or "the cost model"
  if len(seen) == 1 and seen[0] != here:
    raise ValueError(
        f"cost model {where} was fitted on one model only ({model.meta.get('model', '?')}: "
        f"its weight reads are folded into the per-step term) and cannot predict this model "
        f"(gemm_flops_per_row {here['gemm_flops_per_row']} vs "
        f"{seen[0].get('gemm_flops_per_row')}); calibrate on this model, or on two models "
        f"(scripts/calibrate.py --second_model)")
  if len(seen) > 1 and here not in seen:
    say(f"cost model: {where} was fitted on {len(seen)} other models; predicting this one "
        f"from its cost features")
  if model.meta.get("provisional"):
    say(f"cost model: {where} is provisional: {model.meta['provisional']}")
  if model.meta.get("uncalibrated"):
    say(f"cost model: accelerator profile {model.meta.get('profile')!r} is uncalibrated "
        f"(published peaks x stated efficiencies)")
  elif model.meta.get("fitted"):
    fitted = model.meta["fitted"]
    say(f"cost model: accelerator profile {model.meta.get('profile')!r}: "
        f"{fitted.get('summary', 'fitted to measured operator timings')}")
  elif model.meta.get("device") and model.meta.get("chosen") != "default, none holds":
    fp = fingerprint or device_fingerprint()
    made = model.meta["device"]
    if made.get("id") != fp["id"]:
      how = device_difference(made, fp) or "another fingerprint"
      say(f"cost model: {where} was calibrated on another device than this one: {how} "
          f"(id {made.get('id')} vs {fp['id']}): its times may not hold here")
  return for_model(model, costs)
