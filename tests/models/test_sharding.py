"""Tensor parallelism (models.sharding) and multi-process JAX.

The mesh tests need several devices, which on CPU exist only when XLA_FLAGS
asks for fake host devices before jax starts, so they run in subprocesses
(this pytest process has one device).
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P

from models import llama, quant, sharding
from models.config import ModelConfig, RopeConfig, get_config
from serving.engine.config import EngineConfig
from tests.serving import multiprocess_replay

ROOT = Path(__file__).resolve().parents[2]
TP_CFG = multiprocess_replay.CFG     # tiny, ffn 192 and vocabulary 768


def _env(num_devices: int) -> dict:
  env = dict(os.environ, PYTHONPATH=str(ROOT),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}")
  env.pop("JAX_PLATFORMS", None)
  return dict(env, JAX_PLATFORMS="cpu")


def test_mesh_spec_is_parsed_and_bad_specs_name_the_rule():
  assert sharding.parse_mesh("model:4") == {"data": 1, "model": 4}
  assert sharding.parse_mesh("data:1,model:2") == {"data": 1, "model": 2}
  assert sharding.make_mesh("") is None
  for spec, rule in [("model:0", "int size >= 1"), ("model:x", "int size >= 1"),
                     ("tensor:2", "AXIS:SIZE"), ("model:2,model:2", "each AXIS once"),
                     ("data:2,model:2", "data axis must be 1")]:
    with pytest.raises(ValueError, match=rule):
      EngineConfig(mesh=spec)
  with pytest.raises(ValueError, match="needs 2 devices, JAX has 1"):
    sharding.make_mesh("model:2")


def test_split_rule_for_head_counts_the_mesh_does_not_divide():
  smollm2 = get_config("smollm2-135m")      # 9 query / 3 KV heads, ffn 1536, vocab 49152
  assert sharding.split_groups(smollm2, 3) == dict(attention=True, mlp=True, vocab=True)
  for size in (2, 4):
    assert sharding.split_groups(smollm2, size) == dict(attention=False, mlp=True,
                                                        vocab=True)
  assert sharding.split_groups(get_config("tiny"), 3) == dict(attention=False, mlp=False,
                                                              vocab=False)


def test_param_specs_are_megatron_by_path():
  params = jax.eval_shape(lambda: llama.init_params(TP_CFG, jax.random.PRNGKey(0)))
  specs = sharding.param_specs(params, TP_CFG, 2)
  layer_col, layer_row = P(None, None, "model"), P(None, "model")   # trailing None left out
  assert [specs["layers"]["attn"][w] for w in ("wq", "wk", "wv", "wo")] == [
      layer_col, layer_col, layer_col, layer_row]
  assert [specs["layers"]["mlp"][w] for w in ("w_gate", "w_up", "w_down")] == [
      layer_col, layer_col, layer_row]
  assert specs["embed"]["embedding"] == P("model")
  assert specs["layers"]["attn_norm"]["scale"] == specs["final_norm"]["scale"] == P()
  assert sharding.kv_spec(TP_CFG, 2) == P(None, None, None, "model", None)
  # Model axis 4 does not divide the 2 KV heads: attention and cache replicated.
  specs4 = sharding.param_specs(params, TP_CFG, 4)
  assert specs4["layers"]["attn"]["wq"] == P() and sharding.kv_spec(TP_CFG, 4) == P()
  assert specs4["layers"]["mlp"]["w_down"] == layer_row
  with pytest.raises(ValueError, match="extra/w has no sharding rule"):
    sharding.param_specs({"extra": {"w": jax.ShapeDtypeStruct((2, 2), "f4")}}, TP_CFG, 2)


# One small config per family (the switches of models/config.py that add or
# reshape parameters, and a few that do not), at widths 2 and 4 divide where a
# split is wanted: 2 KV heads (attention split at 2, replicated at 4), ffn
# 128, vocabulary 384.
_BASE = ModelConfig(vocab_size=384, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=16, ffn_dim=128, tie_embeddings=False, name="family")
FAMILY_CFGS = {
    "llama3.1": dataclasses.replace(_BASE, rope_theta=500000.0, rope=RopeConfig(
        kind="llama3", theta=500000.0, factor=8.0, original_max_position=64)),
    "qwen2.5": dataclasses.replace(_BASE, qkv_bias=True, family="qwen2"),
    "llama-attention-bias": dataclasses.replace(_BASE, qkv_bias=True, o_bias=True),
    "qwen3": dataclasses.replace(_BASE, head_dim=32, qk_norm=True, family="qwen3"),
    "mistral": dataclasses.replace(_BASE, layer_windows=(8, 8), family="mistral"),
    "gemma2": dataclasses.replace(
        _BASE, tie_embeddings=True, norm_style="gemma", post_norms=True,
        activation="gelu_tanh", scale_embeddings=True, attn_softcap=4.0,
        final_softcap=8.0, layer_windows=(8, 0), family="gemma2"),
    "gemma3": dataclasses.replace(
        _BASE, tie_embeddings=True, head_dim=32, qk_norm=True, norm_style="gemma",
        post_norms=True, activation="gelu_tanh", scale_embeddings=True,
        layer_windows=(8, 0), rope_local=RopeConfig(theta=10000.0), family="gemma3"),
    "phi3": dataclasses.replace(_BASE, rotary_dim=12, layer_windows=(8, 8), family="phi3"),
    "mixtral": dataclasses.replace(_BASE, ffn_dim=96, num_experts=4, experts_per_token=2,
                                   family="mixtral"),
    "qwen3-moe": dataclasses.replace(_BASE, ffn_dim=64, num_experts=4, experts_per_token=2,
                                     qk_norm=True, family="qwen3_moe"),
}


def _family_shapes(cfg):
  return jax.eval_shape(lambda: llama.init_params(cfg, jax.random.PRNGKey(0)))


def _flat(tree):
  return {"/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                   for k in path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(
              tree, is_leaf=lambda x: isinstance(x, P))}


@pytest.mark.parametrize("family", sorted(FAMILY_CFGS))
def test_every_family_parameter_gets_a_spec_split_as_its_group(family):
  """Every leaf of every family's tree has a rule, at model axes 1, 2, 4 and
  for the stacked and the per-layer (``split_layers``) trees; the new leaves
  split or replicate as the module docstring's table says."""
  cfg = FAMILY_CFGS[family]
  shapes = _family_shapes(cfg)
  per_layer = jax.eval_shape(lambda: llama.split_layers(
      llama.init_params(cfg, jax.random.PRNGKey(0))))
  col, row, vec = P(None, None, "model"), P(None, "model"), P(None, "model")
  for size in (1, 2, 4):
    split = sharding.split_groups(cfg, size)
    assert set(split) == {"attention", "experts" if cfg.num_experts else "mlp", "vocab"}
    specs = _flat(sharding.param_specs(shapes, cfg, size))
    layer_specs = _flat(sharding.param_specs(per_layer, cfg, size))
    assert set(specs) == set(_flat(shapes))
    attn = split["attention"]      # at size 1 every group "splits" over one device
    want = {"layers/attn/wq": col if attn else P(), "layers/attn/wo": row if attn else P(),
            "layers/attn/bq": vec if attn else P(), "layers/attn/bk": vec if attn else P(),
            "layers/attn/bo": P(), "layers/attn/q_norm/scale": P(),
            "layers/attn/k_norm/scale": P(), "layers/post_attn_norm/scale": P(),
            "layers/post_mlp_norm/scale": P(), "layers/moe/router": P(),
            "layers/moe/experts_gate": P(None, None, None, "model"),
            "layers/moe/experts_up": P(None, None, None, "model"),
            "layers/moe/experts_down": P(None, None, "model"),
            "layers/mlp/w_gate": col, "layers/mlp/w_down": row}
    for path, spec in want.items():
      if path not in specs:
        continue
      group = path.split("/")[1]
      on = split.get({"attn": "attention", "mlp": "mlp",
                                   "moe": "experts"}.get(group, group), False)
      assert specs[path] == (spec if on or spec == P() else P()), (family, size, path)
    for path, spec in specs.items():      # per-layer [K, N]: the rule without the layer axis
      if path.startswith("layers/attn/w") or path.startswith("layers/mlp/w"):
        for i in range(cfg.n_layers):
          assert layer_specs[f"{path}/{i}"] == (P(*tuple(spec)[1:]) if spec != P()
                                                else P()), (family, size, path, i)
      elif "/" not in path or not path.startswith("layers/"):
        assert layer_specs[path] == spec
  if cfg.qkv_bias:
    assert "layers/attn/bq" in _flat(shapes)
  if cfg.num_experts:
    assert _flat(shapes)["layers/moe/experts_down"].shape == (2, 4, cfg.ffn_dim, 64)


def test_int8_weights_get_their_float_weights_split():
  """A ``QuantizedWeight`` (stacked, per layer, and the LM head): ``q`` like
  the float weight, ``col_scale`` split with the columns of a column-
  parallel weight, replicated for a row-parallel one."""
  from tests.models.conftest import perturbed_params  # pylint: disable=import-outside-toplevel
  params = quant.quantize_params(perturbed_params(TP_CFG, seed=0), TP_CFG.tie_embeddings)
  for tree in (params, llama.split_layers(params)):
    specs = sharding.param_specs(tree, TP_CFG, 2)
    attn, mlp = specs["layers"]["attn"], specs["layers"]["mlp"]
    stacked = not isinstance(attn["wq"], tuple)
    one = lambda w: w if stacked else w[1]
    lead = (None,) if stacked else ()
    assert one(attn["wq"]).q == P(*lead, None, "model")
    assert one(attn["wq"]).col_scale == P(*lead, "model")
    assert one(attn["wo"]).q == P(*lead, "model") and one(attn["wo"]).col_scale == P()
    assert one(mlp["w_down"]).q == P(*lead, "model")
    assert specs["lm_head"].q == P(None, "model") and specs["lm_head"].col_scale == P("model")
  # Not divided (4 does not divide the 2 KV heads): replicated, q and scales.
  specs4 = sharding.param_specs(params, TP_CFG, 4)["layers"]["attn"]["wq"]
  assert specs4.q == specs4.col_scale == P()


def test_a_shape_that_disagrees_with_its_rule_or_the_config_is_refused():
  bad_rank = {"layers": {"attn": {"wq": jax.ShapeDtypeStruct((2, 2, 64, 32), "f4")}}}
  with pytest.raises(ValueError, match=r"layers/attn/wq has shape \(2, 2, 64, 32\)"):
    sharding.param_specs(bad_rank, TP_CFG, 2)
  odd = {"layers": {"mlp": {"w_up": jax.ShapeDtypeStruct((2, 64, 191), "f4")}}}
  with pytest.raises(ValueError, match="axis 2 does not divide by the model axis size 2"):
    sharding.param_specs(odd, TP_CFG, 2)


@pytest.mark.extended
def test_tp_meshes_match_one_device_logits_and_greedy_tokens(tmp_path):
  """Model axes 2, 3, 4 against one device (tp 1) through the Engine: split
  attention at 2, replicated attention with split MLP and vocabulary at 3
  and 4 (2 KV heads), every program compiled at most its bound."""
  preset = json.loads((ROOT / "configs" / "tiny.json").read_text())
  preset["min_bucket"] = preset["max_num_batched_tokens"]     # one token bucket
  (tmp_path / "tiny1.json").write_text(json.dumps(preset))
  out = tmp_path / "rows.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "tp_equality.py"), "--tps=2,3,4",
       "--prompt_lens=5,17,9", "--max_tokens=4", f"--engine={tmp_path / 'tiny1.json'}",
       f"--out={out}", "--devices=4"],
      env=_env(4), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert [r["mesh"] for r in rows] == ["one device", "model:2", "model:3", "model:4"]
  assert [r["split"].get("attention") for r in rows[1:]] == [True, False, False]
  for r in rows[1:]:
    assert r["tokens_equal"] and r["compile_bound_ok"], r
    # One token bucket: the iteration program compiles once, for both paths
    # (iterations that need the host run their settled plan in it too).
    assert r["compiled"]["step"] == 1 and "execute" not in r["compiled"]
    assert 0.0 < r["max_abs_logit_diff"] < 1e-5     # partial sums re-associated
  # No emitted position is a near-tie that a 1e-5 logit difference could flip.
  assert rows[0]["min_margin"] > 2e-5


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.extended        # two JAX processes (~70 s); one-process meshes run by default
def test_two_processes_serve_one_replay_on_one_mesh():
  """jax.distributed on 127.0.0.1: two processes with 4 fake CPU devices each
  run one engine over a model:8 mesh spanning both (collectives over gloo)
  and agree, token for token, with each other and with one device."""
  coordinator = f"127.0.0.1:{_free_port()}"
  procs = [subprocess.Popen(
      [sys.executable, "-m", "tests.serving.multiprocess_replay", coordinator, "2",
       str(i), "model:8"], cwd=ROOT, env=_env(4), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    reference = multiprocess_replay.replay_tokens("")      # one device, this process
    results = [p.communicate(timeout=240) for p in procs]
  finally:
    for p in procs:
      p.kill()
  reports = []
  for p, (stdout, stderr) in zip(procs, results):
    assert p.returncode == 0, stderr[-3000:]
    reports.append(json.loads(stdout.strip().splitlines()[-1]))
  assert [(r["process"], r["devices"], r["local_devices"]) for r in reports] == [
      (0, 8, 4), (1, 8, 4)]
  assert reports[0]["tokens"] == reports[1]["tokens"] == reference
  assert len(reference) == 6 and all(len(t) >= 1 for t in reference.values())
