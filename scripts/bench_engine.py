"""Engine throughput beside HF transformers `generate` on the same weights.

  python scripts/bench_engine.py --out=runs/bench_engine.json

Sections (float32, CPU, greedy, ignore EOS):
* prefill: tokens/s for one 512-token prompt (one output token).
* decode: output tokens/s with N concurrent requests (256-token prompts, 128
  output tokens), end to end and decode-only (minus the one-token run).
* trace: 64 requests with Azure-conv prompt/output lengths (capped at
  1024/512), all arriving at t=0; transformers runs static left-padded batches
  of 32 that wait for their longest member, iterserve runs continuous
  batching with at most 32 running. Useful output tokens/s.
* gemm: the machine's float32 GEMM FLOP/s and the fraction a decode step
  achieves (model FLOPs per token x decode tokens/s / GEMM FLOP/s).
"""

import json
import os
import sys
import time
from pathlib import Path

# torch's OpenMP threads spin after each op by default, taking cores from
# XLA's threads in the same process; make them sleep instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from models.loaders import load_model, resolve_model_path
from serving import workloads
from serving.config import EngineConfig, SamplingParams
from serving.engine import Engine
from serving.launch import warmup

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "runs/bench_engine.json", "Result JSON path.")
flags.DEFINE_list("sections", ["prefill", "decode", "trace", "gemm"], "What to measure.")
flags.DEFINE_list("concurrency", ["1", "8", "32", "64"], "Decode concurrency levels.")
flags.DEFINE_integer("prompt_len", 256, "Decode section prompt length.")
flags.DEFINE_integer("output_len", 128, "Decode section output length.")
flags.DEFINE_integer("trace_requests", 64, "Trace section request count.")
flags.DEFINE_string("trace", str(Path(__file__).resolve().parents[2] / "shared/data/traces/"
                                 "azure2023/AzureLLMInferenceTrace_conv.csv"),
                    "Azure conv CSV for the trace section (synthetic lengths if absent).")
flags.DEFINE_bool("hf", True, "Also run HF transformers (needs the reference extra).")
flags.DEFINE_string("engine", "cpu_default", "Engine preset.")


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(20, 40000, size=n).tolist() for n in lengths]


def _engine(cfg, params, **overrides):
  engine = Engine(cfg, params, EngineConfig.preset(FLAGS.engine, **overrides))
  return engine


def iterserve_run(cfg, params, prompts, outputs, **overrides):
  """Seconds to finish all requests (all arriving at t=0); outputs checked."""
  engine = _engine(cfg, params, **overrides)
  t = time.perf_counter()
  for i, (p, n) in enumerate(zip(prompts, outputs)):
    engine.add_request(f"b{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
  engine.run()
  seconds = time.perf_counter() - t
  got = [len(r.output_token_ids) for r in engine.requests.values()]
  assert got == list(outputs), "every request must produce its output length"
  return seconds, engine


def hf_run(model, torch, prompts, new_tokens):
  """Seconds for one static left-padded batch generating ``new_tokens``."""
  width = max(len(p) for p in prompts)
  ids = torch.zeros((len(prompts), width), dtype=torch.long)
  mask = torch.zeros_like(ids)
  for i, p in enumerate(prompts):
    ids[i, width - len(p):] = torch.tensor(p)
    mask[i, width - len(p):] = 1
  t = time.perf_counter()
  with torch.inference_mode():
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
  return time.perf_counter() - t


def load_hf():
  import torch
  import transformers
  path, _ = resolve_model_path("smollm2-135m")
  model = transformers.LlamaForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
  return model, torch


def gemm_flops_per_s():
  a = jnp.ones((1024, 2048), jnp.float32)
  b = jnp.ones((2048, 2048), jnp.float32)
  f = jax.jit(lambda a, b: a @ b)
  f(a, b).block_until_ready()
  t, n = time.perf_counter(), 20
  for _ in range(n):
    f(a, b).block_until_ready()
  return n * 2 * 1024 * 2048 * 2048 / (time.perf_counter() - t)


def flops_per_token(cfg):
  """2 x multiply-adds of the projections, MLP and LM head for one row."""
  attn = cfg.d_model * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
  attn += cfg.n_heads * cfg.head_dim * cfg.d_model
  mlp = 3 * cfg.d_model * cfg.ffn_dim
  return 2 * (cfg.n_layers * (attn + mlp) + cfg.d_model * cfg.vocab_size)


def main(argv):
  del argv
  cfg, params, _ = load_model("smollm2-135m", cache_dir=".cache/iterserve/weights")
  hf = load_hf() if FLAGS.hf else None
  scratch = _engine(cfg, params)
  warmup(scratch)
  out = {"jax_version": jax.__version__, "device": str(jax.devices()[0]),
         "engine_preset": FLAGS.engine, "dtype": "float32",
         "token_buckets": list(scratch.config.token_buckets)}

  if "prefill" in FLAGS.sections:
    prompt = _prompts([512])
    s, _ = iterserve_run(cfg, params, prompt, [1])
    row = {"prompt_tokens": 512, "iterserve_tokens_per_s": 512 / s}
    if hf:
      hf_run(*hf, prompt, 1)
      row["hf_tokens_per_s"] = 512 / hf_run(*hf, prompt, 1)
    out["prefill"] = row
    print("prefill", row)

  if "decode" in FLAGS.sections:
    out["decode"] = []
    for n in map(int, FLAGS.concurrency):
      prompts = _prompts([FLAGS.prompt_len] * n, seed=n)
      total = n * FLAGS.output_len
      s, engine = iterserve_run(cfg, params, prompts, [FLAGS.output_len] * n,
                                max_num_seqs=max(32, n), max_request_slots=max(128, n),
                                sample_rows=max(64, n))
      s1, _ = iterserve_run(cfg, params, prompts, [1] * n, max_num_seqs=max(32, n),
                            max_request_slots=max(128, n), sample_rows=max(64, n))
      row = {"concurrency": n, "iterserve_output_tokens_per_s": total / s,
             "iterserve_decode_tokens_per_s": (total - n) / max(s - s1, 1e-9),
             "iterserve_iterations": engine.num_iterations}
      if hf:
        h = hf_run(*hf, prompts, FLAGS.output_len)
        h1 = hf_run(*hf, prompts, 1)
        row.update(hf_output_tokens_per_s=total / h,
                   hf_decode_tokens_per_s=(total - n) / max(h - h1, 1e-9))
        row["speedup"] = row["iterserve_output_tokens_per_s"] / row["hf_output_tokens_per_s"]
      out["decode"].append(row)
      print("decode", row)

  if "trace" in FLAGS.sections:
    n = FLAGS.trace_requests
    if Path(FLAGS.trace).exists():
      wl = workloads.load_azure_trace(FLAGS.trace, max_requests=n, max_prompt_len=1024,
                                      max_output_len=512, vocab_size=cfg.vocab_size)
      source = FLAGS.trace
    else:
      wl = workloads.synthetic_azure_conv(n, 1.0, max_prompt_len=1024, max_output_len=512,
                                          vocab_size=cfg.vocab_size)
      source = "synthetic_azure_conv"
    prompts = [list(s.prompt_token_ids) for s in wl]
    outputs = [s.max_tokens for s in wl]
    useful = sum(outputs)
    s, engine = iterserve_run(cfg, params, prompts, outputs)
    row = {"source": source, "requests": n, "prompt_tokens": sum(map(len, prompts)),
           "output_tokens": useful, "iterserve_seconds": s,
           "iterserve_output_tokens_per_s": useful / s,
           "iterserve_preemptions": engine.num_preemptions}
    if hf:
      h = sum(hf_run(*hf, prompts[i:i + 32], max(outputs[i:i + 32]))
              for i in range(0, n, 32))
      row.update(hf_seconds=h, hf_output_tokens_per_s=useful / h,
                 speedup=(useful / s) / (useful / h))
    out["trace"] = row
    print("trace", row)

  if "gemm" in FLAGS.sections:
    peak = gemm_flops_per_s()
    row = {"gemm_gflops": peak / 1e9, "flops_per_token": flops_per_token(cfg)}
    decode32 = [r for r in out.get("decode", []) if r["concurrency"] == 32]
    if decode32:
      rate = decode32[0]["iterserve_decode_tokens_per_s"]
      row["decode32_fraction_of_gemm"] = flops_per_token(cfg) * rate / peak
    out["gemm"] = row
    print("gemm", row)

  Path(FLAGS.out).parent.mkdir(parents=True, exist_ok=True)
  Path(FLAGS.out).write_text(json.dumps(out, indent=2))
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
