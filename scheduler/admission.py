"""Admission under unknown output length (§0x06).

One home for the reservation arithmetic, in jnp so the engine's jitted
policies run it (``scheduler.policies.ledger`` reads it through
``reservation_rows``) and the host records below reuse it:

* ``forecast_outputs``: G_hat per request from online facts only: the
  declared ``max_tokens`` ("max"), or an estimator over the output lengths
  of requests already completed in this run (``completed_outputs``, a
  histogram kept in ``SchedulerState`` by ``scheduler.apply``): its
  ceil-mean ("point", estimator ``mean_completed``) or its nearest-rank
  quantile ("quantile" / "watermark", estimator ``p90_completed`` for
  q = 0.9); the declared maximum before any request completed. Always
  clipped to ``[1, max_tokens]``. The realized length of a live request is
  never read.
* ``append_rows``: A_hat = U + max(G_hat - max(E, 1), 0): for a request that
  has emitted E >= 1 outputs, ``max(G_hat - E, 0)``; for an unstarted one,
  ``U + max(G_hat - 1, 0)`` (prefill emits output 1; §0x05). U counts the
  prompt (or rebuild) rows still to compute.
* ``soft_ceiling`` (C_hard - W) and ``admits`` (R + A_hat <= C_soft).

The records below (``ReservationPolicy``, ``RequestView``,
``ReservationEstimate``, ``AllocationRequest``, ``PhysicalAllocationResult``,
``plan_admission``, ``admit_fifo``, ``extension_request``,
``on_allocation_result``) are the article's host-level fixtures of the same
arithmetic for the Loop 5 tests (tests/scheduler/test_admission.py); the
engine does not build them. In the engine an extension is the decode row
that crosses a request's reserved frontier (``IterationPlan.extend``), and
a refused extension is handled by the ledger's victim rule.

Three records, three owners, never merged:

    ReservationEstimate       scheduler: forecast rows/bytes and ceilings
    AllocationRequest         scheduler -> allocator: rows for one epoch
    PhysicalAllocationResult  allocator: GRANTED / TEMPORARILY_UNAVAILABLE /
                              FAILED (the scheduler never fills it in)
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax.numpy as jnp

from scheduler import accounting as acc

POLICY_KINDS = ("max", "point", "quantile", "watermark")
# The engine's kinds: "policy" keeps each policy's published rule (ORCA
# reserves the declared maximum; the others allocate output rows on demand).
ENGINE_KINDS = ("policy",) + POLICY_KINDS


def estimator_name(kind: str, quantile: float = 0.9) -> str:
  """Name of the online G_hat estimator of ``kind`` (reported per replay)."""
  if kind == "point":
    return "mean_completed"
  if kind in ("quantile", "watermark"):
    return f"p{round(quantile * 100):d}_completed"
  return "declared_max" if kind == "max" else "policy"


def completed_quantile(completed_outputs, quantile: float):
  """i32[]: nearest-rank ``quantile`` of a histogram of completed output
  lengths (``completed_outputs[n]`` = requests that ended with n outputs);
  0 when empty. The smallest n with ``cumsum[n] >= ceil(q * total)``."""
  total = jnp.sum(completed_outputs)
  rank = jnp.maximum(jnp.ceil(quantile * total.astype(jnp.float32)).astype(jnp.int32), 1)
  return jnp.argmax(jnp.cumsum(completed_outputs) >= rank).astype(jnp.int32)


def completed_mean(completed_outputs):
  """i32[]: ceil of the mean completed output length (0 when empty)."""
  total = jnp.sum(completed_outputs)
  lengths = jnp.arange(completed_outputs.shape[0], dtype=jnp.int32)
  outputs = jnp.sum(lengths * completed_outputs)
  return jnp.where(total > 0, (outputs + total - 1) // jnp.maximum(total, 1), 0)


def forecast_outputs(kind: str, max_tokens, completed_outputs=None,
                     quantile: float = 0.9):
  """i32[R]: G_hat, the forecast total outputs of each request (§0x06).

  Args:
    kind: one of ``POLICY_KINDS`` (static).
    max_tokens: i32[R], declared output caps.
    completed_outputs: i32[L] histogram of the output lengths of requests
      completed in this run, or None (then every kind falls back to the
      declared maximum).
    quantile: static, the quantile of "quantile" / "watermark".

  Raises:
    ValueError: an unknown kind.
  """
  if kind not in POLICY_KINDS:
    raise ValueError(f"reservation kind must be one of {POLICY_KINDS}, got {kind!r}")
  max_tokens = jnp.asarray(max_tokens, jnp.int32)
  if kind == "max" or completed_outputs is None:
    return max_tokens
  est = (completed_mean(completed_outputs) if kind == "point"
         else completed_quantile(completed_outputs, quantile))
  est = jnp.where(jnp.sum(completed_outputs) > 0, est, max_tokens)
  return jnp.clip(est, 1, jnp.maximum(max_tokens, 1)).astype(jnp.int32)


def append_rows(uncached_rows, emitted, forecast_total):
  """A_hat = U + max(G_hat - max(E, 1), 0) future KV rows (§0x05, §0x06).

  ints or i32 arrays: ``uncached_rows`` U (prompt / rebuild rows still to
  compute), ``emitted`` E, ``forecast_total`` G_hat. The last output is
  never fed back, so a request with G_hat outputs writes ``p + G_hat - 1``
  rows in all.
  """
  return uncached_rows + jnp.maximum(forecast_total - jnp.maximum(emitted, 1), 0)


def soft_ceiling(hard_ceiling, watermark):
  """C_soft = C_hard - W (rows or pages; W is held outside admission)."""
  return hard_ceiling - watermark


def admits(reserved, estimated, ceiling):
  """The FIFO admission predicate ``R + A_hat <= C_soft`` (bool)."""
  return reserved + estimated <= ceiling
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
