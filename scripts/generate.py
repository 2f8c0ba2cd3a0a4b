"""Generates text for prompts or chat messages, streamed to stdout.

  python scripts/generate.py --prompt="The capital of France is" --max_tokens=16
  python scripts/generate.py --chat="Write a haiku about autumn."
  python scripts/generate.py --mt_bench=../shared/data/prompts/mt_bench_questions.jsonl --num=3

Requests run together through the engine (iteration-level batching); each
answer is printed as its tokens arrive, prefixed by its request id. A
--max_tokens past what the engine's context (max_model_len) leaves after a
prompt is clipped to that, with one line saying so. With --speculative the
output ends with one line of the drafts, draft tokens and accepted tokens
and the acceptance rate.
"""

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from serving import cli
from serving.cli import launch
from serving.engine.config import SamplingParams
from serving.harness import report_text

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("prompt", [], "Raw text prompt (no chat template).")
flags.DEFINE_multi_string("chat", [], "User message, wrapped in the model's chat template.")
flags.DEFINE_string("mt_bench", None, "MT-Bench question JSONL; first turns become chat prompts.")
flags.DEFINE_integer("num", 3, "With --mt_bench: how many questions.", lower_bound=1)
flags.DEFINE_integer("max_tokens", 128, "Output tokens at most.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
flags.DEFINE_integer("top_k", 0, "Top-k (0 = off).")
flags.DEFINE_float("top_p", 1.0, "Top-p (1 = off).")
flags.DEFINE_integer("seed", 0, "Sampling seed.", lower_bound=0, upper_bound=2**32 - 1)
launch.define_engine_flags()


def _mt_bench_first_turns(path: str, num: int):
  """First turns of the first ``num`` MT-Bench rows; ValueError names the
  file, line and field on a missing file or a malformed row."""
  try:
    with open(path) as f:
      lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
  except OSError as e:
    raise ValueError(f"--mt_bench={path}: cannot read ({e.strerror})") from None
  turns = []
  for i, line in lines[:num]:
    try:
      turn = json.loads(line)["turns"][0]
    except (json.JSONDecodeError, KeyError, IndexError, TypeError):
      raise ValueError(f"--mt_bench={path}:{i}: each row must be JSON with a "
                       f"non-empty 'turns' list") from None
    if not isinstance(turn, str) or not turn:
      raise ValueError(f"--mt_bench={path}:{i}: turns[0] must be non-empty text")
    turns.append(turn)
  return turns


def prompt_texts():
  """(request id, text, is_chat) of every --prompt, --chat and --mt_bench
  turn, checked before the model loads.

  Raises:
    ValueError: an empty --prompt or --chat, no prompt at all, or a bad
      --mt_bench file.
  """
  if any(not text for text in FLAGS.prompt + FLAGS.chat):
    raise ValueError("--prompt and --chat must be non-empty text")
  chats = list(FLAGS.chat)
  if FLAGS.mt_bench:
    chats += _mt_bench_first_turns(FLAGS.mt_bench, FLAGS.num)
  items = [(f"prompt-{i}", text, False) for i, text in enumerate(FLAGS.prompt)]
  items += [(f"chat-{i}", text, True) for i, text in enumerate(chats)]
  if not items:
    raise ValueError("give at least one --prompt, --chat or --mt_bench")
  return items


def _token_ids(tokenizer, text: str, chat: bool):
  """A raw prompt's ids (BOS added as the tokenizer's post-processor says),
  or a chat message rendered by the model's template, whose text already
  holds every special token (BOS too: not added again; as the server and
  transformers tokenize a rendered chat)."""
  if chat:
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True)
  return tokenizer.encode(text, add_special_tokens=not chat)


def fit_context(rid: str, prompt_len: int, sampling: SamplingParams,
                max_model_len: int) -> SamplingParams:
  """``sampling`` with max_tokens clipped to what the context leaves after a
  ``prompt_len``-token prompt, printing one line when it is (a prompt that
  fills the context is the engine's refusal)."""
  room = max_model_len - prompt_len
  if not 0 < room < sampling.max_tokens:
    return sampling
  print(f"[{rid}] --max_tokens={sampling.max_tokens} clipped to {room}: the engine's "
        f"max_model_len={max_model_len} leaves {room} tokens after the {prompt_len}-token "
        f"prompt")
  return dataclasses.replace(sampling, max_tokens=room)


def main(argv):
  del argv
  # Checked before the model loads: a bad sampling flag or a missing prompt
  # is one line, not a wait for the weights first.
  sampling = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature,
                            top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.seed)
  texts = prompt_texts()
  engine, _, tokenizer = launch.build_engine()
  max_model_len = engine.config.max_model_len     # the banner's "context" says it
  detok = {}
  for rid, text, chat in texts:
    print(f"[{rid}] >>> {text}")
    ids = _token_ids(tokenizer, text, chat)
    engine.add_request(rid, ids, fit_context(rid, len(ids), sampling, max_model_len))
    detok[rid] = tokenizer.detokenizer(skip_special_tokens=True)
  single = len(detok) == 1
  pending = {rid: "" for rid in detok}   # several answers: streamed by line
  while engine.has_unfinished():
    for out in engine.step():
      piece = detok[out.request_id].push_many(out.new_token_ids)
      if out.finished:          # the held bytes of an unfinished character
        piece += detok[out.request_id].flush()
      if single:
        print(piece, end="", flush=True)
      else:
        buf = pending[out.request_id] + piece
        *lines, buf = buf.split("\n")
        if len(buf) >= 72 or out.finished:
          lines, buf = lines + [buf], ""
        for line in lines:
          if line.strip():
            print(f"[{out.request_id}] {line}", flush=True)
        pending[out.request_id] = buf
      if out.finished:
        print(f"{chr(10) if single else ''}[{out.request_id}] <{out.outcome}: "
              f"{out.finish_reason}>", flush=True)
  for rid, req in engine.requests.items():
    text = detok[rid].text      # == tokenizer.decode(output ids), as streamed
    print(f"\n=== {rid} ({req.outcome}, {len(req.output_token_ids)} tokens)\n{text}")
  if engine.config.speculation is not None:
    spec = engine.spec_counts.stats()
    print("\n" + report_text.format_spec_decode(spec, engine.config.speculative))


if __name__ == "__main__":
  cli.run(main)
