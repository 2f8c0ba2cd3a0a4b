"""The engine's host-side records of requests: a request as the host
tracks it (``Request``), what one ``Engine.step`` reports for it
(``RequestOutput``, ``TokenLogprobs``, ``PromptLogprobs``), and
``QueueFull``. The records the device programs exchange with the host are
in ``serving.engine.facts``."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

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
  cache_salt: str = ""             # ``add_request``'s prefix-cache salt
  # KV rows handed over with the request (a decode engine's
  # ``Engine.add_handoff``: the prompt length); 0 for one that starts anew.
  received_tokens: int = 0

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
