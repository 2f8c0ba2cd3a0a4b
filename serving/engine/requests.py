"""The engine's host-side records: a request as the host tracks it
(``Request``), what one ``Engine.step`` reports for it (``RequestOutput``,
``TokenLogprobs``, ``PromptLogprobs``), the typed facts the ``plan`` and
``step`` programs return (``PlanFacts``, ``StepFacts``), an arrival as the
``arrive`` program writes it (``Arrival``), and ``QueueFull``."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import flax
import jax
import numpy as np

from scheduler import preemption as pre
from serving.engine.config import SamplingParams

class QueueFull(Exception):
  """``add_request`` refused: ``EngineConfig.max_queued_requests`` accepted
  requests are unfinished. Nothing was recorded; the caller may retry once
  requests finish (a server answers HTTP 429)."""

  def __init__(self, request_id: str, limit: int):
    super().__init__(f"request {request_id!r} refused: {limit} accepted requests are "
                     f"unfinished (EngineConfig.max_queued_requests={limit}); retry "
                     f"after some finish")
    self.request_id, self.limit = request_id, limit


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

  @classmethod
  def empty(cls, max_model_len: int, max_stop_ids: int) -> "Arrival":
    """An arrival of nothing (host arrays, the dtypes above): the padding
    of a batch or queue of arrivals."""
    i32, f32, no = np.int32(0), np.float32(0), np.bool_(False)
    return cls(request_id=i32, arrival_seq=i32, arrival_ms=f32, prompt_len=i32,
               max_tokens=i32, priority=i32, client=i32, ttft_ms=f32, tbt_ms=f32,
               temperature=f32, top_k=i32, top_p=f32, seed=np.uint32(0), min_tokens=i32,
               ignore_eos=no, prompt=np.zeros(max_model_len, np.int32),
               stop_ids=np.full(max_stop_ids, -1, np.int32), logprobs=no, prompt_logprobs=no)


@flax.struct.dataclass
class PlanFacts:
  """The small record the ``plan`` program returns for the host to settle
  the iteration's plan by (``_plan_step``); per-slot arrays are over the R
  slots.

  Attributes:
    bad_plan: bool[], a plan rule was violated: the host raises
      ``validate.validate_plan``.
    never: bool[R], live slots the policy can never schedule (rejected).
    admit, preempt: bool[R], the plan's queue intents (a swapped request
      admitted is written back; a preemption is settled, §0x0C).
    num_tokens, num_seqs: i32[], the plan's token rows and sequences.
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
  rows_bound: jax.Array
  evict: jax.Array


@flax.struct.dataclass
class StepFacts:
  """The small record the ``step`` program returns for the host to fetch
  (``_execute_step``); per-slot arrays are over the R slots.

  Attributes:
    pages_low: bool[], free KV pages are short (``_pages_low``): with prefix
      caching the next iteration first checks for waiting hits to unpin.
    bad_result: bool[], a result rule was violated: the host raises
      ``validate.validate_result``.
    emitted, token, finished, finish_reason, failed: per slot (i32/bool[R]),
      the result's emissions and endings, drained into ``RequestOutput``s.
    num_tokens, decodes: i32[], the plan's token rows and decode rows.
    features: f32[4 + 2 W], ``cost_model.plan_stats`` of the plan.
    prefix: with prefix caching, (computed i32[R], pages_held i32[R],
      page_table i32[R, P], marked bool[]) for registering computed prompt
      pages (``_registrable``); else None.
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


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
  """One output token's raw logprobs (float32).

  Attributes:
    logprob: the token's logprob.
    top_ids: i32[K] the K = ``MAX_LOGPROBS`` (or vocabulary) most likely
      tokens, descending (lower id first on ties); top: f32[K] theirs.
  """

  logprob: float
  top_ids: np.ndarray
  top: np.ndarray


@dataclasses.dataclass
class PromptLogprobs:
  """A prompt's raw logprobs, filled as its prefill rows run.

  Attributes:
    token: f32[p] each prompt token's logprob given the tokens before it
      (NaN at position 0: the first token has none).
    top_ids: i32[p, K], top: f32[p, K]: each position's K most likely
      tokens, descending (-1 / NaN at position 0).
  """

  token: np.ndarray
  top_ids: np.ndarray
  top: np.ndarray

  @classmethod
  def empty(cls, prompt_len: int, k: int) -> "PromptLogprobs":
    return cls(np.full(prompt_len, np.nan, np.float32),
               np.full((prompt_len, k), -1, np.int32),
               np.full((prompt_len, k), np.nan, np.float32))


@dataclasses.dataclass
class Request:
  """Host-side record of one request (ids, clocks in ms, SLO limits in ms
  with +inf for none, outputs)."""

  request_id: str
  uid: int
  prompt_token_ids: List[int]
  sampling: SamplingParams
  arrival_ms: float
  priority: int = 0
  client: str = "default"
  output_token_ids: List[int] = dataclasses.field(default_factory=list)
  token_times_ms: List[float] = dataclasses.field(default_factory=list)
  outcome: Optional[str] = None
  finish_reason: str = ""
  slo_ttft_ms: float = float("inf")
  slo_tpot_ms: float = float("inf")
  num_preemptions: int = 0
  num_extensions: int = 0
  recompute_tokens: int = 0
  prefix_hit_tokens: int = 0
  slot: int = -1
  queue_record: Optional[pre.QueueRecord] = dataclasses.field(default=None, repr=False)
  want_logprobs: bool = False      # output tokens' logprobs asked (``add_request``)
  output_logprobs: List[TokenLogprobs] = dataclasses.field(default_factory=list, repr=False)
  # Asked for prompt logprobs: filled as its prefill rows run (else None).
  prompt_logprobs: Optional[PromptLogprobs] = dataclasses.field(default=None, repr=False)

  @property
  def finished(self) -> bool:
    return self.outcome is not None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """One step's news for a request: new tokens and, at the end, the outcome."""

  request_id: str
  new_token_ids: List[int]
  finished: bool
  outcome: Optional[str]
  finish_reason: str
  # Each new token's logprobs, for a request added with ``logprobs``.
  new_logprobs: Optional[List[TokenLogprobs]] = None
