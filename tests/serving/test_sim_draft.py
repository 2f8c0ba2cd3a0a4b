"""A draft model's speculation in the simulator: each step pays, beside the
target's forward, the draft model's forward over the same packed rows and,
where rows carry drafts, its k single-row forwards over those rows (as
``executor.draft_propose`` runs them), each priced by the cost model's
terms on the draft's shape; the no-speculation and n-gram
figures are unchanged; a draft of another vocabulary, or one that cannot be
read, is refused naming ``EngineConfig.speculative``."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from scheduler import records as rec
from serving.engine import calibrations as cal_lib
from serving.engine import cost_model as cost_lib
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from tests.serving.engine_testing import (ATTN_MS_PER_GFLOP, CFG, KV_MS_PER_GB, ROW_MS, STEP_MS,
                                          save_test_cost_model, step_ms)

# The draft model below: 1 block, 2 query heads over 1 KV head of 16, float32.
# A query-key pair costs 4 * 2 * 16 FLOPs, a cached token 2 * 1 * 16 * 4 bytes.
DRAFT_PAIR_FLOPS, DRAFT_KV_BYTES = 4 * 2 * 16, 2 * 1 * 16 * 4


def draft_ms(rows, pairs, keys, passes=1):
  """The test cost model's time (ms) of the draft's forwards: ``passes``
  steps, ``rows`` rows, ``pairs`` query-key pairs, ``keys`` keys read."""
  return (STEP_MS * passes + ROW_MS * rows + ATTN_MS_PER_GFLOP * pairs * DRAFT_PAIR_FLOPS / 1e9
          + KV_MS_PER_GB * keys * DRAFT_KV_BYTES / 1e9)


def write_draft(directory: Path, vocab_size: int, *, weights: bool = True, **config) -> str:
  """A tiny Llama checkpoint (transformers' config class, random weights,
  ``save_pretrained``; ``weights=False``: its config only) with a small
  tokenizer, in ``directory``; returns its path."""
  transformers = pytest.importorskip("transformers")
  from tokenizers import Tokenizer, models, pre_tokenizers
  directory.mkdir(parents=True)
  cls = getattr(transformers, config.pop("config_class", "LlamaConfig"))
  hf = cls(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
           max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None,
           eos_token_id=1, **config)
  if weights:
    import torch
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf).save_pretrained(directory)
  else:
    hf.save_pretrained(directory)
  tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(directory / "tokenizer.json"))
  return str(directory)


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
  return save_test_cost_model(tmp_path_factory.mktemp("cost") / "cost.json")


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
  return write_draft(tmp_path_factory.mktemp("draft") / "tiny-draft", CFG.vocab_size)


def _config(cost_file, speculative, alpha=1.0):
  return EngineConfig.preset("tiny", executor="simulated", cost_model=cost_file,
                             speculative=speculative, spec_acceptance=alpha if speculative else 0.0)


def _step_times(config, prompt=(3, 4, 5, 6, 7, 8), max_tokens=8):
  """Each step's charged ms and plan statistics, one request to its end."""
  engine = Engine(CFG, None, config)
  req = engine.add_request("r", list(prompt), SamplingParams(max_tokens=max_tokens,
                                                               ignore_eos=True))
  out = []
  while not req.finished:
    start = engine.now_ms()
    engine.step()
    out.append((engine.now_ms() - start, np.asarray(engine.last_step_stats[0]).tolist(),
                np.asarray(engine.last_step_features)))
  return engine, out


def test_a_draft_step_pays_the_draft_forward_and_its_passes(cost_file, draft):
  """One request, prompt 6, 8 outputs, k = 3, alpha 1, as the n-gram case
  of test_sim_speculative. Step 1: the prompt [0, 6): the target's 6 rows
  (21 pairs, 6 keys), and the draft's forward over the same rows; no
  drafts, no single-row forwards. Step 2: the decode row at 6 with 3
  drafts [6, 10): target and draft forwards over its 4 rows (34 pairs, 10
  keys), then 3 single-row forwards at positions 7, 8, 9 (8 + 9 + 10 = 27
  keys seen, each pair one key read). Step 3: the cap leaves 2 drafts
  [10, 13) (11 + 12 + 13 = 36 pairs, 13 keys); 2 forwards, as many as
  the most drafts a row carries: at 11 and 12 (12 + 13 keys)."""
  engine, steps = _step_times(_config(cost_file, f"draft:{draft},k=3"))
  assert engine.model_costs.draft.gemm_flops_per_row == 2 * (32 * (32 + 2 * 16) + 32 * 32
                                                             + 3 * 32 * 64)
  assert engine.model_costs.draft_passes == 3
  want = [step_ms(6, 21, 6) + draft_ms(6, 21, 6),
          step_ms(4, 34, 10) + draft_ms(4, 34, 10) + draft_ms(3, 27, 27, passes=3),
          step_ms(3, 36, 13) + draft_ms(3, 36, 13) + draft_ms(2, 25, 25, passes=2)]
  np.testing.assert_allclose([s[0] for s in steps], want, rtol=1e-9)
  # The draft tail of plan_stats: rows carrying drafts, drafts, the most
  # drafts of a row, keys seen by the drafts' rows.
  assert [s[1][6:] for s in steps] == [[0, 0, 0, 0], [1, 3, 3, 27], [1, 2, 2, 25]]
  assert all(s[2].shape == (3, len(cost_lib.FEATURES)) for s in steps)
  assert engine.spec_counts.num_accepted_tokens == 5


def test_plain_and_ngram_step_costs_are_unchanged(cost_file):
  """Without speculation and with n-gram drafts a step is the target's
  forward only, its features one row, at the figures of before."""
  _, plain = _step_times(_config(cost_file, ""))
  want = [step_ms(6, 21, 6)] + [step_ms(1, j + 1, j + 1) for j in range(6, 13)]
  np.testing.assert_allclose([s[0] for s in plain], want, rtol=1e-9)
  _, ngram = _step_times(_config(cost_file, "ngram:k=3,n=2"))
  np.testing.assert_allclose([s[0] for s in ngram],
                             [step_ms(6, 21, 6), step_ms(4, 34, 10), step_ms(3, 36, 13)],
                             rtol=1e-9)
  assert all(s[2].shape == (len(cost_lib.FEATURES),) for s in plain + ngram)


def _plan(intervals, num_slots=40):
  """A stand-in plan: (start, end, kind, drafts) per slot, the rest unselected."""
  pad = num_slots - len(intervals)
  start, end, kind, drafts = zip(*intervals)
  kinds = {"prefill": rec.PREFILL_CHUNK, "decode": rec.DECODE_ROW}
  i32 = lambda v: jnp.asarray(list(v) + [0] * pad, jnp.int32)
  return SimpleNamespace(selected=jnp.asarray([True] * len(intervals) + [False] * pad),
                         start=i32(start), end=i32(end), kind=i32(kinds[k] for k in kind),
                         num_draft=i32(drafts))


def _tiny_cfg(**kw):
  base = dict(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
              ffn_dim=64, rope_theta=1e4, tie_embeddings=True, max_position=128,
              eos_token_ids=(1,))
  return ModelConfig(**(base | kw))


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_the_draft_forwards_features_by_hand(weights):
  """34 decode rows carrying drafts (one at 20 with 4, 33 at 10 with 2)
  and a prompt chunk [0, 8), k = 4: the draft's forward over the packed
  rows samples one row per sequence (35); 4 single-row forwards of 34
  rows each (2 tiles of 32: one GEMM pass more each), 136 rows, all but
  the last forward's 34 sampling; the drafts' rows see 22 + 23 + 24 + 25 keys (the long row)
  and 12 + 13 (each other), and the 136 - 70 rows past their drafts one
  key each."""
  plan = _plan([(0, 8, "prefill", 0), (20, 25, "decode", 4)]
               + [(10, 13, "decode", 2)] * 33)
  stats = np.asarray(cost_lib.plan_stats(plan, (0,)))
  keys = 22 + 23 + 24 + 25 + 33 * (12 + 13)
  assert stats[:3].tolist() == [8, 34 + 70, 35 + 70] and stats[6:].tolist() == [34, 70, 4, keys]
  target = cost_lib.model_costs(_tiny_cfg(), weights)
  small = cost_lib.model_costs(_tiny_cfg(n_layers=1, n_heads=2, n_kv_heads=1), weights)
  costs = dataclasses.replace(target, draft=small, draft_passes=4)
  f = cost_lib.step_features(stats, 128, costs)
  assert f.shape == (3, len(cost_lib.FEATURES))
  np.testing.assert_array_equal(f[0], cost_lib.step_features(stats[:6], 128, target))
  one_per_sequence = stats[:6].copy()
  one_per_sequence[2] = 35
  np.testing.assert_array_equal(f[1], cost_lib.step_features(one_per_sequence, 128, small))
  passes = dict(zip(cost_lib.FEATURES, f[2]))
  gemm = 136 * small.gemm_flops_per_row / 1e9
  assert passes["step"] == 4 and passes["rows"] == 136
  assert passes["gemm_gflop"] == pytest.approx(gemm)
  assert passes["lm_head_gflop"] == pytest.approx(102 * 2 * 32 * 100 / 1e9)
  assert passes["attention_gflop"] == pytest.approx((keys + 66) * 4 * 2 * 16 / 1e9)
  assert passes["kv_read_gb"] == pytest.approx((keys + 66) * small.kv_bytes_per_token / 1e9)
  assert passes["weight_read_gb"] == pytest.approx(4 * small.weight_bytes_per_step / 1e9)
  if weights == "int8":        # one GEMM over every row of a forward
    assert passes["prompt_gemm_gflop"] == pytest.approx(gemm)
    assert passes["extra_weight_read_gb"] == 0
  else:
    assert passes["prompt_gemm_gflop"] == 0
    assert passes["extra_weight_read_gb"] == pytest.approx(4 * small.weight_bytes_per_step / 1e9)
  # Every coefficient set: the step is the three forwards' sums, each
  # coefficient times its feature, the draft's two by the draft's model.
  coef = dict(zip(cost_lib.FEATURES, (5.0, 0.5, 3.0, 7.0, 11.0, 13.0, 17.0, 19.0, 23.0)))
  model = cost_lib.CostModel.of(**coef)
  model = cost_lib.CostModel(model.coef_ms, draft=model)
  hand = sum(c * f[p][i] for p in range(3) for i, c in enumerate(coef.values()))
  assert model.predict_ms(f) == pytest.approx(hand, rel=1e-12)
  # More drafts cost more: at most 2 a row (2 forwards instead of 4), and
  # fewer drafts per row at the same most.
  def cost(intervals):
    plan_ = _plan([(0, 8, "prefill", 0)] + intervals)
    return model.predict_ms(cost_lib.step_features(
        np.asarray(cost_lib.plan_stats(plan_, (0,))), 128, costs))
  two = cost([(20, 23, "decode", 2)] + [(10, 12, "decode", 1)] * 33)
  assert two < model.predict_ms(f)
  assert cost([(20, 25, "decode", 4)] + [(10, 12, "decode", 1)] * 33) < model.predict_ms(f)
  assert two < cost([(20, 23, "decode", 2)] + [(10, 13, "decode", 2)] * 33)
  # No row carrying drafts: the draft's forward over the rows, no sampling,
  # no single-row forwards.
  plain = np.asarray(cost_lib.plan_stats(_plan([(0, 8, "prefill", 0), (9, 10, "decode", 0)]),
                                         (0,)))
  h = cost_lib.step_features(plain, 128, costs)
  assert h[1][cost_lib.FEATURES.index("lm_head_gflop")] == 0 and not h[2].any()


def test_roofline_bounds_each_forward_on_its_own():
  """A roofline model prices each forward by its own larger side: a
  compute-bound target (10 ms of GEMM, 1 ms of weights) and memory-bound
  draft passes (1 ms of GEMM, 4 ms of weights) take 10 + 4 ms, not
  max(11, 5)."""
  model = cost_lib.CostModel.of(combine="roofline", gemm_gflop=1.0, weight_read_gb=1.0)
  model = cost_lib.CostModel(model.coef_ms, "roofline", draft=model)
  f = np.zeros((3, len(cost_lib.FEATURES)))
  g, w = cost_lib.FEATURES.index("gemm_gflop"), cost_lib.FEATURES.index("weight_read_gb")
  f[0, [g, w]] = 10.0, 1.0
  f[2, [g, w]] = 1.0, 4.0
  assert model.predict_ms(f) == 14.0
  assert model.predict_ms(f, xp=jnp) == 14.0
  with pytest.raises(ValueError, match="need CostModel.draft"):
    cost_lib.CostModel(model.coef_ms, "roofline").predict_ms(f)
  back = cost_lib.from_json(json.loads(json.dumps(model.to_json())), "here")
  assert back == model and back.predict_ms(f) == 14.0


def test_a_one_model_calibration_refuses_the_draft(cost_file, draft):
  """A calibration fitted on the target alone predicts the target only:
  the draft model is refused by the same rule."""
  costs = cost_lib.engine_model_costs(CFG, _config(cost_file, f"draft:{draft},k=2"))
  alone = cost_lib.CostModel.of(step=1.0, meta={
      "models": [cost_lib.engine_model_costs(CFG, _config(cost_file, "")).to_json()]})
  with pytest.raises(ValueError, match=r"cannot predict the draft model "
                                       r"\(EngineConfig.speculative\)"):
    cal_lib.resolve(alone, costs, say=lambda line: None)
  assert cal_lib.resolve(alone, dataclasses.replace(costs, draft=None),
                         say=lambda line: None).draft is None


def test_the_default_calibration_is_one_that_predicts_the_draft_too():
  """On a machine whose shipped calibration was fitted on one model (the
  target's), a draft model of another shape makes it not hold: the default
  calibration (fitted on two models) is kept, and it predicts both."""
  from models.config import get_config
  fp = {"backend": "cpu", "kind": "cpu", "count": 1, "cpu": "AMD EPYC", "cpus": 2,
        "id": "not-shipped", "flags": ["fpu", "sse2", "avx", "fma", "avx2"]}
  target = cost_lib.model_costs(get_config("smollm2-135m"), "float32")
  assert cal_lib.select_calibration(fp, target)[0].name == "cost_model_cpu_avx2.json"
  costs = dataclasses.replace(target, draft=cost_lib.model_costs(CFG, "float32"))
  path, line = cal_lib.select_calibration(fp, costs)
  assert path is None and "cost_model_cpu_avx2.json (fitted on smollm2-135m only)" in line
  lines = []
  model = cal_lib.resolve(cal_lib.load(), costs, fingerprint=fp, say=lines.append)
  assert model.meta["path"] == "cost_model_cpu.json" and model.draft is not None
  assert any("predicting the draft model (EngineConfig.speculative) from its cost features"
             in line for line in lines)


def test_a_draft_of_another_vocabulary_or_unreadable_is_refused(cost_file, tmp_path):
  other = write_draft(tmp_path / "vocab-384", 384, weights=False)
  with pytest.raises(ValueError, match=r"EngineConfig.speculative: the draft model's vocabulary "
                                       r"\(384 tokens.*must be the target's \(512, tiny\)"):
    Engine(CFG, None, _config(cost_file, f"draft:{other},k=2"))
  missing = tmp_path / "no-such-model"
  with pytest.raises(ValueError, match=r"EngineConfig.speculative: the draft model "
                                       r".*no-such-model.* cannot be read"):
    Engine(CFG, None, _config(cost_file, f"draft:{missing},k=2"))
  windowed = write_draft(tmp_path / "windowed", CFG.vocab_size, weights=False,
                         config_class="MistralConfig", sliding_window=8)
  with pytest.raises(ValueError, match=r"EngineConfig.speculative: the draft model .*windowed.* "
                                       r"has attention window\(s\) \[8\] the target 'tiny' lacks"):
    Engine(CFG, None, _config(cost_file, f"draft:{windowed},k=2"))
