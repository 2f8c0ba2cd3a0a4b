"""``serve.py`` with engine actors, as a user runs it: a local Ray started
by the launcher, a prefill and a decode engine (a two-layer random model on
the tiny engine preset), one streamed completion, then SIGINT: the launcher
exits 0 and Ray goes with it (extended: two engine processes start)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.engine_testing import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "random:smollm2-135m,n_layers=2"


@pytest.mark.extended
def test_serve_py_prefill_decode_actors_stream_and_stop_on_sigint(tmp_path):
  port = free_port()
  log = open(tmp_path / "serve.log", "w")
  process = subprocess.Popen(
      [sys.executable, str(ROOT / "scripts" / "serve.py"), f"--port={port}",
       f"--model={MODEL}", "--engine=tiny", "--prefill_replicas=1", "--decode_replicas=1",
       "--replica_cpus=0"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
      env=dict(os.environ, PYTHONPATH=str(ROOT)))
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.monotonic() + 300
    while True:
      assert process.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
      assert time.monotonic() < deadline, "the front did not answer in time"
      try:
        if httpx.get(f"{url}/health", timeout=2).status_code == 200:
          break
      except httpx.HTTPError:
        pass
      time.sleep(0.5)
    body = dict(model=MODEL, prompt="hello there my friend", max_tokens=5, temperature=0,
                ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
      events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    (record,) = httpx.get(f"{url}/router", timeout=30).json()["requests"]
    assert (record["replica"], record["decode_replica"], record["outcome"]) == (
        0, 0, "completed")
    assert [d["pool"] for d in record["decisions"]] == ["prefill", "decode"]
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 0
  finally:
    if process.poll() is None:
      process.kill()
      process.wait(timeout=30)
