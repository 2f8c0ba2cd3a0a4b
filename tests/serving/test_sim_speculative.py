"""Speculative decoding in the simulator: the simulated executor accepts
drafts at the stated rate, deterministically from (seed, request id,
output index); a request's tokens and recorded length are those without
speculation; the cost model charges every verify row as a generated row
with its context; the device loop takes n-gram speculation
(test_sim_loop_speculative compares it with the step path)."""

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from serving.engine import sim_executor
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.harness import metrics
from serving.harness import synthetic
from serving.harness.replay import path, replay, run_config, run_outcomes
from tests.serving.engine_testing import CFG, save_test_cost_model, step_ms


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
  return save_test_cost_model(tmp_path_factory.mktemp("cost") / "cost.json")


def _config(cost_file, speculative="ngram:k=3,n=2", alpha=0.6, **overrides):
  return EngineConfig.preset("tiny", executor="simulated", cost_model=cost_file,
                             speculative=speculative,
                             spec_acceptance=alpha if speculative else 0.0, **overrides)


def test_draws_accept_at_the_stated_rate_within_a_binomial_bound():
  """20000 rows verifying 4 drafts at alpha 0.7: each draft position is a
  Bernoulli(0.7) trial where the ones before it succeeded, so the
  successes over the trials made are within 4 binomial sigmas of 0.7, and
  the mean accepted count within 4 sigmas of 0.7 + 0.49 + 0.343 + 0.2401."""
  alpha, k, n = 0.7, 4, 20000
  rid = jnp.arange(n, dtype=jnp.int32) % 500
  emitted = jnp.arange(n, dtype=jnp.int32) // 500 * 7
  accepted = np.asarray(sim_executor.accepted_drafts(
      3, alpha, rid, emitted, jnp.full((n,), k, jnp.int32), k))
  trials = accepted.sum() + np.sum(accepted < k)          # the draws that were read
  sigma = math.sqrt(alpha * (1 - alpha) / trials)
  assert abs(accepted.sum() / trials - alpha) < 4 * sigma
  mean = sum(alpha ** j for j in range(1, k + 1))
  assert abs(accepted.mean() - mean) < 4 * accepted.std() / math.sqrt(n)
  # Fewer drafts verified: the leading draws are the same ones.
  two = np.asarray(sim_executor.accepted_drafts(3, alpha, rid, emitted,
                                                jnp.full((n,), 2, jnp.int32), k))
  np.testing.assert_array_equal(two, np.minimum(accepted, 2))
  # Another seed, other draws; alpha 1 accepts all.
  other = np.asarray(sim_executor.accepted_drafts(4, alpha, rid, emitted,
                                                  jnp.full((n,), k, jnp.int32), k))
  assert (other != accepted).mean() > 0.3
  every = sim_executor.accepted_drafts(3, 1.0, rid, emitted, jnp.full((n,), k, jnp.int32), k)
  assert bool(jnp.all(every == k))


def _run(config, realized=None, prompts=((5, 6, 7, 8), (9, 10, 11), (12, 13, 14, 15, 16)),
         max_tokens=24):
  engine = Engine(CFG, None, config)
  reqs = [engine.add_request(f"r{i}", list(p), SamplingParams(max_tokens=max_tokens,
                                                                ignore_eos=True))
          for i, p in enumerate(prompts)]
  engine.realized_output_tokens.update(realized or {})
  engine.run()
  return engine, reqs


def test_tokens_and_recorded_lengths_are_those_without_speculation(cost_file):
  """The simulated tokens do not depend on speculation; a recorded length
  ends its request at exactly that many tokens (EOS inside the verified
  rows), a declared cap by length; drafts save iterations."""
  realized = {"r0": 11, "r1": 24}        # r2: none recorded, its max_tokens
  plain, plain_reqs = _run(_config(cost_file, speculative=""), realized)
  spec, reqs = _run(_config(cost_file, alpha=0.8), realized)
  for a, b in zip(reqs, plain_reqs):
    assert a.output_token_ids == b.output_token_ids
    assert (a.outcome, a.finish_reason) == (b.outcome, b.finish_reason)
  assert [len(r.output_token_ids) for r in reqs] == [11, 24, 24]
  assert [r.finish_reason for r in reqs] == ["eos", "length", "length"]
  counts = spec.spec_counts
  assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
  assert spec.num_iterations < plain.num_iterations
  assert int(jnp.sum(spec.pages.pages_held)) == 0


def test_first_draft_acceptance_through_the_engine_is_binomial(cost_file):
  """Every verified row draws its first draft once, and no row is cut by an
  end (recorded lengths equal the caps, which leave every draft room, and
  prompt + cap stays inside the context): the first-position acceptances
  are Binomial(rows, alpha)."""
  alpha = 0.6
  prompts = [tuple(range(3 + i, 9 + i)) for i in range(8)]
  engine, reqs = _run(_config(cost_file, alpha=alpha), prompts=prompts, max_tokens=50)
  counts = engine.spec_counts
  rows = counts.num_drafts
  assert rows > 100
  assert all(len(r.output_token_ids) == 50 for r in reqs)
  sigma = math.sqrt(alpha * (1 - alpha) / rows)
  assert abs(counts.accepted_per_pos[0] / rows - alpha) < 4 * sigma
  # The learned facts: accepted / (accepted + rejections) estimates alpha
  # (rows are Bernoulli runs to the first failure); accepted / verified
  # drafts sits well below it.
  state = engine.state
  accepted = int(state.client_accepted_tokens[0])
  rejected = int(state.client_draft_rejections[0])
  assert accepted == counts.num_accepted_tokens
  trials = accepted + rejected
  assert abs(accepted / trials - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / trials)
  assert accepted / counts.num_draft_tokens < alpha - 0.1


def test_verify_rows_are_charged_as_generated_rows_with_their_context(cost_file):
  """One request, prompt 6, 8 outputs, 3 drafts, alpha 1 (all accepted),
  pages of 4. Step 1: its prompt [0, 6): 6 rows, 1+..+6 = 21 query-key
  pairs, 6 keys; emits 1. Step 2: the decode row at 6 and 3 drafts,
  [6, 10): 4 rows, 7+8+9+10 = 34 pairs, 10 keys; emits 4 (5 in all).
  Step 3: the cap leaves 8 - 5 - 1 = 2 drafts, [10, 13): 3 rows, 11+12+13
  = 36 pairs, 13 keys; emits 3 and ends."""
  engine = Engine(CFG, None, _config(cost_file, alpha=1.0))
  req = engine.add_request("r", [3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=8,
                                                                    ignore_eos=True))
  times = []
  while not req.finished:
    start = engine.now_ms()
    engine.step()
    stats = np.asarray(engine.last_step_stats[0])
    times.append((engine.now_ms() - start, stats[:4].tolist()))
  assert [t[1] for t in times] == [[6, 0, 1, 6], [0, 4, 4, 0], [0, 3, 3, 0]]
  want = [step_ms(6, 21, 6), step_ms(4, 34, 10), step_ms(3, 36, 13)]
  np.testing.assert_allclose([t[0] for t in times], want, rtol=1e-9)
  assert len(req.output_token_ids) == 8
  assert engine.spec_counts.num_accepted_tokens == 5


def _report_bytes(cost_file, tmp_path, name, **overrides):
  engine = Engine(CFG, None, _config(cost_file, **overrides))
  wl = synthetic.synthetic_azure_conv(12, rate_scale=2.0, seed=5, max_prompt_len=30,
                                      max_output_len=40, vocab_size=CFG.vocab_size,
                                      reserved_token_ids=frozenset({0, 1}))
  assert path(engine, loop=True) == ("step", engine.loop_refusal())
  records, duration_s = replay(engine, wl, realtime=False)
  report = metrics.build_report(records, duration_s, run_config(engine, "tiny"),
                                num_offered=len(wl))
  report["engine_outcomes"] = run_outcomes(engine)      # as scripts/replay.py writes it
  out = tmp_path / name
  metrics.write_report(out, report)
  return out.read_bytes()


def test_same_seed_same_replay_bytes(cost_file, tmp_path):
  """Two replays with one seed write the same report, byte for byte;
  another seed draws other acceptances."""
  a = _report_bytes(cost_file, tmp_path, "a.json", spec_seed=7)
  b = _report_bytes(cost_file, tmp_path, "b.json", spec_seed=7)
  c = _report_bytes(cost_file, tmp_path, "c.json", spec_seed=8)
  assert a == b
  first, other = json.loads(a), json.loads(c)
  assert first["config"]["spec_acceptance"] == 0.6 and first["config"]["spec_seed"] == 7
  assert first["engine_outcomes"]["spec_decode"]["num_accepted_tokens"] > 0
  assert (first["engine_outcomes"]["spec_decode"]
          != other["engine_outcomes"]["spec_decode"])


def test_the_loop_takes_speculation_and_the_settings_are_checked(cost_file):
  engine = Engine(CFG, None, _config(cost_file, enable_prefix_caching=False))
  assert engine.loop_refusal() is None      # test_sim_loop_speculative runs it
  with pytest.raises(ValueError, match=r"EngineConfig.spec_acceptance must be in \(0, 1\] "
                                       r"with executor 'simulated'"):
    _config(cost_file, alpha=0.0)
  with pytest.raises(ValueError, match=r"EngineConfig.spec_acceptance must be in \[0, 1\]"):
    _config(cost_file, alpha=1.5)
  with pytest.raises(ValueError, match="EngineConfig.spec_acceptance must be 0 .unset. "
                                       "unless executor is 'simulated'"):
    EngineConfig.preset("tiny", speculative="ngram:k=2", spec_acceptance=0.5)
  with pytest.raises(ValueError, match="EngineConfig.spec_seed must be an int >= 0"):
    _config(cost_file, spec_seed=-1)
  dataclasses.replace(_config(cost_file), executor="simulated")    # accepted
