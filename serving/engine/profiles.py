"""Accelerator profiles: roofline cost models of a GPU or TPU, and the
collectives' times.

A profile (``configs/accelerators/NAME.json``, ``--cost_model=profile:NAME``)
is a ``CostModel`` of the "roofline" form: each compute and memory term at
the accelerator's peak x efficiency. The TPU profiles are published peaks x
stated efficiencies (``uncalibrated``).

A fitted GPU profile (format 2, ``scripts/fit_profiles.py`` and
``serving.engine.profile_fit``, on measured per-operator GPU timings) adds
terms that depend on the model: a fixed time per GEMM and per row-wise
operator in every block, the row-wise operators' bytes, and under TP one
device's share plus the all-reduces. ``for_model`` (inside ``resolve``)
charges them into the ``step`` and ``rows`` coefficients for the model at
hand; ``all_reduce_ms`` and ``send_recv_ms`` are the collectives' one
definition. ``transfer_link`` is the link a KV handoff crosses between two
engines (intra-node or inter-node): the fitted send/recv, or a profile's
stated, uncalibrated ``links``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from serving.engine.cost_model import COMPUTE, FEATURES, MEMORY, CostModel, ModelCosts

PROFILE_DIR = Path(__file__).resolve().parents[2] / "configs" / "accelerators"
PROFILE_PREFIX = "profile:"


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
  return transfer_link(model, "intra" if same_node else "inter").ms(nbytes)


LINKS = ("intra", "inter")


def transfer_link(model: CostModel, link: str = "intra") -> Link:
  """The link a KV handoff between two engines crosses: ``intra`` (two
  devices of one node) or ``inter`` (two nodes). The one definition both
  ``send_recv_ms`` and the simulator's transfers read: a fitted GPU
  profile's measured send/recv (``same_node`` / ``other_node``); a profile
  without measurements (the TPUs) states its ``links`` figures
  (``{"intra": {latency_ms, gbps}, "inter": ..., "source": ...}``: published
  interconnect peaks x an assumed efficiency, uncalibrated).

  Raises:
    ValueError: an unknown ``link``, or a model that states neither (a CPU
      calibration).
  """
  if link not in LINKS:
    raise ValueError(f"link must be one of {LINKS}, got {link!r}")
  table = model.meta.get("per_model", {}).get("collectives", {}).get("send_recv")
  where = "same_node" if link == "intra" else "other_node"
  if table and where in table:
    return _link(table[where], f"send_recv[{where}]")
  links = model.meta.get("links")
  if not links or link not in links:
    raise ValueError(f"cost model {model.meta.get('profile') or model.meta.get('path')!r} "
                     f"states no {link} link (a profile's send_recv or links does)")
  return _link(links[link], f"links[{link}]")


def transfer_link_source(model: CostModel, link: str = "intra") -> str:
  """Where ``transfer_link``'s figures come from, for reports."""
  if model.meta.get("per_model", {}).get("collectives", {}).get("send_recv"):
    return f"fitted send/recv ({model.meta.get('fitted', {}).get('to', 'measured')})"
  return model.meta.get("links", {}).get("source", "uncalibrated, stated")


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
  if "links" in p:
    for link in LINKS:
      _link(p["links"].get(link), f"profile {name}: links.{link}")
    meta["links"] = p["links"]
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
  * ``row_gemm_gflop``: the GEMMs charged over the step's live rows, not
    its padded bucket (the measured times are per actual token count);
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
    model = dataclasses.replace(model, row_gemm_gflop=costs.gemm_flops_per_row / 1e9)
    rows = float(ops.get("gemm_row_tile", 1.0))
    if rows > 1:
      per_row = dict(gemm_gflop=costs.gemm_flops_per_row,
                     prompt_gemm_gflop=costs.gemm_flops_per_row,
                     lm_head_gflop=costs.lm_head_flops_per_row)
      tile = tuple(rows * per_row[f] / 1e9 if f in per_row else 0.0 for f in FEATURES)
      model = dataclasses.replace(model, tile=tile)
  return dataclasses.replace(model, coef_ms=tuple(coef[f] for f in FEATURES), meta=meta)
