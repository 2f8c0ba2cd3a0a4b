"""OpenAI response and stream-chunk bodies: the fields every response starts
with, choices (a completion's ``text``, a chat ``message`` or chunk
``delta``), usage, and logprobs in the completions and chat shapes.

Logprobs (completions ``logprobs`` k, chat ``logprobs`` + ``top_logprobs``;
k <= ``MAX_LOGPROBS``) are the engine's: the raw model logits'
``log_softmax`` (vLLM's default "raw_logprobs": before temperature,
top-k/top-p and the min_tokens stop mask), float32, computed on the device
from the logits the sampler read (``serving.engine.executor.StepLogprobs``),
one entry per generated token (``completion_tokens``; a stop string's tokens
too), streamed with the chunks; with ``echo`` the prompt's tokens come first
(the first token has none). -inf is written as -9999.0, as vLLM writes it.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

from serving.http.parsing import ParsedRequest


def head(rid: str, model_name: str, chat: bool, chunk: bool) -> dict:
  """The fields every response and chunk starts with; ``object`` is
  "text_completion" (OpenAI's legacy completions, chunks too),
  "chat.completion" or "chat.completion.chunk"."""
  kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
  return {"id": rid, "object": kind, "created": int(time.time()), "model": model_name}


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: Optional[int] = None) -> dict:
  """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` (the
  prompt tokens served from the prefix cache) when given."""
  body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}
  if cached_tokens is not None:
    body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
  return body


def final_usage(parsed: ParsedRequest, ends: Dict[int, dict]) -> dict:
  """Usage of a request that completed: each prompt's tokens once (and,
  as cached, the most any of its copies took from the prefix cache),
  completion tokens summed over every choice."""
  cached = {}
  for i, e in ends.items():
    cached[i // parsed.n] = max(cached.get(i // parsed.n, 0), e["cached_tokens"])
  return usage(parsed.prompt_tokens(), sum(e["completion_tokens"] for e in ends.values()),
               sum(cached.values()))


def _json_logprob(value: float) -> float:
  """A logprob as JSON carries it: float32 -> Python float; -inf (a token
  the model rules out) as -9999.0, as vLLM writes it (JSON has no inf)."""
  return max(float(value), -9999.0)


def _token_text(tokenizer, token_id: int) -> str:
  """A token's own text as logprobs name it (special tokens kept; a piece
  of a UTF-8 character shows as U+FFFD, its ``bytes`` are exact)."""
  return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, entries, k: int, offset: int = 0) -> dict:
  """OpenAI's legacy completion ``logprobs`` for ``entries`` ((token id,
  ``TokenLogprobs`` or None) each; None: the prompt's first token, which
  has none): ``tokens``, ``token_logprobs``, ``top_logprobs`` (the k most
  likely tokens plus the chosen one, so up to k + 1: text -> logprob; of
  tokens with the same text, the likeliest's) and
  ``text_offset`` (each token's start in the text, from ``offset``)."""
  tokens, values, tops, offsets = [], [], [], []
  for token_id, lp in entries:
    text = _token_text(tokenizer, token_id)
    tokens.append(text)
    offsets.append(offset)
    offset += len(text)
    if lp is None:
      values.append(None)
      tops.append(None)
      continue
    values.append(_json_logprob(lp.logprob))
    top = {}        # tokens with the same text (pieces of a character): the likeliest
    for t, v in zip(lp.top_ids[:k], lp.top[:k]):
      top.setdefault(_token_text(tokenizer, int(t)), _json_logprob(v))
    top.setdefault(text, _json_logprob(lp.logprob))
    tops.append(top)
  return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
          "text_offset": offsets}


def chat_logprobs(tokenizer, entries, k: int) -> dict:
  """OpenAI's chat ``logprobs``: ``content``, one entry per token (its
  text, logprob, UTF-8 ``bytes`` and the k most likely tokens)."""
  def one(token_id, logprob):
    return {"token": _token_text(tokenizer, token_id), "logprob": _json_logprob(logprob),
            "bytes": list(tokenizer.token_bytes(token_id))}
  return {"content": [
      {**one(token_id, lp.logprob),
       "top_logprobs": [one(int(t), v) for t, v in zip(lp.top_ids[:k], lp.top[:k])]}
      for token_id, lp in entries]}


def choice_logprobs(tokenizer, parsed: ParsedRequest, chat: bool, entries, offset: int = 0):
  """The ``logprobs`` of a choice or chunk for ``entries``; None when the
  request asked for none."""
  if parsed.logprobs is None:
    return None
  if chat:
    return chat_logprobs(tokenizer, entries, parsed.logprobs)
  return completion_logprobs(tokenizer, entries, parsed.logprobs, offset)


def choice(index: int, chat: bool, text: str, finish_reason: Optional[str],
           chunk: bool, logprobs=None) -> dict:
  """One choice of a response (``chunk``: of a stream chunk, a ``delta``
  for chat)."""
  if not chat:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason}
  if chunk:
    delta = {"content": text} if text or finish_reason is None else {}
    return {"index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": finish_reason}
  return {"index": index, "message": {"role": "assistant", "content": text},
          "logprobs": logprobs, "finish_reason": finish_reason}
