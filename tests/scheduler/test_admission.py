"""§0x06 admission records on the reconstructed Loop 5 fixture.

Reconstructed inputs (as in test_article_fixtures): 8 base rows, hard
ceiling 28, watermark 4; three FIFO resume-ready requests A, B, C with E = 1
and forecast totals G_hat = rows + 1: maximum [10, 11, 12], point [5, 4, 4],
p90 [7, 8, 6]; hidden realized append rows [6, 8, 7] (offline only).
"""

import pytest

from tests.scheduler import article_accounting as acc
from tests.scheduler import article_admission as art

MAX_ROWS, POINT, P90, REALIZED = [9, 10, 11], [4, 3, 3], [6, 7, 5], [6, 8, 7]


def _requests():
  return [art.RequestView(name, 0, max_tokens=m + 1, emitted=1, point_forecast=p + 1,
                          quantile_forecast=q + 1)
          for name, m, p, q in zip("ABC", MAX_ROWS, POINT, P90)]


def _admitted(policy):
  out = art.admit_fifo(policy, _requests(), base_rows=8, hard_ceiling_rows=28)
  return [isinstance(d, art.AdmissionIntent) for d in out], out


@pytest.mark.parametrize("policy,admitted,realized", [
    (art.ReservationPolicy("max"), [True, True, False], 22),
    (art.ReservationPolicy("point", predictor_id="len-point-v1"), [True] * 3, 29),
    (art.ReservationPolicy("quantile", predictor_id="len-q-v1", quantile=0.9), [True] * 3, 29),
    (art.ReservationPolicy("watermark", predictor_id="len-q-v1", watermark_rows=4),
     [True, True, False], 22),
])
def test_reservation_policies_admit_and_breach(policy, admitted, realized):
  got, decisions = _admitted(policy)
  assert got == admitted
  assert 8 + sum(r for r, a in zip(REALIZED, got) if a) == realized
  for d in decisions:
    if isinstance(d, art.AdmissionIntent):
      assert d.physical_allocation_result is None          # not allocation
      assert d.allocation_request.requested_rows == d.estimate.estimated_rows
      assert d.allocation_request.requested_bytes == acc.rows_to_bytes(d.estimate.estimated_rows)
  soft = decisions[0].estimate.soft_ceiling_rows
  assert soft == (24 if policy.kind == "watermark" else 28)


def test_extension_request_and_allocator_branches():
  """Watermark plan: B reserved 7 rows, realizes 8: when its progress reaches
  the reserved frontier the scheduler asks for one more row (22 <= 24, no
  victim); the allocator's answer, not the request, decides."""
  assert art.extension_request("B", 0, 3, reserved_rows=7, used_rows=5) is None
  ext = art.extension_request("B", 0, 3, reserved_rows=7, used_rows=7)
  assert ext.requested_rows == 1 and ext.allocation_epoch == 4
  for status, action in ((art.GRANTED, "publish"),
                         (art.TEMPORARILY_UNAVAILABLE, "wait"),
                         (art.FAILED, "preempt_or_reject")):
    assert art.on_allocation_result(
        art.PhysicalAllocationResult("B", 0, 4, status, 1), ext) == action
  with pytest.raises(ValueError):
    art.on_allocation_result(art.PhysicalAllocationResult("B", 0, 3, art.GRANTED), ext)


def test_forecast_refuses_missing_or_oversized_predictions():
  with pytest.raises(ValueError, match="predictor_id"):
    art.ReservationPolicy("point")
  with pytest.raises(ValueError, match="outside"):
    art.forecast_total_outputs(art.ReservationPolicy("point", predictor_id="p"),
                               art.RequestView("A", 0, max_tokens=4, point_forecast=9))
  new = art.estimate(art.ReservationPolicy("max"),
                     art.RequestView("N", 0, max_tokens=5, uncached_prompt_rows=3), 28)
  assert new.estimated_rows == 3 + 4                # U + max(G_hat - 1, 0)
