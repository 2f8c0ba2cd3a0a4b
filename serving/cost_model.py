"""Step-time cost model of one iteration, and its least-squares fit.

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
grid of shapes and fits the coefficients with ``numpy.linalg.lstsq``; the
JSON names the model, dtype, backend, machine and jax version it holds for.
``fit`` uses non-negative least squares by default (``scipy.optimize.nnls``).
Linear per-iteration cost models of this form are what Vidur (Agrawal et
al., MLSys 2024) profiles per operator; here one fit covers the whole step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, Sequence

import jax.numpy as jnp
import numpy as np

from scheduler import records as rec

FEATURES = ("prefill_rows", "decode_rows", "kv_tokens_read", "bucket")
DEFAULT_CALIBRATION = (Path(__file__).resolve().parent.parent / "configs"
                       / "calibration" / "cost_model_smollm2_cpu.json")


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
