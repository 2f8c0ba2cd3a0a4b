"""The launchers on saved random checkpoints of the model families, as a
user runs them: ``scripts/generate.py --model=DIR`` and ``scripts/serve.py
--model=DIR`` (then ``/v1/models``, a completion and a chat completion over
HTTP), and a simulated ``scripts/replay.py`` that reads the config alone.

The checkpoints are transformers' own (``tests/models/families.py``: random
weights saved with ``save_pretrained``, a BPE tokenizer trained on the
repository's text, a chat template), one for each family the engine runs.
The launchers' greedy text must equal transformers' ``generate`` on the same
directory, through each launcher's own path (tokenizer, BOS, chat template,
EOS ids). The default profile runs one of them: a dense family with Llama
3.1's RoPE, BOS and three EOS ids (the engine's greedy tokens of every
family, Qwen3-MoE included, are checked against transformers by
tests/models/test_families.py); the other nine are ``extended``. A checkpoint is written
when a test first asks for it. Each test runs in well under a minute on 2
cores (one 16-row bucket, ``--engine=tiny``).
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "models"))

from attention import native  # pylint: disable=wrong-import-position
from tests.e2e.launcher_testing import (  # pylint: disable=wrong-import-position
    family_checkpoints, get_json, post_json, serving)

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers")),
    reason="needs the reference extra (torch, transformers) to write the checkpoints")

# family variant (tests/models/families.py, those with ``engine=True``; named
# here so that collecting this file imports no torch) -> its ModelConfig.family
FAMILIES = {"llama3.1": "llama", "llama3.2": "llama", "qwen2.5": "qwen2", "qwen3": "qwen3",
            "mistral": "mistral", "gemma2": "gemma2", "gemma3": "gemma3_text",
            "phi3": "phi3", "mixtral": "mixtral", "qwen3-moe": "qwen3_moe"}
MIXTURES = ("mixtral", "qwen3-moe")
DEFAULT_PROFILE = ("llama3.1",)
VARIANTS = [v if v in DEFAULT_PROFILE else pytest.param(v, marks=pytest.mark.extended)
            for v in FAMILIES]
PROMPT = "The scheduler admits requests"
CHAT = "Which request runs first?"
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """variant -> a saved random float32 checkpoint directory, written on
  first use (``families.build_checkpoint``) and kept for the module."""
  return family_checkpoints(tmp_path_factory.mktemp("family-launchers"), FAMILIES)


def _hf_text(directory: Path, text: str, *, chat: bool, stop: bool) -> str:
  """transformers' greedy continuation of ``text`` (``MAX_TOKENS`` tokens;
  with ``stop``, ended by generation_config.json's EOS ids), decoded
  without special tokens."""
  import families  # pylint: disable=import-outside-toplevel
  model, tokenizer = families.hf_model(directory), families.hf_tokenizer(directory)
  if chat:     # the template's text, tokenized without adding BOS (as transformers does)
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)
  ids = tokenizer(text, add_special_tokens=not chat)["input_ids"]
  eos = model.generation_config.eos_token_id
  out = families.hf_generate(model, ids, MAX_TOKENS,
                             stop_ids=tuple(eos if isinstance(eos, list) else [eos])
                             if stop else None)
  return tokenizer.decode(out, skip_special_tokens=True)


def _loaded_line(stdout: str) -> str:
  return next(line for line in stdout.splitlines() if line.startswith("model: "))


@pytest.mark.parametrize("variant", VARIANTS)
def test_generate_streams_transformers_greedy_text(variant, checkpoints, tmp_path):
  """generate.py --model=DIR: the loaded line names the family; a raw
  prompt and a chat message (the directory's template) in one batch give
  transformers' greedy text."""
  directory = checkpoints(variant)
  proc = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "generate.py"), f"--model={directory}",
       "--engine=tiny", f"--cache_dir={tmp_path / 'cache'}", f"--prompt={PROMPT}",
       f"--chat={CHAT}", f"--max_tokens={MAX_TOKENS}"],
      cwd=ROOT, capture_output=True, timeout=120)
  # Bytes, decoded without newline translation: a random model may well emit
  # "\r", which text mode would read as "\n".
  proc.stdout, proc.stderr = proc.stdout.decode(), proc.stderr.decode()
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = _loaded_line(proc.stdout)
  assert line.startswith(f"model: {variant} ({FAMILIES[variant]}, 2 layers, d_model 64"), line
  assert ("experts (top 2)" in line) == (variant in MIXTURES), line
  if "decode GEMM: native" in line:        # the kernel's vector width beside it
    from models import rowgemm
    assert f"decode GEMM: native ({rowgemm.vector_bits()}-bit vectors)" in line, line
  for rid, text, chat in (("prompt-0", PROMPT, False), ("chat-0", CHAT, True)):
    head, _, answer = proc.stdout.partition(f"\n=== {rid} (completed, ")
    assert answer, proc.stdout[-2000:]
    # Each block is print()ed: the text ends with print's one newline (the
    # text's own trailing newlines are kept: a random model may emit them).
    got = answer.split("\n", 1)[1].split("\n=== ")[0].removesuffix("\n")
    assert got == _hf_text(directory, text, chat=chat, stop=True), rid


@pytest.mark.parametrize("variant", VARIANTS)
def test_serve_lists_the_family_and_answers_as_transformers(variant, checkpoints, tmp_path):
  """serve.py --model=DIR: /v1/models shows the family and both contexts;
  a completion and a chat completion (greedy, ignore_eos) are transformers'
  greedy text."""
  directory, log = checkpoints(variant), tmp_path / "serve.log"
  with serving([f"--model={directory}", "--engine=tiny", f"--cache_dir={tmp_path / 'cache'}",
                "--nowarmup"], log) as port:
    card, = get_json(port, "/v1/models")["data"]
    assert (card["id"], card["family"], card["max_position"], card["max_model_len"],
            card["vocab_size"]) == (str(directory), FAMILIES[variant], 256, 64, 384)
    common = {"model": str(directory), "max_tokens": MAX_TOKENS, "temperature": 0,
              "ignore_eos": True}
    done = post_json(port, "/v1/completions", {**common, "prompt": PROMPT})
    assert done["usage"]["completion_tokens"] == MAX_TOKENS, done
    assert done["choices"][0]["text"] == _hf_text(directory, PROMPT, chat=False, stop=False)
    chat = post_json(port, "/v1/chat/completions",
                     {**common, "messages": [{"role": "user", "content": CHAT}]})
    assert chat["usage"]["completion_tokens"] == MAX_TOKENS, chat
    assert chat["choices"][0]["message"]["content"] == _hf_text(directory, CHAT, chat=True,
                                                                stop=False)
    assert f"model: {variant} ({FAMILIES[variant]}, " in log.read_text()


def test_simulated_replay_reports_the_family_and_its_costs(checkpoints, tmp_path):
  """replay.py --executor=simulated on the MoE checkpoint: the engine holds
  no weights; the report names the family and its ``model_costs`` (which
  come from the config alone, whatever the step-time profile)."""
  out = tmp_path / "report.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "replay.py"),
       f"--model={checkpoints('qwen3-moe')}", "--engine=tiny", "--executor=simulated",
       "--cache_dir=", "--num_requests=4", "--rate_scale=4", "--max_prompt_len=24",
       "--max_output_len=6", "--cost_model=profile:h200", f"--out={out}"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["completed"] == 4
  config = report["config"]
  assert config["family"] == "qwen3_moe"
  costs = config["model_costs"]
  # 2 blocks: attention 64 x (64 + 2 x 32) + 64 x 64 and a router 64 x 4 and
  # two experts 3 x 64 x 64 per row, 2 FLOPs each.
  assert costs["gemm_flops_per_row"] == 2 * 2 * (12288 + 256 + 2 * 12288)
  assert costs["kv_bytes_per_token"] == 2 * 2 * 32 * 4


@pytest.mark.skipif(native.unavailable_reason() is not None,
                    reason="the native attention kernel does not build here")
def test_native_attention_refuses_a_head_dim_it_does_not_take(tmp_path):
  """--attention_impl=native on a Phi-3 of head_dim 24: one line naming the
  flag and the head_dim, exit 2, before anything compiles."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  import families  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  phi3 = families.FAMILIES["phi3"]
  wide = dataclasses.replace(phi3, name="phi3-hd24", config=lambda: transformers.Phi3Config(
      **{**families.COMMON, "hidden_size": 96}, rope_parameters=dict(
          rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)))
  directory = families.build_checkpoint(wide, tmp_path / "phi3-hd24",
                                        lambda pre: families.train_tokenizer(pre))
  proc = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "generate.py"), f"--model={directory}",
       "--engine=tiny", "--cache_dir=", "--prompt=x", "--attention_impl=native"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: --attention_impl=native: the native kernel takes head_dim in (16, 32, 64, "
      "128, 256), model phi3-hd24 has 24 (--attention_impl=auto runs blocked_dot for it)")
