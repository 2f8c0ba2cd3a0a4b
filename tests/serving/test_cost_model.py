"""``serving.engine.cost_model.model_costs``: cost features from a ModelConfig,
checked against numbers computed by hand for two published shapes."""

import dataclasses
import hashlib
import json

import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig, get_config
from serving.engine import calibrations as cal_lib
from serving.engine import profiles as profile_lib
from serving.engine import cost_model as cost_lib

# Llama-3.1-8B: d 4096, 32 blocks, 32 query / 8 KV heads of 128, MLP 14336,
# vocabulary 128256, untied head.
LLAMA_8B = ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                       n_kv_heads=8, head_dim=128, ffn_dim=14336, rope_theta=500000.0,
                       tie_embeddings=False, max_position=131072, eos_token_ids=(128001,))
# Mixtral-8x7B: the same attention, 8 experts of 14336, top 2, vocabulary 32000.
MIXTRAL = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      head_dim=128, ffn_dim=14336, rope_theta=1e6, tie_embeddings=False,
                      max_position=32768, eos_token_ids=(2,), family="mixtral",
                      num_experts=8, experts_per_token=2)


def test_llama_8b_by_hand():
  c = cost_lib.model_costs(LLAMA_8B, "bfloat16")
  # Per block: q 4096x4096 + k, v 4096x1024 each + o 4096x4096 = 41,943,040;
  # MLP 3 x 4096 x 14336 = 176,160,768; sum 218,103,808; x 32 x 2 FLOPs.
  assert c.gemm_flops_per_row == 13_958_643_712
  assert c.lm_head_flops_per_row == 2 * 4096 * 128256 == 1_050_673_152
  # q.k and p.v: 2 x 2 x 32 heads x 128 per block, 32 blocks.
  assert c.attention_flops_per_pair == 524_288
  # K and V: 2 x 8 x 128 bf16 values per block = 4 KiB, 32 blocks = 128 KiB.
  assert c.kv_bytes_per_token == 131_072
  # Blocks 6,979,321,856 + norms 2 x 4096 x 32 + final norm 4096 + head
  # 525,336,576 = 7,504,924,672 values read per step; the untied embedding
  # adds 525,336,576 to the model (8,030,261,248 parameters: "8B").
  assert c.weight_bytes_per_step == 2 * 7_504_924_672
  assert c.weight_bytes == 2 * 8_030_261_248
  assert c.expert_bytes == 0 and c.windows == (0,) * 32
  assert c.attention_flops(1000) == 1000 * 524_288


def test_mixtral_by_hand():
  c = cost_lib.model_costs(MIXTRAL)        # float32 weights and cache
  # Per block: attention 41,943,040 x 2 FLOPs, router 4096 x 8 x 2, two
  # experts 2 x 176,160,768 x 2: 83,886,080 + 65,536 + 704,643,072 =
  # 788,594,688; 32 blocks.
  assert c.gemm_flops_per_row == 25_235_030_016
  assert c.lm_head_flops_per_row == 2 * 4096 * 32000
  assert c.kv_bytes_per_token == 32 * 2 * 1024 * 4
  # One expert in 32 blocks: 32 x 176,160,768 values.
  assert c.expert_bytes == 4 * 5_637_144_576
  # Per block 41,943,040 + 32,768 + 8 x 176,160,768 + 8192 = 1,451,270,144;
  # x 32 + 4096 + head 131,072,000 = 46,571,720,704 (+ the embedding:
  # 46,702,792,704, Mixtral's "46.7B").
  assert c.weight_bytes_per_step == 4 * 46_571_720_704
  assert c.weight_bytes == 4 * 46_702_792_704


def test_windows_cap_the_keys_a_windowed_block_reads():
  import dataclasses
  cfg = dataclasses.replace(get_config("tiny"), layer_windows=(8, 0))
  c = cost_lib.model_costs(cfg)
  per_block = 4 * cfg.n_heads * cfg.head_dim
  assert c.attention_flops_per_pair == 2 * per_block
  assert c.attention_flops(20) == per_block * (8 + 20)
  assert c.attention_flops(5) == per_block * (5 + 5)
  assert c.to_json()["windows"] == [8, 0]


def test_tied_int8_and_kv_dtypes():
  cfg = get_config("tiny")          # tied: the head is the embedding, counted once
  f32 = cost_lib.model_costs(cfg)
  assert f32.weight_bytes == f32.weight_bytes_per_step
  int8 = cost_lib.model_costs(cfg, "int8")
  assert int8.weight_bytes * 4 == f32.weight_bytes
  assert int8.kv_dtype == "float32" and int8.kv_bytes_per_token == f32.kv_bytes_per_token
  assert cost_lib.model_costs(cfg, kv_dtype="bfloat16").kv_bytes_per_token * 2 == (
      f32.kv_bytes_per_token)
  with pytest.raises(ValueError, match="weight_dtype must be one of"):
    cost_lib.model_costs(cfg, "float8")


# ---------------------------------------------------------------- step model
def _plan(intervals):
  """A stand-in plan: (start, end, kind) per slot, the rest unselected."""
  from types import SimpleNamespace
  import jax.numpy as jnp
  from scheduler import records as rec
  pad = 6 - len(intervals)
  start, end, kind = zip(*intervals) if intervals else ((), (), ())
  kinds = {"prefill": rec.PREFILL_CHUNK, "decode": rec.DECODE_ROW}
  return SimpleNamespace(
      selected=jnp.asarray([True] * len(intervals) + [False] * pad),
      start=jnp.asarray(list(start) + [0] * pad, jnp.int32),
      end=jnp.asarray(list(end) + [0] * pad, jnp.int32),
      kind=jnp.asarray([kinds[k] for k in kind] + [0] * pad, jnp.int32), num_draft=None)


def test_plan_stats_by_hand():
  # A decode row at position 9 sees 10 keys; chunk [0, 4) computes 1+2+3+4
  # pairs, chunk [4, 8) 5+6+7+8. Under a window of 6: 6, 10, 5+6+6+6.
  plan = _plan([(9, 10, "decode"), (0, 4, "prefill"), (4, 8, "prefill")])
  stats = np.asarray(cost_lib.plan_stats(plan, (0, 6)))
  # No drafts: the draft tail (3 counts, then keys per window) is zero.
  np.testing.assert_array_equal(stats, [8, 1, 3, 8, 10 + 10 + 26, 6 + 10 + 23,
                                        10 + 4 + 8, 6 + 4 + 6] + [0] * 5)
  # Prompts of 5, 6 and 6 tokens: the decode row (position 9) is generated,
  # chunk [0, 4) is all prompt, chunk [4, 8) has 2 prompt rows (a rebuild
  # of outputs past position 6 runs with the generated rows).
  prompt_len = jnp.asarray([5, 6, 6] + [0] * 3, jnp.int32)
  stats = np.asarray(cost_lib.plan_stats(plan, (0,), prompt_len))
  np.testing.assert_array_equal(stats, [8, 1, 3, 6, 10 + 10 + 26, 10 + 4 + 8] + [0] * 4)


@pytest.mark.parametrize("window", [0, 1, 3, 7, 50])
def test_plan_stats_window_pairs_equal_a_loop(window):
  rng = np.random.default_rng(window)
  for _ in range(20):
    intervals = []
    for _ in range(rng.integers(0, 6)):
      s = int(rng.integers(0, 40))
      intervals.append((s, s + int(rng.integers(1, 12)), "prefill"))
    stats = np.asarray(cost_lib.plan_stats(_plan(intervals), (window,)))
    see = lambda j: j + 1 if window == 0 else min(j + 1, window)
    pairs = sum(see(j) for s, e, _ in intervals for j in range(s, e))
    keys = sum(e if window == 0 else min(e, window) for _, e, _ in intervals)
    assert stats[4:6].tolist() == [pairs, keys]


def test_step_features_by_hand_for_a_windowed_model():
  # 2 blocks, one global and one with a window of 8: a pair costs
  # 4 * n_heads * head_dim = 256 FLOPs per block, a cached token 2 * 2 * 16 * 4
  # bytes per block.
  cfg = ModelConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=16, ffn_dim=64, rope_theta=1e4, tie_embeddings=True,
                    max_position=64, eos_token_ids=(1,), layer_windows=(0, 8))
  costs = cost_lib.model_costs(cfg)
  # prefill, decode, seqs, prompt rows, pairs g/w, keys g/w
  stats = [12, 2, 3, 12, 100, 60, 30, 20]
  f = dict(zip(cost_lib.FEATURES, cost_lib.step_features(stats, 16, costs)))
  assert f["step"] == 1 and f["rows"] == 14
  assert f["gemm_gflop"] == pytest.approx(16 * costs.gemm_flops_per_row / 1e9)
  assert f["lm_head_gflop"] == pytest.approx(3 * 2 * 32 * 100 / 1e9)
  assert f["attention_gflop"] == pytest.approx((100 + 60) * 256 / 1e9)
  assert f["kv_read_gb"] == pytest.approx((30 + 20) * 256 / 1e9)
  assert f["weight_read_gb"] == pytest.approx(costs.weight_bytes_per_step / 1e9)
  # Row classes: the prompt rows' GEMM runs at least 64 rows; the 2 decode
  # rows run their own (one tile), a second pass over the weights.
  assert f["prompt_gemm_gflop"] == pytest.approx(64 * costs.gemm_flops_per_row / 1e9)
  assert f["extra_weight_read_gb"] == pytest.approx(costs.weight_bytes_per_step / 1e9)
  # 40 decode rows alone: two tiles of 32, one pass past the first.
  g = dict(zip(cost_lib.FEATURES, cost_lib.step_features([0, 40, 40, 0, 0, 0, 0, 0], 64,
                                                          costs)))
  assert g["prompt_gemm_gflop"] == 0.0
  assert g["extra_weight_read_gb"] == pytest.approx(costs.weight_bytes_per_step / 1e9)
  with pytest.raises(ValueError, match="window kind"):
    cost_lib.step_features(stats[:5], 16, costs)


def _synthetic_grid(rng, cfg, n):
  """Features of random steps of ``cfg`` (buckets 16..256, contexts to 8k)."""
  costs = cost_lib.model_costs(cfg, "bfloat16")
  rows = []
  for _ in range(n):
    decode, chunks = int(rng.integers(0, 32)), int(rng.integers(0, 5))
    prefill = chunks * int(rng.integers(1, 64))
    bucket = int(2 ** np.ceil(np.log2(max(prefill + decode, 16))))
    ctx, chunk_ctx = int(rng.integers(1, 8192)), int(rng.integers(0, 8192))
    stats = [prefill, decode, decode + chunks, prefill,
             prefill * (prefill / max(chunks, 1) + 1) / 2 + prefill * chunk_ctx + decode * ctx,
             decode * ctx + chunks * chunk_ctx]
    rows.append(cost_lib.step_features(stats, bucket, costs))
  return np.array(rows)


TRUE = dict(step=2.0, rows=0.05, gemm_gflop=1000 / 400.0, lm_head_gflop=1000 / 300.0,
            attention_gflop=1000 / 150.0, kv_read_gb=1000 / 60.0, weight_read_gb=1000 / 80.0,
            prompt_gemm_gflop=1000 / 900.0, extra_weight_read_gb=1000 / 40.0)


def test_fit_recovers_known_efficiencies_across_two_models():
  """Synthetic step times from known throughputs (GFLOP/s, GB/s) on two
  models of different widths: the fit recovers every efficiency and
  predicts a third model it never saw."""
  rng = np.random.default_rng(0)
  small = get_config("tiny")
  big = dataclasses.replace(LLAMA_8B, n_layers=2, vocab_size=4096, eos_token_ids=(1,))
  x = np.concatenate([_synthetic_grid(rng, small, 400), _synthetic_grid(rng, big, 400)])
  true = cost_lib.CostModel.of(**TRUE)
  y = np.array([true.predict_ms(r) for r in x]) * rng.normal(1, 0.001, len(x))
  fit = cost_lib.fit(x, y, meta={"models": ["a", "b"]})
  for name, value in TRUE.items():
    assert fit.coef_ms[cost_lib.FEATURES.index(name)] == pytest.approx(value, rel=0.05), name
  assert fit.efficiencies()["weight_read_gb"] == pytest.approx(80.0, rel=0.05)
  assert fit.meta["median_rel_residual"] < 0.005
  # Every term earns its place: leaving one out leaves a larger residual.
  assert all(v > 1.5 * fit.meta["rms_residual_ms"]
             for v in fit.meta["residual_without"].values())
  third = _synthetic_grid(rng, dataclasses.replace(MIXTRAL, n_layers=1), 20)
  for r in third:
    assert fit.predict_ms(r) == pytest.approx(true.predict_ms(r), rel=0.03)


def test_one_model_fit_folds_weight_reads_into_the_step_term():
  rng = np.random.default_rng(1)
  x = _synthetic_grid(rng, get_config("tiny"), 200)
  y = np.array([cost_lib.CostModel.of(**TRUE).predict_ms(r) for r in x])
  free = [f for f in cost_lib.FEATURES if f != "weight_read_gb"]
  fit = cost_lib.fit(x, y, free=free)
  weight_ms = TRUE["weight_read_gb"] * x[0, cost_lib.FEATURES.index("weight_read_gb")]
  assert fit.coef_ms[0] == pytest.approx(TRUE["step"] + weight_ms, rel=1e-3)
  assert fit.coef_ms[cost_lib.FEATURES.index("weight_read_gb")] == 0.0 and fit.meta["free"] == free
  with pytest.raises(ValueError, match="unknown feature"):
    cost_lib.fit(x, y, free=["step", "bucket"])
  with pytest.raises(ValueError, match="at least"):
    cost_lib.fit(x[:3], y[:3])


def test_a_relative_fit_weights_each_step_by_its_time():
  """One free term (``step``) over steps of 1 and 3 ms: in ms the fit is
  their mean, 2; in relative error it minimizes (c-1)^2 + ((c-3)/3)^2,
  so 9(c-1) + (c-3) = 0 and c = 1.2. Residuals are reported in ms."""
  x = np.zeros((2, len(cost_lib.FEATURES)))
  x[:, cost_lib.FEATURES.index("step")] = 1.0
  y = np.array([1.0, 3.0])
  absolute = cost_lib.fit(x, y, free=["step"])
  assert absolute.coef_ms[0] == pytest.approx(2.0) and absolute.meta["fit_error"] == "absolute"
  relative = cost_lib.fit(x, y, free=["step"], relative=True)
  assert relative.coef_ms[0] == pytest.approx(1.2) and relative.meta["fit_error"] == "relative"
  assert relative.meta["rms_residual_ms"] == pytest.approx(np.sqrt((0.2**2 + 1.8**2) / 2))
  assert relative.meta["median_rel_residual"] == pytest.approx((0.2 + 0.6) / 2)
  # Exact data is fitted exactly either way.
  rng = np.random.default_rng(2)
  grid = _synthetic_grid(rng, get_config("tiny"), 200)
  true = np.array([cost_lib.CostModel.of(**TRUE).predict_ms(r) for r in grid])
  free = [f for f in cost_lib.FEATURES if f != "weight_read_gb"]
  assert (cost_lib.fit(grid, true, free=free, relative=True).coef_ms
          == pytest.approx(cost_lib.fit(grid, true, free=free).coef_ms, rel=1e-6, abs=1e-9))
  with pytest.raises(ValueError, match="every step_ms > 0"):
    cost_lib.fit(x, np.array([1.0, 0.0]), free=["step"], relative=True)


def test_h100_profile_by_hand_on_llama_8b():
  """A decode step of 8 sequences at 1,024 tokens each on the fitted H100
  profile, by its formula from the profile's own numbers: 3 ms per step, the
  fixed times of 32 x 4 + 1 GEMMs and 32 x 5 row-wise operators, 8 rows'
  row-wise bytes, and the smooth roofline of its FLOPs (the GEMMs' and the
  LM head's over one 128-row tile: the fitted row tile) and its 15.01 GB of
  bf16 weights (7.505e9 elements read per step: 32 blocks of 218.1M and the
  525.3M head) plus 1.07 GB of KV (8 x 1,025 tokens x 131,072 bytes)."""
  p = json.loads((profile_lib.PROFILE_DIR / "h100.json").read_text())
  costs = cost_lib.model_costs(LLAMA_8B, "bfloat16")
  model = cal_lib.resolve(cal_lib.load("profile:h100"), costs, say=lambda _: None)
  assert model.combine == "roofline" and not model.meta.get("uncalibrated")
  eff, ops = p["efficiency"], p["operators"]
  stats = [0, 8, 8, 0, 8 * 1025, 8 * 1025]
  f = cost_lib.step_features(stats, 16, costs)
  memory_ms = (costs.weight_bytes_per_step + 8 * 1025 * costs.kv_bytes_per_token) / (
      3350e9 * eff["memory"]) * 1000
  tile = ops["gemm_row_tile"]
  assert tile == 128
  compute_ms = (tile * costs.gemm_flops_per_row / eff["gemm"] + tile
                * costs.lm_head_flops_per_row / eff["lm_head"] + 8 * 1025
                * costs.attention_flops_per_pair / eff["attention"]) / 989e12 * 1000
  q = p["roofline_p"]
  fixed = 3.0 + 129 * ops["gemm_op_ms"] + 160 * ops["row_op_ms"]
  rows = 8 * costs.row_bytes_per_row / (ops["row_gbps"] * 1e6)
  want = fixed + rows + (compute_ms ** q + memory_ms ** q) ** (1 / q)
  assert model.predict_ms(f) == pytest.approx(want, rel=1e-9)
  # A 4,096-row prefill chunk is compute-bound (GEMMs at the fitted efficiency).
  pre = cost_lib.step_features([4096, 0, 1, 4096, 4096 * 4097 / 2, 4096], 4096, costs)
  gemm_ms = 4096 * costs.gemm_flops_per_row / (989e12 * eff["gemm"]) * 1000
  assert model.predict_ms(pre) > 3.0 + gemm_ms > 3.0 + memory_ms
  with pytest.raises(ValueError, match="profiles: \\['a100', 'h100', 'h200', 'tpu_v5e'"):
    cal_lib.load("profile:b200")


def test_resolve_refuses_another_model_and_warns_on_another_device(tmp_path):
  tiny = cost_lib.model_costs(get_config("tiny"))
  other = cost_lib.model_costs(LLAMA_8B)
  here = {"id": "aaa", "cpu": "this cpu"}
  lines = []
  one = cost_lib.CostModel.of(step=1.0, meta={"models": [tiny.to_json()], "path": "c.json",
                                               "device": {"id": "aaa"}, "model": "tiny"})
  assert cal_lib.resolve(one, tiny, fingerprint=here, say=lines.append) is one
  assert lines == []
  with pytest.raises(ValueError, match="fitted on one model only \\(tiny"):
    cal_lib.resolve(one, other, fingerprint=here, say=lines.append)
  two = cost_lib.CostModel.of(step=1.0, meta={"models": [tiny.to_json(), {"x": 1}],
                                               "device": {"id": "bbb", "cpu": "that cpu"}})
  cal_lib.resolve(two, other, fingerprint=here, say=lines.append)
  assert len(lines) == 2 and "predicting this one from its cost features" in lines[0]
  assert lines[1] == ("cost model: the cost model was calibrated on another device than "
                      "this one: another CPU model (that cpu vs this cpu) (id bbb vs aaa): "
                      "its times may not hold here")
  lines.clear()
  cal_lib.resolve(cal_lib.load("profile:tpu_v5e"), other, fingerprint=here,
                  say=lines.append)
  assert lines == ["cost model: accelerator profile 'tpu_v5e' is uncalibrated "
                   "(published peaks x stated efficiencies)"]


def test_a_calibration_without_the_row_class_features_reads_them_as_zero(tmp_path):
  seven = {f: float(i + 1) for i, f in enumerate(cost_lib.FEATURES)
           if f not in cost_lib.ADDED_FEATURES}
  path = tmp_path / "seven.json"
  path.write_text(json.dumps({"coef_ms": seven, "combine": "sum"}))
  model = cal_lib.load(path)
  assert dict(zip(cost_lib.FEATURES, model.coef_ms)) == {
      **seven, **{f: 0.0 for f in cost_lib.ADDED_FEATURES}}
  del seven["rows"]
  path.write_text(json.dumps({"coef_ms": seven}))
  with pytest.raises(ValueError, match="missing \\['rows'"):
    cal_lib.load(path)


def test_old_form_and_bad_models_are_refused(tmp_path):
  old = tmp_path / "old.json"
  old.write_text('{"intercept_ms": 5, "coef_ms": {"prefill_rows": 1, "decode_rows": 1, '
                 '"kv_tokens_read": 0, "bucket": 1}}')
  with pytest.raises(ValueError, match="missing \\['step', 'rows'"):
    cal_lib.load(old)
  with pytest.raises(ValueError, match="must all be >= 0"):
    cost_lib.CostModel.of(step=-1.0)
  with pytest.raises(ValueError, match="unknown feature"):
    cost_lib.CostModel.of(bucket=1.0)
  with pytest.raises(ValueError, match="combine must be one of"):
    cost_lib.CostModel.of(combine="max")


def test_device_fingerprint_is_stable():
  a, b = cal_lib.device_fingerprint(), cal_lib.device_fingerprint()
  assert a == b and a["backend"] == "cpu" and len(a["id"]) == 12
  # The flag list is stored but kept out of the id (older calibrations,
  # made without it, keep matching their machine).
  assert a["flags"] == sorted(a["flags"])
  rest = {k: v for k, v in a.items() if k not in ("id", "flags")}
  assert a["id"] == hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:12]


def _fingerprint(**fields):
  """A CPU fingerprint as device_fingerprint makes one (its id over the
  fields but ``flags``)."""
  fp = {**dict(backend="cpu", kind="cpu", count=1, cpu="AMD EPYC", cpus=2), **fields}
  flags = fp.pop("flags", None)
  fp.setdefault("flags_sha", hashlib.sha256(" ".join(flags or []).encode()).hexdigest()[:12])
  fp["id"] = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
  return fp if flags is None else dict(fp, flags=flags)


def test_the_another_device_warning_names_what_differs():
  base = ["avx", "avx2", "fma", "sse4_2"]
  made = _fingerprint(flags=base + ["avx512f"])          # a calibration with the list
  old = {k: v for k, v in made.items() if k != "flags"}  # one made before it was stored
  assert cal_lib.device_difference(made, made) == ""
  assert cal_lib.device_difference(old, _fingerprint(flags=base)) == (
      "same CPU model (AMD EPYC, 2 CPUs) but other CPU feature flags")
  assert cal_lib.device_difference(made, _fingerprint(flags=base + ["amx_tile"])) == (
      "same CPU model (AMD EPYC, 2 CPUs) but other CPU feature flags (this one lacks "
      "avx512f; has amx_tile)")
  many = _fingerprint(flags=["avx", "amx_bf16", "amx_int8", "amx_tile", "gfni", "vaes"])
  assert cal_lib.device_difference(made, many) == (
      "same CPU model (AMD EPYC, 2 CPUs) but other CPU feature flags (this one lacks "
      "avx2, avx512f, fma, sse4_2; has amx_bf16; 4 more)")
  assert cal_lib.device_difference(made, _fingerprint(flags=base, cpus=4)) == (
      "same CPU model (AMD EPYC) but another CPU count (2 vs 4) and other CPU feature "
      "flags (this one lacks avx512f)")
  assert cal_lib.device_difference(made, _fingerprint(flags=base + ["avx512f"],
                                                      cpu="Intel Xeon")) == (
      "another CPU model (AMD EPYC vs Intel Xeon)")
  gpu = {"backend": "gpu", "kind": "NVIDIA H200", "count": 1, "id": "g1"}
  assert cal_lib.device_difference(made, gpu) == "another kind of device (cpu vs NVIDIA H200)"
  assert cal_lib.device_difference(dict(gpu, count=8), gpu) == (
      "same kind of device (NVIDIA H200) but another device count (8 vs 1)")
  # resolve's warning: one line with the difference and both ids.
  tiny = cost_lib.model_costs(get_config("tiny"))
  lines = []
  model = cost_lib.CostModel.of(step=1.0, meta={"path": "cost_model_cpu.json",
                                                 "device": old, "models": []})
  here = _fingerprint(flags=base)
  cal_lib.resolve(model, tiny, fingerprint=here, say=lines.append)
  assert lines == [f"cost model: cost_model_cpu.json was calibrated on another device than "
                   f"this one: same CPU model (AMD EPYC, 2 CPUs) but other CPU feature flags "
                   f"(id {old['id']} vs {here['id']}): its times may not hold here"]


def test_calibrate_refuses_a_busy_machine(tmp_path):
  """scripts/calibrate.py stops before measuring when the load average (here
  faked at 9.0) is above --max_load, exit status 2, one line."""
  import subprocess
  import sys
  from pathlib import Path
  root = Path(__file__).resolve().parents[2]
  model = tmp_path / "m.gguf"                   # a model path; refused before it is read
  model.write_bytes(b"")
  busy = ("import os, runpy, sys; os.getloadavg = lambda: (9.0, 9.0, 9.0); "
          "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
  proc = subprocess.run([sys.executable, "-c", busy, str(root / "scripts" / "calibrate.py"),
                         f"--model={model}", "--engine=tiny", "--prompt_lens=8",
                         "--batch_sizes=1", "--max_load=1.5", "--cache_dir=",
                         f"--holdout_out={tmp_path / 'holdout.json'}"],
                        cwd=root, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: machine busy before measuring: 1-minute load average 9.00 > --max_load=1.5 "
      "(stop other jobs; a calibration taken beside them is wrong)")
