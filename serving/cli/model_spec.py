"""A model flag's value (``--model``, ``--second_model``): checked before
anything loads, and read without weights for the simulated executor.

A value is a named model with weights (``smollm2-135m``), a ``*.gguf`` file,
an HF checkpoint directory, ``random:PRESET[,field=value...]`` (a shape with
random weights), or, for the simulated executor only, a config preset of
``models.config.PRESETS`` that has no weights (``tiny``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from models.config import PRESETS
from models.loaders import NAMED_MODELS, load_config, resolve_model_path

RANDOM_PREFIX = "random:"


def random_model(spec: str, dtype=jnp.float32, *, weights: bool = True,
                 flag: str = "--model"):
  """``random:PRESET[,key=value...]``: a named model's config with overridden
  shape fields and random weights (``llama.init_params``, seed 0; None when
  ``weights`` is False), its tokenizer the named model's: timing runs of
  shapes without a checkpoint (a step's time does not depend on weights).

  Raises:
    ValueError: naming ``flag``: an unknown preset or field, a malformed
      pair, a value not of the field's type or that the config refuses, or
      a ``vocab_size`` override (the tokenizer is fixed).
  """
  from models import llama              # pylint: disable=import-outside-toplevel
  preset, *pairs = spec[len(RANDOM_PREFIX):].split(",")
  try:
    base, tokenizer = load_config(preset)
  except ValueError as e:
    raise ValueError(f"{flag}={spec}: {e}") from None
  fields = {f.name for f in dataclasses.fields(base)}
  overrides = {}
  for pair in pairs:
    key, eq, value = pair.partition("=")
    if not eq or key not in fields:
      raise ValueError(f"{flag}={spec}: {pair!r} must be FIELD=VALUE with FIELD a "
                       f"ModelConfig field")
    if key == "vocab_size":
      raise ValueError(f"{flag}={spec}: vocab_size cannot change (the tokenizer is "
                       f"{preset}'s)")
    kind = type(getattr(base, key))
    try:
      overrides[key] = kind(value)
    except ValueError:
      article = "an" if kind.__name__[0] in "aeiou" else "a"
      raise ValueError(f"{flag}={spec}: {key} must be {article} {kind.__name__}, got "
                       f"{value!r}") from None
  try:
    cfg = dataclasses.replace(base, name=spec[len(RANDOM_PREFIX):], **overrides)
  except ValueError as e:
    raise ValueError(f"{flag}={spec}: {e}") from None
  params = llama.init_params(cfg, jax.random.PRNGKey(0), dtype) if weights else None
  return cfg, params, tokenizer


def is_config_preset(spec: str) -> bool:
  """Whether ``spec`` names a config preset without weights (``tiny``): in
  ``PRESETS``, not a named model with weights, and no file or directory of
  that name in the way (the loaders take a path first)."""
  return spec in PRESETS and spec not in NAMED_MODELS and not Path(spec).exists()


def check_model_spec(flag: str, spec: str, *, simulated: bool = False,
                     needs_tokenizer: bool = False,
                     simulated_flag: str = "--executor=simulated") -> None:
  """Checks a model flag's value before any model loads: a ``random:`` spec
  parses with its overrides (``random_model`` without weights), a config
  preset without weights (``is_config_preset``) is taken where ``simulated``
  (the simulated executor reads a config alone) and the caller
  ``needs_tokenizer`` not (a preset has none), any other value names a model
  with weights, a ``*.gguf`` file or an HF directory.

  Raises:
    ValueError: naming ``flag`` and what is wrong with ``spec``, the value
      said once; a config preset without ``simulated`` names
      ``simulated_flag``, the caller's way to the simulated executor.
  """
  if spec.startswith(RANDOM_PREFIX):
    random_model(spec, weights=False, flag=flag)
    return
  if is_config_preset(spec):
    models = f"{sorted(NAMED_MODELS)}, a *.gguf file or an HF directory"
    if not simulated:
      raise ValueError(f"{flag}={spec}: a config preset without weights runs only on the "
                       f"simulated executor ({simulated_flag}); models with weights: {models}")
    if needs_tokenizer:
      raise ValueError(f"{flag}={spec}: a config preset has no tokenizer, and this launcher "
                       f"takes a model with one: {models}")
    return
  try:
    resolve_model_path(spec)
  except ValueError as e:
    raise ValueError(f"{flag}={spec}: {_without_name(str(e), spec)}") from None


def model_config(spec: str):
  """``(ModelConfig, Tokenizer or None)`` of a model flag's value without
  its weights, for the simulated executor: a config preset's
  (``is_config_preset``; no tokenizer, None), else ``load_config``'s.

  Raises:
    ValueError: as ``load_config``.
  """
  return (PRESETS[spec], None) if is_config_preset(spec) else load_config(spec)


def _without_name(message: str, spec: str) -> str:
  """A loader's message about ``spec`` without its own naming of it (the
  flag's ``FLAG=SPEC: `` prefix names it): ``unknown model 'x': ...``
  becomes ``unknown model: ...``, ``/path: expected ...`` ``expected ...``."""
  path = f"{Path(spec).expanduser()}: "
  if message.startswith(path):
    return message[len(path):]
  return message.replace(f" {spec!r}", "", 1)
