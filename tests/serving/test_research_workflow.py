"""The research harness as a user drives it: prompt and output fitted into
the context together, live and cached KV pages apart in the ledger, and
report coordinates (what the user set) apart from outcomes (what the run
measured), so that replays differing only in the policy compare."""

import json

import pytest

from serving.harness import ablation
from serving.harness import ledger
from serving.harness import metrics
from serving.harness import synthetic
from serving.harness import traces
from serving.harness import workloads
from serving.engine import cost_model as cost_lib
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.harness.replay import OUTCOME_KEYS, replay, run_config, run_outcomes
from serving.engine.sim_executor import VirtualClock
from tests.serving.engine_testing import CFG


def _spec(i, prompt_len, max_tokens):
  return workloads.RequestSpec(request_id=f"r{i}", arrival_s=float(i),
                               prompt_token_ids=tuple(range(3, 3 + prompt_len)),
                               max_tokens=max_tokens)


def _workload(specs):
  return workloads.Workload(
      requests=tuple(specs), source="test", path=None, sha256=None, num_rows_read=len(specs),
      num_clipped=0, num_output_capped=0, time_scale=1.0, window_s=None, seed=0,
      max_prompt_len=None, max_output_len=None)


def test_fit_context_keeps_outputs_and_cuts_prompts_by_the_stated_rule():
  """cpu_small's 512-token context: a 1,000-token prompt no longer takes 511
  tokens and leaves one output token; the output keeps min(requested, 256)."""
  wl = workloads.fit_context(_workload([
      _spec(0, 1000, 200),     # long prompt: output kept whole, prompt cut to 312
      _spec(1, 2000, 512),     # both long: output keeps 256, prompt 256
      _spec(2, 100, 600),      # short prompt: output takes the rest, 412
      _spec(3, 300, 100),      # fits: unchanged
      _spec(4, 511, 1),        # fits exactly: unchanged
  ]), 512)
  assert [(r.prompt_len, r.max_tokens) for r in wl] == [
      (312, 200), (256, 256), (100, 412), (300, 100), (511, 1)]
  assert all(r.prompt_len + r.max_tokens <= 512 for r in wl)
  assert [r.clipped for r in wl] == [True, True, False, False, False]
  assert wl[0].prompt_token_ids == tuple(range(3, 3 + 312))      # a prefix of the original
  assert (wl.num_clipped, wl.num_output_capped, wl.num_context_fitted) == (2, 2, 3)
  assert wl.describe()["max_model_len"] == 512
  note = workloads.fit_note(wl)
  assert "\n" not in note and note.startswith("note: 3 of 5 requests cut to fit "
                                               "max_model_len=512")
  assert "outputs 1-412 tokens" in note
  assert workloads.fit_note(workloads.fit_context(_workload([_spec(0, 10, 10)]), 512)) is None
  with pytest.raises(ValueError, match="max_model_len=1 must be >= 2"):
    workloads.fit_context(wl, 1)


def test_fit_context_on_a_trace_window_leaves_outputs_of_their_requested_length(tmp_path):
  """An Azure-format trace of long prompts on a 64-token context: every
  output keeps min(requested, 32) tokens (before: prompts clipped to 63 and
  one output token each)."""
  trace = tmp_path / "trace.csv"
  rows = [(900, 20), (1500, 200), (40, 10), (63, 1)]
  trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
      f"2023-11-16 18:15:{46 + i:02d}.0000000,{p},{o}\n" for i, (p, o) in enumerate(rows)))
  wl = workloads.fit_context(traces.load_azure_trace(str(trace), vocab_size=CFG.vocab_size),
                             64)
  assert [(r.prompt_len, r.max_tokens) for r in wl] == [(44, 20), (32, 32), (40, 10), (63, 1)]


def _sim_engine(cost_file, **overrides):
  cfg = EngineConfig.preset("tiny", executor="simulated", cost_model=cost_file, **overrides)
  return Engine(CFG, None, cfg, clock=VirtualClock())


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("cost") / "cost.json"
  cost_lib.CostModel.of(step=7.0, rows=2.0, attention_gflop=2000.0,
                        kv_read_gb=400.0).save(path)
  return str(path)


def _shared_prefix_workload(n=16):
  return synthetic.synthetic_shared_prefix(
      n, system_prompt_len=24, num_system_prompts=2, user_len=(4, 12), max_output_len=12,
      rate_per_s=40.0, seed=1, vocab_size=CFG.vocab_size, reserved_token_ids=frozenset({0, 1}))


def test_ledger_counts_live_and_cached_kv_pages_apart(cost_file):
  """With prefix caching, finished requests leave their prompt pages cached:
  they are not live. After the last request no page is live, the cached ones
  remain, and live + cached + free = num_pages - 1 in every sample."""
  engine = _sim_engine(cost_file)
  sampler = ledger.ResourceSampler(engine)
  records, duration_s = replay(engine, _shared_prefix_workload(), on_progress=sampler)
  out = ledger.build_ledger(records, duration_s=duration_s, engine=engine, sampler=sampler)
  series = out["resources"]["timeseries"]
  assert series["columns"] == ["t_ms", "kv_pages_live", "kv_pages_cached", "queue_len",
                               "running"]
  rows = series["rows"]
  last = dict(zip(series["columns"], rows[-1]))
  cached = run_outcomes(engine)["prefix_cache_pages"]
  assert cached > 0
  assert (last["kv_pages_live"], last["kv_pages_cached"], last["running"]) == (0, cached, 0)
  free = int(engine.pages.num_free)
  assert last["kv_pages_live"] + last["kv_pages_cached"] + free == engine.config.num_pages - 1
  assert out["resources"]["kv_pages_live_max"] == max(r[1] for r in rows) > 0
  assert out["resources"]["kv_pages_cached_max"] == max(r[2] for r in rows) >= cached


def _report(cost_file, policy):
  engine = _sim_engine(cost_file, policy=policy)
  wl = _shared_prefix_workload()
  records, duration_s = replay(engine, wl)
  report = metrics.build_report(records, duration_s, run_config(engine, "tiny"),
                                num_offered=len(wl))
  report["engine_outcomes"] = run_outcomes(engine)
  return json.loads(json.dumps(report))


def test_a_replays_rate_is_its_workloads_time_scale_not_a_rate_scale():
  """A replay report carries its rate in the workload (``time_scale``: 1/20
  for --rate_scale=20), so its coordinates have no ``rate_scale`` (it used
  to print 1.0 for every replay); two replays at different rates are refused
  naming the time scale; a sweep's rate grid stays a coordinate."""
  replay = lambda scale: {"config": {"model": "m", "workload": {
      "source": "synthetic", "time_scale": scale}}}
  coords = ablation.coordinates(replay(0.05))
  assert "rate_scale" not in coords
  assert json.loads(coords["trace"]) == {"source": "synthetic", "time_scale": 0.05}
  with pytest.raises(ValueError, match=r"coordinate 'trace' differs in time_scale "
                                       r"\(0\.05 vs 10\.0\)"):
    ablation.check_comparable([replay(0.05), replay(10.0)], ["a.json", "b.json"])
  sweep = dict(replay(1.0), rate_scale=[0.5, 2])
  assert json.loads(ablation.coordinates(sweep)["rate_scale"]) == [0.5, 2]


def test_outcomes_are_not_coordinates_so_policies_compare(cost_file):
  """Two replays that differ only in the policy measure different outcomes
  (iterations, prompt rows computed, prefix-cache counters) and still
  compare; an engine setting that differs is refused in one line that names
  the key."""
  a, b = _report(cost_file, "sarathi_serve"), _report(cost_file, "fastserve")
  assert tuple(a["engine_outcomes"]) == OUTCOME_KEYS
  assert not set(OUTCOME_KEYS) & set(a["config"])
  assert a["completed"] == b["completed"] == 16
  outcomes = lambda r: (r["engine_outcomes"]["iterations"],
                        r["engine_outcomes"]["prefill_tokens_computed"])
  assert outcomes(a) != outcomes(b), (outcomes(a), outcomes(b))
  assert a["engine_outcomes"]["prefix_cache_pages"] > 0
  ablation.check_comparable([a, b], ["a.json", "b.json"])
  # Which sort and scan kernels ran (native, or XLA's without a compiler
  # or off the CPU) gives the same bits: not a coordinate.
  xla = dict(b, config=dict(b["config"], key_order_sort="jax.lax.sort (no compiler)",
                            scan_kernels="xla (no compiler)"))
  assert a["config"]["scan_kernels"] != xla["config"]["scan_kernels"]
  ablation.check_comparable([a, xla], ["a.json", "b.json"])
  # A report written before outcomes left the config compares too.
  legacy = [dict(r, config={**r["config"], **r.pop("engine_outcomes")}) for r in (a, b)]
  ablation.check_comparable(legacy, ["a.json", "b.json"])
  changed = dict(b, config=dict(b["config"], max_num_seqs=2, page_size=8))
  with pytest.raises(ValueError) as e:
    ablation.check_comparable([a, changed], ["a.json", "b.json"])
  assert str(e.value) == ("refusing to rank a.json and b.json: coordinate 'engine_config' "
                          "differs in max_num_seqs (4 vs 2), page_size (4 vs 8)")
