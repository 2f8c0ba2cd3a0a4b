"""Thins a window of the Mooncake conversation trace by prefix group, keeping
every request of each group kept (so follow-up turns still find their prefix).

  python scripts/slice_mooncake.py --window_s=0,600 --every=40 \\
      --out=runs/mooncake_slice.jsonl

A request's group is its first two hash ids (the shared opening block and
the first block of its own content); a group is kept when the sha256 of its
ids, as an integer, is 0 mod --every. Rows are written unchanged, in file
order, with their original timestamps (replay.py / bench_serving.py apply
--time_scale). The output is derived data: keep it under runs/.
"""

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags

from serving import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("trace", "../shared/data/traces/mooncake/conversation_trace.jsonl",
                    "Mooncake conversation JSONL.")
flags.DEFINE_list("window_s", ["0", "600"], "A,B: keep timestamps in [A, B) seconds.")
flags.DEFINE_integer("every", 40, "Keep one prefix group in this many (>= 1).")
flags.DEFINE_string("out", "runs/mooncake_slice.jsonl", "Output JSONL.")


def keep(hash_ids, every: int) -> bool:
  group = json.dumps(hash_ids[:2]).encode()
  return int.from_bytes(hashlib.sha256(group).digest()[:8], "big") % every == 0


def main(argv):
  del argv
  if FLAGS.every < 1:
    raise ValueError(f"--every must be >= 1, got {FLAGS.every}")
  start_ms, end_ms = (float(x) * 1e3 for x in FLAGS.window_s)
  kept = total = 0
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  with open(FLAGS.trace) as src, open(FLAGS.out, "w") as out:
    for line in src:
      row = json.loads(line)
      if not start_ms <= row["timestamp"] < end_ms:
        continue
      total += 1
      if keep(row["hash_ids"], FLAGS.every):
        out.write(line)
        kept += 1
  print(f"kept {kept} of {total} requests in [{FLAGS.window_s[0]}, {FLAGS.window_s[1]}) s "
        f"-> {FLAGS.out}")


if __name__ == "__main__":
  cli.run(main)
