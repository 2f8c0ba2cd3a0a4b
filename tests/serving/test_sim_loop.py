"""Many simulated iterations per program call (``Engine.simulate``,
``serving.engine.sim_loop``) against one ``Engine.step`` per iteration."""

import dataclasses
import functools
import os

import jax.numpy as jnp
import numpy as np
import pytest

from scheduler import validate
from serving.engine import cost_model as cost_lib
from serving.engine import clocks
from serving.engine import sim_driver
from serving.engine import sim_loop
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.engine.requests import QueueFull
from serving.harness import synthetic
from serving.kv import pages as kv_pages
from serving.harness import ledger
from serving.harness import replay as replay_lib
from serving.harness import workloads
from serving.harness.replay import replay, run_outcomes
from tests.serving.engine_testing import CFG, prompts

# Token times of the two paths agree to this (ms): both run the host's
# float64 clock arithmetic, the loop on the device, where XLA may round a
# step time's last bit otherwise (seen: <= 5e-13 ms on these replays of
# about a second).
TIME_TOL_MS = 1e-9


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("cost") / "cost.json"
  cost_lib.CostModel.of(step=5.0, rows=0.5, gemm_gflop=3000.0, attention_gflop=2000.0,
                        kv_read_gb=400.0).save(path)
  return str(path)


def _engine(cost_file, policy="sarathi_serve", **overrides):
  """A simulated tiny engine, prefix caching off, token buckets 4, 8, 16."""
  config = EngineConfig.preset("tiny", executor="simulated", cost_model=cost_file,
                               enable_prefix_caching=False, min_bucket=4, policy=policy,
                               **overrides)
  return Engine(CFG, None, config)


def _workload(n=16, rate_scale=2.0, seed=0, clients=1, slo=False, max_output_len=12):
  wl = synthetic.synthetic_azure_conv(
      n, rate_scale=rate_scale, seed=seed, max_prompt_len=30, max_output_len=max_output_len,
      vocab_size=CFG.vocab_size, reserved_token_ids=frozenset({0, 1}))
  wl = dataclasses.replace(wl, requests=tuple(
      dataclasses.replace(s, client=f"c{i % clients}") for i, s in enumerate(wl.requests)))
  return workloads.with_slos(wl, ttft_ms=150.0, tpot_ms=40.0) if slo else wl


def _same(step, loop):
  """The records of the two paths agree: outcomes and tokens exactly,
  times within ``TIME_TOL_MS``."""
  assert [r.request_id for r in step] == [r.request_id for r in loop]
  for a, b in zip(step, loop):
    assert (a.outcome, a.finish_reason, a.output_token_ids, a.num_preemptions,
            a.recompute_tokens, a.num_extensions) == (
                b.outcome, b.finish_reason, b.output_token_ids, b.num_preemptions,
                b.recompute_tokens, b.num_extensions), a.request_id
    assert a.arrival_s == b.arrival_s
    np.testing.assert_allclose(b.token_times_s, a.token_times_s, rtol=0,
                               atol=TIME_TOL_MS / 1000.0)


def _counters(engine):
  out = run_outcomes(engine)
  out.pop("compiled_programs")
  return out, engine.policy_evaluations


# A short KV cache (19 usable pages of 4 rows) under a steady load and a
# burst: preemptions (the host settles them and their re-admissions) and a
# slot table that grows past its 8 slots (programs of two sizes).
WORKLOADS = {"steady": dict(n=12, seed=1, rate_scale=3.0, clients=3, slo=True),
             "burst": dict(n=12, seed=4, rate_scale=40.0, clients=3, slo=True,
                           max_output_len=30)}


# sarathi_serve on the burst in the default run; the steady workload, and
# vllm_v1, vtc and least_slack (the fairness and SLO orders), in the
# extended profile (suite time).
@pytest.mark.parametrize("name", ["burst", pytest.param("steady", marks=pytest.mark.extended)])
@pytest.mark.parametrize("policy", ["sarathi_serve",
                                    pytest.param("vllm_v1", marks=pytest.mark.extended),
                                    pytest.param("vtc", marks=pytest.mark.extended),
                                    pytest.param("least_slack", marks=pytest.mark.extended)])
def test_the_loop_runs_the_step_paths_iterations(cost_file, policy, name):
  wl = _workload(**WORKLOADS[name])
  step_engine = _engine(cost_file, policy, num_pages=20)
  step, step_s = replay(step_engine, wl, loop=False)
  loop_engine = _engine(cost_file, policy, num_pages=20)
  resize, sizes = loop_engine._resize, []
  loop_engine._resize = lambda size: (sizes.append(size), resize(size))
  loop, loop_s = replay(loop_engine, wl)
  assert "loop" not in step_engine.compiled_programs()
  assert loop_engine.compiled_programs()["loop"] >= 1
  _same(step, loop)
  assert loop_s == pytest.approx(step_s, abs=TIME_TOL_MS / 1000.0)
  assert _counters(loop_engine) == _counters(step_engine)
  assert sum(r.outcome == "completed" for r in loop) >= len(wl) - 1
  if name == "burst":
    assert loop_engine.num_preemptions > 0 and max(sizes) > 8, sizes


def test_the_queue_bound_refuses_the_same_arrivals_on_both_paths(cost_file):
  """A burst past ``max_queued_requests``: the loop adds requests ahead of
  their arrival only while the bound cannot refuse them, so it refuses
  exactly the arrivals the step path refuses, at the same times."""
  wl = _workload(n=24, seed=4, rate_scale=3.0, max_output_len=30)
  runs = []
  for loop in (False, True):
    engine = _engine(cost_file, max_queued_requests=8)
    runs.append((replay(engine, wl, loop=loop), engine))
  (step, step_s), step_engine = runs[0]
  (loop, loop_s), loop_engine = runs[1]
  refused = [r.request_id for r in step if "max_queued_requests" in (r.finish_reason or "")]
  # Refusals interleave with later admissions (the queue drains between).
  first = [r.request_id for r in step].index(refused[0])
  assert refused and any(r.outcome == "completed" for r in step[first:])
  assert refused == [r.request_id for r in loop
                     if "max_queued_requests" in (r.finish_reason or "")]
  assert loop_engine.compiled_programs()["loop"] >= 1
  _same(step, loop)
  assert loop_s == pytest.approx(step_s, abs=TIME_TOL_MS / 1000.0)


@pytest.mark.extended   # ~18 s; the loop-vs-step test runs the same iterations over many calls
def test_short_calls_and_a_moving_epoch_run_the_same_iterations(cost_file, monkeypatch):
  """Calls of 5 iterations (the log fills: ``FULL``) and a device epoch
  that moves every 300 ms (``REBASE``: the host steps) change nothing."""
  monkeypatch.setattr(clocks, "DEVICE_REBASE_MS", 300.0)
  wl = _workload(n=12, seed=6, rate_scale=3.0)
  step_engine = _engine(cost_file)
  step, _ = replay(step_engine, wl, loop=False)
  assert step_engine.clocks.device_epoch_ms > 0
  engine = _engine(cost_file)
  specs = sorted(wl.requests, key=lambda s: s.arrival_s)
  for s in specs:
    engine.realized_output_tokens[s.request_id] = s.max_tokens
    engine.add_future_request(s.request_id, s.prompt_token_ids,
                              SamplingParams(max_tokens=s.max_tokens, ignore_eos=True),
                              arrival_ms=s.arrival_s * 1000.0, client=s.client)
  engine.simulate(iterations_per_call=5)
  assert not engine.has_unfinished()
  for s, a in zip(specs, step):
    req = engine.requests[s.request_id]
    assert tuple(req.output_token_ids) == tuple(a.output_token_ids)
    np.testing.assert_allclose(np.array(req.token_times_ms) / 1000.0, a.token_times_s, rtol=0,
                               atol=TIME_TOL_MS / 1000.0)
  assert _counters(engine) == _counters(step_engine)


def test_two_loop_replays_are_byte_identical(cost_file):
  # sarathi_serve: this module's default programs (suite time)
  wl = _workload(**WORKLOADS["burst"])
  runs = []
  for _ in range(2):
    engine = _engine(cost_file, "sarathi_serve", num_pages=20)
    records, duration_s = replay(engine, wl)
    runs.append(repr(([dataclasses.asdict(r) for r in records], duration_s,
                      _counters(engine))))
  assert runs[0] == runs[1]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_released_programs_give_back_their_memory_maps_and_the_same_replay(cost_file):
  # A sweep process that kept every (policy, slot-table size) program died
  # at the kernel's memory-map limit; release_programs lets them go and the
  # next engine builds them again to the same records.
  def maps():
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)

  wl = _workload(n=4)          # one slot-table size: the claim is the maps and the replay
  runs = []
  for _ in range(2):
    engine = _engine(cost_file, "sarathi_serve", num_pages=20)   # the module's programs
    records, duration_s = replay(engine, wl)
    runs.append(repr(([dataclasses.asdict(r) for r in records], duration_s)))
    del engine
    held = maps()
    sim_loop.release_programs()
    assert maps() < held - 100
    assert sim_loop.maps_crowded(0.0) and not sim_loop.maps_crowded(1.0)
  assert runs[0] == runs[1]


def test_the_loop_refuses_what_it_does_not_cover(cost_file, params):
  caching = Engine(CFG, None, EngineConfig.preset("tiny", executor="simulated",
                                                   cost_model=cost_file))
  swap = _engine(cost_file, preemption_mode="swap")
  model = Engine(CFG, params, EngineConfig.preset("tiny", enable_prefix_caching=False))
  plans = _engine(cost_file)
  plans.record_plans = True
  for engine, setting in ((caching, "enable_prefix_caching"), (swap, "preemption_mode"),
                          (model, "executor"), (plans, "record_plans")):
    assert setting in engine.loop_refusal()
    with pytest.raises(ValueError, match=setting):
      engine.simulate()
    with pytest.raises(ValueError, match=setting):
      engine.add_future_request("r", prompts([4])[0], arrival_ms=1.0)
  simulated = EngineConfig.preset("tiny", executor="simulated", enable_prefix_caching=False)
  assert "VirtualClock" in sim_loop.refusal(simulated, virtual=False, record_plans=False)
  assert sim_loop.refusal(simulated, virtual=True, record_plans=False) is None
  # replay falls back to one step per iteration, as before.
  records, _ = replay(caching, _workload(n=4))
  assert all(r.outcome == "completed" for r in records)
  assert "loop" not in caching.compiled_programs()


def test_future_requests_keep_their_order_and_the_queue_bound(cost_file):
  engine = _engine(cost_file, max_request_slots=4, max_queued_requests=4)
  p, sampling = prompts([4, 4, 4, 4, 4]), SamplingParams(max_tokens=4)
  engine.add_future_request("a", p[0], sampling, arrival_ms=10.0)
  with pytest.raises(ValueError, match="arrival order"):
    engine.add_future_request("b", p[1], sampling, arrival_ms=5.0)
  for i in range(3):
    engine.add_future_request(f"c{i}", p[2 + i], sampling, arrival_ms=20.0)
  with pytest.raises(QueueFull):
    engine.add_future_request("d", p[0], sampling, arrival_ms=30.0)
  engine.simulate(stop_ms=15.0)
  assert engine.now_ms() >= 15.0 and engine.requests["a"].output_token_ids
  assert not engine.requests["c0"].output_token_ids
  engine.run()      # the requests still to arrive run through simulate
  assert [engine.requests[r].outcome for r in ("a", "c0", "c1", "c2")] == ["completed"] * 4


def test_requests_that_arrived_inside_a_short_simulate_call_count_against_the_bound(
    cost_file):
  """``simulate(max_iterations=...)`` may return with future requests whose
  arrival has passed still waiting to be taken (the call stopped at the
  first arrival no free slot could take). They are accepted and unfinished,
  so ``add_request`` counts them: with 4 live and 4 arrived, an engine
  bounded at 8 refuses a ninth request, and the slot table never asks for
  more than 8 slots."""
  engine = _engine(cost_file, max_request_slots=4, max_queued_requests=8)
  p, sampling = prompts([4] * 9), SamplingParams(max_tokens=8, ignore_eos=True)
  for i in range(4):
    engine.add_request(f"live{i}", p[i], sampling)
  for i in range(4):
    engine.add_future_request(f"due{i}", p[4 + i], sampling, arrival_ms=1.0)
  engine.simulate(max_iterations=1)
  assert engine.now_ms() >= 1.0
  assert len(engine.table.future) == 4        # arrived, not yet taken
  with pytest.raises(QueueFull, match="max_queued_requests=8"):
    engine.add_request("over", p[8], sampling)
  engine.run(max_iterations=200)
  assert engine.num_slots == 8 and "over" not in engine.requests
  assert [r.outcome for r in engine.requests.values()] == ["completed"] * 8


def test_the_slot_table_refuses_to_grow_past_the_bound(cost_file):
  """A slot table asked for more than ``max_queued_requests`` slots (the
  bound every accepted request counts against) is a broken count: an
  error naming the bound, not a doubling loop that never ends."""
  engine = _engine(cost_file, max_request_slots=4, max_queued_requests=8)
  with pytest.raises(RuntimeError, match=r"9 slots.*max_queued_requests=8"):
    engine.table.resized(9)
  assert engine.num_slots == 4
  engine._resize(engine.table.resized(8))
  assert engine.num_slots == 8


def test_the_slot_table_sizes_grow_and_shrink_with_a_margin(cost_file):
  """Sizes 4, 8, 16, 32 (and a capped last one); a table grows to the
  first size holding its requests and shrinks while the smaller size would
  be at most three-quarters full."""
  table = _engine(cost_file, max_request_slots=4, max_queued_requests=32).table
  assert table.sizes() == [4, 8, 16, 32]
  assert [table.resized(n) for n in (0, 3, 4, 5, 9, 17, 32)] == [4, 4, 4, 8, 16, 32, 32]
  table.slots = [None] * 32
  # 12 fit three-quarters of 16, not of 8; 13 do not fit three-quarters of 16.
  assert [table.resized(n) for n in (32, 13, 12, 6, 3, 0)] == [32, 32, 16, 8, 4, 4]
  table.slots = [None] * 16
  assert [table.resized(n) for n in (17, 16, 7, 6)] == [32, 16, 16, 8]
  capped = _engine(cost_file, max_request_slots=4, max_queued_requests=12).table
  assert capped.sizes() == [4, 8, 12]
  capped.slots = [None] * 12
  assert [capped.resized(n) for n in (12, 9, 7, 6, 3)] == [12, 12, 12, 8, 4]


# sarathi_serve on the loop path in the default run; the step path and the
# policies with state of their own in the extended profile (suite time:
# each table size compiles its programs).
@pytest.mark.parametrize("policy,loop", [
    ("sarathi_serve", True), pytest.param("sarathi_serve", False, marks=pytest.mark.extended),
    pytest.param("fastserve", True, marks=pytest.mark.extended),
    pytest.param("vtc", True, marks=pytest.mark.extended)])
def test_a_shrinking_slot_table_changes_no_request(cost_file, policy, loop):
  """A burst grows the table from 4 to 8 slots; as it drains the table
  shrinks (its live requests move to the first slots) and the records equal
  those of an engine whose table never shrinks: tokens, outcomes and times,
  the policy's own state (fastserve's per-slot levels, vtc's per-client
  counters) moving with its requests. Loop calls of 4 iterations, so that
  the table can shrink between them."""
  wl = _workload(n=8, seed=4, rate_scale=40.0, clients=3, max_output_len=30)
  runs, sizes = {}, {}
  for shrink in (True, False):
    engine = _engine(cost_file, policy, num_pages=200, max_request_slots=4,
                     max_queued_requests=8)
    table, resize, sizes[shrink] = engine.table, engine._resize, []
    if not shrink:
      table.resized = lambda n: max(len(table.slots), min(s for s in table.sizes() if s >= n))
    engine._resize = lambda size, r=resize, seen=sizes[shrink]: (seen.append(size), r(size))
    engine.simulate = functools.partial(engine.simulate, iterations_per_call=4)
    runs[shrink] = replay(engine, wl, loop=loop)[0]
  assert sizes[False] == [8]
  assert sizes[True][0] == 8 and 4 in sizes[True][1:], sizes[True]
  _same(runs[False], runs[True])


def test_a_progress_callback_keeps_the_loop_and_its_records(cost_file, monkeypatch):
  """``replay``'s ``on_progress`` (a progress bar, the ledger's resource
  sampler) does not take the loop away: ``path`` says "loop", the loop
  program runs, the callback runs after every bounded loop call, and the
  records equal the step path's; ``on_step`` still asks for the step path."""
  monkeypatch.setattr(replay_lib, "PROGRESS_ITERATIONS", 8)
  wl = _workload(**WORKLOADS["steady"])
  step, _ = replay(_engine(cost_file, num_pages=20), wl, loop=False)
  engine = _engine(cost_file, num_pages=20)
  assert replay_lib.path(engine) == ("loop", "")
  assert replay_lib.path(engine, on_step=print)[0] == "step"
  sampler = ledger.ResourceSampler(engine, every=4)
  seen = []

  def progress(e):
    seen.append((e.num_iterations, e.table.num_ended))
    sampler(e)

  loop, _ = replay(engine, wl, on_progress=progress)
  assert engine.compiled_programs()["loop"] >= 1
  _same(step, loop)
  assert len(seen) >= engine.num_iterations // (8 + sim_loop.LOOP_ITERATIONS)
  assert seen[-1] == (engine.num_iterations, len(wl))
  assert [n for n, _ in seen] == sorted(n for n, _ in seen)
  assert len(sampler.samples) >= 2


@pytest.mark.parametrize("progress_iterations", [8, None])
def test_the_resource_samples_are_the_step_paths(cost_file, monkeypatch, progress_iterations):
  """``ledger.ResourceSampler`` on the loop path samples the iterations the
  step path samples, with the same values (the loop logs each iteration's
  occupancy; host steps inside ``simulate`` are sampled there), for two
  samplers of different ``every`` on one engine: KV pages under
  preemption, a slot table that grows, a queue bound; a replay shorter than
  ``PROGRESS_ITERATIONS`` (None: the default) included, whose peaks the
  loop once read as 0."""
  if progress_iterations is not None:
    monkeypatch.setattr(replay_lib, "PROGRESS_ITERATIONS", progress_iterations)
  cases = [(WORKLOADS["burst"], dict(num_pages=20), True),
           (dict(n=24, seed=4, rate_scale=3.0, max_output_len=30),
            dict(max_queued_requests=8, max_request_slots=4), False)]
  for args, overrides, preempts in cases:
    wl = _workload(**args)
    runs = []
    for loop in (False, True):
      engine = _engine(cost_file, **overrides)
      samplers = [ledger.ResourceSampler(engine, every) for every in (1, 3)]
      replay(engine, wl, loop=loop, on_progress=lambda e: [s(e) for s in samplers])
      runs.append((engine, [np.array(s.samples) for s in samplers]))
    (step_engine, step_samples), (loop_engine, loop_samples) = runs
    assert loop_engine.loop_runs.loop_iterations > 0
    assert (loop_engine.loop_runs.host_iterations > 0) == preempts
    for every, step, loop in zip((1, 3), step_samples, loop_samples):
      assert len(step) == step_engine.num_iterations // every > 10
      np.testing.assert_array_equal(loop[:, 1:], step[:, 1:])
      np.testing.assert_allclose(loop[:, 0], step[:, 0], rtol=0, atol=1e-3)
      live, queue = step[:, 1], step[:, 3]
      assert live.max() > 0 and queue.max() > 0


def test_without_prefix_caching_the_allocator_view_skips_the_refcounts(cost_file):
  """``kv_pages.view(caching=False)``, which the plan program takes when
  prefix caching is off, equals the general view after every step of a
  burst that preempts (pages freed and taken again): no page is cached or
  shared, so the free stack is every free page and a slot's held pages are
  all reclaimable."""
  engine = _engine(cost_file, num_pages=20)
  seen = []

  def check(outputs):
    general = kv_pages.view(engine.pages)
    fast = kv_pages.view(engine.pages, caching=False)
    for name in ("free_pages", "pages_held", "reclaimable_pages"):
      np.testing.assert_array_equal(np.asarray(getattr(fast, name)),
                                    np.asarray(getattr(general, name)), err_msg=name)
    seen.append(int(general.free_pages))

  replay(engine, _workload(**WORKLOADS["burst"]), loop=False, on_step=check)
  assert engine.num_preemptions > 0 and min(seen) < 4 < max(seen)


@pytest.mark.extended     # test_cluster_sim's overloaded case runs until_end by default
def test_until_end_returns_after_each_ending_with_the_step_paths_marks(cost_file):
  """``simulate(until_end=True, marks=...)`` returns after exactly the
  iterations whose step outputs end a request (one loop program for both
  flag values), and its marks are those the step path's outputs bring
  (``sim_driver.step_marks``), at the same times. Forced preemptions make
  some iterations host steps (an ending there returns too)."""
  lengths = [5, 9, 3, 12, 7, 4, 10, 6]
  p = prompts(lengths, seed=3)
  max_tokens = [6, 2, 9, 4, 3, 11, 5, 7]

  def engine_with_requests():
    engine = _engine(cost_file, force_preempt_every=5)
    for i, (q, m) in enumerate(zip(p, max_tokens)):
      engine.realized_output_tokens[f"r{i}"] = m
      engine.add_request(f"r{i}", q, SamplingParams(max_tokens=m, ignore_eos=True))
    return engine

  step_engine, step_marks, ends = engine_with_requests(), [], []
  while step_engine.has_unfinished():
    outputs = step_engine.step()
    sim_driver.step_marks(step_engine, outputs, step_marks)
    if any(out.finished for out in outputs):
      ends.append((step_engine.num_iterations, step_engine.now_ms()))
  assert step_engine.num_preemptions > 0 and len(ends) >= 4

  engine, marks, returns = engine_with_requests(), [], []
  engine.simulate(stop_ms=1.0, marks=marks)       # until_end=False: the first iteration
  while engine.has_unfinished():
    engine.simulate(marks=marks, until_end=True)
    returns.append((engine.num_iterations, engine.now_ms()))
  assert [n for n, _ in returns] == [n for n, _ in ends]
  np.testing.assert_allclose([t for _, t in returns], [t for _, t in ends], rtol=0,
                             atol=TIME_TOL_MS)
  key = lambda m: (m[1], m[2])
  loop_marks, step_marks = sorted(marks, key=key), sorted(step_marks, key=key)
  assert [key(m) for m in loop_marks] == [key(m) for m in step_marks]
  np.testing.assert_allclose([m[0] for m in loop_marks], [m[0] for m in step_marks], rtol=0,
                             atol=TIME_TOL_MS)
  assert {m[2] for m in marks} == {"first_token", "finished"}
  assert sum(m[2] == "finished" for m in marks) == len(lengths)
  assert engine.compiled_programs()["loop"] == 1
  assert _counters(engine) == _counters(step_engine)


@pytest.fixture
def stale_results(monkeypatch):
  """The simulated executor, its results bound to a stale decision once a
  request has emitted 3 tokens (``validate.StaleResult``); the programs
  built with it are dropped afterwards."""
  from serving.engine import programs as programs_lib
  real = programs_lib._simulated_execute

  def stale(*args, **kwargs):
    kv, pages, buffers, result, logprobs = real(*args, **kwargs)
    late = jnp.any(args[5].emitted >= 3)
    return kv, pages, buffers, result.replace(
        decision_id=result.decision_id + late.astype(jnp.int32)), logprobs

  def clear():
    programs_lib.programs.cache_clear()
    programs_lib._executor.cache_clear()
    sim_loop.loop_program.cache_clear()

  clear()
  monkeypatch.setattr(programs_lib, "_simulated_execute", stale)
  yield
  monkeypatch.undo()
  clear()


def test_a_broken_result_raises_at_the_step_paths_iteration(cost_file, stale_results):
  """The loop decides its host exits before the step writes its tables; a
  result that breaks a rule ends the call, and ``simulate`` raises the
  rule's error at the iteration, with the state, ``Engine.step`` raises it."""
  wl = _workload(n=6, seed=1, rate_scale=3.0)
  raised = []
  for loop in (False, True):
    engine = _engine(cost_file)
    with pytest.raises(validate.StaleResult) as error:
      replay(engine, wl, loop=loop)
    raised.append((str(error.value), engine.num_iterations, engine.policy_evaluations,
                   np.asarray(engine.state.emitted).tolist(),
                   np.asarray(engine.state.decision_id).tolist(),
                   np.asarray(engine.pages.page_table).tolist(),
                   np.asarray(engine.pages.free_stack).tolist(), int(engine.pages.num_free),
                   engine.now_ms(), dict(engine.buckets_used), engine.clocks.stamp,
                   [None if r is None else r.request_id for r in engine.table.slots]))
    if loop:
      assert engine.loop_runs.exits["RESULT"] == 1
      assert engine.loop_runs.loop_iterations == engine.num_iterations > 0
  assert raised[0] == raised[1]
  assert max(raised[0][3]) == 3       # raised when a request had emitted its third token


def _step_to(engine, num_iterations):
  """The step path (``Engine.step``), fed as ``sim_driver.simulate`` feeds
  its host steps, until ``num_iterations`` ran or nothing is left."""
  table = engine.table
  while engine.num_iterations < num_iterations and engine.has_unfinished():
    table.take_arrived(engine.now_ms())
    if not table.pending and not table.num_live():
      sim_driver._advance_to(engine, table.future[0].arrival_ms)
      continue
    engine.step()


def _device_arrivals(engine):
  """The device epoch and each live request's float32 device arrival time."""
  device = np.asarray(engine.manifest.arrival_ms)
  return engine.clocks.device_epoch_ms, {
      r.request_id: float(device[s]) for s, r in enumerate(engine.table.slots) if r is not None}


def test_arrivals_at_a_moving_epoch_get_the_same_device_times_on_both_paths(cost_file,
                                                                             monkeypatch):
  """With the epoch moving every 20 ms many arrivals come due in an
  iteration that moves it: both paths move it first and write them at the
  new epoch (the loop returns ``REBASE`` before admitting them), so every
  live request's float32 device arrival time is the same, bit for bit,
  after every loop call."""
  monkeypatch.setattr(clocks, "DEVICE_REBASE_MS", 20.0)
  specs = sorted(_workload(n=10, seed=8, rate_scale=3.0).requests, key=lambda s: s.arrival_s)
  engines = [_engine(cost_file), _engine(cost_file)]
  for engine in engines:
    for s in specs:
      engine.realized_output_tokens[s.request_id] = s.max_tokens
      engine.add_future_request(s.request_id, s.prompt_token_ids,
                                SamplingParams(max_tokens=s.max_tokens, ignore_eos=True),
                                arrival_ms=s.arrival_s * 1000.0 + 0.1234567)
  step_engine, loop_engine = engines
  seen = 0
  while loop_engine.has_unfinished():
    loop_engine.simulate(iterations_per_call=8, max_iterations=1)   # one loop call
    _step_to(step_engine, loop_engine.num_iterations)
    assert step_engine.num_iterations == loop_engine.num_iterations
    assert _device_arrivals(loop_engine) == _device_arrivals(step_engine), (
        loop_engine.num_iterations)
    seen += len(_device_arrivals(loop_engine)[1])
  assert not step_engine.has_unfinished() and seen > 0
  assert loop_engine.loop_runs.exits["REBASE"] >= 5
