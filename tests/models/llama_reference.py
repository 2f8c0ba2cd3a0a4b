"""Dense numpy (float64) Llama: the oracle for the packed, paged forward.

Written independently of ``models.llama``: one sequence at a time, no pages,
a full causal mask, and RoPE in complex form (dimension ``i`` and
``i + head_dim/2`` are the real and imaginary parts of one rotating number).
"""

from __future__ import annotations

import numpy as np


def _f64(tree):
  if isinstance(tree, dict):
    return {k: _f64(v) for k, v in tree.items()}
  return np.asarray(tree, np.float64)


def _rms(x, scale, eps):
  return scale * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope_complex(x, theta):
  """x: [L, heads, head_dim] at positions 0..L-1."""
  length, _, head_dim = x.shape
  half = head_dim // 2
  inv_freq = theta ** (-np.arange(half) * 2.0 / head_dim)
  rot = np.exp(1j * np.arange(length)[:, None] * inv_freq[None, :])  # [L, half]
  z = (x[..., :half] + 1j * x[..., half:]) * rot[:, None, :]
  return np.concatenate([z.real, z.imag], axis=-1)


def dense_forward(params, cfg, tokens):
  """One sequence through the decoder.

  Args:
    params: ``models.llama`` parameter tree (any array type).
    cfg: ``ModelConfig``.
    tokens: int[L] the whole sequence from position 0.

  Returns:
    dict with ``hidden`` f64[L, d_model] (after the final norm), ``logits``
    f64[L, vocab], ``k`` and ``v`` f64[n_layers, L, n_kv_heads, head_dim]
    (keys after RoPE).
  """
  p = _f64(params)
  tokens = np.asarray(tokens)
  length = len(tokens)
  group = cfg.n_heads // cfg.n_kv_heads
  x = p["embed"]["embedding"][tokens]
  causal = np.tril(np.ones((length, length), bool))
  ks, vs = [], []
  for layer in range(cfg.n_layers):
    lp = {name: {k: v[layer] for k, v in sub.items()} for name, sub in p["layers"].items()}
    h = _rms(x, lp["attn_norm"]["scale"], cfg.rms_eps)
    q = (h @ lp["attn"]["wq"]).reshape(length, cfg.n_heads, cfg.head_dim)
    k = (h @ lp["attn"]["wk"]).reshape(length, cfg.n_kv_heads, cfg.head_dim)
    v = (h @ lp["attn"]["wv"]).reshape(length, cfg.n_kv_heads, cfg.head_dim)
    q = _rope_complex(q, cfg.rope_theta)
    k = _rope_complex(k, cfg.rope_theta)
    ks.append(k)
    vs.append(v)
    out = np.zeros_like(q)
    for head in range(cfg.n_heads):
      kv_head = head // group
      scores = q[:, head] @ k[:, kv_head].T / np.sqrt(cfg.head_dim)
      scores = np.where(causal, scores, -np.inf)
      weights = np.exp(scores - scores.max(-1, keepdims=True))
      weights /= weights.sum(-1, keepdims=True)
      out[:, head] = weights @ v[:, kv_head]
    x = x + out.reshape(length, -1) @ lp["attn"]["wo"]
    h = _rms(x, lp["mlp_norm"]["scale"], cfg.rms_eps)
    gate = h @ lp["mlp"]["w_gate"]
    x = x + (gate / (1 + np.exp(-gate)) * (h @ lp["mlp"]["w_up"])) @ lp["mlp"]["w_down"]
  hidden = _rms(x, p["final_norm"]["scale"], cfg.rms_eps)
  head = p["embed"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]
  return {"hidden": hidden, "logits": hidden @ head, "k": np.stack(ks), "v": np.stack(vs)}
