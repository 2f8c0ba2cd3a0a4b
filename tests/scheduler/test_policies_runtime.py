"""ORCA, SARATHI and vLLM-V1-shaped policies on article fixtures.

§0x03 (ORCA Algorithm 1: reserve prompt + max_tokens, break not skip,
release at finish), §0x09 (SARATHI anchor chunk; vLLM frontier catch-up with
long_prefill_token_threshold), §0x0D (FCFS tail victim vs PRIORITY
max(priority, arrival) victim).
"""

import numpy as np

from tests.scheduler import fixtures as fx
from scheduler import records as rec
from scheduler import validate as v
from scheduler.ledger import Budgets
from scheduler.policy_orca import Orca
from scheduler.policy_sarathi import Sarathi
from scheduler.policy_vllm import VllmV1
from tests.scheduler.policy_testing import Driver


def _widths(plan):
  return np.where(np.asarray(plan.selected),
                  np.asarray(plan.end) - np.asarray(plan.start), 0).tolist()


def test_vllm_long_prefill_threshold_400_400_224():
  """Three 800-token prompts, threshold 400, token budget 1024.

  Iteration 1 (waiting pass): 400, 400, then the remaining 224. Iteration 2
  (running pass, the same clamp): 400, 400, 224. Iteration 3: A and B reached
  800 and decode one row each; C catches up with 1024 - 2 = 1022 rows of
  budget but only 800 - 448 = 352 rows left: 1, 1, 352.
  """
  d = Driver(VllmV1(Budgets(token_budget=1024, seq_budget=4, chunk_cap=400)),
             num_slots=4, num_pages=256, page_size=16)
  for name in "ABC":
    d.arrive(name, prompt_len=800, max_tokens=4)
  schedule = []
  for t in range(3):
    _, plan, _ = d.step(t + 1.0)
    schedule.append(_widths(plan)[:3])
    assert d.served(plan) == ["A", "B", "C"]
  assert schedule == [[400, 400, 224], [400, 400, 224], [1, 1, 352]]


def _victim_fixture():
  """§0x0D: zero free pages, running [A, B], priority(A)=10, priority(B)=1.

  Reconstructed inputs: page size 4; A (p=4, e=1, c=4) needs a second page
  for its decode row [4, 5); B (p=3, e=1, c=3) decodes [3, 4) inside the one
  page (four teaching rows) it holds; the cache has exactly those 2 pages.
  """
  reqs = [dict(slot=0, request_id=0, arrival_seq=0, prompt_len=4, emitted=1,
               computed=4, status=rec.RUNNING, priority=10),
          dict(slot=1, request_id=1, arrival_seq=1, prompt_len=3, emitted=1,
               computed=3, status=rec.RUNNING, priority=1)]
  manifest, state = fx.build(reqs, num_slots=2)
  return manifest.online(), state, fx.alloc_view(state, num_pages=2, page_size=4)


def test_vllm_fcfs_versus_priority_victim():
  manifest, state, view = _victim_fixture()
  budgets = Budgets(token_budget=8, seq_budget=2, chunk_cap=8)
  fcfs = fx.plan_jit(VllmV1(budgets), manifest, state, view)
  v.validate_plan(manifest, state, fcfs)
  # FCFS: tail victim B releases its 4 rows; A schedules one row.
  assert np.asarray(fcfs.preempt).tolist() == [False, True]
  assert int(view.pages_held[1]) * view.page_size == 4
  assert _widths(fcfs) == [1, 0] and int(fcfs.num_tokens) == 1
  prio = fx.plan_jit(VllmV1(budgets, mode="priority"), manifest, state, view)
  v.validate_plan(manifest, state, prio)
  # PRIORITY: the least-favoured running request is A itself: it preempts
  # itself and no running row is scheduled (and no waiting pass follows).
  assert np.asarray(prio.preempt).tolist() == [True, False]
  assert not np.asarray(prio.selected).any() and int(prio.num_tokens) == 0


def test_vllm_no_waiting_pass_after_preemption():
  """A waiting request that would fit is not admitted in the step where the
  running pass preempted (§0x0D)."""
  manifest, state, view = _victim_fixture()
  reqs = [dict(slot=0, request_id=0, arrival_seq=0, prompt_len=4, emitted=1,
               computed=4, status=rec.RUNNING, priority=10),
          dict(slot=1, request_id=1, arrival_seq=1, prompt_len=3, emitted=1,
               computed=3, status=rec.RUNNING, priority=1),
          dict(slot=2, request_id=2, arrival_seq=2, prompt_len=1)]
  manifest, state = fx.build(reqs, num_slots=4)
  view = fx.alloc_view(state, num_pages=2, page_size=4)
  plan = fx.plan_jit(VllmV1(Budgets(token_budget=8, seq_budget=3, chunk_cap=8)),
                     manifest.online(), state, view)
  assert np.asarray(plan.preempt).tolist() == [False, True, False, False]
  assert not bool(plan.admit[2]) and not bool(plan.selected[2])


def test_orca_break_not_skip_and_release_at_finish():
  """ORCA Select() over 8 pages of 4 rows (32 reservable rows).

  r0 (prompt 4, max 4) reserves 2 pages; r1 (prompt 4, max 24) would need 7
  more: 9 > 8, so selection breaks and r2 (prompt 2, max 2, 1 page), which
  fits, is *not* admitted ahead of r1. r3's 10-token prompt is wider than the
  8-row token budget: unschedulable, reported in the plan. When r0 finishes
  (realized length 2) its reservation is released and r1, r2 are admitted.
  """
  d = Driver(Orca(Budgets(token_budget=8, seq_budget=4, chunk_cap=8)),
             num_slots=4, num_pages=8, page_size=4)
  d.arrive("r0", prompt_len=4, max_tokens=4, hidden=2)
  d.arrive("r1", prompt_len=4, max_tokens=24, hidden=1)
  d.arrive("r2", prompt_len=2, max_tokens=2, hidden=1)
  d.arrive("r3", prompt_len=10, max_tokens=1)
  _, plan, _ = d.step(1.0)
  assert d.served(plan) == ["r0"]
  assert np.asarray(plan.unschedulable).tolist() == [False, False, False, True]
  _, plan, result = d.step(2.0)
  assert d.served(plan) == ["r0"] and bool(result.finished[0])
  _, plan, _ = d.step(3.0)
  assert d.served(plan) == ["r1", "r2"]
  assert int(plan.end[1]) == 4 and int(plan.end[2]) == 2       # whole prompts


def test_sarathi_one_anchor_chunk_with_piggybacked_decodes():
  """Two decoding requests and two waiting 10-token prompts, C = 4, token
  budget 8, 4 sequences: one anchor chunk [0, 4) of the older prompt plus
  both decode rows; the younger prompt waits (one anchor per iteration)."""
  reqs = [dict(slot=0, request_id=0, arrival_seq=0, prompt_len=3, emitted=1,
               computed=3, status=rec.RUNNING),
          dict(slot=1, request_id=1, arrival_seq=1, prompt_len=2, emitted=2,
               computed=3, status=rec.RUNNING),
          dict(slot=2, request_id=2, arrival_seq=2, prompt_len=10),
          dict(slot=3, request_id=3, arrival_seq=3, prompt_len=10)]
  manifest, state = fx.build(reqs, num_slots=4)
  view = fx.alloc_view(state, num_pages=32, page_size=4)
  policy = Sarathi(Budgets(token_budget=8, seq_budget=4, chunk_cap=4))
  plan = fx.plan_jit(policy, manifest.online(), state, view)
  v.validate_plan(manifest.online(), state, plan)
  assert _widths(plan) == [1, 1, 4, 0]
  sel = np.flatnonzero(np.asarray(plan.selected))
  assert sel[np.argsort(np.asarray(plan.rank)[sel])].tolist() == [2, 0, 1]
