"""Policy names: the registered library, and user policies by spec.

``POLICIES`` maps each registered name to a ``Budgets -> policy`` factory;
``factory(name)`` resolves a registered name or a user's spec
(``module:Class`` or ``path/to/file.py:Class``, loaded by
``scheduler.policy_loader``). Building a policy for an engine, with the
conformance kit run on a user's first, is ``scheduler.policies.make_policy``.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict

from scheduler import policy_loader
from scheduler.ledger import Budgets
from scheduler.policy_fairness import FastServe, PrefixAware, Vtc, VtcCompletionReconciled
from scheduler.policy_length import (ShortestJobFirst, ShortestPrefillFirst,
                                     ShortestRemainingFirst)
from scheduler.policy_orca import Orca
from scheduler.policy_sarathi import Sarathi
from scheduler.policy_sarathi_serve import SarathiServe
from scheduler.policy_slo import LeastSlack, PriorityAging
from scheduler.policy_vllm import VllmV1


def _named(cls, name: str, **params) -> Callable[[Budgets], object]:
  """``cls`` with fixed keyword ``params``, as a factory named ``name``."""
  make = functools.partial(cls, **params)
  make.__name__ = name
  return make


POLICIES: Dict[str, Callable[[Budgets], object]] = {
    "sarathi_serve": SarathiServe,
    "orca": Orca,
    "sarathi": Sarathi,
    "vllm_v1": VllmV1,
    "vllm_v1_priority": _named(VllmV1, "VllmV1", mode="priority",
                               policy_id="vllm_v1_priority"),
    "fastserve": FastServe,
    "vtc": Vtc,
    "vtc_completion_reconciled": VtcCompletionReconciled,
    "priority_aging": PriorityAging,
    "least_slack": LeastSlack,
    "prefix_aware": PrefixAware,
    "sjf": ShortestJobFirst,
    "srpt": ShortestRemainingFirst,
    "spf": ShortestPrefillFirst,
}


def is_registered(name) -> bool:
  return isinstance(name, str) and name in POLICIES


def factory(name: str) -> Callable[[Budgets], object]:
  """The ``Budgets -> policy`` factory of a registered name or a user's spec.

  Raises:
    ValueError: neither a registered name nor a loadable spec (the known
      names listed, or ``policy_loader.SpecError``'s reason).
  """
  if is_registered(name):
    return POLICIES[name]
  if policy_loader.is_spec(name):
    return policy_loader.load_factory(name)
  raise ValueError(f"policy must be one of {sorted(POLICIES)} or "
                   f"{policy_loader.FORMS}{policy_loader.missing_class(name)}, got {name!r}")
