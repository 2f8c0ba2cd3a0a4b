"""Preemption and resume records and their queue-state machine (§0x0C).

Four records, four owners, one binding. Every record carries the binding
``(request_id, generation, snapshot_sha256, suspension_epoch)``; a receipt
whose binding is not the current one (older epoch, older generation after a
cancellation, other digest) is refused with ``StaleReceipt`` — it may still
drive idempotent physical cleanup, never scheduling.

    PreemptionIntent     scheduler policy output (mode, fallback, target)
    ReleaseResult        allocator fact: READY / INFLIGHT / FAILED, bytes
    PreservationResult   preservation fact: exact ready prefix tokens
    ResumeTicket         derived: rebuild interval [T_ready, T_target)

Queue states and the only legal transitions (anything else raises
``IllegalTransition``)::

    RUNNING -> PREEMPT_PENDING -> SUSPENDED_PRESERVED | SUSPENDED_RECOMPUTE
                               -> CANCELLED
    SUSPENDED_* -> RESUME_PENDING -> RUNNING | CANCELLED

Rebuild rows ``[T_ready, T_target)`` consume token budget but publish no
output and no fairness service (the engine's recompute path marks them
``records.REBUILD``). Physical pages, host addresses and copy streams never
appear here: the engine's exact-preservation path (``serving.kv.swap``: KV
pages copied to host memory and back, ``preemption_mode="swap"``) publishes
``ReleaseResult`` / ``PreservationResult`` / ``ReadinessReceipt`` facts for
the same binding, and the state's frontier falls back to the preserved
prefix (``IterationResult.preserved_end``) instead of 0.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

# Queue states.
RUNNING = "RUNNING"
PREEMPT_PENDING = "PREEMPT_PENDING"
SUSPENDED_PRESERVED = "SUSPENDED_PRESERVED"
SUSPENDED_RECOMPUTE = "SUSPENDED_RECOMPUTE"
CANCELLED = "CANCELLED"
RESUME_PENDING = "RESUME_PENDING"
SUSPENDED = (SUSPENDED_PRESERVED, SUSPENDED_RECOMPUTE)

# Modes, fallbacks and receipt statuses.
PRESERVE_EXACT, RECOMPUTE, ABORT = "PRESERVE_EXACT", "RECOMPUTE", "ABORT"
REMAIN_SUSPENDED = "REMAIN_SUSPENDED"
READY, INFLIGHT, FAILED = "READY", "INFLIGHT", "FAILED"
# Readiness kinds of the resume conjunction besides release and preservation.
READINESS_KINDS = ("allocation", "promotion", "layers", "placement")


class IllegalTransition(ValueError):
  """A queue-state transition outside the §0x0C state machine."""


class StaleReceipt(ValueError):
  """A receipt bound to another generation, digest or suspension epoch."""


@dataclasses.dataclass(frozen=True)
class Binding:
  """The four-part identity every §0x0C record carries."""

  request_id: str
  generation: int
  snapshot_sha256: str
  suspension_epoch: int


@dataclasses.dataclass(frozen=True)
class PreemptionIntent:
  """Policy output: suspend ``binding`` (no physical claim).

  Attributes:
    semantic_target_tokens: T_target = committed = computed tokens frozen at
      preemption (p + e - 1 for an ordinary decoding request).
    mode: PRESERVE_EXACT | RECOMPUTE | ABORT.
    fallback: RECOMPUTE | REMAIN_SUSPENDED | ABORT, used if preservation fails.
  """

  intent_id: str
  binding: Binding
  mode: str
  fallback: str
  semantic_target_tokens: int
  reason: str
  policy_id: str
  decision_version: int

  def __post_init__(self):
    if self.mode not in (PRESERVE_EXACT, RECOMPUTE, ABORT):
      raise ValueError(f"PreemptionIntent.mode must be PRESERVE_EXACT, RECOMPUTE "
                       f"or ABORT, got {self.mode!r}")
    if self.fallback not in (RECOMPUTE, REMAIN_SUSPENDED, ABORT):
      raise ValueError(f"PreemptionIntent.fallback must be RECOMPUTE, "
                       f"REMAIN_SUSPENDED or ABORT, got {self.fallback!r}")
    if self.semantic_target_tokens < 0:
      raise ValueError(f"semantic_target_tokens must be >= 0, got "
                       f"{self.semantic_target_tokens}")


@dataclasses.dataclass(frozen=True)
class ReleaseResult:
  """Allocator fact; ``reclaimed_bytes`` counts only when READY."""

  binding: Binding
  status: str
  reclaimed_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class PreservationResult:
  """Preservation fact: the exact, identity-matched ready prefix (tokens)."""

  binding: Binding
  status: str
  exact_ready_prefix_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class ReadinessReceipt:
  """Another foreign fact of the resume conjunction (``READINESS_KINDS``)."""

  binding: Binding
  kind: str
  status: str


@dataclasses.dataclass(frozen=True)
class ResumeTicket:
  """Derived permission to resume: rebuild ``[T_ready, T_target)`` then
  continue with ordinary work at ``T_target``."""

  binding: Binding
  semantic_target_tokens: int
  rebuild_interval: Tuple[int, int]
  receipts: Tuple[object, ...]

  @property
  def recompute_overhead_tokens(self) -> int:
    return self.rebuild_interval[1] - self.rebuild_interval[0]

  @property
  def semantic_service_tokens(self) -> int:
    """Rebuild publishes no semantic (fairness) service: always 0."""
    return 0


@dataclasses.dataclass(frozen=True)
class QueueRecord:
  """The scheduler's view of one request's suspension lifecycle."""

  request_id: str
  generation: int
  snapshot_sha256: str
  suspension_epoch: int
  queue_state: str = RUNNING

  @property
  def binding(self) -> Binding:
    return Binding(self.request_id, self.generation, self.snapshot_sha256,
                   self.suspension_epoch)


# ------------------------------------------------------------ transitions


def _require_state(record: QueueRecord, allowed, to: str) -> None:
  if record.queue_state not in allowed:
    raise IllegalTransition(f"{record.request_id}: {record.queue_state} -> {to} "
                            f"is not allowed (from {sorted(allowed)} only)")


def check_binding(record: QueueRecord, receipt) -> None:
  """Raises StaleReceipt unless ``receipt.binding`` is the record's binding."""
  if receipt.binding != record.binding:
    raise StaleReceipt(f"{type(receipt).__name__} bound to {receipt.binding} "
                       f"is stale for {record.binding}")


def begin_preemption(record: QueueRecord, intent: PreemptionIntent) -> QueueRecord:
  """RUNNING -> PREEMPT_PENDING under a new (strictly later) epoch."""
  _require_state(record, (RUNNING,), PREEMPT_PENDING)
  b = intent.binding
  if (b.request_id, b.generation, b.snapshot_sha256) != (
      record.request_id, record.generation, record.snapshot_sha256):
    raise StaleReceipt(f"intent {intent.intent_id} bound to {b} is stale for "
                       f"{record.binding}")
  if b.suspension_epoch <= record.suspension_epoch:
    raise IllegalTransition(f"suspension epoch must grow: {record.suspension_epoch} "
                            f"-> {b.suspension_epoch}")
  return dataclasses.replace(record, suspension_epoch=b.suspension_epoch,
                             queue_state=PREEMPT_PENDING)


def published_capacity_bytes(record: QueueRecord, release: ReleaseResult) -> int:
  """Bytes the scheduler may count as free: only a matching READY release."""
  check_binding(record, release)
  return release.reclaimed_bytes if release.status == READY else 0


def settle(record: QueueRecord, intent: PreemptionIntent,
           release: Optional[ReleaseResult],
           preservation: Optional[PreservationResult] = None) -> QueueRecord:
  """PREEMPT_PENDING -> SUSPENDED_* / CANCELLED once the facts allow.

  ABORT (as mode, or as the fallback of a failed preservation) cancels;
  RECOMPUTE suspends for recompute once the release is READY; PRESERVE_EXACT
  suspends preserved once release and preservation are READY, and a FAILED
  preservation takes the intent's explicit fallback. Until then the record
  stays PREEMPT_PENDING (which is not free capacity).
  """
  _require_state(record, (PREEMPT_PENDING,), "SUSPENDED_*")
  for receipt in (release, preservation):
    if receipt is not None:
      check_binding(record, receipt)
  if intent.mode == ABORT:
    return cancel(record)
  if intent.mode == PRESERVE_EXACT and preservation is not None \
      and preservation.status == FAILED:
    if intent.fallback == ABORT:
      return cancel(record)
    if intent.fallback == REMAIN_SUSPENDED:
      return record
    return _after_release(record, release, SUSPENDED_RECOMPUTE)
  if intent.mode == RECOMPUTE:
    return _after_release(record, release, SUSPENDED_RECOMPUTE)
  if preservation is None or preservation.status != READY:
    return record
  return _after_release(record, release, SUSPENDED_PRESERVED)


def _after_release(record, release, to):
  if release is None or release.status != READY:
    return record
  return dataclasses.replace(record, queue_state=to)


def cancel(record: QueueRecord) -> QueueRecord:
  """Any non-terminal state -> CANCELLED with a successor generation
  (cancellation wins by generation: every older receipt becomes stale)."""
  if record.queue_state == CANCELLED:
    raise IllegalTransition(f"{record.request_id} is already CANCELLED")
  return dataclasses.replace(record, generation=record.generation + 1,
                             queue_state=CANCELLED)


def request_resume(record: QueueRecord) -> QueueRecord:
  """SUSPENDED_* -> RESUME_PENDING (not runnable until a ticket exists)."""
  _require_state(record, SUSPENDED, RESUME_PENDING)
  return dataclasses.replace(record, queue_state=RESUME_PENDING)


def derive_resume_ticket(record: QueueRecord, intent: PreemptionIntent,
                         release: ReleaseResult,
                         preservation: Optional[PreservationResult],
                         receipts: Sequence[ReadinessReceipt] = (),
                         required: Sequence[str] = ("allocation",)
                         ) -> Optional[ResumeTicket]:
  """The ResumeTicket, or None while the readiness conjunction is incomplete.

  Every receipt must carry the record's binding (else StaleReceipt). Needs:
  RESUME_PENDING, release READY, every ``required`` readiness kind READY,
  and for a preserved suspension a READY preservation whose exact prefix
  ``T_ready`` is in ``[0, T_target]``; a recompute suspension has
  ``T_ready = 0`` unless a READY exact prefix is supplied.
  """
  _require_state(record, (RESUME_PENDING,), "ticket")
  check_binding(record, intent)
  for receipt in (release, preservation, *receipts):
    if receipt is not None:
      check_binding(record, receipt)
  if release.status != READY:
    return None
  ready = {r.kind for r in receipts if r.status == READY}
  if any(kind not in ready for kind in required):
    return None
  target = intent.semantic_target_tokens
  t_ready = 0
  if preservation is not None and preservation.status == READY:
    t_ready = preservation.exact_ready_prefix_tokens
  elif preservation is not None and preservation.status == INFLIGHT:
    return None
  if not 0 <= t_ready <= target:
    raise ValueError(f"exact ready prefix {t_ready} must be in [0, {target}]")
  return ResumeTicket(binding=record.binding, semantic_target_tokens=target,
                      rebuild_interval=(t_ready, target),
                      receipts=tuple(r for r in (release, preservation, *receipts)
                                     if r is not None))


def complete_resume(record: QueueRecord, ticket: ResumeTicket) -> QueueRecord:
  """RESUME_PENDING -> RUNNING with a matching ticket."""
  _require_state(record, (RESUME_PENDING,), RUNNING)
  check_binding(record, ticket)
  return dataclasses.replace(record, queue_state=RUNNING)


def ordinary_next_interval(ticket: ResumeTicket) -> Tuple[int, int]:
  """The ordinary decode interval after the rebuild: [T_target, T_target+1)."""
  t = ticket.semantic_target_tokens
  return (t, t + 1)
