"""Random HF checkpoints of every supported decoder family, written by transformers.

The independent reference for the family tests (``test_families.py``):
transformers builds each family from its own config class with random
weights, offline, and ``save_pretrained`` writes an ordinary checkpoint
directory (``config.json``, ``model.safetensors``, ``generation_config.json``)
beside a byte-level BPE tokenizer trained here on the repository's own text
(``tokenizer.json``, ``tokenizer_config.json`` with the chat template, or the
``chat_template.jinja`` file form). Our loader reads the directory, transformers
reads the same directory, and the two forwards are compared.

Each ``Family`` turns on the switches its real checkpoints use, at tiny
widths (hidden 64, 2 layers, 4 query heads over 2 KV heads, vocabulary 384):
windows shorter than the test prompts, soft-caps that bend the scores, biases
and norm scales drawn at random (transformers initialises them to 0 and 1,
which would hide a missing bias or a wrong ``1 + w``), a mixture of 4 experts
with top-2 routing. Weights are drawn at ``WEIGHT_STD`` (0.15, about 7x
transformers' 0.02), so that each block changes the residual stream, the next
token depends on the context, and the top-2 logit gaps stand far above
float32 rounding.

Needs torch and transformers (the ``reference`` extra); import it after
``pytest.importorskip``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import transformers
from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors, trainers)

REPO = Path(__file__).resolve().parents[2]
VOCAB_SIZE = 384
# Special tokens at ids 0..4 of every tokenizer here.
BOS, EOS, IM_START, IM_END, EOT = ("<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                    "<|eot|>")
SPECIALS = [BOS, EOS, IM_START, IM_END, EOT]
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, EOT_ID = range(5)
WEIGHT_STD = 0.15      # matrices and embeddings
BIAS_STD = 0.2         # q/k/v biases
NORM_STD = 0.3         # norm scales: 1 + N(0, 0.3) (Gemma: the stored w of 1 + w)
# Gemma adds the current token's embedding at sqrt(d) times its scale and
# reads logits through the same (tied) embedding: drawn like the others, that
# echo dominates and the model repeats its last token whatever the context.
# So Gemma's embedding is drawn smaller, its sandwich norms end each block at
# about 3x (w ~ 2) and the final norm at about 4x (w ~ 3): the blocks (the
# context) decide the next token and the logits keep their spread.
GEMMA_EMBED_STD = 0.3 * WEIGHT_STD
GEMMA_POST_NORM = 2.0
GEMMA_FINAL_NORM = 3.0
# Qwen2's split before the byte-level mapping (its tokenizer.json and
# transformers' Qwen2Tokenizer): single digits, letters with one leading
# non-letter, newlines apart.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
               r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=BOS_ID,
              eos_token_id=EOS_ID, pad_token_id=EOS_ID, tie_word_embeddings=False)


@dataclasses.dataclass(frozen=True)
class Family:
  """One family (or variant) of decoder checkpoints.

  Attributes:
    name: variant name, used as the checkpoint directory's name.
    model_class: transformers' ``*ForCausalLM`` class name.
    config: builds the transformers config (tiny widths, the family's switches).
    switches: what the variant turns on, in words (the docs table's column).
    adds_bos: the tokenizer's post-processor prepends ``<|bos|>``.
    legacy_rope: ``config.json`` is rewritten in transformers 4's form that
      most Hub checkpoints still carry (transformers 5 reads both): the
      value is the key naming the kind in ``rope_scaling`` ("rope_type", or
      "type" as in Qwen2.5's published yarn snippet); ``rope_theta``,
      ``partial_rotary_factor`` and Gemma 3's ``rope_local_base_freq`` at
      the top level. None: transformers 5's ``rope_parameters``.
    window_pattern: ``config.json``'s ``layer_types`` is replaced by the
      older ``sliding_window_pattern`` integer (Gemma 3 on the Hub).
    template_file: the chat template lives in ``chat_template.jinja``
      instead of ``tokenizer_config.json``.
    extra_eos: more end-of-sequence ids, in ``generation_config.json``
      (Llama 3's ``<|eot_id|>`` / ``<|eom_id|>``).
    shard_size: ``save_pretrained``'s ``max_shard_size``: several
      ``*.safetensors`` files with ``model.safetensors.index.json``.
    engine: the engine checks (greedy tokens, invariances) run on this
      variant; variants that only change the forward's numbers are checked
      by logits alone, to keep the suite's compile time down.
    pre_tokenizer: "gpt2" (GPT-2's byte-level split: Llama 3, Mistral's
      tekken-like files, ...) or "qwen2" (Qwen's split and NFC normaliser;
      transformers 5 rebuilds Qwen tokenizers from that definition,
      whatever tokenizer.json says, so the file must agree with it).
  """

  name: str
  model_class: str
  config: Callable[[], transformers.PretrainedConfig]
  switches: str
  adds_bos: bool = False
  legacy_rope: Optional[str] = None
  window_pattern: bool = False
  template_file: bool = False
  extra_eos: tuple[int, ...] = ()
  shard_size: Optional[str] = None
  engine: bool = True
  pre_tokenizer: str = "gpt2"


def _llama31():
  return transformers.LlamaConfig(**COMMON, rope_parameters=dict(
      rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
      high_freq_factor=4.0, original_max_position_embeddings=64))


def _llama32():
  return transformers.LlamaConfig(**{**COMMON, "tie_word_embeddings": True}, rope_parameters=dict(
      rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
      high_freq_factor=4.0, original_max_position_embeddings=32))


def _llama_dynamic():
  return transformers.LlamaConfig(**COMMON, rope_parameters=dict(
      rope_type="dynamic", rope_theta=10000.0, factor=2.0))


def _qwen2():
  return transformers.Qwen2Config(**COMMON, rope_parameters=dict(rope_type="default",
                                                                 rope_theta=1000000.0))


def _qwen2_yarn():
  return transformers.Qwen2Config(**COMMON, rope_parameters=dict(
      rope_type="yarn", rope_theta=1000000.0, factor=4.0,
      original_max_position_embeddings=64))


def _qwen3():
  return transformers.Qwen3Config(**COMMON, head_dim=32, rope_parameters=dict(
      rope_type="default", rope_theta=1000000.0))


def _mistral():
  return transformers.MistralConfig(**COMMON, sliding_window=8, rope_parameters=dict(
      rope_type="default", rope_theta=1000000.0))


def _gemma2():
  return transformers.Gemma2Config(
      **{**COMMON, "tie_word_embeddings": True}, head_dim=16, query_pre_attn_scalar=24,
      attn_logit_softcapping=4.0, final_logit_softcapping=8.0, sliding_window=8,
      hidden_activation="gelu_pytorch_tanh")


def _gemma3():
  return transformers.Gemma3TextConfig(
      **{**COMMON, "tie_word_embeddings": True}, head_dim=32, query_pre_attn_scalar=24,
      sliding_window=8, sliding_window_pattern=2, hidden_activation="gelu_pytorch_tanh",
      rope_parameters=dict(
          sliding_attention=dict(rope_type="default", rope_theta=10000.0),
          full_attention=dict(rope_type="linear", rope_theta=1000000.0, factor=4.0)))


def _phi3():
  return transformers.Phi3Config(**COMMON, sliding_window=8, rope_parameters=dict(
      rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.75))


def _mixtral():
  return transformers.MixtralConfig(**{**COMMON, "intermediate_size": 96},
                                    num_local_experts=4, num_experts_per_tok=2,
                                    rope_parameters=dict(rope_type="default",
                                                         rope_theta=1000000.0))


def _qwen3_moe(norm_topk_prob):
  def build():
    return transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
  return build


FAMILIES = {f.name: f for f in [
    Family("llama3.1", "LlamaForCausalLM", _llama31,
           "llama3 RoPE (config.json in the rope_scaling form), untied head, 3 EOS ids, "
           "sharded safetensors (index.json)", adds_bos=True, legacy_rope="rope_type",
           extra_eos=(IM_END_ID, EOT_ID), shard_size="150KB"),
    Family("llama3.2", "LlamaForCausalLM", _llama32,
           "llama3 RoPE (rope_parameters form), tied embeddings, chat_template.jinja",
           adds_bos=True, template_file=True, extra_eos=(EOT_ID,)),
    Family("llama-dynamic", "LlamaForCausalLM", _llama_dynamic,
           "dynamic NTK RoPE x2 (rope_scaling with 'type'; transformers scales only past "
           "max_position_embeddings, so within the context it is the default)",
           adds_bos=True, legacy_rope="type", engine=False),
    Family("qwen2.5", "Qwen2ForCausalLM", _qwen2,
           "q/k/v biases, theta 1e6, no BOS, Qwen2 tokenizer", pre_tokenizer="qwen2"),
    Family("qwen2.5-yarn", "Qwen2ForCausalLM", _qwen2_yarn,
           "q/k/v biases, yarn RoPE (factor 4 over 64 positions; rope_scaling with 'type')",
           legacy_rope="type", engine=False, pre_tokenizer="qwen2"),
    Family("qwen3", "Qwen3ForCausalLM", _qwen3,
           "per-head q/k RMSNorm, head_dim 32 != hidden / heads (16)", extra_eos=(IM_END_ID,),
           pre_tokenizer="qwen2"),
    Family("mistral", "MistralForCausalLM", _mistral,
           "sliding window 8 on every layer (prompts of 20-40 tokens)", adds_bos=True),
    Family("gemma2", "Gemma2ForCausalLM", _gemma2,
           "attention soft-cap 4, final soft-cap 8, sliding/global layers (window 8), "
           "query_pre_attn_scalar 24, GeGLU, sqrt(d) embeddings, 1 + w norms, sandwich norms",
           adds_bos=True),
    Family("gemma3", "Gemma3ForCausalLM", _gemma3,
           "sliding_window_pattern 2 (window 8), local RoPE theta 1e4, global linear RoPE x4 "
           "theta 1e6, q/k norm, head_dim 32, query_pre_attn_scalar 24, GeGLU, sandwich norms",
           adds_bos=True, window_pattern=True),
    Family("gemma3-legacy", "Gemma3ForCausalLM", _gemma3,
           "gemma3 in transformers 4's config form (rope_scaling linear, rope_local_base_freq, "
           "layer_types)", adds_bos=True, legacy_rope="rope_type", engine=False),
    Family("phi3", "Phi3ForCausalLM", _phi3,
           "fused qkv_proj and gate_up_proj, partial rotary 0.75 (top-level "
           "partial_rotary_factor), sliding window 8", legacy_rope="rope_type"),
    Family("mixtral", "MixtralForCausalLM", _mixtral,
           "4 experts, top-2 (softmax over the top 2)", adds_bos=True, legacy_rope="rope_type"),
    Family("qwen3-moe", "Qwen3MoeForCausalLM", _qwen3_moe(True),
           "4 experts, top-2, norm_topk_prob true, q/k norm", pre_tokenizer="qwen2"),
    Family("qwen3-moe-unnormed", "Qwen3MoeForCausalLM", _qwen3_moe(False),
           "4 experts, top-2, norm_topk_prob false (top-2 softmax weights kept)", engine=False,
           pre_tokenizer="qwen2"),
]}


# --------------------------------------------------------------------------
# Tokenizer


def corpus() -> list[str]:
  """The repository's own prose: README.md and docs/*.md, as paragraphs."""
  texts = []
  for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
    texts += [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
  return texts


def train_tokenizer(pre_tokenizer: str = "gpt2", vocab_size: int = VOCAB_SIZE) -> Tokenizer:
  """A byte-level BPE of ``vocab_size`` ids trained on ``corpus()``:
  ``SPECIALS`` at ids 0..4, the 256 byte symbols, then merges. No
  post-processor (``with_post_processor`` adds one).

  Args:
    pre_tokenizer: "gpt2" or "qwen2" (``Family.pre_tokenizer``).
    vocab_size: ids in all.
  """
  tok = Tokenizer(models.BPE())
  if pre_tokenizer == "qwen2":
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  else:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(corpus(), trainer)
  assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
  assert [tok.token_to_id(s) for s in SPECIALS] == list(range(len(SPECIALS)))
  return tok


def with_post_processor(tok: Tokenizer, adds_bos: bool) -> Tokenizer:
  """A copy of ``tok`` whose post-processor prepends ``<|bos|>`` (or, without
  BOS, the byte-level one that adds nothing)."""
  tok = Tokenizer.from_str(tok.to_str())
  if adds_bos:
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)])
  else:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  return tok


def _write_tokenizer(directory: Path, tok: Tokenizer, family: Family) -> None:
  tok = with_post_processor(tok, family.adds_bos)
  tok.save(str(directory / "tokenizer.json"))
  config = {"tokenizer_class": ("Qwen2Tokenizer" if family.pre_tokenizer == "qwen2"
                                else "PreTrainedTokenizerFast"), "eos_token": EOS,
            "pad_token": EOS, "bos_token": BOS if family.adds_bos else None,
            "model_max_length": 256, "clean_up_tokenization_spaces": False}
  if family.template_file:
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
  else:
    config["chat_template"] = CHAT_TEMPLATE
  (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


# --------------------------------------------------------------------------
# Weights and the checkpoint directory


def randomize(model: torch.nn.Module, seed: int, gemma: bool) -> None:
  """Draws every parameter: matrices N(0, WEIGHT_STD), biases N(0, BIAS_STD),
  norm scales around their neutral value (1, or 0 for Gemma's ``1 + w``;
  Gemma's exceptions above)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if "norm" in name:
        value = (0.0 if gemma else 1.0) + NORM_STD * noise
        if gemma and ("post_attention" in name or "post_feedforward" in name):
          value = value + GEMMA_POST_NORM
        elif gemma and name == "model.norm.weight":
          value = value + GEMMA_FINAL_NORM
      elif name.endswith(".bias"):
        value = BIAS_STD * noise
      elif gemma and name == "model.embed_tokens.weight":
        value = GEMMA_EMBED_STD * noise
      else:
        value = WEIGHT_STD * noise
      p.copy_(value.to(p.dtype))


def _legacy_rope(config: dict, kind_key: str) -> None:
  """``rope_parameters`` -> transformers 4's keys, in place."""
  rope = config.pop("rope_parameters")
  if "full_attention" in rope:          # Gemma 3: one entry per layer type
    local = rope["sliding_attention"]
    assert local["rope_type"] == "default"
    config["rope_local_base_freq"] = local["rope_theta"]
    rope = dict(rope["full_attention"])
  else:
    rope = dict(rope)
  config["rope_theta"] = rope.pop("rope_theta")
  partial = rope.pop("partial_rotary_factor", None)
  if partial is not None and partial != 1.0:
    config["partial_rotary_factor"] = partial
  kind = rope.pop("rope_type")
  config["rope_scaling"] = None if kind == "default" else {kind_key: kind, **rope}


def _rewrite_config(directory: Path, family: Family) -> None:
  path = directory / "config.json"
  config = json.loads(path.read_text())
  if family.legacy_rope:
    _legacy_rope(config, family.legacy_rope)
  if family.window_pattern:
    pattern = config["layer_types"].index("full_attention") + 1
    assert config["layer_types"] == [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(config["num_hidden_layers"])]
    del config["layer_types"]
    config.pop("_sliding_window_pattern", None)
    config["sliding_window_pattern"] = pattern
  path.write_text(json.dumps(config, indent=2))


def build_checkpoint(family: Family, directory: Path, tok: Callable[[str], Tokenizer], *,
                     dtype: str = "float32", seed: int = 0) -> Path:
  """Writes ``family``'s random checkpoint into ``directory`` (created).

  Args:
    family: the variant.
    directory: target; replaced when it exists.
    tok: pre-tokenizer kind -> the trained tokenizer (``train_tokenizer``).
    dtype: "float32", "bfloat16" or "float16": the dtype of the saved
      tensors (the weights are drawn in float32 and rounded).
    seed: weight seed; equal seeds give equal float32 weights, so the
      bfloat16 checkpoint is the float32 one rounded.

  Returns:
    ``directory``.
  """
  directory = Path(directory)
  if directory.exists():
    shutil.rmtree(directory)
  directory.mkdir(parents=True)
  config = family.config()
  config.architectures = [family.model_class]
  torch.manual_seed(seed)
  model = getattr(transformers, family.model_class)(config).eval()
  randomize(model, seed, gemma=config.model_type.startswith("gemma"))
  model = model.to(getattr(torch, dtype))
  model.config.dtype = dtype
  model.generation_config.eos_token_id = [EOS_ID, *family.extra_eos]
  model.generation_config.bos_token_id = BOS_ID
  model.generation_config.pad_token_id = EOS_ID
  model.save_pretrained(directory, **({"max_shard_size": family.shard_size}
                                      if family.shard_size else {}))
  _rewrite_config(directory, family)
  _write_tokenizer(directory, tok(family.pre_tokenizer), family)
  return directory


# --------------------------------------------------------------------------
# transformers' side


def hf_model(directory: Path, dtype: str = "float32") -> torch.nn.Module:
  """transformers' model of a checkpoint (eager attention: the reference
  implementation of soft-caps and windows)."""
  return transformers.AutoModelForCausalLM.from_pretrained(
      str(directory), dtype=getattr(torch, dtype), attn_implementation="eager").eval()


def hf_tokenizer(directory: Path):
  return transformers.AutoTokenizer.from_pretrained(str(directory))


def hf_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
  """f32[len(ids), vocab] logits of one sequence from position 0."""
  with torch.no_grad():
    out = model(torch.tensor([ids]), use_cache=False).logits[0]
  return out.float().numpy()


def hf_generate(model: torch.nn.Module, ids: list[int], num_new: int,
                stop_ids: Optional[tuple[int, ...]] = None) -> list[int]:
  """transformers' greedy continuation (``generate(do_sample=False)``) of one
  prompt: ``num_new`` tokens, or fewer when one of ``stop_ids`` ends it
  (None: nothing stops it, as the engine's ``ignore_eos``)."""
  # An EOS of None would fall back to generation_config.json's ids: an id
  # past the vocabulary never stops it.
  stop = list(stop_ids) if stop_ids else [model.config.vocab_size]
  config = transformers.GenerationConfig(do_sample=False, max_new_tokens=num_new,
                                         pad_token_id=EOS_ID, eos_token_id=stop)
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=int),
                         generation_config=config)
  return out[0, len(ids):].tolist()


def top2_gaps(logits: np.ndarray) -> np.ndarray:
  """f32[rows] the gap between each row's largest and second largest logit."""
  top = np.sort(logits, axis=-1)[:, -2:]
  return top[:, 1] - top[:, 0]
