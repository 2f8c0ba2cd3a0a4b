"""Writers for small test models: a byte-level BPE vocabulary, GGUF files and
HF checkpoint directories built from ``models.llama`` params."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from tokenizers import pre_tokenizers


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
  """HF -> llama.cpp row order of a Q or K projection (what a GGUF stores;
  the inverse of ``models.loaders.unpermute_rotary``).

  Args:
    w: [n_heads * head_dim, d_in] torch-layout (``[out, in]``) weight.
    n_heads: heads in ``w`` (query heads for Q, KV heads for K).

  Returns:
    ``w`` with each head's rows reordered so that row ``2i`` is HF row ``i``
    and row ``2i + 1`` is HF row ``i + head_dim / 2`` (interleaved pairs).
  """
  rows = w.shape[0]
  head_dim = rows // n_heads
  return (w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def bpe_vocab():
  """(tokens, merges, token_types): specials, 256 byte symbols, some merges."""
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  tokens = list(SPECIALS) + alphabet
  merges = []
  letters = "etaoinshr"
  for a in letters:
    merges.append(f"Ġ {a}")
    tokens.append("Ġ" + a)
  for a in letters:
    for b in letters:
      merges.append(f"{a} {b}")
      tokens.append(a + b)
  merges.append("Ġt he")  # needs "Ġt" and "he" above
  tokens.append("Ġthe")
  merges.append("4 2")  # only reachable by pre-tokenizers that keep digits together
  tokens.append("42")
  types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
  return tokens, merges, types


def torch_layout(cfg, params):
  """name -> f32 [out, in] arrays with HF names (Q/K in HF row order)."""
  p = {k: np.asarray(v, np.float32) for k, v in _flatten(params).items()}
  out = {"model.embed_tokens.weight": p["embed/embedding"],
         "model.norm.weight": p["final_norm/scale"]}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = np.ascontiguousarray(p["lm_head"].T)
  for i in range(cfg.n_layers):
    pre = f"model.layers.{i}."
    out[pre + "input_layernorm.weight"] = p["layers/attn_norm/scale"][i]
    out[pre + "post_attention_layernorm.weight"] = p["layers/mlp_norm/scale"][i]
    for hf, ours in (("self_attn.q_proj", "attn/wq"), ("self_attn.k_proj", "attn/wk"),
                     ("self_attn.v_proj", "attn/wv"), ("self_attn.o_proj", "attn/wo"),
                     ("mlp.gate_proj", "mlp/w_gate"), ("mlp.up_proj", "mlp/w_up"),
                     ("mlp.down_proj", "mlp/w_down")):
      out[pre + hf + ".weight"] = np.ascontiguousarray(p["layers/" + ours][i].T)
  return out


def _flatten(tree, prefix=""):
  flat = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      flat.update(_flatten(v, f"{prefix}{k}/"))
    else:
      flat[prefix + k] = v
  return flat


_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
            "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name):
  if hf_name in _TO_GGUF:
    return _TO_GGUF[hf_name]
  _, _, layer, *rest = hf_name.split(".")
  module = ".".join(rest[:-1])
  return f"blk.{layer}.{_TO_GGUF[module]}.weight"


def gguf_tensors(cfg, params):
  """GGUF name -> f32 [out, in] array, Q/K rows permuted as llama.cpp does."""
  out = {}
  for name, w in torch_layout(cfg, params).items():
    if name.endswith("q_proj.weight"):
      w = permute_rotary(w, cfg.n_heads)
    elif name.endswith("k_proj.weight"):
      w = permute_rotary(w, cfg.n_kv_heads)
    out[gguf_name(name)] = w
  return out


def write_gguf(path, cfg, tensors, *, qtypes=None, drop_keys=(), vocab=None,
               shapes=None):
  """Writes a llama GGUF.

  Args:
    tensors: name -> f32 array (``gguf_tensors``) or (raw bytes, qtype).
    qtypes: name -> GGMLQuantizationType to quantize f32 arrays with
      (default F32).
    drop_keys: metadata keys to leave out.
  """
  tokens, merges, types = vocab or bpe_vocab()
  writer = gguf.GGUFWriter(str(path), "llama")
  meta = {
      "block_count": lambda: writer.add_block_count(cfg.n_layers),
      "context_length": lambda: writer.add_context_length(cfg.max_position),
      "embedding_length": lambda: writer.add_embedding_length(cfg.d_model),
      "feed_forward_length": lambda: writer.add_feed_forward_length(cfg.ffn_dim),
      "head_count": lambda: writer.add_head_count(cfg.n_heads),
      "head_count_kv": lambda: writer.add_head_count_kv(cfg.n_kv_heads),
      "rope_freq_base": lambda: writer.add_rope_freq_base(cfg.rope_theta),
      "rms_eps": lambda: writer.add_layer_norm_rms_eps(cfg.rms_eps),
      "rope_dims": lambda: writer.add_rope_dimension_count(cfg.head_dim),
      "vocab_size": lambda: writer.add_vocab_size(cfg.vocab_size),
      "tokenizer_model": lambda: writer.add_tokenizer_model("gpt2"),
      "tokenizer_pre": lambda: writer.add_tokenizer_pre("smollm"),
      "tokens": lambda: writer.add_token_list(tokens),
      "merges": lambda: writer.add_token_merges(merges),
      "token_types": lambda: writer.add_token_types(types),
      "bos": lambda: writer.add_bos_token_id(1),
      "eos": lambda: writer.add_eos_token_id(cfg.eos_token_ids[0]),
      "add_bos": lambda: writer.add_add_bos_token(False),
      "chat_template": lambda: writer.add_chat_template(CHAT_TEMPLATE),
  }
  for key, add in meta.items():
    if key not in drop_keys:
      add()
  qtypes = qtypes or {}
  for name, w in tensors.items():
    if isinstance(w, tuple):
      raw, qtype = w
      writer.add_tensor(name, raw, raw_dtype=qtype)
      continue
    qtype = qtypes.get(name, gguf.GGMLQuantizationType.F32)
    if qtype == gguf.GGMLQuantizationType.F32:
      writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
    elif qtype == gguf.GGMLQuantizationType.F16:
      writer.add_tensor(name, np.asarray(w, np.float16))
    else:
      writer.add_tensor(name, gguf.quants.quantize(np.asarray(w, np.float32), qtype),
                        raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return Path(path)


def write_hf_dir(directory, cfg, params, tokenizer_backend):
  """HF checkpoint directory: config.json, model.safetensors, tokenizer files."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  save_file(torch_layout(cfg, params), str(directory / "model.safetensors"))
  (directory / "config.json").write_text(json.dumps({
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
      "intermediate_size": cfg.ffn_dim, "rope_theta": cfg.rope_theta,
      "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": cfg.max_position, "bos_token_id": 1,
      "eos_token_id": list(cfg.eos_token_ids), "rope_scaling": None,
      "hidden_act": "silu"}))
  tokenizer_backend.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": CHAT_TEMPLATE, "add_bos_token": False}))
  return directory
