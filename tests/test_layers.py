"""The import rule: which package may import which (every import, module
level or inside a function, read from the source with ``ast``).

* ``models/`` and ``attention/`` (the model and its kernels) import nothing
  from ``scheduler/`` or ``serving/``.
* ``scheduler/`` (policies, plans, validation) imports nothing from
  ``serving/``, except the conformance kit, which drives the engine, and
  of ``models/`` and ``attention/`` only the native kernels' builder
  (``attention.native_build``: the key order's radix sort).
* The engine core (``serving/engine/`` and ``serving/kv/``: the engine,
  its config, executors, packing, sampling and virtual-clock cost model, the
  KV cache's pages, swap and prefix cache) imports only the core: never the
  HTTP front (``serving/http/``), the research harness
  (``serving/harness/``) or the CLI (``serving/cli/``).
* Every module under ``serving/`` lives in one of those five subpackages.
* Ray is the runtime of replicas only: ``models/``, ``attention/``,
  ``scheduler/`` and every module under ``serving/`` but the Ray runtime's
  own (``RAY_MODULES``) import no ``ray``; an engine runs, and its tests
  pass, without it.

Size and reach: no product module above ``LONG_FILE_LINES`` unless
``LONG_MODULES`` says why, ``serving/engine/engine.py`` at most
``ENGINE_LINES``, and no module reaches into the private names of the
engine's programs module (the drivers share its public iteration body).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ("engine", "kv")
SUBPACKAGES = {"engine", "kv", "http", "harness", "cli"}
SCHEDULER_MAY_DRIVE_THE_ENGINE = {"conformance"}
# The modules that may import ray: the engine actors and the front over them.
RAY_MODULES = {"serving/http/ray_engines.py", "serving/http/ray_front.py",
               "serving/http/ray_transfer.py"}


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


def test_scheduler_imports_only_the_kernel_builder_below_it():
  bad = [(p.relative_to(ROOT), name) for p in _modules("scheduler") for name in imports(p)
         if name.split(".")[0] in ("models", "attention")
         and name not in ("attention", "attention.native_build")]
  assert bad == []


def test_engine_core_imports_only_the_core():
  core = [p for package in CORE for p in _modules(f"serving/{package}")]
  assert len(core) >= 10, core
  bad = [(p.relative_to(ROOT), name) for p in core for name in imports(p)
         if name.split(".")[0] == "serving" and len(name.split(".")) > 1
         and name.split(".")[1] not in CORE]
  assert bad == []


def test_only_the_ray_runtime_imports_ray():
  paths = [p for package in ("models", "attention", "scheduler") for p in _modules(package)]
  paths += sorted((ROOT / "serving").rglob("*.py"))
  assert len(paths) >= 40, paths
  bad = [str(p.relative_to(ROOT)) for p in paths
         if str(p.relative_to(ROOT)) not in RAY_MODULES
         and any(name.split(".")[0] == "ray" for name in imports(p))]
  assert bad == []
  assert all((ROOT / m).exists() for m in RAY_MODULES), RAY_MODULES


def test_the_ray_rule_catches_an_import(tmp_path):
  """``import ray.util`` and ``from ray import remote`` both count."""
  src = tmp_path / "m.py"
  src.write_text("import ray.util\ndef f():\n  from ray import remote\n")
  assert {"ray.util", "ray", "ray.remote"} <= imports(src)


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
ENGINE_LINES = 740

# Product modules allowed past LONG_FILE_LINES, each with why it stays one
# file. A module leaves this table once it is split below the bound.
LONG_MODULES = {
    "attention/ragged.py": "every implementation of the one paged-attention layout "
                           "(reference, blocked jnp paths, native and Pallas dispatch) "
                           "shares one contract, stated and read once",
    "models/llama.py": "one decoder definition for every family: its blocks, row-tiled "
                       "GEMMs and paged KV writes are read together when a row's bits "
                       "are checked",
    "models/loaders.py": "three checkpoint sources (HF, GGUF, the converted cache) share "
                         "one error type, one parameter layout and one cache",
    "scheduler/ledger.py": "the books (token, sequence and page ledgers) and every offer "
                           "that moves them hold their invariants only together",
    "scheduler/conformance.py": "the kit is one procedure a policy author reads top to "
                                "bottom: rules, workloads, driver, page ledger, shrinker",
    "serving/engine/engine.py": "Engine is the public API (intake, step, simulate, "
                                "counters, the prefill/decode handoff verbs) composing the "
                                "request table, clocks, prefix book, suspensions and "
                                "handoffs; bounded by ENGINE_LINES instead",
    "serving/engine/cost_model.py": "one step-time definition: the plan statistics, the "
                                    "features of each forward (a draft model's included) and "
                                    "their pricing, which the host and the simulated loop's "
                                    "device program both evaluate",
    "serving/http/replicas.py": "ReplicaFront is one state machine on one event loop whose "
                                "steps share the router's replica and placement state",
}


def _product_modules():
  return [p for root in ("models", "attention", "scheduler", "serving")
          for p in sorted((ROOT / root).rglob("*.py"))]


def _lines(path: Path) -> int:
  return len(path.read_text().splitlines())


def test_no_long_module_without_a_reason():
  """No product module above LONG_FILE_LINES unless LONG_MODULES says why,
  and no entry outlives the length it excuses."""
  long = {str(p.relative_to(ROOT)) for p in _product_modules() if _lines(p) > LONG_FILE_LINES}
  assert sorted(long - set(LONG_MODULES)) == []
  assert sorted(set(LONG_MODULES) - long) == []
  for name, reason in LONG_MODULES.items():
    assert len(reason) > 40, name


def import_cycles(root: Path, packages) -> list:
  """Sorted module cycles (strongly connected sets of two or more modules,
  or one importing itself) among the modules of ``packages`` under
  ``root``; an edge is any import of another of those modules, a function's
  own imports included."""
  paths = {}
  for package in packages:
    for path in sorted((root / package).rglob("*.py")):
      parts = path.relative_to(root).with_suffix("").parts
      paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  graph = {m: sorted(n for n in imports(p) if n in paths) for m, p in paths.items()}
  index, low, stack, on_stack, cycles = {}, {}, [], set(), []

  def visit(m):                          # Tarjan's strongly connected components
    index[m] = low[m] = len(index)
    stack.append(m)
    on_stack.add(m)
    for n in graph[m]:
      if n not in index:
        visit(n)
        low[m] = min(low[m], low[n])
      elif n in on_stack:
        low[m] = min(low[m], index[n])
    if low[m] == index[m]:
      comp = []
      while True:
        n = stack.pop()
        on_stack.discard(n)
        comp.append(n)
        if n == m:
          break
      if len(comp) > 1 or m in graph[m]:
        cycles.append(sorted(comp))

  for m in sorted(graph):
    if m not in index:
      visit(m)
  return sorted(cycles)


def test_no_import_cycle():
  assert import_cycles(ROOT, ("models", "attention", "scheduler", "serving")) == []


def test_the_cycle_rule_catches_a_cycle(tmp_path):
  """A three-module cycle through a function-level import is found; a
  one-way import is not a cycle."""
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from pkg import b\n")
  (pkg / "b.py").write_text("import pkg.c\n")
  (pkg / "c.py").write_text("def f():\n  from pkg.a import x\n")
  (pkg / "d.py").write_text("from pkg import a\n")
  assert import_cycles(tmp_path, ("pkg",)) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_engine_module_stays_short():
  """``Engine`` composes its parts; the parts own their tables."""
  assert _lines(ROOT / "serving/engine/engine.py") <= ENGINE_LINES


PROGRAMS = "serving.engine.programs"


def private_calls_into(path: Path, module: str) -> list:
  """``(line, name)`` of every private name (leading underscore) of
  ``module`` that ``path`` reads: through an alias of the module
  (``import a.b as m``, ``from a import b``, ``from a import b as m``,
  then ``m._x``) or imported by name (``from a.b import _x``)."""
  package, _, leaf = module.rpartition(".")
  tree = ast.parse(path.read_text(), str(path))
  aliases, bad = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      aliases.update(a.asname for a in node.names if a.name == module and a.asname)
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      if node.module == package:
        aliases.update(a.asname or a.name for a in node.names if a.name == leaf)
      elif node.module == module:
        bad += [(node.lineno, a.name) for a in node.names if a.name.startswith("_")]
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and node.attr.startswith("_")):
      bad.append((node.lineno, node.attr))
  return sorted(bad)


def test_no_private_calls_into_the_programs_module():
  """Every driver builds on the programs module's public iteration body."""
  own = ROOT / "serving/engine/programs.py"
  bad = [(str(p.relative_to(ROOT)), hit) for p in _product_modules() if p != own
         for hit in private_calls_into(p, PROGRAMS)]
  assert bad == []


def test_the_private_call_rule_catches_a_violation(tmp_path):
  src = tmp_path / "x.py"
  src.write_text("from serving.engine import programs as p\n"
                 "from serving.engine.programs import _arrive, arrive\n"
                 "def f():\n  return p._plan_step, p.plan_step\n")
  assert private_calls_into(src, PROGRAMS) == [(2, "_arrive"), (4, "_plan_step")]
