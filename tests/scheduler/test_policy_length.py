"""SJF, SRPT and shortest-prefill-first (``scheduler.policy_length``).

The output-length prediction is learned through ``apply`` from ended
requests only; each policy then orders a worked example whose order is
computed by hand in the test's docstring (aging_ms = 20, now = 100 or
200 ms), with aging on and off.
"""

import numpy as np
import pytest

from tests.scheduler import fixtures as fx
from scheduler import records as rec
from scheduler import validate as v
from scheduler.policies import Budgets, make_policy
from scheduler.policy_length import (ShortestJobFirst, ShortestPrefillFirst,
                                     ShortestRemainingFirst, predicted_outputs)
from tests.scheduler.policy_testing import Driver


def _plan(policy, reqs, *, now_ms, client_requests, client_outputs, num_pages=64):
  manifest, state = fx.build(reqs, num_slots=len(reqs) + 1, num_clients=3,
                             now_ms=now_ms)
  state = state.replace(
      client_completed_requests=np.asarray(client_requests, np.int32),
      client_completed_outputs=np.asarray(client_outputs, np.int32))
  online = manifest.online()
  view = fx.alloc_view(state, num_pages=num_pages, page_size=4)
  plan = fx.plan_jit(policy, online, state, view)
  v.validate_plan(online, state, plan, view)
  return online, state, plan


def _served(plan, names):
  sel = np.flatnonzero(np.asarray(plan.selected))
  order = sel[np.argsort(np.asarray(plan.rank)[sel])]
  widths = np.asarray(plan.end) - np.asarray(plan.start)
  return [(names[s], int(widths[s])) for s in order]


def test_the_prediction_is_learned_from_ended_requests_through_apply():
  """Client 0 completes requests of 2 and 5 outputs, client 1 one of 9;
  client 2's only request fails (not counted); client 1's second request is
  still live (its hidden 30 is never read). Counters: requests [2, 1, 0],
  outputs [7, 9, 0]. G_hat: client 0 ceil(7 / 2) = 4; client 1 9, clipped
  to a new request's max_tokens 6; client 2 (no history) the mean over
  all, ceil(16 / 3) = 6; before any completion, max_tokens."""
  d = Driver(ShortestJobFirst(Budgets(token_budget=16, seq_budget=4, chunk_cap=16)),
             num_slots=8, num_clients=3, num_pages=64, page_size=4)
  assert np.asarray(d.state.client_completed_requests).tolist() == [0, 0, 0]
  d.arrive("a", prompt_len=2, max_tokens=8, client=0, hidden=2)
  d.arrive("b", prompt_len=2, max_tokens=8, client=0, hidden=5)
  d.arrive("c", prompt_len=2, max_tokens=9, client=1, hidden=9)
  fails = d.arrive("e", prompt_len=2, max_tokens=8, client=2, hidden=3)
  late = d.arrive("late", prompt_len=2, max_tokens=30, client=1, hidden=30)
  online = d.manifest.online()
  assert np.asarray(predicted_outputs(online, d.state))[:5].tolist() == [8, 8, 9, 8, 30]
  fail = np.zeros(8, bool)
  fail[fails] = True
  d.step(1.0, fail=fail)
  for t in range(2, 13):
    d.step(float(t))
  status = np.asarray(d.state.status)
  assert status[:4].tolist() == [rec.FINISHED] * 4 and status[late] == rec.RUNNING
  assert int(d.state.finish_reason[fails]) == rec.FINISH_ERROR
  assert np.asarray(d.state.client_completed_requests).tolist() == [2, 1, 0]
  assert np.asarray(d.state.client_completed_outputs).tolist() == [7, 9, 0]
  for client, max_tokens in ((0, 8), (1, 6), (2, 8)):
    d.arrive(f"new{client}", prompt_len=2, max_tokens=max_tokens, client=client)
  online = d.manifest.online()
  new = [s for s, n in d.names.items() if n.startswith("new")]
  assert np.asarray(predicted_outputs(online, d.state))[new].tolist() == [4, 6, 6]


def test_sjf_worked_example():
  """Client history: client 0 mean ceil(3 / 2) = 2, client 1 mean 8.
  R0 runs (client 1, started: first, whatever its length). Waiting, by
  aged G_hat at now = 200 ms: W1 (client 1, arrived 0): 8 - 200 // 20 =
  -2; W2 (client 0, arrived 100): 2 - 5 = -3; W3 (client 0, arrived 150):
  2 - 2 = 0. Order R0, W2, W1, W3; three seats: R0, W2, W1. Without aging:
  W2 (2), W3 (2, later), W1 (8): R0, W2, W3."""
  reqs = [dict(slot=0, request_id=0, arrival_seq=0, arrival_ms=0.0, prompt_len=4,
               emitted=1, computed=4, status=rec.RUNNING, client=1),
          dict(slot=1, request_id=1, arrival_seq=1, arrival_ms=0.0, prompt_len=4, client=1),
          dict(slot=2, request_id=2, arrival_seq=2, arrival_ms=100.0, prompt_len=4, client=0),
          dict(slot=3, request_id=3, arrival_seq=3, arrival_ms=150.0, prompt_len=4, client=0)]
  names = ["R0", "W1", "W2", "W3"]
  budgets = Budgets(token_budget=16, seq_budget=3, chunk_cap=16)
  history = dict(client_requests=[2, 1, 0], client_outputs=[3, 8, 0])
  _, _, plan = _plan(ShortestJobFirst(budgets), reqs, now_ms=200.0, **history)
  assert _served(plan, names) == [("R0", 1), ("W2", 4), ("W1", 4)]
  assert np.asarray(plan.sort_key)[1].tolist() == [0, 1, -2, 1, 1, 0]
  _, _, plan = _plan(ShortestJobFirst(budgets, aging_ms=0.0), reqs, now_ms=200.0, **history)
  assert _served(plan, names) == [("R0", 1), ("W2", 4), ("W3", 4)]


def test_srpt_worked_example():
  """History as above (client 0: 2, client 1: 8; client 2 has none: the
  mean over all, ceil(11 / 3) = 4). Remaining rows max(G_hat - e, 1) +
  (target - c), aged at now = 100 ms: R0 (client 1, e = 1, decoding):
  7 - 5 = 2; R1 (client 0, e = 5, outlived its prediction: 1 left):
  1 - 5 = -4; W2 (client 0, prompt 2, arrived 40): 2 + 2 - 3 = 1; W3
  (client 2, prompt 1, arrived 100): 4 + 1 = 5. Order R1, W2, R0, W3: the
  waiting W2 goes before the running R0; three seats. Without aging:
  R1 (1), W2 (4), W3 (5), R0 (7)."""
  reqs = [dict(slot=0, request_id=0, arrival_seq=0, arrival_ms=0.0, prompt_len=4,
               emitted=1, computed=4, status=rec.RUNNING, client=1),
          dict(slot=1, request_id=1, arrival_seq=1, arrival_ms=0.0, prompt_len=2,
               emitted=5, computed=6, status=rec.RUNNING, client=0),
          dict(slot=2, request_id=2, arrival_seq=2, arrival_ms=40.0, prompt_len=2, client=0),
          dict(slot=3, request_id=3, arrival_seq=3, arrival_ms=100.0, prompt_len=1, client=2)]
  names = ["R0", "R1", "W2", "W3"]
  budgets = Budgets(token_budget=16, seq_budget=3, chunk_cap=16)
  history = dict(client_requests=[2, 1, 0], client_outputs=[3, 8, 0])
  online, state, plan = _plan(ShortestRemainingFirst(budgets), reqs, now_ms=100.0,
                              **history)
  assert np.asarray(predicted_outputs(online, state))[:4].tolist() == [8, 2, 2, 4]
  assert _served(plan, names) == [("R1", 1), ("W2", 2), ("R0", 1)]
  _, _, plan = _plan(ShortestRemainingFirst(budgets, aging_ms=0.0), reqs, now_ms=100.0,
                     **history)
  assert _served(plan, names) == [("R1", 1), ("W2", 2), ("W3", 1)]


def test_spf_worked_example():
  """Prompt (or rebuild) rows left, aged at now = 100 ms: R0 decoding
  (0 left, arrived 0): -5; P1 mid-prefill (12-row prompt, 4 done, arrived
  0): 8 - 5 = 3; W2 (prompt 6, arrived 60): 6 - 2 = 4; W3 (prompt 2,
  arrived 100): 2. Order R0, W3, P1, W2 under an 8-row budget: R0 1 row,
  W3 2, P1 the 5 left. Without aging: R0 (0), W3 (2), W2 (6), P1 (8): W2
  takes the 5 rows."""
  reqs = [dict(slot=0, request_id=0, arrival_seq=0, arrival_ms=0.0, prompt_len=4,
               emitted=1, computed=4, status=rec.RUNNING),
          dict(slot=1, request_id=1, arrival_seq=1, arrival_ms=0.0, prompt_len=12,
               computed=4, status=rec.RUNNING),
          dict(slot=2, request_id=2, arrival_seq=2, arrival_ms=60.0, prompt_len=6),
          dict(slot=3, request_id=3, arrival_seq=3, arrival_ms=100.0, prompt_len=2)]
  names = ["R0", "P1", "W2", "W3"]
  budgets = Budgets(token_budget=8, seq_budget=4, chunk_cap=8)
  history = dict(client_requests=[0, 0, 0], client_outputs=[0, 0, 0])
  _, _, plan = _plan(ShortestPrefillFirst(budgets), reqs, now_ms=100.0, **history)
  assert _served(plan, names) == [("R0", 1), ("W3", 2), ("P1", 5)]
  _, _, plan = _plan(ShortestPrefillFirst(budgets, aging_ms=0.0), reqs, now_ms=100.0,
                     **history)
  assert _served(plan, names) == [("R0", 1), ("W3", 2), ("W2", 5)]


@pytest.mark.parametrize("name", ["sjf", "srpt", "spf"])
def test_registered_with_aging_declared(name):
  policy = make_policy(name, Budgets(token_budget=8, seq_budget=2, chunk_cap=4))
  assert policy.policy_id == name and policy.starvation_free
  assert not type(policy)(policy.budgets, aging_ms=0.0).starvation_free
  with pytest.raises(ValueError, match="aging_ms must be >= 0"):
    type(policy)(policy.budgets, aging_ms=-1.0)
