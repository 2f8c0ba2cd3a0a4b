"""Every supported family against HF transformers on the same random checkpoint.

transformers writes each family's checkpoint (``families.py``: tiny widths,
the family's real switches, random weights, a BPE tokenizer trained on the
repository's text); our loader (``models.loaders.load_model``) reads the
directory and our forward runs it. Per family:

* the tokenizer, BOS, EOS ids and chat template agree with transformers';
* float32: full-sequence logits of every prompt followed by transformers'
  greedy continuation (teacher forcing) within ``F32_ATOL`` of
  transformers' forward;
* the engine (several requests in one batch, chunked prefill with a token
  budget of 16 and a chunk cap of 8, prefix caching on) emits transformers'
  ``generate(do_sample=False)`` tokens; a request's tokens are the same
  alone, in the mixed batch (other chunk boundaries) and after a prefix
  hit;
* bfloat16 (the checkpoint saved in bfloat16): transformers' bfloat16
  greedy continuation teacher-forced through our bfloat16 forward, our
  argmax is its token at every step where its top-2 gap exceeds
  ``BF16_NOISE``; the logit error is measured and bounded (a mixture's rows
  moved by a bfloat16 router tie counted apart);
* a float16 checkpoint widens exactly; and, slow, each switch turned off in
  our config moves the logits far beyond ``F32_ATOL`` (the checkpoints
  exercise every switch).

``pytest -s`` prints the measured errors; with ``ITERSERVE_FAMILY_REPORT``
set to a path, they are written there as JSON (the docs table,
docs/model-families.md).
"""

import dataclasses
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from models import llama
from models.config import RopeConfig
from models.loaders import load_model
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine

torch = pytest.importorskip("torch", reason="reference extra: pip install torch==2.13.0")
transformers = pytest.importorskip("transformers",
                                   reason="reference extra: pip install transformers")
import families as F  # pylint: disable=wrong-import-position  (needs torch)

pytestmark = [pytest.mark.reference]

NUM_NEW = 8
F32_ATOL = 1e-4
# Where transformers' bfloat16 top-2 gap is below this, the argmax is a
# coin toss between two bfloat16 computations (a logit of magnitude 4-8 has
# an ulp of 1/32, and the error accumulates over the blocks).
BF16_NOISE = 0.2
# bfloat16 logits within BF16_ATOL of transformers' bfloat16 ones (measured:
# at most 0.13 on dense models, whose rows are 0.1-0.35 from float32 on
# either side); a mixture's rows further than BF16_FROM_F32 from float32 on
# either side (a router tie, or a later row attending to its token) are left
# out, at most MAX_FLIPPED_ROWS of them (measured: 2-17 of 157-162 rows; a
# mixture wrong in bfloat16 would move nearly every row).
BF16_ATOL = 0.5
BF16_FROM_F32 = 0.35
MAX_FLIPPED_ROWS = 0.25
TEXTS = [
    "The scheduler admits a request when its pages fit under the watermark.",
    "Prefix caching keys full prompt pages by content",
    "def greedy(params, cfg, prompts):\n    return",
]
SHARED_TAIL = " Then it decodes."
# Tiny engine: 4 sequences, a 16-token budget, prompt chunks of at most 8
# (every prompt here is prefilled in several chunks), 4-row pages.
ENGINE = EngineConfig.preset("tiny", num_pages=128, max_model_len=96)
REPORT_ENV = "ITERSERVE_FAMILY_REPORT"
# The engine checks compile one engine per family (the suite's largest
# cost): these families' run in the fast set, the others' are marked slow;
# so are the bfloat16 checks of the variants that only change numbers.
FAST_ENGINE_FAMILIES = ("gemma2", "qwen3-moe")
# bfloat16 greedy in the default profile: a dense family with Llama 3.1's RoPE,
# one with windows and soft-capping, one mixture of experts; the rest extended.
FAST_BF16_FAMILIES = ("llama3.1", "gemma2", "qwen3-moe")


def full_logits(params, cfg, seqs, rows=256, page_size=16):
  """f32[len(s), vocab] logits of every position of each sequence in
  ``seqs``, all prefilled in one packed iteration of ``llama.forward``."""
  lengths = [len(s) for s in seqs]
  assert sum(lengths) <= rows
  pages = [-(-n // page_size) for n in lengths]
  table = np.zeros((len(seqs), max(pages)), np.int32)
  tokens, positions, slots, cu, first = [], [], [], [0], 1
  for i, seq in enumerate(seqs):
    table[i, :pages[i]] = np.arange(first, first + pages[i])
    first += pages[i]
    pos = np.arange(len(seq))
    tokens += list(seq)
    positions += pos.tolist()
    slots += (table[i, pos // page_size] * page_size + pos % page_size).tolist()
    cu.append(cu[-1] + len(seq))
  pad = rows - len(tokens)
  i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))
  kv = llama.init_kv_cache(cfg, first, page_size, jnp.dtype(params["embed"]["embedding"].dtype))
  hidden, _ = llama.forward_jit(
      params, cfg, kv, i32(tokens + [0] * pad), i32(positions + [0] * pad),
      i32(slots + [-1] * pad), i32(lengths), i32(table), i32(cu), jnp.int32(len(seqs)),
      attention_impl="auto", prompt_rows=jnp.arange(rows) < cu[-1])
  logits = np.asarray(llama.compute_logits_jit(params, cfg, hidden[:cu[-1]]))
  return [logits[lo:hi] for lo, hi in zip(cu[:-1], cu[1:])]


def first_mismatch(got, want):
  return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


# --------------------------------------------------------------------------
# Fixtures: one checkpoint pair (float32, bfloat16) per family and session


@pytest.fixture(scope="session")
def report():
  """family -> measured numbers; written to $ITERSERVE_FAMILY_REPORT at the end."""
  results = {}
  yield results
  path = os.environ.get(REPORT_ENV)
  if path and results:
    path = Path(path)
    old = json.loads(path.read_text()) if path.exists() else {}
    for name, row in results.items():
      old.setdefault(name, {}).update(row)
    path.write_text(json.dumps(old, indent=2, sort_keys=True))


@pytest.fixture(scope="session")
def bpe():
  """pre-tokenizer kind -> the BPE trained with it (trained on first use)."""
  trained = {}

  def get(kind):
    if kind not in trained:
      trained[kind] = F.train_tokenizer(kind)
    return trained[kind]
  return get


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, bpe):
  """(family name, dtype) -> checkpoint directory, built on first use."""
  root = tmp_path_factory.mktemp("families")
  built = {}

  def get(name, dtype="float32"):
    if (name, dtype) not in built:
      built[name, dtype] = F.build_checkpoint(F.FAMILIES[name], root / f"{name}-{dtype}", bpe,
                                              dtype=dtype)
    return built[name, dtype]
  return get


@pytest.fixture(scope="session")
def models(checkpoints, report):
  """family name -> ours and transformers' float32 model, the prompts and
  transformers' greedy continuations (built on first use)."""
  built = {}

  def get(name):
    if name not in built:
      family = F.FAMILIES[name]
      directory = checkpoints(name)
      cfg, params, tok = load_model(directory)
      model = F.hf_model(directory)
      chat = tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}])
      prompts = [tok.encode(t) for t in TEXTS + [chat]]
      shared = prompts[0] + tok.encode(SHARED_TAIL, add_special_tokens=False)
      hf_tokens = [F.hf_generate(model, p, NUM_NEW) for p in prompts + [shared]]
      # transformers' top-2 gap at each step that chose a token
      hf_gaps = [F.top2_gaps(F.hf_logits(model, p + t)[len(p) - 1:-1])
                 for p, t in zip(prompts + [shared], hf_tokens)]
      report.setdefault(name, {}).update(switches=family.switches,
                                         model_type=model.config.model_type)
      built[name] = dict(cfg=cfg, params=params, tok=tok, model=model, dir=directory,
                         prompts=prompts, shared=shared, hf_tokens=hf_tokens, hf_gaps=hf_gaps)
    return built[name]
  return get


def by_family(fast=None):
  """Parameters over every family; with ``fast``, the others marked slow."""
  return [pytest.param(name, marks=[] if fast is None or name in fast
                       else [pytest.mark.slow, pytest.mark.extended])
          for name in F.FAMILIES]


# --------------------------------------------------------------------------
# Tokenizer and config


@pytest.mark.parametrize("name", by_family())
def test_tokenizer_template_and_special_ids_agree(name, models):
  family, f32 = F.FAMILIES[name], models(name)
  tok, cfg = f32["tok"], f32["cfg"]
  hf_tok = F.hf_tokenizer(f32["dir"])
  messages = [{"role": "user", "content": "Why is the sky blue?"}]
  chat = tok.apply_chat_template(messages)
  assert chat == hf_tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=True)
  for text in TEXTS + [chat, "naïve café — 世界 🙂\n\n\tTabs  and   spaces 42!"]:
    assert tok.encode(text) == hf_tok(text)["input_ids"], text
  assert cfg.bos_token_id == (F.BOS_ID if family.adds_bos else None)
  assert (f32["prompts"][0][0] == F.BOS_ID) == family.adds_bos
  assert sorted(cfg.eos_token_ids) == sorted({F.EOS_ID, *family.extra_eos})
  assert cfg.family == f32["model"].config.model_type


# --------------------------------------------------------------------------
# float32


@pytest.mark.parametrize("name", by_family())
def test_float32_logits_match_transformers(name, models, report):
  f32 = models(name)
  seqs = [p + g for p, g in zip(f32["prompts"] + [f32["shared"]], f32["hf_tokens"])]
  ours = full_logits(f32["params"], f32["cfg"], seqs)
  worst, min_gap = 0.0, np.inf
  for seq, got in zip(seqs, ours):
    want = F.hf_logits(f32["model"], seq)
    worst = max(worst, float(np.abs(got - want).max()))
    min_gap = min(min_gap, float(F.top2_gaps(want).min()))
  report[name].update(f32_max_logit_error=worst, f32_positions=sum(map(len, seqs)))
  print(f"\n{name}: float32 max |logit diff| {worst:.2e} over "
        f"{sum(map(len, seqs))} positions (smallest top-2 gap {min_gap:.1e})")
  assert worst <= F32_ATOL


def test_float16_checkpoint_loads_exactly(models, checkpoints, report):
  """float16 tensors (a checkpoint saved in float16) widen exactly: our
  float32 load of them gives transformers' float32 forward of the same
  file within F32_ATOL."""
  name = "qwen2.5"
  directory = checkpoints(name, "float16")
  cfg, params, _ = load_model(directory)
  model = F.hf_model(directory, "float32")
  seqs = [p + t for p, t in zip(models(name)["prompts"], models(name)["hf_tokens"])]
  worst = max(float(np.abs(got - F.hf_logits(model, seq)).max())
              for seq, got in zip(seqs, full_logits(params, cfg, seqs)))
  report[name].update(f16_checkpoint_max_logit_error=worst)
  print(f"\n{name}: float16 checkpoint, float32 max |logit diff| {worst:.2e}")
  assert worst <= F32_ATOL


# --------------------------------------------------------------------------
# bfloat16


@pytest.mark.parametrize("name", by_family(fast=FAST_BF16_FAMILIES))
def test_bfloat16_greedy_matches_transformers_where_the_gap_is_clear(name, models, checkpoints,
                                                                     report):
  """transformers' bfloat16 greedy continuation, teacher-forced through our
  bfloat16 forward, both measured against transformers' float32 forward of
  the same sequences.

  A mixture's router can tie in bfloat16 (top-2/3 router logits within
  0.01), and each side may then pick another expert for that token: a row
  1-4 logits away from float32 on that side (measured on both sides; the
  token's K/V carry it to a few later rows). A mixture's rows more than
  BF16_FROM_F32 from float32 on either side are counted and left out (at
  most MAX_FLIPPED_ROWS of them). On every other row our logits
  are within BF16_ATOL of transformers' bfloat16 ones, and our argmax is
  its token wherever its top-2 gap exceeds BF16_NOISE.
  """
  f32 = models(name)
  directory = checkpoints(name, "bfloat16")
  cfg, params, _ = load_model(directory, dtype=jnp.bfloat16)
  assert params["embed"]["embedding"].dtype == jnp.bfloat16
  model = F.hf_model(directory, "bfloat16")
  prompts = f32["prompts"]
  seqs = [p + F.hf_generate(model, p, NUM_NEW) for p in prompts]
  ours = full_logits(params, cfg, seqs)
  worst, kept_worst, ours_f32, hf_f32 = 0.0, 0.0, 0.0, 0.0
  rows, flipped, ours_moved, hf_moved, checked, total, agree = 0, 0, 0, 0, 0, 0, 0
  for prompt, seq, got in zip(prompts, seqs, ours):
    want = F.hf_logits(model, seq)
    exact = F.hf_logits(f32["model"], seq)
    ours_away, hf_away = np.abs(got - exact).max(-1), np.abs(want - exact).max(-1)
    away = np.maximum(ours_away, hf_away)
    ours_moved += int((ours_away > BF16_FROM_F32).sum())
    hf_moved += int((hf_away > BF16_FROM_F32).sum())
    kept = away <= BF16_FROM_F32 if cfg.is_moe else np.ones(len(seq), bool)
    rows += len(seq)
    flipped += int((~kept).sum())
    worst = max(worst, float(np.abs(got - want).max()))
    kept_worst = max(kept_worst, float(np.abs(got - want)[kept].max()))
    ours_f32 = max(ours_f32, float(np.abs(got - exact).max()))
    hf_f32 = max(hf_f32, float(np.abs(want - exact).max()))
    steps = slice(len(prompt) - 1, len(seq) - 1)       # the rows that chose a token
    chosen = np.asarray(seq[len(prompt):])
    clear = (F.top2_gaps(want[steps]) > BF16_NOISE) & kept[steps]
    checked += int(clear.sum())
    total += len(chosen)
    agree += int((got[steps].argmax(-1) == chosen).sum())
    np.testing.assert_array_equal(got[steps].argmax(-1)[clear], chosen[clear])
  report[name].update(bf16_max_logit_error=worst, bf16_max_logit_error_unflipped=kept_worst,
                      bf16_ours_vs_f32=ours_f32, bf16_hf_vs_f32=hf_f32, bf16_rows=rows,
                      bf16_flipped_rows=flipped, bf16_ours_moved_rows=ours_moved,
                      bf16_hf_moved_rows=hf_moved, bf16_steps_checked=checked, bf16_steps=total,
                      bf16_steps_equal=agree)
  print(f"\n{name}: bfloat16 max |logit diff| {worst:.3f} over {rows} positions, {kept_worst:.3f} "
        f"without the {flipped} rows a routing tie moved (from float32: ours {ours_f32:.3f}, "
        f"{ours_moved} rows > {BF16_FROM_F32}; transformers' {hf_f32:.3f}, {hf_moved} rows); "
        f"argmax equal at {checked}/{total} steps with top-2 gap > {BF16_NOISE} "
        f"({agree}/{total} at all steps)")
  assert flipped <= MAX_FLIPPED_ROWS * rows
  assert kept_worst <= BF16_ATOL
  assert checked >= total // 3


# --------------------------------------------------------------------------
# The engine (float32)


@pytest.fixture(scope="session")
def engine_runs(models):
  """family name -> token lists of the engine's runs: ``mixed`` (all
  prompts in one batch), ``alone`` (each prompt, then the shared-prefix
  one, on a fresh engine), ``first`` and ``shared`` (prompt 0, then the
  prompt sharing its prefix, on one engine) and that engine's prefix-cache
  hits."""
  done = {}

  def get(name):
    if name not in done:
      m = models(name)
      cfg, params, prompts = m["cfg"], m["params"], m["prompts"]
      sampling = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)
      run = lambda engine, batch: [r.output_token_ids for r in engine.generate(batch, sampling)]
      mixed = run(Engine(cfg, params, ENGINE), prompts)
      alone = [run(Engine(cfg, params, ENGINE), [p])[0] for p in prompts + [m["shared"]]]
      engine = Engine(cfg, params, ENGINE)
      first = run(engine, [prompts[0]])[0]
      shared = run(engine, [m["shared"]])[0]
      done[name] = dict(mixed=mixed, alone=alone, first=first, shared=shared,
                        hits=engine.prefix_cache_stats()["prefix_cache_hits"])
    return done[name]
  return get


ENGINE_FAMILIES = [p for p in by_family(fast=FAST_ENGINE_FAMILIES)
                   if F.FAMILIES[p.values[0]].engine]


@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_engine_greedy_equals_transformers_generate(name, models, engine_runs, report):
  """The engine's tokens (prompts 0-3 in one batch, then the prompt sharing
  prompt 0's prefix after a prefix hit) are transformers' greedy tokens.
  Where transformers' top-2 gap is within float32 noise (2 F32_ATOL) the
  two may pick different tokens: the sequences are compared up to there."""
  m = models(name)
  runs = engine_runs(name)
  got = runs["mixed"] + [runs["shared"]]
  assert all(len(t) == NUM_NEW for t in got + m["hf_tokens"])
  equal = got == m["hf_tokens"]
  report[name].update(greedy_equal=equal, greedy_tokens=len(got) * NUM_NEW)
  print(f"\n{name}: engine greedy tokens equal to transformers' generate: {equal}")
  for i, (ours, theirs, gaps) in enumerate(zip(got, m["hf_tokens"], m["hf_gaps"])):
    step = first_mismatch(ours, theirs)
    assert step is None or gaps[step] < 2 * F32_ATOL, (
        f"prompt {i}: first different token at step {step} (transformers' top-2 gap "
        f"{gaps[step]:.2e}): {ours} vs {theirs}")


@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_tokens_alone_equal_mixed_chunked_and_after_prefix_hit(name, engine_runs, report):
  runs = engine_runs(name)
  invariant = (runs["mixed"] == runs["alone"][:-1] and runs["first"] == runs["alone"][0]
               and runs["shared"] == runs["alone"][-1])
  report[name].update(invariant=invariant, prefix_hits=runs["hits"])
  assert runs["mixed"] == runs["alone"][:-1]
  assert runs["first"] == runs["alone"][0]
  assert runs["hits"] >= 8          # at least the two full 4-row pages of the shared prefix
  assert runs["shared"] == runs["alone"][-1]
  assert len({tuple(t) for t in runs["alone"]}) == len(runs["alone"])


@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_speculative_decoding_keeps_the_greedy_tokens(name, models, engine_runs):
  """n-gram drafts verified in the step leave the batch's greedy tokens as
  they are without speculation (serving.engine.speculative)."""
  m = models(name)
  engine = Engine(m["cfg"], m["params"],
                  dataclasses.replace(ENGINE, speculative="ngram:k=3,n=2"))
  got = [r.output_token_ids for r in engine.generate(
      m["prompts"], SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))]
  assert got == engine_runs(name)["mixed"]
  assert engine.spec_counts.num_draft_tokens > 0


@pytest.mark.extended
@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_the_model_as_its_own_draft_keeps_the_greedy_tokens(name, models, engine_runs):
  """A draft model (``draft:MODEL``) equal to the target proposes the
  target's greedy tokens, so its tokens are those without speculation and
  every draft is accepted: the draft's KV cache, in the target's pages,
  holds what the target's does."""
  m = models(name)
  engine = Engine(m["cfg"], m["params"],
                  dataclasses.replace(ENGINE, speculative=f"draft:{m['dir']},k=3"))
  got = [r.output_token_ids for r in engine.generate(
      m["prompts"], SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))]
  assert got == engine_runs(name)["mixed"]
  counts = engine.spec_counts
  assert counts.num_draft_tokens > 0
  assert counts.num_accepted_tokens == counts.num_draft_tokens


# --------------------------------------------------------------------------
# Each switch is live


def _plain_rope(cfg):
  return dataclasses.replace(cfg, rope=RopeConfig(theta=cfg.rope.theta))


def _zero_biases(params):
  attn = dict(params["layers"]["attn"])
  for key in ("bq", "bk", "bv"):
    attn[key] = jnp.zeros_like(attn[key])
  return {**params, "layers": {**params["layers"], "attn": attn}}


# (family, the switch turned off): a config or params change.
SWITCHES = [
    ("llama3.1", "llama3 RoPE", _plain_rope, None),
    ("qwen2.5", "q/k/v biases", None, _zero_biases),
    ("qwen2.5-yarn", "yarn RoPE", _plain_rope, None),
    ("qwen3", "q/k norm", lambda c: dataclasses.replace(c, qk_norm=False), None),
    ("mistral", "window", lambda c: dataclasses.replace(c, layer_windows=()), None),
    ("gemma2", "attention soft-cap", lambda c: dataclasses.replace(c, attn_softcap=None), None),
    ("gemma2", "final soft-cap", lambda c: dataclasses.replace(c, final_softcap=None), None),
    ("gemma2", "query_pre_attn_scalar", lambda c: dataclasses.replace(c, attn_scale=None), None),
    ("gemma2", "windows", lambda c: dataclasses.replace(c, layer_windows=()), None),
    ("gemma3", "local RoPE", lambda c: dataclasses.replace(c, rope_local=None), None),
    ("gemma3", "linear global RoPE", _plain_rope, None),
    ("phi3", "partial rotary", lambda c: dataclasses.replace(c, rotary_dim=c.head_dim), None),
    ("phi3", "window", lambda c: dataclasses.replace(c, layer_windows=()), None),
    ("mixtral", "top-2", lambda c: dataclasses.replace(c, experts_per_token=1), None),
    ("qwen3-moe", "norm_topk_prob", lambda c: dataclasses.replace(c, norm_topk_prob=False),
     None),
]


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("name,switch,cfg_off,params_off", SWITCHES,
                         ids=[f"{n}-{s}" for n, s, _, _ in SWITCHES])
def test_each_switch_moves_the_logits_far_beyond_the_tolerance(name, switch, cfg_off,
                                                               params_off, models):
  """Guards the checkpoints themselves: with one switch turned off in our
  config (or its weights zeroed), the logits move by more than 1000x
  F32_ATOL (measured: 1.3 to 8), so the float32 comparison above would see
  a switch that is read wrongly or ignored."""
  m = models(name)
  seqs = [p + t for p, t in zip(m["prompts"], m["hf_tokens"])]
  cfg = cfg_off(m["cfg"]) if cfg_off else m["cfg"]
  params = params_off(m["params"]) if params_off else m["params"]
  moved = max(float(np.abs(a - b).max()) for a, b in
              zip(full_logits(params, cfg, seqs), full_logits(m["params"], m["cfg"], seqs)))
  print(f"\n{name}: without {switch} the logits move by {moved:.2f}")
  assert moved > 1000 * F32_ATOL
