"""The import rule: which package may import which (every import, module
level or inside a function, read from the source with ``ast``).

* ``models/`` and ``attention/`` (the model and its kernels) import nothing
  from ``scheduler/`` or ``serving/``.
* ``scheduler/`` (policies, plans, validation) imports nothing from
  ``serving/``, except the conformance kit, which drives the engine.
* The engine core (``serving/engine/`` and ``serving/kv/``: the engine,
  its config, executors, packing, sampling and virtual-clock cost model, the
  KV cache's pages, swap and prefix cache) imports only the core: never the
  HTTP front (``serving/http/``), the research harness
  (``serving/harness/``) or the CLI (``serving/cli/``).
* Every module under ``serving/`` lives in one of those five subpackages.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ("engine", "kv")
SUBPACKAGES = {"engine", "kv", "http", "harness", "cli"}
SCHEDULER_MAY_DRIVE_THE_ENGINE = {"conformance"}


def imports(path: Path) -> set:
  """Dotted names ``path`` imports (``from a import b`` gives ``a`` and ``a.b``)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      out.add(node.module)
      out.update(f"{node.module}.{a.name}" for a in node.names)
  return out


def _modules(package: str):
  return sorted((ROOT / package).glob("*.py"))


def test_models_and_attention_import_no_scheduler_or_serving():
  bad = [(p.relative_to(ROOT), name) for package in ("models", "attention")
         for p in _modules(package) for name in imports(p)
         if name.split(".")[0] in ("scheduler", "serving")]
  assert bad == []


def test_scheduler_imports_no_serving():
  bad = [(p.relative_to(ROOT), name) for p in _modules("scheduler")
         if p.stem not in SCHEDULER_MAY_DRIVE_THE_ENGINE
         for name in imports(p) if name.split(".")[0] == "serving"]
  assert bad == []


def test_engine_core_imports_only_the_core():
  core = [p for package in CORE for p in _modules(f"serving/{package}")]
  assert len(core) >= 10, core
  bad = [(p.relative_to(ROOT), name) for p in core for name in imports(p)
         if name.split(".")[0] == "serving" and len(name.split(".")) > 1
         and name.split(".")[1] not in CORE]
  assert bad == []


def test_every_serving_module_lives_in_a_subpackage():
  loose = sorted(p.name for p in _modules("serving") if p.name != "__init__.py")
  assert loose == []
  packages = {p.name for p in (ROOT / "serving").iterdir()
              if p.is_dir() and (p / "__init__.py").exists()}
  assert packages == SUBPACKAGES


def test_the_rule_catches_a_violation(tmp_path):
  """The checker sees an import inside a function too."""
  src = tmp_path / "x.py"
  src.write_text("def f():\n  from serving.http import server\n  import serving.harness.replay\n")
  assert {"serving.http", "serving.http.server", "serving.harness.replay"} <= imports(src)


LONG_FILE_LINES = 650


def test_a_long_module_states_why_it_is_one_file():
  """No module above ~600 lines without a reason: its docstring says
  "One file:" and why."""
  roots = [ROOT / d for d in ("models", "attention", "scheduler", "serving")]
  long = [p for root in roots for p in sorted(root.rglob("*.py"))
          if len(p.read_text().splitlines()) > LONG_FILE_LINES
          and "One file:" not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
  assert [str(p.relative_to(ROOT)) for p in long] == []
