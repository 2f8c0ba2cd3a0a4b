"""A replay whose KV cache is too small for every request completes (exit
status 0: rejection is an outcome) and says why after its table, in the
words of the report's records, one line per reason with its count."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = "--model=random:smollm2-135m,d_model=64,n_heads=4,n_kv_heads=2,ffn_dim=128,n_layers=2"


def test_a_replay_that_rejects_every_request_says_why_and_how_many(tmp_path):
  """The tiny preset's 4-row pages; --num_pages=4 leaves 3 past the null
  page. Prompt + output - 1 KV rows: 20 + 4 - 1 = 23 (6 pages), 12 + 6 - 1
  = 17 (5 pages), 30 + 3 - 1 = 32 (8 pages): none fits; 9 pages would hold
  them all."""
  trace = tmp_path / "trace.csv"
  trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:10.0000000,20,4\n2023-11-16 18:15:11.0000000,12,6\n"
                   "2023-11-16 18:15:11.5000000,30,3\n")
  out = tmp_path / "replay.json"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "replay.py"), "--engine=tiny", MODEL,
       "--executor=simulated", "--num_pages=4", f"--trace=azure:{trace}", "--cache_dir=",
       f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  report = json.loads(out.read_text())
  why = ("KV rows (prompt + max_tokens - 1); the cache has 3 (num_pages 4 less page 0, the "
         "null page): raise num_pages (--num_pages) to at least")
  assert [(r["outcome"], r["finish_reason"]) for r in report["requests"]] == [
      ("rejected", f"needs 6 KV pages for 23 {why} 7"),
      ("rejected", f"needs 5 KV pages for 17 {why} 6"),
      ("rejected", f"needs 8 KV pages for 32 {why} 9")]
  lines = proc.stdout.splitlines()
  said = [line for line in lines if line.startswith("rejected ")]
  assert said == [f"rejected 3 of 3 (every request was rejected): needs 5 to 8 KV pages for "
                  f"17 to 32 {why} 9"], proc.stdout[-3000:]
  table_end = max(i for i, line in enumerate(lines) if line == "=" * 50)
  assert lines.index(said[0]) > table_end     # after the table
