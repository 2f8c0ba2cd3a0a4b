"""Fits a GPU profile's terms to measured per-operator timings.

The data are per-operator GPU times of one transformer block's non-attention
operators (an ``OperatorTable`` per model and GPU: Vidur's public profiles,
``mlp.csv``, every token count and TP degree) and collective times by
message size (``all_reduce.csv``, ``send_recv.csv``). The fitted terms are
the ones ``profiles.for_model`` charges, by the same definitions:

* a weight GEMM of m rows through a K x N weight on one device:
  ``gemm_op_ms + ((2m'KN / (peak * gemm_eff))**p + (2KN / (hbm * mem_eff))
  **p) ** (1/p)``, m' = m rounded up to ``gemm_row_tile`` (bf16 weights; a
  fixed per-operator time the roofline lacks, a part-filled row tile paying
  a whole one, and a smooth roofline: p = inf is the sharp one);
* a row-wise operator (norm, RoPE, activation, residual add):
  ``row_op_ms + bytes / row_gbps``;
* one block: the four GEMMs' fixed times, the row-wise operators', and one
  smooth roofline over the block's summed FLOPs and weight bytes (what the
  step model charges over all blocks);
* a collective: ``Link`` (latency + bytes / bandwidth) per worker count.

``fit_operators`` fits the five operator terms and p by least squares on
log(predicted / measured) of every operator and block time
(``scipy.optimize.least_squares``, soft-L1: relative error, robust to the
odd outlier); ``error_table`` reports median and p90 relative error.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

from serving.engine import profiles as profile_lib

GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ROW_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
BYTES = 2                         # bf16 weights and activations, as measured
_SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "use_gated_mlp")


@dataclasses.dataclass(frozen=True)
class OperatorTable:
  """One model's measured operator times on one GPU.

  Attributes:
    model: the model's name (the folder it was read from).
    n_heads, n_kv_heads, d_model, ffn_dim: its shape; gated: a gated MLP
      (the up projection holds gate and up).
    tokens: f64[N] rows of the batch (``num_tokens``).
    tp: f64[N] TP degree of each measurement.
    times_ms: op name -> f64[N] median time (ms) of the operators measured
      (of ``GEMM_OPS + ROW_OPS``; a model without a second norm lacks it).
  """

  model: str
  n_heads: int
  n_kv_heads: int
  d_model: int
  ffn_dim: int
  gated: bool
  tokens: np.ndarray
  tp: np.ndarray
  times_ms: Dict[str, np.ndarray]

  def gemm_shapes(self, row_tile: float = 1.0) -> Dict[str, tuple]:
    """op -> (GFLOP f64[N], weight GB f64[N]) of each GEMM on one device,
    its rows rounded up to a multiple of ``row_tile`` (the GEMM kernel's row
    tile: a part-filled tile costs a whole one)."""
    d, hd, tp = self.d_model, self.d_model / self.n_heads, self.tp
    rows = np.ceil(self.tokens / row_tile) * row_tile
    kn = {"attn_pre_proj": (d, (self.n_heads + 2 * self.n_kv_heads) * hd / tp),
          "attn_post_proj": (self.n_heads * hd / tp, d),
          "mlp_up_proj": (d, self.ffn_dim * (1 + self.gated) / tp),
          "mlp_down_proj": (self.ffn_dim / tp, d)}
    return {op: (2 * rows * k * n / 1e9, BYTES * k * n / 1e9) for op, (k, n) in kn.items()}

  def row_gb(self) -> Dict[str, np.ndarray]:
    """op -> f64[N] GB each row-wise operator moves on one device (the
    ``ModelCosts.row_bytes_per_row`` counts)."""
    d, hd, tp = self.d_model, self.d_model / self.n_heads, self.tp
    per_row = {"input_layernorm": 2 * d, "post_attention_layernorm": 2 * d,
               "attn_rope": 2 * (self.n_heads + self.n_kv_heads) * hd / tp,
               "mlp_act": (2 + self.gated) * self.ffn_dim / tp, "add": 3 * d}
    return {op: BYTES * self.tokens * e / 1e9 for op, e in per_row.items()}

  def block_ms(self) -> np.ndarray:
    """f64[N] the measured block: the sum of its measured operators."""
    return sum(self.times_ms[op] for op in GEMM_OPS + ROW_OPS if op in self.times_ms)


def read_operator_table(path) -> OperatorTable:
  """An ``OperatorTable`` of one ``mlp.csv`` (the model named by its folder).

  Raises:
    ValueError: a missing column or more than one model shape in the file.
  """
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  if not rows:
    raise ValueError(f"{path}: no rows")
  need = _SHAPE_COLUMNS + ("num_tokens", "num_tensor_parallel_workers")
  missing = [c for c in need if c not in rows[0]]
  if missing:
    raise ValueError(f"{path}: lacks column(s) {missing}")
  shapes = {tuple(r[c] for c in _SHAPE_COLUMNS) for r in rows}
  if len(shapes) != 1:
    raise ValueError(f"{path}: holds {len(shapes)} model shapes; one expected")
  h, kv, d, f, gated = next(iter(shapes))
  times = {op: np.array([float(r[f"time_stats.{op}.median"]) for r in rows])
           for op in GEMM_OPS + ROW_OPS if f"time_stats.{op}.median" in rows[0]}
  return OperatorTable(Path(path).parent.name, int(h), int(kv), int(d), int(f),
                       gated.strip().lower() == "true",
                       np.array([float(r["num_tokens"]) for r in rows]),
                       np.array([float(r["num_tensor_parallel_workers"]) for r in rows]), times)


def read_operator_tables(data_dir, gpu: str) -> List[OperatorTable]:
  """Every model's table under ``data_dir/compute/<gpu>/*/*/mlp.csv``,
  sorted by model name.

  Raises:
    ValueError: none there.
  """
  paths = sorted(Path(data_dir).glob(f"compute/{gpu}/*/*/mlp.csv"))
  if not paths:
    raise ValueError(f"no operator tables under {data_dir}/compute/{gpu}/*/*/mlp.csv")
  return sorted((read_operator_table(p) for p in paths), key=lambda t: t.model)


@dataclasses.dataclass(frozen=True)
class OperatorTerms:
  """The fitted operator terms of one GPU (``profiles.read_profile``'s
  ``operators``, efficiencies and ``roofline_p``).

  Attributes:
    gemm_op_ms: fixed time of one weight GEMM (ms).
    gemm_eff: fraction of peak FLOP/s the GEMMs reach.
    memory_eff: fraction of HBM bandwidth their weight reads reach.
    roofline_p: the smooth roofline's p (inf: max).
    row_op_ms: fixed time of one row-wise operator (ms).
    row_gbps: bandwidth of the row-wise operators (GB/s; inf: free).
    gemm_row_tile: the GEMMs' FLOPs are charged over the rows rounded up to
      a multiple of this (1: the rows themselves); chosen, not fitted
      (``fit_operators_tiled``).
  """

  gemm_op_ms: float
  gemm_eff: float
  memory_eff: float
  roofline_p: float
  row_op_ms: float
  row_gbps: float
  gemm_row_tile: float = 1.0


def assumed_terms() -> OperatorTerms:
  """What the uncalibrated profiles assumed: GEMMs at 60% of peak, weight
  reads at 75% of bandwidth, a sharp roofline, nothing for the fixed and
  row-wise costs."""
  return OperatorTerms(0.0, 0.6, 0.75, np.inf, 0.0, np.inf)


def _bound(compute_ms, memory_ms, p):
  if np.isinf(p):
    return np.maximum(compute_ms, memory_ms)
  return (compute_ms ** p + memory_ms ** p) ** (1.0 / p)


def predict_operators(table: OperatorTable, terms: OperatorTerms, peak_tflops: float,
                      hbm_gbps: float) -> Dict[str, np.ndarray]:
  """op -> f64[N] modelled time (ms) of each operator ``table`` measured."""
  out = {}
  for op, (gflop, gb) in table.gemm_shapes(terms.gemm_row_tile).items():
    out[op] = terms.gemm_op_ms + _bound(gflop / (peak_tflops * terms.gemm_eff),
                                        1e3 * gb / (hbm_gbps * terms.memory_eff),
                                        terms.roofline_p)
  for op, gb in table.row_gb().items():
    out[op] = terms.row_op_ms + 1e3 * gb / terms.row_gbps
  return {op: t for op, t in out.items() if op in table.times_ms}


def predict_block(table: OperatorTable, terms: OperatorTerms, peak_tflops: float,
                  hbm_gbps: float) -> np.ndarray:
  """f64[N] modelled time (ms) of one block's measured operators, as the
  step model charges a block (``profiles.for_model``): fixed times, row
  bytes, one smooth roofline over the block's GEMMs."""
  shapes = table.gemm_shapes(terms.gemm_row_tile)
  gflop = sum(s[0] for s in shapes.values())
  gb = sum(s[1] for s in shapes.values())
  rows = [op for op in ROW_OPS if op in table.times_ms]
  row_gb = sum(g for op, g in table.row_gb().items() if op in rows)
  return (len(GEMM_OPS) * terms.gemm_op_ms + len(rows) * terms.row_op_ms
          + 1e3 * row_gb / terms.row_gbps
          + _bound(gflop / (peak_tflops * terms.gemm_eff),
                   1e3 * gb / (hbm_gbps * terms.memory_eff), terms.roofline_p))


# Bounds of the fit (log space): fixed times 0.1 us - 1 ms, efficiencies
# 1%-100%, p 1-16, row bandwidth 10 GB/s - 100 TB/s.
_LOWER = np.log([1e-4, 0.01, 0.01, 1.0, 1e-4, 10.0])
_UPPER = np.log([1.0, 1.0, 1.0, 16.0, 1.0, 1e5])


def fit_operators(tables: Sequence[OperatorTable], peak_tflops: float, hbm_gbps: float,
                  *, block_weight: float = 2.0, gemm_row_tile: float = 1.0) -> OperatorTerms:
  """The ``OperatorTerms`` that best fit ``tables`` (least squares on
  log(predicted / measured) of every operator and, weighted
  ``block_weight``, every block: the block is what the step model charges,
  one roofline over its summed GEMMs, so it is fitted beside the operators).

  Raises:
    ValueError: no tables.
  """
  if not tables:
    raise ValueError("fit_operators needs at least one table")
  from scipy.optimize import least_squares  # pylint: disable=import-outside-toplevel

  def residuals(q):
    terms = OperatorTerms(*np.exp(q), gemm_row_tile)
    out = []
    for t in tables:
      pred = predict_operators(t, terms, peak_tflops, hbm_gbps)
      out += [np.log(pred[op] / t.times_ms[op]) for op in pred]
      if block_weight:
        out.append(block_weight * np.log(predict_block(t, terms, peak_tflops, hbm_gbps)
                                         / t.block_ms()))
    return np.concatenate(out)

  start = np.log([0.005, 0.6, 0.75, 2.0, 0.003, 1000.0])
  sol = least_squares(residuals, start, bounds=(_LOWER, _UPPER), loss="soft_l1",
                      f_scale=0.05, x_scale=1.0)
  return OperatorTerms(*(float(v) for v in np.exp(sol.x)), gemm_row_tile)


def fit_loss(tables: Sequence[OperatorTable], terms: OperatorTerms, peak_tflops: float,
             hbm_gbps: float) -> float:
  """The fit's training criterion: the mean over ``tables`` of the blocks'
  median plus p90 relative error."""
  return float(np.mean([sum(error_summary(predict_block(t, terms, peak_tflops, hbm_gbps),
                                          t.block_ms())[k] for k in ("median", "p90"))
                        for t in tables]))


def fit_operators_tiled(tables: Sequence[OperatorTable], peak_tflops: float, hbm_gbps: float,
                        tiles: Sequence[float] = (1, 64, 128, 256)) -> OperatorTerms:
  """``fit_operators`` at each GEMM row tile of ``tiles``; the terms of the
  tile whose fit has the least ``fit_loss`` on the same (training) tables."""
  fits = [fit_operators(tables, peak_tflops, hbm_gbps, gemm_row_tile=float(t)) for t in tiles]
  return min(fits, key=lambda f: fit_loss(tables, f, peak_tflops, hbm_gbps))


def error_summary(predicted, measured) -> dict:
  """Median and p90 of |predicted / measured - 1| and the count."""
  e = np.abs(np.asarray(predicted) / np.asarray(measured) - 1.0)
  return {"median": float(np.median(e)), "p90": float(np.percentile(e, 90)), "n": int(e.size)}


def error_table(tables: Sequence[OperatorTable], terms: OperatorTerms, peak_tflops: float,
                hbm_gbps: float) -> dict:
  """Per model, per TP degree: the block's and each operator's
  ``error_summary``, plus the block's over every table (``all``)."""
  out, pooled_p, pooled_m = {}, [], []
  for t in tables:
    ops = predict_operators(t, terms, peak_tflops, hbm_gbps)
    block = predict_block(t, terms, peak_tflops, hbm_gbps)
    pooled_p.append(block)
    pooled_m.append(t.block_ms())
    per_tp = {}
    for tp in sorted(set(t.tp.tolist())):
      s = t.tp == tp
      per_tp[str(int(tp))] = {
          "block": error_summary(block[s], t.block_ms()[s]),
          "operators": {op: error_summary(ops[op][s], t.times_ms[op][s]) for op in ops}}
    out[t.model] = per_tp
  out["all"] = error_summary(np.concatenate(pooled_p), np.concatenate(pooled_m))
  return out


def read_collective(path, workers_equal_node: bool = True) -> Dict[int, tuple]:
  """``all_reduce.csv`` / ``send_recv.csv`` -> {key: (size bytes f64[N],
  median ms f64[N])}: for an all-reduce keyed by worker count, the runs
  whose workers are all in one node; for send/recv keyed by
  devices_per_node (1: the two ends in two nodes, 2: in one)."""
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  col = next(c for c in rows[0] if c.startswith("time_stats.") and c.endswith(".median"))
  out: Dict[int, list] = {}
  for r in rows:
    workers, per_node = int(r["num_workers"]), int(r["devices_per_node"])
    if workers_equal_node:
      if workers != per_node:
        continue
      key = workers
    else:
      key = per_node
    out.setdefault(key, []).append((float(r["size"]), float(r[col])))
  return {k: (np.array([s for s, _ in v]), np.array([t for _, t in v]))
          for k, v in sorted(out.items())}


def fit_link(size_bytes, time_ms) -> profile_lib.Link:
  """The ``Link`` (latency + bytes / bandwidth) of least relative error
  over the measured sizes (weighted least squares, weights 1 / time)."""
  size = np.asarray(size_bytes, np.float64)
  t = np.asarray(time_ms, np.float64)
  a = np.stack([np.ones_like(size), size / 1e6], axis=1) / t[:, None]
  from scipy.optimize import nnls  # pylint: disable=import-outside-toplevel
  (lat, per_mb), _ = nnls(a, np.ones_like(t))
  return profile_lib.Link(float(lat), float(1.0 / per_mb) if per_mb > 0 else float("inf"))


def fit_collectives(network_dir) -> dict:
  """The ``collectives`` of a profile from one node kind's folder (e.g.
  ``network/a100_dgx``): ``all_reduce`` by worker count, ``send_recv``
  ``same_node`` and ``other_node``, each ``{latency_ms, gbps}`` and its
  ``error`` (``error_summary`` over the measured sizes)."""
  out = {"all_reduce": {}, "send_recv": {}}
  for workers, (size, t) in read_collective(Path(network_dir) / "all_reduce.csv").items():
    link = fit_link(size, t)
    out["all_reduce"][str(workers)] = dict(latency_ms=link.latency_ms, gbps=link.gbps,
                                           error=error_summary(link.ms(size), t))
  names = {1: "other_node", 2: "same_node"}
  for per_node, (size, t) in read_collective(Path(network_dir) / "send_recv.csv",
                                             workers_equal_node=False).items():
    link = fit_link(size, t)
    out["send_recv"][names[per_node]] = dict(latency_ms=link.latency_ms, gbps=link.gbps,
                                             error=error_summary(link.ms(size), t))
  return out


def pooled_by_tp(tables: Sequence[OperatorTable], terms: OperatorTerms, peak_tflops: float,
                 hbm_gbps: float) -> dict:
  """TP degree -> the block's ``error_summary`` over every table's rows at
  that degree (and ``all``)."""
  pred, meas, tps = [], [], []
  for t in tables:
    pred.append(predict_block(t, terms, peak_tflops, hbm_gbps))
    meas.append(t.block_ms())
    tps.append(t.tp)
  pred, meas, tps = np.concatenate(pred), np.concatenate(meas), np.concatenate(tps)
  out = {str(int(tp)): error_summary(pred[tps == tp], meas[tps == tp])
         for tp in sorted(set(tps.tolist()))}
  out["all"] = error_summary(pred, meas)
  return out


def fit_profile(base: dict, tables: Sequence[OperatorTable], network_dir,
                held_out: Sequence[str], gpu: str, commit: str) -> tuple:
  """(profile, report): ``base`` (a profile JSON, its peaks kept) with the
  terms fitted on the tables not ``held_out``, the collectives of
  ``network_dir``, and what it was fitted to; the report holds the
  held-out and training errors beside the assumptions' (``assumed_terms``).

  Raises:
    ValueError: no table held out, or none left to fit.
  """
  train = [t for t in tables if t.model not in held_out]
  test = [t for t in tables if t.model in held_out]
  if not test or not train:
    raise ValueError(f"{gpu}: held_out {list(held_out)} must name at least one of the models "
                     f"{[t.model for t in tables]} and leave one to fit")
  peak, hbm = base["peak_tflops"], base["hbm_gbps"]
  terms = fit_operators_tiled(train, peak, hbm)
  assumed = assumed_terms()
  held = {"fitted": pooled_by_tp(test, terms, peak, hbm),
          "assumed": pooled_by_tp(test, assumed, peak, hbm)}
  summary = {"held_out_block_fitted": held["fitted"]["all"],
             "held_out_block_assumed": held["assumed"]["all"]}
  report = {"terms": dataclasses.asdict(terms), "summary": summary, "held_out": held,
            "training": pooled_by_tp(train, terms, peak, hbm),
            "held_out_by_model": {"fitted": error_table(test, terms, peak, hbm),
                                  "assumed": error_table(test, assumed, peak, hbm)}}
  collectives = fit_collectives(network_dir)
  rows = sum(t.tokens.size for t in train)
  fit, was = held["fitted"]["all"], held["assumed"]["all"]
  profile = dict(base, format=2, roofline_p=terms.roofline_p, row_ms=0.0,
                 efficiency=dict(base["efficiency"], gemm=terms.gemm_eff,
                                 lm_head=terms.gemm_eff, memory=terms.memory_eff),
                 operators=dict(gemm_op_ms=terms.gemm_op_ms, row_op_ms=terms.row_op_ms,
                                row_gbps=terms.row_gbps, gemm_row_tile=terms.gemm_row_tile),
                 collectives=collectives)
  profile["fitted"] = {
      "to": f"measured per-operator GPU times (Vidur's public profiles, {gpu})",
      "data_commit": commit, "models": [t.model for t in train],
      "held_out": [t.model for t in test], "rows": int(rows),
      "held_out_block_error": held,
      "summary": (f"fitted to {gpu} operator timings of {len(train)} models ({rows} rows); "
                  f"held-out block time error median {fit['median']:.1%}, p90 "
                  f"{fit['p90']:.1%} (assumed efficiencies: {was['median']:.1%}, "
                  f"{was['p90']:.1%}); attention still a roofline")}
  profile["assumptions"] = (
      "Fitted (scripts/fit_profiles.py): the non-attention operators (weight GEMMs: a fixed "
      "time each plus a smooth roofline of FLOPs, over the rows rounded up to "
      "operators.gemm_row_tile, at peak x efficiency.gemm and weight bytes at bandwidth x "
      "efficiency.memory; row-wise operators: a fixed time plus bytes at row_gbps) and the "
      "all-reduce and send/recv times of one node. Still assumed: "
      "attention (efficiency.attention of peak FLOP/s, KV reads at the fitted memory "
      "efficiency: a roofline from bandwidth, no attention timings were measured), "
      "step_ms (host and launch time per iteration), the LM head at the GEMMs' efficiency, "
      "embedding lookup and sampling free.")
  return profile, report


def scaled_profile(base: dict, source: dict, source_name: str) -> dict:
  """``base``'s device and peaks with ``source``'s fitted terms: the same
  fixed times, efficiencies and collectives, the row-wise bandwidth scaled
  by the HBM bandwidth ratio (no measurements of ``base``'s device)."""
  ratio = base["hbm_gbps"] / source["hbm_gbps"]
  out = {k: v for k, v in source.items()
         if k not in ("device", "source", "peak_tflops", "hbm_gbps")}
  out.update(device=base["device"], source=base["source"], peak_tflops=base["peak_tflops"],
             hbm_gbps=base["hbm_gbps"])
  out["operators"] = dict(source["operators"], row_gbps=source["operators"]["row_gbps"] * ratio)
  out["fitted"] = dict(source["fitted"], scaled_from=source_name,
                       summary=f"scaled from {source_name}'s fit by its peaks and bandwidth "
                               f"(x{ratio:.2f} row-wise bandwidth); no {base['device']} "
                               f"timings measured; attention still a roofline")
  out["fitted"].pop("held_out_block_error", None)
  out["assumptions"] = (f"Scaled, not fitted: {source_name}'s fitted terms (fixed operator "
                        f"times, GEMM and memory efficiencies, roofline_p, collectives) with "
                        f"this device's published peak FLOP/s and HBM bandwidth. Still "
                        f"assumed: " + source["assumptions"].split("Still assumed: ", 1)[-1])
  return out
