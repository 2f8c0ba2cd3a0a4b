"""The ledger's goodput judges requests as its outcome partition does."""

from serving.harness import ledger
from serving.harness.metrics import RequestRecord


def _rec(rid, ttft_s, slo_ttft_ms=None):
  # Two tokens 0.1 s apart (TPOT 100 ms), arrival at 0.
  return RequestRecord(request_id=rid, client="c", arrival_s=0.0, first_token_s=ttft_s,
                       token_times_s=[ttft_s, ttft_s + 0.1], prompt_tokens=4, output_tokens=2,
                       outcome="completed", finish_reason="length", slo_ttft_ms=slo_ttft_ms)


def test_ledger_goodput_uses_each_requests_own_slo_before_the_shared_one():
  """Worked by hand. TTFTs 0.2, 0.4, 0.6 s; "a" declares 300 ms, "b" 500 ms,
  "c" none. With a shared 250 ms limit: a (0.2 <= 0.3) and b (0.4 <= 0.5)
  are valid by their own limits, c (0.6 > 0.25) misses: 2 valid of 3.
  Judged by the shared limit alone it would be 1 (only a); the partition
  says 2, and the goodput block must agree with it. Without a shared limit
  the requests' own SLOs still produce the block: c has no limit and
  passes, 3 valid."""
  records = [_rec("a", 0.2, 300.0), _rec("b", 0.4, 500.0), _rec("c", 0.6)]
  out = ledger.build_ledger(records, duration_s=2.0, ttft_ms=250.0)
  assert out["outcomes"]["total"]["valid"] == 2
  g = out["goodput"]
  assert (g["valid"], g["missed"]) == (2, 1)
  assert g["request_goodput"] == 1.0          # 2 valid / 2 s
  assert g["slo"] == {"ttft_ms": 250.0, "tpot_ms": None, "e2el_ms": None,
                      "per_request": True, "horizon_s": None}
  assert out["slo"]["requests_declare_slos"] is True
  own = ledger.build_ledger(records, duration_s=2.0)
  assert own["outcomes"]["total"]["valid"] == own["goodput"]["valid"] == 3
  none = ledger.build_ledger([_rec("d", 0.6)], duration_s=2.0)
  assert "goodput" not in none                # no limit anywhere: no goodput block
  assert none["slo"]["requests_declare_slos"] is False


def test_ledger_goodput_counts_a_request_open_at_the_horizon_as_not_valid():
  """Both requests meet their 300 ms TTFT; "late" emits its last token at
  1.3 s, after the 1.0 s horizon: the partition says 1 valid and 1 open at
  the horizon, and the goodput 1 valid (the open one missed), not 2."""
  records = [_rec("early", 0.2, 300.0), _rec("late", 0.2, 300.0)]
  records[1] = RequestRecord(**{**records[1].__dict__, "token_times_s": [0.2, 1.3]})
  out = ledger.build_ledger(records, duration_s=2.0, horizon_s=1.0)
  total = out["outcomes"]["total"]
  assert (total["valid"], total["open_at_horizon"]) == (1, 1)
  assert (out["goodput"]["valid"], out["goodput"]["missed"]) == (1, 1)
  assert out["goodput"]["slo"]["horizon_s"] == 1.0
