"""Tokenizer: encoding, decoding, chat templates and streaming detokenization.

A thin wrapper over a ``tokenizers.Tokenizer`` (the Rust tokenizer of HF's
``tokenizers`` package). ``build_bpe_tokenizer`` makes one from the
vocabulary a GGUF file carries (``tokenizer.ggml.*`` metadata, the gpt2-style
byte-level BPE), so the core install never needs ``transformers``.
"""

from __future__ import annotations

import json
from typing import Iterable, Optional, Sequence

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

# GGUF token_type values (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Split regexes of the byte-level BPE pre-tokenizers named by
# ``tokenizer.ggml.pre`` (the same expressions as the models' tokenizer.json).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str):
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in ("default", "gpt-2", "gpt2"):
    return byte_level
  if pre == "smollm":  # every digit alone, then GPT-2's split
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT}.get(pre)
  if split is None:
    raise ValueError(
        f"unsupported byte-level BPE pre-tokenizer {pre!r}; supported: "
        "default, gpt-2, smollm, llama-bpe, qwen2")
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_bpe_tokenizer(tokens: Sequence[str], merges: Sequence[str],
                        token_types: Optional[Sequence[int]] = None, *,
                        pre: str = "default",
                        bos_token_id: Optional[int] = None) -> tokenizers.Tokenizer:
  """Byte-level BPE ``tokenizers.Tokenizer`` from a GGUF-style vocabulary.

  Args:
    tokens: token strings in id order (byte-level alphabet, e.g. ``Ġthe``).
    merges: BPE merges in rank order, each ``"left right"``.
    token_types: GGUF token types per id; CONTROL and USER_DEFINED tokens
      become added tokens (matched whole in the input text; CONTROL ones are
      special and dropped by ``decode(skip_special_tokens=True)``).
    pre: ``tokenizer.ggml.pre`` name choosing the pre-tokenizer split.
    bos_token_id: when set, ``encode(add_special_tokens=True)`` prepends it.

  Raises:
    ValueError: unknown ``pre``, a malformed merge, or duplicate tokens.
  """
  vocab = {tok: i for i, tok in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise ValueError(f"vocabulary has duplicate tokens ({len(tokens) - len(vocab)})")
  pairs = []
  for rank, merge in enumerate(merges):
    parts = merge.split(" ")
    if len(parts) != 2:
      raise ValueError(f"merge {rank} is not 'left right': {merge!r}")
    pairs.append((parts[0], parts[1]))
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                        byte_fallback=False))
  tok.pre_tokenizer = _pre_tokenizer(pre)
  tok.decoder = decoders.ByteLevel()
  if token_types is not None:
    added = []
    for i, kind in enumerate(token_types):
      if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
        added.append(tokenizers.AddedToken(
            tokens[i], special=kind == TOKEN_TYPE_CONTROL, normalized=False))
    tok.add_tokens(added)
  if bos_token_id is not None:
    bos = tokens[bos_token_id]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, bos_token_id)])
  return tok


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                            indent=indent)
  env.globals["raise_exception"] = _raise_exception
  return env.from_string(source)


class IncrementalDetokenizer:
  """Turns a stream of token ids into a stream of complete text pieces.

  A character whose UTF-8 bytes are split across tokens is held back until
  its last byte arrives, so every piece returned is valid text and the pieces
  concatenate to ``decode(all ids)``. Decoding re-reads only a short window of
  recent ids (the ids since the previous emitted piece plus the one before),
  so each step costs O(window), not O(sequence).
  """

  # A UTF-8 character has at most 4 bytes and every token at least 1, so a
  # window this long that still ends in U+FFFD holds a genuinely invalid byte.
  _MAX_PENDING = 4

  def __init__(self, tokenizer: "Tokenizer", *, skip_special_tokens: bool = False):
    self._tok = tokenizer
    self._skip = skip_special_tokens
    self._ids: list[int] = []
    self._prefix = 0   # window start: ids before it are fully emitted
    self._read = 0     # ids before it have been emitted as text
    self.text = ""     # everything emitted so far

  def _decode(self, ids):
    return self._tok.decode(ids, skip_special_tokens=self._skip)

  def push(self, token_id: int) -> str:
    """Adds one id; returns the newly completed text (possibly empty)."""
    self._ids.append(int(token_id))
    return self._emit(final=False)

  def push_many(self, token_ids: Iterable[int]) -> str:
    return "".join(self.push(t) for t in token_ids)

  def flush(self) -> str:
    """Returns held-back text (incomplete bytes decode as U+FFFD)."""
    return self._emit(final=True)

  def _emit(self, final: bool) -> str:
    before = self._decode(self._ids[self._prefix:self._read])
    after = self._decode(self._ids[self._prefix:])
    pending = len(self._ids) - self._read
    if len(after) <= len(before) and not final:
      return ""
    if after.endswith("\ufffd") and not final and pending < self._MAX_PENDING:
      return ""
    piece = after[len(before):]
    self._prefix, self._read = self._read, len(self._ids)
    self.text += piece
    return piece


class Tokenizer:
  """Encode/decode text and render chat prompts for one model.

  Attributes:
    eos_token_id: the model's end-of-sequence id.
    stop_token_ids: ids that end generation (includes ``eos_token_id``).
    bos_token_id: prepended by ``encode(add_special_tokens=True)`` when the
      model wants it, else None.
    chat_template: jinja2 source of the chat template, or None.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_token_id: int,
               stop_token_ids: Iterable[int] = (), bos_token_id: Optional[int] = None,
               chat_template: Optional[str] = None):
    self._tok = tokenizer
    self.eos_token_id = int(eos_token_id)
    self.stop_token_ids = tuple(dict.fromkeys([self.eos_token_id, *map(int, stop_token_ids)]))
    self.bos_token_id = bos_token_id
    self.chat_template = chat_template
    self._template = _compile_template(chat_template) if chat_template else None

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The wrapped ``tokenizers.Tokenizer``."""
    return self._tok

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def id_to_token(self, token_id: int) -> Optional[str]:
    return self._tok.id_to_token(int(token_id))

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``; special-token strings in it map to their ids."""
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def detokenizer(self, *, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
    """A fresh streaming detokenizer (see ``IncrementalDetokenizer``)."""
    return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[dict],
                          add_generation_prompt: bool = True, **kwargs) -> str:
    """Renders ``messages`` (dicts with ``role`` and ``content``) as prompt text.

    Raises:
      ValueError: the tokenizer has no chat template.
      jinja2.TemplateError: the template rejects the messages.
    """
    if self._template is None:
      raise ValueError("this tokenizer has no chat template")
    special = {}
    if self.bos_token_id is not None:
      special["bos_token"] = self.id_to_token(self.bos_token_id)
    special["eos_token"] = self.id_to_token(self.eos_token_id)
    return self._template.render(messages=list(messages),
                                 add_generation_prompt=add_generation_prompt,
                                 **{**special, **kwargs})

  # Serialization (the converted-model cache stores tokenizers this way).
  def to_json(self) -> str:
    return json.dumps({
        "tokenizer": self._tok.to_str(), "eos_token_id": self.eos_token_id,
        "stop_token_ids": list(self.stop_token_ids), "bos_token_id": self.bos_token_id,
        "chat_template": self.chat_template})

  @classmethod
  def from_json(cls, text: str) -> "Tokenizer":
    data = json.loads(text)
    return cls(tokenizers.Tokenizer.from_str(data["tokenizer"]),
               eos_token_id=data["eos_token_id"], stop_token_ids=data["stop_token_ids"],
               bos_token_id=data["bos_token_id"], chat_template=data["chat_template"])
