"""The docs name every flag by its canonical name: a flag alias
(``flags.DEFINE_alias``) defined by a launcher or a module it loads is
accepted on the command line, but no doc or README writes it. And they run
Python as ``.venv/bin/python`` (the interpreter scripts/setup.sh makes),
never a bare ``python`` that may lack the project's packages."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _flag_names():
  """({alias: canonical name}, {every canonical flag name}) defined under
  scripts/ and serving/ (read from the source, nothing imported)."""
  aliases, names = {}, set()
  for path in [*ROOT.glob("scripts/*.py"), *ROOT.glob("serving/**/*.py")]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr.startswith("DEFINE") and node.args
              and isinstance(node.args[0], ast.Constant)):
        continue
      if node.func.attr == "DEFINE_alias":
        aliases[node.args[0].value] = node.args[1].value
      else:
        names.add(node.args[0].value)
  return aliases, names


def alias_uses(text: str, aliases: dict) -> list:
  """(line number, alias as written, its canonical flag) of each alias
  written as a flag in ``text`` (``--route`` is, ``--route_log`` is not)."""
  found = []
  for number, line in enumerate(text.splitlines(), 1):
    for match in re.finditer(r"(?<![\w-])--([A-Za-z][\w-]*)", line):
      if match.group(1) in aliases:
        found.append((number, match.group(0), f"--{aliases[match.group(1)]}"))
  return found


def test_the_scan_finds_an_alias_written_as_a_flag():
  text = "run it\n  --route=prefix_aware --route_log=x.jsonl, `--route`; --router\n"
  assert alias_uses(text, {"route": "router"}) == [(2, "--route", "--router"),
                                                   (2, "--route", "--router")]


def test_docs_use_canonical_flag_names():
  aliases, names = _flag_names()
  # An alias some other launcher defines as its own flag would be ambiguous.
  aliases = {a: c for a, c in aliases.items() if a not in names}
  found = [f"{path.relative_to(ROOT)}:{number}: {alias} (write {canonical})"
           for path in sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md")])
           for number, alias, canonical in alias_uses(path.read_text(), aliases)]
  assert not found, "\n".join(found)


# ``python`` (or python3) as a command: before ``-m``, ``-c`` or a *.py file,
# not part of a path or a name (``.venv/bin/python``, ``llama-cpp-python``).
BARE_PYTHON = re.compile(r"(?<![\w./-])python3?(?=[ \t]+(?:-[mc](?:\s|$)|\S+\.py\b))")


def bare_python_uses(text: str) -> list:
  """(line number, line) of each line of ``text`` that runs a bare python."""
  return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1)
          if BARE_PYTHON.search(line)]


def test_the_scan_finds_a_bare_python_command():
  text = ("python scripts/replay.py\n"
          "  .venv/bin/python scripts/replay.py \\\n"
          "PYTHONPATH=. python3 tests/x.py; `python -m scheduler.conformance`\n"
          "```python\n"
          "python -c \"import jax\"\n"
          "llama-cpp-python server.py, /usr/bin/python x.py, a python API\n")
  assert bare_python_uses(text) == [
      (1, "python scripts/replay.py"),
      (3, "PYTHONPATH=. python3 tests/x.py; `python -m scheduler.conformance`"),
      (5, 'python -c "import jax"')]


def test_docs_run_python_as_the_venvs_interpreter():
  paths = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("docs/**/*.py")]
  found = [f"{path.relative_to(ROOT)}:{number}: {line} (write .venv/bin/python)"
           for path in sorted(paths) for number, line in bare_python_uses(path.read_text())]
  assert not found, "\n".join(found)
