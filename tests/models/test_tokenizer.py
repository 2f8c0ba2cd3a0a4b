"""Tokenizer wrapper: BPE built from a GGUF-style vocabulary, chat template,
streaming detokenizer."""

import hypothesis
import hypothesis.strategies as st
import pytest
import tokenizers
from tokenizers import decoders, models

from gguf_testing import CHAT_TEMPLATE, bpe_vocab
from models.tokenizer import _BYTE_LEVEL, Tokenizer, build_bpe_tokenizer


@pytest.fixture(scope="module")
def tok():
  tokens, merges, types = bpe_vocab()
  return Tokenizer(build_bpe_tokenizer(tokens, merges, types, pre="smollm"),
                   eos_token_id=2, stop_token_ids=[0], chat_template=CHAT_TEMPLATE)


def ids_of(tok, *pieces):
  return [tok.backend.token_to_id(p) for p in pieces]


def test_bpe_merges_digits_and_specials(tok):
  # " the" merges fully; " th" stops at ("Ġt", "h"); digits stay single
  # ("smollm" pre-tokenizer); special tokens are matched whole.
  assert tok.encode(" the") == ids_of(tok, "Ġthe")
  assert tok.encode(" th") == ids_of(tok, "Ġt", "h")
  assert tok.encode("42") == ids_of(tok, "4", "2")
  gpt2 = build_bpe_tokenizer(*bpe_vocab(), pre="gpt-2")
  assert gpt2.encode("42").ids == ids_of(tok, "42")
  assert tok.encode("<|im_start|>hi<|im_end|>") == [1] + ids_of(tok, "hi") + [2]
  assert tok.stop_token_ids == (2, 0)


def test_decode_round_trips_unicode(tok):
  text = "naïve café — 世界 🙂 the end"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert tok.decode(tok.encode("<|im_end|>x"), skip_special_tokens=True) == "x"


def test_bos_is_prepended_only_when_configured():
  tokens, merges, types = bpe_vocab()
  with_bos = build_bpe_tokenizer(tokens, merges, types, bos_token_id=0)
  assert with_bos.encode("a", add_special_tokens=True).ids == [0, tokens.index("a")]
  assert with_bos.encode("a", add_special_tokens=False).ids == [tokens.index("a")]
  plain = build_bpe_tokenizer(tokens, merges, types)
  assert plain.encode("a", add_special_tokens=True).ids == [tokens.index("a")]


def test_unknown_pre_tokenizer_and_bad_merge():
  tokens, merges, types = bpe_vocab()
  with pytest.raises(ValueError, match="pre-tokenizer 'mystery'"):
    build_bpe_tokenizer(tokens, merges, types, pre="mystery")
  with pytest.raises(ValueError, match="merge 1 is not 'left right'"):
    build_bpe_tokenizer(tokens, [merges[0], "abc"], types)


def test_chat_template(tok):
  text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi"}])
  assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                  "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
  no_prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                      add_generation_prompt=False)
  assert no_prompt == "<|im_start|>user\nHi<|im_end|>\n"
  bare = Tokenizer(tok.backend, eos_token_id=2)
  with pytest.raises(ValueError, match="no chat template"):
    bare.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_streaming_holds_split_characters(tok):
  text = "a 世界🙂!"
  ids = tok.encode(text)
  # The vocabulary has no merges for these bytes: one token per UTF-8 byte.
  assert len(ids) == len(text.encode("utf-8"))
  detok = tok.detokenizer()
  pieces = [detok.push(i) for i in ids]
  assert pieces == ["a", " ", "", "", "世", "", "", "界", "", "", "", "🙂", "!"]
  assert detok.flush() == "" and detok.text == text


def test_streaming_matches_full_decode_with_merges_and_specials(tok):
  text = "<|im_start|>the heart ist naïve 42<|im_end|>"
  ids = tok.encode(text)
  detok = tok.detokenizer()
  assert "".join(detok.push(i) for i in ids) + detok.flush() == tok.decode(ids) == text
  skip = tok.detokenizer(skip_special_tokens=True)
  assert skip.push_many(ids) + skip.flush() == tok.decode(ids, skip_special_tokens=True)


def test_streaming_flushes_a_dangling_byte(tok):
  ids = tok.encode("é")  # two byte tokens
  detok = tok.detokenizer()
  assert detok.push(ids[0]) == ""
  assert detok.flush() == "\ufffd"


def test_json_round_trip(tok):
  again = Tokenizer.from_json(tok.to_json())
  text = "<|im_start|>the 42 café"
  assert again.encode(text) == tok.encode(text)
  assert again.stop_token_ids == tok.stop_token_ids
  assert again.chat_template == CHAT_TEMPLATE


def _piece_tokenizer(pieces):
  """A byte-level tokenizer whose vocabulary is exactly ``pieces`` (bytes),
  so that ids 0..n-1 spell them; decoding maps ids back to their bytes."""
  alphabet = {b: ch for ch, b in _BYTE_LEVEL.items()}
  tokens = list(dict.fromkeys("".join(alphabet[b] for b in p) for p in pieces))
  return Tokenizer(build_bpe_tokenizer(tokens, []), eos_token_id=0), tokens


def _stream(tok, ids):
  detok = tok.detokenizer()
  pieces = [detok.push(i) for i in ids]
  pieces.append(detok.flush())
  return pieces, detok.text


def test_tokens_each_ending_inside_a_character_lose_nothing():
  # "你好世界和": five 3-byte characters cut into pieces of 1, 3, 3, 3, 2 and
  # 3 bytes; every piece but the last ends inside a character.
  data = "你好世界和".encode()
  cuts = [0, 1, 4, 7, 10, 12, 15]
  pieces = [data[a:b] for a, b in zip(cuts, cuts[1:])]
  tok, tokens = _piece_tokenizer(pieces)
  ids = [tokens.index("".join({b: c for c, b in _BYTE_LEVEL.items()}[x] for x in p))
         for p in pieces]
  streamed, text = _stream(tok, ids)
  assert streamed == ["", "你", "好", "世", "界", "和", ""]
  assert text == tok.decode(ids) == "你好世界和"


def test_incomplete_trailing_character_streams_as_the_final_text():
  # Cut by max_tokens inside an emoji: the stream and decode() agree.
  data = "ok🙂".encode()
  pieces = [data[:3], data[3:4]]          # "ok" + first emoji byte, one more byte
  tok, _ = _piece_tokenizer(pieces)
  streamed, text = _stream(tok, [0, 1])
  assert streamed == ["ok", "", "\ufffd"]   # held: 2 of the emoji's 4 bytes
  assert text == tok.decode([0, 1]) == "ok\ufffd"


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.text(min_size=1, max_size=12), st.data())
def test_stream_equals_final_text_over_byte_level_tokenizations(text, data):
  raw = text.encode()
  cuts = sorted(data.draw(st.sets(st.integers(1, len(raw) - 1), max_size=len(raw) - 1))
                if len(raw) > 1 else [])
  bounds = [0, *cuts, len(raw)]
  pieces = [raw[a:b] for a, b in zip(bounds, bounds[1:])]
  stop = data.draw(st.integers(1, len(pieces)))   # max_tokens may cut the text
  tok, tokens = _piece_tokenizer(pieces)
  alphabet = {b: ch for ch, b in _BYTE_LEVEL.items()}
  ids = [tokens.index("".join(alphabet[x] for x in p)) for p in pieces][:stop]
  streamed, final = _stream(tok, ids)
  assert "".join(streamed) == final == tok.decode(ids)
  assert "\ufffd" not in "".join(streamed[:-1])        # nothing held is lost mid-stream
  if stop == len(pieces):
    assert final == text


def test_byte_fallback_decoder_follows_the_same_rule():
  # A sentencepiece-style vocabulary (Llama 2): "▁" pieces, <0xHH> byte
  # fallback, a decoder that strips the first space. Not byte-level, so the
  # detokenizer re-reads a window; the unfinished-character rule is the same.
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
  vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
  vocab.update({"▁hi": 259, "▁the": 260, "re": 261})
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>",
                                            byte_fallback=True))
  backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                       decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  tok = Tokenizer(backend, eos_token_id=2)
  assert not tok.is_byte_level
  byte = lambda s: [3 + b for b in s.encode()]
  ids = [259] + byte("你好") + [260, 261] + byte("🙂") + [259] + byte("🙂")[:2]
  detok = tok.detokenizer()
  streamed = [detok.push(i) for i in ids]
  assert "".join(streamed) == "hi你好 there🙂 hi"            # held: 2 of 4 emoji bytes
  assert streamed[1:4] == ["", "", "你"]
  tail = detok.flush()                                       # the 2 bytes, as decode() has them
  assert tail and set(tail) == {"\ufffd"}
  assert detok.text == tok.decode(ids) == "hi你好 there🙂 hi" + tail
