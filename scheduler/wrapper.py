"""``PolicyWrapper``: the base of a policy that plans with another one
(``self.inner``) and then changes its plan: ``ForcedPreemption``
(``scheduler.policy_forced``), ``FixedDraft`` and ``AdaptiveDraft``
(``scheduler.policy_speculative``). It keeps the inner policy's version,
budgets, tie-break, keys, state and ``update``; the subclass names itself
(``policy_id``) and plans (``__call__``)."""

from __future__ import annotations

from scheduler import keys


class PolicyWrapper:
  """Delegates everything but ``policy_id`` and ``__call__`` to ``self.inner``."""

  @property
  def version(self) -> str:
    return self.inner.version

  @property
  def budgets(self):
    return self.inner.budgets

  @property
  def tie_break(self):
    return self.inner.tie_break

  def sort_keys(self, manifest, state, view=None):
    keyer = getattr(self.inner, "sort_keys", None)
    if keyer is None:
      return keys.sort_keys(manifest, state)
    return keyer(manifest, state, view)

  def init_state(self, num_slots, num_clients):
    init = getattr(self.inner, "init_state", None)
    return None if init is None else init(num_slots, num_clients)

  def update(self, manifest, state, plan, result, successor):
    update = getattr(self.inner, "update", None)
    if update is None:
      return successor.policy_state
    return update(manifest, state, plan, result, successor)

  def watermark_pages(self) -> int:
    """The inner policy's admission watermark (0 without budgets)."""
    budgets = getattr(self.inner, "budgets", None)
    return 0 if budgets is None else budgets.watermark_pages
