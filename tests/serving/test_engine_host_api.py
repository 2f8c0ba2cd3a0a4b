"""Engine host API for a long-running server: ending a request as completed
from the host (stop strings), evicting finished requests and idle clients,
and the float64 host / rebased float32 device clocks."""

import numpy as np
import pytest

from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import DEVICE_REBASE_MS, Engine
from serving.kv import pages as kv_pages
from tests.serving.engine_testing import CFG, prompts as _prompts

BASE = EngineConfig.preset("tiny")
LONG = SamplingParams(max_tokens=8, ignore_eos=True)


def _pages_free(engine):
  """No page is held: every page is free or cached and unreferenced."""
  free, evictable, in_use = (int(n) for n in kv_pages.page_census(engine.pages))
  return (free + evictable, in_use) == (engine.config.num_pages - 1, 0)


def test_finish_ends_a_request_completed_and_frees_its_pages(params):
  prompts = _prompts([6, 9], seed=40)
  alone = Engine(CFG, params, BASE).generate(prompts[1:], LONG)[0].output_token_ids
  engine = Engine(CFG, params, BASE)
  cut = engine.add_request("cut", prompts[0], LONG)
  other = engine.add_request("other", prompts[1], LONG)
  with pytest.raises(ValueError, match="at least one output token"):
    engine.finish("cut")
  while len(cut.output_token_ids) < 3:
    engine.step()
  kept = list(cut.output_token_ids)
  out = engine.finish("cut", "stop")
  assert (out.finished, out.outcome, out.finish_reason) == (True, "completed", "stop")
  assert cut.outcome == "completed" and cut.finish_reason == "stop"
  engine.run()
  assert cut.output_token_ids == kept                    # nothing after the stop
  assert other.output_token_ids == alone                 # the batch mate is unchanged
  assert _pages_free(engine)
  assert engine.finish("cut").outcome == "completed"     # idempotent once finished
  with pytest.raises(ValueError, match="unknown request_id"):
    engine.finish("nope")


def test_evicted_requests_and_idle_clients_leave_the_host_tables(params):
  engine = Engine(CFG, params, BASE)                    # num_clients = 4
  sampling = SamplingParams(max_tokens=2, ignore_eos=True)
  for i, client in enumerate("abxy"):
    engine.add_request(f"{client}0", _prompts([4], seed=i)[0], sampling, client=client)
  with pytest.raises(ValueError, match="num_clients"):
    engine.add_request("c0", _prompts([4], seed=3)[0], sampling, client="c")
  with pytest.raises(ValueError, match="is live"):
    engine.evict("a0")
  engine.run()
  index_a = engine.table.clients["a"]
  assert int(np.asarray(engine.state.service_rows)[index_a]) > 0
  # The client's ended requests are its output-length history (2 tokens).
  assert int(np.asarray(engine.state.client_completed_requests)[index_a]) == 1
  assert int(np.asarray(engine.state.client_completed_outputs)[index_a]) == 2
  assert engine.evict("a0").outcome == "completed"
  assert "a0" not in engine.requests and "a" not in engine.table.clients
  for counter in ("service_rows", "client_completed_requests", "client_completed_outputs"):
    assert int(np.asarray(getattr(engine.state, counter))[index_a]) == 0   # counters restart
  # Many clients over time, never more than num_clients at once, tables bounded.
  for rid in ("x0", "y0"):
    engine.evict(rid)
  for i in range(8):
    rid = f"c{i}"
    engine.add_request(rid, _prompts([3], seed=10 + i)[0], sampling, client=f"client-{i}")
    engine.run()
    assert engine.evict(rid).outcome == "completed"
    assert len(engine.requests) == 1 and len(engine.table.clients) == 1   # b0 / b remain


class _Clock:
  """Seconds: starts at ``start``, then ``jump_s`` later after construction,
  advancing 1 ms per reading."""

  def __init__(self, jump_s):
    self.t, self.jump_s, self.calls = 100.0, jump_s, 0

  def __call__(self):
    self.calls += 1
    if self.calls == 2:
      self.t += self.jump_s
    self.t += 0.001
    return self.t


def test_device_clock_rebases_and_keeps_ms_resolution_after_hours(params):
  prompts = _prompts([5, 11, 7], seed=50)
  runs = []
  for jump_s in (0.0, 10 * 3600.0):                     # fresh, and 10 hours later
    engine = Engine(CFG, params, BASE, clock=_Clock(jump_s))
    reqs = [engine.add_request(f"r{i}", p, LONG) for i, p in enumerate(prompts)]
    engine.run()
    runs.append((engine, reqs))
  (fresh, fresh_reqs), (late, late_reqs) = runs
  assert [r.output_token_ids for r in late_reqs] == [r.output_token_ids for r in fresh_reqs]
  assert late.clocks.device_epoch_ms > 10 * 3600e3 - DEVICE_REBASE_MS
  device_now = float(np.asarray(late.state.now_ms))
  assert device_now < 2 * DEVICE_REBASE_MS
  assert abs(device_now + late.clocks.device_epoch_ms - late.now_ms()) < 5.0
  for a, b in zip(fresh_reqs, late_reqs):      # 1 ms steps survive in host times
    np.testing.assert_allclose(np.diff(b.token_times_ms), np.diff(a.token_times_ms),
                               atol=1e-6)
    assert np.all(np.diff(b.token_times_ms) >= 1.0)


def test_arrivals_after_hours_idle_keep_sub_ms_device_times(params):
  """Two requests that arrive 0.4 ms apart after three idle hours: the step
  that takes them moves the device epoch first, so their float32 device
  arrival times are written at the new epoch (0 and 0.4 ms), not rounded
  at the old one (1 ms apart near 1.08e7 ms) and then shifted."""
  clock = _Clock(0.0)
  engine = Engine(CFG, params, BASE, clock=clock)
  engine.add_request("r0", _prompts([5], seed=51)[0], LONG)
  engine.run()
  assert engine.clocks.device_epoch_ms == 0.0
  clock.t += 3 * 3600.0
  now = engine.now_ms()
  late = [engine.add_request(f"late{i}", p, LONG, arrival_ms=now - 1.0 + 0.4 * i)
          for i, p in enumerate(_prompts([4, 6], seed=52))]
  engine.step()
  assert engine.clocks.device_epoch_ms == late[0].arrival_ms
  device = np.asarray(engine.manifest.arrival_ms)
  slots = [engine.table.slots.index(r) for r in late]
  assert device[slots[0]] == 0.0
  assert device[slots[1]] == pytest.approx(0.4, abs=1e-6)
