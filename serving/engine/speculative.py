"""Speculative decoding's engine half: the setting, the n-gram proposer and
the verification of draft tokens (Leviathan et al. 2023, "Fast Inference
from Transformers via Speculative Decoding"; vLLM's ``ngram`` proposer).

How many drafts a request verifies is the policy's decision
(``IterationPlan.num_draft``, ``scheduler.policy_speculative``); the
executor proposes them (``write_drafts``), runs the verify rows in the one
ragged step beside prefill chunks and decode rows, and keeps the leading
drafts equal to the target's own tokens (``num_verified``).

The drafts here are deterministic (the n-gram proposer's continuation), so
the draft distribution q is one-hot. Then the rejection rule of Leviathan
et al. (accept draft d with probability min(1, p(d) / q(d)) = p(d), else
draw from the residual, p without d, renormalized) is exactly: draw the
target's token t from p with the request's seed at that output index, and
accept d iff t == d (t is then the token that follows). That draw is the
one a step without speculation makes for the same output index, from the
same logits, so a request's tokens are the same with and without
speculation, greedy or seeded (``sampling.sample`` keys each draw by the
request's seed and output index only).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

METHODS = ("ngram", "draft")
# The longest n-gram the proposer matches: its program unrolls a compare
# per length and position, O(n^2) (vLLM's prompt lookup defaults to 5).
MAX_NGRAM = 16


@dataclasses.dataclass(frozen=True)
class Speculation:
  """A speculative-decoding setting (``EngineConfig.speculative``).

  Attributes:
    method: "ngram": prompt lookup, no draft model (vLLM's ``ngram``);
      "draft": a smaller model of the target's vocabulary proposes greedily
      (``draft_forward``).
    k: the most draft tokens one decode row verifies (>= 1).
    n: the longest n-gram matched (in [1, MAX_NGRAM]); the proposer tries
      n, n - 1, ..., 1 and takes the longest suffix that occurred before
      (0 with method "draft").
    draft: the draft model (a preset name, an HF directory or a GGUF file,
      as ``models.loaders.load_model`` takes) with method "draft"; "" else.
    adaptive: 0: every decode row is offered k drafts
      (``scheduler.policy_speculative.FixedDraft``); 1: each iteration
      picks one k' in [0, k] for its decode rows by expected goodput
      (``AdaptiveDraft``), with the step time ``fixed_ms + row_ms * rows``.
    fixed_ms, row_ms: that step-time model's coefficients (ms per step,
      ms per token row); needed with adaptive=1, 0 otherwise.
    per_row: with adaptive=1, 1: each decode row gets its own k' at its
      request's learned rate (``AdaptiveDraft.per_row``); 0: one k' per
      iteration.
  """

  method: str = "ngram"
  k: int = 4
  n: int = 3
  adaptive: int = 0
  fixed_ms: float = 0.0
  row_ms: float = 0.0
  draft: str = ""
  per_row: int = 0

  @classmethod
  def parse(cls, text: str, field: str = "EngineConfig.speculative") -> "Speculation | None":
    """``"ngram:k=4,n=3"`` -> ``Speculation``; ``""`` -> None (off).
    ``"draft:PATH,k=4"``: the model at PATH drafts (no ``n``).
    ``"...,adaptive=1,fixed_ms=F,row_ms=R"`` sets k per iteration
    (``,per_row=1``: per decode row).

    Raises:
      ValueError: naming ``field`` and the rule broken (unknown method or
        option or one given twice, "draft" without a model or with n, k not
        an int >= 1, n not in [1, MAX_NGRAM], adaptive not 0 or 1, fixed_ms
        not a number > 0 or row_ms not a number >= 0 with adaptive=1, either
        given without it).
    """
    if not text:
      return None
    method, _, opts = text.partition(":")
    if method not in METHODS:
      raise ValueError(f"{field} must be ngram[:k=K,n=N] or draft:MODEL[,k=K], "
                       f"got {text!r}")
    draft = ""
    if method == "draft":
      draft, _, opts = opts.partition(",")
      if not draft or "=" in draft:
        raise ValueError(f"{field} draft needs its model first (draft:MODEL[,k=K], MODEL a "
                         f"preset, HF directory or GGUF file), got {text!r}")
    values = {}
    for item in filter(None, opts.split(",")):
      key, eq, value = item.partition("=")
      if key not in ("k", "n", "adaptive", "fixed_ms", "row_ms", "per_row") or not eq:
        raise ValueError(f"{field} options are k=K, n=N, adaptive=0|1, fixed_ms=F, "
                         f"row_ms=F and per_row=0|1 (not {item!r}), got {text!r}")
      if key == "n" and method == "draft":
        raise ValueError(f"{field} n applies to ngram only (a draft model proposes "
                         f"without n-grams), got {text!r}")
      if key in values:
        raise ValueError(f"{field} gives {key} twice, got {text!r}")
      if key == "k":
        if not value.isdigit() or int(value) < 1:
          raise ValueError(f"{field} k must be an int >= 1, got {text!r}")
        values[key] = int(value)
      elif key == "n":
        if not value.isdigit() or not 1 <= int(value) <= MAX_NGRAM:
          raise ValueError(f"{field} n must be an int in [1, {MAX_NGRAM}] (the proposer "
                           f"compares every n-gram length up to n), got {text!r}")
        values[key] = int(value)
      elif key in ("adaptive", "per_row"):
        if value not in ("0", "1"):
          raise ValueError(f"{field} {key} must be 0 or 1, got {text!r}")
        values[key] = int(value)
      else:
        try:
          number = float(value)
        except ValueError:
          number = math.nan
        if not (number > 0 if key == "fixed_ms" else number >= 0) or math.isinf(number):
          rule = "> 0" if key == "fixed_ms" else ">= 0"
          raise ValueError(f"{field} {key} must be a finite number {rule}, got {text!r}")
        values[key] = number
    if method == "draft":
      values.update(n=0, draft=draft)
    spec = cls(method=method, **values)
    timed = "fixed_ms" in values and "row_ms" in values
    if spec.adaptive and not timed:
      raise ValueError(f"{field} adaptive=1 needs fixed_ms=F and row_ms=F (the step time "
                       f"fixed_ms + row_ms * rows it maximizes goodput over), got {text!r}")
    if not spec.adaptive and ("fixed_ms" in values or "row_ms" in values
                              or "per_row" in values):
      raise ValueError(f"{field} fixed_ms, row_ms and per_row apply only with adaptive=1, "
                       f"got {text!r}")
    return spec

  def __str__(self) -> str:
    text = (f"draft:{self.draft},k={self.k}" if self.method == "draft"
            else f"{self.method}:k={self.k},n={self.n}")
    if self.adaptive:
      text += f",adaptive=1,fixed_ms={self.fixed_ms:g},row_ms={self.row_ms:g}"
      text += ",per_row=1" if self.per_row else ""
    return text


@functools.lru_cache(maxsize=8)
def draft_config(model: str):
  """The draft model's ``ModelConfig`` (``models.loaders.load_config``: its
  config file only, no weights).

  Raises:
    ModelLoadError (a ValueError): as ``load_config``.
  """
  from models import loaders     # the loaders import this package's users
  return loaders.load_config(model)[0]


def check_draft(target_cfg, draft_cfg, field: str = "EngineConfig.speculative") -> None:
  """Refuses a draft model the target cannot verify: its vocabulary must be
  the target's (token ids mean the same in both).

  Raises:
    ValueError: naming ``field``, the rule and both sizes.
  """
  if draft_cfg.vocab_size != target_cfg.vocab_size:
    raise ValueError(f"{field}: the draft model's vocabulary ({draft_cfg.vocab_size} "
                     f"tokens, {draft_cfg.name}) must be the target's ({target_cfg.vocab_size}, "
                     f"{target_cfg.name})")


def check_draft_model(target: str, speculative: str, field: str = "--speculative") -> None:
  """Refuses, before any weights load, a draft model (``draft:MODEL``) whose
  config or tokenizer cannot be read, or whose vocabulary or tokenizer is
  not the target's (``target`` a model source as ``load_config`` takes;
  a ``random:`` target is checked by vocabulary size when the engine
  starts). Nothing happens for other settings.

  Raises:
    ValueError: naming ``field`` and the rule.
  """
  spec = Speculation.parse(speculative, field)
  if spec is None or spec.method != "draft":
    return
  from models import loaders
  try:
    draft_cfg, draft_tok = loaders.load_config(spec.draft)
  except ValueError as e:
    raise ValueError(f"{field}: the draft model {spec.draft!r} cannot be read: {e}") from None
  if target.startswith("random:"):
    return
  target_cfg, target_tok = loaders.load_config(target)
  check_draft(target_cfg, draft_cfg, field)
  if draft_tok.backend.get_vocab() != target_tok.backend.get_vocab():
    raise ValueError(f"{field}: the draft model's tokenizer ({spec.draft}) must map tokens "
                     f"to the ids the target's ({target}) does; they differ")


def ngram_drafts(stream, length, *, k: int, n: int):
  """The n-gram proposer: i32[R, k] drafts for each slot.

  For each slot, the longest suffix of its known tokens ``stream[:length]``
  of at most ``n`` tokens that also occurred earlier, at its latest earlier
  occurrence, proposes the tokens that followed it there (clipped at the
  last known token). With no earlier occurrence of even the last token,
  the last token is proposed k times.

  Args:
    stream: i32[R, M] prompt then output tokens; length: i32[R] tokens
      known (prompt + emitted), >= 1 for a slot that speculates.
    k, n: static draft count and longest n-gram.
  """
  num_slots, width = stream.shape
  pos = jnp.arange(width, dtype=jnp.int32)

  def one(row, size):
    follow = jnp.int32(-1)
    for m in range(1, n + 1):     # a longer match found later overrides
      suffix = jax.lax.dynamic_slice(row, (jnp.maximum(size - m, 0),), (m,))
      hit = jnp.ones((width,), bool)
      for t in range(m):
        hit = hit & (jnp.roll(row, -t) == suffix[t])
      # An occurrence ending before the suffix starts and followed by a
      # known token: i + m <= size - 1.
      hit = hit & (pos + m <= size - 1) & (size > m)
      latest = jnp.max(jnp.where(hit, pos, -1))
      follow = jnp.where(latest >= 0, latest + m, follow)
    start = jnp.where(follow >= 0, follow, size - 1)
    at = jnp.minimum(start + jnp.arange(k, dtype=jnp.int32), size - 1)
    return row[jnp.clip(at, 0, width - 1)]

  return jax.vmap(one)(stream, length.astype(jnp.int32))


def write_drafts(stream, length, num_draft, drafts):
  """``stream`` with each slot's first ``num_draft`` drafts written at
  positions ``[length, length + num_draft)``, where the verify row reads
  them (``pack``); positions past the context are dropped.

  Args:
    stream: i32[R, M]; length: i32[R] known tokens (p + e); num_draft:
      i32[R]; drafts: i32[R, K].
  """
  num_slots, k = drafts.shape
  j = jnp.arange(k, dtype=jnp.int32)
  col = jnp.where(j[None, :] < num_draft[:, None], length[:, None] + j[None, :],
                  stream.shape[1])
  rows = jnp.broadcast_to(jnp.arange(num_slots)[:, None], col.shape)
  return stream.at[rows, col].set(drafts, mode="drop")


def num_verified(drafts, target, num_draft):
  """i32[N]: leading drafts equal to the target's tokens.

  Args:
    drafts: i32[N, K] the drafts a row verified; target: i32[N, K + 1] the
      target's tokens at its rows (row j's token follows draft j); num_draft:
      i32[N] drafts the row carried.
  """
  k = drafts.shape[1]
  match = (drafts == target[:, :k]) & (jnp.arange(k)[None, :] < num_draft[:, None])
  return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def emitted_tokens(facts):
  """A step's emitted tokens per slot, from its ``StepFacts`` on the host:
  ``facts.token`` (i32[R], one token each) without speculation, else a list
  over R of each slot's tokens in order."""
  if facts.spec is None:
    return facts.token
  _, accepted, tokens = facts.spec
  return [row[:1 + a].tolist() for row, a in zip(tokens, accepted)]


class SpecCounts:
  """Host counters of the drafts an engine verified (vLLM's metric names:
  ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
  ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``).

  Attributes:
    num_drafts: decode rows that carried drafts.
    num_draft_tokens: draft tokens verified.
    num_accepted_tokens: draft tokens accepted and emitted.
    accepted_per_pos: list[int] of length K: accepted drafts at each draft
      position (position 0 is the first draft after the last emitted token).
  """

  def __init__(self, k: int):
    self.num_drafts = 0
    self.num_draft_tokens = 0
    self.num_accepted_tokens = 0
    self.accepted_per_pos = [0] * k

  def add(self, spec) -> None:
    """Counts one step's ``StepFacts.spec`` (host arrays; None: nothing)."""
    if spec is None:
      return
    for k, a in zip(spec[0], spec[1]):
      if k > 0:
        self.num_drafts += 1
        self.num_draft_tokens += int(k)
        self.num_accepted_tokens += int(a)
        for pos in range(int(a)):
          self.accepted_per_pos[pos] += 1

  def add_counts(self, counts) -> None:
    """Counts the totals of many steps: i32[3 + K] drafting rows, draft
    tokens, accepted tokens, then the accepted drafts per position
    (``sim_loop.SpecLog.counts``)."""
    counts = [int(x) for x in counts]
    self.num_drafts += counts[0]
    self.num_draft_tokens += counts[1]
    self.num_accepted_tokens += counts[2]
    self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, counts[3:])]

  def stats(self) -> dict:
    """The counters and the acceptance rate as a JSON-ready dict."""
    return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.acceptance_rate}

  @property
  def acceptance_rate(self) -> float:
    """Accepted / verified draft tokens (0.0 before any)."""
    return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
