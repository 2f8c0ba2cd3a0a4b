"""Shared pieces of the launcher tests: the family checkpoints written on
first use, ``scripts/serve.py`` in a subprocess on a free port, and JSON
over HTTP to it."""

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from tests.serving.engine_testing import free_port

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "models"))


def family_checkpoints(root: Path, variants: Sequence[str]) -> Callable[[str], Path]:
  """variant -> its saved random float32 checkpoint under ``root``
  (``families.build_checkpoint``), written when first asked for and kept;
  each pre-tokenizer's BPE is trained once.

  Args:
    root: an empty directory; each checkpoint goes to ``root / variant``.
    variants: the caller's list of the ``families.FAMILIES`` variants with
      ``engine=True`` (written out so that collecting a test file imports
      no torch); checked here against that table.

  Needs torch and transformers (the ``reference`` extra).
  """
  import families  # pylint: disable=import-outside-toplevel
  assert tuple(variants) == tuple(n for n, f in families.FAMILIES.items() if f.engine)
  trained, built = {}, {}

  def tokenizer(kind):
    if kind not in trained:
      trained[kind] = families.train_tokenizer(kind)
    return trained[kind]

  def get(name):
    if name not in built:
      built[name] = families.build_checkpoint(families.FAMILIES[name], root / name, tokenizer)
    return built[name]
  return get


def get_json(port: int, path: str, timeout_s: float = 90.0) -> dict:
  """GET ``http://127.0.0.1:{port}{path}``, the answer's JSON."""
  with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as resp:
    return json.loads(resp.read())


def post_json(port: int, path: str, body: dict, timeout_s: float = 90.0) -> dict:
  """POST ``body`` as JSON to ``http://127.0.0.1:{port}{path}``, the
  answer's JSON (an HTTP error status raises ``urllib.error.HTTPError``)."""
  req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                               data=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(req, timeout=timeout_s) as resp:
    return json.loads(resp.read())


@contextlib.contextmanager
def serving(args: Sequence[str], log: Path, *, ready_timeout_s: float = 90.0,
            env: Optional[dict] = None) -> Iterator[int]:
  """``scripts/serve.py`` with ``args`` and ``--port`` of a free port, its
  stdout and stderr in ``log``; yields the port once ``/health`` answers
  200.

  On exit the server gets SIGTERM, and SIGKILL if it is still running 20 s
  later. Fails the test (with the log's tail) when the server exits before
  it is ready, or is not ready within ``ready_timeout_s`` seconds.

  Args:
    args: serve.py's flags, without ``--port``.
    log: file for the server's output (replaced).
    ready_timeout_s: seconds to wait for ``/health``.
    env: the server's environment (None: this process's).
  """
  port = free_port()
  with open(log, "w") as out:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "serve.py"), *args, f"--port={port}"],
        cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + ready_timeout_s
    while True:
      assert proc.poll() is None, log.read_text()[-3000:]
      try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
          resp.read()
        break
      except OSError:
        assert time.monotonic() < deadline, (
            f"serve.py not ready in {ready_timeout_s:g} s: " + log.read_text()[-3000:])
        time.sleep(0.3)
    yield port
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
