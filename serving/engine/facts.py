"""The typed records the engine's device programs exchange with the host:
an arrival as the ``arrive`` program writes it into a slot (``Arrival``),
and the small facts the ``plan`` and ``step`` programs return for the host
to fetch and act on (``PlanFacts``, ``StepFacts``)."""

from __future__ import annotations

from typing import Optional

import flax
import jax
import numpy as np


@flax.struct.dataclass
class Arrival:
  """One request's declaration as the ``arrive`` program writes it into a
  slot: the manifest fields (``scheduler.apply.arrive``) and the executor's
  per-slot sampling buffers (``serving.engine.executor.RequestBuffers``).

  Attributes:
    request_id, arrival_seq: i32[], engine uid (both; arrival order = uid).
    arrival_ms: f32[], original arrival on the engine clock (ms).
    prompt_len, max_tokens, priority, client: i32[].
    ttft_ms, tbt_ms: f32[], declared SLO limits (ms; +inf = none).
    temperature, top_p: f32[]; top_k, min_tokens: i32[]; seed: u32[];
    ignore_eos: bool[] (``SamplingParams``).
    prompt: i32[max_model_len], prompt tokens, zero-padded.
    stop_ids: i32[max_stop_ids], stop token ids, -1-padded (unused entries).
    logprobs, prompt_logprobs: bool[], the request's logprob flags.
    received: i32[], KV rows handed over with the request (a decode
      engine's ``Engine.add_handoff``: its prompt length, its first token
      then at ``prompt[prompt_len]``), 0 for a request that starts anew.
  """

  request_id: np.ndarray
  arrival_seq: np.ndarray
  arrival_ms: np.ndarray
  prompt_len: np.ndarray
  max_tokens: np.ndarray
  priority: np.ndarray
  client: np.ndarray
  ttft_ms: np.ndarray
  tbt_ms: np.ndarray
  temperature: np.ndarray
  top_k: np.ndarray
  top_p: np.ndarray
  seed: np.ndarray
  min_tokens: np.ndarray
  ignore_eos: np.ndarray
  prompt: np.ndarray
  stop_ids: np.ndarray
  logprobs: np.ndarray
  prompt_logprobs: np.ndarray
  received: np.ndarray

  @classmethod
  def empty(cls, max_model_len: int, max_stop_ids: int) -> "Arrival":
    """An arrival of nothing (host arrays, the dtypes above): the padding
    of a batch or queue of arrivals."""
    i32, f32, no = np.int32(0), np.float32(0), np.bool_(False)
    return cls(request_id=i32, arrival_seq=i32, arrival_ms=f32, prompt_len=i32,
               max_tokens=i32, priority=i32, client=i32, ttft_ms=f32, tbt_ms=f32,
               temperature=f32, top_k=i32, top_p=f32, seed=np.uint32(0), min_tokens=i32,
               ignore_eos=no, prompt=np.zeros(max_model_len, np.int32),
               stop_ids=np.full(max_stop_ids, -1, np.int32), logprobs=no, prompt_logprobs=no,
               received=i32)


@flax.struct.dataclass
class PlanFacts:
  """The small record the ``plan`` program returns for the host to act on
  (``programs.plan_step``); per-slot arrays are over the R slots.

  Attributes:
    bad_plan: bool[], a plan rule was violated: the host raises
      ``validate.validate_plan``.
    never: bool[R], live slots the policy can never schedule (rejected).
    admit, preempt: bool[R], the plan's queue intents (a swapped request
      admitted is written back; a preemption is settled, §0x0C).
    num_tokens, num_seqs: i32[], the plan's token rows and sequences.
    prompt_rows: bool[], the plan runs prompt or rebuild rows (with prefix
      caching, the step then registers pages: no plan is made ahead,
      ``serving.engine.plan_ahead``).
    rows_bound: i32[], the most rows any valid plan on this state could
      schedule (``_rows_bound``): the host runs the plan in this bound's
      token bucket (see ``Engine._execute``).
    evict: i32[], cached pages to evict before the plan runs: the pages it
      allocates beyond those free once its preemptions released theirs (0
      without prefix caching).
  """

  bad_plan: jax.Array
  never: jax.Array
  admit: jax.Array
  preempt: jax.Array
  num_tokens: jax.Array
  num_seqs: jax.Array
  prompt_rows: jax.Array
  rows_bound: jax.Array
  evict: jax.Array


@flax.struct.dataclass
class StepFacts:
  """The small record the ``step`` program returns for the host to fetch
  (``programs.execute_step``); per-slot arrays are over the R slots.

  Attributes:
    pages_low: bool[], free KV pages are short (``_pages_low``): with prefix
      caching the next iteration first checks for waiting hits to unpin.
    bad_result: bool[], a result rule was violated: the host raises
      ``validate.validate_result``.
    emitted, token, finished, finish_reason, failed: per slot (i32/bool[R]),
      the result's emissions and endings, drained into ``RequestOutput``s.
    num_tokens, decodes: i32[], the plan's token rows and decode rows (a
      decode row's drafts included).
    features: f32[7 + 3 W], ``cost_model.plan_stats`` of the plan.
    prefix: with prefix caching, (computed i32[R], pages_held i32[R],
      page_table i32[R, P], marked bool[]) for registering computed prompt
      pages (``_registrable``); else None.
    handoff: on a prefill engine (``EngineConfig.role``), the page table
      i32[R, P] once the plan's pages were allocated, before the step
      released ended slots: where a request that ended "handoff" left its
      pages (``serving.engine.handoffs``); else None.
    spec: with speculative decoding, (num_draft i32[R], accepted i32[R],
      tokens i32[R, 1 + K]): each slot's drafts verified and accepted, and
      the tokens it emitted in order (-1 past them); else None.
  """

  pages_low: jax.Array
  bad_result: jax.Array
  emitted: jax.Array
  token: jax.Array
  finished: jax.Array
  finish_reason: jax.Array
  failed: jax.Array
  num_tokens: jax.Array
  decodes: jax.Array
  features: jax.Array
  prefix: Optional[tuple] = None
  handoff: Optional[jax.Array] = None
  spec: Optional[tuple] = None
