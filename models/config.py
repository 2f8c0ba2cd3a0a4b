"""Model configuration for the Llama-family decoder, with named presets.

``ModelConfig`` is frozen and hashable so it can be a static argument of
``jax.jit``. Every field is checked in ``__post_init__``; a bad value raises
``ValueError`` naming the field and the rule it breaks.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and constants of a Llama-family decoder.

  Attributes:
    vocab_size: rows of the token embedding (and LM head).
    d_model: width of the residual stream.
    n_layers: decoder blocks.
    n_heads: query heads per block.
    n_kv_heads: key/value heads per block (grouped-query attention); must
      divide ``n_heads``.
    head_dim: width of one attention head; even (RoPE rotates pairs).
    ffn_dim: hidden width of the SwiGLU MLP.
    rope_theta: RoPE base frequency (inverse frequencies
      ``theta ** (-2i / head_dim)``).
    rms_eps: epsilon added to the mean square in RMSNorm.
    tie_embeddings: the LM head reuses the token embedding.
    max_position: context length in tokens (positions are ``[0, max_position)``).
    bos_token_id: token prepended by ``encode(add_special_tokens=True)``;
      ``None`` means nothing is prepended.
    eos_token_ids: tokens that end generation (non-empty tuple).
    name: preset or source name (informational).
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

  def __post_init__(self):
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                  "head_dim", "ffn_dim", "max_position"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of "
          f"n_kv_heads ({self.n_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
    for field in ("rope_theta", "rms_eps"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"ModelConfig.{field} must be a positive number, got {value!r}")
    object.__setattr__(self, "rope_theta", float(self.rope_theta))
    object.__setattr__(self, "rms_eps", float(self.rms_eps))
    if not isinstance(self.tie_embeddings, bool):
      raise ValueError(
          f"ModelConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")
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
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"ModelConfig.name must be a non-empty str, got {self.name!r}")

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
