"""Runs one launcher's refusal cases in one process: imports
``scripts/<name>`` once (JAX and the engine's modules with it), then for
each request read from stdin forks a child that runs the launcher's main
through ``cli.run`` as ``python scripts/<name> ARGS`` would, and writes
back its exit status, stdout and stderr.

The import is what costs a launcher subprocess its seconds; the parent
never starts a JAX backend, so a child may. Protocol, one JSON object per
line: request ``{"args": [...], "env": {...} or null}``, response
``{"status": int, "stdout": str, "stderr": str}``.

  python tests/e2e/refusal_server.py generate.py
"""

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _child(module, script: str, args, env) -> None:
  """The forked child: the launcher's ``__main__`` block; never returns."""
  if env is not None:
    os.environ.clear()
    os.environ.update(env)
  sys.argv = [str(ROOT / "scripts" / script), *args]
  status = 0
  try:
    from serving import cli    # pylint: disable=import-outside-toplevel
    cli.run(module.main)
  except SystemExit as e:
    status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:      # a traceback, as the interpreter would print it
    import traceback          # pylint: disable=import-outside-toplevel
    traceback.print_exc()
    status = 1
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


def main() -> None:
  script = sys.argv[1]
  sys.path.insert(0, str(ROOT))
  os.chdir(ROOT)
  spec = importlib.util.spec_from_file_location(f"launcher_{Path(script).stem}",
                                                ROOT / "scripts" / script)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  reply = sys.stdout
  for line in sys.stdin:
    request = json.loads(line)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
      reply.flush()
      pid = os.fork()
      if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        _child(module, script, request["args"], request.get("env"))
      _, code = os.waitpid(pid, 0)
      out.seek(0)
      err.seek(0)
      reply.write(json.dumps({"status": os.waitstatus_to_exitcode(code),
                              "stdout": out.read(), "stderr": err.read()}) + "\n")
      reply.flush()


if __name__ == "__main__":
  main()
