"""HF ``config.json`` -> ``ModelConfig`` for each supported family.

``from_hf`` reads a checkpoint's ``config.json`` (as a dict) the way
transformers 5 does (its ``configuration_*.py`` defaults and
``modeling_rope_utils``), in either config format:

* transformers < 5: ``rope_theta`` + ``rope_scaling`` (+ Gemma 3's
  ``rope_local_base_freq``);
* transformers 5: ``rope_parameters`` (``{rope_type, rope_theta, factor,
  ...}``; for Gemma 3 keyed by layer type ``{"full_attention": {...},
  "sliding_attention": {...}}``).

Nothing is dropped silently. Every key of ``config.json`` is either one the
mapping reads (``IMPLEMENTED[family]``), one known not to change the
forward pass (``NO_EFFECT[family]``, with the reason), or refused with a
``ModelLoadError`` naming the file and the key (unless its value is null,
false or empty, which no family gives a meaning). Unsupported values of
implemented keys (a RoPE kind, ``mlp_bias``, ``mlp_only_layers``, ...) are
refused the same way.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Optional, Union

from models.config import ModelConfig, RopeConfig


class ModelLoadError(ValueError):
  """A model source is missing, malformed or unsupported (one line naming
  the file and the field or tensor at fault)."""


# --------------------------------------------------------------------------
# Key sets


# Keys of every family's config.json that do not change inference.
_COMMON_NO_EFFECT = {
    "architectures": "names the transformers class; model_type selects the mapping",
    "transformers_version": "provenance",
    "torch_dtype": "storage dtype; the engine's dtype is --dtype",
    "dtype": "storage dtype; the engine's dtype is --dtype",
    "_name_or_path": "provenance",
    "_model_name_or_path": "provenance (written by transformers' GGUF reader)",
    "auto_map": "remote-code class pointers; model_type selects the mapping",
    "initializer_range": "weight initialisation only",
    "use_cache": "transformers' KV-cache switch",
    "attention_dropout": "dropout: off at inference",
    "pad_token_id": "padding id: the engine packs requests without padding",
    "unk_token_id": "a tokenizer id: the tokenizer comes from tokenizer.json",
    "bos_token_id": "BOS is what the tokenizer's post-processor prepends",
    "cache_implementation": "transformers' cache class (numerics unchanged)",
    "chunk_size_feed_forward": "chunking the MLP over rows does not change it",
    "output_attentions": "transformers output switch",
    "output_hidden_states": "transformers output switch",
    "return_dict": "transformers output switch",
    "tokenizer_class": "the tokenizer comes from tokenizer.json",
    "id2label": "classification heads only",
    "label2id": "classification heads only",
    "problem_type": "classification heads only",
    "finetuning_task": "provenance",
    "task_specific_params": "generate() defaults; sampling comes from each request",
}
# transformers' generate() defaults: sampling comes from each request.
for _key in ("temperature", "top_k", "top_p", "typical_p", "do_sample", "max_length",
             "min_length", "num_beams", "num_beam_groups", "diversity_penalty",
             "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
             "encoder_no_repeat_ngram_size", "num_return_sequences", "early_stopping",
             "bad_words_ids", "forced_bos_token_id", "forced_eos_token_id",
             "decoder_start_token_id", "sep_token_id", "suppress_tokens",
             "begin_suppress_tokens", "output_scores", "return_dict_in_generate",
             "remove_invalid_values", "exponential_decay_length_penalty"):
  _COMMON_NO_EFFECT[_key] = "a generate() default; sampling comes from each request"

_ROUTER_TRAINING = {
    "output_router_logits": "router logits output for the auxiliary loss (training)",
    "router_aux_loss_coef": "auxiliary load-balancing loss (training)",
}

NO_EFFECT: dict[str, dict[str, str]] = {
    "llama": {"pretraining_tp": "transformers 5 does not read it (v4's split matmul "
                                "is the same linear map)"},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "gemma2": {"hidden_act": "transformers' Gemma reads hidden_activation",
               "sliding_window_size": "legacy copy; transformers reads sliding_window"},
    "gemma3_text": {"hidden_act": "transformers' Gemma reads hidden_activation",
                    "_sliding_window_pattern": "private copy; transformers reads "
                                               "layer_types / sliding_window_pattern"},
    "phi3": {"resid_pdrop": "dropout: off at inference",
             "embd_pdrop": "dropout: off at inference"},
    "mixtral": {**_ROUTER_TRAINING,
                "router_jitter_noise": "router noise, applied only in training"},
    "qwen3_moe": {**_ROUTER_TRAINING,
                  "intermediate_size": "the dense MLP width of mlp_only_layers "
                                       "(none: every layer is a mixture)",
                  "max_window_layers": "transformers' Qwen3-MoE does not read it"},
}
for _family in NO_EFFECT:
  NO_EFFECT[_family] = {**_COMMON_NO_EFFECT, **NO_EFFECT[_family]}

_COMMON_IMPLEMENTED = {
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "eos_token_id", "rope_theta", "rope_scaling", "rope_parameters",
    "original_max_position_embeddings"}
_GEMMA = {"hidden_activation", "attention_bias", "query_pre_attn_scalar", "sliding_window",
          "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
          "use_bidirectional_attention", "intermediate_size"}
IMPLEMENTED: dict[str, frozenset] = {
    family: frozenset(_COMMON_IMPLEMENTED | extra) for family, extra in {
        "llama": {"hidden_act", "intermediate_size", "attention_bias", "mlp_bias"},
        "mistral": {"hidden_act", "intermediate_size", "sliding_window"},
        "qwen2": {"hidden_act", "intermediate_size", "use_sliding_window", "sliding_window",
                  "max_window_layers", "layer_types"},
        "qwen3": {"hidden_act", "intermediate_size", "attention_bias", "use_sliding_window",
                  "sliding_window", "max_window_layers", "layer_types"},
        "gemma2": _GEMMA,
        "gemma3_text": _GEMMA | {"sliding_window_pattern", "rope_local_base_freq"},
        "phi3": {"hidden_act", "intermediate_size", "sliding_window", "partial_rotary_factor"},
        "mixtral": {"hidden_act", "intermediate_size", "sliding_window", "num_local_experts",
                    "num_experts", "num_experts_per_tok"},
        "qwen3_moe": {"hidden_act", "attention_bias", "use_sliding_window", "sliding_window",
                      "num_experts", "num_local_experts", "num_experts_per_tok",
                      "norm_topk_prob", "moe_intermediate_size", "mlp_only_layers",
                      "decoder_sparse_step"},
    }.items()}

FAMILIES = tuple(IMPLEMENTED)

# transformers 5's class defaults for keys a config.json may leave out.
_DEFAULTS = {
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, num_key_value_heads=None,
                  head_dim=None, tie_word_embeddings=False, rope_theta=10000.0),
    "mistral": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, num_key_value_heads=8,
                    head_dim=None, tie_word_embeddings=False, rope_theta=10000.0,
                    sliding_window=4096),
    "qwen2": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=32,
                  head_dim=None, tie_word_embeddings=False, rope_theta=10000.0,
                  sliding_window=4096, max_window_layers=28),
    "qwen3": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=32,
                  head_dim=128, tie_word_embeddings=False, rope_theta=10000.0,
                  sliding_window=4096, max_window_layers=28),
    "gemma2": dict(rms_norm_eps=1e-6, max_position_embeddings=8192, num_key_value_heads=4,
                   head_dim=256, tie_word_embeddings=True, rope_theta=10000.0,
                   sliding_window=4096, query_pre_attn_scalar=256,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(rms_norm_eps=1e-6, max_position_embeddings=131072,
                        num_key_value_heads=4, head_dim=256, tie_word_embeddings=True,
                        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                        sliding_window=4096, query_pre_attn_scalar=256,
                        final_logit_softcapping=None, attn_logit_softcapping=None,
                        sliding_window_pattern=6),
    "phi3": dict(rms_norm_eps=1e-5, max_position_embeddings=4096, num_key_value_heads=None,
                 head_dim=None, tie_word_embeddings=False, rope_theta=10000.0,
                 sliding_window=None),
    "mixtral": dict(rms_norm_eps=1e-5, max_position_embeddings=131072, num_key_value_heads=8,
                    head_dim=None, tie_word_embeddings=False, rope_theta=1_000_000.0,
                    sliding_window=None, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=4,
                      head_dim=None, tie_word_embeddings=False, rope_theta=10000.0,
                      sliding_window=4096, num_experts=128, num_experts_per_tok=8,
                      norm_topk_prob=False, moe_intermediate_size=768),
}

# RoPE parameter keys each kind reads (transformers' modeling_rope_utils).
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta", "partial_rotary_factor",
                "original_max_position_embeddings"},
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor"},
    "yarn": {"factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
}
for _kind in ("linear", "dynamic", "llama3", "yarn"):
  _ROPE_KEYS[_kind] = _ROPE_KEYS[_kind] | _ROPE_KEYS["default"]

_LAYER_TYPES = ("full_attention", "sliding_attention")


# --------------------------------------------------------------------------
# Reading helpers


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


def _trivial(value: Any) -> bool:
  """null, false or empty: no family gives these a meaning."""
  return value is None or value is False or (isinstance(value, (list, dict, str))
                                             and not value)


class _Reader:
  """Reads keys of one config.json with the family's defaults; every
  refusal names the file and the key."""

  def __init__(self, hf: dict, where: str, family: str):
    self.hf, self.where, self.family = hf, where, family
    self.defaults = _DEFAULTS[family]

  def refuse(self, key: str, why: str):
    raise ModelLoadError(f"{self.where}: {key} {why}")

  def has(self, key: str) -> bool:
    return key in self.hf

  def get(self, key: str, default: Any = ...):
    assert key in IMPLEMENTED[self.family], (self.family, key)
    if key in self.hf:
      return self.hf[key]
    if default is ...:
      return self.defaults.get(key)
    return default

  def need(self, key: str):
    if self.hf.get(key) is None:
      self.refuse(key, "is missing")
    return self.hf[key]

  def number(self, key: str, default: Any = ..., *, integer=False, allow_none=False):
    value = self.get(key, default)
    if value is None and allow_none:
      return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
      self.refuse(key, f"must be {'an int' if integer else 'a number'}, got {_short(value)}")
    return value

  def flag(self, key: str, default: Any = ...) -> bool:
    value = self.get(key, default)
    if value is None:
      return False
    if not isinstance(value, bool):
      self.refuse(key, f"must be a bool, got {_short(value)}")
    return value


def _check_keys(r: _Reader):
  implemented, no_effect = IMPLEMENTED[r.family], NO_EFFECT[r.family]
  for key, value in r.hf.items():
    if key in implemented or key in no_effect or _trivial(value):
      continue
    r.refuse(key, f"= {_short(value)} is not supported for model_type {r.family!r} "
                  "(it may change the forward pass and is not implemented)")


# --------------------------------------------------------------------------
# RoPE


def _rope_dicts(r: _Reader) -> tuple[dict, Optional[dict], bool]:
  """``(global params, sliding-layer params or None, nested)`` with
  ``rope_type`` and ``rope_theta`` filled in as transformers 5 does."""
  hf = r.hf
  scaling = copy.deepcopy(hf.get("rope_scaling"))
  params = copy.deepcopy(hf.get("rope_parameters"))
  for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
    if value is not None and not isinstance(value, dict):
      r.refuse(key, f"must be an object or null, got {_short(value)}")
  nested = bool(params) and set(params) <= set(_LAYER_TYPES)
  if r.family == "gemma3_text":
    if params and not nested:
      r.refuse("rope_parameters", "must be keyed by layer type (full_attention, "
                                  f"sliding_attention) for gemma3_text, got {_short(params)}")
    params = params or {}
    full = params.get("full_attention") or {"rope_type": "default"}
    local = params.get("sliding_attention") or {"rope_type": "default"}
    if scaling:
      full.update(scaling)
    full.setdefault("rope_theta", r.number("rope_theta"))
    local.setdefault("rope_theta", r.number("rope_local_base_freq"))
    return full, local, True
  if nested:
    r.refuse("rope_parameters", f"is keyed by layer type, which model_type {r.family!r} "
                                "does not have")
  params = scaling or params or {}
  params.setdefault("rope_theta", r.number("rope_theta"))
  if r.family == "phi3" and r.has("partial_rotary_factor"):
    params.setdefault("partial_rotary_factor", r.hf["partial_rotary_factor"])
  return params, None, False


def _rope(r: _Reader, params: dict, field: str, nested: bool, head_dim: int,
          max_position: int) -> tuple[RopeConfig, int]:
  """``(RopeConfig, rotary_dim)`` of one rope parameter dict."""
  kind = params.get("rope_type", params.get("type", "default"))
  if r.family == "phi3" and kind in ("su", "yarn", "longrope"):
    r.refuse(f"{field}.rope_type", f"= {kind!r} (Phi-3 longrope) is not supported")
  if kind not in _ROPE_KEYS:
    r.refuse(f"{field}.rope_type", f"= {kind!r} is not supported; supported: "
                                   f"{sorted(_ROPE_KEYS)}")
  for key, value in params.items():
    if key not in _ROPE_KEYS[kind] and value is not None:
      r.refuse(f"{field}.{key}", f"= {_short(value)} is not supported with rope_type {kind!r}")

  def num(key, default=...):
    value = params.get(key, default)
    if value is ...:
      r.refuse(f"{field}.{key}", f"is required for rope_type {kind!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      r.refuse(f"{field}.{key}", f"must be a number, got {_short(value)}")
    return value

  theta = num("rope_theta")
  partial = num("partial_rotary_factor", 1.0)
  if partial != 1.0 and r.family != "phi3":
    r.refuse(f"{field}.partial_rotary_factor", f"= {partial} is not supported for "
                                                f"model_type {r.family!r}")
  rotary_dim = int(head_dim * partial)
  original = params.get("original_max_position_embeddings")
  if kind in ("llama3", "yarn"):  # standardize_rope_params: the top-level key wins
    if not nested and r.has("original_max_position_embeddings"):
      original = r.hf["original_max_position_embeddings"]
    original = max_position if original is None else original
    if isinstance(original, bool) or not isinstance(original, int):
      r.refuse(f"{field}.original_max_position_embeddings",
               f"must be an int, got {_short(original)}")
  try:
    if kind in ("default", "dynamic"):
      # dynamic NTK scales only past max_position_embeddings, which the
      # engine never reaches: within the context it is the default.
      return RopeConfig(theta=theta), rotary_dim
    if kind == "linear":
      return RopeConfig(kind="linear", theta=theta, factor=num("factor")), rotary_dim
    if kind == "llama3":
      return RopeConfig(kind="llama3", theta=theta, factor=num("factor"),
                        low_freq_factor=num("low_freq_factor"),
                        high_freq_factor=num("high_freq_factor"),
                        original_max_position=original), rotary_dim
    factor = params.get("factor", ...)
    factor = max_position / original if factor is None else num("factor")
    attention = params.get("attention_factor")
    if attention is None:
      mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

      def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

      attention = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
                   if mscale and mscale_all else get_mscale(factor))
    truncate = params.get("truncate", True)
    if nested and truncate is not True:  # transformers reads truncate at the top level
      r.refuse(f"{field}.truncate", "is not supported in per-layer rope_parameters")
    return RopeConfig(kind="yarn", theta=theta, factor=factor,
                      original_max_position=original,
                      beta_fast=params.get("beta_fast") or 32.0,
                      beta_slow=params.get("beta_slow") or 1.0,
                      attention_factor=float(attention), truncate=bool(truncate)), rotary_dim
  except ValueError as e:
    raise ModelLoadError(f"{r.where}: {field}: {e}") from e


# --------------------------------------------------------------------------
# Windows, experts


def _layer_types(r: _Reader, n_layers: int, default: list) -> list:
  types = r.get("layer_types", None)
  if types is None:
    return default
  if (not isinstance(types, list) or len(types) != n_layers
      or any(t not in _LAYER_TYPES for t in types)):
    r.refuse("layer_types", f"must list {n_layers} of {_LAYER_TYPES}, got {_short(types)}")
  return types


def _windows(r: _Reader, n_layers: int, max_position: int) -> tuple[int, ...]:
  """Per-layer sliding window (0: global), as transformers 5's modeling
  files decide it; a window covering the whole context is global."""
  family = r.family
  if family == "llama":
    return ()
  if family in ("qwen2", "qwen3", "qwen3_moe") and not r.flag("use_sliding_window", False):
    window = None
  else:
    window = r.number("sliding_window", integer=True, allow_none=True)
  if window is not None and window <= 0:
    r.refuse("sliding_window", f"must be a positive int or null, got {window}")
  if family in ("qwen2", "qwen3"):
    first = r.number("max_window_layers", integer=True, allow_none=True) or 0
    types = _layer_types(r, n_layers, [
        "sliding_attention" if window is not None and i >= first else "full_attention"
        for i in range(n_layers)])
  elif family == "gemma2":
    types = _layer_types(r, n_layers, [_LAYER_TYPES[(i + 1) % 2] for i in range(n_layers)])
  elif family == "gemma3_text":
    pattern = r.number("sliding_window_pattern", integer=True)
    if pattern <= 0:
      r.refuse("sliding_window_pattern", f"must be a positive int, got {pattern}")
    types = _layer_types(r, n_layers, [_LAYER_TYPES[bool((i + 1) % pattern)]
                                       for i in range(n_layers)])
  else:  # mistral, phi3, mixtral, qwen3_moe: every layer
    types = ["sliding_attention"] * n_layers
  if window is None or window >= max_position:
    return ()
  return tuple(window if t == "sliding_attention" else 0 for t in types)


def _experts(r: _Reader) -> dict:
  if r.family == "mixtral":
    key = "num_local_experts" if r.has("num_local_experts") or not r.has("num_experts") \
        else "num_experts"
    return dict(num_experts=r.number(key, integer=True),
                experts_per_token=r.number("num_experts_per_tok", integer=True),
                norm_topk_prob=True, ffn_dim=r.need("intermediate_size"))
  if r.family == "qwen3_moe":
    only = r.get("mlp_only_layers", None)
    if only:
      r.refuse("mlp_only_layers", f"= {_short(only)} is not supported (dense layers in a "
                                  "mixture of experts)")
    step = r.number("decoder_sparse_step", 1, integer=True)
    if step != 1:
      r.refuse("decoder_sparse_step", f"= {step} is not supported (only 1: every layer "
                                      "a mixture)")
    key = "num_experts" if r.has("num_experts") or not r.has("num_local_experts") \
        else "num_local_experts"
    return dict(num_experts=r.number(key, integer=True),
                experts_per_token=r.number("num_experts_per_tok", integer=True),
                norm_topk_prob=r.flag("norm_topk_prob"),
                ffn_dim=r.number("moe_intermediate_size", integer=True))
  return dict(ffn_dim=r.need("intermediate_size"))


# --------------------------------------------------------------------------
# Entry point


def _eos(r: _Reader, generation: Optional[dict]) -> tuple[int, ...]:
  where_gen = Path(r.where).parent / "generation_config.json"
  out = []
  for source, value, field in ((r.where, r.hf.get("eos_token_id"), "eos_token_id"),
                               (where_gen, (generation or {}).get("eos_token_id"),
                                "eos_token_id")):
    values = value if isinstance(value, list) else [] if value is None else [value]
    for token in values:
      if isinstance(token, bool) or not isinstance(token, int):
        raise ModelLoadError(f"{source}: {field} must be an int or a list of ints, "
                             f"got {_short(value)}")
      if token not in out:
        out.append(token)
  if not out:
    raise ModelLoadError(f"{r.where}: eos_token_id is missing (and {where_gen.name} "
                         "gives none)")
  return tuple(out)


def from_hf(hf: dict, *, where: Union[str, Path], tokenizer_bos: Optional[int],
            generation: Optional[dict], name: str) -> ModelConfig:
  """Maps an HF ``config.json`` to a ``ModelConfig``.

  Args:
    hf: the parsed ``config.json``.
    where: its path, for messages.
    tokenizer_bos: the id the tokenizer's post-processor prepends, or None.
    generation: the parsed ``generation_config.json`` or None; its
      ``eos_token_id`` (int or list) adds to ``config.json``'s.
    name: ``ModelConfig.name``.

  Returns:
    The ``ModelConfig`` with every switch the family implies.

  Raises:
    ModelLoadError: one line naming ``where`` and the key: an unknown or
      unsupported ``model_type``, a key that changes the forward pass but
      is not implemented, an unsupported value (RoPE kind, ``mlp_bias``,
      ``mlp_only_layers``, ...), a missing or mistyped key, or values
      ``ModelConfig`` rejects.
  """
  where = str(where)
  if not isinstance(hf, dict):
    raise ModelLoadError(f"{where}: must be a JSON object")
  family = hf.get("model_type")
  if family == "gemma3":
    raise ModelLoadError(f"{where}: model_type 'gemma3' is the multimodal Gemma 3 "
                         "(vision tower + text_config); only its text model "
                         "(model_type gemma3_text) is supported")
  if family not in IMPLEMENTED:
    raise ModelLoadError(f"{where}: model_type is {family!r}; supported: "
                         f"{', '.join(FAMILIES)}")
  r = _Reader(hf, where, family)
  _check_keys(r)
  gemma = family in ("gemma2", "gemma3_text")
  if gemma:
    act = r.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
      r.refuse("hidden_activation", f"= {_short(act)} is not supported (gelu_pytorch_tanh)")
    if r.flag("use_bidirectional_attention", False):
      r.refuse("use_bidirectional_attention", "= true is not supported (causal decoding)")
  else:
    act = r.get("hidden_act", "silu")
    if act != "silu":
      r.refuse("hidden_act", f"= {_short(act)} is not supported (silu)")
  if family == "llama" and r.flag("mlp_bias", False):
    r.refuse("mlp_bias", "= true is not supported (MLP biases)")
  d_model = r.number("hidden_size", None, integer=True, allow_none=True)
  n_heads = r.number("num_attention_heads", None, integer=True, allow_none=True)
  n_layers = r.number("num_hidden_layers", None, integer=True, allow_none=True)
  for key, value in (("hidden_size", d_model), ("num_attention_heads", n_heads),
                     ("num_hidden_layers", n_layers)):
    if value is None or value <= 0:
      r.refuse(key, "is missing" if value is None else f"must be positive, got {value}")
  head_dim = r.number("head_dim", integer=True, allow_none=True) or d_model // n_heads
  max_position = r.number("max_position_embeddings", integer=True)
  rope_params, local_params, nested = _rope_dicts(r)
  field = "rope_parameters.full_attention" if nested else (
      "rope_scaling" if r.hf.get("rope_scaling") else "rope_parameters")
  rope, rotary_dim = _rope(r, rope_params, field, nested, head_dim, max_position)
  rope_local = None
  if local_params is not None:
    rope_local, _ = _rope(r, local_params, "rope_parameters.sliding_attention", nested,
                          head_dim, max_position)
  windows = _windows(r, n_layers, max_position)
  if not windows or rope_local == rope:
    rope_local = None
  bias = r.flag("attention_bias", False) if r.family not in ("mistral", "qwen2", "phi3",
                                                             "mixtral") else False
  fields = dict(
      vocab_size=r.need("vocab_size"), d_model=d_model, n_layers=n_layers, n_heads=n_heads,
      n_kv_heads=r.number("num_key_value_heads", integer=True, allow_none=True) or n_heads,
      head_dim=head_dim, rope_theta=rope.theta, rope=rope, rope_local=rope_local,
      rotary_dim=rotary_dim, rms_eps=r.number("rms_norm_eps"),
      tie_embeddings=r.flag("tie_word_embeddings"), max_position=max_position,
      bos_token_id=tokenizer_bos, eos_token_ids=_eos(r, generation), name=name,
      family=family, qkv_bias=bias or family == "qwen2", o_bias=bias,
      qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"), layer_windows=windows,
      **_experts(r))
  if gemma:
    scalar = r.number("query_pre_attn_scalar")
    if scalar <= 0:
      r.refuse("query_pre_attn_scalar", f"must be positive, got {scalar}")
    fields.update(
        norm_style="gemma", post_norms=True, activation="gelu_tanh", scale_embeddings=True,
        attn_scale=scalar ** -0.5,
        attn_softcap=r.number("attn_logit_softcapping", allow_none=True),
        final_softcap=r.number("final_logit_softcapping", allow_none=True))
  try:
    return ModelConfig(**fields)
  except ValueError as e:
    raise ModelLoadError(f"{where}: invalid config: {e}") from e
