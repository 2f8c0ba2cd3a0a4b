"""Loading HF checkpoint directories of every family (models.loaders).

Checkpoints are written by transformers' own ``save_pretrained`` (random
weights, tiny shapes); each loaded leaf is checked against transformers'
state dict by the tensor names of that family. Numerics against
transformers' forward live in ``test_families.py``.
"""

import dataclasses
import json
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from gguf_testing import CHAT_TEMPLATE, bpe_vocab
from models import loaders
from models.config import RopeConfig
from models.loaders import ModelLoadError
from models.tokenizer import build_bpe_tokenizer

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SMALL = dict(vocab_size=len(bpe_vocab()[0]), hidden_size=32, intermediate_size=48,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, eos_token_id=2)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=8)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(head_dim=16, sliding_window=8, sliding_window_pattern=2)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5,
                                                   pad_token_id=0, bos_token_id=1)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       head_dim=16, norm_topk_prob=True)),
}


def write_tokenizer(directory):
  build_bpe_tokenizer(*bpe_vocab()).save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": CHAT_TEMPLATE}))


def save_family(directory, family, dtype=None):
  config_cls, model_cls, extra = FAMILIES[family]
  torch.manual_seed(0)
  model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SMALL, **extra))
  if dtype is not None:
    model = model.to(dtype)
  model.save_pretrained(directory)
  write_tokenizer(directory)
  return {k: v.float().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  root = tmp_path_factory.mktemp("families")
  return {family: (root / family, save_family(root / family, family)) for family in FAMILIES}


def expected(family, sd, cfg):
  """Our leaf path -> the value transformers holds for it (written from
  each family's HF names, independently of the loader's tables)."""
  L, q, kv, F = cfg.n_layers, cfg.q_dim, cfg.kv_dim, cfg.ffn_dim
  layer = lambda i, name: sd[f"model.layers.{i}.{name}"]
  stack = lambda fn: np.stack([fn(i) for i in range(L)])
  want = {("embed", "embedding"): sd["model.embed_tokens.weight"],
          ("final_norm", "scale"): sd["model.norm.weight"],
          ("layers", "attn_norm", "scale"): stack(lambda i: layer(i, "input_layernorm.weight")),
          ("layers", "attn", "wo"): stack(lambda i: layer(i, "self_attn.o_proj.weight").T)}
  if family == "phi3":
    qkv = lambda i: layer(i, "self_attn.qkv_proj.weight")
    want[("layers", "attn", "wq")] = stack(lambda i: qkv(i)[:q].T)
    want[("layers", "attn", "wk")] = stack(lambda i: qkv(i)[q:q + kv].T)
    want[("layers", "attn", "wv")] = stack(lambda i: qkv(i)[q + kv:].T)
    gate_up = lambda i: layer(i, "mlp.gate_up_proj.weight")
    want[("layers", "mlp", "w_gate")] = stack(lambda i: gate_up(i)[:F].T)
    want[("layers", "mlp", "w_up")] = stack(lambda i: gate_up(i)[F:].T)
  else:
    for ours, hf in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
      want[("layers", "attn", ours)] = stack(lambda i, hf=hf: layer(
          i, f"self_attn.{hf}.weight").T)
  if family in ("llama", "qwen2"):
    for ours, hf in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
      want[("layers", "attn", ours)] = stack(lambda i, hf=hf: layer(i, f"self_attn.{hf}.bias"))
  if family == "llama":
    want[("layers", "attn", "bo")] = stack(lambda i: layer(i, "self_attn.o_proj.bias"))
  if family in ("qwen3", "gemma3_text", "qwen3_moe"):
    for norm in ("q_norm", "k_norm"):
      want[("layers", "attn", norm, "scale")] = stack(
          lambda i, norm=norm: layer(i, f"self_attn.{norm}.weight"))
  if family.startswith("gemma"):
    for ours, hf in (("post_attn_norm", "post_attention_layernorm"),
                     ("mlp_norm", "pre_feedforward_layernorm"),
                     ("post_mlp_norm", "post_feedforward_layernorm")):
      want[("layers", ours, "scale")] = stack(lambda i, hf=hf: layer(i, f"{hf}.weight"))
  else:
    want[("layers", "mlp_norm", "scale")] = stack(
        lambda i: layer(i, "post_attention_layernorm.weight"))
  if cfg.is_moe:   # transformers holds experts fused: gate_up [E, 2F, D], down [E, D, F]
    gate_up = lambda i: layer(i, "mlp.experts.gate_up_proj")
    want[("layers", "moe", "router")] = stack(lambda i: layer(i, "mlp.gate.weight").T)
    want[("layers", "moe", "experts_gate")] = stack(
        lambda i: gate_up(i)[:, :F].transpose(0, 2, 1))
    want[("layers", "moe", "experts_up")] = stack(
        lambda i: gate_up(i)[:, F:].transpose(0, 2, 1))
    want[("layers", "moe", "experts_down")] = stack(
        lambda i: layer(i, "mlp.experts.down_proj").transpose(0, 2, 1))
  elif family != "phi3":
    for ours in ("gate", "up"):
      want[("layers", "mlp", f"w_{ours}")] = stack(
          lambda i, ours=ours: layer(i, f"mlp.{ours}_proj.weight").T)
  if not cfg.is_moe:
    want[("layers", "mlp", "w_down")] = stack(lambda i: layer(i, "mlp.down_proj.weight").T)
  if not cfg.tie_embeddings:
    want[("lm_head",)] = sd["lm_head.weight"].T
  return want


def flat(params):
  return dict(loaders._flat_paths(params))  # pylint: disable=protected-access


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_leaf_is_transformers_tensor(saved, family):
  directory, sd = saved[family]
  cfg, params, tok = loaders.read_hf_dir(directory)
  assert cfg.family == family and cfg.eos_token_ids == (2,)
  want = expected(family, sd, cfg)
  got = flat(params)
  assert set(got) == set(want)
  for path, value in want.items():
    assert got[path].dtype == np.float32
    np.testing.assert_array_equal(got[path], value, err_msg=str(path))
  assert tok.apply_chat_template([{"role": "user", "content": "x"}]).endswith("assistant\n")


def test_fused_expert_layout_loads_the_same(saved, tmp_path):
  directory, _ = saved["qwen3_moe"]
  fused = tmp_path / "fused"
  shutil.copytree(directory, fused)
  tensors = load_file(str(directory / "model.safetensors"))
  out = {k: v for k, v in tensors.items() if ".experts." not in k}
  for i in range(2):
    get = lambda j, w, i=i: tensors[f"model.layers.{i}.mlp.experts.{j}.{w}.weight"]
    out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(
        [np.concatenate([get(j, "gate_proj"), get(j, "up_proj")]) for j in range(4)])
    out[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(
        [get(j, "down_proj") for j in range(4)])
  save_file(out, str(fused / "model.safetensors"))
  want = flat(loaders.read_hf_dir(directory)[1])
  got = flat(loaders.read_hf_dir(fused)[1])
  assert set(got) == set(want)
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


def test_sharded_checkpoint_via_index(saved, tmp_path):
  directory, _ = saved["llama"]
  sharded = tmp_path / "sharded"
  shutil.copytree(directory, sharded)
  (sharded / "model.safetensors").unlink()
  tensors = load_file(str(directory / "model.safetensors"))
  names = sorted(tensors)
  weight_map = {}
  for part, chunk in enumerate((names[::2], names[1::2])):
    file = f"model-0000{part + 1}-of-00002.safetensors"
    save_file({k: tensors[k] for k in chunk}, str(sharded / file))
    weight_map.update({k: file for k in chunk})
  index = sharded / "model.safetensors.index.json"
  index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  want = flat(loaders.read_hf_dir(directory)[1])
  got = flat(loaders.read_hf_dir(sharded)[1])
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))
  (sharded / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(ModelLoadError, match=r"index.json: weight_map\[.*\] names "
                                           r"'model-00002-of-00002.safetensors', which is "
                                           "missing"):
    loaders.read_hf_dir(sharded)


def test_bf16_tensors_load_to_bf16_bitwise(saved, tmp_path):
  directory = tmp_path / "bf16"
  sd = save_family(directory, "llama", dtype=torch.bfloat16)
  raw = load_file(str(directory / "model.safetensors"))
  assert raw["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
  _, params, _ = loaders.read_hf_dir(directory, dtype=jnp.bfloat16)
  got = flat(params)
  assert all(v.dtype == jnp.bfloat16 for v in got.values())
  bits = lambda x: np.asarray(x).view(np.uint16)
  np.testing.assert_array_equal(bits(got[("embed", "embedding")]),
                                bits(raw["model.embed_tokens.weight"]))
  np.testing.assert_array_equal(bits(got[("layers", "attn", "wq")][1]),
                                bits(raw["model.layers.1.self_attn.q_proj.weight"].T))
  np.testing.assert_array_equal(bits(got[("layers", "attn", "bk")][0]),
                                bits(raw["model.layers.0.self_attn.k_proj.bias"]))
  # the same checkpoint as float32 is the exact widening
  _, params32, _ = loaders.read_hf_dir(directory)
  np.testing.assert_array_equal(flat(params32)[("lm_head",)], sd["lm_head.weight"].T)
  # f16 on disk, bf16 in the engine: one rounding, as numpy's cast of f16 does
  tensors = {k: v.astype(np.float32).astype(np.float16) for k, v in raw.items()}
  save_file(tensors, str(directory / "model.safetensors"))
  _, params16, _ = loaders.read_hf_dir(directory, dtype=jnp.bfloat16)
  np.testing.assert_array_equal(
      bits(flat(params16)[("layers", "mlp", "w_up")][0]),
      bits(tensors["model.layers.0.mlp.up_proj.weight"].T.astype(ml_dtypes.bfloat16)))


def test_tensor_refusals_name_file_and_tensor(saved, tmp_path):
  directory = tmp_path / "bad"
  shutil.copytree(saved["qwen3"][0], directory)
  tensors = load_file(str(directory / "model.safetensors"))

  def refused(changed, *fragments):
    save_file(changed, str(directory / "model.safetensors"))
    with pytest.raises(ModelLoadError) as info:
      loaders.read_hf_dir(directory)
    message = str(info.value)
    assert "\n" not in message and str(directory) in message, message
    for fragment in fragments:
      assert fragment in message, message

  refused({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_norm.weight"},
          "tensor 'model.layers.1.self_attn.k_norm.weight' is missing")
  refused({**tensors, "model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)},
          "model.safetensors: tensor 'model.layers.0.self_attn.q_norm.weight' has shape "
          "(8,), expected (16,)")
  refused({**tensors, "model.norm.weight": np.ones(32, np.int32)},
          "tensor 'model.norm.weight' has dtype I32")


def test_tokenizer_files(saved, tmp_path):
  directory = tmp_path / "tok"
  shutil.copytree(saved["llama"][0], directory)
  (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
  tok = loaders.read_hf_dir(directory)[2]
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
  (directory / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
  with pytest.raises(ModelLoadError) as info:
    loaders.read_hf_dir(directory)
  assert "tokenizer.json: unreadable tokenizer" in str(info.value)
  assert "\n" not in str(info.value)


def test_generation_config_adds_eos(saved, tmp_path):
  directory = tmp_path / "gen"
  shutil.copytree(saved["qwen2"][0], directory)
  (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
  cfg, _, tok = loaders.read_hf_dir(directory)
  assert cfg.eos_token_ids == (2, 1) and tok.stop_token_ids == (2, 1)


def test_config_round_trips_through_the_cache_json():
  from models.hf_config import from_hf  # pylint: disable=import-outside-toplevel
  from test_hf_config import GEMMA3_1B  # pylint: disable=import-outside-toplevel
  cfg = from_hf({**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
                where="c.json", tokenizer_bos=2, generation=None, name="g")
  text = json.dumps(loaders._config_to_json(cfg))  # pylint: disable=protected-access
  back = loaders._config_from_json(json.loads(text))  # pylint: disable=protected-access
  assert back == cfg and isinstance(back.rope, RopeConfig) and back.layer_windows


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_moe"])
def test_load_model_and_cache_restore(saved, tmp_path, family):
  directory, _ = saved[family]
  cache = tmp_path / "cache"
  cfg, params, _ = loaders.load_model(directory, dtype=jnp.bfloat16, cache_dir=cache)
  cfg2, params2, _ = loaders.load_model(directory, dtype=jnp.bfloat16, cache_dir=cache)
  assert cfg2 == cfg
  got, want = flat(params2), flat(params)
  assert set(got) == set(want)
  for path in want:
    assert got[path].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got[path], np.float32),
                                  np.asarray(want[path], np.float32), err_msg=str(path))


def test_qwen2_gguf_with_biases_matches_the_hf_directory(saved, tmp_path):
  import gguf  # pylint: disable=import-outside-toplevel
  directory, _ = saved["qwen2"]
  cfg, want, _ = loaders.read_hf_dir(directory)
  tensors = load_file(str(directory / "model.safetensors"))
  tokens, merges, types = bpe_vocab()
  writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "qwen2")
  writer.add_block_count(cfg.n_layers)
  writer.add_context_length(cfg.max_position)
  writer.add_embedding_length(cfg.d_model)
  writer.add_feed_forward_length(cfg.ffn_dim)
  writer.add_head_count(cfg.n_heads)
  writer.add_head_count_kv(cfg.n_kv_heads)
  writer.add_rope_freq_base(cfg.rope_theta)
  writer.add_layer_norm_rms_eps(cfg.rms_eps)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("qwen2")
  writer.add_token_list(tokens)
  writer.add_token_merges(merges)
  writer.add_token_types(types)
  writer.add_eos_token_id(2)
  names = {"input_layernorm.weight": "attn_norm.weight",
           "post_attention_layernorm.weight": "ffn_norm.weight",
           "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
           "mlp.down_proj.weight": "ffn_down.weight",
           "self_attn.o_proj.weight": "attn_output.weight"}
  for proj in "qkv":
    names[f"self_attn.{proj}_proj.weight"] = f"attn_{proj}.weight"
    names[f"self_attn.{proj}_proj.bias"] = f"attn_{proj}.bias"
  top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
         "output_norm.weight", "lm_head.weight": "output.weight"}
  for name, value in tensors.items():
    if name in top:
      writer.add_tensor(top[name], value)
    else:
      _, _, layer, rest = name.split(".", 3)
      writer.add_tensor(f"blk.{layer}.{names[rest]}", value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  got_cfg, got, _ = loaders.read_gguf(tmp_path / "q.gguf")
  assert got_cfg.qkv_bias and got_cfg.family == "qwen2"
  got, want = flat(got), flat(want)
  assert set(got) == set(want)
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


def test_load_config_reads_no_tensor(saved, tmp_path):
  # The simulated executor's read: the same config and tokenizer as a full
  # load, from a directory whose weights are gone.
  directory, _ = saved["gemma2"]
  cfg, _, tok = loaders.read_hf_dir(directory)
  bare = tmp_path / "bare"
  shutil.copytree(directory, bare)
  for file in bare.glob("*.safetensors"):
    file.unlink()
  cfg2, tok2 = loaders.load_config(bare)
  assert cfg2 == dataclasses.replace(cfg, name="bare")
  assert tok2.encode("hello world") == tok.encode("hello world")
  with pytest.raises(ModelLoadError, match="no .*safetensors"):
    loaders.read_hf_dir(bare)


def test_a_config_preset_without_weights_is_named_as_such(tmp_path, monkeypatch):
  """``tiny`` is a config preset (the simulated executor runs it) with no
  weights: loading it says so and lists what has weights, where it said
  "not a preset"; a name that is neither still says that."""
  monkeypatch.chdir(tmp_path)                  # no ./tiny directory in the way
  with pytest.raises(ModelLoadError, match=r"model 'tiny' is a config preset without "
                     r"weights \(the simulated executor runs it\); models with weights: "
                     r"\['smollm2-135m'\]"):
    loaders.resolve_model_path("tiny")
  with pytest.raises(ModelLoadError, match=r"unknown model 'nope': not a preset"):
    loaders.resolve_model_path("nope")
