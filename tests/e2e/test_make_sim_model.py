"""scripts/make_sim_model.py: the directories it writes load through
``models.loaders.load_config`` with the published shapes, and the stand-in
tokenizer has the model's vocabulary and special ids."""

import subprocess
import sys
from pathlib import Path

import pytest

from models.loaders import load_config
from serving.engine import cost_model as cost_lib

ROOT = Path(__file__).resolve().parents[2]


def _make(preset, out):
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "make_sim_model.py"),
                         f"--preset={preset}", f"--out={out}"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)


# Published parameter counts: Mistral 7B's release (7,241,732,096) and
# Llama-3.1-8B's safetensors index (8,030,261,248), independent of the
# shapes typed into the script.
@pytest.mark.parametrize("preset,family,vocab,params,window,bos,eos", [
    ("mistral-7b-v0.1", "mistral", 32000, 7_241_732_096, 4096, 1, 2),
    ("mistral-7b-instruct-v0.2", "mistral", 32000, 7_241_732_096, 0, 1, 2),
    ("llama-3.1-8b", "llama", 128256, 8_030_261_248, 0, 128000, 128001),
])
def test_written_directory_loads_with_the_published_shape(tmp_path, preset, family, vocab,
                                                          params, window, bos, eos):
  proc = _make(preset, tmp_path / preset)
  assert proc.returncode == 0, proc.stderr[-2000:]
  cfg, tok = load_config(tmp_path / preset)
  assert (cfg.family, cfg.vocab_size, cfg.d_model, cfg.n_layers) == (family, vocab, 4096, 32)
  assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == (32, 8, 128, 14336)
  assert [cfg.layer_window(i) for i in range(32)] == [window] * 32
  assert (cfg.bos_token_id, cfg.eos_token_ids) == (bos, (eos,))
  costs = cost_lib.model_costs(cfg, "bfloat16")
  assert costs.weight_bytes == 2 * params
  assert costs.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2        # 128 KiB per token
  assert tok.vocab_size == vocab
  text = "héllo, world"
  ids = tok.encode(text)
  assert ids[0] == bos and len(ids) == 1 + len(text.encode())  # BOS, then one id per byte
  assert max(ids) < vocab and tok.decode(ids, skip_special_tokens=True) == text
  assert tok.backend.id_to_token(eos) == ("</s>" if family == "mistral" else
                                          "<|end_of_text|>")


def test_unknown_preset_is_refused_in_one_line(tmp_path):
  proc = _make("gpt-5", tmp_path / "m")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1].startswith(
      "error: flag --preset=gpt-5: value should be one of"), proc.stderr
  assert not (tmp_path / "m").exists()


def test_llama_2_13b_has_the_published_shape(tmp_path):
  # Llama-2-13b-hf's safetensors index: total_size 26,031,728,640 bytes in
  # float16 = 13,015,864,320 parameters.
  proc = _make("llama-2-13b", tmp_path / "m")
  assert proc.returncode == 0, proc.stderr[-2000:]
  cfg, tok = load_config(tmp_path / "m")
  assert (cfg.family, cfg.vocab_size, cfg.d_model, cfg.n_layers) == ("llama", 32000, 5120, 40)
  assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == (40, 40, 128, 13824)
  costs = cost_lib.model_costs(cfg, "bfloat16")
  assert costs.weight_bytes == 26_031_728_640
  assert costs.kv_bytes_per_token == 40 * 2 * 40 * 128 * 2      # 800 KiB per token
  assert tok.encode("a")[0] == 1 and tok.backend.id_to_token(2) == "</s>"
