"""Tensor parallelism over a ``jax.sharding.Mesh`` (Megatron-style, by GSPMD).

A mesh spec names the sizes of the two mesh axes, ``"data:D,model:M"`` (either
may be left out; a left-out axis has size 1; ``""`` means no mesh: one device,
as without tensor parallelism). One engine uses ``data == 1``: data-parallel
replicas are separate engines, each with its own mesh.

Weights are placed by their path in the parameter tree (``models.llama``'s
docstring lists it), following Megatron-LM (Shoeybi et al., 2019):

  ================================  ===========================  =========
  path                              split                        group
  ================================  ===========================  =========
  layers/attn/wq, wk, wv            columns (heads)              attention
  layers/attn/bq, bk, bv            their only axis (heads)      attention
  layers/attn/wo                    rows (heads)                 attention
  layers/attn/bo                    replicated (added after the  -
                                    row-parallel all-reduce)
  layers/mlp/w_gate, w_up           columns (ffn)                mlp
  layers/mlp/w_down                 rows (ffn)                   mlp
  layers/moe/router                 replicated                   -
  layers/moe/experts_gate, _up      columns (each expert's ffn)  experts
  layers/moe/experts_down           rows (each expert's ffn)     experts
  embed/embedding                   rows (vocabulary)            vocab
  lm_head                           columns (vocabulary)         vocab
  lm_head_panels                    replicated (one device only) -
  */scale (RMSNorm, q/k norms,      replicated                   -
  Gemma's post norms)
  ================================  ===========================  =========

A rule names the split of the weight without its layer axis (``[K, N]``,
``[N]`` for a bias, ``[E, K, N]`` for an expert stack) and applies alike to
the stacked leaf (``[L, K, N]``: the layer axis is not split), to each
element of ``models.llama.split_layers``' per-layer tuples (``[K, N]``), and
to an int8 ``models.quant.QuantizedWeight`` of either (its ``q`` like the
float weight, its per-column ``col_scale [..., N]`` like the weight's
columns: split for a column-parallel weight, replicated for a row-parallel
one). Int8 weights run on one device (``EngineConfig`` refuses them with a
mesh), so the AMX tile layout, whose bytes are permuted, is never split.

Experts are split Megatron-style within each expert (every device holds
every expert's slice of the ffn axis), not expert-parallel (each device a
subset of the experts). Measured on the three grouped GEMMs of an expert
MLP (``models.moe.grouped_matmul``, x [M, K] replicated, w [E, K, N]) under
GSPMD on CPU with 4 fake devices (E 8, K 64, F 128, M 40; jax 0.10.2):

  =====================  ===============================  ==================
  grouped GEMM, split    collectives GSPMD inserts        max diff vs 1 dev.
  =====================  ===============================  ==================
  ragged_dot, E          all-reduce of the gate and up    7.2e-7
                         outputs [M, F] and down [M, D]
  ragged_dot, F          all-reduce of down [M, D]        3.6e-7
  tiled (CPU), E         all-gather of every expert       0 (bitwise)
                         weight: replicated, defeats TP
  tiled (CPU), F         all-reduce of each down tile     9.5e-7
                         [GROUP_TILE, D]
  =====================  ===============================  ==================

(outputs of order 1). Splitting F compiles and keeps the weights split
under both implementations, communicating only the down projection's
partial sums (of the routed rows), as a dense MLP does; the tiled GEMM's
per-tile expert index cannot be partitioned over E. The
experts group is split when ``M`` divides ``ffn_dim`` (one expert's width).

The KV cache ``[L, pages, page_size, n_kv_heads, head_dim]`` is split on its
KV-head axis with the attention group. Everything else (scheduler records,
page tables, request buffers) is replicated on every device.

Head counts the mesh does not divide are not refused. The rule: a group is
split over ``model`` when the model-axis size ``M`` divides its dimension
(attention: ``n_kv_heads``, which then also divides ``n_heads``; mlp and
experts: ``ffn_dim``; vocab: ``vocab_size``), and replicated on every device
of the axis otherwise. SmolLM2-135M (9 query, 3 KV heads, ffn 1536, vocab
49152) therefore runs attention split at M = 3 and replicated at M = 2 or 4,
with its MLP and vocabulary split at M = 2, 3 and 4.

The jitted programs stay the same programs: their inputs carry
``NamedSharding``s and GSPMD partitions them, inserting the all-reduce after
every row-parallel product and the collectives of the vocabulary-split
embedding lookup and logits. Split attention runs under ``shard_map``
(``attention_over_heads``): each device attends with its own KV heads and
their query heads, whatever the implementation, so a Pallas kernel (which
GSPMD cannot partition) runs per device on its heads, with no collective.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.config import ModelConfig

MESH_AXES = ("data", "model")

# Last path keys -> (group, spec of the weight without its stacked layer
# axis); group None: replicated whatever the mesh. Column-parallel weights
# split their output axis, row-parallel their input.
_COLUMN, _ROW, _BIAS = P(None, "model"), P("model", None), P("model")
_EXPERT_COLUMN, _EXPERT_ROW = P(None, None, "model"), P(None, "model", None)
_RULES = {
    ("attn", "wq"): ("attention", _COLUMN),
    ("attn", "wk"): ("attention", _COLUMN),
    ("attn", "wv"): ("attention", _COLUMN),
    ("attn", "bq"): ("attention", _BIAS),
    ("attn", "bk"): ("attention", _BIAS),
    ("attn", "bv"): ("attention", _BIAS),
    ("attn", "wo"): ("attention", _ROW),
    ("attn", "bo"): (None, P(None)),
    ("mlp", "w_gate"): ("mlp", _COLUMN),
    ("mlp", "w_up"): ("mlp", _COLUMN),
    ("mlp", "w_down"): ("mlp", _ROW),
    ("moe", "router"): (None, P(None, None)),
    ("moe", "experts_gate"): ("experts", _EXPERT_COLUMN),
    ("moe", "experts_up"): ("experts", _EXPERT_COLUMN),
    ("moe", "experts_down"): ("experts", _EXPERT_ROW),
    ("embed", "embedding"): ("vocab", _ROW),
    ("lm_head",): ("vocab", _COLUMN),
    # models.llama.HEAD_PANELS [ceil(vocab / 64), d_model, 64]: the native
    # decode GEMM's copy of the head, which runs on one device only.
    ("lm_head_panels",): (None, P(None, None, None)),
}
# The fields of an int8 ``models.quant.QuantizedWeight`` leaf.
_QUANTIZED_FIELDS = ("q", "col_scale")


def parse_mesh(spec: str) -> Dict[str, int]:
  """``"data:D,model:M"`` -> ``{"data": D, "model": M}`` (missing axes 1).

  Raises:
    ValueError: an unknown or repeated axis name, a size that is not an int
      >= 1, or ``data > 1`` (one engine is one data index).
  """
  sizes = {axis: 1 for axis in MESH_AXES}
  seen = set()
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, sep, size = item.partition(":")
    if not sep or name not in MESH_AXES or name in seen:
      raise ValueError(f"EngineConfig.mesh must be comma-separated AXIS:SIZE items with "
                       f"each AXIS once, one of {MESH_AXES}, got {spec!r}")
    if not size.isdigit() or int(size) < 1:
      raise ValueError(f"EngineConfig.mesh axis {name!r} must have an int size >= 1, "
                       f"got {size!r}")
    seen.add(name)
    sizes[name] = int(size)
  if sizes["data"] != 1:
    raise ValueError(f"EngineConfig.mesh data axis must be 1 in one engine (data-parallel "
                     f"replicas are separate engines), got {spec!r}")
  return sizes


def make_mesh(spec: str, devices: Optional[Sequence[jax.Device]] = None) -> Optional[Mesh]:
  """The ``Mesh`` of ``spec`` over the first ``data * model`` of ``devices``
  (default: ``jax.devices()``, every process's devices after
  ``jax.distributed.initialize``), or None for ``""``.

  Raises:
    ValueError: a bad spec (``parse_mesh``) or more devices asked than exist.
  """
  if not spec:
    return None
  sizes = parse_mesh(spec)
  devices = list(jax.devices() if devices is None else devices)
  need = sizes["data"] * sizes["model"]
  if need > len(devices):
    raise ValueError(f"EngineConfig.mesh {spec!r} needs {need} devices, JAX has "
                     f"{len(devices)} (on CPU, XLA_FLAGS=--xla_force_host_platform_"
                     f"device_count=N before jax starts makes N)")
  grid = np.array(devices[:need], dtype=object).reshape(sizes["data"], sizes["model"])
  return Mesh(grid, MESH_AXES)


def initialize_processes(coordinator: str, num_processes: int, process_id: int) -> None:
  """Joins this process to a multi-process JAX run (``jax.distributed``).

  Every process calls it with the same ``coordinator`` (``HOST:PORT`` of
  process 0) and ``num_processes``, and its own ``process_id``, before any
  other JAX call. Afterwards ``jax.devices()`` lists every process's devices
  (``jax.local_devices()`` this one's), a mesh spans them, and one engine
  runs multi-controller: each process runs the same host loop and launches
  the same programs, whose collectives cross processes (on CPU over gloo).
  The host loops must therefore make the same decisions: same requests in
  the same order, and a clock that agrees (``sim_executor.VirtualClock``).

  Raises:
    ValueError: ``num_processes < 1``, ``process_id`` outside
      ``[0, num_processes)``, or a coordinator that is not ``HOST:PORT``.
  """
  if num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, num_processes={num_processes}), "
                     f"got {process_id}")
  host, _, port = coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"coordinator must be HOST:PORT, got {coordinator!r}")
  jax.distributed.initialize(coordinator, num_processes=num_processes,
                             process_id=process_id)


def split_groups(cfg: ModelConfig, model_size: int) -> Dict[str, bool]:
  """Which weight groups of ``cfg``'s model are split over a model axis of
  ``model_size`` (the rule in the module docstring): ``attention``, ``mlp``
  (dense models) or ``experts`` (``cfg.num_experts`` > 0), ``vocab``."""
  ffn = "experts" if cfg.num_experts else "mlp"
  return {"attention": cfg.n_kv_heads % model_size == 0,
          ffn: cfg.ffn_dim % model_size == 0,
          "vocab": cfg.vocab_size % model_size == 0}


def _model_size(mesh: Optional[Mesh]) -> int:
  return 1 if mesh is None else mesh.shape["model"]


def _weight_path(path):
  """(dict keys, QuantizedWeight field or None) of a leaf's tree path: the
  index of a per-layer tuple element is dropped (the element is one layer
  of the weight), a ``QuantizedWeight`` field is returned apart."""
  keys, field = [], None
  for k in path:
    if isinstance(k, jax.tree_util.SequenceKey):
      continue
    if isinstance(k, jax.tree_util.GetAttrKey) and k.name in _QUANTIZED_FIELDS:
      field = k.name
      continue
    keys.append(getattr(k, "key", getattr(k, "name", str(k))))
  return tuple(keys), field


def param_specs(params, cfg: ModelConfig, model_size: int):
  """The ``PartitionSpec`` of every leaf of ``params`` (same tree).

  ``params`` is in ``models.llama``'s layout, stacked (``[L, K, N]``) or
  with ``split_layers``' per-layer tuples (``[K, N]`` each), float or int8
  ``QuantizedWeight`` (``q`` [..., K, N] int8, ``col_scale`` [..., N]
  float32); leaves may be arrays or shape structs. A leaf of a split group
  gets its rule's spec, with ``None`` for a leading layer axis; a leaf of a
  replicated group ``P()``.

  Raises:
    ValueError: a leaf whose path has no rule (a new weight must be given
      one), a leaf with fewer axes than its rule or more than one axis in
      front of them, or a split axis ``model_size`` does not divide (a
      shape that disagrees with ``cfg``).
  """
  split = split_groups(cfg, model_size)

  def spec(path, leaf):
    keys, field = _weight_path(path)
    name = "/".join(map(str, keys)) + (f".{field}" if field else "")
    if keys and keys[-1] == "scale":
      return P()
    for suffix, (group, rule) in _RULES.items():
      if keys[-len(suffix):] != suffix:
        continue
      if field == "col_scale":           # per output column: the rule's last axis
        rule = P(*tuple(rule)[-1:])
      extra = leaf.ndim - len(rule)
      if extra not in (0, 1):
        raise ValueError(f"parameter {name} has shape {tuple(leaf.shape)}: its sharding "
                         f"rule {rule} wants {len(rule)} axes, or one more in front "
                         f"(the layer axis)")
      if group is None or not split.get(group, False) or "model" not in tuple(rule):
        return P()
      out = (None,) * extra + tuple(rule)
      axis = out.index("model")
      if leaf.shape[axis] % model_size:
        raise ValueError(f"parameter {name} has shape {tuple(leaf.shape)}: axis {axis} "
                         f"does not divide by the model axis size {model_size}, though "
                         f"the config's {group} group splits")
      # Trailing replicated axes left out: the spec GSPMD gives a slice of a
      # placed stack (``split_layers``' ``w[i]`` of a row-parallel
      # [L, K, N] is ``P("model")``), so placing the split tree again is no
      # copy and no new program signature.
      while out[-1] is None:
        out = out[:-1]
      return P(*out)
    raise ValueError(f"parameter {name} has no sharding rule in models.sharding")

  return jax.tree_util.tree_map_with_path(spec, params)


def param_shardings(params, cfg: ModelConfig, mesh: Mesh):
  """``NamedSharding`` per leaf of ``params`` (leaves may be shape structs)."""
  specs = param_specs(params, cfg, _model_size(mesh))
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                is_leaf=lambda x: isinstance(x, P))


def kv_spec(cfg: ModelConfig, model_size: int) -> P:
  """Spec of a ``KVCache`` array ``[L, pages, page_size, n_kv_heads, head_dim]``:
  split on its KV-head axis when attention is split, else replicated."""
  return P(None, None, None, "model", None) if split_groups(cfg, model_size)[
      "attention"] else P()


def attention_mesh(cfg: ModelConfig, mesh: Optional[Mesh]) -> Optional[Mesh]:
  """``mesh`` when it splits attention (``split_groups``), else None
  (replicated attention needs no ``shard_map``)."""
  if mesh is None or not split_groups(cfg, _model_size(mesh))["attention"]:
    return None
  return mesh


def attention_over_heads(attend, mesh: Mesh):
  """``attend(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, num_seqs)``
  under ``shard_map`` over ``model``: q ``[T, n_heads, head_dim]`` and the
  pages ``[pages, page_size, n_kv_heads, head_dim]`` split by head (device
  ``i`` holds KV heads ``[i * n_kv / M, (i + 1) * n_kv / M)`` and exactly
  the query heads that read them), the metadata replicated; the output is
  split like q."""
  heads, pages = P(None, "model", None), P(None, None, "model", None)
  return jax.shard_map(attend, mesh=mesh,
                       in_specs=(heads, pages, pages, P(), P(), P(), P()),
                       out_specs=heads, check_vma=False)


def shard_params(params, cfg: ModelConfig, mesh: Mesh):
  """``params`` (host or device arrays) placed into their target shardings;
  a device array already placed so (an equivalent sharding) is kept as it
  is, not copied."""
  targets = param_shardings(params, cfg, mesh)

  def place(x, target):
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(target, x.ndim):
      return x
    return jax.device_put(x, target)

  return jax.tree_util.tree_map(place, params, targets)


def shard_kv(kv, cfg: ModelConfig, mesh: Mesh):
  """The ``KVCache`` placed with ``kv_spec`` on ``mesh``."""
  sharding = NamedSharding(mesh, kv_spec(cfg, _model_size(mesh)))
  return jax.device_put(kv, sharding)


def replicated(mesh: Mesh) -> NamedSharding:
  """Every device of ``mesh`` holds the whole array."""
  return NamedSharding(mesh, P())


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where one engine's arrays live: a mesh, or one device (``mesh`` None)."""

  cfg: ModelConfig
  mesh: Optional[Mesh]

  def params(self, params):
    if self.mesh is None:
      return params
    return shard_params(params, self.cfg, self.mesh)

  def kv(self, kv):
    if self.mesh is None:
      return jax.device_put(kv, jax.local_devices()[0])
    return shard_kv(kv, self.cfg, self.mesh)

  def tables(self, tables):
    """Scheduler records, page tables and request buffers (replicated)."""
    return jax.device_put(tables, jax.local_devices()[0] if self.mesh is None
                          else replicated(self.mesh))

  def pinned(self, cache_then: int = 0) -> dict:
    """``jax.jit`` keywords that pin a program's outputs to the shardings
    its inputs have: all replicated, or (``cache_then`` > 0) an output
    tuple of a ``KVCache`` split with ``kv_spec`` then ``cache_then``
    replicated pytrees. Empty without a mesh (one device: outputs stay
    where the inputs are)."""
    if self.mesh is None:
      return {}
    rest = replicated(self.mesh)
    if not cache_then:
      return dict(out_shardings=rest)
    cache = NamedSharding(self.mesh, kv_spec(self.cfg, _model_size(self.mesh)))
    return dict(out_shardings=(cache,) + (rest,) * cache_then)
