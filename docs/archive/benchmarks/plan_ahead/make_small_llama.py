"""The small random-weight Llama of this folder's figures (HF layout).

  .venv/bin/python docs/archive/benchmarks/plan_ahead/make_small_llama.py \\
      runs/models/llama-small-4l

transformers' LlamaForCausalLM (seed 0): hidden 256, MLP 768, 4 layers, 8
query and 4 KV heads, vocabulary 4,096, float32; a word-level tokenizer
(``w3`` ... ``w4095``). Its decode step takes ~2 ms on the 2-core Xeon, the
regime where the host's share of an iteration is large.
"""

import sys

import tokenizers
import torch
import transformers


def main(out):
  vocab = 4096
  config = transformers.LlamaConfig(
      vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
  words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer.save(f"{out}/tokenizer.json")


if __name__ == "__main__":
  main(sys.argv[1])
