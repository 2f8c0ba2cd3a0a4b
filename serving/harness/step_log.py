"""The steps of a real replay, logged for the simulator's calibration.

A real replay (model executor, wall clock) is the schedule the simulator
tries to reproduce. ``StepLog`` records one row per committed engine step:
the step's cost features (``Engine.last_step_features``), the wall time of
its ``engine.step()`` call, the cost model's prediction for those features,
and its class (prefill-only, mixed or decode-only, from its prefill and
decode rows). Two questions read off it:

* per-step error: predicted against measured time of the very steps the
  machine ran (``StepLog.summary``), apart from any difference between the
  simulated schedule and the real one;
* a fit on steps shaped like a loaded replay (``fit_steps``): the same
  features and the same NNLS fit as the calibration grid
  (``cost_model.fit``), on the logged steps instead.

The log is an .npz (``StepLog.save``): ``features`` f64[N, F] with
``feature_names``, ``measured_ms`` and ``predicted_ms`` f64[N],
``step_class`` i8[N] (an index into ``class_names``), ``prefill_rows`` and
``decode_rows`` i64[N], ``case`` i32[N], ``plan_stats`` f64[N, S] and
``bucket`` i64[N] (the step's raw ``cost_model.plan_stats`` and token bucket:
``cost_model.step_features`` of them is ``features``, and of them under a
changed feature definition the new features, with no new measurement),
``idle_before_ms`` f64[N] (wall ms from the end of the case's previous
``engine.step()`` call to the start of this one: the engine idles between
them when nothing is live; NaN for a case's first step), ``load_avg`` (the
machine's 1-minute load average before the recording process loaded
anything) and ``meta`` (JSON: model, dtype, engine preset, device
fingerprint, the model's ``ModelCosts``, the predicting cost model, the
cases). Logs written before ``plan_stats``, ``bucket`` and
``idle_before_ms`` load without them.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from serving.engine import cost_model as cost_lib
from serving.harness.replay import replay

STEP_CLASSES = ("prefill", "mixed", "decode")


def step_class(prefill_rows: int, decode_rows: int) -> int:
  """Index into ``STEP_CLASSES``: decode rows only -> "decode", prompt rows
  beside decode rows -> "mixed", else "prefill"."""
  if decode_rows > 0:
    return STEP_CLASSES.index("mixed" if prefill_rows > 0 else "decode")
  return STEP_CLASSES.index("prefill")


def _rel_err(predicted, measured) -> Optional[float]:
  """Median of predicted / measured - 1 (None when there are no steps)."""
  if len(measured) == 0:
    return None
  return float(np.median(np.asarray(predicted) / np.asarray(measured) - 1.0))


class StepLog:
  """Rows of the committed steps of one or more replays (cases).

  Args:
    cost: the cost model whose prediction each row carries.
  """

  def __init__(self, cost: cost_lib.CostModel):
    self.cost = cost
    self.cases: List[dict] = []
    self._features: List[np.ndarray] = []
    self._measured: List[float] = []
    self._predicted: List[float] = []
    self._rows: List[tuple] = []
    self._case: List[int] = []
    self._stats: List[np.ndarray] = []
    self._bucket: List[int] = []
    self._idle: List[float] = []

  def __len__(self) -> int:
    return len(self._measured)

  def replay(self, engine, workload, info: Optional[dict] = None,
             on_step: Optional[Callable] = None, **kwargs):
    """``replay.replay`` of ``workload`` on ``engine``, logging each
    committed step as a row of a new case (``info`` is kept as its entry in
    ``cases``). A ``step()`` call that commits nothing (an idle or a
    rejecting plan) adds no row; ``cases[-1]["uncommitted_calls"]`` counts
    them. Returns what ``replay`` returns."""
    case = len(self.cases)
    self.cases.append(dict(info or {}, uncommitted_calls=0))
    times: List[float] = []
    seen = [engine.num_iterations]
    last_end = [None]      # perf_counter seconds at the end of the previous step() call

    def logging(outputs):
      end = time.perf_counter()        # ``replay`` calls this as the step returns
      start = end - times[-1] / 1000.0
      idle = math.nan if last_end[0] is None else max(start - last_end[0], 0.0) * 1000.0
      last_end[0] = end
      if engine.num_iterations > seen[0]:
        seen[0] = engine.num_iterations
        stats, bucket = engine.last_step_stats
        self.add(engine.last_step_features, engine.last_step_rows, times[-1], case,
                 stats=stats, bucket=bucket, idle_before_ms=idle)
      else:
        self.cases[case]["uncommitted_calls"] += 1
      if on_step is not None:
        on_step(outputs)

    return replay(engine, workload, on_step=logging, step_ms=times, **kwargs)

  def add(self, features: Sequence[float], rows: tuple, measured_ms: float,
          case: int, *, stats: Optional[Sequence[float]] = None, bucket: int = -1,
          idle_before_ms: float = math.nan) -> None:
    """One step: its ``FEATURES`` values f64[F], (prefill rows, decode
    rows), its wall time (ms), its case index, and its raw plan statistics
    (``Engine.last_step_stats``; None: unknown, NaN in the log), bucket
    (-1: unknown) and the idle wall ms before it (NaN: unknown)."""
    features = np.asarray(features, np.float64)
    self._features.append(features)
    self._measured.append(float(measured_ms))
    self._predicted.append(self.cost.predict_ms(features))
    self._rows.append((int(rows[0]), int(rows[1])))
    self._case.append(int(case))
    self._stats.append(None if stats is None else np.asarray(stats, np.float64))
    self._bucket.append(int(bucket))
    self._idle.append(float(idle_before_ms))

  def _plan_stats(self) -> np.ndarray:
    """f64[N, S] of the rows' plan statistics, NaN where not given."""
    width = max((len(x) for x in self._stats if x is not None), default=0)
    out = np.full((len(self._stats), width), np.nan)
    for i, x in enumerate(self._stats):
      if x is not None:
        if len(x) != width:
          raise ValueError(f"StepLog: plan statistics of {len(x)} values in row {i}, "
                           f"{width} in another (one model per log)")
        out[i] = x
    return out

  def arrays(self) -> Dict[str, np.ndarray]:
    """The rows as arrays (the .npz's fields but ``load_avg`` and ``meta``)."""
    rows = np.array(self._rows, np.int64).reshape(-1, 2)
    return {
        "features": np.array(self._features, np.float64).reshape(-1, len(cost_lib.FEATURES)),
        "feature_names": np.array(cost_lib.FEATURES),
        "measured_ms": np.array(self._measured, np.float64),
        "predicted_ms": np.array(self._predicted, np.float64),
        "step_class": np.array([step_class(p, d) for p, d in rows], np.int8),
        "class_names": np.array(STEP_CLASSES),
        "prefill_rows": rows[:, 0],
        "decode_rows": rows[:, 1],
        "case": np.array(self._case, np.int32),
        "plan_stats": self._plan_stats(),
        "bucket": np.array(self._bucket, np.int64),
        "idle_before_ms": np.array(self._idle, np.float64),
    }

  def summary(self, case: int) -> dict:
    """One case's steps: their count, the sums of measured and predicted
    ms, and per step class the count, the sums and the median of
    predicted / measured - 1 (positive: the model is slower)."""
    a = self.arrays()
    mine = a["case"] == case
    out = {"count": int(mine.sum()),
           "measured_ms_sum": float(a["measured_ms"][mine].sum()),
           "predicted_ms_sum": float(a["predicted_ms"][mine].sum()),
           "uncommitted_calls": self.cases[case]["uncommitted_calls"], "by_class": {}}
    for i, name in enumerate(STEP_CLASSES):
      sel = mine & (a["step_class"] == i)
      out["by_class"][name] = {
          "count": int(sel.sum()),
          "measured_ms_sum": float(a["measured_ms"][sel].sum()),
          "predicted_ms_sum": float(a["predicted_ms"][sel].sum()),
          "median_pred_over_measured_minus_1": _rel_err(a["predicted_ms"][sel],
                                                         a["measured_ms"][sel])}
    return out

  def schedule(self, case: int) -> dict:
    """One case's schedule without its times: the step count and the
    predicted ms sum, in all and per step class (for a simulated replay,
    whose wall times are the host's, not the machine's)."""
    a = self.arrays()
    mine = a["case"] == case
    out = {"count": int(mine.sum()), "predicted_ms_sum": float(a["predicted_ms"][mine].sum()),
           "by_class": {}}
    for i, name in enumerate(STEP_CLASSES):
      sel = mine & (a["step_class"] == i)
      out["by_class"][name] = {"count": int(sel.sum()),
                               "predicted_ms_sum": float(a["predicted_ms"][sel].sum())}
    return out

  def save(self, path: str, load_avg: float, meta: dict) -> None:
    """Writes the .npz: the rows, ``load_avg`` (the load average the
    measurement was taken at) and ``meta`` with ``cases`` and the cost
    model's JSON added."""
    meta = dict(meta, cases=self.cases, cost_model=self.cost.to_json(),
                created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:        # the path as given (savez would add .npz)
      np.savez(f, **self.arrays(), load_avg=np.float64(load_avg), meta=json.dumps(meta))


def load(path: str) -> dict:
  """A step log's fields (``meta`` parsed, ``load_avg`` a float).

  Raises:
    ValueError: its features are not ``cost_model.FEATURES``.
  """
  with np.load(path) as z:
    log = {k: z[k] for k in z.files}
  names = tuple(str(n) for n in log["feature_names"])
  if names != cost_lib.FEATURES:
    raise ValueError(f"step log {path!r} has features {list(names)}, not "
                     f"{list(cost_lib.FEATURES)} (recorded by another version)")
  log["meta"] = json.loads(str(log["meta"]))
  log["load_avg"] = float(log["load_avg"])
  return log


def fit_steps(paths: Sequence[str], max_load: float,
              features: Optional[Sequence[str]] = None,
              relative: bool = False) -> cost_lib.CostModel:
  """Fits the "sum" cost model (``cost_model.fit``, NNLS) on the steps of
  the step logs at ``paths``.

  As on the calibration grid, ``weight_read_gb`` is fitted only when the
  logs hold two or more models (on one it cannot be told from ``step``),
  and predictions are floored at half the fastest step. The meta says the
  source ("replay steps"), the files, the step count, the load averages,
  the models, and the new fit's median of predicted / measured - 1 per step
  class. ``features`` (None: all) names the terms fitted; the others stay 0.
  ``relative``: fit relative step errors (``cost_model.fit``).

  Raises:
    ValueError: a log recorded at a load average above ``max_load`` (naming
      --max_load), logs of different dtypes, engine presets or devices, or
      no steps.
  """
  logs = [load(p) for p in paths]
  for path, log in zip(paths, logs):
    if log["load_avg"] > max_load:
      raise ValueError(f"step log {path!r} was recorded at a 1-minute load average of "
                       f"{log['load_avg']:.2f} > --max_load={max_load}: its step times are "
                       f"not this machine's alone (record it again on an idle machine)")
  first = logs[0]["meta"]
  for path, log in zip(paths[1:], logs[1:]):
    for key in ("dtype", "engine"):
      if log["meta"][key] != first[key]:
        raise ValueError(f"step logs differ in {key}: {paths[0]!r} has {first[key]!r}, "
                         f"{path!r} has {log['meta'][key]!r}")
    if log["meta"]["device"]["id"] != first["device"]["id"]:
      raise ValueError(f"step logs were recorded on different devices: {paths[0]!r} on "
                       f"{first['device']['id']}, {path!r} on {log['meta']['device']['id']}")
  x = np.concatenate([log["features"] for log in logs])
  y = np.concatenate([log["measured_ms"] for log in logs])
  if len(y) == 0:
    raise ValueError(f"step logs {list(paths)} hold no steps")
  classes = np.concatenate([log["step_class"] for log in logs])
  models, names = [], []
  for log in logs:
    for costs in log["meta"]["models"]:
      if costs not in models:
        models.append(costs)
        names.append(log["meta"]["model"])
  free = [f for f in features or cost_lib.FEATURES
          if f != "weight_read_gb" or len(models) > 1]
  meta = dict(source="replay steps", files=list(paths), steps=int(len(y)),
              model=first["model"], family=first.get("family"), dtype=first["dtype"],
              engine=first["engine"], device=first["device"], models=models,
              model_names=names, load_avg=[log["load_avg"] for log in logs],
              max_load=max_load,
              cases=[c for log in logs for c in log["meta"]["cases"]],
              created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
  model = cost_lib.fit(x, y, free=free, min_step_ms=float(np.min(y)) * 0.5, meta=meta,
                       relative=relative)
  predicted = np.array([model.predict_ms(r) for r in x])
  model.meta["by_class"] = {
      name: {"count": int((classes == i).sum()),
             "median_pred_over_measured_minus_1": _rel_err(predicted[classes == i],
                                                            y[classes == i])}
      for i, name in enumerate(STEP_CLASSES)}
  return model


def load_grids(paths):
  """(features, step_ms, meta) of saved grids, merged: the rows of all, and
  one meta whose ``models``/``model_names`` list every grid's models and
  whose load averages and spreads are every grid's (``grids`` names the
  files). The first grid's dtype, engine and device must be every grid's.

  Raises:
    ValueError: a grid of another dtype, engine preset, device or feature
      set than the first.
  """
  xs, ys, metas = [], [], []
  for path in paths:
    grid = np.load(path)
    xs.append(grid["features"])
    ys.append(grid["step_ms"])
    metas.append(json.loads(str(grid["meta"])))
    if xs[-1].shape[1] != len(cost_lib.FEATURES):
      raise ValueError(f"{path!r} has {xs[-1].shape[1]} features, not the "
                       f"{len(cost_lib.FEATURES)} of {list(cost_lib.FEATURES)} (measured by "
                       f"another version: measure it again)")
    for key in ("dtype", "engine"):
      if metas[-1][key] != metas[0][key]:
        raise ValueError(f"grids differ in {key}: {paths[0]!r} has "
                         f"{metas[0][key]!r}, {path!r} has {metas[-1][key]!r}")
    if metas[-1]["device"]["id"] != metas[0]["device"]["id"]:
      raise ValueError(f"{path!r} was measured on another device than {paths[0]!r}")
  if len(metas) == 1:
    return xs[0], ys[0], metas[0]
  meta = dict(metas[0], grids=list(paths),
              models=[m for meta in metas for m in meta["models"]],
              model_names=[n for meta in metas for n in meta["model_names"]],
              load_avg_before=[meta["load_avg_before"] for meta in metas],
              load_avg_after=[meta["load_avg_after"] for meta in metas],
              step_time_spread=[s for meta in metas for s in meta["step_time_spread"]])
  return np.concatenate(xs), np.concatenate(ys), meta
