"""Step-time cost model of one iteration, and its non-negative least-squares fit.

The modelled time of an iteration is linear in its shape (ms):

  step_ms = intercept_ms + a * prefill_rows + b * decode_rows
            + c * kv_tokens_read + d * bucket

* ``prefill_rows``: prompt and rebuild rows computed (PREFILL_CHUNK + REBUILD).
* ``decode_rows``: DECODE_ROW rows (one per decoding sequence).
* ``kv_tokens_read``: cached keys attention reads, summed over the step's
  rows: the row at position j reads j + 1 keys, so an interval [s, e)
  reads (e - s) * (s + e + 1) / 2 (a decode row at position e - 1 reads e).
* ``bucket``: the token-row bucket the step was compiled for (padding cost).

A prediction is clamped at ``min_step_ms`` (>= 0) so that a virtual clock
never goes back. ``scripts/calibrate.py`` measures the model executor on a
grid of shapes and fits the coefficients by non-negative least squares
(``fit``: ``scipy.optimize.nnls``, ``numpy.linalg.lstsq`` only when asked
with ``nonnegative=False``); the JSON names the model, dtype, backend,
machine and jax version it holds for.
Linear per-iteration cost models of this form are what Vidur (Agrawal et
al., MLSys 2024) profiles per operator; here one fit covers the whole step.

``model_costs(cfg)`` derives a model's cost features from its
``ModelConfig`` alone (FLOPs per row, weight and KV bytes, attention FLOPs
per query-key pair): what a calibration holds for (recorded in its meta and
in replay reports), and the features a config-driven cost model builds on.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, Sequence

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from scheduler import records as rec

FEATURES = ("prefill_rows", "decode_rows", "kv_tokens_read", "bucket")
DEFAULT_CALIBRATION = (Path(__file__).resolve().parent.parent / "configs"
                       / "calibration" / "cost_model_smollm2_cpu.json")
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

  def attention_flops(self, num_keys: int) -> int:
    """FLOPs of one query row that attends ``num_keys`` cached keys (its own
    included), all blocks; a windowed block sees at most its window."""
    per_block = self.attention_flops_per_pair // len(self.windows)
    return sum(per_block * (min(num_keys, w) if w else num_keys) for w in self.windows)

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self), "windows": list(self.windows)}


def model_costs(cfg: ModelConfig, weight_dtype: str = "float32",
                kv_dtype: str | None = None) -> ModelCosts:
  """The cost features of ``cfg`` (``ModelCosts``; a pure function).

  Args:
    cfg: the model's config (any family).
    weight_dtype: "float32", "bfloat16", "float16" or "int8".
    kv_dtype: the KV cache's dtype name; None: ``weight_dtype`` (int8
      weights keep a float32 cache).

  Raises:
    ValueError: a dtype name outside ``DTYPE_BYTES``.
  """
  if kv_dtype is None:
    kv_dtype = "float32" if weight_dtype == "int8" else weight_dtype
  for name, value in (("weight_dtype", weight_dtype), ("kv_dtype", kv_dtype)):
    if value not in DTYPE_BYTES:
      raise ValueError(f"model_costs: {name} must be one of {sorted(DTYPE_BYTES)}, "
                       f"got {value!r}")
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
  return ModelCosts(
      gemm_flops_per_row=layers * (2 * attn_weights + mlp_flops),
      lm_head_flops_per_row=2 * head,
      attention_flops_per_pair=layers * 4 * cfg.n_heads * cfg.head_dim,
      kv_bytes_per_token=layers * 2 * cfg.kv_dim * kb,
      weight_bytes_per_step=step_elements * wb,
      expert_bytes=layers * expert * wb if cfg.is_moe else 0,
      weight_bytes=all_elements * wb,
      windows=tuple(cfg.layer_windows) or (0,) * layers,
      weight_dtype=weight_dtype, kv_dtype=kv_dtype)


def step_features(plan: rec.IterationPlan):
  """f32[3]: (prefill_rows, decode_rows, kv_tokens_read) of a plan (the
  bucket is a static host value and is appended by the caller)."""
  sel = plan.selected
  rows = jnp.where(sel, plan.end - plan.start, 0)
  decode = sel & (plan.kind == rec.DECODE_ROW)
  kv_read = rows.astype(jnp.float32) * (plan.start + plan.end + 1).astype(jnp.float32) / 2
  return jnp.stack([jnp.sum(jnp.where(decode, 0, rows)).astype(jnp.float32),
                    jnp.sum(decode).astype(jnp.float32), jnp.sum(kv_read)])


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Linear step-time model.

  Attributes:
    intercept_ms: fixed per-step term (ms).
    coef_ms: per-unit cost of each of ``FEATURES`` (ms per row / token).
    min_step_ms: floor of a prediction (ms, >= 0).
    meta: where the fit holds (model, dtype, backend, machine, jax
      version, grid, residuals); carried into reports.
  """

  intercept_ms: float
  coef_ms: tuple
  min_step_ms: float = 0.0
  meta: dict = dataclasses.field(default_factory=dict, compare=False)

  def __post_init__(self):
    if len(self.coef_ms) != len(FEATURES):
      raise ValueError(f"CostModel.coef_ms needs {len(FEATURES)} values {FEATURES}, "
                       f"got {len(self.coef_ms)}")
    if not self.min_step_ms >= 0:
      raise ValueError(f"CostModel.min_step_ms must be >= 0, got {self.min_step_ms}")
    object.__setattr__(self, "coef_ms", tuple(float(c) for c in self.coef_ms))

  def predict_ms(self, features: Sequence[float]) -> float:
    """Modelled step time (ms) of one iteration's ``FEATURES`` values."""
    x = np.asarray(features, np.float64)
    return max(self.min_step_ms, float(self.intercept_ms + np.dot(self.coef_ms, x)))

  def to_json(self) -> dict:
    return {"features": list(FEATURES), "intercept_ms": self.intercept_ms,
            "coef_ms": dict(zip(FEATURES, self.coef_ms)),
            "min_step_ms": self.min_step_ms, "meta": self.meta}

  def save(self, path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")


def load(path=None) -> CostModel:
  """Reads a calibration JSON (default ``DEFAULT_CALIBRATION``).

  Raises:
    ValueError: missing file, or a file without every feature coefficient.
  """
  path = Path(path) if path else DEFAULT_CALIBRATION
  if not path.exists():
    raise ValueError(f"cost model file {str(path)!r} not found (write one with "
                     f"scripts/calibrate.py)")
  d = json.loads(path.read_text())
  coef = d.get("coef_ms", {})
  missing = [f for f in FEATURES if f not in coef]
  if missing or "intercept_ms" not in d:
    raise ValueError(f"{path}: cost model needs intercept_ms and coef_ms for "
                     f"{list(FEATURES)}; missing {missing or ['intercept_ms']}")
  meta = dict(d.get("meta", {}), path=str(path.name))
  return CostModel(float(d["intercept_ms"]), tuple(coef[f] for f in FEATURES),
                   float(d.get("min_step_ms", 0.0)), meta)


def fit(features, step_ms, *, min_step_ms: float = 0.0, meta: Dict = None,
        nonnegative: bool = True) -> CostModel:
  """Least-squares fit of the linear model.

  With ``nonnegative`` (default) the intercept and every coefficient are
  constrained to >= 0 (``scipy.optimize.nnls``): a row, a context token or
  a padded bucket row never saves time, and on collinear grids (prefill
  rows and bucket move together) an unconstrained fit can trade a large
  negative coefficient for a large positive one. Otherwise
  ``numpy.linalg.lstsq``.

  Args:
    features: f64[N, 4] rows of ``FEATURES``.
    step_ms: f64[N] measured step times (ms).
  Returns:
    a CostModel whose ``meta`` adds the fit's RMS and max absolute residual
    (ms) and the number of samples.
  Raises:
    ValueError: shapes disagree or fewer samples than unknowns.
  """
  x = np.asarray(features, np.float64)
  y = np.asarray(step_ms, np.float64)
  if x.ndim != 2 or x.shape[1] != len(FEATURES) or y.shape != (x.shape[0],):
    raise ValueError(f"fit needs features f64[N, {len(FEATURES)}] and step_ms f64[N], "
                     f"got {x.shape} and {y.shape}")
  if x.shape[0] < len(FEATURES) + 1:
    raise ValueError(f"fit needs at least {len(FEATURES) + 1} samples, got {x.shape[0]}")
  a = np.concatenate([np.ones((x.shape[0], 1)), x], axis=1)
  if nonnegative:
    from scipy.optimize import nnls
    coef, _ = nnls(a, y)
  else:
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
  resid = y - a @ coef
  meta = dict(meta or {}, num_samples=int(x.shape[0]),
              solver="nnls" if nonnegative else "lstsq",
              rms_residual_ms=float(np.sqrt(np.mean(resid ** 2))),
              max_abs_residual_ms=float(np.max(np.abs(resid))))
  return CostModel(float(coef[0]), tuple(float(c) for c in coef[1:]), min_step_ms, meta)
