"""Tensor-parallel equality: logits and greedy tokens per mesh against one device.

For each model-axis size M, ``tp_equality`` builds an ``Engine`` with
``mesh="model:M"`` the way the launchers do (``serving.cli.launch``: the
parameters loaded straight into their shardings when a loader is given, the
engine's per-layer weights, then ``launch.warmup``'s scratch engines built
from the engine's stored parameters) and

* runs the test prompts through ``Engine.generate`` (greedy), comparing every
  output token with the one-device engine's;
* runs one packed prefill of the prompts followed by their greedy outputs
  (teacher forcing) through ``llama.forward`` / ``compute_logits`` with the
  engine's placed weights and cache, and reports the largest
  ``|logit - logit_one_device|`` over every row and vocabulary entry;
* counts the programs its jitted functions compiled (``_cache_size``, which
  also counts a recompile for a new input sharding) against the engine's
  bound (``len(token_buckets)`` for the model step, 1 for the others).

Greedy tokens can differ only where the one-device top-2 logit gap of an
emitted position is below twice the largest logit difference; ``min_margin``
reports the smallest such gap over the outputs, so a row with
``min_margin > 2 * max_abs_logit_diff`` cannot flip.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from models import llama, sharding
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine

# Per-program bound on compiled programs for one engine (one slot-table size).
_SINGLE = ("arrive", "release", "plan", "sync_cached")
# Compiled once per token bucket: the step program.
_PER_BUCKET = ("step",)


def _teacher_forced_logits(engine: Engine, sequences: Sequence[Sequence[int]]) -> np.ndarray:
  """f32[T, vocab] logits of every row of the sequences packed in one prefill
  (pages ``1..`` of the engine's cache in order, page 0 untouched)."""
  cfg, page_size = engine.model_cfg, engine.config.page_size
  tokens, positions, slots, kv_lens, tables, cu = [], [], [], [], [], [0]
  pages_per_seq = max(-(-len(s) // page_size) for s in sequences)
  next_page = 1
  for seq in sequences:
    n = len(seq)
    pages = list(range(next_page, next_page + -(-n // page_size)))
    next_page += len(pages)
    tokens += list(seq)
    positions += list(range(n))
    slots += [pages[i // page_size] * page_size + i % page_size for i in range(n)]
    kv_lens.append(n)
    tables.append(pages + [0] * (pages_per_seq - len(pages)))
    cu.append(cu[-1] + n)
  if next_page > engine.config.num_pages:
    raise ValueError(f"the check needs {next_page} KV pages, the engine has "
                     f"{engine.config.num_pages}")
  i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))
  kv = sharding.Placement(cfg, engine.mesh).kv(
      llama.init_kv_cache(cfg, engine.config.num_pages, page_size, engine.kv.k.dtype))
  hidden, _ = llama.forward_jit(
      engine.params, cfg, kv, i32(tokens), i32(positions), i32(slots), i32(kv_lens),
      i32(tables), i32(cu), jnp.int32(len(sequences)),
      attention_impl=engine.config.attention_impl,
      mesh=sharding.attention_mesh(cfg, engine.mesh), decode_gemm=engine.decode_gemm)
  return np.asarray(llama.compute_logits_jit(engine.params, cfg, hidden,
                                             decode_gemm=engine.decode_gemm))


def _compiled(engine: Engine) -> Dict[str, int]:
  p = engine._programs
  return {name: getattr(p, name)._cache_size() for name in _PER_BUCKET + _SINGLE}


def tp_equality(model_cfg, params, engine_cfg: EngineConfig,
                prompts: Sequence[Sequence[int]], max_tokens: int,
                model_sizes: Sequence[int], *,
                load: Optional[Callable[[str], Any]] = None,
                warmup: Optional[Callable[[Engine], Any]] = None) -> List[dict]:
  """One row per model-axis size (the first row is one device, no mesh).

  Args:
    model_cfg, params: the model (``params`` unused when ``load`` is given).
    engine_cfg: the engine config; its ``mesh`` is replaced per row.
    prompts: token ids of each prompt.
    max_tokens: greedy tokens per prompt.
    model_sizes: model-axis sizes after the one-device row.
    load: ``mesh spec -> params`` placed on that mesh (the launchers'
      ``load_model(..., mesh=...)``); None: ``params`` for every row.
    warmup: called with each engine before it generates (the launchers'
      ``launch.warmup``, which builds scratch engines from the engine's
      stored, per-layer, placed parameters).

  Returns rows of ``{"mesh", "split", "max_abs_logit_diff", "min_margin",
  "tokens_equal", "compiled", "compile_bound_ok", "seconds"}``.

  Raises:
    ValueError: a size needs more devices than this process has, or a
      parameter without a sharding rule (``models.sharding.param_specs``).
  """
  sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  rows, reference = [], None
  for size in [None] + list(model_sizes):
    t = time.perf_counter()
    mesh = "" if size is None else f"model:{size}"
    engine = Engine(model_cfg, params if load is None else load(mesh),
                    dataclasses.replace(engine_cfg, mesh=mesh))
    if warmup is not None:
      warmup(engine)
    outputs = [r.output_token_ids for r in engine.generate(prompts, sampling)]
    compiled = _compiled(engine)
    if reference is None:
      sequences = [list(p) + o[:-1] for p, o in zip(prompts, outputs)]
      logits = _teacher_forced_logits(engine, sequences)
      reference = dict(outputs=outputs, logits=logits,
                       min_margin=_min_margin(logits, prompts, outputs))
    else:
      logits = _teacher_forced_logits(engine, sequences)
    rows.append(dict(
        mesh=mesh or "one device",
        split=sharding.split_groups(model_cfg, size or 1) if size else {},
        max_abs_logit_diff=float(np.max(np.abs(logits - reference["logits"]))),
        min_margin=reference["min_margin"],
        tokens_equal=outputs == reference["outputs"],
        compiled=compiled,
        compile_bound_ok=(
            all(compiled[n] <= len(engine_cfg.token_buckets) for n in _PER_BUCKET)
            and all(compiled[n] <= 1 for n in _SINGLE)),
        seconds=round(time.perf_counter() - t, 1)))
  return rows


def _min_margin(logits: np.ndarray, prompts, outputs) -> float:
  """Smallest top-1 minus top-2 logit over the rows that emitted an output
  token (the last prompt row and every fed-back output but the last)."""
  margins, start = [], 0
  for prompt, out in zip(prompts, outputs):
    n = len(prompt) + len(out) - 1
    rows = logits[start + len(prompt) - 1:start + n]
    top2 = np.sort(rows, axis=-1)[:, -2:]
    margins.append(float(np.min(top2[:, 1] - top2[:, 0])))
    start += n
  return min(margins)


def markdown_table(rows: Sequence[dict]) -> str:
  """The rows as the table of docs/scale-out.md."""
  lines = ["| mesh | split over `model` | max abs logit diff | greedy tokens equal | "
           "step programs compiled (one per bucket, both paths / bound) | s |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    split = ", ".join(g for g, on in r["split"].items() if on) or "-"
    bound = "ok" if r["compile_bound_ok"] else "EXCEEDED"
    lines.append(f"| {r['mesh']} | {split} | {r['max_abs_logit_diff']:.2e} | "
                 f"{r['tokens_equal']} | {r['compiled']['step']} "
                 f"({bound}) | "
                 f"{r['seconds']} |")
  return "\n".join(lines)
