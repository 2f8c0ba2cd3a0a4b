"""Tensor-parallel equality table: logits and greedy tokens per mesh vs one device.

  python scripts/tp_equality.py                         # tiny random model, tp 1..4
  python scripts/tp_equality.py --model=smollm2-135m --engine=cpu_small --tps=1,2,3
  python scripts/tp_equality.py --model=path/to/hf_dir --tps=2,4 --devices=4

Runs the same prompts through an ``Engine`` on one device and on meshes
``model:M`` for each ``--tps`` entry (``serving.harness.tp_check``), built as the
launchers build theirs (``--model`` loaded straight into each mesh's
shardings, ``launch.warmup`` before generating; ``--nowarmup`` skips it), and
prints the table of docs/scale-out.md; ``--out`` writes the rows as JSON. On CPU the
devices are XLA's fake host devices: unless XLA_FLAGS already says otherwise,
this script asks for ``--devices`` of them before jax starts. Exits 1 when
tokens differ or a compile bound is exceeded.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fake_devices(argv) -> None:
  """XLA_FLAGS must name the host device count before jax initialises."""
  count = next((a.split("=", 1)[1] for a in argv if a.startswith("--devices=")), "8")
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={count}").strip()


_fake_devices(sys.argv)

from absl import flags  # pylint: disable=wrong-import-position
import dataclasses  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from models import llama  # pylint: disable=wrong-import-position
from models.config import get_config  # pylint: disable=wrong-import-position
from serving import cli
from serving.cli import launch
from serving.harness import tp_check  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_integer("devices", 8, "Fake CPU devices (set before jax starts).")
flags.DEFINE_list("tps", ["1", "2", "3", "4"], "Model-axis sizes to compare.")
flags.DEFINE_list("prompt_lens", ["5", "17", "9", "30"], "Prompt lengths (random ids; "
                  "the text prompts of --prompt for a real model).")
flags.DEFINE_multi_string("prompt", [], "Text prompts (real models; replaces --prompt_lens).")
flags.DEFINE_integer("max_tokens", 8, "Greedy tokens per prompt.")
flags.DEFINE_integer("ffn_dim", 192, "tiny-random: MLP width (192 and vocabulary 768 "
                     "divide by 2, 3 and 4, so every size splits the MLP and vocabulary).")
flags.DEFINE_integer("vocab_size", 768, "tiny-random: vocabulary size.")
flags.DEFINE_string("out", None, "Write the rows as JSON here.")
flags.DEFINE_boolean("warmup", True, "Run launch.warmup on every engine before its "
                     "prompts (the launchers' path: scratch engines from its stored params).")
launch.define_engine_flags()
FLAGS.set_default("model", "tiny-random")
FLAGS.set_default("engine", "tiny")


def _model():
  """(cfg, params, prompts, load): the tiny random model (layer_scale 8,
  seed 1) with random prompt ids and no loader, or --model loaded with its
  tokenizer and ``load(mesh)``, which loads it again straight into the
  shardings of ``mesh`` (as the launchers do)."""
  if FLAGS.model == "tiny-random":
    cfg = dataclasses.replace(get_config("tiny"), ffn_dim=FLAGS.ffn_dim,
                              vocab_size=FLAGS.vocab_size)
    params = llama.init_params(cfg, jax.random.PRNGKey(1), layer_scale=8)
    rng = np.random.default_rng(0)
    return cfg, params, [rng.integers(3, cfg.vocab_size, size=int(n)).tolist()
                         for n in FLAGS.prompt_lens], None
  cfg, params, tokenizer = launch.load_flags_model(launch.engine_config(mesh=""))
  texts = FLAGS.prompt or ["The capital of France is", "def fibonacci(n):",
                           "Continuous batching schedules LLM inference"]
  load = lambda mesh: params if not mesh else launch.load_flags_model(
      launch.engine_config(mesh=mesh))[1]
  return cfg, params, [tokenizer.encode(t) for t in texts], load


def main(argv):
  del argv
  cfg, params, prompts, load = _model()
  rows = tp_check.tp_equality(cfg, params, launch.engine_config(mesh=""), prompts,
                              FLAGS.max_tokens, [int(t) for t in FLAGS.tps], load=load,
                              warmup=launch.warmup if FLAGS.warmup else None)
  print(f"model {cfg.name}: {cfg.n_heads} query / {cfg.n_kv_heads} KV heads, ffn "
        f"{cfg.ffn_dim}, vocab {cfg.vocab_size}; {len(prompts)} prompts x "
        f"{FLAGS.max_tokens} greedy tokens; smallest one-device top-2 logit gap of an "
        f"emitted token {rows[0]['min_margin']:.3g}")
  print(tp_check.markdown_table(rows))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(rows, f, indent=1)
  if not all(r["tokens_equal"] and r["compile_bound_ok"] for r in rows):
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
