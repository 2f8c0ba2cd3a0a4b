"""HF checkpoint directories and the orbax converted-params cache."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import perturbed_params
from gguf_testing import bpe_vocab, gguf_tensors, write_gguf, write_hf_dir
from models import loaders
from models.loaders import ModelLoadError
from models.tokenizer import build_bpe_tokenizer


@pytest.fixture(scope="module")
def model(tiny_cfg):
  cfg = dataclasses.replace(tiny_cfg, vocab_size=len(bpe_vocab()[0]), eos_token_ids=(2,),
                            tie_embeddings=False, name="hf-tiny")
  return cfg, perturbed_params(cfg, seed=7)


def assert_same_params(got, want):
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  want_leaves = dict(jax.tree_util.tree_leaves_with_path(want))
  assert len(got_leaves) == len(want_leaves)
  for path, value in got_leaves:
    np.testing.assert_array_equal(np.asarray(value, np.float32),
                                  np.asarray(want_leaves[path], np.float32), err_msg=str(path))


def test_hf_directory_loads(tmp_path, model):
  cfg, params = model
  backend = build_bpe_tokenizer(*bpe_vocab(), pre="smollm")
  directory = write_hf_dir(tmp_path / "hf-tiny", cfg, params, backend)
  got_cfg, got, tok = loaders.load_model(directory)
  assert got_cfg == cfg
  assert_same_params(got, params)
  assert tok.eos_token_id == 2 and tok.bos_token_id is None
  assert tok.apply_chat_template([{"role": "user", "content": "x"}]).endswith("assistant\n")
  assert tok.encode(" the") == [backend.token_to_id("Ġthe")]


def test_hf_directory_errors(tmp_path, model):
  cfg, params = model
  backend = build_bpe_tokenizer(*bpe_vocab())
  directory = write_hf_dir(tmp_path / "d", cfg, params, backend)
  config = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
  with pytest.raises(ModelLoadError, match="config.json: model_type is 'gpt2'"):
    loaders.load_model(directory)
  (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
  with pytest.raises(ModelLoadError, match=r"'model.layers.0.mlp.gate_proj.weight' has "
                                           r"shape \(128, 64\), expected \(96, 64\)"):
    loaders.load_model(directory)
  (directory / "config.json").write_text(json.dumps(config))
  os.remove(directory / "tokenizer.json")
  with pytest.raises(ModelLoadError, match="tokenizer.json: file is missing"):
    loaders.load_model(directory)


def test_cache_restores_without_reading_the_source(tmp_path, model, monkeypatch):
  cfg, params = model
  path = write_gguf(tmp_path / "tiny.gguf", cfg, gguf_tensors(cfg, params))
  cache = tmp_path / "cache"
  first = loaders.load_model(path, cache_dir=cache)
  assert len(list(cache.iterdir())) == 1

  def no_read(*args, **kwargs):
    raise AssertionError("the cached load read the GGUF file")

  monkeypatch.setattr(loaders, "read_gguf", no_read)
  second = loaders.load_model(path, cache_dir=cache)
  assert second[0] == first[0] == dataclasses.replace(cfg, name="tiny")
  assert_same_params(second[1], first[1])
  assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(second[1]))
  text = "<|im_start|>the 42<|im_end|>"
  assert second[2].encode(text) == first[2].encode(text)
  assert second[2].chat_template == first[2].chat_template
  # bf16 is its own entry; a changed source file is a new key.
  monkeypatch.undo()
  cfg16, params16, _ = loaders.load_model(path, dtype=jnp.bfloat16, cache_dir=cache)
  assert params16["embed"]["embedding"].dtype == jnp.bfloat16
  stat = path.stat()
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  loaders.load_model(path, cache_dir=cache)
  assert len(list(cache.iterdir())) == 3


def test_gguf_load_and_cache_restore_place_params_in_their_mesh_shardings(tmp_path, model):
  from models import sharding  # pylint: disable=import-outside-toplevel
  cfg, params = model
  path = write_gguf(tmp_path / "tiny.gguf", cfg, gguf_tensors(cfg, params))
  mesh = sharding.make_mesh("model:1")
  want = sharding.param_specs(params, cfg, 1)
  for _ in range(2):      # converted from the GGUF, then restored by orbax
    _, got, _ = loaders.load_model(path, cache_dir=tmp_path / "cache", mesh=mesh)
    specs = jax.tree_util.tree_map(lambda x: x.sharding.spec, got)
    assert specs == want and specs["lm_head"] == jax.sharding.PartitionSpec(None, "model")
    assert all(x.sharding.mesh == mesh for x in jax.tree_util.tree_leaves(got))
    assert_same_params(got, params)
