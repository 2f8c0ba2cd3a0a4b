"""Kernels chosen by measurement (``serving.engine.autotune``), on a fake
timer: which implementation wins, what is kept, what is never replaced."""

import dataclasses
import json

import pytest

from serving.engine import autotune
from serving.engine.config import EngineConfig
from tests.serving.engine_testing import CFG

TINY = EngineConfig.preset("tiny", min_bucket=8)        # buckets 8 and 16


class FakeClock:
  """A timer that moves only when a timed call runs: by its stated cost."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now

  def candidates(self, costs):
    """name -> make(bucket) whose call costs ``costs[name][bucket]`` seconds."""
    def make(name):
      def at(bucket):
        def call():
          self.now += costs[name][bucket]
          return 0
        return call
      return at
    return {name: make(name) for name in costs}


COSTS = {"native": {8: 0.004, 16: 0.030}, "blocked_dot": {8: 0.006, 16: 0.020},
         "blocked": {8: 0.050, 16: 0.050}}


def test_measure_times_every_cell_and_pick_takes_the_least_total():
  clock = FakeClock()
  table = autotune.measure(clock.candidates(COSTS), [8, 16], budget_s=10.0, timer=clock)
  assert table == {n: {b: pytest.approx(c * 1e3) for b, c in row.items()}
                   for n, row in COSTS.items()}
  # native is faster at 8 rows, blocked_dot at 16: one implementation for
  # every bucket, the least total (26 ms against 34 ms).
  assert autotune.pick(table) == "blocked_dot"


def test_a_spent_budget_leaves_cells_empty_and_pick_uses_common_buckets():
  clock = FakeClock()
  # Each cell costs 1 + REPS calls; 0.05 s lets the first bucket finish only.
  table = autotune.measure(clock.candidates(COSTS), [8, 16], budget_s=0.05, timer=clock)
  assert all(table[n][8] is not None for n in COSTS)
  assert {table[n][16] for n in COSTS} == {None}
  assert autotune.pick(table) == "native"
  with pytest.raises(ValueError, match="budget"):
    autotune.pick({"a": {8: None}, "b": {8: 1.0}})


def _choose(tmp_path, config=TINY, load=0.2, costs=COSTS, clock=None):
  clock = clock or FakeClock()
  lines = []
  out, choices = autotune.choose(
      CFG, config, str(tmp_path), 10.0, timer=clock, load=lambda: load, say=lines.append,
      candidates={"attention_impl": clock.candidates(costs),
                  "decode_gemm": clock.candidates({"native": {1: 1e-3, 8: 2e-3, 32: 9e-3},
                                                   "xla": {1: 3e-3, 8: 3e-3, 32: 4e-3}})})
  return out, {c.field: c for c in choices}, lines


def test_choose_measures_once_keeps_the_table_and_reads_it_next_time(tmp_path):
  config, choices, lines = _choose(tmp_path)
  assert (config.attention_impl, config.decode_gemm) == ("blocked_dot", "xla")
  assert choices["attention_impl"].how == "measured"
  kept = json.loads(open(choices["attention_impl"].path).read())
  assert kept["choice"] == "blocked_dot" and kept["machine"] == autotune.fingerprint()
  assert kept["shape"]["buckets"] == [8, 16] and kept["shape"]["head_dim"] == CFG.head_dim
  assert len(lines) == 2 and lines[0].startswith("autotune: attention_impl=blocked_dot (measured")
  # Next start: the kept table decides; nothing is timed (other costs would flip it).
  flipped = {n: {b: 1.0 - c for b, c in row.items()} for n, row in COSTS.items()}
  again, choices, _ = _choose(tmp_path, costs=flipped)
  assert again.attention_impl == "blocked_dot" and choices["attention_impl"].how == "cached"


def test_an_explicit_flag_is_kept_and_a_loaded_machine_times_nothing(tmp_path):
  config, choices, lines = _choose(tmp_path, dataclasses.replace(TINY, attention_impl="blocked"))
  assert config.attention_impl == "blocked" and choices["attention_impl"].how == "flag"
  assert not any("attention_impl" in line for line in lines)
  clock = FakeClock()
  config, choices, lines = _choose(tmp_path / "busy", load=3.0, clock=clock)
  assert config.attention_impl == "auto" and clock.now == 0.0
  assert "load 3.00 > 1.5" in choices["attention_impl"].how
  assert choices["attention_impl"].how.startswith("the rule's ")
  assert not (tmp_path / "busy" / "autotune").exists()


def test_the_candidates_that_run_here_are_timed_on_the_models_shapes(tmp_path):
  """No fake: the tiny model's attention candidates each run one cell."""
  cands = autotune.attention_candidates(CFG, TINY)
  assert {"blocked_dot", "blocked"} <= set(cands)
  table = autotune.measure({n: cands[n] for n in ("blocked_dot",)}, [8], budget_s=60.0)
  assert table["blocked_dot"][8] > 0
