"""IterationPlan -> PackedIteration: rows in a fixed token-row bucket (§0x04).

Selected intervals are laid out in plan rank order; sequence ``i`` owns the
packed rows ``[cu_q_lens[i], cu_q_lens[i + 1])``. Rows past the plan's
``num_tokens`` are padding: they read token 0 at position 0, write no K/V
(``slot_mapping == -1``) and are never sampled. Packing never changes the
selected intervals.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from scheduler import scan
from scheduler.records import IterationPlan


@flax.struct.dataclass
class PackedIteration:
  """Row routes and attention descriptors of one packed iteration.

  Attributes:
    tokens: i32[T] token ids; positions: i32[T] request-local positions.
    slot_of_row: i32[T] request slot of each row (0 for padding).
    valid_row: bool[T] False for padding rows.
    slot_mapping: i32[T] ``page * page_size + offset`` (-1 for padding).
    seq_slots: i32[S] request slot of each packed sequence.
    valid_seq: bool[S]; num_seqs: i32[].
    cu_q_lens: i32[S + 1] packed row offsets.
    kv_lens: i32[S] committed + current rows per sequence.
    page_table: i32[S, pages_per_seq] pages of each packed sequence.
    last_row: i32[S] packed row whose hidden state samples the next token.
  """

  tokens: jax.Array
  positions: jax.Array
  slot_of_row: jax.Array
  valid_row: jax.Array
  slot_mapping: jax.Array
  seq_slots: jax.Array
  valid_seq: jax.Array
  num_seqs: jax.Array
  cu_q_lens: jax.Array
  kv_lens: jax.Array
  page_table: jax.Array
  last_row: jax.Array


def pack(plan: IterationPlan, token_buffer, page_table, page_size: int, *,
         num_rows: int, num_seqs: int) -> PackedIteration:
  """Packs a validated plan.

  Args:
    plan: the IterationPlan (per-slot arrays of length R).
    token_buffer: i32[R, max_model_len] logical stream of every slot.
    page_table: i32[R, pages_per_seq] from the allocator (after allocation).
    page_size: static rows per page.
    num_rows: static bucket size T (>= plan.num_tokens).
    num_seqs: static sequence capacity S (>= plan.num_seqs).
  """
  num_slots = plan.selected.shape[0]
  order_key = jnp.where(plan.selected, plan.rank, num_slots + jnp.arange(num_slots))
  seq_slots = jnp.argsort(order_key)[:num_seqs].astype(jnp.int32)
  valid_seq = jnp.arange(num_seqs) < plan.num_seqs
  q_len = jnp.where(valid_seq, plan.end[seq_slots] - plan.start[seq_slots], 0)
  cu_q_lens = jnp.concatenate(
      [jnp.zeros((1,), jnp.int32), scan.cumsum_i32(q_len.astype(jnp.int32))])

  rows = jnp.arange(num_rows, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu_q_lens, rows, side="right") - 1, 0, num_seqs - 1)
  valid_row = rows < cu_q_lens[plan.num_seqs]
  slot = jnp.where(valid_row, seq_slots[seq], 0)
  position = jnp.where(valid_row, plan.start[slot] + rows - cu_q_lens[seq], 0)
  tokens = jnp.where(valid_row, token_buffer[slot, position], 0)
  page = page_table[slot, position // page_size]
  slot_mapping = jnp.where(valid_row, page * page_size + position % page_size, -1)
  return PackedIteration(
      tokens=tokens, positions=position, slot_of_row=slot, valid_row=valid_row,
      slot_mapping=slot_mapping, seq_slots=seq_slots, valid_seq=valid_seq,
      num_seqs=plan.num_seqs.astype(jnp.int32), cu_q_lens=cu_q_lens,
      kv_lens=jnp.where(valid_seq, plan.end[seq_slots], 0),
      page_table=page_table[seq_slots],
      last_row=jnp.maximum(cu_q_lens[1:] - 1, 0))
