"""Launcher runs for refusal tests, through one refusal server per launcher
(``tests/e2e/refusal_server.py``): the server imports the launcher once and
forks a child per case, so a case costs a fork, not a Python start and the
engine's imports."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_SERVERS = {}


def run(script: str, *args, env=None):
  """``python scripts/<script> ARGS`` with ``env`` (None: this process's):
  ``(exit status, stdout, stderr)``."""
  server = _SERVERS.get(script)
  if server is None or server.poll() is not None:
    server = _SERVERS[script] = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "e2e" / "refusal_server.py"), script], cwd=ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  server.stdin.write(json.dumps({"args": [str(a) for a in args], "env": env}) + "\n")
  server.stdin.flush()
  reply = json.loads(server.stdout.readline())
  return reply["status"], reply["stdout"], reply["stderr"]


def refused(script: str, *args, env=None):
  """``run``'s exit status and last stderr line, after checking that the
  launcher printed no traceback and loaded no model."""
  status, stdout, stderr = run(script, *args, env=env)
  assert "Traceback" not in stderr, stderr[-3000:]
  assert "model:" not in stdout                 # refused before a model loaded
  return status, stderr.strip().splitlines()[-1]


def stop_servers() -> None:
  for server in _SERVERS.values():
    server.stdin.close()
    server.wait(timeout=60)
  _SERVERS.clear()
