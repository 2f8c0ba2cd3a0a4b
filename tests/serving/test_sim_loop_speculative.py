"""``Engine.simulate`` (the ``loop`` program) with speculative decoding on
the simulated executor, against one ``Engine.step`` per iteration: the same
tokens (several per verified row), outcomes, times, iteration counts and
draft counters (``Engine.spec_counts``)."""

import json
import subprocess
import sys

import pytest

from serving.engine import sim_driver
from serving.engine import sim_loop
from serving.engine.config import SamplingParams
from serving.harness.replay import replay
from tests.serving import test_sim_loop as base
from tests.serving.engine_testing import CFG

cost_file = base.cost_file      # the module's fixture

ADAPTIVE = "ngram:k=3,n=2,adaptive=1,fixed_ms=5,row_ms=0.5"


def _spec_engine(cost_file, policy, speculative, **overrides):
  return base._engine(cost_file, policy, num_pages=20, speculative=speculative,
                      spec_acceptance=0.7, **overrides)


def _counting_steps(engine):
  """Counts the engine's ``Engine.step`` calls (the host-run iterations)."""
  calls = []
  step = engine.step

  def counted(*args, **kwargs):
    calls.append(1)
    return step(*args, **kwargs)

  engine.step = counted
  return calls


# The default suite keeps the draft-model case below (the same log and
# counters: the simulated executor accepts drafts by its stated rate,
# whichever proposer is named); these run under -m extended.
@pytest.mark.extended
@pytest.mark.parametrize("policy,speculative", [
    ("sarathi_serve", "ngram:k=4,n=3"),
    ("vllm_v1", ADAPTIVE),
    ("sarathi_serve", ADAPTIVE + ",per_row=1"),
    ("vtc", "ngram:k=2,n=2")])
def test_the_loop_runs_the_step_paths_speculative_iterations(cost_file, policy, speculative):
  for name, args in base.WORKLOADS.items():
    wl = base._workload(**args)
    step_engine = _spec_engine(cost_file, policy, speculative)
    step, step_s = replay(step_engine, wl, loop=False)
    loop_engine = _spec_engine(cost_file, policy, speculative)
    assert loop_engine.loop_refusal() is None
    steps = _counting_steps(loop_engine)
    loop, loop_s = replay(loop_engine, wl)
    assert "loop" not in step_engine.compiled_programs(), name
    assert loop_engine.compiled_programs()["loop"] >= 1, name
    # Most iterations ran in the loop: the host stepped only those that
    # need it (preemptions, re-admissions), far fewer than all.
    assert len(steps) < loop_engine.num_iterations // 2, name
    base._same(step, loop)
    assert loop_s == pytest.approx(step_s, abs=base.TIME_TOL_MS / 1000.0), name
    assert base._counters(loop_engine) == base._counters(step_engine), name
    assert loop_engine.num_iterations == step_engine.num_iterations, name
    counts = loop_engine.spec_counts.stats()
    assert counts == step_engine.spec_counts.stats(), name
    # Speculation did something: rows verified drafts, some accepted, and
    # some rows emitted several tokens.
    assert counts["num_drafts"] > 0 and 0 < counts["num_accepted_tokens"] < counts[
        "num_draft_tokens"], name
    if name == "burst":
      assert loop_engine.num_preemptions > 0, name


@pytest.mark.extended     # the default run keeps the draft loop's equality below
def test_the_log_carries_a_verified_rows_tokens(cost_file, monkeypatch):
  """Without speculation the log has no ``spec`` part; with k drafts its
  rows are 1 + k tokens wide and its counters k positions long."""
  plain = base._engine(cost_file)
  spec = _spec_engine(cost_file, "sarathi_serve", "ngram:k=4,n=3")
  take, logs = sim_driver.take_log, []

  def keep(engine, log, *args, **kwargs):
    logs.append(log)
    return take(engine, log, *args, **kwargs)

  monkeypatch.setattr(sim_driver, "take_log", keep)
  for engine in (plain, spec):
    engine.add_request("r", [5, 6, 7, 5, 6, 7], SamplingParams(max_tokens=9, ignore_eos=True))
    engine.realized_output_tokens["r"] = 9
    engine.simulate()
    assert engine.requests["r"].output_token_ids and not engine.has_unfinished()
  assert len(logs) == 2
  assert logs[0].spec is None
  capacity = sim_loop.LOOP_ITERATIONS * spec.config.max_num_seqs
  assert logs[1].spec.tokens.shape == (capacity, 5)
  assert logs[1].spec.counts.shape == (3 + 4,)
  # One request of 9 outputs: fewer iterations with speculation, the same tokens.
  assert plain.requests["r"].output_token_ids == spec.requests["r"].output_token_ids
  assert spec.num_iterations < plain.num_iterations
  assert spec.spec_counts.num_drafts == spec.num_iterations - 1   # every decode row drafts


@pytest.mark.extended
def test_replay_script_takes_the_loop_with_speculation(tmp_path):
  """The launcher's simulated speculation runs in the loop (prefix caching,
  on by default, is the one setting to turn off)."""
  out = tmp_path / "report.json"
  subprocess.run(
      [sys.executable, "scripts/replay.py", "--executor=simulated", "--speculative=ngram:k=4",
       "--spec_acceptance=0.7", "--noenable_prefix_caching", "--num_requests=4",
       f"--out={out}"], check=True, capture_output=True, timeout=600)
  report = json.loads(out.read_text())
  assert report["config"]["replay_path"]["path"] == "loop"
  assert report["engine_outcomes"]["spec_decode"]["num_drafts"] > 0


def test_the_loop_runs_a_draft_models_iterations(cost_file, tmp_path):
  """A draft model's forwards are priced on the device by the host's
  definition (``cost_model.step_features``' three rows): loop and step give
  the same tokens, times and counters."""
  from tests.serving.test_sim_draft import write_draft    # pylint: disable=import-outside-toplevel
  draft = write_draft(tmp_path / "tiny-draft", CFG.vocab_size, weights=False)
  wl = base._workload(**base.WORKLOADS["burst"])
  step_engine = _spec_engine(cost_file, "sarathi_serve", f"draft:{draft},k=3")
  step, step_s = replay(step_engine, wl, loop=False)
  loop_engine = _spec_engine(cost_file, "sarathi_serve", f"draft:{draft},k=3")
  assert loop_engine.loop_refusal() is None
  steps = _counting_steps(loop_engine)
  loop, loop_s = replay(loop_engine, wl)
  assert loop_engine.compiled_programs()["loop"] >= 1
  assert len(steps) < loop_engine.num_iterations // 2
  base._same(step, loop)
  assert loop_s == pytest.approx(step_s, abs=base.TIME_TOL_MS / 1000.0)
  assert loop_engine.num_iterations == step_engine.num_iterations
  assert loop_engine.spec_counts.stats() == step_engine.spec_counts.stats()
