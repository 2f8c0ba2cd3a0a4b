"""Step-time cost model of one iteration: features from the model and the plan.

The features and their fit are this module; the accelerator profiles and
the collectives are ``serving.engine.profiles``, and the calibrations
(reading one, the device fingerprint, the machine kinds and checking a
model against this device: ``resolve``) ``serving.engine.calibrations``.
All three evaluate the same definitions, on the host and inside the
simulated loop.

The modelled time of an iteration is a function of what the step computes
and moves, derived from the ``ModelConfig`` (``model_costs``) and the plan
(``plan_stats``), so that a fit holds across models and an accelerator's
published peaks give a first estimate without the accelerator:

  ======================  =============================================  =========
  feature                 what it counts                                 unit
  ======================  =============================================  =========
  step                    1 per iteration (host work, launch, sync)      step
  rows                    live token rows (per-row non-GEMM work)        row
  gemm_gflop              weight GEMMs over every row of the bucket      GFLOP
                          (the program runs the padded bucket; a
                          fitted GPU profile charges the live rows:
                          ``CostModel.row_gemm_gflop``)
  lm_head_gflop           the LM head on the rows that sample            GFLOP
  attention_gflop         query-key pairs (a chunk of c rows after s     GFLOP
                          cached keys: c*s + c(c+1)/2 pairs; a windowed
                          block sees at most its window)
  kv_read_gb              each scheduled sequence's cached K/V, read     GB
                          once per block per step
  weight_read_gb          the weights a step reads (MoE: every expert,   GB
                          an upper bound)
  prompt_gemm_gflop       the prompt rows' GEMM class: one GEMM over     GFLOP
                          the whole bucket, at least LARGE_GEMM_ROWS
                          rows, in a step with a prompt row
  extra_weight_read_gb    the weights read again by each GEMM pass past  GB
                          the first: a step with prompt rows and
                          generated rows (decode rows, recomputed
                          outputs) runs both classes, the generated rows
                          in tiles of ROW_TILE
  ======================  =============================================  =========

The last two say how this engine's row-wise projections run
(``models.llama.rowwise``: a row's bits depend only on its row class, so a
mixed step runs two GEMM passes); a calibration fits them beside the first
seven, and an accelerator profile leaves them at zero (one fused weight
pass per step, as a paper's engine would run).

``CostModel.coef_ms`` holds ms per unit of each feature (``step``'s is the
per-step term), so ``1000 / coef`` of a GFLOP or GB feature is the
throughput the fit measured (GFLOP/s, GB/s): the efficiencies of
``CostModel.efficiencies``. Two ways to combine the terms:

* ``"sum"``: every term adds (a fitted calibration; on a CPU the compute
  and memory phases of a step overlap little).
* ``"roofline"``: ``step + rows + max(compute terms, memory terms)``: an
  accelerator profile (``serving.engine.profiles``), where a step is bound
  by the larger of its FLOPs at peak x efficiency and its bytes at
  bandwidth x efficiency (a fitted profile: the smooth bound
  ``CostModel.roofline_p``).

``fit`` is the non-negative least-squares fit of the "sum" form that
``scripts/calibrate.py`` runs on a measured grid (``scipy.optimize.nnls``).
Linear per-iteration cost models are what Vidur (Agrawal et al., MLSys 2024)
fits per operator; the roofline bound is Williams et al. (CACM 2009).

``model_costs(cfg)`` derives a model's cost features from its
``ModelConfig`` alone (FLOPs per row, weight and KV bytes, attention FLOPs
per query-key pair).

Speculation with a draft model (``speculative="draft:MODEL,..."``, the
simulated executor): a step also runs the draft's forward over the same
packed rows and, where rows carry drafts, k single-row forwards over the
decode rows that do (``executor.draft_propose``).
``engine_model_costs`` adds the draft's ``ModelCosts`` (``draft_config``
reads its config, no weights, and refuses another vocabulary),
``plan_stats`` counts the passes, ``step_features`` gives one row of
``FEATURES`` per forward and ``CostModel.predict_ms`` prices the draft's
with the same terms charged for the draft's shape (``CostModel.draft``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Dict, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.sharding import parse_mesh
from models.llama import LARGE_GEMM_ROWS, ROW_TILE
from scheduler import records as rec

FEATURES = ("step", "rows", "gemm_gflop", "lm_head_gflop", "attention_gflop",
            "kv_read_gb", "weight_read_gb", "prompt_gemm_gflop", "extra_weight_read_gb")
COMPUTE = ("gemm_gflop", "lm_head_gflop", "attention_gflop", "prompt_gemm_gflop")
MEMORY = ("kv_read_gb", "weight_read_gb", "extra_weight_read_gb")
# Features a calibration written before the row-class features lacks: read
# as 0 (what that calibration's predictions already assumed).
ADDED_FEATURES = ("prompt_gemm_gflop", "extra_weight_read_gb")
COMBINES = ("sum", "roofline")
# Bytes per stored element of a weight or KV dtype name.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


@dataclasses.dataclass(frozen=True)
class ModelCosts:
  """A model's per-step cost features, from its config alone.

  FLOPs count a multiply-add as 2. Sums are over all ``n_layers`` blocks.
  Biases, norms, RoPE, activations, routing's top-k and sampling are left
  out (each under 1% of a projection's FLOPs at real widths).

  Attributes:
    gemm_flops_per_row: FLOPs of one token row's weight GEMMs in all blocks:
      the q/k/v/o projections plus the MLP (dense: gate, up, down of width
      ``ffn_dim``; MoE: the router's ``d_model x num_experts`` and the MLPs
      of the ``experts_per_token`` experts the row is routed to).
    lm_head_flops_per_row: FLOPs of the LM head for one live row
      (``2 * d_model * vocab_size``; the engine computes it for the rows
      that sample only).
    attention_flops_per_pair: FLOPs of one (query row, cached key) pair in
      all blocks: scores ``q . k`` and the weighted sum of ``v``
      (``4 * n_heads * head_dim`` per block). A windowed block (``windows``)
      counts only the keys inside its window: ``attention_flops``.
    kv_bytes_per_token: bytes one cached token holds in all blocks (K and
      V, ``2 * n_kv_heads * head_dim`` elements per block, in ``kv_dtype``).
    weight_bytes_per_step: bytes of the weights one model step reads, in
      ``weight_dtype``: every block's projections, norms and biases, the MLP
      (MoE: the router and every expert, an upper bound: a step reads only
      the experts its rows route to) and the LM head (the tied embedding
      counted once; an untied embedding is only gathered by row, not read).
    expert_bytes: bytes of one expert's three matrices in all blocks (0 for
      a dense model); a step whose rows hit ``h`` experts per block reads
      ``weight_bytes_per_step - (num_experts - h) * expert_bytes``.
    weight_bytes: every parameter (the embedding included), in
      ``weight_dtype``: the model's memory.
    windows: per block, its sliding window in tokens (0: global);
      ``ModelConfig.layer_windows`` or all zeros.
    weight_dtype, kv_dtype: the dtype names the byte counts are for (int8
      weights: one byte per element, per-column scales left out).
    tp: the tensor-parallel degree the engine runs (``EngineConfig.mesh``'s
      model axis). The fields above are the whole model's; a fitted
      profile charges one device's share (``profiles.for_model``).
    row_bytes_per_row: bytes one token row moves through a device's
      row-wise operators in all blocks (``profiles.ROW_OPS_PER_BLOCK``: two norms
      of ``d_model`` read and written, the residual add's two reads and
      one write, RoPE over the device's q and k heads, the MLP activation
      over its share of the width: gate and up read, one written), in the
      activation dtype (``activation_dtype``).
    all_reduce_bytes_per_row: bytes one row adds to each of a block's
      ``profiles.ALL_REDUCES_PER_BLOCK`` all-reduces under TP (``d_model`` in the
      activation dtype).
    draft: the draft model's ``ModelCosts`` (in the same dtypes and TP
      degree) when a draft model speculates in the simulator
      (``engine_model_costs``); None else. ``step_features`` then adds the
      draft's forwards (see "A draft model's forwards" there).
    draft_passes: with ``draft``, the single-row forwards a step whose
      rows carry drafts runs (``Speculation.k``: the executor's
      ``draft_propose`` runs all k over every drafting sequence).
  """

  gemm_flops_per_row: int
  lm_head_flops_per_row: int
  attention_flops_per_pair: int
  kv_bytes_per_token: int
  weight_bytes_per_step: int
  expert_bytes: int
  weight_bytes: int
  windows: tuple
  weight_dtype: str
  kv_dtype: str
  tp: int = 1
  row_bytes_per_row: int = 0
  all_reduce_bytes_per_row: int = 0
  draft: Optional["ModelCosts"] = None
  draft_passes: int = 0

  def attention_flops(self, num_keys: int) -> int:
    """FLOPs of one query row that attends ``num_keys`` cached keys (its own
    included), all blocks; a windowed block sees at most its window."""
    per_block = self.attention_flops_per_pair // len(self.windows)
    return sum(per_block * (min(num_keys, w) if w else num_keys) for w in self.windows)

  def to_json(self) -> dict:
    """The fields as JSON; ``draft`` (its own ``to_json``) and
    ``draft_passes`` only with a draft model."""
    speculative = ("draft", "draft_passes")
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
           if f.name not in speculative}
    out["windows"] = list(self.windows)
    if self.draft is not None:
      out.update(draft=self.draft.to_json(), draft_passes=self.draft_passes)
    return out


def activation_dtype(weight_dtype: str) -> str:
  """The dtype a model's activations run in: its weights' (int8 weights
  compute in float32)."""
  return "float32" if weight_dtype == "int8" else weight_dtype


def model_costs(cfg: ModelConfig, weight_dtype: str = "float32",
                kv_dtype: str | None = None, tp: int = 1) -> ModelCosts:
  """The cost features of ``cfg`` (``ModelCosts``; a pure function).

  Args:
    cfg: the model's config (any family).
    weight_dtype: "float32", "bfloat16", "float16" or "int8".
    kv_dtype: the KV cache's dtype name; None: ``weight_dtype`` (int8
      weights keep a float32 cache).
    tp: tensor-parallel degree (>= 1): the per-device row-wise bytes.

  Raises:
    ValueError: a dtype name outside ``DTYPE_BYTES``, or ``tp < 1``.
  """
  if kv_dtype is None:
    kv_dtype = "float32" if weight_dtype == "int8" else weight_dtype
  for name, value in (("weight_dtype", weight_dtype), ("kv_dtype", kv_dtype)):
    if value not in DTYPE_BYTES:
      raise ValueError(f"model_costs: {name} must be one of {sorted(DTYPE_BYTES)}, "
                       f"got {value!r}")
  if not (isinstance(tp, int) and tp >= 1):
    raise ValueError(f"model_costs: tp must be an int >= 1, got {tp!r}")
  d, f, layers = cfg.d_model, cfg.ffn_dim, cfg.n_layers
  attn_weights = d * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * d
  expert = 3 * d * f                                       # gate, up, down
  if cfg.is_moe:
    mlp_flops = 2 * (d * cfg.num_experts + cfg.experts_per_token * expert)
    mlp_weights = d * cfg.num_experts + cfg.num_experts * expert
  else:
    mlp_flops, mlp_weights = 2 * expert, expert
  small = (2 + 2 * cfg.post_norms) * d                     # norm scales
  small += (cfg.q_dim + 2 * cfg.kv_dim) * cfg.qkv_bias + d * cfg.o_bias
  small += 2 * cfg.head_dim * cfg.qk_norm
  block = attn_weights + mlp_weights + small
  head = d * cfg.vocab_size
  step_elements = layers * block + d + head                # + final norm
  all_elements = step_elements + (0 if cfg.tie_embeddings else cfg.vocab_size * d)
  wb, kb = DTYPE_BYTES[weight_dtype], DTYPE_BYTES[kv_dtype]
  ab = DTYPE_BYTES[activation_dtype(weight_dtype)]
  width = f * (cfg.experts_per_token if cfg.is_moe else 1)
  # Norms 2 x (read + write) d, add 2 reads + 1 write of d, RoPE read and
  # write of the device's q and k, activation: gate and up read, one written.
  row_elements = 7 * d + (2 * (cfg.q_dim + cfg.kv_dim) + 3 * width) / tp
  return ModelCosts(
      gemm_flops_per_row=layers * (2 * attn_weights + mlp_flops),
      lm_head_flops_per_row=2 * head,
      attention_flops_per_pair=layers * 4 * cfg.n_heads * cfg.head_dim,
      kv_bytes_per_token=layers * 2 * cfg.kv_dim * kb,
      weight_bytes_per_step=step_elements * wb,
      expert_bytes=layers * expert * wb if cfg.is_moe else 0,
      weight_bytes=all_elements * wb,
      windows=tuple(cfg.layer_windows) or (0,) * layers,
      weight_dtype=weight_dtype, kv_dtype=kv_dtype, tp=tp,
      row_bytes_per_row=int(round(layers * row_elements * ab)),
      all_reduce_bytes_per_row=d * ab)


def draft_config(target: ModelConfig, model: str, field: str = "EngineConfig.speculative",
                 same_windows: bool = True) -> ModelConfig:
  """The ``ModelConfig`` of a draft model (``Speculation.draft``; read and
  checked against the ``target`` by ``speculative.draft_config`` and
  ``check_draft``, the model executor's own rules). With ``same_windows``
  (the simulator) its window kinds must be among the target's, which the
  simulator charges its attention by; the model executor runs any.

  Raises:
    ValueError: naming ``field``: the model cannot be read; its vocabulary
      is not the target's; or it has an attention window the target lacks
      (its attention is charged from the target's plan statistics, one
      column per window kind).
  """
  from serving.engine import speculative   # pylint: disable=import-outside-toplevel
  try:
    cfg = speculative.draft_config(model)
  except (OSError, ValueError) as e:     # ModelLoadError is a ValueError
    raise ValueError(f"{field}: the draft model {model!r} cannot be read: {e}") from None
  speculative.check_draft(target, cfg, field)
  extra = sorted(set(cfg.window_kinds) - set(target.window_kinds))
  if same_windows and extra:
    raise ValueError(f"{field}: the draft model {model!r} has attention window(s) {extra} the "
                     f"target {target.name!r} lacks ({list(target.window_kinds)}): the "
                     f"simulator charges a draft's attention by the target's window kinds")
  return cfg


def engine_model_costs(cfg: ModelConfig, engine_config) -> ModelCosts:
  """``model_costs`` of ``cfg`` in an ``EngineConfig``'s weight and KV dtypes
  (int8 weights when ``engine_config.weights`` is "int8", else its
  ``dtype``; the cache in ``kv_cache_dtype``) and its mesh's model axis
  (the TP degree). With the simulated executor and a draft model
  (``speculative="draft:MODEL,k=K"``), ``draft`` holds that model's costs
  in the same dtypes and TP degree (``draft_config``; raises its
  ValueError) and ``draft_passes`` K."""
  weights = "int8" if engine_config.weights == "int8" else engine_config.dtype
  tp = parse_mesh(getattr(engine_config, "mesh", "") or "")["model"]
  costs = model_costs(cfg, weights, engine_config.kv_cache_dtype, tp=tp)
  spec = getattr(engine_config, "speculation", None)
  if (spec is not None and spec.method == "draft"
      and getattr(engine_config, "executor", "") == "simulated"):
    draft = draft_config(cfg, spec.draft)
    costs = dataclasses.replace(
        costs, draft=model_costs(draft, weights, engine_config.kv_cache_dtype, tp=tp),
        draft_passes=spec.k)
  return costs


def plan_stats(plan: rec.IterationPlan, windows: tuple = (0,), prompt_len=None):
  """The plan's side of the step features, on device (``step_features``
  combines them with the model's ``ModelCosts`` on the host).

  Args:
    plan: the iteration's plan (selected intervals [start, end) per slot).
    windows: static, the model's distinct attention windows
      (``ModelConfig.window_kinds``; 0 = global), ascending.
    prompt_len: i32[R] each slot's prompt length (the manifest's), which
      splits rows into the prompt and generated GEMM classes; None: every
      non-decode row counts as a prompt row.
  Returns:
    f32[7 + 3 * len(windows)]: prefill rows (prompt and rebuild rows),
    decode rows (a decode row and its drafts: ``IterationPlan.num_draft``),
    rows that sample (one per scheduled sequence, and each draft row of a
    verified decode row), rows at prompt positions (below the
    request's prompt length); then per window w the query-key pairs
    one block of that window computes (a row at position j sees
    ``min(j + 1, w)`` keys, all ``j + 1`` for w = 0); then per window the
    cached keys one block reads (``min(end, w)`` per sequence). Then what
    a draft model's single-row forwards need (``DRAFT_STATS``): the decode
    rows that carry drafts, their draft tokens and the most drafts one
    row carries (the forwards the step runs); then per window the
    keys their drafts' rows see (a decode row at ``start`` with d drafts:
    draft j + 1 at position ``start + 1 + j`` sees ``start + 2 + j``),
    which is both their query-key pairs and their keys read, per block
    (``sum over k in [start + 2, start + 1 + d] of min(k, w)``). The first
    ``4 + 2 * len(windows)`` values are the statistics of a plan before
    draft models (a step log's ``plan_stats`` may hold only those).
  """
  sel = plan.selected
  start = plan.start.astype(jnp.float32)
  end = plan.end.astype(jnp.float32)
  rows = jnp.where(sel, end - start, 0.0)
  decode = sel & (plan.kind == rec.DECODE_ROW)
  prefill = jnp.sum(jnp.where(decode, 0.0, rows))
  if prompt_len is None:
    prompt_rows = prefill
  else:
    below = jnp.maximum(jnp.minimum(end, prompt_len.astype(jnp.float32)) - start, 0.0)
    prompt_rows = jnp.sum(jnp.where(sel, below, 0.0))
  # A decode row verifying k drafts runs 1 + k generated rows, each with
  # its context (the pairs below) and its own LM head row.
  decode_rows = jnp.sum(jnp.where(decode, rows, 0.0))
  drafts = decode_rows - jnp.sum(decode).astype(jnp.float32)
  out = [prefill, decode_rows, jnp.sum(sel).astype(jnp.float32) + drafts, prompt_rows]
  pairs, keys = [], []
  for w in windows:
    pairs.append(jnp.sum(jnp.where(sel, _keys_seen(start, end, w), 0.0)))
    keys.append(jnp.sum(jnp.where(sel, end if w == 0 else jnp.minimum(end, float(w)), 0.0)))
  num_draft = jnp.where(decode, rec.num_draft(plan), 0)
  carrying = decode & (num_draft > 0)
  tail = [jnp.sum(carrying).astype(jnp.float32), jnp.sum(num_draft).astype(jnp.float32),
          jnp.max(num_draft).astype(jnp.float32)]
  for w in windows:
    tail.append(jnp.sum(jnp.where(carrying, _keys_seen(start + 1.0, end, w), 0.0)))
  return jnp.stack(out + pairs + keys + tail)


# The draft-pass statistics ``plan_stats`` appends (then one per window).
DRAFT_STATS = ("draft_rows", "draft_tokens", "draft_max")


def _keys_seen(start, end, w: int):
  """f32[R]: the query-key pairs of rows at positions ``[start, end)`` in one
  block of window ``w`` (0: global): the sum over k in [start + 1, end] of
  ``min(k, w)``."""
  if w == 0:
    return (end - start) * (start + end + 1.0) / 2.0
  lo, top = start + 1.0, jnp.minimum(end, float(w))
  ramp = jnp.where(top >= lo, (lo + top) * (top - lo + 1.0) / 2.0, 0.0)
  flat = jnp.maximum(end - jnp.maximum(start, float(w)), 0.0) * float(w)
  return ramp + flat


def step_features(stats, bucket: int, costs: ModelCosts, xp=np) -> np.ndarray:
  """f64[len(FEATURES)]: one step's ``FEATURES`` values; with ``xp``
  ``jax.numpy``, of traced ``stats`` and ``bucket`` in JAX's default float
  (float64 in a ``jax.enable_x64`` scope, where the simulated loop charges
  its steps on the device by this same definition).

  A draft model's forwards (``executor.draft_propose``): with
  ``costs.draft`` set, f64[3, len(FEATURES)], one row per kind of forward
  the step runs, each priced by its own model (``CostModel.predict_ms``):

  * the target's forward, as above;
  * the draft's forward over the same packed rows (the same statistics
    and bucket with the draft's costs: its KV cache keeps step with the
    target's), whose LM head runs one row per scheduled sequence, and
    only in a step whose rows carry drafts (the row giving draft 1);
  * in such a step, the draft's single-row forwards together, as many as
    the most drafts a row carries (m <= ``costs.draft_passes``, k): each
    runs one row per decode row carrying drafts (D of them, the live rows:
    no padded bucket), draft j of a row at its position, or a one-key row
    past the row's own drafts; all but the last sample each row (the last
    only writes K/V); per forward a ``step``, a weight read and the GEMM
    passes of D rows in tiles of ``ROW_TILE``.

  Args:
    stats: ``plan_stats`` of the step's plan (for ``costs``' windows; its
      first ``4 + 2 * len(window kinds)`` values alone are a step without
      the draft tail, as a step log written before it holds).
    bucket: the token-row bucket the step needs (its GEMMs run every row).
    costs: the model's ``ModelCosts`` (in the engine's dtypes).
    xp: ``numpy`` (host) or ``jax.numpy`` (device).
  Raises:
    ValueError: ``stats`` is not for ``costs``' windows.
  """
  kinds = tuple(sorted(set(costs.windows)))
  dtype = xp.result_type(float)
  stats = xp.asarray(stats, dtype)
  bucket = xp.asarray(bucket, dtype)
  head = 4 + 2 * len(kinds)
  if stats.shape not in ((head,), (head + len(DRAFT_STATS) + len(kinds),)):
    raise ValueError(f"step_features: stats of shape {stats.shape} do not match the model's "
                     f"{len(kinds)} window kind(s) {kinds}")
  target = _pass_features(stats[:4], stats[4:4 + len(kinds)], stats[4 + len(kinds):head],
                          kinds, bucket, costs, xp)
  if costs.draft is None:
    return target
  draft = costs.draft
  mine = tuple(sorted(set(draft.windows)))
  if not set(mine) <= set(kinds):
    raise ValueError(f"step_features: the draft model's window kinds {mine} are not among "
                     f"the target's {kinds}")
  at = np.array([kinds.index(k) for k in mine], np.int32)
  if stats.shape[0] == head:
    tail = xp.zeros((len(DRAFT_STATS) + len(kinds),), dtype)
  else:
    tail = stats[head:]
  carrying, tokens, most = tail[0], tail[1], tail[2]
  sampled = xp.where(carrying > 0, stats[2] - tokens, 0.0)    # one row per sequence
  rows_pass = _pass_features((stats[0], stats[1], sampled, stats[3]),
                             stats[4:4 + len(kinds)][at], stats[4 + len(kinds):head][at],
                             mine, bucket, draft, xp)
  passes = _draft_passes_features(carrying, tokens, most, tail[len(DRAFT_STATS):][at],
                                  draft, xp)
  return xp.stack([target, rows_pass, passes])


def _per_block(costs: ModelCosts, kinds: tuple, xp, dtype):
  """(FLOPs per pair, bytes per key) of the blocks of each window kind."""
  blocks = np.array([sum(1 for w in costs.windows if w == k) for k in kinds], np.float64)
  layers = len(costs.windows)
  return (xp.asarray(blocks * (costs.attention_flops_per_pair / layers), dtype),
          xp.asarray(blocks * (costs.kv_bytes_per_token / layers), dtype))


def _pass_features(rows, pairs, keys, kinds: tuple, bucket, costs: ModelCosts, xp):
  """One forward's ``FEATURES`` from its plan statistics: ``rows`` (prefill,
  decode, sampling and prompt rows), ``pairs`` and ``keys`` per window kind
  ``kinds`` of ``costs``' model."""
  dtype = xp.result_type(float)
  prefill, decode, seqs, prompt = rows
  generated = prefill + decode - prompt        # decode rows, recomputed outputs
  if costs.weight_dtype == "int8":      # one GEMM over every row (rowwise(exact=True))
    prompt_rows, passes = bucket, 1.0
  else:
    prompt_rows = xp.where(prompt > 0, xp.maximum(bucket, LARGE_GEMM_ROWS), 0.0)
    passes = (prompt > 0) + xp.ceil(generated / ROW_TILE)
  pair_flops, key_bytes = _per_block(costs, kinds, xp, dtype)
  return xp.stack([xp.asarray(v, dtype) for v in (
      1.0,
      prefill + decode,
      bucket * costs.gemm_flops_per_row / 1e9,
      seqs * costs.lm_head_flops_per_row / 1e9,
      (pairs @ pair_flops) / 1e9,
      (keys @ key_bytes) / 1e9,
      costs.weight_bytes_per_step / 1e9,
      prompt_rows * costs.gemm_flops_per_row / 1e9,
      xp.maximum(passes - 1.0, 0.0) * costs.weight_bytes_per_step / 1e9,
  )])


def _draft_passes_features(carrying, tokens, most, keys, draft: ModelCosts, xp):
  """The ``FEATURES`` of a draft model's single-row forwards, summed, in a
  step where ``carrying`` decode rows carry ``tokens`` drafts, at most
  ``most`` each, whose rows see ``keys`` keys per window kind of ``draft``
  (``plan_stats``' draft tail); none where no row carries drafts. ``most``
  forwards each run the ``carrying`` rows (all generated rows, in tiles of
  ``ROW_TILE``); the ``most * carrying - tokens`` rows past their own
  drafts see one key; the last forward computes no logits."""
  dtype = xp.result_type(float)
  passes = most
  rows = passes * carrying
  sampled = xp.maximum(passes - 1.0, 0.0) * carrying
  keys = keys + (rows - tokens)
  pair_flops, key_bytes = _per_block(draft, tuple(sorted(set(draft.windows))), xp, dtype)
  gemm = rows * draft.gemm_flops_per_row / 1e9
  extra = passes * xp.maximum(xp.ceil(carrying / ROW_TILE) - 1.0, 0.0)
  int8 = draft.weight_dtype == "int8"     # one GEMM over every row, one pass
  return xp.stack([xp.asarray(v, dtype) for v in (
      passes,
      rows,
      gemm,
      sampled * draft.lm_head_flops_per_row / 1e9,
      (keys @ pair_flops) / 1e9,
      (keys @ key_bytes) / 1e9,
      passes * draft.weight_bytes_per_step / 1e9,
      gemm if int8 else 0.0,
      0.0 if int8 else extra * draft.weight_bytes_per_step / 1e9,
  )])


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Step-time model over ``FEATURES``.

  Attributes:
    coef_ms: ms per unit of each of ``FEATURES`` (``step``: ms per
      iteration; GFLOP and GB features: ms per GFLOP / GB), all >= 0.
    combine: "sum" (every term adds) or "roofline" (``step`` and ``rows``
      terms plus the larger of the ``COMPUTE`` and the ``MEMORY`` terms).
    min_step_ms: floor of a prediction (ms, >= 0).
    roofline_p: how "roofline" joins the compute and memory sums C and M:
      ``(C**p + M**p) ** (1/p)``; inf (default): ``max(C, M)``, the sharp
      roofline. A fitted profile's p (about 1.2-1.5) says a GEMM near its
      ridge point runs slower than either bound alone.
    tile: () or one value per feature of ``FEATURES``: a value > 0 rounds
      that feature up to a multiple of it before it is charged (a fitted
      profile's GEMM row tile: the GFLOP of one tile of rows,
      ``profiles.for_model``).
    row_gemm_gflop: 0 (default): ``gemm_gflop`` is charged as given, over
      the padded token bucket the step program runs (this engine's JAX
      step; a calibration measured it so). > 0: the GFLOP of one live row's
      weight GEMMs, and ``gemm_gflop`` is charged over the step's live rows
      instead (``rows`` x this, then ``tile``): a fitted GPU profile, whose
      measured operator times are per actual token count, stepping at the
      row tile and not at a power-of-two bucket (``profiles.for_model``
      sets it; docs/simulator.md, "What a step pays").
    meta: where it holds: ``models`` (the ``ModelCosts`` JSON of each model
      its fit ran; empty: stated model-independent, as a profile),
      ``device`` (``calibrations.device_fingerprint``), dtype, engine preset, load
      average, grid, residuals, ``uncalibrated`` for a profile; carried
      into reports.
    draft: None, or the cost model of a draft model's passes
      (``calibrations.resolve`` sets it, this model charged for the draft
      model's costs): ``predict_ms`` of a step's three passes
      (``step_features`` with a draft) prices the first with this model,
      the draft's two with it.
  Raises:
    ValueError: a coefficient count other than ``len(FEATURES)``, a
      negative coefficient, an unknown ``combine``, ``min_step_ms < 0``,
      ``roofline_p < 1`` or a ``draft`` that is not a ``CostModel``.
  """

  coef_ms: tuple
  combine: str = "sum"
  min_step_ms: float = 0.0
  meta: dict = dataclasses.field(default_factory=dict, compare=False)
  roofline_p: float = math.inf
  tile: tuple = ()
  row_gemm_gflop: float = 0.0
  draft: Optional["CostModel"] = None

  def __post_init__(self):
    if len(self.coef_ms) != len(FEATURES):
      raise ValueError(f"CostModel.coef_ms needs {len(FEATURES)} values {FEATURES}, "
                       f"got {len(self.coef_ms)}")
    if any(not c >= 0 for c in self.coef_ms):
      raise ValueError(f"CostModel.coef_ms must all be >= 0, got {self.coef_ms}")
    if self.combine not in COMBINES:
      raise ValueError(f"CostModel.combine must be one of {COMBINES}, got {self.combine!r}")
    if not self.min_step_ms >= 0:
      raise ValueError(f"CostModel.min_step_ms must be >= 0, got {self.min_step_ms}")
    if not self.roofline_p >= 1:
      raise ValueError(f"CostModel.roofline_p must be >= 1 (inf: max), got {self.roofline_p}")
    if self.tile and (len(self.tile) != len(FEATURES) or any(not t >= 0 for t in self.tile)):
      raise ValueError(f"CostModel.tile must be () or {len(FEATURES)} values >= 0, "
                       f"got {self.tile}")
    if not self.row_gemm_gflop >= 0:
      raise ValueError(f"CostModel.row_gemm_gflop must be >= 0 (0: the bucket's rows), "
                       f"got {self.row_gemm_gflop}")
    if self.draft is not None and not isinstance(self.draft, CostModel):
      raise ValueError(f"CostModel.draft must be None or a CostModel, got {self.draft!r}")
    object.__setattr__(self, "row_gemm_gflop", float(self.row_gemm_gflop))
    object.__setattr__(self, "tile", tuple(float(t) for t in self.tile))
    object.__setattr__(self, "coef_ms", tuple(float(c) for c in self.coef_ms))

  @classmethod
  def of(cls, combine: str = "sum", min_step_ms: float = 0.0, meta: Optional[dict] = None,
         **coef_ms) -> "CostModel":
    """A model from named coefficients (the rest 0), e.g.
    ``CostModel.of(step=5.0, rows=0.5)``; raises ValueError on an unknown name."""
    unknown = sorted(set(coef_ms) - set(FEATURES))
    if unknown:
      raise ValueError(f"CostModel.of: unknown feature(s) {unknown}; features are {FEATURES}")
    return cls(tuple(float(coef_ms.get(f, 0.0)) for f in FEATURES), combine, min_step_ms,
               dict(meta or {}))

  def terms_ms(self, features: Sequence[float], xp=np) -> Dict[str, float]:
    """Each feature's term (ms) of one step's ``FEATURES`` values (floats;
    with ``xp`` ``jax.numpy``, traced scalars); ``gemm_gflop`` over the live
    rows when ``row_gemm_gflop`` is set."""
    value = float if xp is np else (lambda x: x)
    live = value(features[FEATURES.index("rows")]) * self.row_gemm_gflop
    out = {}
    for i, (f, c, x) in enumerate(zip(FEATURES, self.coef_ms, features)):
      x = live if f == "gemm_gflop" and self.row_gemm_gflop > 0 else value(x)
      if self.tile and self.tile[i] > 0:
        x = xp.ceil(x / self.tile[i] - 1e-9) * self.tile[i]
      out[f] = c * (float(x) if xp is np else x)
    return out

  def predict_ms(self, features: Sequence[float], xp=np) -> float:
    """Modelled step time (ms) of one step's ``FEATURES`` values: a float
    on the host; with ``xp`` ``jax.numpy``, a traced scalar (the simulated
    loop's step time on the device, float64 in its ``jax.enable_x64``
    scope, by the same definition).

    With a draft model, ``features`` is f64[3, len(FEATURES)]
    (``step_features``): the target's forward priced by this model, the
    draft's forward over the packed rows and its single-row passes by
    ``draft``, each combined on its own ("roofline": each pass bound by
    its own compute or memory) and added; ``min_step_ms`` floors the sum.

    Raises:
      ValueError: a profile not charged for its model (``resolve``), or
        the passes of a draft model without ``draft``.
    """
    ndim = features.ndim if hasattr(features, "ndim") else np.ndim(features)
    if ndim == 2:
      if self.draft is None:
        raise ValueError("cost model: features of a draft model's passes need "
                         "CostModel.draft (calibrations.resolve with the draft's ModelCosts)")
      total = (self._unfloored_ms(features[0], xp) + self.draft._unfloored_ms(features[1], xp)
               + self.draft._unfloored_ms(features[2], xp))
    else:
      total = self._unfloored_ms(features, xp)
    total = xp.maximum(self.min_step_ms, total)
    return float(total) if xp is np else total

  def _unfloored_ms(self, features, xp):
    """``predict_ms`` of one forward's ``FEATURES`` before the floor."""
    if self.meta.get("per_model") and not self.meta.get("for_model"):
      raise ValueError(f"cost model {self.meta.get('profile', '')!r} has per-model terms "
                       f"(fitted operator and collective costs): resolve(model, costs) "
                       f"first, which charges them for the model at hand")
    t = self.terms_ms(features, xp)
    if self.combine == "sum":
      total = sum(t.values())
    else:
      compute, memory = sum(t[f] for f in COMPUTE), sum(t[f] for f in MEMORY)
      if math.isinf(self.roofline_p):
        bound = xp.maximum(compute, memory)
      else:
        p = self.roofline_p
        bound = (compute ** p + memory ** p) ** (1.0 / p)
      total = t["step"] + t["rows"] + bound
    return total

  def efficiencies(self) -> Dict[str, float]:
    """Throughput each GFLOP / GB term stands for (GFLOP/s or GB/s:
    ``1000 / coef``; inf for a zero coefficient, a term the fit found free)."""
    return {f: (1000.0 / c if c > 0 else float("inf"))
            for f, c in zip(FEATURES, self.coef_ms) if f in COMPUTE + MEMORY}

  @property
  def models(self) -> list:
    """The ``ModelCosts`` JSON of each model the fit ran (empty: any model)."""
    return list(self.meta.get("models", []))

  def to_json(self) -> dict:
    out = {"features": list(FEATURES), "coef_ms": dict(zip(FEATURES, self.coef_ms)),
           "combine": self.combine, "min_step_ms": self.min_step_ms, "meta": self.meta}
    if not math.isinf(self.roofline_p):
      out["roofline_p"] = self.roofline_p
    if self.tile:
      out["tile"] = dict(zip(FEATURES, self.tile))
    if self.row_gemm_gflop > 0:
      out["row_gemm_gflop"] = self.row_gemm_gflop
    if self.draft is not None:
      out["draft"] = self.draft.to_json()
    return out

  def save(self, path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")


def from_json(d: dict, where: str) -> CostModel:
  """A ``CostModel`` from its JSON (``CostModel.to_json``).

  Raises:
    ValueError: naming ``where`` and the missing feature, e.g. a calibration
      of the old row-count form (re-run ``scripts/calibrate.py``).
  """
  coef = dict(d.get("coef_ms", {}))
  if all(f in coef for f in FEATURES if f not in ADDED_FEATURES):
    coef = {f: 0.0 for f in ADDED_FEATURES} | coef    # written before the row classes
  missing = [f for f in FEATURES if f not in coef]
  if missing:
    raise ValueError(f"{where}: cost model needs coef_ms for every feature {list(FEATURES)}; "
                     f"missing {missing} (a calibration of another form: re-run "
                     f"scripts/calibrate.py)")
  return CostModel(tuple(coef[f] for f in FEATURES), d.get("combine", "sum"),
                   float(d.get("min_step_ms", 0.0)), dict(d.get("meta", {})),
                   float(d.get("roofline_p", math.inf)),
                   tuple(d["tile"].get(f, 0.0) for f in FEATURES) if d.get("tile") else (),
                   float(d.get("row_gemm_gflop", 0.0)),
                   from_json(d["draft"], f"{where} (draft)") if d.get("draft") else None)


def fit(features, step_ms, *, free: Sequence[str] = FEATURES, min_step_ms: float = 0.0,
        meta: Dict = None, nonnegative: bool = True, relative: bool = False) -> CostModel:
  """Least-squares fit of the "sum" model.

  ``relative``: minimize the steps' relative errors (each row weighted by
  1 / its time) rather than their errors in ms. Step times span 20-600 ms
  on a CPU grid; in ms the long prompt steps decide the shared terms and a
  decode step's error can reach 20% (docs/simulator.md, "The Intel Xeon
  calibration").

  With ``nonnegative`` (default) every coefficient is constrained to >= 0
  (``scipy.optimize.nnls``): a row, a FLOP or a byte never saves time, and
  on collinear grids an unconstrained fit can trade a large negative
  coefficient for a large positive one. Otherwise ``numpy.linalg.lstsq``
  (a negative result is then refused by ``CostModel``).

  Args:
    features: f64[N, len(FEATURES)] rows of ``step_features``.
    step_ms: f64[N] measured step times (ms).
    free: the features fitted; the others are held at 0 (a grid on one
      model cannot tell ``weight_read_gb`` from ``step``: leave it out).
  Returns:
    a CostModel whose ``meta`` adds the fit's RMS and max absolute residual
    (ms), the median relative residual, the number of samples and the
    RMS residual each fitted feature's removal would leave
    (``residual_without``: what each term earns).
  Raises:
    ValueError: shapes disagree, an unknown feature in ``free``, fewer
      samples than unknowns, or a step time <= 0 with ``relative``.
  """
  x = np.asarray(features, np.float64)
  y = np.asarray(step_ms, np.float64)
  if x.ndim != 2 or x.shape[1] != len(FEATURES) or y.shape != (x.shape[0],):
    raise ValueError(f"fit needs features f64[N, {len(FEATURES)}] and step_ms f64[N], "
                     f"got {x.shape} and {y.shape}")
  if relative and not np.all(y > 0):
    raise ValueError("fit(relative=True) needs every step_ms > 0")
  w = 1.0 / y if relative else np.ones_like(y)
  unknown = sorted(set(free) - set(FEATURES))
  if unknown:
    raise ValueError(f"fit: unknown feature(s) in free: {unknown}; features are {FEATURES}")
  cols = [i for i, f in enumerate(FEATURES) if f in free]
  if x.shape[0] < len(cols) + 1:
    raise ValueError(f"fit needs at least {len(cols) + 1} samples, got {x.shape[0]}")

  def solve(use):
    a = x[:, use]
    if nonnegative:
      from scipy.optimize import nnls     # pylint: disable=import-outside-toplevel
      c, _ = nnls(a * w[:, None], y * w)
    else:
      c, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    return c, y - a @ c

  coef_free, resid = solve(cols)
  coef = np.zeros(len(FEATURES))
  coef[cols] = coef_free
  without = {}
  for i in cols:
    if len(cols) > 1:
      without[FEATURES[i]] = float(np.sqrt(np.mean(solve([j for j in cols if j != i])[1] ** 2)))
  meta = dict(meta or {}, num_samples=int(x.shape[0]), free=[FEATURES[i] for i in cols],
              solver="nnls" if nonnegative else "lstsq",
              fit_error="relative" if relative else "absolute",
              rms_residual_ms=float(np.sqrt(np.mean(resid ** 2))),
              max_abs_residual_ms=float(np.max(np.abs(resid))),
              median_rel_residual=float(np.median(np.abs(resid) / np.maximum(y, 1e-9))),
              residual_without=without)
  return CostModel(tuple(float(c) for c in coef), "sum", min_step_ms, meta)
