"""A non-editable install carries every native kernel's source.

The package is built from a copy of the working tree and installed with
``pip install --no-deps --no-build-isolation`` into a fresh virtual
environment whose only other path is this environment's site-packages (so
jax, pip and setuptools come offline, and the editable install's import hook is
not run). A process started there, outside the repository, imports the
installed packages and reports for each native kernel where its source
resolved and why it cannot run (None when it runs): every ``.cc`` and every
module (each ``serving`` subpackage's) of the repository is installed, the
installed config reads its presets and accelerator profiles, each kernel's
source lies inside the installed package, and each kernel runs exactly
where it runs from the repository.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

from attention import native
from models import amx, rowgemm

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("serving", "models", "attention", "scheduler", "configs")
KERNELS = {"attention.native": native, "models.amx": amx, "models.rowgemm": rowgemm}
# Everything but the packages, pyproject.toml and README.md stays behind.
_SKIP = shutil.ignore_patterns(".git", ".venv", ".cache", ".ci", "runs", "build", "dist", "docs",
                               "tests", "scripts", "*.egg-info", "__pycache__", ".pytest_cache",
                               ".hypothesis", "*.so")
_PROBE = textwrap.dedent("""
    import importlib, json, sys, sysconfig
    from pathlib import Path
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    report = {"site": str(site), "cc": sorted(
        str(p.relative_to(site))
        for pkg in sys.argv[1].split(",") for p in (site / pkg).rglob("*.cc"))}
    for name in sys.argv[2].split(","):
      mod = importlib.import_module(name)
      report[name] = {"file": mod.__file__, "source": str(mod.KERNEL.source),
                      "reason": mod.unavailable_reason()}
    report["py"] = sorted(str(p.relative_to(site)) for pkg in sys.argv[1].split(",")
                          for p in (site / pkg).rglob("*.py"))
    from serving.engine import config, profiles
    report["preset"] = [config.__file__, config.EngineConfig.preset("tiny").policy,
                        profiles.profile_names()]
    print(json.dumps(report))
""")


def _run(cmd, **kw):
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
  assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
  return proc.stdout


def test_a_non_editable_install_resolves_every_native_kernel(tmp_path):
  src, venv, outside = tmp_path / "src", tmp_path / "venv", tmp_path / "elsewhere"
  shutil.copytree(ROOT, src, ignore=_SKIP)
  outside.mkdir()
  # Without its own pip and setuptools: this environment's (pip, setuptools
  # >= 77 for the build) come through the path line below.
  _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
  python = venv / "bin" / "python"
  site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
              .strip())
  # A plain path line: this environment's packages, without running its .pth
  # files (the editable install's finder among them).
  (site / "iterserve_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
  _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
        "--no-index", str(src)], cwd=outside, env=env)
  report = json.loads(_run([str(python), "-I", "-c", _PROBE, ",".join(PACKAGES), ",".join(KERNELS)],
                           cwd=outside, env=env))

  installed = Path(report["site"])
  repo_cc = sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.cc"))
  assert repo_cc and report["cc"] == repo_cc
  # Every module of every package (the serving subpackages among them), and
  # the presets and accelerator profiles the installed config reads.
  repo_py = sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
  assert "serving/engine/programs.py" in repo_py and report["py"] == repo_py
  config_file, policy, profiles = report["preset"]
  assert Path(config_file).is_relative_to(installed) and policy == "sarathi_serve"
  assert "h100" in profiles
  for name, mod in KERNELS.items():
    got = report[name]
    assert Path(got["file"]).is_relative_to(installed), got
    assert Path(got["source"]).is_relative_to(installed) and Path(got["source"]).is_file(), got
    assert Path(got["source"]).read_bytes() == mod.KERNEL.source.read_bytes(), name
    assert got["reason"] == mod.unavailable_reason(), (name, got["reason"])
