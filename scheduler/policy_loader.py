"""A policy from the user's own code: ``module:Class`` or ``file.py:Class``.

``--policy`` (``EngineConfig.policy``) takes a registered name
(``scheduler.registry.POLICIES``) or a spec naming a policy class (or any
``Budgets -> policy`` factory) in an importable module (``mypkg.mine:Fifo``)
or a Python file (``path/to/mine.py:Fifo``; relative to the working
directory). This module only finds and imports what a spec names
(``load_factory``); ``scheduler.policies.make_policy`` runs the conformance
kit's fast profile on it once per process and refuses it with the broken
rule named before it is built with the engine's budgets.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable

FORMS = "'module:Class' or 'path/to/file.py:Class'"
POLICY_RULE = ("must be a scheduling policy class (a subclass of PolicyBase, or one "
               "whose instances are callable as policy(manifest, state, alloc)) "
               "constructible from Budgets, or a Budgets -> policy factory")

class SpecError(ValueError):
  """A spec that names no loadable policy; ``.reason`` says why."""

  def __init__(self, spec: str, reason: str):
    super().__init__(f"policy {spec!r}: {reason}")
    self.reason = reason


def missing_class(name: str) -> str:
  """A note for a name that is neither registered nor a spec, put before the
  refusal's ", got NAME" (which ``cli.flag_named`` reads): a file named
  without its class says which part is missing; '' otherwise."""
  if isinstance(name, str) and name.endswith(".py") and ":" not in name:
    if not Path(name).is_file():
      return f" (no such file {str(Path(name).resolve())!r}, and no class named)"
    return f" ({name!r} names a file but not the class in it: write '{name}:Class')"
  return ""


def is_spec(name: str) -> bool:
  """True when ``name`` names a user's policy rather than a registered one."""
  return isinstance(name, str) and ":" in name


def _module_of(where: str, spec: str):
  if where.endswith(".py"):
    path = Path(where).resolve()
    if not path.is_file():
      raise SpecError(spec, f"must name an existing file: no such file {str(path)!r}")
    name = "iterserve_policy_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name not in sys.modules:
      loader_spec = importlib.util.spec_from_file_location(name, path)
      module = importlib.util.module_from_spec(loader_spec)
      sys.modules[name] = module
      try:
        loader_spec.loader.exec_module(module)
      except Exception as e:                  # the user's code: report, do not crash
        del sys.modules[name]
        raise SpecError(spec, f"{str(path)!r} failed to load "
                              f"({type(e).__name__}: {e})") from e
    return sys.modules[name]
  try:
    return importlib.import_module(where)
  except ModuleNotFoundError as e:
    raise SpecError(spec, f"must name an importable module: cannot import module "
                          f"{where!r} ({e})") from None
  except Exception as e:                      # the user's code: report, do not crash
    raise SpecError(spec, f"module {where!r} failed to import "
                          f"({type(e).__name__}: {e})") from e


def load_factory(spec: str) -> Callable:
  """The ``Budgets -> policy`` factory ``spec`` names.

  Raises:
    SpecError (a ValueError): the spec is not of the form ``FORMS``, the
      module or file cannot be found, it has no such attribute, or it names
      a class that is no policy (neither ``plan`` nor ``__call__``:
      ``POLICY_RULE``).
  """
  where, _, attr = spec.rpartition(":")
  if not where or not attr or not attr.replace(".", "_").isidentifier():
    raise SpecError(spec, f"must be a registered name or {FORMS}")
  obj = _module_of(where, spec)
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise SpecError(spec, f"{where!r} has no attribute {attr!r}")
    obj = getattr(obj, part)
  if not callable(obj):
    raise SpecError(spec, f"{attr!r} is not a class or factory")
  if isinstance(obj, type) and not any(
      "__call__" in vars(k) or "plan" in vars(k) for k in obj.__mro__[:-1]):
    raise SpecError(spec, f"{attr!r} {POLICY_RULE}")
  return obj
