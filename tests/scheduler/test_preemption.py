"""§0x0C Loop 9 preemption/resume contracts and the engine's recompute path.

Reconstructed inputs (the article lists only the eight contract outcomes):
request "r" with generation 2, digest "S", suspension epochs 10 / 11, and the
frontiers each outcome names (T_target 6, 7, 5).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.scheduler import fixtures as fx
from scheduler import preemption as pre
from scheduler import records as rec
from scheduler import validate as v
from scheduler.ledger import Budgets
from scheduler.policies import make_policy
from scheduler.registry import POLICIES
from scheduler.policy_vllm import VllmV1
from tests.scheduler.policy_testing import step


def _suspend(mode, target, epoch=10, fallback=pre.RECOMPUTE):
  rec0 = pre.QueueRecord("r", 2, "S", epoch - 1)
  b = pre.Binding("r", 2, "S", epoch)
  intent = pre.PreemptionIntent("i", b, mode, fallback, target, "kv_pressure",
                                "vllm_v1", 7)
  return pre.begin_preemption(rec0, intent), intent, b


def _resume(record, intent, release, preservation=None, receipts=None):
  b = record.binding
  receipts = [pre.ReadinessReceipt(b, "allocation", pre.READY)] if receipts is None else receipts
  record = pre.settle(record, intent, release, preservation)
  record = pre.request_resume(record)
  return record, pre.derive_resume_ticket(record, intent, release, preservation, receipts)


def test_eight_loop9_contracts():
  resumable, stale = 0, 0
  # 1. exact preservation: empty rebuild [6, 6), then ordinary [6, 7).
  r, intent, b = _suspend(pre.PRESERVE_EXACT, 6)
  assert r.queue_state == pre.PREEMPT_PENDING
  r, t = _resume(r, intent, pre.ReleaseResult(b, pre.READY, 4096),
                 pre.PreservationResult(b, pre.READY, 6))
  assert t.rebuild_interval == (6, 6) and pre.ordinary_next_interval(t) == (6, 7)
  assert pre.complete_resume(r, t).queue_state == pre.RUNNING
  resumable += 1
  # 2. full recomputation: rebuild [0, 6), semantic service 0.
  r, intent, b = _suspend(pre.RECOMPUTE, 6)
  r, t = _resume(r, intent, pre.ReleaseResult(b, pre.READY, 4096))
  assert t.rebuild_interval == (0, 6) and t.semantic_service_tokens == 0
  assert t.recompute_overhead_tokens == 6
  resumable += 1
  # 3. partial exact prefix: rebuild [4, 7), then ordinary [7, 8).
  r, intent, b = _suspend(pre.PRESERVE_EXACT, 7)
  r, t = _resume(r, intent, pre.ReleaseResult(b, pre.READY, 4096),
                 pre.PreservationResult(b, pre.READY, 4))
  assert t.rebuild_interval == (4, 7) and pre.ordinary_next_interval(t) == (7, 8)
  resumable += 1
  # 4. failed preservation: the explicit recompute fallback, rebuild [0, 5).
  r, intent, b = _suspend(pre.PRESERVE_EXACT, 5, fallback=pre.RECOMPUTE)
  failed = pre.PreservationResult(b, pre.FAILED, 5)
  assert pre.settle(r, intent, pre.ReleaseResult(b, pre.READY, 1),
                    failed).queue_state == pre.SUSPENDED_RECOMPUTE
  r, t = _resume(r, intent, pre.ReleaseResult(b, pre.READY, 1), failed)
  assert t.rebuild_interval == (0, 5)
  resumable += 1
  # 5. cancellation race: the successor generation makes old receipts stale.
  r, intent, b = _suspend(pre.PRESERVE_EXACT, 6)
  cancelled = pre.cancel(r)
  assert cancelled.queue_state == pre.CANCELLED and cancelled.generation == 3
  for receipt in (pre.ReleaseResult(b, pre.READY, 4096),
                  pre.PreservationResult(b, pre.READY, 6)):
    with pytest.raises(pre.StaleReceipt):
      pre.check_binding(cancelled, receipt)
    stale += 1
  with pytest.raises(pre.IllegalTransition):
    pre.request_resume(cancelled)
  # 6. repeated preemption: the epoch-10 receipt cannot satisfy epoch 11.
  r, intent10, b10 = _suspend(pre.PRESERVE_EXACT, 6, epoch=10)
  r = pre.settle(r, intent10, pre.ReleaseResult(b10, pre.READY, 1),
                 pre.PreservationResult(b10, pre.READY, 6))
  r = pre.complete_resume(pre.request_resume(r), pre.derive_resume_ticket(
      pre.request_resume(r), intent10, pre.ReleaseResult(b10, pre.READY, 1),
      pre.PreservationResult(b10, pre.READY, 6),
      [pre.ReadinessReceipt(b10, "allocation", pre.READY)]))
  b11 = pre.Binding("r", 2, "S", 11)
  intent11 = pre.PreemptionIntent("i11", b11, pre.PRESERVE_EXACT, pre.RECOMPUTE, 6,
                                  "kv_pressure", "vllm_v1", 8)
  r = pre.begin_preemption(r, intent11)
  with pytest.raises(pre.StaleReceipt):
    pre.settle(r, intent11, pre.ReleaseResult(b11, pre.READY, 1),
               pre.PreservationResult(b10, pre.READY, 6))
  stale += 1
  r, t = _resume(r, intent11, pre.ReleaseResult(b11, pre.READY, 1),
                 pre.PreservationResult(b11, pre.READY, 6))
  assert t.binding.suspension_epoch == 11
  resumable += 1
  # 7. promotion in flight: no resume ticket.
  r, intent, b = _suspend(pre.PRESERVE_EXACT, 6)
  r = pre.request_resume(pre.settle(r, intent, pre.ReleaseResult(b, pre.READY, 1),
                                    pre.PreservationResult(b, pre.READY, 6)))
  assert pre.derive_resume_ticket(
      r, intent, pre.ReleaseResult(b, pre.READY, 1), pre.PreservationResult(b, pre.READY, 6),
      [pre.ReadinessReceipt(b, "allocation", pre.READY),
       pre.ReadinessReceipt(b, "promotion", pre.INFLIGHT)],
      required=("allocation", "promotion")) is None
  # 8. release in flight: no reclaimed capacity and no resume ticket.
  r, intent, b = _suspend(pre.RECOMPUTE, 6)
  inflight = pre.ReleaseResult(b, pre.INFLIGHT, 4096)
  assert pre.published_capacity_bytes(r, inflight) == 0
  assert pre.settle(r, intent, inflight).queue_state == pre.PREEMPT_PENDING
  with pytest.raises(pre.IllegalTransition):
    pre.request_resume(pre.settle(r, intent, inflight))
  assert (resumable, stale) == (5, 3)


def test_illegal_transitions_refused():
  r = pre.QueueRecord("r", 0, "S", 0)
  with pytest.raises(pre.IllegalTransition):
    pre.request_resume(r)                        # RUNNING is not suspended
  _, intent, _ = _suspend(pre.RECOMPUTE, 3)
  with pytest.raises(pre.IllegalTransition):     # epoch must grow
    pre.begin_preemption(pre.QueueRecord("r", 2, "S", 10), intent)


def test_engine_recompute_rebuild_publishes_no_service():
  """The §0x0D FCFS victim B (p=3, e=1) is recompute-preempted, then rebuilds
  [0, 3) as REBUILD rows: recompute_rows +3, fairness service +0, no output;
  its next interval is the ordinary decode [3, 4)."""
  reqs = [dict(slot=0, request_id=0, arrival_seq=0, prompt_len=4, emitted=1,
               computed=4, status=rec.RUNNING, client=0, hidden=9),
          dict(slot=1, request_id=1, arrival_seq=1, prompt_len=3, emitted=1,
               computed=3, status=rec.RUNNING, client=1, hidden=9)]
  manifest, state = fx.build(reqs, num_slots=2)
  policy = VllmV1(Budgets(token_budget=8, seq_budget=2, chunk_cap=8))
  hits, fail = np.zeros(2, np.int32), np.zeros(2, bool)
  run = lambda state, pages: step(policy, manifest, state, np.float32(1), np.float32(1),
                                  hits, fail, num_pages=pages, page_size=4)
  state, plan, _, pb, rb = run(state, 2)
  assert int(pb) == int(rb) == 0 and bool(plan.preempt[1])
  assert int(state.generation[1]) == 1 and int(state.computed[1]) == 0
  service = np.asarray(state.service_rows).copy()
  state, plan, result, pb, rb = run(state, 8)
  assert int(pb) == int(rb) == 0
  assert int(plan.kind[1]) == rec.REBUILD and (int(plan.start[1]), int(plan.end[1])) == (0, 3)
  assert not bool(result.emitted[1]) and int(state.emitted[1]) == 1
  assert int(state.service_rows[1]) == service[1]
  assert int(state.recompute_rows[1]) == 3
  state, plan, _, _, _ = run(state, 8)
  assert int(plan.kind[1]) == rec.DECODE_ROW and int(plan.start[1]) == 3


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_readmits_a_preserved_decoder_with_one_decode_row(name):
  """§0x0C exact preservation: a request suspended with its whole prefix
  preserved (T_ready = T_target = p + e - 1) is WAITING at the decode
  frontier holding no pages; re-admission is one DECODE_ROW [c, c + 1)
  whose pages cover the restored prefix, not a REBUILD."""
  policy = make_policy(name, Budgets(token_budget=8, seq_budget=2, chunk_cap=8))
  # max_tokens 3: ORCA's max reservation (p + 3 = 7 rows) fits 2 pages too.
  reqs = [dict(slot=0, request_id=0, arrival_seq=0, prompt_len=4, emitted=2,
               computed=5, generation=1, status=rec.WAITING, max_tokens=3),
          dict(slot=1, request_id=1, arrival_seq=1, prompt_len=9, status=rec.WAITING)]
  manifest, state = fx.build(reqs, num_slots=3)
  state = state.replace(num_preemptions=state.num_preemptions.at[0].set(1))
  # Nothing held (the pages went back at preemption); 2 pages of 4 rows are
  # free: exactly what the restored prefix and its next row need.
  view = rec.AllocatorView(free_pages=jnp.int32(2), pages_held=jnp.zeros(3, jnp.int32),
                           page_size=4)
  online = manifest.online()
  plan = jax.jit(lambda m, s, a: policy(m, s, a))(online, state, view)
  v.validate_plan(online, state, plan)
  assert bool(plan.selected[0]) and bool(plan.admit[0])
  assert (int(plan.start[0]), int(plan.end[0])) == (5, 6)
  assert int(plan.kind[0]) == rec.DECODE_ROW
  # The fresh prompt needs three pages and must wait; under a FCFS ``break``
  # it does not block the resumed decoder either.
  assert not bool(plan.selected[1])
