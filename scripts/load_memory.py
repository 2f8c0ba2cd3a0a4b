"""Peak host memory of loading an HF checkpoint; JSON.

  python scripts/load_memory.py --layers=2 --out=/tmp/load_memory.json

Writes a random bfloat16 checkpoint of Llama-3.1-8B's width (hidden 4096,
intermediate 14336, 32 heads, 8 KV heads, vocab 128256, untied head) with
``--layers`` layers (safetensors written from numpy, no torch), then loads it
with ``load_model(dtype=bfloat16)`` in a fresh subprocess and reports that
process's peak RSS (``ru_maxrss``) before and after the load against the
checkpoint's size. A load that kept a float32 copy of the bf16 weights would
peak near 3x the checkpoint on top of the baseline.
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from serving import cli

FLAGS = flags.FLAGS
flags.DEFINE_integer("layers", 2, "Decoder layers of the random checkpoint.")
flags.DEFINE_string("dir", None, "Where to write the checkpoint (default: a temp dir, "
                                 "removed afterwards).")
flags.DEFINE_string("out", None, "JSON path (the JSON is printed either way).")
flags.DEFINE_string("_load", None, "Internal: load this directory and print peak RSS.")
flags.DEFINE_string("_write", None, "Internal: write the checkpoint here, print its bytes.")

WIDTH = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
             num_attention_heads=32, num_key_value_heads=8)


def write_checkpoint(directory: str, layers: int) -> int:
  """Random bf16 Llama-3.1-8B-width checkpoint, one safetensors file per
  layer plus one for the embeddings (sharded via the index); returns bytes."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer, models  # pylint: disable=import-outside-toplevel
  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(0)
  d, f, v = WIDTH["hidden_size"], WIDTH["intermediate_size"], WIDTH["vocab_size"]
  hd = d // WIDTH["num_attention_heads"]
  kv = WIDTH["num_key_value_heads"] * hd

  def rand(*shape):
    return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

  weight_map, total = {}, 0
  shards = [("model-embed.safetensors", lambda: {
      "model.embed_tokens.weight": rand(v, d), "lm_head.weight": rand(v, d),
      "model.norm.weight": np.ones(d, ml_dtypes.bfloat16)})]
  for i in range(layers):
    p = f"model.layers.{i}."
    shards.append((f"model-layer{i}.safetensors", lambda p=p: {
        p + "input_layernorm.weight": np.ones(d, ml_dtypes.bfloat16),
        p + "post_attention_layernorm.weight": np.ones(d, ml_dtypes.bfloat16),
        p + "self_attn.q_proj.weight": rand(d, d), p + "self_attn.k_proj.weight": rand(kv, d),
        p + "self_attn.v_proj.weight": rand(kv, d), p + "self_attn.o_proj.weight": rand(d, d),
        p + "mlp.gate_proj.weight": rand(f, d), p + "mlp.up_proj.weight": rand(f, d),
        p + "mlp.down_proj.weight": rand(d, f)}))
  for file, make in shards:
    tensors = make()
    save_file(tensors, os.path.join(directory, file))
    total += sum(t.nbytes for t in tensors.values())
    weight_map.update({name: file for name in tensors})
    del tensors
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_hidden_layers": layers, "head_dim": hd, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072, "tie_word_embeddings": False,
            "rope_theta": 500000.0, "eos_token_id": [128001, 128009],
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            "torch_dtype": "bfloat16", **WIDTH}
  with open(os.path.join(directory, "config.json"), "w") as fh:
    json.dump(config, fh)
  vocab = {f"t{i}": i for i in range(v)}
  Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(
      os.path.join(directory, "tokenizer.json"))
  return total


def load_and_measure(directory: str) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from models.loaders import load_model  # pylint: disable=import-outside-toplevel
  jax.devices()
  # ru_maxrss survives exec, so this process was started by one that stayed
  # small (the checkpoint is written by a sibling subprocess).
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  t = time.perf_counter()
  _, params, _ = load_model(directory, dtype=jnp.bfloat16)
  jax.block_until_ready(params)
  seconds = time.perf_counter() - t
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
  return {"peak_rss_before_load_bytes": before, "peak_rss_bytes": peak,
          "params_bytes": nbytes, "load_s": round(seconds, 2)}


def main(argv):
  del argv
  # pylint: disable=protected-access
  if FLAGS._load:
    print(json.dumps(load_and_measure(FLAGS._load)))
    return
  if FLAGS._write:
    print(json.dumps(write_checkpoint(FLAGS._write, FLAGS.layers)))
    return
  directory = FLAGS.dir or tempfile.mkdtemp(prefix="load_memory-")

  def child(*args):
    run = subprocess.run([sys.executable, os.path.abspath(__file__), *args],
                         capture_output=True, text=True, check=False)
    if run.returncode:
      sys.exit(f"subprocess {args} failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])

  try:
    size = child(f"--_write={directory}", f"--layers={FLAGS.layers}")
    measured = child(f"--_load={directory}")
  finally:
    if not FLAGS.dir:
      import shutil  # pylint: disable=import-outside-toplevel
      shutil.rmtree(directory, ignore_errors=True)
  gib = 2 ** 30
  growth = measured["peak_rss_bytes"] - measured["peak_rss_before_load_bytes"]
  report = {
      "checkpoint": f"random Llama-3.1-8B width, {FLAGS.layers} layers, bfloat16",
      "checkpoint_gib": round(size / gib, 3),
      "params_gib": round(measured["params_bytes"] / gib, 3),
      "peak_rss_gib": round(measured["peak_rss_bytes"] / gib, 3),
      "rss_before_load_gib": round(measured["peak_rss_before_load_bytes"] / gib, 3),
      "load_growth_gib": round(growth / gib, 3),
      "load_growth_over_checkpoint": round(growth / size, 3),
      "load_s": measured["load_s"],
  }
  text = json.dumps(report, indent=2)
  print(text)
  if FLAGS.out:
    with open(FLAGS.out, "w") as fh:
      fh.write(text + "\n")


if __name__ == "__main__":
  cli.run(main)
