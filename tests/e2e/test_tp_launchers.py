"""Tensor parallelism through the launchers: ``scripts/replay.py``,
``scripts/serve.py`` and ``scripts/tp_equality.py`` with ``--mesh=model:M``
on a saved checkpoint directory, tokens equal to one device.

Each launcher runs in a subprocess with XLA's fake host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``, set before jax
starts), through the path a user takes: ``--model=DIR`` loads the HF
directory straight into its shardings, the engine stores the per-layer
weights (``models.llama.split_layers``), and ``launch.warmup`` builds
scratch engines from those stored params (which is where a rule that did not
cover a per-layer tuple element stopped with "has no sharding rule").

The family checkpoints (``tests/models/families.py``: transformers' random
models saved with ``save_pretrained``) run through ``tp_equality.py``, which
builds its engines the same way (load into the mesh, engine, warmup) and
also compares the logits; they are ``slow`` (a step program per mesh,
about 30 s each on 2 cores).
"""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "models"))

from gguf_testing import bpe_vocab, write_hf_dir  # pylint: disable=wrong-import-position
from models import llama  # pylint: disable=wrong-import-position
from models.config import get_config  # pylint: disable=wrong-import-position
from models.tokenizer import build_bpe_tokenizer  # pylint: disable=wrong-import-position
from tests.e2e.launcher_testing import (  # pylint: disable=wrong-import-position
    family_checkpoints, post_json, serving)

MESHES = ("", "model:2", "model:4")
# The tiny model (2 KV heads: attention split at model:2, replicated at
# model:4) with an MLP and a padded vocabulary that 2 and 4 divide, so both
# meshes split the MLP and the vocabulary.
VOCAB = 352           # the BPE vocabulary (351 tokens) padded to a multiple of 4


def _env(num_devices: int = 4) -> dict:
  return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}")


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
  """A saved random Llama checkpoint directory (layer_scale 8: the next
  token depends on the whole context)."""
  assert len(bpe_vocab()[0]) <= VOCAB
  cfg = dataclasses.replace(get_config("tiny"), vocab_size=VOCAB, ffn_dim=192,
                            eos_token_ids=(2,), tie_embeddings=False, name="hf-tiny")
  params = llama.init_params(cfg, jax.random.PRNGKey(1), layer_scale=8)
  backend = build_bpe_tokenizer(*bpe_vocab(), pre="smollm")
  return write_hf_dir(tmp_path_factory.mktemp("tp") / "hf-tiny", cfg, params, backend)


def _replay(model_dir: Path, mesh: str, out: Path, *extra: str) -> dict:
  """``scripts/replay.py`` on ``model_dir`` under ``mesh`` ("" = one device):
  {request id: output token ids}."""
  args = [sys.executable, str(ROOT / "scripts" / "replay.py"), f"--model={model_dir}",
          "--engine=tiny", "--num_requests=5", "--rate_scale=4.0", "--max_prompt_len=24",
          "--max_output_len=6", "--cache_dir=", f"--out={out}", *extra]
  if mesh:
    args.append(f"--mesh={mesh}")
  proc = subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, f"--mesh={mesh}: " + proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["completed"] == 5 and report["config"]["mesh"] == mesh, report["config"]
  return {r["request_id"]: r["output_token_ids"] for r in report["requests"]}


# ~2 min on 2 cores; tests/models/test_sharding.py checks the mesh engine by default.
@pytest.mark.extended
def test_replay_on_a_mesh_emits_the_one_device_tokens(hf_tiny, tmp_path):
  """model:2 (attention, MLP, vocabulary split) and model:4 (attention
  replicated: 2 KV heads) against one device, greedy, through replay.py."""
  tokens = {mesh: _replay(hf_tiny, mesh, tmp_path / f"r{i}.json")
            for i, mesh in enumerate(MESHES)}
  assert len(tokens[""]) == 5 and all(tokens[""].values())
  for mesh in MESHES[1:]:
    assert tokens[mesh] == tokens[""], mesh


def _serve_completions(model_dir: Path, mesh: str, prompts, log: Path) -> list:
  """``scripts/serve.py`` under ``mesh`` (its output in ``log``): the greedy
  completion of each prompt (token ids) as text, over HTTP."""
  args = [f"--model={model_dir}", "--engine=tiny", "--cache_dir=", "--served_model_name=tiny"]
  if mesh:
    args.append(f"--mesh={mesh}")
  texts = []
  with serving(args, log, ready_timeout_s=240, env=_env()) as port:
    for prompt in prompts:
      answer = post_json(port, "/v1/completions",
                         {"model": "tiny", "prompt": prompt, "max_tokens": 6,
                          "temperature": 0, "ignore_eos": True}, timeout_s=60)
      assert answer["usage"]["completion_tokens"] == 6, answer
      texts.append(answer["choices"][0]["text"])
  return texts


@pytest.mark.extended
def test_serve_on_a_mesh_answers_with_the_one_device_completions(hf_tiny, tmp_path):
  """serve.py (warmup on, as by default) under model:2 and model:4: the
  greedy completions over HTTP equal one device's."""
  prompts = [[5, 40, 77, 300, 12, 9], list(range(20, 37))]
  texts = {mesh: _serve_completions(hf_tiny, mesh, prompts, tmp_path / f"serve{i}.log")
           for i, mesh in enumerate(MESHES)}
  assert all(texts[""])
  for mesh in MESHES[1:]:
    assert texts[mesh] == texts[""], mesh


# --------------------------------------------------------------------------
# Every family (tests/models/families.py), slow.

_HAS_REFERENCE = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
_FAMILY_PROMPTS = ("--prompt=The scheduler admits requests in order",
                   "--prompt=Tensor parallel")


# The families.FAMILIES variants with ``engine=True`` (named here so that
# collecting this file imports no torch; ``family_checkpoints`` checks the list).
ENGINE_FAMILIES = ("llama3.1", "llama3.2", "qwen2.5", "qwen3", "mistral", "gemma2", "gemma3",
                   "phi3", "mixtral", "qwen3-moe")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
  """name -> a saved random checkpoint of that family (float32), written on
  first use (``families.build_checkpoint``)."""
  return family_checkpoints(tmp_path_factory.mktemp("families"), ENGINE_FAMILIES)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.skipif(not _HAS_REFERENCE, reason="needs the reference extra (torch, "
                    "transformers) to write the family checkpoints")
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_family_on_model_2_and_4_matches_one_device(family, family_dirs, tmp_path):
  """One device, model:2 (attention, MLP or experts, vocabulary split: 2 KV
  heads) and model:4 (attention replicated) through tp_equality.py: greedy
  tokens equal, logits within 1e-4 (partial sums re-associated) and no
  emitted position a near-tie they could flip, no program compiled past its
  bound."""
  out = tmp_path / "rows.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "tp_equality.py"),
       f"--model={family_dirs(family)}", "--engine=tiny", "--tps=2,4", "--devices=4",
       "--max_tokens=4", "--cache_dir=", f"--out={out}", *_FAMILY_PROMPTS],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert [r["mesh"] for r in rows] == ["one device", "model:2", "model:4"]
  assert rows[1]["split"]["attention"] and not rows[2]["split"]["attention"]
  for r in rows[1:]:
    assert r["tokens_equal"] and r["compile_bound_ok"], r
    assert all(r["split"].values()) or r is rows[2], r
    assert r["max_abs_logit_diff"] < 1e-4, r
    assert rows[0]["min_margin"] > 2 * r["max_abs_logit_diff"], r


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.skipif(not _HAS_REFERENCE, reason="needs the reference extra (torch, "
                    "transformers) to write the family checkpoints")
def test_moe_replay_on_model_4_emits_the_one_device_tokens(family_dirs, tmp_path):
  """The experts split over 4 devices (Megatron within each expert) through
  replay.py: a mixed batch's tokens equal one device's."""
  model = family_dirs("qwen3-moe")
  one = _replay(model, "", tmp_path / "one.json")
  assert _replay(model, "model:4", tmp_path / "four.json") == one
