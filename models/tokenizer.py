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


def _byte_level_alphabet() -> dict:
  """GPT-2's byte-level alphabet: printable stand-in character -> byte."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
               + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


def incomplete_utf8_tail(data: bytes) -> int:
  """Bytes at the end of ``data`` that start a UTF-8 character but do not
  finish it (0 when ``data`` ends on a character boundary or in an invalid
  byte, which no later byte can repair)."""
  for k in range(1, min(3, len(data)) + 1):
    b = data[-k]
    if 0x80 <= b < 0xC0:          # continuation byte: keep looking back
      continue
    need = 2 if 0xC2 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else 4 if 0xF0 <= b < 0xF5 else 0
    return k if need > k else 0
  return 0


_BYTE_LEVEL = _byte_level_alphabet()


def _decoder_is_byte_level(tokenizer: tokenizers.Tokenizer) -> bool:
  decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
  parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
  return any(d.get("type") == "ByteLevel" for d in parts)


class IncrementalDetokenizer:
  """Turns a stream of token ids into a stream of complete text pieces.

  The rule for an unfinished character, one rule for the stream and the
  final text: the first 1-3 bytes of a multi-byte UTF-8 character are held
  back until its last byte arrives, however many ids carried them (a
  byte-level vocabulary may cut "\u4f60\u597d\u4e16\u754c\u548c" into pieces of 1, 3, 3, 3, 2 and
  3 bytes, each ending inside a character); ``flush`` at the request's end
  emits held bytes as U+FFFD, exactly as ``Tokenizer.decode`` of all ids
  does. So the pieces always concatenate to ``decode(all ids)``.

  A byte-level tokenizer is decoded from the ids' bytes (O(1) per id). Any
  other decoder re-reads a short window of recent ids (those since the last
  character boundary plus the piece before, which gives decoders such as
  sentencepiece's their context).
  """

  def __init__(self, tokenizer: "Tokenizer", *, skip_special_tokens: bool = False):
    self._tok = tokenizer
    self._skip = skip_special_tokens
    self._ids: list[int] = []
    self._held = b""   # byte-level: bytes of an unfinished character
    self._tail = b""   # other decoders: last <= 3 bytes of the ids so far
    self._prefix = 0   # window start: ids before it are fully emitted
    self._read = 0     # ids before it have been emitted as text
    self.text = ""     # everything emitted so far

  def _decode(self, ids):
    return self._tok.decode(ids, skip_special_tokens=self._skip)

  def push(self, token_id: int) -> str:
    """Adds one id; returns the newly completed text (possibly empty)."""
    data = self._tok.token_bytes(token_id, self._skip)
    if self._tok.is_byte_level:
      self._held += data
      cut = len(self._held) - incomplete_utf8_tail(self._held)
      piece = self._held[:cut].decode("utf-8", errors="replace")
      self._held = self._held[cut:]
      self.text += piece
      return piece
    self._ids.append(int(token_id))
    self._tail = (self._tail + data)[-3:]
    return self._emit(final=False)

  def push_many(self, token_ids: Iterable[int]) -> str:
    return "".join(self.push(t) for t in token_ids)

  def flush(self) -> str:
    """Returns held-back text (the bytes of an unfinished character decode as
    U+FFFD, as in ``Tokenizer.decode``)."""
    if self._tok.is_byte_level:
      piece, self._held = self._held.decode("utf-8", errors="replace"), b""
      self.text += piece
      return piece
    return self._emit(final=True)

  def _emit(self, final: bool) -> str:
    if not final and incomplete_utf8_tail(self._tail):
      return ""
    before = self._decode(self._ids[self._prefix:self._read])
    after = self._decode(self._ids[self._prefix:])
    if len(after) <= len(before) and not final:
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
    self._byte_level = _decoder_is_byte_level(tokenizer)
    self._bytes_cache: dict = {}

  @property
  def is_byte_level(self) -> bool:
    """Whether decoding maps each id to bytes (GPT-2 byte-level alphabet)."""
    return self._byte_level

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The wrapped ``tokenizers.Tokenizer``."""
    return self._tok

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def id_to_token(self, token_id: int) -> Optional[str]:
    return self._tok.id_to_token(int(token_id))

  def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
    """The UTF-8 bytes one id contributes to decoded text: the byte-level
    alphabet mapped back to bytes, ``<0xHH>`` byte-fallback pieces as that
    byte, added tokens as their text (nothing when skipped as special)."""
    token_id = int(token_id)
    key = (token_id, skip_special_tokens)
    cached = self._bytes_cache.get(key)
    if cached is not None:
      return cached
    piece = self._tok.id_to_token(token_id)
    added = self._tok.get_added_tokens_decoder().get(token_id)
    if piece is None:
      out = b""
    elif added is not None:
      out = b"" if (skip_special_tokens and added.special) else added.content.encode()
    elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
      out = bytes([int(piece[3:5], 16)])
    elif self._byte_level and all(ch in _BYTE_LEVEL for ch in piece):
      out = bytes(_BYTE_LEVEL[ch] for ch in piece)
    else:
      out = self._tok.decode([token_id], skip_special_tokens=skip_special_tokens).encode()
    self._bytes_cache[key] = out
    return out

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
