"""The import rule: which package may import which (every import, module
level or inside a function, read from the source with ``ast``).

* ``models/`` and ``attention/`` (the model and its kernels) import nothing
  from ``scheduler/`` or ``serving/``.
* ``scheduler/`` (policies, plans, validation) imports nothing from
  ``serving/``, except the conformance kit, which drives the engine.
* The engine core in ``serving/`` (``CORE``: the engine, its step program's
  executors, the KV cache's pages, swap and prefix cache, sampling, packing,
  the config and the cost model of its virtual clock) imports only the core:
  never the HTTP front (server, replicas, router), the research harness
  (workloads, replay, metrics, ledger, ablation, cluster_sim) or the CLI
  (launch, cli).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = {"config", "cost_model", "engine", "executor", "kv_pages", "kv_swap", "pack",
        "prefix_cache", "sampling", "sim_executor", "hostmem", "__init__"}
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
  known = {p.stem for p in _modules("serving")}
  assert CORE <= known, CORE - known
  bad = []
  for p in _modules("serving"):
    if p.stem not in CORE:
      continue
    for name in imports(p):
      parts = name.split(".")
      if parts[0] == "serving" and len(parts) > 1 and parts[1] in known:
        if parts[1] not in CORE:
          bad.append((p.stem, parts[1]))
  assert bad == []


def test_the_rule_catches_a_violation(tmp_path):
  """The checker sees an import inside a function too."""
  src = tmp_path / "x.py"
  src.write_text("def f():\n  from serving import server\n  import serving.replay\n")
  assert {"serving", "serving.server", "serving.replay"} <= imports(src)
