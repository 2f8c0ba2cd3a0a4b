"""Command-line refusals of the launchers in scripts/ (absl flags).

A launcher refuses bad input with one line, ``error: ...`` naming the flag
and its rule, and exit status 2 (the usual status of a usage error):
``launch.exit_on_bad_input`` for what ``main`` checks, ``parse_flags`` for
what absl checks while parsing (an unknown flag, an enum value outside its
choices, a bound, a value of the wrong type).

  app.run(launch.exit_on_bad_input(main), flags_parser=cli.parse_flags)
"""

import sys
from typing import List

from absl import flags

FLAGS = flags.FLAGS
USAGE_ERROR = 2


def parse_flags(argv: List[str]) -> List[str]:
  """absl's flag parsing (``app.run``'s ``flags_parser``): the arguments left
  after the flags; on a flag absl refuses, prints one line naming it (absl's
  own message) and exits with status 2."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    print(f"error: {message} (--helpfull lists the flags)", file=sys.stderr)
    sys.exit(USAGE_ERROR)
