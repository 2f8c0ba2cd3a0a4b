"""The decode roofline of bench_engine.py, worked by hand."""

import pytest

from models.config import get_config
from serving.engine import cost_model as cost_lib
from serving.harness import roofline


def test_the_floor_is_the_bytes_a_step_reads_over_the_bandwidth():
  costs = cost_lib.model_costs(get_config("tiny"))
  w, kv = costs.weight_bytes_per_step, costs.kv_bytes_per_token
  row = roofline.decode_roofline(costs, concurrency=4, context=100.0,
                                 decode_tokens_per_s=400.0, read_bps=1e10)
  assert row["kv_bytes_per_step"] == 4 * 100 * kv
  assert row["floor_ms_weights"] == pytest.approx(w / 1e10 * 1e3)
  assert row["floor_ms"] == pytest.approx((w + 400 * kv) / 1e10 * 1e3)
  assert row["step_ms"] == pytest.approx(10.0)          # 4 tokens per step at 400 tokens/s
  assert row["fraction"] == pytest.approx(row["floor_ms"] / 10.0)
  none = roofline.decode_roofline(costs, 4, 100.0, None, 1e10)
  assert none["step_ms"] is none["fraction"] is None and none["floor_ms"] == row["floor_ms"]


def test_the_read_bandwidth_is_a_positive_rate():
  assert roofline.read_bytes_per_s(mib=8, reps=1) > 0
