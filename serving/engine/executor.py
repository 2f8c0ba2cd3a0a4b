"""The model executor: one validated plan -> one IterationResult (§0x04).

``execute`` is a pure function compiled once per token-row bucket. In order:
release the pages of preempted requests, allocate pages for the planned
intervals, pack the rows, run the model (row-wise XLA projections, prompt rows
in the large GEMM class and generated-token rows in 2..32-row tiles, then
segmented paged attention; a bucket above ``ModelRunner.chunk_rows`` as a
``lax.scan`` over chunks), sample one token for every sequence whose
interval emits, apply the stop rules, write emitted tokens into the logical
stream and free the pages of finished requests. It returns facts (``IterationResult``); only
``scheduler.apply.apply`` turns them into the next state.

Logprobs (``StepLogprobs``), for the requests that ask (per-slot flags in
``RequestBuffers``): the emitted token's logprob and the ``MAX_LOGPROBS``
most likely tokens, from the same logits the sampler read, and for prompt
rows the logprob of the next prompt token, from the prefill rows this plan
computes (the LM head runs on those rows too, in tiles; no second forward
pass). Both are ``sampling.raw_logprobs``: the raw model logits'
``log_softmax`` (vLLM's default "raw_logprobs"), before the stop mask,
temperature and top-k/top-p. The output shapes are fixed by the bucket;
nothing is computed when no request in the step asked.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from models import llama
from models import quant
from scheduler import iteration
from scheduler import records as rec
from scheduler import scan
from serving.kv import pages as kv_pages
from serving.engine import speculative
from serving.engine.pack import pack
from serving.engine.sampling import MAX_LOGPROBS, raw_logprobs, sample


@flax.struct.dataclass
class RequestBuffers:
  """Per-slot token stream and sampling parameters (serving-owned).

  Attributes:
    tokens: i32[R, max_model_len] prompt then output tokens; None in
      ``Engine.simulate``'s loop program, whose simulated executor reads
      none (the host records the tokens from its log).
    temperature, top_p: f32[R]; top_k, min_tokens: i32[R].
    seed: u32[R]; ignore_eos: bool[R].
    stop_ids: i32[R, max_stop_ids] (-1 padded).
    logprobs: bool[R] the request wants its emitted tokens' logprobs.
    prompt_logprobs: bool[R] the request wants its prompt tokens' logprobs.
  """

  tokens: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  seed: jax.Array
  min_tokens: jax.Array
  ignore_eos: jax.Array
  stop_ids: jax.Array
  logprobs: jax.Array
  prompt_logprobs: jax.Array


def init_buffers(num_slots: int, max_model_len: int, max_stop_ids: int) -> RequestBuffers:
  return RequestBuffers(
      tokens=jnp.zeros((num_slots, max_model_len), jnp.int32),
      temperature=jnp.zeros((num_slots,), jnp.float32),
      top_k=jnp.zeros((num_slots,), jnp.int32),
      top_p=jnp.ones((num_slots,), jnp.float32),
      seed=jnp.zeros((num_slots,), jnp.uint32),
      min_tokens=jnp.zeros((num_slots,), jnp.int32),
      ignore_eos=jnp.zeros((num_slots,), bool),
      stop_ids=jnp.full((num_slots, max_stop_ids), -1, jnp.int32),
      logprobs=jnp.zeros((num_slots,), bool),
      prompt_logprobs=jnp.zeros((num_slots,), bool))


@flax.struct.dataclass
class StepLogprobs:
  """Raw logprobs one executed plan computed (``sampling.raw_logprobs``;
  K = ``MAX_LOGPROBS``, or the vocabulary when smaller).

  Attributes:
    token: f32[R] per slot: the logprob of the token it emitted (0 where the
      slot emitted nothing or did not ask); f32[R, W] with speculative
      decoding: the token at each of the slot's first W rows.
    top_ids: i32[R, K], top: f32[R, K]: its K most likely tokens, descending
      ([R, W, K] with speculative decoding).
    num_prompt: i32[] prompt rows scored; entries [0, num_prompt) of the
      ``prompt_*`` arrays hold them (the rest is padding).
    prompt_slot, prompt_pos: i32[T] the slot and position of each scored
      row: its logits give the prompt token at ``prompt_pos + 1``.
    prompt_token: f32[T] that token's logprob.
    prompt_top_ids: i32[T, K], prompt_top: f32[T, K]: the row's K most
      likely tokens, descending.
  """

  token: jax.Array
  top_ids: jax.Array
  top: jax.Array
  num_prompt: jax.Array
  prompt_slot: jax.Array
  prompt_pos: jax.Array
  prompt_token: jax.Array
  prompt_top_ids: jax.Array
  prompt_top: jax.Array


def _mask_stops(logits, seq_slots, buffers, output_index, eos_ids):
  """Suppresses EOS and stop ids in rows drawing an output below
  min_tokens (``output_index`` i32[S]: the output each row draws)."""
  early = output_index < buffers.min_tokens[seq_slots]                # [S]

  def mask(logits):
    vocab = jnp.arange(logits.shape[-1])
    stop_ids = buffers.stop_ids[seq_slots]                              # [S, K]
    stop = jnp.any(vocab[None, None, :] == stop_ids[:, :, None], axis=1)
    stop = stop | jnp.isin(vocab, jnp.asarray(eos_ids))[None, :]
    return jnp.where(early[:, None] & stop, -jnp.inf, logits)

  return jax.lax.cond(jnp.any(early), mask, lambda x: x, logits)


@dataclasses.dataclass(frozen=True)
class ModelRunner:
  """Static, hashable binding of a model config to the executor."""

  cfg: object
  attention_impl: str = "auto"
  mesh: object = None    # a Mesh splitting attention (``models.sharding.attention_mesh``)
  chunk_rows: int = 0    # scan a bucket of more rows in chunks of this many (0: never)
  decode_gemm: str = "xla"   # generated rows' float32 GEMM (``llama.forward``)
  draft_cfg: object = None   # the draft model's config (speculative "draft"), or None

  @property
  def eos_token_ids(self):
    return tuple(self.cfg.eos_token_ids)

  @property
  def draft(self) -> "ModelRunner | None":
    """The draft model's runner (its config, the same kernels), or None."""
    if self.draft_cfg is None:
      return None
    return dataclasses.replace(self, cfg=self.draft_cfg, draft_cfg=None)

  def forward(self, params, kv, packed, prompt_len):
    """``llama.forward`` over a packed iteration; ``prompt_len`` i32[R] (per
    slot) marks the prompt rows, whose GEMMs run in the large bit class."""
    prompt_rows = packed.positions < prompt_len[packed.slot_of_row]
    return llama.forward(params, self.cfg, kv, packed.tokens, packed.positions,
                         packed.slot_mapping, packed.kv_lens, packed.page_table,
                         packed.cu_q_lens, packed.num_seqs,
                         attention_impl=self.attention_impl, mesh=self.mesh,
                         prompt_rows=prompt_rows, chunk_rows=self.chunk_rows or None,
                         decode_gemm=self.decode_gemm)

  def compute_logits(self, params, hidden, num_live=None):
    return llama.compute_logits(params, self.cfg, hidden, num_live,
                                decode_gemm=self.decode_gemm)


def _prompt_logprobs(model: ModelRunner, params, hidden, want, target, *, k: int,
                     tile: int = 32):
  """Raw logprobs of the next prompt token at the rows in ``want``.

  The wanted rows are moved to the front (stable order) and the LM head,
  ``log_softmax`` and top-k run on them ``tile`` rows at a time in a
  ``fori_loop`` of ``ceil(count / tile)`` trips (no [T, V] logits are ever
  held; a tile's GEMM has ``tile`` rows, inside the 2..32-row bit class of
  ``llama.row_tiled``, so a row's values do not depend on its neighbours).

  Args:
    hidden: f32[T, d_model] the plan's final hidden rows.
    want: bool[T] rows to score; target: i32[T] each row's next token.
    k: static alternatives per row.

  Returns:
    (order i32[T] rows in output order, count i32[], chosen f32[T],
    top_ids i32[T, k], top f32[T, k]); entries from ``count`` on are padding.
  """
  num_rows = hidden.shape[0]
  tile = min(tile, num_rows)
  num_tiles = -(-num_rows // tile)
  order = jnp.argsort(~want, stable=True).astype(jnp.int32)
  count = jnp.sum(want).astype(jnp.int32)
  padded = jnp.pad(order, (0, num_tiles * tile - num_rows))

  def one_tile(i, out):
    chosen, top_ids, top = out
    rows = jax.lax.dynamic_slice(padded, (i * tile,), (tile,))
    logits = model.compute_logits(params, hidden[rows])
    c, ids, t = raw_logprobs(logits, target[rows], k=k)
    start = i * tile
    return (jax.lax.dynamic_update_slice(chosen, c, (start,)),
            jax.lax.dynamic_update_slice(top_ids, ids, (start, 0)),
            jax.lax.dynamic_update_slice(top, t, (start, 0)))

  size = num_tiles * tile
  out = (jnp.zeros((size,), jnp.float32), jnp.zeros((size, k), jnp.int32),
         jnp.zeros((size, k), jnp.float32))
  trips = (count + tile - 1) // tile
  # The loop under a cond: with one tile (buckets of <= ``tile`` rows) XLA:CPU
  # otherwise runs the loop body's LM head, log_softmax and top-k (a full
  # two-array sort of [tile, V]) in every step, wanted or not.
  chosen, top_ids, top = jax.lax.cond(
      count > 0, lambda: jax.lax.fori_loop(0, trips, one_tile, out), lambda: out)
  return order, count, chosen[:num_rows], top_ids[:num_rows], top[:num_rows]


def step_logprobs(model: ModelRunner, params, hidden, logits, token, packed, buffers,
                  prompt_len, num_slots: int, width: int = 1) -> StepLogprobs:
  """The ``StepLogprobs`` of one executed plan.

  Args:
    hidden: f32[T, d_model] final hidden rows; logits: f32[N W, V] the raw
      logits of the N sampled sequences' last W rows (the sampler's input
      before its stop mask); token: i32[N W] the tokens sampled from them.
    packed: the ``PackedIteration``; buffers: ``RequestBuffers`` (flags and
      token stream); prompt_len: i32[R] per slot.
    width: static W, 1 + the most drafts a row verifies (1 without
      speculation). With W > 1 the per-slot arrays gain an axis W after R:
      the logprobs of the tokens at a slot's first W rows.
  """
  vocab = logits.shape[-1]
  k = min(MAX_LOGPROBS, vocab)
  sampled = logits.shape[0]
  slots = jnp.repeat(packed.seq_slots[:sampled // width], width)
  want = buffers.logprobs[slots] & jnp.repeat(packed.valid_seq[:sampled // width], width)
  none = (jnp.zeros((sampled,), jnp.float32), jnp.zeros((sampled, k), jnp.int32),
          jnp.zeros((sampled, k), jnp.float32))
  chosen, top_ids, top = jax.lax.cond(
      jnp.any(want), lambda: raw_logprobs(logits, token, k=k), lambda: none)
  index = jnp.where(want, slots, num_slots)            # others -> dropped
  col = jnp.tile(jnp.arange(width), sampled // width)

  def per_slot(x):
    out = jnp.zeros((num_slots, width) + x.shape[1:], x.dtype).at[index, col].set(
        x, mode="drop")
    return out[:, 0] if width == 1 else out

  # Prompt rows: position j's logits give the prompt token at j + 1.
  slot, pos = packed.slot_of_row, packed.positions
  rows_want = (packed.valid_row & buffers.prompt_logprobs[slot]
               & (pos + 1 < prompt_len[slot]))
  target = buffers.tokens[slot, jnp.minimum(pos + 1, buffers.tokens.shape[1] - 1)]
  order, count, p_chosen, p_ids, p_top = _prompt_logprobs(model, params, hidden, rows_want,
                                                          target, k=k)
  return StepLogprobs(token=per_slot(chosen), top_ids=per_slot(top_ids), top=per_slot(top),
                      num_prompt=count, prompt_slot=slot[order], prompt_pos=pos[order],
                      prompt_token=p_chosen, prompt_top_ids=p_ids, prompt_top=p_top)


def draft_propose(draft: ModelRunner, params, kv, packed, num_draft, known, prompt_len, *,
                  k: int, num_rows: int, num_seqs: int):
  """A draft model's greedy proposals, its KV cache kept in step with the
  target's (speculative method "draft"; Leviathan et al. 2023, Chen et al.
  2023).

  The draft runs once over the step's packed rows (prefill chunks, decode
  rows, verify rows: it computes the K/V of every row the target computes;
  a verify row's token is a placeholder here, its K/V rewritten below), and
  row ``last - k_s`` of a sequence with ``k_s`` drafts gives draft 1. Then
  ``m = max k_s`` passes of one row per drafting sequence: pass j runs
  draft j at position ``known - 1 + j``, writes its K/V and gives draft
  j + 1 (the m-th pass only writes; a row past its own drafts writes
  nothing). So after the step the draft's cache holds every position the
  target's does, whichever drafts are accepted. The draft's K/V sit in the
  target's pages (``kv.draft``, the same page table).

  Args:
    draft: static runner of the draft model; params: its parameters.
    kv: the ``KVCache`` with ``kv.draft`` set.
    packed: the step's ``PackedIteration``; num_draft: i32[R] drafts per
      slot; known: i32[R] tokens known per slot (p + e); prompt_len: i32[R].
    k: static, the most drafts a row carries; num_rows, num_seqs: static
      bucket T and sequence capacity S.

  Returns ``(kv, drafts)``: ``drafts`` i32[R, k] per slot (rows past a
  slot's ``num_draft`` are unspecified).
  """
  hidden, dkv = draft.forward(params, kv.draft, packed, prompt_len)
  n = min(num_rows, num_seqs)
  seq_slots = packed.seq_slots[:n]
  seq_k = jnp.where(packed.valid_seq[:n], num_draft[seq_slots], 0)
  ps = kv.k.shape[2]
  num_slots = num_draft.shape[0]

  def propose(dkv):
    x_row = jnp.clip(packed.last_row[:n] - seq_k, 0, num_rows - 1)
    logits = draft.compute_logits(params, hidden[x_row], packed.num_seqs)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)                 # [n]
    # Drafting sequences first, in order: pass j's rows and sequences.
    order = jnp.argsort(seq_k == 0, stable=True).astype(jnp.int32)
    live = jnp.sum(seq_k > 0).astype(jnp.int32)
    i = jnp.arange(n, dtype=jnp.int32)
    table = packed.page_table[:n][order]
    base = (known[seq_slots] - 1)[order]
    cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                 scan.cumsum_i32(i < live)])
    most = jnp.max(seq_k)

    def one_pass(j, carry):
      dkv, tok, drafts = carry
      drafts = jax.lax.dynamic_update_slice(drafts, tok[:, None], (0, j - 1))
      valid = (i < live) & (j <= seq_k[order])
      pos = jnp.where(valid, base + j, 0)
      page = table[i, jnp.clip(pos // ps, 0, table.shape[1] - 1)]
      slot_mapping = jnp.where(valid, page * ps + pos % ps, -1)
      kv_lens = jnp.where(i < live, jnp.where(valid, pos + 1, 1), 0)
      h, dkv = llama.forward(params, draft.cfg, dkv, tok[order], pos, slot_mapping, kv_lens,
                             table, cu_q_lens, live, attention_impl=draft.attention_impl,
                             decode_gemm=draft.decode_gemm)
      # The last forward only writes draft ``most``'s K/V: no logits.
      nxt = jax.lax.cond(
          j < most, lambda: jnp.argmax(draft.compute_logits(params, h, live),
                                       axis=-1).astype(jnp.int32), lambda: jnp.zeros_like(tok))
      return dkv, tok.at[order].set(nxt), drafts

    dkv, _, drafts = jax.lax.fori_loop(1, most + 1, one_pass,
                                       (dkv, tok, jnp.zeros((n, k), jnp.int32)))
    return dkv, drafts                                                    # [n, k]

  dkv, drafts = jax.lax.cond(jnp.any(seq_k > 0), propose,
                             lambda d: (d, jnp.zeros((n, k), jnp.int32)), dkv)
  index = jnp.where(packed.valid_seq[:n], seq_slots, num_slots)
  per_slot = jnp.zeros((num_slots, k), jnp.int32).at[index].set(drafts, mode="drop")
  return kv.replace(draft=dkv), per_slot


def execute(params, kv, pages: kv_pages.PageState, buffers: RequestBuffers,
            manifest: rec.WorkloadManifest, state: rec.SchedulerState,
            plan: rec.IterationPlan, *, model, num_rows: int, num_seqs: int,
            max_model_len: int, speculation=None):
  """Runs one plan. Returns ``(kv, pages, buffers, result, logprobs)``
  (``StepLogprobs``).

  Args:
    model: static ``ModelRunner`` (forward / compute_logits / eos ids).
    num_rows: static token-row bucket T; num_seqs: static S.
    speculation: static ``speculative.Speculation`` or None. With it, a
      decode row carrying ``plan.num_draft`` drafts has them proposed into
      the stream before packing, the target's token drawn at each of its
      rows, and the leading drafts equal to them accepted
      (``speculative``); the result then carries ``accepted`` and
      ``tokens``, and pages only rejected rows reached are given back.

  The LM head runs on the last row of each of the ``min(S, num_rows)``
  sequences that can hold a row (every selected sequence holds at least
  one), in ``llama.row_tiled`` GEMMs over the live ones only: no logits row
  is computed, zero-filled or copied for a sequence that cannot exist.
  With speculation it runs on each sequence's last ``1 + K`` rows.
  The result's ``emit_ms`` is 0: the host stamps the publication time.
  """
  width = 1 if speculation is None else 1 + speculation.k
  k = rec.num_draft(plan)
  known = manifest.prompt_len + state.emitted
  draft_params = params.get("draft")
  params = {name: p for name, p in params.items() if name != "draft"}
  if speculation is not None and speculation.method == "ngram":   # only when a row drafts
    propose = lambda stream: speculative.write_drafts(stream, known, k, speculative.ngram_drafts(
        stream, known, k=speculation.k, n=speculation.n))
    buffers = buffers.replace(tokens=jax.lax.cond(jnp.any(k > 0), propose, lambda s: s,
                                                  buffers.tokens))
  pages = allocate_for_plan(pages, plan)
  packed = pack(plan, buffers.tokens, pages.page_table, pages.page_size,
                num_rows=num_rows, num_seqs=num_seqs)
  if model.draft is not None:
    kv, drafts = draft_propose(model.draft, draft_params, kv, packed, k, known,
                               manifest.prompt_len, k=speculation.k, num_rows=num_rows,
                               num_seqs=num_seqs)
    buffers = buffers.replace(tokens=speculative.write_drafts(buffers.tokens, known, k, drafts))
    # The verify rows read their drafts: draft j + 1 sits at position known + j.
    slot, pos = packed.slot_of_row, packed.positions
    ahead = pos - known[slot]
    take = packed.valid_row & (ahead >= 0) & (ahead < k[slot])
    packed = packed.replace(tokens=jnp.where(
        take, drafts[slot, jnp.clip(ahead, 0, speculation.k - 1)], packed.tokens))

  hidden, kv = model.forward(params, kv, packed, manifest.prompt_len)
  # Sequences at or beyond sampled_rows hold no row (they are padding), so
  # the head, the stop mask, sampling and the finiteness check run on those
  # rows only (each row's token is its own) and their results are padded to S.
  sampled_rows = min(num_rows, num_seqs)
  seq_slots = packed.seq_slots[:sampled_rows]
  j = jnp.arange(width, dtype=jnp.int32)
  # Row j of a sequence with k drafts: its packed row last - k + j (j <= k).
  seq_k = k[seq_slots]
  last = packed.last_row[:sampled_rows]
  rows = jnp.clip(last[:, None] - seq_k[:, None] + jnp.minimum(j[None, :], seq_k[:, None]),
                  0, num_rows - 1).reshape(-1)                      # [N W]
  logits = model.compute_logits(params, hidden[rows], packed.num_seqs * width)  # [N W, V]
  slots = jnp.repeat(seq_slots, width)
  index = (state.emitted[slots] + jnp.tile(j, sampled_rows)).astype(jnp.int32)
  raw = logits
  logits = _mask_stops(logits, slots, buffers, index, model.eos_token_ids)
  token = sample(logits, buffers.temperature[slots], buffers.top_k[slots],
                 buffers.top_p[slots], buffers.seed[slots], index)
  logprobs = step_logprobs(model, params, hidden, raw, token, packed, buffers,
                           manifest.prompt_len, plan.selected.shape[0], width)
  finite = jnp.all(jnp.isfinite(logits) | (logits == -jnp.inf), axis=-1) & jnp.any(
      jnp.isfinite(logits), axis=-1)
  token = token.reshape(sampled_rows, width)
  finite = jnp.all(finite.reshape(sampled_rows, width)
                   | (j[None, :] > seq_k[:, None]), axis=1)
  pad = (0, num_seqs - sampled_rows)
  token = jnp.pad(token, (pad, (0, 0)), constant_values=-1)           # [S, W]
  finite = jnp.pad(finite, pad, constant_values=True)
  slots = packed.seq_slots

  num_slots = plan.selected.shape[0]
  per_slot = lambda x, fill: jnp.full((num_slots,) + x.shape[1:], fill, x.dtype).at[
      jnp.where(packed.valid_seq, slots, num_slots)].set(x, mode="drop")
  slot_token = per_slot(token, -1)                                    # [R, W]
  slot_finite = per_slot(finite, True)

  is_eos = jnp.isin(slot_token, jnp.asarray(model.eos_token_ids)) & ~buffers.ignore_eos[:, None]
  verified = None
  if speculation is None:
    slot_token, is_eos = slot_token[:, 0], is_eos[:, 0]
  else:
    # Draft j + 1 sits at stream position known + j (``write_drafts``).
    col = jnp.minimum(known[:, None] + jnp.arange(speculation.k)[None, :], max_model_len - 1)
    proposed = jnp.take_along_axis(buffers.tokens, col, axis=1)      # [R, K]
    verified = speculative.num_verified(proposed, slot_token, k)
  pages, buffers, result = take_tokens(pages, buffers, manifest, state, plan, slot_token,
                                       slot_finite, is_eos, max_model_len=max_model_len,
                                       verified=verified)
  return kv, pages, buffers, result, logprobs


def allocate_for_plan(pages: kv_pages.PageState, plan: rec.IterationPlan
                      ) -> kv_pages.PageState:
  """Releases the plan's preempted slots' pages, then grows every selected
  slot's pages to hold ``plan.end`` rows (the one allocation rule of every
  executor)."""
  pages = kv_pages.deallocate(pages, plan.preempt)
  rows_needed = jnp.where(plan.selected, plan.end, 0)
  ps = pages.page_size
  max_new = -(-(plan.token_budget + ps) // ps)
  # A slot holds the pages of its computed rows, so its new rows [start,
  # end) need at most ceil((end - start) / ps) pages; a valid plan (the
  # only kind that runs) has at most token_budget rows in seq_budget slots.
  max_total = plan.token_budget // ps + plan.seq_budget + 1
  return kv_pages.allocate(pages, rows_needed, max_new_per_slot=max_new,
                           max_new_total=max_total)


def take_tokens(pages: kv_pages.PageState, buffers: RequestBuffers,
                manifest: rec.WorkloadManifest, state: rec.SchedulerState,
                plan: rec.IterationPlan, slot_token, slot_finite, is_eos, *,
                max_model_len: int, verified=None):
  """Takes the tokens one executed plan sampled: its IterationResult by the
  stop rules (``scheduler.iteration.stop_rules``, the one definition), the
  emitted tokens written into the stream, ended slots' pages released.
  Every executor ends its step here.

  Args:
    slot_token: i32[R] the token each slot sampled (-1 where none), or
      i32[R, W] with ``verified``: the tokens at a slot's first W rows.
    slot_finite: bool[R] its logits were finite (False: the slot fails).
    is_eos: bool[R] (bool[R, W]) the token ends the request as EOS (the
      caller applies ``ignore_eos``; the simulated executor: the recorded
      length reached).
    verified: i32[R] leading drafts equal to the target's tokens
      (speculative decoding), or None.
  Returns ``(pages, buffers, result)``: the emitted tokens written after
  the slot's prompt and outputs, pages only rejected draft rows reached
  given back, finished and failed slots' pages released.
  """
  result = iteration.stop_rules(manifest, state, plan, slot_token, is_eos=is_eos,
                                stop_ids=buffers.stop_ids, finite=slot_finite,
                                max_model_len=max_model_len, verified=verified)
  emitted = result.emitted
  num_slots = plan.selected.shape[0]
  tokens = result.token[:, None] if result.tokens is None else result.tokens   # [R, W]
  if buffers.tokens is not None:      # None: a stream nothing reads (``sim_loop``)
    j = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    write_col = jnp.where(emitted[:, None] & (tokens >= 0),
                          (manifest.prompt_len + state.emitted)[:, None] + j[None, :],
                          max_model_len)                             # OOB -> drop
    rows = jnp.broadcast_to(jnp.arange(num_slots)[:, None], write_col.shape)
    buffers = buffers.replace(tokens=buffers.tokens.at[rows, write_col].set(tokens,
                                                                            mode="drop"))
  if result.accepted is not None:
    spec = result.completed & (rec.num_draft(plan) > 0)
    every_row = pages.page_table.shape[1] * pages.page_size
    pages = kv_pages.trim(pages, jnp.where(spec, result.completed_end, every_row))
  pages = kv_pages.deallocate(pages, result.finished | result.failed)
  return pages, buffers, result


def prepare_params(model_cfg, params, config, placement, int8_gemm, decode_gemm):
  """The parameters as the executor reads them: quantized to int8 when
  ``config.weights`` says so (``int8_gemm``), placed over the mesh, split
  into per-layer buffers (each block's GEMM reads its layer in place:
  ``llama.split_layers``), with the LM head's panels for the native decode
  GEMM. With a draft model (``Speculation.draft``) its parameters, prepared
  the same way, are under ``"draft"`` (given there, or read from the
  model). The simulated executor runs no model: its parameters are ``{}``.

  Raises:
    ValueError: ``params`` None with the model executor.
  """
  if config.executor == "simulated":   # the weights are neither needed nor kept
    return {}
  if params is None:
    raise ValueError("Engine needs model parameters unless EngineConfig.executor is "
                     "'simulated'")
  spec = config.speculation
  draft = None
  if spec is not None and spec.method == "draft":
    # The draft's weights: given as params["draft"], or read from its model.
    draft = params.get("draft") if isinstance(params, dict) else None
    params = {name: p for name, p in params.items() if name != "draft"}
    draft_cfg = speculative.draft_config(spec.draft)
    speculative.check_draft(model_cfg, draft_cfg)
    if draft is None:
      from models import loaders
      dtype = jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32
      _, draft, _ = loaders.load_model(spec.draft, dtype=dtype)
  params = _prepared(model_cfg, params, config, placement, int8_gemm, decode_gemm)
  if draft is not None:
    params["draft"] = _prepared(draft_cfg, draft, config, None, int8_gemm, decode_gemm)
  return params


def _prepared(cfg, params, config, placement, int8_gemm, decode_gemm):
  """One model's parameters as ``prepare_params`` gives them (``placement``
  None: the default device)."""
  if config.weights == "int8":
    params = quant.quantize_params(params, cfg.tie_embeddings, gemm=int8_gemm)
  params = (jax.device_put(params, jax.local_devices()[0]) if placement is None
            else placement.params(params))
  params = llama.split_layers(params)
  if decode_gemm == "native":
    params = llama.with_head_panels(params, cfg)
  return dict(params)
