"""Tensor parallelism (models.sharding) and multi-process JAX.

The mesh tests need several devices, which on CPU exist only when XLA_FLAGS
asks for fake host devices before jax starts, so they run in subprocesses
(this pytest process has one device).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P

from models import llama, sharding
from models.config import get_config
from serving.config import EngineConfig
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
  layer_col, layer_row = P(None, None, "model"), P(None, "model", None)
  assert [specs["layers"]["attn"][w] for w in ("wq", "wk", "wv", "wo")] == [
      layer_col, layer_col, layer_col, layer_row]
  assert [specs["layers"]["mlp"][w] for w in ("w_gate", "w_up", "w_down")] == [
      layer_col, layer_col, layer_row]
  assert specs["embed"]["embedding"] == P("model", None)
  assert specs["layers"]["attn_norm"]["scale"] == specs["final_norm"]["scale"] == P()
  assert sharding.kv_spec(TP_CFG, 2) == P(None, None, None, "model", None)
  # Model axis 4 does not divide the 2 KV heads: attention and cache replicated.
  specs4 = sharding.param_specs(params, TP_CFG, 4)
  assert specs4["layers"]["attn"]["wq"] == P() and sharding.kv_spec(TP_CFG, 4) == P()
  assert specs4["layers"]["mlp"]["w_down"] == layer_row
  with pytest.raises(ValueError, match="extra/w has no sharding rule"):
    sharding.param_specs({"extra": {"w": jax.ShapeDtypeStruct((2, 2), "f4")}}, TP_CFG, 2)


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
