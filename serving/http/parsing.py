"""OpenAI request bodies -> engine inputs: ``RequestParser`` checks a
completions or chat body and gives a ``ParsedRequest`` (each choice's prompt
token ids and ``SamplingParams``, stop strings, streaming, routing).

Rules: a body holds only the fields its endpoint reads (``COMPLETION_FIELDS``,
``CHAT_FIELDS``) or an unimplemented one at its off value
(``UNSUPPORTED_FIELDS``); any other field is a 400 naming it, never ignored.
Bad input raises ``BadRequest`` naming the field and the rule, as vLLM does for
a prompt plus max_tokens beyond the context (both numbers in the message;
never silently cut). A batched prompt is one choice per prompt; ``n`` copies
of each prompt are choices too, prompt-major, copy j seeded
``(seed + j) mod 2**32``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Tuple

from serving.engine.config import SamplingParams
from serving.engine.sampling import MAX_LOGPROBS
from serving.http.protocol import BadRequest, UnknownModel, _get, refuse_long_ints

MAX_STOP_STRINGS = 8
# Chat roles the OpenAI API defines for text messages ("developer" is its
# newer name for "system").
CHAT_ROLES = ("system", "developer", "user", "assistant")
# OpenAI request fields this server does not implement, with the values that
# mean "off" (accepted); any other value is a 400 naming the field, never
# silently ignored.
UNSUPPORTED_FIELDS = {
    "suffix": (None,), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "min_p": (None, 0), "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, False),
}
MAX_STOP_STRING_CHARS = 256
# Body fields each endpoint reads; with UNSUPPORTED_FIELDS (at their off
# values) they are all a body may hold: any other field is a 400 naming it.
_COMMON_FIELDS = frozenset({
    "model", "n", "best_of", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "seed", "min_tokens", "ignore_eos", "stop", "stop_token_ids", "stream", "stream_options",
    "priority", "client", "tenant", "user", "slo_ttft_ms", "slo_tbt_ms", "cache_salt"})
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "chat_template_kwargs"}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


MAX_CACHE_SALT_CHARS = 256
MAX_SLO_MS = 86_400_000.0          # a day: an SLO past it is no target


def _float(body: dict, name: str, default, rule: str = "a number") -> Optional[float]:
  """``body[name]`` (an int or a float) as a float; an integer too large
  for a float is a 400 naming the field (``float()`` would raise
  OverflowError, a 500). Infinity and NaN pass: the field's own range
  check refuses them."""
  value = _get(body, name, (int, float), default, rule)
  if value is None:
    return None
  try:
    return float(value)
  except OverflowError:
    raise BadRequest(f"'{name}' must be a finite number, got an integer of "
                     f"{len(str(abs(value)))} digits", name) from None


@dataclasses.dataclass
class ParsedRequest:
  """A validated request: its choices' prompts and sampling, stop strings,
  streaming and routing. With ``n`` copies per prompt, choice i is copy
  ``i % n`` of prompt ``i // n``."""

  prompts: List[List[int]]   # prompt token ids, one list per choice (``index`` order)
  samplings: List[SamplingParams]       # one per choice (max_tokens, seed may differ)
  stop: List[str]
  stream: bool
  include_usage: bool
  priority: int
  client: str
  extra: Dict[str, Any]      # engine keyword arguments (e.g. SLO targets)
  prompt_field: str = "prompt"          # or "messages": the body field of the prompt
  max_tokens_field: str = "max_tokens"  # or "max_completion_tokens", as the body named it
  continuous_usage: bool = False        # usage on every chunk (include_usage too)
  # Alternatives per token when logprobs are asked (completions ``logprobs``,
  # chat ``top_logprobs``), None when not.
  logprobs: Optional[int] = None
  # ``echo``: each prompt's text (its string, or its ids decoded), which the
  # choice's text starts with (and, with logprobs, its tokens' logprobs).
  echo_texts: Optional[List[str]] = None
  score_only: bool = False   # max_tokens 0 with echo: the prompt alone is returned
  n: int = 1                 # copies of each prompt (choices = prompts * n)

  @property
  def num_prompts(self) -> int:
    return len(self.prompts) // self.n

  def prompt_tokens(self) -> int:
    """Prompt tokens of the request, each prompt counted once."""
    return sum(len(p) for p in self.prompts[::self.n])



class RequestParser:
  """Checks OpenAI request bodies against the served model and the server's
  bounds (see the module docstring).

  Args:
    tokenizer: the model's Tokenizer (prompts, chat template, echo text).
    model_name: the name requests must use.
    max_model_len: the engine's context (tokens): prompt + max_tokens fit it.
    vocab_size: the model's vocabulary: token ids are in [0, vocab_size).
    max_stop_ids: the most ``stop_token_ids`` a request may hold.
    capacity: the server's live bound: the most choices one request holds.
    default_max_tokens: max_tokens when the body has none (None: the rest of
      the context, as vLLM).
    max_prompt_chars: the longest prompt string, or chat messages' text in
      all, taken to the tokenizer (None: no cap); a token-id prompt holds
      at most ``max_model_len`` ids. Both are checked before tokenizing.
  """

  def __init__(self, tokenizer, model_name: str, *, max_model_len: int, vocab_size: int,
               max_stop_ids: int, capacity: int, default_max_tokens: Optional[int] = None,
               max_prompt_chars: Optional[int] = None):
    self.tokenizer = tokenizer
    self.model_name = model_name
    self.max_model_len = max_model_len
    self.vocab_size = vocab_size
    self.max_stop_ids = max_stop_ids
    self.capacity = capacity
    self.default_max_tokens = default_max_tokens
    self.max_prompt_chars = max_prompt_chars

  def parse(self, body: Any, chat: bool) -> ParsedRequest:
    """Validates an OpenAI request body; raises BadRequest naming the field.

    Every body field is one this endpoint reads (``COMPLETION_FIELDS``,
    ``CHAT_FIELDS``) or an unimplemented one at its off value
    (``UNSUPPORTED_FIELDS``); any other field is a 400 naming it.
    """
    if not isinstance(body, dict):
      raise BadRequest("the request body must be a JSON object")
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for field in body:
      if field not in known and field not in UNSUPPORTED_FIELDS:
        raise BadRequest(f"'{field}' is not a field this server reads for "
                         f"{'chat completions' if chat else 'completions'} (unknown "
                         f"fields are refused, never ignored)", field)
    model = _get(body, "model", str, self.model_name)
    if model != self.model_name:
      raise UnknownModel(f"model {model!r} does not exist; this server serves "
                         f"{self.model_name!r}", "model")
    n = _get(body, "n", int, 1)
    if n < 1:
      raise BadRequest(f"'n' must be >= 1 (choices per prompt), got {n}", "n")
    best_of = _get(body, "best_of", int, None)
    if best_of is not None and best_of != n:
      raise BadRequest(f"'best_of' must equal 'n' (got best_of={best_of}, n={n}): this "
                       f"server returns every sampled copy and does not rank copies",
                       "best_of")
    for field, neutral in UNSUPPORTED_FIELDS.items():
      if field in body and body[field] not in neutral:
        raise BadRequest(f"'{field}' is not supported by this server (accepted only as "
                         f"{' or '.join(json.dumps(v) for v in neutral)})", field)
    if chat:
      prompts, texts = [self.chat_prompt(body)], None
    else:
      prompts, texts = self._completion_prompts(body)
    logprobs = self._logprobs_field(body, chat)
    echo = not chat and _get(body, "echo", bool, False)
    # OpenAI deprecates max_tokens for max_completion_tokens: with both, the
    # latter wins (as vLLM's `max_completion_tokens or max_tokens`).
    legacy = _get(body, "max_tokens", int, None)
    max_tokens = _get(body, "max_completion_tokens", int, None)
    field = "max_completion_tokens"
    if max_tokens is None:
      max_tokens, field = legacy, "max_tokens"
    # The field a "too long" refusal names: the one the body gave (default max_tokens).
    max_tokens_field = field if field in body else "max_tokens"
    score_only = echo and max_tokens == 0
    if score_only:     # the engine computes one token (the prompt's last row samples)
      max_tokens = 1
    if max_tokens is not None and max_tokens < 1:
      # Only completions read `echo`: a chat body has no exception to name.
      rule = "" if chat else " (0 only with 'echo': true, a request that scores its prompt)"
      raise BadRequest(f"'{field}' must be >= 1{rule}, got {max_tokens}", field)
    prompt_field = "messages" if chat else "prompt"
    lengths = []          # each prompt's max_tokens (the body's, or the default)
    for i, ids in enumerate(prompts):
      wanted = max_tokens
      if wanted is None:  # the rest of the context (or the server's default)
        wanted = min(self.default_max_tokens or self.max_model_len - len(ids),
                     self.max_model_len - len(ids))
        if wanted < 1:
          wanted = 1      # the prompt fills the context: refused below
      if len(ids) + wanted > self.max_model_len:
        name = prompt_field if len(prompts) == 1 else f"{prompt_field}[{i}]"
        raise BadRequest(
            f"This model's maximum context length is {self.max_model_len} tokens. "
            f"However, you requested {len(ids) + wanted} tokens ({len(ids)} in the "
            f"{name}, {wanted} in the completion). Please reduce the length of the "
            f"{name} or completion.",
            field if len(ids) < self.max_model_len else name)
      lengths.append(wanted)
    temperature = _float(body, "temperature", 1.0)
    top_p = _float(body, "top_p", 1.0)
    top_k = _get(body, "top_k", int, 0)
    if not -1 <= top_k < 2**31:
      raise BadRequest(f"'top_k' must be in [-1, 2**31) (-1 or 0 = off), got {top_k}",
                       "top_k")
    top_k = 0 if top_k == -1 else top_k            # vLLM spells "off" as -1
    seed = _get(body, "seed", int, 0)
    min_tokens = _get(body, "min_tokens", int, 0)
    ignore_eos = _get(body, "ignore_eos", bool, False)
    stop = _get(body, "stop", (str, list), [], "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
      raise BadRequest("'stop' must hold non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
      raise BadRequest(f"'stop' holds at most {MAX_STOP_STRINGS} strings of at most "
                       f"{MAX_STOP_STRING_CHARS} characters", "stop")
    stop_ids = _get(body, "stop_token_ids", list, [], "a list of token ids")
    vocab = self.vocab_size
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
               for t in stop_ids):
      raise BadRequest(f"'stop_token_ids' must be integer token ids in [0, {vocab})",
                       "stop_token_ids")
    if len(stop_ids) > self.max_stop_ids:
      raise BadRequest(f"'stop_token_ids' holds at most {self.max_stop_ids} ids, got "
                       f"{len(stop_ids)}", "stop_token_ids")
    try:
      sampling = SamplingParams(max_tokens=max(lengths), temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed, min_tokens=min_tokens,
                                stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos)
      samplings = [dataclasses.replace(sampling, max_tokens=m) for m in lengths]
    except ValueError as e:         # "SamplingParams.top_p must be in (0, 1], got 2.0"
      field_name = str(e).split(" ", 1)[0].split(".")[-1]
      if field_name == "max_tokens":
        field_name = field
      raise BadRequest(f"'{field_name}' {str(e).split(' ', 1)[1]}", field_name) from None
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, None, "an object")
    if options is not None and not stream:
      raise BadRequest("'stream_options' is only allowed with 'stream': true",
                       "stream_options")
    options = options or {}
    for key in options:
      if key not in STREAM_OPTIONS:
        raise BadRequest(f"'stream_options.{key}' is not a stream option this server "
                         f"reads (one of {list(STREAM_OPTIONS)})", f"stream_options.{key}")
    include_usage = _get(options, "include_usage", bool, False)
    continuous = _get(options, "continuous_usage_stats", bool, False)
    priority = _get(body, "priority", int, 0)
    if not -2**31 <= priority < 2**31:
      raise BadRequest(f"'priority' must be in [-2**31, 2**31) (an int32; lower runs "
                       f"first), got {priority}", "priority")
    client = (_get(body, "client", str, None) or _get(body, "tenant", str, None)
              or _get(body, "user", str, "default"))
    extra = {}
    # Body field -> Engine.add_request keyword (§0x07: the TBT limit is the
    # per-token SLO the engine calls slo_tpot_ms).
    for field, keyword in (("slo_ttft_ms", "slo_ttft_ms"), ("slo_tbt_ms", "slo_tpot_ms")):
      value = _float(body, field, None, "a number of ms")
      if value is None:
        continue
      if not 0 < value <= MAX_SLO_MS:
        raise BadRequest(f"'{field}' must be in (0, {MAX_SLO_MS:.0f}] ms, got {value}", field)
      extra[keyword] = value
    salt = _get(body, "cache_salt", str, None, "a string")
    if salt is not None:
      if not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise BadRequest(f"'cache_salt' must be 1..{MAX_CACHE_SALT_CHARS} characters, got "
                         f"{len(salt)}", "cache_salt")
      extra["cache_salt"] = salt
    if logprobs is not None:
      extra["logprobs"] = True
      if echo:                  # from the prefill rows; no prefix hit (Engine)
        extra["prompt_logprobs"] = True
    echo_texts = None
    if echo:
      echo_texts = [t if t is not None else
                    self.tokenizer.decode(ids, skip_special_tokens=True)
                    for t, ids in zip(texts, prompts)]
    if len(prompts) * n > self.capacity:
      raise BadRequest(f"{len(prompts)} prompt(s) x n={n} is {len(prompts) * n} choices; "
                       f"a request holds at most {self.capacity} (the server's "
                       f"live bound)", "n")
    # Choice i = copy i % n of prompt i // n, copy j seeded (seed + j) mod 2**32.
    prompts = [ids for ids in prompts for _ in range(n)]
    samplings = [dataclasses.replace(sp, seed=(seed + j) % 2**32)
                 for sp in samplings for j in range(n)]
    if echo_texts is not None:
      echo_texts = [t for t in echo_texts for _ in range(n)]
    return ParsedRequest(prompts, samplings, stop, stream, include_usage, priority, client,
                         extra, prompt_field=prompt_field,
                         max_tokens_field=max_tokens_field,
                         continuous_usage=include_usage and continuous, logprobs=logprobs,
                         echo_texts=echo_texts, score_only=score_only, n=n)

  @staticmethod
  def _logprobs_field(body: dict, chat: bool) -> Optional[int]:
    """The alternatives per token a body asks for, None when it asks for no
    logprobs: completions ``logprobs`` (an int k; null or false: none),
    chat ``logprobs`` (bool) with ``top_logprobs`` (k, default 0). At most
    ``MAX_LOGPROBS`` (the device program's static top-k)."""
    rule = f"an int in [0, {MAX_LOGPROBS}]"
    if chat:
      wanted = _get(body, "logprobs", bool, False)
      k = _get(body, "top_logprobs", int, 0, rule)
      field = "top_logprobs"
      if k and not wanted:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
      field = "logprobs"
      if body.get("logprobs") is False:       # the legacy "off"
        return None
      k = _get(body, "logprobs", int, None, rule)
      wanted = k is not None
    if not wanted:
      return None
    if not 0 <= k <= MAX_LOGPROBS:
      raise BadRequest(f"'{field}' must be in [0, {MAX_LOGPROBS}] (the most "
                       f"alternatives per token this server computes), got {k}", field)
    return k

  def _completion_prompts(self, body: dict) -> Tuple[List[List[int]], List[Optional[str]]]:
    """The body's ``prompt`` as token ids, one list per choice, and each
    prompt's string (None for token ids): a string or a list of token ids
    is one prompt; a list of strings or a list of token-id lists is a batch
    (at most the server's live bound)."""
    prompt = _get(body, "prompt", (str, list), rule="a string or a list of token ids")
    if isinstance(prompt, str):
      return [self.one_prompt(prompt, "prompt", True)], [prompt]
    if not prompt:
      raise BadRequest("'prompt' must be non-empty", "prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
      return [self.one_prompt(prompt, "prompt", True)], [None]
    if not (all(isinstance(p, str) for p in prompt) or
            all(isinstance(p, list) for p in prompt)):
      raise BadRequest("'prompt' must be a string, a list of token ids, a list of strings "
                       "or a list of token-id lists (not a mix)", "prompt")
    if len(prompt) > self.capacity:
      raise BadRequest(f"'prompt' holds {len(prompt)} prompts; a batch holds at most "
                       f"{self.capacity} (the server's live bound)", "prompt")
    return ([self.one_prompt(p, f"prompt[{i}]" if len(prompt) > 1 else "prompt", True)
             for i, p in enumerate(prompt)],
            [p if isinstance(p, str) else None for p in prompt])

  def one_prompt(self, prompt, name: str, add_special_tokens: bool) -> List[int]:
    """One prompt (a string, or a list of token ids) as token ids."""
    if isinstance(prompt, str):
      if not prompt:
        raise BadRequest(f"'{name}' must be non-empty", name)
      self._check_chars(len(prompt), name)
      return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    if len(prompt) > self.max_model_len:
      raise BadRequest(f"'{name}' holds {len(prompt)} token ids; the context "
                       f"(max_model_len) is {self.max_model_len}", name)
    vocab = self.vocab_size
    if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and
                             0 <= t < vocab for t in prompt):
      raise BadRequest(f"'{name}' as token ids must be a non-empty list of ids in "
                       f"[0, {vocab})", name)
    return list(prompt)

  def _check_chars(self, num_chars: int, name: str) -> None:
    """A prompt of ``num_chars`` characters past ``max_prompt_chars`` is a
    400 naming it, before the tokenizer sees it."""
    if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
      raise BadRequest(f"'{name}' holds {num_chars} characters; a prompt holds at most "
                       f"{self.max_prompt_chars} (--max_prompt_chars), checked before "
                       f"tokenizing", name)

  def chat_prompt(self, body: dict, add_special_tokens: bool = False) -> List[int]:
    """The body's ``messages`` through the chat template (with the body's
    ``chat_template_kwargs``), as token ids."""
    messages = _get(body, "messages", list, rule="a list of messages")
    if not messages:
      raise BadRequest("'messages' must hold at least one message", "messages")
    clean = []
    for i, m in enumerate(messages):
      if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest(f"'messages[{i}]' must be an object with a 'role' string",
                         f"messages[{i}].role")
      if m["role"] not in CHAT_ROLES:
        raise BadRequest(f"'messages[{i}].role' must be one of {list(CHAT_ROLES)}, got "
                         f"{m['role']!r}", f"messages[{i}].role")
      content = m.get("content")
      if isinstance(content, list):      # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(c, dict) and c.get("type") == "text" and
                   isinstance(c.get("text"), str) for c in content):
          raise BadRequest(f"'messages[{i}].content' parts must be text parts",
                           f"messages[{i}].content")
        content = "".join(c["text"] for c in content)
      if not isinstance(content, str):
        raise BadRequest(f"'messages[{i}].content' must be a string (text content is "
                         f"required)", f"messages[{i}].content")
      clean.append({"role": m["role"], "content": content})
    self._check_chars(sum(len(m["content"]) for m in clean), "messages")
    # vLLM's extra variables for the template (e.g. {"enable_thinking": false}).
    variables = _get(body, "chat_template_kwargs", dict, {}, "an object")
    refuse_long_ints(variables, "chat_template_kwargs")
    if "messages" in variables:
      raise BadRequest("'chat_template_kwargs' may not set 'messages' (the body's field)",
                       "chat_template_kwargs.messages")
    try:
      text = self.tokenizer.apply_chat_template(
          clean, **{"add_generation_prompt": True, **variables})
    except Exception as e:          # jinja2 raise_exception in the template
      raise BadRequest(f"'messages' rejected by the chat template: {e}", "messages") from None
    return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
