"""Fits the A100 and H100 profiles to measured GPU operator timings.

  python scripts/fit_profiles.py --data_dir=../shared/data/vidur_profiles

Reads ``compute/<gpu>/*/*/mlp.csv`` and ``network/<gpu>_dgx/*.csv`` of the
data folder (Vidur's public profiles; its PROVENANCE.md names the commit),
fits the operator terms on every model but ``--held_out``
(``serving.engine.profile_fit``) and the collectives on the node's
all-reduce and send/recv times, and writes ``<gpu>.json`` (profile format 2,
``profiles.read_profile``) into ``--out_dir``, H200's scaled from H100's
(same fitted terms, its own bandwidth), and the report (held-out error per
GPU, model, TP degree and operator beside the assumptions replaced) to
``--report``. Nothing is measured here: a least-squares fit of the tables.
"""

import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from serving import cli
from serving.engine import profiles as profile_lib
from serving.engine import profile_fit

FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", "../shared/data/vidur_profiles", "The measured profiles "
                    "(compute/<gpu>/<org>/<model>/mlp.csv, network/<gpu>_dgx/*.csv).")
flags.DEFINE_string("out_dir", str(profile_lib.PROFILE_DIR), "Where the profile JSONs go.")
flags.DEFINE_string("report", "runs/fit_profiles_report.json", "The fit's report JSON.")
flags.DEFINE_list("gpus", ["a100", "h100"], "GPUs to fit (folders of compute/).")
flags.DEFINE_list("held_out", ["Llama-2-70b-hf", "phi-2"], "Models left out of the fit "
                  "and reported on (at least one per GPU).")
flags.DEFINE_string("scaled", "h200:h100", "TARGET:SOURCE: a profile written from SOURCE's "
                    "fit with TARGET's own peaks ('' for none).")


def data_commit(data_dir) -> str:
  """The source commit PROVENANCE.md names ('' when it names none)."""
  path = Path(data_dir) / "PROVENANCE.md"
  found = re.search(r"\b[0-9a-f]{40}\b", path.read_text()) if path.exists() else None
  return found.group(0) if found else ""


def main(argv):
  del argv
  if not Path(FLAGS.data_dir, "compute").is_dir():
    raise ValueError(f"--data_dir {FLAGS.data_dir!r} has no compute/ folder")
  commit = data_commit(FLAGS.data_dir)
  report, written = {"data_commit": commit, "held_out": FLAGS.held_out}, {}
  for gpu in FLAGS.gpus:
    base = profile_lib.read_profile(Path(FLAGS.out_dir) / f"{gpu}.json")
    profile, report[gpu] = profile_fit.fit_profile(
        base, profile_fit.read_operator_tables(FLAGS.data_dir, gpu),
        Path(FLAGS.data_dir) / "network" / f"{gpu}_dgx", FLAGS.held_out, gpu, commit)
    written[gpu] = profile
  if FLAGS.scaled:
    target, source = FLAGS.scaled.split(":")
    written[target] = profile_fit.scaled_profile(
        profile_lib.read_profile(Path(FLAGS.out_dir) / f"{target}.json"), written[source], source)
  for name, profile in written.items():
    (Path(FLAGS.out_dir) / f"{name}.json").write_text(
        json.dumps(profile, indent=1, sort_keys=True) + "\n")
  os.makedirs(os.path.dirname(FLAGS.report) or ".", exist_ok=True)
  Path(FLAGS.report).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
  for gpu in FLAGS.gpus:
    print(gpu, json.dumps(report[gpu]["summary"]))
  print(f"profiles: {sorted(written)} in {FLAGS.out_dir}; report: {FLAGS.report}")


if __name__ == "__main__":
  cli.run(main)
