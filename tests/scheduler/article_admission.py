"""The article's host-level admission records (§0x06, Loop 5), built on
``scheduler.admission``'s reservation arithmetic: what the scheduler hands
the allocator and what comes back. The engine builds none of them (its
admission runs inside the jitted policies); the article's tests do.

Three records, three owners, never merged:

    ReservationEstimate       scheduler: forecast rows/bytes and ceilings
    AllocationRequest         scheduler -> allocator: rows for one epoch
    PhysicalAllocationResult  allocator: GRANTED / TEMPORARILY_UNAVAILABLE /
                              FAILED (the scheduler never fills it in)
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from scheduler.admission import POLICY_KINDS, admits, append_rows, forecast_outputs, soft_ceiling
from tests.scheduler import article_accounting as acc

GRANTED, TEMPORARILY_UNAVAILABLE, FAILED = "GRANTED", "TEMPORARILY_UNAVAILABLE", "FAILED"


@dataclasses.dataclass(frozen=True)
class ReservationPolicy:
  """How G_hat is chosen and how much headroom admission keeps.

  Attributes:
    kind: "max" (declared max_tokens), "point" (a named predictor's value),
      "quantile" (a named predictor's quantile), "watermark" (a quantile
      forecast against the soft ceiling C_hard - watermark_rows).
    predictor_id: names the prediction source for point / quantile /
      watermark ("" for max).
    quantile: e.g. 0.9 for "quantile" / "watermark".
    watermark_rows: W, rows held outside ordinary admission (watermark only).
  """

  kind: str
  predictor_id: str = ""
  quantile: float = 0.9
  watermark_rows: int = 0

  def __post_init__(self):
    if self.kind not in POLICY_KINDS:
      raise ValueError(f"ReservationPolicy.kind must be one of {POLICY_KINDS}, "
                       f"got {self.kind!r}")
    if self.kind != "max" and not self.predictor_id:
      raise ValueError(f"ReservationPolicy.predictor_id must name the predictor "
                       f"for kind {self.kind!r}")
    if self.watermark_rows < 0 or (self.kind != "watermark" and self.watermark_rows):
      raise ValueError(f"watermark_rows must be >= 0 and only set for kind "
                       f"'watermark', got {self.watermark_rows}")

  @property
  def policy_id(self) -> str:
    return f"{self.kind}:{self.predictor_id}" if self.predictor_id else self.kind


@dataclasses.dataclass(frozen=True)
class RequestView:
  """Online facts of one request (never its realized length).

  Attributes:
    max_tokens: declared output cap.
    emitted: outputs already emitted (E).
    uncached_prompt_rows: U, prompt rows still to prefill (0 once run).
    point_forecast / quantile_forecast: the named predictor's total-output
      forecasts (None if it has none); both <= max_tokens.
  """

  request_id: str
  generation: int
  max_tokens: int
  emitted: int = 0
  uncached_prompt_rows: int = 0
  point_forecast: Optional[int] = None
  quantile_forecast: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class ReservationEstimate:
  """Scheduler-owned forecast of one request's future rows (logical)."""

  policy_id: str
  prediction_version: str
  estimated_rows: int
  estimated_bytes: int
  hard_ceiling_rows: int
  soft_ceiling_rows: int


@dataclasses.dataclass(frozen=True)
class AllocationRequest:
  """Scheduler -> allocator: rows requested for one generation and epoch."""

  request_id: str
  generation: int
  allocation_epoch: int
  requested_rows: int
  requested_bytes: int


@dataclasses.dataclass(frozen=True)
class PhysicalAllocationResult:
  """Allocator-owned fact; the scheduler only branches on it."""

  request_id: str
  generation: int
  allocation_epoch: int
  status: str
  granted_rows: int = 0


@dataclasses.dataclass(frozen=True)
class AdmissionIntent:
  estimate: ReservationEstimate
  allocation_request: AllocationRequest
  physical_allocation_result: None = None


@dataclasses.dataclass(frozen=True)
class DeferCapacity:
  estimate: ReservationEstimate


def soft_ceiling_rows(hard_ceiling_rows: int, watermark_rows: int) -> int:
  """C_soft = C_hard - W (rows); ValueError if the watermark is illegal."""
  if not 0 <= watermark_rows <= hard_ceiling_rows:
    raise ValueError(f"watermark_rows must be in [0, {hard_ceiling_rows}], "
                     f"got {watermark_rows}")
  return int(soft_ceiling(hard_ceiling_rows, watermark_rows))


def forecast_total_outputs(policy: ReservationPolicy, request: RequestView) -> int:
  """G_hat from online facts only; ValueError if a forecast is missing or
  exceeds the declared maximum."""
  if policy.kind == "max":
    return int(forecast_outputs("max", request.max_tokens))
  value = (request.point_forecast if policy.kind == "point"
           else request.quantile_forecast)
  if value is None:
    raise ValueError(f"{request.request_id}: predictor {policy.predictor_id!r} "
                     f"published no {policy.kind} forecast")
  if not 0 <= value <= request.max_tokens:
    raise ValueError(f"{request.request_id}: forecast {value} outside "
                     f"[0, max_tokens={request.max_tokens}]")
  return value


def estimate(policy: ReservationPolicy, request: RequestView, hard_ceiling_rows: int,
             prediction_version: str = "v1") -> ReservationEstimate:
  """ReservationEstimate: A_hat rows (§0x05) and bytes, with both ceilings."""
  g_hat = forecast_total_outputs(policy, request)
  rows = int(append_rows(request.uncached_prompt_rows, request.emitted, g_hat))
  return ReservationEstimate(
      policy_id=policy.policy_id, prediction_version=prediction_version,
      estimated_rows=rows, estimated_bytes=acc.rows_to_bytes(rows),
      hard_ceiling_rows=hard_ceiling_rows,
      soft_ceiling_rows=soft_ceiling_rows(hard_ceiling_rows, policy.watermark_rows))


def plan_admission(policy: ReservationPolicy, request: RequestView,
                   reserved_rows: int, hard_ceiling_rows: int,
                   allocation_epoch: int) -> Union[AdmissionIntent, DeferCapacity]:
  """Admit iff ``reserved_rows + A_hat <= soft ceiling``; the intent carries
  an AllocationRequest and no physical result."""
  est = estimate(policy, request, hard_ceiling_rows)
  if not admits(reserved_rows, est.estimated_rows, est.soft_ceiling_rows):
    return DeferCapacity(est)
  return AdmissionIntent(est, AllocationRequest(
      request_id=request.request_id, generation=request.generation,
      allocation_epoch=allocation_epoch, requested_rows=est.estimated_rows,
      requested_bytes=est.estimated_bytes))


def admit_fifo(policy: ReservationPolicy, requests, base_rows: int,
               hard_ceiling_rows: int, allocation_epoch: int = 0):
  """FIFO ``plan_admission`` over ``requests``; a deferred request does not
  reserve. Returns the list of intents / deferrals."""
  reserved, out = base_rows, []
  for r in requests:
    decision = plan_admission(policy, r, reserved, hard_ceiling_rows, allocation_epoch)
    if isinstance(decision, AdmissionIntent):
      reserved += decision.estimate.estimated_rows
    out.append(decision)
  return out


def admit_fifo_rows(base_rows: int, estimated_rows, ceiling_rows: int):
  """``admits`` over a FIFO list of A_hat rows; a miss defers (skips) and
  reserves nothing. Returns list[bool]; reads only estimates."""
  reserved, admitted = base_rows, []
  for rows in estimated_rows:
    ok = bool(admits(reserved, rows, ceiling_rows))
    admitted.append(ok)
    reserved += rows if ok else 0
  return admitted


def extension_request(request_id: str, generation: int, allocation_epoch: int,
                      reserved_rows: int, used_rows: int, margin_rows: int = 1,
                      extension_rows: int = 1) -> Optional[AllocationRequest]:
  """AllocationRequest for ``extension_rows`` more rows once progress is
  within ``margin_rows`` of the reserved frontier, else None."""
  if reserved_rows - used_rows >= margin_rows:
    return None
  return AllocationRequest(request_id=request_id, generation=generation,
                           allocation_epoch=allocation_epoch + 1,
                           requested_rows=extension_rows,
                           requested_bytes=acc.rows_to_bytes(extension_rows))


def on_allocation_result(result: PhysicalAllocationResult,
                         request: AllocationRequest) -> str:
  """Next intent from the allocator's fact: "publish" (GRANTED), "wait"
  (TEMPORARILY_UNAVAILABLE) or "preempt_or_reject" (FAILED). StaleResult-like
  mismatches raise ValueError."""
  if (result.request_id, result.generation, result.allocation_epoch) != (
      request.request_id, request.generation, request.allocation_epoch):
    raise ValueError(f"allocation result {result} does not answer {request}")
  return {GRANTED: "publish", TEMPORARILY_UNAVAILABLE: "wait",
          FAILED: "preempt_or_reject"}[result.status]
