"""Article arithmetic of §0x02, §0x05, §0x06, §0x07, §0x09 and §0x0E.

Plain functions over Python ints / sequences, kept as the exact fixtures of
tests/scheduler/test_article_fixtures.py: slot occupancy, iteration budgets,
row bytes, offline scoring of a frozen admission plan against hidden truth
(``score_admission``: reservation error and hard breach, never an online
input), outcome partitions, causal pairs and history exposure of chunked
prefill, the imbalance proxy, and the one-control sensitivity ledgers.
The engine runs none of them: its reservation arithmetic (A_hat, the soft
ceiling, the admission predicate) has one home, ``scheduler.admission``,
which the jitted policies call. Units are in the names: ``_rows`` (token
rows), ``_bytes``, ``_ms``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

KIB = 1024
MIB = 1024 * 1024
# §0x05: logical K/V bytes per all-layer committed row of the GQA/fp16 profile.
DELTA_KV_ROW_BYTES = 131_072


# --------------------------------------------------------------- §0x02


@dataclasses.dataclass(frozen=True)
class SlotOccupancy:
  """Retrospective logical slot accounting (§0x02); slot-iterations."""

  useful: int
  available: int

  @property
  def idle(self) -> int:
    return self.available - self.useful

  @property
  def occupancy(self) -> float:
    """U_slot = useful / available (not measured GPU utilization)."""
    return self.useful / self.available


def fixed_cohort_occupancy(lengths: Sequence[int], num_slots: int) -> SlotOccupancy:
  """One frozen cohort: W_available = B * max G, W_useful = sum G (§0x02)."""
  return SlotOccupancy(useful=sum(lengths), available=num_slots * max(lengths))


def replay_occupancy(busy_slots_per_iteration: Sequence[int],
                     num_slots: int) -> SlotOccupancy:
  """Occupancy of a replay given the busy slots of every iteration."""
  return SlotOccupancy(useful=sum(busy_slots_per_iteration),
                       available=num_slots * len(busy_slots_per_iteration))


# --------------------------------------------------------------- §0x05


def iteration_ledger(widths: Sequence[int]) -> Dict[str, int]:
  """N_seq (selected generations) and N_tok (sum of interval widths)."""
  return {"num_seqs": len(widths), "num_tokens": sum(widths)}


def iteration_legal(widths: Sequence[int], token_budget: int, seq_budget: int) -> bool:
  """N_seq <= B_seq and N_tok <= B_tok: both ledgers, never one scalar."""
  ledger = iteration_ledger(widths)
  return ledger["num_seqs"] <= seq_budget and ledger["num_tokens"] <= token_budget


def rows_to_bytes(rows: int, delta_kv_row_bytes: int = DELTA_KV_ROW_BYTES) -> int:
  """Logical payload bytes of ``rows`` committed rows."""
  return rows * delta_kv_row_bytes


# --------------------------------------------------------------- §0x06


@dataclasses.dataclass(frozen=True)
class AdmissionOutcome:
  """FIFO admission against a ceiling, scored offline (§0x06). Rows.

  admitted: per request, admitted by the online predicate.
  reserved_rows: base + estimated rows of admitted requests.
  realized_rows: base + realized rows of admitted requests (offline).
  over_rows / under_rows: summed signed reservation error of admitted
    requests, split by sign (epsilon > 0 / epsilon < 0).
  hard_breach_rows: max(realized - hard ceiling, 0).
  """

  admitted: tuple
  reserved_rows: int
  realized_rows: int
  over_rows: int
  under_rows: int
  hard_breach_rows: int


def score_admission(base_rows: int, estimated_rows: Sequence[int],
                    realized_rows: Sequence[int], admitted: Sequence[bool],
                    hard_ceiling_rows: int) -> AdmissionOutcome:
  """Offline scoring of a frozen admission plan against hidden truth."""
  errors = [e - r for e, r, a in zip(estimated_rows, realized_rows, admitted) if a]
  realized = base_rows + sum(r for r, a in zip(realized_rows, admitted) if a)
  return AdmissionOutcome(
      admitted=tuple(admitted),
      reserved_rows=base_rows + sum(e for e, a in zip(estimated_rows, admitted) if a),
      realized_rows=realized,
      over_rows=sum(e for e in errors if e > 0),
      under_rows=-sum(e for e in errors if e < 0),
      hard_breach_rows=max(realized - hard_ceiling_rows, 0))


def reservation_intents(ceiling_rows: int, live_rows: int, forecast_rows: int) -> int:
  """A_intent = floor((H - R_live) / r_hat): logical intents, not allocations."""
  return max(ceiling_rows - live_rows, 0) // forecast_rows


# --------------------------------------------------------------- §0x07


@dataclasses.dataclass(frozen=True)
class OutcomePartition:
  """Offered-cohort outcomes; ``closes`` checks N_off = valid+miss+rej+open."""

  offered: int
  valid: int
  missed: int
  rejected: int
  open: int

  @property
  def admitted(self) -> int:
    return self.offered - self.rejected

  @property
  def completed(self) -> int:
    return self.valid + self.missed

  @property
  def closes(self) -> bool:
    return self.offered == self.valid + self.missed + self.rejected + self.open

  @property
  def offered_attainment(self) -> float:
    return self.valid / self.offered

  @property
  def completion_conditioned_attainment(self) -> float:
    """Diagnostic only: rejected and open requests leave this denominator."""
    return self.valid / self.completed


def window_shortfall_rows(demand_rows: int, ticks: int, rows_per_tick: int) -> int:
  """D_W - C_W rows that cannot complete inside the window (>= 0)."""
  return max(demand_rows - ticks * rows_per_tick, 0)


# --------------------------------------------------------------- §0x09


def chunk_starts(prompt_len: int, chunk_size: int) -> List[int]:
  """s_m of equal chunks of ``chunk_size`` (the last may be shorter)."""
  return list(range(0, prompt_len, chunk_size))


def chunk_pairs(chunk_sizes: Sequence[int]) -> List[int]:
  """P_m = c_m * s_m + c_m (c_m + 1) / 2 query-key pairs per chunk."""
  pairs, start = [], 0
  for c in chunk_sizes:
    pairs.append(c * start + c * (c + 1) // 2)
    start += c
  return pairs


def causal_pairs(prompt_len: int) -> int:
  """tri(S) = S (S + 1) / 2."""
  return prompt_len * (prompt_len + 1) // 2


def history_exposure_rows(chunk_sizes: Sequence[int]) -> int:
  """R_hist = sum of chunk start frontiers (a proxy, not HBM bytes)."""
  total, start = 0, 0
  for c in chunk_sizes:
    total += start
    start += c
  return total


def equal_chunks(prompt_len: int, chunk_size: int) -> List[int]:
  """Chunk sizes of ``prompt_len`` cut every ``chunk_size`` rows."""
  return [min(chunk_size, prompt_len - s) for s in chunk_starts(prompt_len, chunk_size)]


def imbalance_ms(service_ms: Sequence[float]) -> float:
  """I = n max t - sum t (ms), an idle-area proxy, not a bubble measurement."""
  return len(service_ms) * max(service_ms) - sum(service_ms)


# --------------------------------------------------------------- §0x0E


def piggyback_rows(decode_rows: int, chunk_size: int, prompt_len: int,
                   token_budget: int, seq_budget: int) -> int:
  """D_piggy = min(D, [B_tok - min(C, S)]_+, [B_seq - 1]_+)."""
  return min(decode_rows, max(token_budget - min(chunk_size, prompt_len), 0),
             max(seq_budget - 1, 0))


def aging_crossover_tick(low_priority: int, high_priority: int, quantum: int) -> int:
  """First tick t with low - floor(t / quantum) <= high (lower runs first)."""
  return max(low_priority - high_priority, 0) * quantum


@dataclasses.dataclass(frozen=True)
class SensitivityControls:
  """The §0x0E shared analytical fixture (defaults are the base case)."""

  prompt_len: int = 16
  chunk_size: int = 4
  decode_rows: int = 4
  token_budget: int = 8
  seq_budget: int = 8
  kv_row_bytes: int = DELTA_KV_ROW_BYTES
  reservation_ceiling_rows: int = 28
  reservation_live_rows: int = 8
  forecast_rows: int = 5
  low_priority: int = 4
  high_priority: int = 0
  aging_quantum: int = 2
  client_events: tuple = (("A", 8), ("B", 4))
  prefix_hit_rows: int = 0
  foreign_ready: bool = True
  hidden_realized_outputs: tuple = ()


def sensitivity_ledgers(controls: SensitivityControls) -> Dict[str, object]:
  """The local ledgers §0x0E derives from one set of controls.

  ``hidden_realized_outputs`` is offline truth: no online ledger reads it.
  """
  c = controls
  # Uncached prompt work starts at the exact prefix hit (U = S - H_hit).
  starts = range(c.prefix_hit_rows, c.prompt_len, c.chunk_size)
  rows = sum(starts)
  return {
      "chunks": len(starts),
      "uncached_rows": c.prompt_len - c.prefix_hit_rows,
      "causal_pairs": causal_pairs(c.prompt_len),
      "history_rows": rows,
      "history_bytes": rows * c.kv_row_bytes,
      "piggyback_room": max(c.token_budget - min(c.chunk_size, c.prompt_len), 0),
      "piggyback_rows": piggyback_rows(c.decode_rows, c.chunk_size,
                                       c.prompt_len, c.token_budget, c.seq_budget),
      "reservation_intents": reservation_intents(
          c.reservation_ceiling_rows, c.reservation_live_rows, c.forecast_rows),
      "aging_crossover_tick": aging_crossover_tick(c.low_priority, c.high_priority,
                                                   c.aging_quantum),
      "client_events": dict(c.client_events),
      "prefill_selectable": bool(c.foreign_ready),
  }
