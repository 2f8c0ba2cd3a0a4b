"""The fault suite's one report line per case (``-s`` shows it)."""

import json


def report(case: str, **figures) -> None:
  """Prints ``fault-figures CASE: {figures as JSON}``: requests sent,
  outcomes by kind, requests without an outcome, pages back."""
  print(f"fault-figures {case}: {json.dumps(figures, sort_keys=True)}", flush=True)
