"""Command-line refusals of the launchers in scripts/ (absl flags).

A launcher refuses bad input with one line, ``error: ...`` naming the flag
(or file, model, request) and its rule, and exit status 2 (the usual status
of a usage error), whether absl refuses it while parsing (an unknown flag, an
enum value outside its choices, a bound, a value of the wrong type) or
``main`` does (a ValueError). ``--help`` and ``--helpfull`` exit with
status 0. Every launcher starts through ``run``:

  if __name__ == "__main__":
    cli.run(main)
"""

import functools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, List, NoReturn

from absl import app, flags, logging

FLAGS = flags.FLAGS
USAGE_ERROR = 2


def refuse(message: str) -> NoReturn:
  """Prints ``error: <message>`` on stderr and exits with status 2."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(USAGE_ERROR)


def check_creatable(flag: str, path: str, *, directory: bool = False) -> None:
  """Refuses (ValueError naming ``--flag``) a path that cannot be written:
  an existing one that is not a writable file (with ``directory``: not a
  writable directory), or a new one whose nearest existing ancestor is a
  file (or else not a directory) or a directory the process cannot write.
  Checked before a model loads, so a run's results are not lost at the end;
  an existing file is overwritten. An empty path is refused, and a file
  path ending in a separator (a folder's spelling) too."""
  if not path:
    raise ValueError(f"--{flag} must be a {'directory' if directory else 'file'} path, "
                     f"got ''")
  if not directory and path.endswith(("/", os.sep)):
    raise ValueError(f"--{flag} {path!r} names a folder (it ends in {path[-1]!r}); give the "
                     f"file's path")
  target = Path(path).absolute()
  if target.exists():
    if directory:
      ok = target.is_dir() and os.access(target, os.W_OK | os.X_OK)
    else:
      ok = target.is_file() and os.access(target, os.W_OK)
    if not ok:
      kind = "directory" if directory else "file"
      raise ValueError(f"--{flag} {path!r} cannot be written: it exists and is not a "
                       f"writable {kind}")
    return
  here = target.parent
  while not here.exists():
    here = here.parent
  if not here.is_dir():
    raise ValueError(f"--{flag} {path!r} cannot be created: {str(here)!r} is "
                     f"{'a file, ' if here.is_file() else ''}not a directory")
  if not os.access(here, os.W_OK | os.X_OK):
    raise ValueError(f"--{flag} {path!r} cannot be created: {str(here)!r} is not a "
                     f"writable directory")


def read_json(flag: str, path: str):
  """The JSON value of the file ``path`` a launcher's ``--flag`` names
  (a saved report or sweep it reads back).

  Raises:
    ValueError: naming ``--flag`` and the path: not a file, or not
      readable as JSON (json's or the decoder's reason).
  """
  if not os.path.isfile(path):
    raise ValueError(f"--{flag}: {path!r} is not a file")
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"--{flag}: {path!r} cannot be read as JSON ({e})") from None


def check_engine_preset(flag: str, name: str) -> None:
  """Refuses (ValueError naming ``--flag``) an engine preset that
  ``EngineConfig.preset`` cannot find: ``name`` must be a preset in configs/
  or, ending in ``.json``, an existing file. Checked before a trace or model
  loads."""
  from serving.engine import config  # pylint: disable=import-outside-toplevel
  if name.endswith(".json"):
    found = Path(name).is_file()
  else:
    found = (config.CONFIG_DIR / f"{name}.json").is_file()
  if not found:
    raise ValueError(f"--{flag} must be a preset in configs/ (one of {config.preset_names()}) "
                     f"or an existing *.json file, got {name!r}")


def use_compile_cache(flag: str, path: str) -> None:
  """Turns on JAX's persistent compilation cache under ``path``/xla
  (``make_dir`` first, so an unusable directory is refused by ``--flag``);
  a later run of the same programs loads them instead of compiling. Programs
  that compile in under 1 s are not stored. An empty ``path``: no cache.

  Raises:
    ValueError: naming ``--flag`` (``make_dir``).
  """
  if not path:
    return
  import jax
  make_dir(flag, path)
  jax.config.update("jax_compilation_cache_dir", f"{path}/xla")
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


class CompileCounter:
  """What JAX spends on programs in this process, from ``jax.monitoring``
  events: ``seconds`` tracing, lowering and compiling or loading them,
  ``programs`` compiled or loaded (backend compiles), ``loaded`` from the
  persistent compilation cache. One per process (``compile_counter``):
  listeners cannot be removed."""

  def __init__(self):
    self.seconds, self.programs, self.loaded = 0.0, 0, 0
    import jax
    jax.monitoring.register_event_duration_secs_listener(self._duration)
    jax.monitoring.register_event_listener(self._event)

  def _duration(self, event: str, seconds: float, **_) -> None:
    if event.startswith("/jax/core/compile/"):
      self.seconds += seconds
      self.programs += event == "/jax/core/compile/backend_compile_duration"

  def _event(self, event: str, **_) -> None:
    self.loaded += event == "/jax/compilation_cache/cache_hits"

  def snapshot(self) -> tuple:
    return self.seconds, self.programs, self.loaded

  def since(self, before: tuple) -> dict:
    """{"seconds", "programs", "loaded_from_cache"} since ``before`` (a
    ``snapshot()``)."""
    now = self.snapshot()
    return {"seconds": round(now[0] - before[0], 3), "programs": now[1] - before[1],
            "loaded_from_cache": now[2] - before[2]}


@functools.lru_cache(maxsize=1)
def compile_counter() -> CompileCounter:
  """This process's ``CompileCounter``, counting from the first call."""
  return CompileCounter()


def make_dir(flag: str, path: str) -> None:
  """Creates the directory ``path`` (where absent) and writes and removes a
  file in it, so that a directory the process cannot use (a read-only file
  system, ``/proc``; ``os.access`` says yes to root there) is refused by
  name before anything runs.

  Raises:
    ValueError: naming ``--flag``: ``check_creatable``'s refusals, or the
      creation or the write failing (naming the directory, which may be
      the folder of the file the flag names, and the system's reason).
  """
  check_creatable(flag, path, directory=True)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"--{flag}: the directory {path!r} cannot be made "
                     f"({e.strerror or e})") from None
  try:
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    raise ValueError(f"--{flag}: no file can be created in the directory {path!r} "
                     f"({e.strerror or e})") from None


def parse_flags(argv: List[str]) -> List[str]:
  """absl's flag parsing (``app.run``'s ``flags_parser``): the arguments left
  after the flags; on a flag absl refuses, prints one line naming it (absl's
  own message) and exits with status 2. absl raises a plain ValueError for a
  boolean's negation given a value (``--nofoo=1``), so that is refused too.
  ``--help``, ``--helpshort``, ``--helpfull`` and ``--helpxml`` print their
  text and exit with status 0 (absl's own exit status for them is 1)."""
  try:
    return FLAGS(argv)
  except (flags.Error, ValueError) as e:
    message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    refuse(f"{message} (--helpfull lists the flags)")
  except SystemExit as e:
    if e.code == 1:                   # absl's help flags exit 1 once their text is out
      sys.exit(0)
    raise


def flag_named(message: str) -> str:
  """A config's refusal, ``"<Config>.<field> <rule>, got <value>"`` (e.g.
  ``EngineConfig``, ``SamplingParams``), said of the flag that gave the
  value: ``"--<field> <rule>, got <value>"`` when a flag of that name was
  given with that value; when the flag was not given (the value is a
  preset's), the message with ``" (set it with --<field>)"`` appended
  unless it names ``--<field>`` already; any other message unchanged."""
  head, _, rest = message.partition(" ")
  owner, dot, name = head.partition(".")
  if not (dot and owner.isidentifier() and name in FLAGS):
    return message
  if not FLAGS[name].present:
    # a message that already names the flag (a config's own advice) is said once
    return message if f"--{name}" in message else f"{message} (set it with --{name})"
  if not rest.endswith(f", got {FLAGS[name].value!r}"):
    return message                   # the value came from elsewhere (a preset, a file)
  return f"--{name} {rest}"


def refuse_x64(launcher: str) -> None:
  """Refuses ``jax_enable_x64`` (``JAX_ENABLE_X64=1``) in ``launcher``, as
  every launcher does, whether or not it builds JAX programs itself: the
  reason is iterserve's, not the launcher's (its programs are int32 and
  float32; ``scheduler.records.refuse_x64`` says what broke under the
  flag), so one rule holds for them all.

  Raises:
    ValueError: the flag on.
  """
  import jax    # pylint: disable=import-outside-toplevel (hostmem's probe loads no jax)
  if jax.config.jax_enable_x64:
    raise ValueError(
        f"jax_enable_x64 must be off in every iterserve launcher, {launcher} included "
        f"(iterserve's JAX programs are written for int32 and float32, and the flag makes "
        f"jnp's Python numbers and aranges 64-bit), got on: unset JAX_ENABLE_X64")


def takes_arguments(main: Callable[[List[str]], Any]) -> Callable[[List[str]], Any]:
  """Marks a launcher's ``main`` as reading arguments that are not flags
  (compare.py's report paths), which ``run`` refuses otherwise."""
  main.takes_arguments = True
  return main


def run(main: Callable[[List[str]], Any]) -> None:
  """``app.run(main)`` with the refusals above: flags parsed by
  ``parse_flags``; an argument that is not a flag refused unless ``main``
  ``takes_arguments`` (a word after the flags, or a value with a space
  left unquoted, ``--out=a b.json``, would otherwise be dropped);
  ``jax_enable_x64`` on (``JAX_ENABLE_X64=1``) refused
  before ``main`` runs, so before any model loads or kernel is timed
  (``refuse_x64``); a ValueError or ``app.UsageError``
  out of ``main`` (bad flag value, file, model or request) becomes one line
  (``flag_named``) and exit status 2. Any other exception keeps its
  traceback (a bug, not bad input)."""

  @functools.wraps(main)
  def refusing(argv):
    if not FLAGS["verbosity"].present:   # JAX's backend probe, checkpoint libraries
      logging.set_verbosity(logging.WARNING)
    if len(argv) > 1 and not getattr(main, "takes_arguments", False):
      refuse(f"unexpected argument {argv[1]!r}: {Path(argv[0]).name} takes only --flags "
             f"(quote a value that holds a space; --helpfull lists the flags)")
    try:
      refuse_x64(Path(argv[0]).name)
      # XLA_FLAGS' ISA cap: a value XLA knows.
      from attention import native_build
      native_build.max_isa()
      return main(argv)
    except (ValueError, app.UsageError) as e:
      refuse(flag_named(str(e)))

  app.run(refusing, flags_parser=parse_flags)
