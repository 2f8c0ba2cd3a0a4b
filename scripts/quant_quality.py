"""What int8 weights (``EngineConfig.weights="int8"``) cost in model quality.

  python scripts/quant_quality.py --out=runs/quant_quality.json

Teacher-forced over human-written text: each MT-Bench question (its two user
turns joined by a blank line; ``--prompts``, JSON lines with ``turns``, or
the built-in sentences when the file is absent) runs through SmolLM2 once
with float32 weights and once with the same weights quantized
(``models.quant.quantize_params``), every row a prompt row. Per text and in
all, over every next-token position: the perplexity of each model
(exp of the mean negative log-likelihood of the actual next token, nats),
the fraction of positions whose argmax agrees, and the mean KL divergence
KL(float32 || int8) of the next-token distributions (nats). Writes JSON and
prints the totals.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from models import llama, quant
from models.loaders import load_model
from serving import cli
from serving.cli import launch

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset name, *.gguf file or HF directory.")
flags.DEFINE_string("prompts", str(Path(__file__).resolve().parents[2] / "shared/data/prompts/"
                                   "mt_bench_questions.jsonl"),
                    "JSON lines with a 'turns' list of strings (MT-Bench's format).")
flags.DEFINE_integer("max_texts", 80, "Texts to score (the first N).", lower_bound=1)
flags.DEFINE_integer("max_len", 256, "Tokens per text (longer texts are clipped).",
                     lower_bound=2)
flags.DEFINE_string("out", "runs/quant_quality.json", "Result JSON path.")
flags.DEFINE_string("cache_dir", ".cache/iterserve", "Converted-weight cache (orbax).")

_FALLBACK = ["The capital of France is Paris, a city known for its museums and cafes.",
             "Continuous batching lets a server add and remove requests between steps.",
             "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"]


def texts():
  """The texts to score and their source.

  Raises:
    ValueError: a --prompts path given on the command line that does not
      exist, or a line that is not a JSON object with a list of strings
      under "turns" (naming the file and line).
  """
  path = Path(FLAGS.prompts)
  if not path.exists():
    if FLAGS["prompts"].present:
      raise ValueError(f"--prompts {path} does not exist")
    print(f"{path} not found: scoring the {len(_FALLBACK)} built-in sentences")
    return _FALLBACK, "built-in"
  docs = []
  for n, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      turns = json.loads(line)["turns"]
    except (ValueError, TypeError, KeyError) as e:
      raise ValueError(f"--prompts {path} line {n}: must be a JSON object with a "
                       f"'turns' list of strings ({type(e).__name__}: {e})") from None
    if not (isinstance(turns, list) and all(isinstance(t, str) for t in turns)):
      raise ValueError(f"--prompts {path} line {n}: 'turns' must be a list of strings")
    docs.append("\n\n".join(turns))
  return docs[:FLAGS.max_texts], str(path)


def next_token_log_probs(params, cfg, ids, rows, page_size=16):
  """f32[len(ids) - 1, vocab] log-probabilities of each next token, one
  prefill of ``ids`` padded to ``rows`` packed rows."""
  n = len(ids)
  pages = -(-rows // page_size)
  kv = llama.init_kv_cache(cfg, pages, page_size)
  tokens = np.zeros(rows, np.int32)
  tokens[:n] = ids
  positions = np.arange(rows, dtype=np.int32)
  slots = np.where(positions < n, positions, -1).astype(np.int32)
  hidden, _ = llama.forward_jit(
      params, cfg, kv, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(slots),
      jnp.asarray([n], jnp.int32), jnp.arange(pages, dtype=jnp.int32)[None],
      jnp.asarray([0, n], jnp.int32), jnp.int32(1), attention_impl="auto",
      prompt_rows=jnp.asarray(positions < n))
  logits = llama.compute_logits_jit(params, cfg, hidden, jnp.int32(n - 1))
  return np.asarray(jax.nn.log_softmax(logits[:n - 1].astype(jnp.float32), axis=-1))


def main(argv):
  del argv
  launch.check_model_spec("--model", FLAGS.model)
  docs, source = texts()
  cfg, params, tokenizer = load_model(FLAGS.model, dtype=jnp.float32,
                                      cache_dir=f"{FLAGS.cache_dir}/weights")
  qparams = quant.quantize_params(params, cfg.tie_embeddings)
  rows = -(-FLAGS.max_len // 64) * 64
  per_text, nll, agree, kl = [], {"float32": [], "int8": []}, [], []
  t = time.perf_counter()
  for text in docs:
    ids = tokenizer.encode(text)[:FLAGS.max_len]
    if len(ids) < 2:
      continue
    target = np.asarray(ids[1:])
    lp = {"float32": next_token_log_probs(params, cfg, ids, rows),
          "int8": next_token_log_probs(qparams, cfg, ids, rows)}
    for k in lp:
      nll[k].append(-lp[k][np.arange(len(target)), target])
    agree.append(lp["float32"].argmax(-1) == lp["int8"].argmax(-1))
    kl.append(np.sum(np.exp(lp["float32"]) * (lp["float32"] - lp["int8"]), axis=-1))
    per_text.append({"tokens": len(ids),
                     "ppl_float32": float(np.exp(nll["float32"][-1].mean())),
                     "ppl_int8": float(np.exp(nll["int8"][-1].mean())),
                     "top1_agreement": float(agree[-1].mean()),
                     "mean_kl": float(kl[-1].mean())})
  cat = np.concatenate
  total = {"texts": len(per_text), "positions": int(sum(len(a) for a in agree)),
           "ppl_float32": float(np.exp(cat(nll["float32"]).mean())),
           "ppl_int8": float(np.exp(cat(nll["int8"]).mean())),
           "top1_agreement": float(cat(agree).mean()),
           "mean_kl": float(cat(kl).mean()),
           "seconds": round(time.perf_counter() - t, 1)}
  out = {"model": FLAGS.model, "source": source, "max_len": FLAGS.max_len,
         "jax_version": jax.__version__, "total": total, "per_text": per_text}
  Path(FLAGS.out).parent.mkdir(parents=True, exist_ok=True)
  Path(FLAGS.out).write_text(json.dumps(out, indent=1))
  print(json.dumps(total, indent=1))
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  cli.run(main)
