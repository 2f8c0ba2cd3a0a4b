"""config.json -> ModelConfig for each family (models.hf_config).

The dicts below are shaped like the hub's config.json of each named model
(transformers 4.x format, as published); ``v5`` rewrites one in
transformers 5's ``rope_parameters`` format, which must map the same.
"""

import copy

import pytest

from models.config import RopeConfig
from models.hf_config import IMPLEMENTED, NO_EFFECT, ModelLoadError, from_hf

COMMON = {"attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
          "torch_dtype": "bfloat16", "transformers_version": "4.51.0"}

LLAMA_31_8B = {
    **COMMON, "architectures": ["LlamaForCausalLM"], "attention_bias": False,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256}
LLAMA_32_1B = {
    **LLAMA_31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "head_dim": 64, "tie_word_embeddings": True, "eos_token_id": 128001,
    "rope_scaling": {**LLAMA_31_8B["rope_scaling"], "factor": 32.0}}
QWEN25_7B = {
    **COMMON, "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 152064}
QWEN25_7B_YARN = {**QWEN25_7B, "max_position_embeddings": 131072, "rope_scaling": {
    "factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}
QWEN3_8B = {
    **COMMON, "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}
MISTRAL_7B = {
    **COMMON, "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "vocab_size": 32000}
GEMMA2_9B = {
    **COMMON, "architectures": ["Gemma2ForCausalLM"], "attention_bias": False,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "gemma2", "num_attention_heads": 16, "num_hidden_layers": 42,
    "num_key_value_heads": 8, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
    "sliding_window_size": 4096, "vocab_size": 256000}
GEMMA3_1B = {
    **COMMON, "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26,
    "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "vocab_size": 262144}
PHI3_MINI_4K = {
    **COMMON, "_name_or_path": "Phi-3-mini-4k-instruct",
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False,
    "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config"}, "bos_token_id": 1,
    "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
    "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "sliding_window": 2047, "tie_word_embeddings": False, "vocab_size": 32064}
MIXTRAL_8X7B = {
    **COMMON, "architectures": ["MixtralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "vocab_size": 32000}
QWEN3_30B_A3B = {
    **COMMON, "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "use_sliding_window": False, "vocab_size": 151936}

HUB = {"Llama-3.1-8B": LLAMA_31_8B, "Llama-3.2-1B": LLAMA_32_1B, "Qwen2.5-7B": QWEN25_7B,
       "Qwen2.5-7B-yarn": QWEN25_7B_YARN, "Qwen3-8B": QWEN3_8B, "Mistral-7B-v0.1": MISTRAL_7B,
       "gemma-2-9b": GEMMA2_9B, "gemma-3-1b": GEMMA3_1B, "Phi-3-mini-4k": PHI3_MINI_4K,
       "Mixtral-8x7B": MIXTRAL_8X7B, "Qwen3-30B-A3B": QWEN3_30B_A3B}


def load(hf, generation=None, bos=None):
  return from_hf(copy.deepcopy(hf), where="/m/config.json", tokenizer_bos=bos,
                 generation=generation, name="m")


def v5(hf):
  """``hf`` in transformers 5's format: rope_theta and rope_scaling folded
  into rope_parameters (keyed by layer type for Gemma 3)."""
  out = copy.deepcopy(hf)
  scaling = out.pop("rope_scaling", None) or {}
  if "type" in scaling:
    scaling["rope_type"] = scaling.pop("type")
  theta = out.pop("rope_theta")
  if out["model_type"] == "gemma3_text":
    out["rope_parameters"] = {
        "full_attention": {"rope_type": "default", **scaling, "rope_theta": theta},
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": out.pop("rope_local_base_freq")}}
  else:
    out["rope_parameters"] = {"rope_type": "default", **scaling, "rope_theta": theta}
  return out


@pytest.mark.parametrize("model", sorted(HUB))
def test_both_rope_formats_give_the_same_config(model):
  assert load(v5(HUB[model])) == load(HUB[model])


def test_llama31():
  cfg = load(LLAMA_31_8B, generation={"eos_token_id": [128001, 128009]}, bos=128000)
  assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
          cfg.ffn_dim, cfg.vocab_size) == (4096, 32, 32, 8, 128, 14336, 128256)
  assert cfg.rope == RopeConfig(kind="llama3", theta=500000.0, factor=8.0,
                                low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position=8192)
  assert cfg.rope_theta == 500000.0 and cfg.max_position == 131072
  assert cfg.eos_token_ids == (128001, 128008, 128009) and cfg.bos_token_id == 128000
  assert not (cfg.qkv_bias or cfg.o_bias or cfg.tie_embeddings or cfg.layer_windows)
  assert cfg.family == "llama" and cfg.rms_eps == 1e-5


def test_llama32_and_attention_bias():
  cfg = load(LLAMA_32_1B)
  assert cfg.tie_embeddings and cfg.head_dim == 64 and cfg.rope.factor == 32.0
  assert cfg.eos_token_ids == (128001,)
  cfg = load({**LLAMA_31_8B, "attention_bias": True})
  assert cfg.qkv_bias and cfg.o_bias


def test_qwen25_with_and_without_yarn():
  cfg = load(QWEN25_7B)
  assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm
  assert cfg.layer_windows == () and cfg.rope is None and cfg.rope_theta == 1e6
  assert (cfg.head_dim, cfg.n_kv_heads) == (128, 4)
  cfg = load(QWEN25_7B_YARN)
  assert cfg.rope == RopeConfig(kind="yarn", theta=1e6, factor=4.0,
                                original_max_position=32768,
                                attention_factor=0.1 * __import__("math").log(4.0) + 1)
  assert cfg.rope.cos_sin_scale == pytest.approx(1.1386294361)


def test_qwen2_sliding_window_layers_as_transformers_computes_them():
  hf = {**QWEN25_7B, "num_hidden_layers": 4, "use_sliding_window": True,
        "sliding_window": 64, "max_window_layers": 2}
  assert load(hf).layer_windows == (0, 0, 64, 64)
  types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
  assert load({**hf, "layer_types": types}).layer_windows == (64, 0, 64, 0)
  assert load({**hf, "use_sliding_window": False, "layer_types": types}).layer_windows == ()


def test_qwen3():
  cfg = load(QWEN3_8B)
  assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim == 128
  assert (cfg.n_heads * cfg.head_dim, cfg.d_model) == (4096, 4096)
  # head_dim decoupled from hidden_size / heads
  assert load({**QWEN3_8B, "head_dim": 64}).head_dim == 64


def test_mistral():
  cfg = load(MISTRAL_7B)
  assert cfg.layer_windows == (4096,) * 32 and cfg.head_dim == 128
  assert load({**MISTRAL_7B, "sliding_window": None}).layer_windows == ()
  # a window covering the whole context is global attention
  assert load({**MISTRAL_7B, "sliding_window": 32768}).layer_windows == ()


def test_gemma2():
  cfg = load(GEMMA2_9B)
  assert (cfg.norm_style, cfg.post_norms, cfg.activation, cfg.scale_embeddings) == (
      "gemma", True, "gelu_tanh", True)
  assert cfg.attn_scale == 256 ** -0.5 and cfg.attn_softcap == 50.0
  assert cfg.final_softcap == 30.0 and cfg.tie_embeddings and not cfg.qk_norm
  assert cfg.layer_windows == (4096, 0) * 21 and cfg.head_dim == 256
  types = ["full_attention", "sliding_attention"] * 21
  assert load({**GEMMA2_9B, "layer_types": types}).layer_windows == (0, 4096) * 21


def test_gemma3_text():
  cfg = load(GEMMA3_1B)
  assert cfg.qk_norm and cfg.post_norms and cfg.norm_style == "gemma"
  assert cfg.attn_softcap is None and cfg.final_softcap is None
  assert cfg.layer_windows == ((512,) * 5 + (0,)) * 4 + (512, 512)
  assert cfg.rope is None and cfg.rope_theta == 1e6
  assert cfg.rope_local == RopeConfig(theta=10000.0)
  assert cfg.eos_token_ids == (1, 106)
  cfg = load({**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
  assert cfg.rope == RopeConfig(kind="linear", theta=1e6, factor=8.0)
  assert cfg.rope_local == RopeConfig(theta=10000.0)
  assert load({**GEMMA3_1B, "sliding_window_pattern": 2}).layer_windows == (512, 0) * 13
  with pytest.raises(ModelLoadError, match=r"config.json: model_type 'gemma3' is the "
                                           r"multimodal Gemma 3"):
    load({"model_type": "gemma3", "text_config": GEMMA3_1B})


def test_phi3():
  cfg = load(PHI3_MINI_4K)
  assert cfg.layer_windows == (2047,) * 32 and cfg.rotary_dim == 96
  cfg = load({**PHI3_MINI_4K, "partial_rotary_factor": 0.5})
  assert cfg.rotary_dim == 48
  with pytest.raises(ModelLoadError, match=r"rope_scaling.rope_type = 'longrope' \(Phi-3 "
                                           "longrope\\) is not supported"):
    load({**PHI3_MINI_4K, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                                           "long_factor": [1.0] * 48}})
  with pytest.raises(ModelLoadError, match=r"rope_type = 'su'"):
    load({**PHI3_MINI_4K, "rope_scaling": {"type": "su"}})


def test_mixtral():
  cfg = load(MIXTRAL_8X7B)
  assert (cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob, cfg.ffn_dim) == (
      8, 2, True, 14336)
  assert cfg.rope_theta == 1e6 and cfg.layer_windows == ()


def test_qwen3_moe():
  cfg = load(QWEN3_30B_A3B)
  assert (cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob, cfg.ffn_dim) == (
      128, 8, True, 768)
  assert cfg.qk_norm and cfg.head_dim == 128
  assert not load({**QWEN3_30B_A3B, "norm_topk_prob": False}).norm_topk_prob
  # transformers 5's save_pretrained writes num_local_experts (its attribute map)
  hf = {**QWEN3_30B_A3B, "num_local_experts": 16}
  del hf["num_experts"]
  assert load(hf).num_experts == 16
  with pytest.raises(ModelLoadError, match=r"config.json: mlp_only_layers = \[0, 3\] is "
                                           "not supported"):
    load({**QWEN3_30B_A3B, "mlp_only_layers": [0, 3]})
  with pytest.raises(ModelLoadError, match=r"config.json: decoder_sparse_step = 2 is not "
                                           "supported"):
    load({**QWEN3_30B_A3B, "decoder_sparse_step": 2})


def test_yarn_attention_factor_from_mscale_and_defaults():
  rope = {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707,
          "beta_fast": None, "truncate": False}
  cfg = load({**QWEN25_7B, "rope_scaling": rope})
  assert cfg.rope.attention_factor == 1.0 and not cfg.rope.truncate
  assert (cfg.rope.beta_fast, cfg.rope.beta_slow) == (32.0, 1.0)
  # original_max_position_embeddings falls back to max_position_embeddings
  assert cfg.rope.original_max_position == 32768
  cfg = load({**QWEN25_7B, "rope_scaling": {"rope_type": "yarn", "factor": None,
                                            "original_max_position_embeddings": 8192}})
  assert cfg.rope.factor == 4.0


def test_dynamic_rope_is_default_within_the_context():
  cfg = load({**LLAMA_31_8B, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
  assert cfg.rope is None and cfg.rope_theta == 500000.0


def one_line_error(hf, *fragments):
  with pytest.raises(ModelLoadError) as info:
    load(hf)
  message = str(info.value)
  assert "\n" not in message and message.startswith("/m/config.json: "), message
  for fragment in fragments:
    assert fragment in message, message


def test_refusals_are_one_line_naming_the_field():
  one_line_error({**LLAMA_31_8B, "model_type": "gpt2"}, "model_type is 'gpt2'", "llama",
                 "qwen3_moe")
  one_line_error({**LLAMA_31_8B, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
                 "rope_scaling.rope_type = 'longrope' is not supported")
  one_line_error({**LLAMA_31_8B, "mlp_bias": True}, "mlp_bias = true is not supported")
  one_line_error({**LLAMA_31_8B, "attn_logit_softcapping": 50.0},
                 "attn_logit_softcapping = 50.0 is not supported for model_type 'llama'")
  one_line_error({**MISTRAL_7B, "some_new_switch": 3}, "some_new_switch = 3")
  one_line_error({**LLAMA_31_8B, "quantization_config": {"quant_method": "awq"}},
                 "quantization_config")
  one_line_error({**LLAMA_31_8B, "hidden_act": "gelu"}, "hidden_act = 'gelu'")
  one_line_error({**GEMMA2_9B, "use_bidirectional_attention": True},
                 "use_bidirectional_attention")
  one_line_error({**LLAMA_31_8B, "rope_scaling": {**LLAMA_31_8B["rope_scaling"],
                                                  "beta_fast": 4}},
                 "rope_scaling.beta_fast = 4 is not supported with rope_type 'llama3'")
  one_line_error({**LLAMA_31_8B, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                 "rope_scaling.low_freq_factor is required")
  one_line_error({k: v for k, v in LLAMA_31_8B.items() if k != "hidden_size"},
                 "hidden_size is missing")
  one_line_error({k: v for k, v in LLAMA_31_8B.items() if k != "eos_token_id"},
                 "eos_token_id is missing")
  one_line_error({**GEMMA2_9B, "layer_types": ["full_attention"]}, "layer_types must list 42")
  one_line_error({**QWEN3_8B, "partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5")
  one_line_error({**LLAMA_31_8B, "num_key_value_heads": 7}, "invalid config",
                 "n_kv_heads")


def test_null_false_and_empty_unknown_keys_are_accepted():
  cfg = load({**LLAMA_31_8B, "sliding_window": None, "mystery": False, "pruned_heads": {}})
  assert cfg == load(LLAMA_31_8B)


def test_key_sets_are_disjoint_and_cover_the_hub_configs():
  for family in IMPLEMENTED:
    assert not IMPLEMENTED[family] & set(NO_EFFECT[family]), family
  for hf in HUB.values():
    family = hf["model_type"]
    meaningful = {k for k, v in hf.items() if v not in (None, False, [], {})}
    assert meaningful <= IMPLEMENTED[family] | set(NO_EFFECT[family]), family


def test_configs_saved_by_transformers(tmp_path):
  transformers = pytest.importorskip("transformers")
  small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               eos_token_id=1)
  cases = [
      (transformers.LlamaConfig, dict(rope_scaling={
          "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
       dict(rope=RopeConfig(kind="llama3", theta=10000.0, factor=8.0,
                            original_max_position=64))),
      (transformers.Qwen2Config, dict(rope_scaling={"type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32},
                                      use_sliding_window=True, sliding_window=16,
                                      max_window_layers=2),
       dict(qkv_bias=True, layer_windows=(0, 0, 16, 16),
            rope=RopeConfig(kind="yarn", theta=10000.0, factor=4.0,
                            original_max_position=32,
                            attention_factor=0.1 * __import__("math").log(4) + 1))),
      (transformers.Gemma3TextConfig, dict(head_dim=16, query_pre_attn_scalar=16,
                                           sliding_window=8, sliding_window_pattern=2,
                                           rope_scaling={"rope_type": "linear",
                                                         "factor": 8.0}),
       dict(layer_windows=(8, 0, 8, 0), rope=RopeConfig(kind="linear", theta=1e6, factor=8.0),
            rope_local=RopeConfig(theta=10000.0), attn_scale=0.25)),
      (transformers.Phi3Config, dict(partial_rotary_factor=0.5, pad_token_id=0,
                                     bos_token_id=2), dict(rotary_dim=4)),
      (transformers.Qwen3MoeConfig, dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=24, norm_topk_prob=True),
       dict(num_experts=4, experts_per_token=2, ffn_dim=24, norm_topk_prob=True)),
  ]
  import json  # pylint: disable=import-outside-toplevel
  for i, (cls, extra, want) in enumerate(cases):
    cls(**small, **extra).save_pretrained(tmp_path / str(i))
    hf = json.loads((tmp_path / str(i) / "config.json").read_text())
    assert "rope_parameters" in hf and "rope_scaling" not in hf
    cfg = load(hf)
    for field, value in want.items():
      assert getattr(cfg, field) == value, (cls.__name__, field, getattr(cfg, field))
