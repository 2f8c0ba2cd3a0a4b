"""A policy's own state (``SchedulerState.policy_state``): built by its
``init_state``, restarted per slot at an arrival and per client at
``forget_client``, advanced only through ``update``, whose old contract
(returning a whole SchedulerState) is refused by name."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from scheduler import apply as apply_lib
from scheduler import records as rec
from scheduler.ledger import Budgets
from scheduler.policy_fairness import FastServe, MlfqState, PrefixAware, Vtc, VtcState
from scheduler.policy_sarathi_serve import SarathiServe
from tests.scheduler.policy_testing import Driver

BUDGETS = Budgets(token_budget=8, seq_budget=2, chunk_cap=4)


def test_initial_state_carries_each_policys_own_state():
  fast = rec.initial_state(3, 2, policy=FastServe(BUDGETS)).policy_state
  assert isinstance(fast, MlfqState)
  assert np.asarray(fast.level.value).tolist() == [-1, -1, -1] and fast.level.fresh == -1
  vtc = rec.initial_state(3, 2, policy=Vtc(BUDGETS)).policy_state
  assert isinstance(vtc, VtcState) and vtc.counter.value.shape == (2,)
  assert np.asarray(vtc.active.value).dtype == bool and int(vtc.last_left) == 0
  assert int(rec.initial_state(3, 2, policy=PrefixAware(BUDGETS)).policy_state.hot_streak) == 0
  assert rec.initial_state(3, 2, policy=SarathiServe(BUDGETS)).policy_state is None
  assert rec.initial_state(3, 2).policy_state is None


def test_arrival_restarts_per_slot_columns_of_that_slot_only():
  state = rec.initial_state(3, 2, policy=FastServe(BUDGETS))
  own = state.policy_state
  state = state.replace(policy_state=own.replace(
      level=own.level.replace(value=jnp.asarray([2, 3, 1], jnp.int32)),
      wait=own.wait.replace(value=jnp.asarray([5, 6, 7], jnp.int32))))
  _, state = apply_lib.arrive(rec.empty_manifest(3), state, 1, 9, 0.0, 0, 4, 2, 0, 0)
  assert np.asarray(state.policy_state.level.value).tolist() == [2, -1, 1]
  assert np.asarray(state.policy_state.wait.value).tolist() == [5, 0, 7]


def test_forget_client_restarts_per_client_columns_and_keeps_the_rest():
  state = rec.initial_state(2, 3, policy=Vtc(BUDGETS))
  own = state.policy_state
  state = state.replace(policy_state=own.replace(
      counter=own.counter.replace(value=jnp.asarray([4, 5, 6], jnp.int32)),
      active=own.active.replace(value=jnp.asarray([True, True, False])),
      last_left=jnp.int32(7)))
  state = apply_lib.forget_client(state, 1)
  assert np.asarray(state.policy_state.counter.value).tolist() == [4, 0, 6]
  assert np.asarray(state.policy_state.active.value).tolist() == [True, False, False]
  assert int(state.policy_state.last_left) == 7


@dataclasses.dataclass(frozen=True)
class OldContract(SarathiServe):
  """An update hook that returns the whole successor, as before."""

  def init_state(self, num_slots, num_clients):
    return {"n": jnp.int32(0)}

  def update(self, manifest, state, plan, result, successor):
    return successor


def test_an_update_returning_a_scheduler_state_is_refused_by_name():
  d = Driver(OldContract(BUDGETS), num_slots=2)
  d.arrive("A", prompt_len=2, max_tokens=1)
  with pytest.raises(TypeError, match=r"OldContract.update must return the policy's own "
                                      r"state .*not a SchedulerState"):
    d.step(1.0)
