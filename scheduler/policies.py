"""Making a policy by name: what the engine, its config and the scripts call.

``make_policy(name, budgets)`` builds a registered policy
(``scheduler.registry.POLICIES``) or a user's (``module:Class`` /
``path/to/file.py:Class``, ``scheduler.policy_loader``) once the
conformance kit's fast profile passed on it (``scheduler.conformance``: run
once per process and spec, seconds); ``check_policy_name`` checks a config
field without running the kit. The library itself lives in
``scheduler.ledger`` (the shared ledger, ``Budgets``, ``PolicyBase``),
``scheduler.keys`` and the ``policy_*`` modules.
"""

from __future__ import annotations

from typing import Dict, Optional

from scheduler import conformance
from scheduler import policy_loader
from scheduler.ledger import Budgets, check_reservation  # noqa: F401  (config's names)
from scheduler.registry import POLICIES, is_registered

# spec -> the conformance failure (None: passed), once per process.
_CHECKED: Dict[str, Optional[str]] = {}


def check_policy_name(owner: str, name: str) -> None:
  """Raises ValueError naming ``owner``'s field unless ``name`` is a
  registered policy or a loadable user policy (the conformance kit runs
  when the policy is made, not here)."""
  if is_registered(name):
    return
  if not policy_loader.is_spec(name):
    raise ValueError(f"{owner}.policy must be one of {sorted(POLICIES)} or "
                     f"{policy_loader.FORMS}{policy_loader.missing_class(name)}, got {name!r}")
  try:
    policy_loader.load_factory(name)
  except policy_loader.SpecError as e:
    raise ValueError(f"{owner}.policy {e.reason}, got {name!r}") from None


def check_policy_flag(flag: str, names) -> None:
  """Raises ValueError naming ``flag`` (e.g. "--policies") unless ``names``
  is a non-empty list of registered policies or loadable user specs."""
  if not names:
    raise ValueError(f"{flag} must name one or more policies: registered ones "
                     f"{sorted(POLICIES)} or {policy_loader.FORMS}, got ''")
  for name in names:
    if is_registered(name):
      continue
    if not policy_loader.is_spec(name):
      raise ValueError(f"{flag} must name registered policies {sorted(POLICIES)} or "
                       f"{policy_loader.FORMS}{policy_loader.missing_class(name)}, got {name!r}")
    try:
      policy_loader.load_factory(name)
    except policy_loader.SpecError as e:
      raise ValueError(f"{flag}: {name!r} {e.reason}") from None


def check_user_policy(spec: str) -> None:
  """Runs the kit's fast profile on the user's policy ``spec`` once per process.

  Raises:
    ValueError: ``policy_loader.load_factory``'s errors, or the kit's verdict:
      "policy SPEC is refused ... breaks rule 'RULE' ... minimal example: ...".
  """
  if spec not in _CHECKED:
    factory = policy_loader.load_factory(spec)
    try:
      conformance.check_policy(factory)
      _CHECKED[spec] = None
    except conformance.ConformanceError as e:
      _CHECKED[spec] = str(e)
  if _CHECKED[spec] is not None:
    raise ValueError(f"policy {spec!r} is refused by the conformance kit "
                     f"(scheduler.conformance): {_CHECKED[spec]}")


def make_policy(name: str, budgets: Budgets):
  """Policy by registered name, or a user's policy by ``module:Class`` /
  ``path/to/file.py:Class`` once the conformance kit's fast profile passed
  (``check_user_policy``). ValueError lists the known names, or names the
  rule a user's policy breaks."""
  if is_registered(name):
    return POLICIES[name](budgets)
  if policy_loader.is_spec(name):
    check_user_policy(name)
    return policy_loader.load_factory(name)(budgets)
  raise ValueError(f"policy must be one of {sorted(POLICIES)} or "
                   f"{policy_loader.FORMS}, got {name!r}")
