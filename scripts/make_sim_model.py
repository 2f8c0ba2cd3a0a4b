"""Writes a weightless model directory for the simulated executor.

  python scripts/make_sim_model.py --preset=mistral-7b-v0.1 --out=runs/models/mistral-7b-v0.1
  python scripts/replay.py --executor=simulated --model=runs/models/mistral-7b-v0.1 \\
      --cost_model=profile:a100 ...

The simulated executor reads a model's ``config.json`` and tokenizer and no
weights (``models.loaders.load_config``); its cost model takes FLOPs and bytes
from the config's shapes. This writes ``config.json`` and
``generation_config.json`` with the published shapes of the preset (copied by
hand from the model's release on the Hugging Face hub, see ``PRESETS``) and a
stand-in tokenizer of the model's vocabulary size: a byte-level BPE with no
merges (text encodes one id per byte), the model's special tokens at their
published ids, and unreachable filler tokens in the other ids. Token counts of
text therefore differ from the real tokenizer's; trace replays give lengths in
tokens and draw prompt ids at random, so they never tokenize text. The
directory is derived data: keep it under runs/ (or anywhere outside the repo).
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from serving import cli

FLAGS = flags.FLAGS

# Published config.json values (keys the loader reads; the rest are inert).
_MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
PRESETS = {
    # mistralai/Mistral-7B-v0.1: 4,096-token sliding window, RoPE theta 1e4.
    "mistral-7b-v0.1": dict(_MISTRAL_7B, rope_theta=10000.0, sliding_window=4096),
    # mistralai/Mistral-7B-Instruct-v0.2 (the Sarathi-Serve paper's model): the
    # same shapes, global attention, RoPE theta 1e6.
    "mistral-7b-instruct-v0.2": dict(_MISTRAL_7B, rope_theta=1000000.0, sliding_window=None),
    # meta-llama/Llama-3.1-8B.
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "vocab_size": 128256, "bos_token_id": 128000,
        "eos_token_id": 128001, "torch_dtype": "bfloat16"},
    # meta-llama/Llama-2-13b-hf (a 13B-class model: DistServe's OPT-13B size).
    "llama-2-13b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
        "num_attention_heads": 40, "num_key_value_heads": 40, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "vocab_size": 32000, "bos_token_id": 1,
        "eos_token_id": 2, "torch_dtype": "float16"},
}
# Special tokens: (id, text); the first is the BOS the tokenizer prepends. By
# preset where it has its own, else by model_type.
_LLAMA3_NAMED = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>",
                 128006: "<|start_header_id|>", 128007: "<|end_header_id|>",
                 128008: "<|eom_id|>", 128009: "<|eot_id|>"}
SPECIALS = {
    "mistral": [(1, "<s>"), (0, "<unk>"), (2, "</s>")],
    "llama-2-13b": [(1, "<s>"), (0, "<unk>"), (2, "</s>")],    # Llama 2's SentencePiece ids
    "llama": [(128000, _LLAMA3_NAMED[128000])] + [
        (i, _LLAMA3_NAMED.get(i, f"<|reserved_special_token_{i - 128000}|>"))
        for i in range(128001, 128256)],
}

flags.DEFINE_enum("preset", "mistral-7b-v0.1", sorted(PRESETS), "Published model shape.")
flags.DEFINE_string("out", None, "Directory to write (created; files in it are replaced).")


def stand_in_tokenizer(vocab_size: int, specials: list):
  """A ``tokenizers.Tokenizer`` of exactly ``vocab_size`` ids: byte-level BPE
  without merges (256 byte symbols in the lowest free ids), ``specials``
  ((id, text) pairs, the first prepended as BOS) at their ids, filler tokens
  ``<filler_i>`` (never produced by encoding) in the ids left.

  Raises:
    ValueError: a special id outside [0, vocab_size), or fewer than 256 free ids.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
  taken = {i: text for i, text in specials}
  if any(not 0 <= i < vocab_size for i in taken):
    raise ValueError(f"special token ids {sorted(taken)} must lie in [0, {vocab_size})")
  free = [i for i in range(vocab_size) if i not in taken]
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  if len(free) < len(alphabet):
    raise ValueError(f"vocab_size {vocab_size} leaves {len(free)} ids for 256 bytes")
  vocab = dict((text, i) for i, text in taken.items())
  vocab.update(zip(alphabet, free))
  vocab.update((f"<filler_{i}>", i) for i in free[len(alphabet):])
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([text for _, text in specials])
  bos_id, bos = specials[0]
  tok.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
  return tok


def write_model_dir(preset: str, out) -> Path:
  """Writes ``preset``'s ``config.json``, ``generation_config.json``,
  ``tokenizer.json`` and ``tokenizer_config.json`` into ``out``; returns it.

  Raises:
    ValueError: an unknown preset.
  """
  if preset not in PRESETS:
    raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
  hf = PRESETS[preset]
  specials = SPECIALS.get(preset, SPECIALS[hf["model_type"]])
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
  (out / "generation_config.json").write_text(json.dumps(
      {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"]}, indent=2) + "\n")
  stand_in_tokenizer(hf["vocab_size"], specials).save(str(out / "tokenizer.json"))
  eos = next(text for i, text in specials if i == hf["eos_token_id"])
  (out / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0][1],
       "eos_token": eos, "model_max_length": hf["max_position_embeddings"],
       "clean_up_tokenization_spaces": False}, indent=2) + "\n")
  return out


def main(argv):
  del argv
  if not FLAGS.out:
    raise ValueError("--out must name the directory to write")
  cli.check_creatable("out", FLAGS.out, directory=True)
  out = write_model_dir(FLAGS.preset, FLAGS.out)
  print(f"wrote {FLAGS.preset} (config, generation config, stand-in tokenizer) to {out}")


if __name__ == "__main__":
  cli.run(main)
