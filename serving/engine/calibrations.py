"""Calibrations: reading a cost model, the device it was made on, and
choosing and checking one for this machine and model.

``scripts/calibrate.py`` measures the model executor on a grid and fits the
"sum" form by non-negative least squares (``cost_model.fit``);
the JSON names the models the grid ran, the dtype, engine preset, device
fingerprint (``device_fingerprint``) and load average. ``load`` reads one
(or a profile, ``serving.engine.profiles``) and ``resolve`` is how the
engine takes one: a calibration fitted on one model predicts only that
model (its weight term cannot be told from the per-step term); one fitted on
two or more models, or a profile, predicts any model through its features.
Where no calibration is named, ``resolve`` takes the shipped CPU
calibration of this machine's kind (``select_calibration``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Callable, Optional

from serving.engine import host_cpu
from serving.engine.cost_model import CostModel, ModelCosts, from_json
from serving.engine.profiles import PROFILE_PREFIX, for_model, profile, profile_names

_CALIBRATIONS = Path(__file__).resolve().parents[2] / "configs" / "calibration"
DEFAULT_CALIBRATION = _CALIBRATIONS / "cost_model_cpu.json"


def load(path=None) -> CostModel:
  """Reads a calibration JSON (default ``DEFAULT_CALIBRATION``, marked
  ``meta["chosen"] = "default"``: ``resolve`` then takes the shipped
  calibration of this machine's kind instead) or, for ``"profile:NAME"``,
  an accelerator profile (``profile``).

  Raises:
    ValueError: missing file or profile, or a file of another form.
  """
  if path and str(path).startswith(PROFILE_PREFIX):
    return profile(str(path)[len(PROFILE_PREFIX):])
  chosen = bool(path)
  path = Path(path) if path else DEFAULT_CALIBRATION
  if not path.exists():
    raise ValueError(f"cost model file {str(path)!r} not found (write one with "
                     f"scripts/calibrate.py, or use --cost_model={PROFILE_PREFIX}NAME for one of "
                     f"{profile_names()})")
  model = from_json(json.loads(path.read_text()), str(path))
  model.meta["path"] = path.name
  if not chosen:
    # None named: ``resolve`` picks the shipped calibration of this
    # machine's kind (``select_calibration``) for the model at hand.
    model.meta["chosen"] = "default"
  return model


def device_fingerprint() -> dict:
  """What a calibration holds for: the JAX backend and device kind and
  count, and on a CPU its model name, logical CPU count and a hash of its
  feature flags (``/proc/cpuinfo``; empty where there is none), with the
  sorted flags themselves (``flags``: what ``device_difference`` names).
  ``id`` is a short hash of the rest but ``flags`` (calibrations made before
  the list was stored keep their ids): equal ids, the same kind of machine."""
  import jax    # pylint: disable=import-outside-toplevel
  devices = jax.devices()
  fp = {"backend": jax.default_backend(), "kind": devices[0].device_kind,
        "count": len(devices)}
  if fp["backend"] == "cpu":
    name, flags = host_cpu.read_cpuinfo()
    name, flags = platform.processor() if name is None else name, sorted(flags)
    fp.update(cpu=name, cpus=os.cpu_count(),
              flags_sha=hashlib.sha256(" ".join(flags).encode()).hexdigest()[:12])
  fp["id"] = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
  if fp["backend"] == "cpu":
    fp["flags"] = flags
  return fp


# Fingerprint fields device_difference compares (``id`` hashes them).
_DEVICE_FIELDS = ("backend", "kind", "count", "cpu", "cpus", "flags_sha")
_MAX_FLAGS_NAMED = 5


def device_difference(made: dict, here: dict) -> str:
  """In words, how the device a calibration was ``made`` on differs from
  ``here`` (two ``device_fingerprint`` dicts), e.g. ``same CPU model (AMD
  EPYC, 2 CPUs) but other CPU feature flags (this one lacks avx512f)`` or
  ``another CPU model (AMD EPYC vs Intel Xeon)``. The flags that differ are
  named (at most 5) where both fingerprints hold the list; '' when no
  compared field differs. A field only one of them records (an older or
  hand-written fingerprint) is not compared."""
  differ = _differing_fields(made, here)
  if not differ:
    return ""
  if {"backend", "kind"} & set(differ):
    return f"another kind of device ({made.get('kind', '?')} vs {here.get('kind', '?')})"
  if "cpu" in differ:
    return f"another CPU model ({made.get('cpu', '?')} vs {here.get('cpu', '?')})"
  if made.get("cpu"):
    cpus = "" if "cpus" in differ else f", {made.get('cpus')} CPUs"
    same = f"same CPU model ({made['cpu']}{cpus})"
  else:
    same = f"same kind of device ({made.get('kind', '?')})"
  return f"{same} but {_other_parts(made, here, differ)}"


def _differing_fields(made: dict, here: dict) -> list:
  return [k for k in _DEVICE_FIELDS if k in made and k in here and made[k] != here[k]]


def _other_parts(made: dict, here: dict, differ: list) -> str:
  """The device count, CPU count and CPU flags that differ (``differ``),
  e.g. ``another CPU count (2 vs 4) and other CPU feature flags (this one
  lacks avx512f)``."""
  parts = []
  if "count" in differ:
    parts.append(f"another device count ({made.get('count')} vs {here.get('count')})")
  if "cpus" in differ:
    parts.append(f"another CPU count ({made.get('cpus')} vs {here.get('cpus')})")
  if "flags_sha" in differ:
    parts.append("other CPU feature flags")
    if isinstance(made.get("flags"), list) and isinstance(here.get("flags"), list):
      lacks = sorted(set(made["flags"]) - set(here["flags"]))
      has = sorted(set(here["flags"]) - set(made["flags"]))
      shown_lacks = lacks[:_MAX_FLAGS_NAMED]
      shown_has = has[:_MAX_FLAGS_NAMED - len(shown_lacks)]
      words = [f"{verb} {', '.join(names)}" for verb, names in
               (("lacks", shown_lacks), ("has", shown_has)) if names]
      hidden = len(lacks) + len(has) - len(shown_lacks) - len(shown_has)
      if hidden:
        words.append(f"{hidden} more")
      if words:
        parts[-1] += f" (this one {'; '.join(words)})"
  return " and ".join(parts)


CALIBRATION_DIR = _CALIBRATIONS
# The vector ISA a CPU calibration holds for: the widest of these its flags
# name (the native kernels and XLA's CPU code differ most by it).
_ISAS = (("avx512f", "avx512"), ("avx2", "avx2"), ("asimd", "neon"))


def machine_kind(fingerprint: dict) -> Optional[dict]:
  """The kind of machine a ``device_fingerprint`` is, as calibrations are
  chosen by: ``{"cpu": model name, "cpus": logical CPUs, "isa": "avx512" |
  "avx2" | "neon" | "baseline"}``; None for a non-CPU backend or a
  fingerprint without its flag list (a calibration made before flags were
  stored states its ``machine_kind`` in its meta instead)."""
  if fingerprint.get("backend") != "cpu" or not isinstance(fingerprint.get("flags"), list):
    return None
  flags = set(fingerprint["flags"])
  isa = next((name for flag, name in _ISAS if flag in flags), "baseline")
  return {"cpu": fingerprint.get("cpu"), "cpus": fingerprint.get("cpus"), "isa": isa}


def _kind_words(kind: Optional[dict]) -> str:
  if not kind:
    return "not a CPU"
  isa = {"avx512": "AVX-512", "avx2": "AVX2", "neon": "NEON"}.get(kind["isa"], "no AVX2")
  return f"{kind['cpu']}, {kind['cpus']} CPUs, {isa}"


def shipped_calibrations(directory=CALIBRATION_DIR) -> list:
  """(path, meta) of every calibration JSON in ``directory`` that states its
  machine kind (``meta["machine_kind"]`` or a fingerprint with flags),
  sorted by file name."""
  out = []
  for path in sorted(Path(directory).glob("*.json")):
    try:
      d = json.loads(path.read_text())
    except (OSError, ValueError):
      continue
    meta = d.get("meta", {})
    if "coef_ms" in d and (meta.get("machine_kind") or machine_kind(meta.get("device", {}))):
      out.append((path, meta))
  return out


def select_calibration(fingerprint: dict, costs: Optional[ModelCosts] = None,
                       directory=CALIBRATION_DIR) -> tuple:
  """The shipped calibration for this machine: ``(path, "")``, or ``(None,
  line)`` where none holds, ``line`` saying why in one line and naming
  ``scripts/calibrate.py``.

  A calibration holds when its machine kind (``machine_kind``: CPU model,
  CPU count, vector ISA) is this fingerprint's, and it can predict
  ``costs``' model (fitted on two or more models, or on this one), and
  its draft model where ``costs.draft`` is set. One made
  on this very fingerprint (``id``) first, then one fitted on more models.
  """
  here = machine_kind(fingerprint)
  found, kinds, one_model = [], [], []
  for path, meta in shipped_calibrations(directory):
    kind = meta.get("machine_kind") or machine_kind(meta.get("device", {}))
    kinds.append(_kind_words(kind))
    if kind != here:
      continue
    models = [_costs_key(m) for m in meta.get("models", [])]
    predicted = [] if costs is None else [costs] + ([costs.draft] if costs.draft else [])
    if len(models) == 1 and any(models[0] != _costs_key(c.to_json()) for c in predicted):
      one_model.append(f"{path.name} (fitted on {meta.get('model', '?')} only)")
      continue
    found.append((meta.get("device", {}).get("id") == fingerprint.get("id"),
                  len(models), path.name, path))
  if found:
    return max(found)[3], ""
  why = (f"the one for this machine's kind cannot predict this model: {one_model[0]}"
         if one_model else f"none of this machine's kind ({_kind_words(here)}; shipped: "
                           f"{'; '.join(kinds) or 'none'})")
  return None, (f"cost model: no shipped CPU calibration holds here, {why}; using "
                f"{DEFAULT_CALIBRATION.name}, whose times may not hold here: fit one on an idle "
                f"machine with scripts/calibrate.py (--quick: a smaller grid)")


def find_calibration(directory, fingerprint: dict, dtype: str,
                     engine: str) -> Optional[Path]:
  """The calibration in ``directory`` made on this kind of device
  (``fingerprint["id"]``) for ``dtype`` and the ``engine`` preset: one
  fitted on several models first, then the newest; None when there is none.
  (Whether it may predict the model at hand is ``resolve``'s check.)"""
  found = []
  for path in Path(directory).glob("*.json") if Path(directory).is_dir() else ():
    try:
      meta = json.loads(path.read_text()).get("meta", {})
    except (OSError, ValueError):
      continue
    if (meta.get("device", {}).get("id") == fingerprint["id"] and meta.get("dtype") == dtype
        and meta.get("engine") == engine):
      found.append((len(meta.get("models", [])) > 1, meta.get("created", ""), path))
  return max(found)[2] if found else None


# ModelCosts fields a calibration's stored models may lack (written before
# them) or that do not change what a calibration predicts.
_NOT_KEYED = ("weight_bytes", "tp", "row_bytes_per_row", "all_reduce_bytes_per_row", "draft",
              "draft_passes")


def _costs_key(costs: dict) -> dict:
  return {k: v for k, v in costs.items() if k not in _NOT_KEYED}


_SAID = set()


def say_once(line: str) -> None:
  """Prints ``line`` to stderr the first time this process says it (N
  replicas on one calibration warn once)."""
  if line not in _SAID:
    _SAID.add(line)
    print(line, file=sys.stderr)


def count_as_said(lines) -> None:
  """Makes ``say_once`` keep ``lines`` (strings) quiet in this process: a
  process started to share a run whose parent said them already (sweep.py's
  trial processes)."""
  _SAID.update(lines)


def _shipped_line(name: str, here: dict, made: dict) -> str:
  """``resolve``'s one line for the shipped calibration ``name`` chosen by
  this machine's kind (``here`` its fingerprint, ``made`` the calibration's):
  which it is and, where it was made on another fingerprint, how that
  device differs (the kind's CPU model and count are the same, so the
  flags or device count; ``device_difference`` where more differs)."""
  kind = _kind_words(machine_kind(here))
  if made.get("id") == here.get("id"):
    return (f"cost model: {name}, the shipped calibration for this machine ({kind}), made on "
            f"a machine of this fingerprint (id {here.get('id')})")
  differ = _differing_fields(made, here)
  if {"backend", "kind", "cpu", "cpus"} & set(differ):
    how = f"on another device: {device_difference(made, here)}"
  elif differ:
    how = f"on a machine of this kind with {_other_parts(made, here, differ)}"
  else:
    how = "on a machine of this kind with another fingerprint"
  return (f"cost model: {name}, the shipped calibration for this machine's kind ({kind}), made "
          f"{how} (id {made.get('id')} vs {here.get('id')}): its times may not hold here")


def resolve(model: CostModel, costs: ModelCosts, *,
            fingerprint: Optional[dict] = None,
            say: Callable[[str], None] = print) -> CostModel:
  """Checks that ``model`` may predict ``costs``' model on this device.

  * A calibration fitted on exactly one model predicts only that model (its
    weight reads are folded into the per-step term): another model is
    refused. One fitted on two or more models, or one stating no models (a
    profile, a hand-written model), predicts any model through its
    features; a model it did not see gets a one-line note.
  * A calibration made on another device (``device_fingerprint`` id) gets
    a one-line warning naming what differs (``device_difference``); a
    profile (``uncalibrated``) a one-line note.
  * The default calibration (``load`` given no path) is replaced by the
    shipped one of this machine's kind for this model
    (``select_calibration``), said in one line that also says how the
    machine it was made on differs from this one (``_shipped_line``: VMs of
    one kind may differ in their flags); where none holds, one line says
    so and names ``scripts/calibrate.py``, and the default is kept.

  Args:
    model: the loaded cost model.
    costs: the engine model's ``ModelCosts``.
    fingerprint: this device's (default ``device_fingerprint()``).
    say: where the one-line notes go.
  Returns:
    ``model``, a profile charged for ``costs``' model (``for_model``);
    with a draft model (``costs.draft``), its ``draft`` the same model
    charged for the draft's (the same checks hold for it).
  Raises:
    ValueError: a one-model calibration for another model, naming both.
  """
  device_said = False     # the default's one line says it, or that no shipped one holds
  if model.meta.get("chosen") == "default" and model.combine == "sum":
    fp, device_said = fingerprint or device_fingerprint(), True
    path, line = select_calibration(fp, costs)
    if path is None:
      say(line)
      model = dataclasses.replace(model, meta=dict(model.meta, chosen="default, none holds"))
    else:
      model = load(path)
      model.meta["chosen"] = f"by machine kind ({_kind_words(machine_kind(fp))})"
      say(_shipped_line(path.name, fp, model.meta.get("device", {})))
  where = model.meta.get("path") or model.meta.get("profile") or "the cost model"
  _check_predicts(model, costs, where, "this model", say)
  if costs.draft is not None:
    _check_predicts(model, costs.draft, where, "the draft model (EngineConfig.speculative)",
                    say)
  if model.meta.get("provisional"):
    say(f"cost model: {where} is provisional: {model.meta['provisional']}")
  if model.meta.get("uncalibrated"):
    say(f"cost model: accelerator profile {model.meta.get('profile')!r} is uncalibrated "
        f"(published peaks x stated efficiencies)")
  elif model.meta.get("fitted"):
    fitted = model.meta["fitted"]
    say(f"cost model: accelerator profile {model.meta.get('profile')!r}: "
        f"{fitted.get('summary', 'fitted to measured operator timings')}")
  elif model.meta.get("device") and not device_said:
    fp = fingerprint or device_fingerprint()
    made = model.meta["device"]
    if made.get("id") != fp["id"]:
      how = device_difference(made, fp) or "another fingerprint"
      say(f"cost model: {where} was calibrated on another device than this one: {how} "
          f"(id {made.get('id')} vs {fp['id']}): its times may not hold here")
  charged = for_model(model, costs)
  if costs.draft is not None:
    charged = dataclasses.replace(charged, draft=for_model(model, costs.draft))
  return charged


def _check_predicts(model: CostModel, costs: ModelCosts, where: str, what: str,
                    say: Callable[[str], None]) -> None:
  """``resolve``'s rule for one model (``what``): a calibration fitted on
  one other model refuses it; one fitted on others predicts it, said."""
  seen = [_costs_key(m) for m in model.models]
  here = _costs_key(costs.to_json())
  if len(seen) == 1 and seen[0] != here:
    raise ValueError(
        f"cost model {where} was fitted on one model only ({model.meta.get('model', '?')}: "
        f"its weight reads are folded into the per-step term) and cannot predict {what} "
        f"(gemm_flops_per_row {here['gemm_flops_per_row']} vs "
        f"{seen[0].get('gemm_flops_per_row')}); calibrate on this model, or on two models "
        f"(scripts/calibrate.py --second_model)")
  if len(seen) > 1 and here not in seen:
    say(f"cost model: {where} was fitted on {len(seen)} other models; predicting "
        f"{'this one' if what == 'this model' else what} from its cost features")
