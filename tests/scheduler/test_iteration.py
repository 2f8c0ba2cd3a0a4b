"""The executors' one set of stop rules (``scheduler.iteration.stop_rules``)
on a hand-made plan over the §0x01A iteration-5 fixture's slots."""

import jax.numpy as jnp
import numpy as np

from scheduler import iteration
from scheduler import records as rec
from scheduler.ledger import Budgets
from scheduler.policy_sarathi_serve import SarathiServe
from tests.scheduler import fixtures as fx

POLICY = SarathiServe(Budgets(token_budget=4, seq_budget=3, chunk_cap=4))


def _plan():
  """The fixture's slots (req-A: p=4, c=0; req-B: p=3, e=1, c=3; req-C:
  p=2, e=2, c=3; req-D: p=4, c=0; req-E finished; slot 5 free) under a plan
  that runs req-A's whole prompt, req-B's and req-C's decode rows and
  req-D's first two prompt rows."""
  manifest, state, _ = fx.iteration5_fixture()
  plan = fx.plan_jit(POLICY, manifest.online(), state,
                     fx.alloc_view(state, num_pages=16, page_size=4))
  chunk, row = rec.PREFILL_CHUNK, rec.DECODE_ROW
  plan = plan.replace(
      selected=jnp.array([1, 1, 1, 1, 0, 0], bool),
      kind=jnp.array([chunk, row, row, chunk, 0, 0], jnp.int32),
      start=jnp.array([0, 3, 3, 0, 0, 0], jnp.int32),
      end=jnp.array([4, 4, 4, 2, 0, 0], jnp.int32))
  return manifest.online(), state, plan


def test_stop_id_then_eos_then_length_and_a_failed_slot():
  manifest, state, plan = _plan()
  stop_ids = jnp.full((6, 2), -1, jnp.int32).at[1, 0].set(77)
  token = jnp.array([10, 77, 12, 13, 14, 15], jnp.int32)
  # max_model_len 5: every emitting slot reaches the context (p + e + 1 = 5),
  # so length loses to a stop id (req-B) and to EOS (req-A) and wins alone
  # (req-C); req-D fails outright and completes nothing.
  result = iteration.stop_rules(
      manifest, state, plan, token, is_eos=jnp.array([1, 0, 0, 0, 0, 0], bool),
      emit_ms=7.0, stop_ids=stop_ids, fail=jnp.array([0, 0, 0, 1, 1, 0], bool),
      max_model_len=5)
  np.testing.assert_array_equal(result.completed, [1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(result.emitted, [1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(result.failed, [0, 0, 0, 1, 0, 0])
  np.testing.assert_array_equal(result.finished, [1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(
      result.finish_reason, [rec.FINISH_EOS, rec.FINISH_STOP, rec.FINISH_LENGTH, 0, 0, 0])
  np.testing.assert_array_equal(result.token, [10, 77, 12, -1, -1, -1])
  np.testing.assert_array_equal(result.completed_end, [4, 4, 4, 0, 2, 0])
  np.testing.assert_array_equal(result.service_rows, [4, 1, 1, 0, 0, 0])
  assert float(result.emit_ms) == 7.0


def test_non_finite_logits_fail_only_an_emitting_slot():
  manifest, state, plan = _plan()
  token = jnp.array([10, 11, 12, 13, 14, 15], jnp.int32)
  # req-D's chunk emits nothing, so its logits are never read.
  result = iteration.stop_rules(manifest, state, plan, token,
                                is_eos=jnp.zeros((6,), bool),
                                finite=jnp.array([1, 0, 1, 0, 1, 1], bool))
  np.testing.assert_array_equal(result.failed, [0, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(result.completed, [1, 0, 1, 1, 0, 0])
  np.testing.assert_array_equal(result.emitted, [1, 0, 1, 0, 0, 0])
  # No context rule without max_model_len: max_tokens (16) is far.
  np.testing.assert_array_equal(result.finished, [0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(result.token, [10, -1, 12, -1, -1, -1])
