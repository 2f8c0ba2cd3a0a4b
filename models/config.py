"""Model configuration of the decoder families, with named presets.

One decoder definition (``models.llama``) covers the Llama, Qwen2/2.5,
Qwen3, Mistral, Gemma 2/3, Phi-3 and mixture-of-experts (Mixtral,
Qwen3-MoE) families by configuration: each difference is an orthogonal,
named switch below, read from an HF ``config.json`` by
``models.hf_config``. ``ModelConfig`` is frozen and hashable so it can be a
static argument of ``jax.jit``. Every field is checked in ``__post_init__``;
a bad value raises ``ValueError`` naming the field and the rule it breaks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

ROPE_KINDS = ("default", "llama3", "linear", "yarn")
NORM_STYLES = ("llama", "gemma")
ACTIVATIONS = ("silu", "gelu_tanh")


def _positive(owner: str, field: str, value, *, integer: bool = False, allow_none=False):
  if value is None and allow_none:
    return
  kinds = (int,) if integer else (int, float)
  if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
    what = "int" if integer else "number"
    raise ValueError(f"{owner}.{field} must be a positive {what}"
                     f"{' or None' if allow_none else ''}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary position embedding frequencies (HF ``rope_scaling`` /
  ``rope_parameters``; transformers' ``modeling_rope_utils`` is the
  reference for each kind).

  Attributes:
    kind: "default" (``theta ** (-2i / dim)``), "llama3" (Llama 3.1: low
      frequencies divided by ``factor``, high ones kept, a smooth ramp
      between, from ``original_max_position``), "linear" (every frequency
      divided by ``factor``: position interpolation), "yarn" (YaRN, Peng et
      al. 2023: NTK-by-parts ramp between ``beta_fast`` and ``beta_slow``
      rotations over ``original_max_position``, cos/sin scaled by
      ``attention_factor``).
    theta: the base frequency.
    factor: context extension factor (llama3, linear, yarn).
    low_freq_factor, high_freq_factor: llama3's wavelength bounds.
    original_max_position: the pre-extension context (llama3, yarn).
    beta_fast, beta_slow: yarn's ramp bounds in rotations.
    attention_factor: yarn's cos/sin scale; None derives
      ``0.1 * ln(factor) + 1`` (``mscale``/``mscale_all_dim`` resolved by
      the loader).
    truncate: yarn rounds its correction range to whole dimensions.
  """

  kind: str = "default"
  theta: float = 10000.0
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: Optional[int] = None
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: Optional[float] = None
  truncate: bool = True

  def __post_init__(self):
    if self.kind not in ROPE_KINDS:
      raise ValueError(f"RopeConfig.kind must be one of {ROPE_KINDS}, got {self.kind!r}")
    for field in ("theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast",
                  "beta_slow"):
      _positive("RopeConfig", field, getattr(self, field))
      object.__setattr__(self, field, float(getattr(self, field)))
    _positive("RopeConfig", "attention_factor", self.attention_factor, allow_none=True)
    _positive("RopeConfig", "original_max_position", self.original_max_position,
              integer=True, allow_none=True)
    if self.kind in ("llama3", "yarn") and self.original_max_position is None:
      raise ValueError(f"RopeConfig.original_max_position is required for kind "
                       f"{self.kind!r}")
    if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(f"RopeConfig.high_freq_factor ({self.high_freq_factor}) must exceed "
                       f"low_freq_factor ({self.low_freq_factor}) for kind 'llama3'")
    if not isinstance(self.truncate, bool):
      raise ValueError(f"RopeConfig.truncate must be a bool, got {self.truncate!r}")

  def inv_freq(self, dim: int) -> np.ndarray:
    """f32[dim // 2] inverse frequencies of a rotary width ``dim``, computed
    in float32 in transformers' order of operations."""
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    base = np.float32(self.theta) ** exponent
    inv = (np.float32(1.0) / base).astype(np.float32)
    if self.kind == "linear":
      return (inv / np.float32(self.factor)).astype(np.float32)
    if self.kind == "llama3":
      old = float(self.original_max_position)
      low_wavelen = old / self.low_freq_factor
      high_wavelen = old / self.high_freq_factor
      wavelen = (2 * math.pi / inv).astype(np.float32)
      scaled = np.where(wavelen > low_wavelen, inv / np.float32(self.factor), inv)
      smooth = ((old / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor)).astype(np.float32)
      smoothed = (1 - smooth) * scaled / np.float32(self.factor) + smooth * scaled
      medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
      return np.where(medium, smoothed, scaled).astype(np.float32)
    if self.kind == "yarn":
      return self._yarn_inv_freq(dim, base)
    return inv

  def _yarn_inv_freq(self, dim: int, base: np.ndarray) -> np.ndarray:
    def correction_dim(rotations):
      return (dim * math.log(self.original_max_position / (rotations * 2 * math.pi))
              / (2 * math.log(self.theta)))
    low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    extrapolation = (np.float32(1.0) / base).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(self.factor) * base)).astype(np.float32)
    keep = (1 - ramp).astype(np.float32)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)

  @property
  def cos_sin_scale(self) -> float:
    """Factor on cos and sin: yarn's attention factor, else 1."""
    if self.kind != "yarn":
      return 1.0
    if self.attention_factor is not None:
      return float(self.attention_factor)
    return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape, constants and family switches of a decoder.

  The defaults are the plain Llama block (pre-RMSNorm, RoPE, GQA, SwiGLU,
  no biases); every other family sets the switches its HF ``config.json``
  implies (``models.hf_config``).

  Attributes:
    vocab_size: rows of the token embedding (and LM head).
    d_model: width of the residual stream (HF ``hidden_size``).
    n_layers: decoder blocks.
    n_heads: query heads per block.
    n_kv_heads: key/value heads per block (grouped-query attention); must
      divide ``n_heads``.
    head_dim: width of one attention head, even; may differ from
      ``d_model / n_heads`` (Qwen3, Gemma).
    ffn_dim: hidden width of the gated MLP; of one expert's MLP when
      ``num_experts`` > 0 (HF ``moe_intermediate_size`` /
      ``intermediate_size`` of Mixtral).
    rope_theta: RoPE base of ``rope`` (kept as a field for the plain case;
      must equal ``rope.theta``).
    rms_eps: epsilon added to the mean square in RMSNorm.
    tie_embeddings: the LM head reuses the token embedding.
    max_position: context length in tokens (positions are ``[0, max_position)``).
    bos_token_id: token prepended by ``encode(add_special_tokens=True)``;
      ``None`` means nothing is prepended.
    eos_token_ids: tokens that end generation (non-empty tuple).
    name: preset or source name (informational).
    family: the HF ``model_type`` the config came from (informational:
      ``/v1/models``, reports).
    rope: the frequencies of every layer (of the global layers when
      ``rope_local`` is set); None (the plain ``RopeConfig(theta=rope_theta)``,
      stored as None): ``global_rope``.
    rope_local: the sliding-window layers' frequencies when they differ
      (Gemma 3's ``rope_local_base_freq``); None: ``rope``.
    rotary_dim: leading dimensions of a head that RoPE rotates (the rest
      pass through: Phi-3's ``partial_rotary_factor``); None: ``head_dim``.
    qkv_bias: q, k and v projections carry biases (Qwen2, Llama's
      ``attention_bias``).
    o_bias: the output projection carries a bias (Llama's ``attention_bias``).
    qk_norm: per-head RMSNorm of q and k over ``head_dim`` before RoPE
      (Qwen3, Gemma 3).
    norm_style: "llama" (``scale * normed`` rounded first) or "gemma"
      (``(1 + scale) * normed`` in float32, then rounded).
    post_norms: RMSNorm on the attention and MLP outputs before each
      residual add (Gemma 2/3's sandwich norms).
    activation: the gate's activation: "silu" (SwiGLU) or "gelu_tanh"
      (GeGLU, Gemma).
    scale_embeddings: the embedding is multiplied by ``sqrt(d_model)``
      rounded to the activation dtype (Gemma).
    attn_scale: the scores' scale; None: ``head_dim ** -0.5`` (Gemma's
      ``query_pre_attn_scalar ** -0.5`` otherwise).
    attn_softcap: scores become ``c * tanh(s / c)`` after scaling (Gemma 2).
    final_softcap: logits become ``c * tanh(z / c)`` (Gemma 2).
    layer_windows: per layer, the sliding window in tokens (a row at
      position ``p`` sees keys ``> p - w``) or 0 for global attention;
      empty: every layer global. Length ``n_layers`` when set.
    num_experts: experts per MoE layer; 0: dense MLPs. When > 0 every
      layer's MLP is a mixture (Mixtral, Qwen3-MoE).
    experts_per_token: top-k experts a token is routed to.
    norm_topk_prob: the top-k routing weights are renormalised to sum to 1
      (Mixtral always; Qwen3-MoE's ``norm_topk_prob``).
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10000.0
  rms_eps: float = 1e-5
  tie_embeddings: bool = True
  max_position: int = 2048
  bos_token_id: Optional[int] = None
  eos_token_ids: tuple[int, ...] = (0,)
  name: str = "custom"
  family: str = "llama"
  rope: Optional[RopeConfig] = None
  rope_local: Optional[RopeConfig] = None
  rotary_dim: Optional[int] = None
  qkv_bias: bool = False
  o_bias: bool = False
  qk_norm: bool = False
  norm_style: str = "llama"
  post_norms: bool = False
  activation: str = "silu"
  scale_embeddings: bool = False
  attn_scale: Optional[float] = None
  attn_softcap: Optional[float] = None
  final_softcap: Optional[float] = None
  layer_windows: tuple[int, ...] = ()
  num_experts: int = 0
  experts_per_token: int = 0
  norm_topk_prob: bool = True

  def __post_init__(self):
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                  "head_dim", "ffn_dim", "max_position"):
      _positive("ModelConfig", field, getattr(self, field), integer=True)
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of "
          f"n_kv_heads ({self.n_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
    for field in ("rope_theta", "rms_eps"):
      _positive("ModelConfig", field, getattr(self, field))
    object.__setattr__(self, "rope_theta", float(self.rope_theta))
    object.__setattr__(self, "rms_eps", float(self.rms_eps))
    for field in ("tie_embeddings", "qkv_bias", "o_bias", "qk_norm", "post_norms",
                  "scale_embeddings", "norm_topk_prob"):
      if not isinstance(getattr(self, field), bool):
        raise ValueError(f"ModelConfig.{field} must be a bool, got {getattr(self, field)!r}")
    if self.bos_token_id is not None and not self._is_token(self.bos_token_id):
      raise ValueError(
          f"ModelConfig.bos_token_id must be None or in [0, vocab_size="
          f"{self.vocab_size}), got {self.bos_token_id!r}")
    eos = self.eos_token_ids
    if isinstance(eos, int):
      eos = (eos,)
    eos = tuple(eos)
    if not eos or not all(self._is_token(t) for t in eos):
      raise ValueError(
          f"ModelConfig.eos_token_ids must be a non-empty tuple of ids in "
          f"[0, vocab_size={self.vocab_size}), got {self.eos_token_ids!r}")
    object.__setattr__(self, "eos_token_ids", eos)
    for field in ("name", "family"):
      if not isinstance(getattr(self, field), str) or not getattr(self, field):
        raise ValueError(f"ModelConfig.{field} must be a non-empty str, "
                         f"got {getattr(self, field)!r}")
    self._check_rope()
    if self.norm_style not in NORM_STYLES:
      raise ValueError(f"ModelConfig.norm_style must be one of {NORM_STYLES}, "
                       f"got {self.norm_style!r}")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"ModelConfig.activation must be one of {ACTIVATIONS}, "
                       f"got {self.activation!r}")
    for field in ("attn_scale", "attn_softcap", "final_softcap"):
      _positive("ModelConfig", field, getattr(self, field), allow_none=True)
      if getattr(self, field) is not None:
        object.__setattr__(self, field, float(getattr(self, field)))
    self._check_windows()
    self._check_experts()

  def _check_rope(self):
    for field in ("rope", "rope_local"):
      value = getattr(self, field)
      if value is not None and not isinstance(value, RopeConfig):
        raise ValueError(f"ModelConfig.{field} must be a RopeConfig or None, got {value!r}")
    if self.rope is not None:
      if self.rope.theta != self.rope_theta:
        raise ValueError(f"ModelConfig.rope_theta ({self.rope_theta}) must equal "
                         f"rope.theta ({self.rope.theta})")
      if self.rope == RopeConfig(theta=self.rope_theta):   # plain: one spelling
        object.__setattr__(self, "rope", None)
    rotary = self.head_dim if self.rotary_dim is None else self.rotary_dim
    if (isinstance(rotary, bool) or not isinstance(rotary, int) or rotary <= 0
        or rotary % 2 or rotary > self.head_dim):
      raise ValueError(f"ModelConfig.rotary_dim must be an even int in [2, head_dim="
                       f"{self.head_dim}], got {self.rotary_dim!r}")
    object.__setattr__(self, "rotary_dim", rotary)

  def _check_windows(self):
    windows = tuple(self.layer_windows)
    if windows and len(windows) != self.n_layers:
      raise ValueError(f"ModelConfig.layer_windows must be empty or have n_layers="
                       f"{self.n_layers} entries, got {len(windows)}")
    if any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in windows):
      raise ValueError(f"ModelConfig.layer_windows entries must be ints >= 0 (0: global), "
                       f"got {windows!r}")
    if not any(windows):
      windows = ()
    object.__setattr__(self, "layer_windows", windows)
    if self.rope_local is not None and not windows:
      raise ValueError("ModelConfig.rope_local needs sliding-window layers (layer_windows)")

  def _check_experts(self):
    for field in ("num_experts", "experts_per_token"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"ModelConfig.{field} must be an int >= 0, got {value!r}")
    if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
      raise ValueError(f"ModelConfig.experts_per_token must be in [1, num_experts="
                       f"{self.num_experts}] for a mixture of experts, got "
                       f"{self.experts_per_token}")
    if not self.num_experts and self.experts_per_token:
      raise ValueError(f"ModelConfig.experts_per_token must be 0 without experts, got "
                       f"{self.experts_per_token}")

  def _is_token(self, token) -> bool:
    return (isinstance(token, int) and not isinstance(token, bool)
            and 0 <= token < self.vocab_size)

  @property
  def q_dim(self) -> int:
    """Width of the concatenated query heads, ``n_heads * head_dim``."""
    return self.n_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    """Width of the concatenated key (or value) heads, ``n_kv_heads * head_dim``."""
    return self.n_kv_heads * self.head_dim

  @property
  def sm_scale(self) -> float:
    """The attention scores' scale (``attn_scale`` or ``head_dim ** -0.5``)."""
    return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

  @property
  def is_moe(self) -> bool:
    """Every layer's MLP is a mixture of ``num_experts`` experts."""
    return self.num_experts > 0

  @property
  def window_kinds(self) -> tuple[int, ...]:
    """The distinct attention windows of the layers, 0 (global) included
    when some layer is global; ``(0,)`` for an all-global model."""
    return tuple(sorted(set(self.layer_windows))) if self.layer_windows else (0,)

  def layer_window(self, layer: int) -> int:
    """Layer ``layer``'s sliding window in tokens, 0 for global attention."""
    return self.layer_windows[layer] if self.layer_windows else 0

  @property
  def global_rope(self) -> RopeConfig:
    """The global layers' frequencies: ``rope``, or plain RoPE of ``rope_theta``."""
    return self.rope if self.rope is not None else RopeConfig(theta=self.rope_theta)


PRESETS: dict[str, ModelConfig] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (config.json of the HF release and the
    # llama.* metadata of its GGUF agree on these values).
    "smollm2-135m": ModelConfig(
        vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
        head_dim=64, ffn_dim=1536, rope_theta=100000.0, rms_eps=1e-5,
        tie_embeddings=True, max_position=8192, bos_token_id=None,
        eos_token_ids=(2,), name="smollm2-135m"),
    # Debug model for unit tests: random weights, compiles in seconds.
    "tiny": ModelConfig(
        vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
        head_dim=16, ffn_dim=128, rope_theta=10000.0, rms_eps=1e-5,
        tie_embeddings=True, max_position=512, bos_token_id=None,
        eos_token_ids=(1,), name="tiny"),
}


def get_config(name: str) -> ModelConfig:
  """Returns the preset called ``name``; raises ``ValueError`` listing presets."""
  try:
    return PRESETS[name]
  except KeyError:
    raise ValueError(
        f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}") from None
