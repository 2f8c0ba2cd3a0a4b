"""The article's fixtures, reproduced by the code the engine runs.

§0x01A iteration 5, §0x02 A/B/C, §0x04 five-row pack, §0x05 budgets and
future rows, §0x06 admission replay, §0x07 burst / saturation / tail probe,
§0x09 chunk ledgers and chunked causal attention, §0x0E sensitivity surface.
Where the article's input table was lost, the docstring says which inputs
were reconstructed (chosen to reproduce every number the text states).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention.ragged import ragged_paged_attention, reference_attention
from scheduler import admission as adm
from tests.scheduler import article_accounting as acc
from tests.scheduler import article_admission as art
from scheduler import apply as apply_lib
from tests.scheduler import fixtures as fx
from scheduler import records as rec
from scheduler import validate as v
from scheduler.ledger import Budgets
from scheduler.policy_sarathi_serve import SarathiServe
from serving.harness.metrics import percentile_nearest_rank
from serving.engine.pack import pack

KIB, MIB = acc.KIB, acc.MIB


# ------------------------------------------------------------------ §0x01A


def test_0x01a_iteration5_mixed_fixture():
  """Decode-first SarathiServe (key phase, priority, arrival, id, generation)
  with K_token = 4, K_seq = 3 on the reconstructed iteration-5 cut."""
  manifest, state, names = fx.iteration5_fixture()
  online = manifest.online()
  policy = SarathiServe(Budgets(token_budget=4, seq_budget=3, chunk_cap=4))
  plan = fx.plan_jit(policy, online, state,
                     fx.alloc_view(state, num_pages=16, page_size=4))
  v.validate_plan(online, state, plan)

  sel = np.flatnonzero(np.asarray(plan.selected))
  order = sel[np.argsort(np.asarray(plan.rank)[sel])]
  assert [f"{names[s]}:{int(plan.generation[s])}" for s in order] == [
      "req-B:2", "req-C:1", "req-A:0"]
  assert [int(plan.snapshot_version[s]) for s in order] == [9, 6, 3]
  assert [(int(plan.start[s]), int(plan.end[s])) for s in order] == [(3, 4), (3, 4), (0, 2)]
  assert [int(plan.kind[s]) for s in order] == [rec.DECODE_ROW, rec.DECODE_ROW,
                                                rec.PREFILL_CHUNK]
  assert int(plan.num_tokens) == 1 + 1 + 2 == 4 and int(plan.num_seqs) == 3
  # Not selected: req-D:0 (foreign readiness false), req-E:4 (terminal).
  assert not bool(plan.selected[3]) and not bool(state.ready[3])
  assert not bool(plan.selected[4]) and int(state.status[4]) == rec.FINISHED
  assert int(state.generation[4]) == 4

  result = fx.fixture_execute(manifest, state, plan, 5.0)
  v.validate_result(plan, state, online, result)
  after = apply_lib.apply(online, state, plan, result)
  # req-A (4-token prompt, reached 2) emits nothing; req-B emits token 2 + EOS.
  assert not bool(result.emitted[0]) and int(after.emitted[0]) == 0
  assert bool(result.emitted[1]) and int(result.finish_reason[1]) == rec.FINISH_EOS
  assert int(after.emitted[1]) == 2
  assert int(manifest.prompt_len[1] + after.emitted[1]) == 5   # logical stream
  assert int(after.committed[1]) == 4                          # committed cache
  # Completed-service debits: client-alpha 3 rows, client-beta 1.
  np.testing.assert_array_equal(after.service_rows, [3, 1])


# ------------------------------------------------------------------ §0x02


def _refill_replay():
  """A (G=2) and B (G=8) at cut 0, C (G=3) at cut 2; one-token prompts.

  The real SarathiServe with two sequence slots (token budget 2) refills at
  iteration boundaries. Returns (busy slots per iteration, first-token cut,
  finish cut, plan at cut 2, names by slot at cut 2).
  """
  policy = SarathiServe(Budgets(token_budget=2, seq_budget=2, chunk_cap=1))
  manifest, state = fx.build(
      [dict(slot=0, request_id=0, arrival_seq=0, prompt_len=1, hidden=2),
       dict(slot=1, request_id=1, arrival_seq=1, prompt_len=1, hidden=8)],
      num_slots=3)
  names = {0: "A", 1: "B"}
  busy, first, finish, cut2 = [], {}, {}, None
  for cut in range(20):
    if cut == 2:
      manifest, state = apply_lib.arrive(manifest, state, 2, 2, 2.0, 2, 1, 16, 0, 0)
      manifest = manifest.replace(hidden_realized_output_tokens=(
          manifest.hidden_realized_output_tokens.at[2].set(3)))
      names[2] = "C"
    live = np.isin(np.asarray(state.status), [rec.WAITING, rec.RUNNING])
    if not live.any():
      break
    nxt, plan, result, pbits, rbits = fx.replay_step_jit(
        policy, manifest, state, jnp.float32(cut), num_pages=64, page_size=4)
    assert int(pbits) == 0 and int(rbits) == 0
    if cut == 2:
      cut2 = (plan, state)
    busy.append(int(plan.num_seqs))
    for s in np.flatnonzero(np.asarray(result.emitted)):
      first.setdefault(names[s], cut + 1)
    for s in np.flatnonzero(np.asarray(result.finished)):
      finish[names[s]] = cut + 1
    state = apply_lib.release(nxt, nxt.status == rec.FINISHED)
  return busy, first, finish, cut2


def test_0x02_fixed_cohort_versus_iteration_refill():
  """Realized lengths A=2, B=8, C=3 with C arriving at cut 2 (the article's
  lost input table, reconstructed from its derivation)."""
  lengths, arrival = {"A": 2, "B": 8, "C": 3}, {"A": 0, "B": 0, "C": 2}
  # Fixed request batch: cohorts {A, B} then {C}.
  first = acc.fixed_cohort_occupancy([2, 8], 2)
  assert (first.useful, first.available, first.idle, first.occupancy) == (10, 16, 6, 0.625)
  second = acc.fixed_cohort_occupancy([3], 2)
  assert (second.useful, second.available, second.idle) == (3, 6, 3)
  timeline = fx.fixed_cohort_replay(lengths, arrival, 2)
  fixed = acc.replay_occupancy([sum(r is not None for r in row) for row in timeline], 2)
  assert len(timeline) == 11
  assert (fixed.useful, fixed.available, fixed.idle) == (13, 22, 9)
  assert round(fixed.occupancy, 3) == 0.591
  assert timeline[2] == [None, "B"]      # slot 0 idles behind the barrier
  assert timeline.index(["C", None]) == 8  # C's prefill runs in [8, 9)

  busy, first_cut, finish_cut, (plan2, state2) = _refill_replay()
  refill = acc.replay_occupancy(busy, 2)
  assert len(busy) == 8 and finish_cut["B"] == 8
  assert (refill.useful, refill.available, refill.idle) == (13, 16, 3)
  assert refill.occupancy == 0.8125
  # Cut-2 transition: A finished after output 2, B decodes for output 3, C
  # is admitted into the freed slot and its prefill gives first_token_cut 3.
  assert finish_cut["A"] == 2 and first_cut["C"] == 3 and finish_cut["C"] == 5
  assert int(state2.status[0]) == rec.FREE and int(state2.emitted[1]) == 2
  assert np.asarray(plan2.selected).tolist() == [False, True, True]
  assert int(plan2.kind[1]) == rec.DECODE_ROW and int(plan2.kind[2]) == rec.PREFILL_CHUNK
  assert bool(plan2.admit[2])


# ------------------------------------------------------------------ §0x04


def _five_row_plan():
  """A:0 decode [5,6), B:0 prefill [0,3), C:0 decode [2,3) in rank order
  A, B, C (the article's row table; the per-request inputs — A with p=5, e=1;
  B a 3-token prompt; C with p=2, e=1 — are reconstructed)."""
  z = jnp.zeros((4,), jnp.int32)
  return rec.IterationPlan(
      decision_id=jnp.int32(0), input_state_version=jnp.int32(0),
      selected=jnp.array([True, True, True, False]), generation=z,
      snapshot_version=z, start=jnp.array([5, 0, 2, 0], jnp.int32),
      end=jnp.array([6, 3, 3, 0], jnp.int32),
      kind=jnp.array([rec.DECODE_ROW, rec.PREFILL_CHUNK, rec.DECODE_ROW,
                      rec.NO_WORK], jnp.int32),
      rank=jnp.array([0, 1, 2, -1], jnp.int32), admit=jnp.zeros((4,), bool),
      preempt=jnp.zeros((4,), bool), sort_key=jnp.zeros((4, 5), jnp.int32),
      num_tokens=jnp.int32(5), num_seqs=jnp.int32(3), token_budget=8, seq_budget=3)


def test_0x04_five_row_packed_fixture():
  plan = _five_row_plan()
  page_size, num_pages = 4, 8
  table = jnp.array([[1, 2], [3, 0], [4, 0], [0, 0]], jnp.int32)
  buffer = jnp.arange(4 * 8, dtype=jnp.int32).reshape(4, 8)
  packed = pack(plan, buffer, table, page_size, num_rows=8, num_seqs=3)
  v.validate_packed(plan, packed)
  cu = np.asarray(packed.cu_q_lens)
  assert np.diff(cu).tolist() == [1, 3, 1] and int(cu[-1]) == 5
  assert cu.tolist() == [0, 1, 4, 5]
  assert np.asarray(packed.positions)[:5].tolist() == [5, 0, 1, 2, 2]
  assert np.asarray(packed.slot_of_row)[:5].tolist() == [0, 1, 1, 1, 2]
  assert np.asarray(packed.valid_row).tolist() == [True] * 5 + [False] * 3

  rng = np.random.default_rng(4)
  heads, kv_heads, dim = 2, 1, 4
  q = jnp.asarray(rng.standard_normal((8, heads, dim)), jnp.float32)
  pool = rng.standard_normal((2, num_pages, page_size, kv_heads, dim)).astype(np.float32)
  owned = {0: [1, 2], 1: [3], 2: [4]}
  args = dict(kv_lens=packed.kv_lens, page_table=packed.page_table,
              cu_q_lens=packed.cu_q_lens, num_seqs=packed.num_seqs, sm_scale=0.5)
  attend = lambda k, v_: np.asarray(ragged_paged_attention(
      q, jnp.asarray(k), jnp.asarray(v_), impl="gather", **args))
  packed_out = attend(pool[0], pool[1])
  ref = reference_attention(q, pool[0], pool[1], **args)
  np.testing.assert_allclose(packed_out[:5], ref[:5], atol=1e-6)
  # Zero cross-request visibility: poisoning every other request's pages
  # (and unused page tails) leaves each request's rows bit-identical.
  for slot, rows in ((0, [0]), (1, [1, 2, 3]), (2, [4])):
    dirty = pool.copy()
    for other, pages in owned.items():
      if other != slot:
        dirty[:, pages] = np.nan
    dirty[:, 2, 2:] = np.nan if slot == 0 else dirty[:, 2, 2:]
    out = attend(dirty[0], dirty[1])
    assert np.array_equal(out[rows], packed_out[rows])


# ------------------------------------------------------------------ §0x05


def test_0x05_token_and_sequence_budgets_are_separate_ledgers():
  """B_tok = 6, B_seq = 3. Counterexamples (lost table, reconstructed):
  prefills [3, 2, 2] fit B_seq but not B_tok; four decode rows fit B_tok but
  not B_seq; [4, 1, 1] fits both."""
  assert acc.iteration_ledger([3, 2, 2]) == {"num_seqs": 3, "num_tokens": 7}
  assert not acc.iteration_legal([3, 2, 2], 6, 3)
  assert not acc.iteration_legal([1, 1, 1, 1], 6, 3)
  assert acc.iteration_legal([4, 1, 1], 6, 3)

  policy = SarathiServe(Budgets(token_budget=6, seq_budget=3, chunk_cap=6))
  prefills = [dict(slot=i, request_id=i, arrival_seq=i, prompt_len=p)
              for i, p in enumerate([3, 2, 2])]
  manifest, state = fx.build(prefills, num_slots=4)
  plan = fx.plan_jit(policy, manifest, state,
                     fx.alloc_view(state, num_pages=32, page_size=4))
  v.validate_plan(manifest, state, plan)
  assert np.asarray(plan.end - plan.start)[:3].tolist() == [3, 2, 1]
  with pytest.raises(v.TokenBudgetOverflow):
    v.validate_plan(manifest, state, plan.replace(
        end=plan.end.at[2].set(2), num_tokens=jnp.int32(7)))

  decodes = [dict(slot=i, request_id=i, arrival_seq=i, prompt_len=2,
                  status=rec.RUNNING, emitted=1, computed=2) for i in range(4)]
  manifest, state = fx.build(decodes, num_slots=4)
  plan = fx.plan_jit(policy, manifest, state,
                     fx.alloc_view(state, num_pages=32, page_size=4))
  assert int(plan.num_seqs) == 3 and int(plan.num_tokens) == 3
  with pytest.raises(v.SequenceBudgetOverflow):
    v.validate_plan(manifest, state, plan.replace(seq_budget=2))


def test_0x05_future_rows_from_the_first_token_contract():
  assert acc.DELTA_KV_ROW_BYTES == 128 * KIB
  assert adm.append_rows(0, emitted=3, forecast_total=10) == 7
  assert adm.append_rows(0, emitted=3, forecast_total=2) == 0
  assert acc.rows_to_bytes(7) == 896 * KIB
  # New request: U + max(G_hat - 1, 0); a one-output request appends no row.
  assert adm.append_rows(5, emitted=0, forecast_total=1) == 5
  assert adm.append_rows(5, emitted=0, forecast_total=4) == 8
  assert acc.rows_to_bytes(8) == 1 * MIB
  # One decode row fits both iteration budgets while its forecast trajectory
  # (39 more rows) exceeds a 28-row reservation ceiling.
  assert acc.iteration_legal([1], 6, 3)
  assert adm.append_rows(0, 1, 40) > 28


# ------------------------------------------------------------------ §0x06


# Reconstructed inputs (the article's table was lost): three FIFO
# resume-ready requests A, B, C (priority A > B > C), each with E = 1
# emitted. Forecast append rows: maximum [9, 10, 11], point [4, 3, 3],
# p90 [6, 7, 5]; hidden realized append rows [6, 8, 7].
E = 1
MAXIMUM, POINT, P90, REALIZED = [9, 10, 11], [4, 3, 3], [6, 7, 5], [6, 8, 7]
BASE_ROWS, HARD_ROWS, WATERMARK_ROWS = 8, 28, 4


def _admission(estimates, ceiling, realized=REALIZED):
  admitted = art.admit_fifo_rows(BASE_ROWS, estimates, ceiling)
  return acc.score_admission(BASE_ROWS, estimates, realized, admitted, HARD_ROWS)


def test_0x06_admission_replay():
  soft = art.soft_ceiling_rows(HARD_ROWS, WATERMARK_ROWS)
  assert soft == 24
  assert acc.rows_to_bytes(HARD_ROWS) == 3.5 * MIB
  assert acc.rows_to_bytes(WATERMARK_ROWS) == 0.5 * MIB
  assert acc.rows_to_bytes(soft) == 3 * MIB
  # Forecast totals G_hat = rows + E give back the rows: max(G_hat - E, 0).
  assert [int(adm.append_rows(0, E, r + E)) for r in P90] == P90

  maximum = _admission(MAXIMUM, HARD_ROWS)
  assert maximum.admitted == (True, True, False)
  assert maximum.over_rows == 5 and acc.rows_to_bytes(5) == 640 * KIB
  assert maximum.hard_breach_rows == 0 and maximum.under_rows == 0

  point = _admission(POINT, HARD_ROWS)
  assert point.admitted == (True, True, True)
  assert point.under_rows == 11 and acc.rows_to_bytes(11) == 1.375 * MIB
  assert point.realized_rows == 29 and point.hard_breach_rows == 1

  p90 = _admission(P90, HARD_ROWS)
  assert p90.admitted == (True, True, True)
  assert p90.under_rows == 3 and acc.rows_to_bytes(3) == 384 * KIB
  assert p90.realized_rows == 29 > HARD_ROWS
  assert p90.hard_breach_rows == 1 and acc.rows_to_bytes(1) == 128 * KIB
  # The preemption candidate is the lowest-priority admitted request: C.
  assert [n for n, a in zip("ABC", p90.admitted) if a][-1] == "C"

  watermark = _admission(P90, soft)
  assert watermark.admitted == (True, True, False)
  assert watermark.under_rows == 1
  assert watermark.realized_rows == 22 < soft < HARD_ROWS
  assert watermark.hard_breach_rows == 0

  # Metamorphic: other realized lengths change the score, never the plan.
  for estimates, ceiling in ((MAXIMUM, HARD_ROWS), (POINT, HARD_ROWS),
                             (P90, HARD_ROWS), (P90, soft)):
    other = _admission(estimates, ceiling, realized=[1, 30, 2])
    assert other.admitted == _admission(estimates, ceiling).admitted
  with pytest.raises(ValueError, match="watermark"):
    art.soft_ceiling_rows(HARD_ROWS, 29)


# ------------------------------------------------------------------ §0x07


TTFT_MS, TBT_MS = 30.0, 20.0


def _partition(outcomes):
  vals = list(outcomes.values())
  return acc.OutcomePartition(offered=len(vals), valid=vals.count("valid"),
                              missed=vals.count("missed"),
                              rejected=vals.count("rejected"), open=vals.count("open"))


def test_0x07_burst_accept_all_versus_four_live_cap():
  """10 ms ticks, 2 rows per tick, 6 requests at t=0 of 1 first-token unit +
  1 next-token unit, TTFT 30 ms, TBT 20 ms, least predicted slack."""
  accept = fx.least_slack_replay([0.0] * 6)
  outcomes = fx.slo_outcomes(accept, ttft_ms=TTFT_MS, tbt_ms=TBT_MS)
  part = _partition(outcomes)
  assert sum(len(r.emit_ms) for r in accept) == 12          # every output emitted
  assert sum(r.selected_negative_slack for r in accept) == 2
  assert [r.emit_ms[0] for r in accept] == [10, 10, 30, 30, 40, 40]
  assert (part.valid, part.missed, part.rejected, part.open) == (4, 2, 0, 0)
  assert part.closes

  capped = fx.least_slack_replay([0.0] * 6, live_cap=4)
  cap_part = _partition(fx.slo_outcomes(capped, ttft_ms=TTFT_MS, tbt_ms=TBT_MS))
  assert (cap_part.valid, cap_part.missed, cap_part.rejected, cap_part.open) == (4, 0, 2, 0)
  assert cap_part.closes and not any(r.selected_negative_slack for r in capped)
  # Same fixed-window request goodput; different failure surfaces.
  assert part.valid == cap_part.valid == 4 and part.offered == cap_part.offered == 6


def test_0x07_saturation_window():
  """240 two-row requests over W = 1.3 s. Reconstructed arrivals: two per
  10 ms tick for the first 120 ticks (t = 0 .. 1190 ms); four-live cap."""
  arrivals = [10.0 * (i // 2) for i in range(240)]
  demand = 240 * 2
  assert demand == 480 and 130 * 2 == 260
  assert acc.window_shortfall_rows(demand, ticks=130, rows_per_tick=2) == 220
  reqs = fx.least_slack_replay(arrivals, live_cap=4, window_ms=1300.0)
  outcomes = fx.slo_outcomes(reqs, ttft_ms=TTFT_MS, tbt_ms=TBT_MS)
  part = _partition(outcomes)
  assert part.closes
  assert (part.rejected, part.valid, part.missed, part.open) == (118, 122, 0, 0)
  assert part.completion_conditioned_attainment == 1.0
  assert round(100 * part.offered_attainment, 3) == 50.833


def test_0x07_tail_probe():
  samples = [10.0] * 98 + [500.0] * 2
  assert np.mean(samples) == pytest.approx(19.8) and np.mean(samples) < 20
  assert percentile_nearest_rank(samples, 95) == 10.0
  assert percentile_nearest_rank(samples, 99) == 500.0
  assert percentile_nearest_rank(samples[:12], 99) is None   # insufficient sample


# ------------------------------------------------------------------ §0x09


def _chunked_attention(q, k, v_, chunk):
  """Each chunk [s, e) attends to keys [0, e) through the paged kernel; rows
  at or beyond e are NaN (not yet written), padding rows keep one shape."""
  seq = q.shape[0]
  page_size = 4
  table = jnp.arange(seq // page_size, dtype=jnp.int32)[None]
  out = np.zeros(q.shape, np.float32)
  for start in range(0, seq, chunk):
    end = min(start + chunk, seq)
    kd, vd = k.copy(), v_.copy()
    kd[end:], vd[end:] = np.nan, np.nan
    rows = np.zeros_like(q)
    rows[: end - start] = q[start:end]
    res = _attend(jnp.asarray(rows), jnp.asarray(kd.reshape(-1, page_size, 1, 4)),
                  jnp.asarray(vd.reshape(-1, page_size, 1, 4)), jnp.array([end]),
                  table, jnp.array([0, end - start]))
    out[start:end] = np.asarray(res)[: end - start]
  return out


@jax.jit
def _attend(q, k, v_, kv_lens, table, cu):
  return ragged_paged_attention(q, k, v_, kv_lens.astype(jnp.int32), table,
                                cu.astype(jnp.int32), jnp.int32(1), sm_scale=0.5,
                                impl="gather")


def test_0x09_chunked_causal_pairs_and_attention():
  seq = 12
  for chunk in (1, 2, 3, 4, 5, 6, 12):
    sizes = acc.equal_chunks(seq, chunk)
    assert sum(acc.chunk_pairs(sizes)) == acc.causal_pairs(seq) == 78
  rng = np.random.default_rng(9)
  q = rng.standard_normal((seq, 2, 4)).astype(np.float32)
  k = rng.standard_normal((seq, 1, 4)).astype(np.float32)
  v_ = rng.standard_normal((seq, 1, 4)).astype(np.float32)
  full = _chunked_attention(q, k, v_, seq)
  for chunk in (1, 2, 3, 4, 5, 6):
    assert np.array_equal(_chunked_attention(q, k, v_, chunk), full), chunk


def test_0x09_history_exposure_sweep_s16():
  """Reconstructed sweep rows (lost table): chunk sizes 1..6, 8, 16."""
  expect = {1: (16, 120), 2: (8, 56), 3: (6, 45), 4: (4, 24), 5: (4, 30),
            6: (3, 18), 8: (2, 8), 16: (1, 0)}
  for chunk, (count, rows) in expect.items():
    sizes = acc.equal_chunks(16, chunk)
    assert len(sizes) == count and acc.history_exposure_rows(sizes) == rows
    assert sum(acc.chunk_pairs(sizes)) == 136
  # Equal chunk count, different boundaries, different exposure.
  assert acc.rows_to_bytes(24) == 3 * MIB and acc.rows_to_bytes(30) == 3.75 * MIB


def test_0x09_ten_token_example_and_imbalance():
  assert acc.chunk_pairs([4, 4, 2]) == [10, 26, 19]
  assert sum(acc.chunk_pairs([4, 4, 2])) == 55 == acc.causal_pairs(10)
  assert acc.history_exposure_rows([4, 4, 2]) == 12
  assert acc.imbalance_ms([18, 4, 4]) == 28
  assert acc.imbalance_ms([8, 8, 6]) == 2


# ------------------------------------------------------------------ §0x0E


BASE = acc.SensitivityControls()


def test_0x0e_base_sensitivity_fixture():
  led = acc.sensitivity_ledgers(BASE)
  assert led["chunks"] == 4
  assert led["causal_pairs"] == 136
  assert led["history_rows"] == 24 and led["history_bytes"] == 3 * MIB
  assert led["piggyback_rows"] == 4
  assert led["reservation_intents"] == 4
  assert led["aging_crossover_tick"] == 8
  assert led["client_events"] == {"A": 8, "B": 4}


# Reconstructed one-control cases (the article's table was lost): ten cases
# over nine axes, each listing the only ledgers that may change.
ONE_CONTROL = [
    (dict(chunk_size=2), {"chunks": 8, "history_rows": 56, "history_bytes": 7 * MIB,
                          "piggyback_room": 6}),
    (dict(chunk_size=8), {"chunks": 2, "history_rows": 8, "history_bytes": 1 * MIB,
                          "piggyback_room": 0, "piggyback_rows": 0}),
    (dict(decode_rows=2), {"piggyback_rows": 2}),
    (dict(token_budget=6), {"piggyback_room": 2, "piggyback_rows": 2}),
    (dict(seq_budget=3), {"piggyback_rows": 2}),
    (dict(forecast_rows=7), {"reservation_intents": 2}),
    (dict(aging_quantum=3), {"aging_crossover_tick": 12}),
    (dict(prefix_hit_rows=4), {"uncached_rows": 12, "chunks": 3}),
    (dict(foreign_ready=False), {"prefill_selectable": False}),
    (dict(hidden_realized_outputs=(1, 9, 40)), {}),
]


@pytest.mark.parametrize("change,expect", ONE_CONTROL,
                         ids=[next(iter(c)) + str(i) for i, (c, _) in enumerate(ONE_CONTROL)])
def test_0x0e_one_control_variations(change, expect):
  base = acc.sensitivity_ledgers(BASE)
  led = acc.sensitivity_ledgers(dataclasses.replace(BASE, **change))
  changed = {k: led[k] for k in led if led[k] != base[k]}
  assert changed == expect
