"""Benchmarks ragged paged attention on the engine's typical mixes; writes JSON.

CPU:  python scripts/bench_attention.py --out=/tmp/attn.json
GPU:  python scripts/bench_attention.py --backend=gpu --peak_hbm_gbps=4800 \
          --impls=pallas,gather,dense --out=/tmp/attn_gpu.json

Mixes (page_size 16, 9 query / 3 KV heads, head_dim 64; --dtype):
  decode32   32 decode rows, kv_len uniform in [500, 1500], T=64
  prefill0   one 256-row prompt chunk, no history, T=256
  prefill1k  one 256-row chunk after 1000 committed rows, T=256
  mixed      31 decode rows + a 225-row chunk after 500 rows, T=256

``--decode_sweep=1,8,32,128 --contexts=256,512,1024`` adds uniform decode
mixes (S sequences of one row each, every kv_len = context, T = the engine's
bucket for S rows) named ``decodeS@context``; ``--bandwidth`` first measures
the machine's memory bandwidth (a jitted sum and a jitted copy of a 256 MiB
float32 array) and reports each mix's memory-read bound: the K/V bytes it
must read divided by the read bandwidth.

``--profile_ops`` adds, per impl and mix, the time of each compiled XLA
operation (fusions, dots) per call, from a JAX profiler trace of the timed
calls: where the milliseconds go inside the attention program.

For each impl: ms per call (median of --iters after one warm-up), speed-up
over the numpy reference and over "gather", max |error| against the
reference, and the achieved bandwidth of the K/V bytes the mix must read
(as a fraction of --peak_hbm_gbps when given).
"""

import collections
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention import native, ragged  # noqa: E402
from serving import cli  # noqa: E402
from serving.engine import host_cpu  # noqa: E402

_OUT = flags.DEFINE_string("out", "/tmp/bench_attention.json", "JSON path.")
_BACKEND = flags.DEFINE_string("backend", "cpu", "JAX platform to run on.")
_IMPLS = flags.DEFINE_list("impls", ["native", "blocked", "blocked_dot", "gather"],
                           "ragged impls, plus 'dense' (masked attention).")
_MIXES = flags.DEFINE_list("mixes", ["decode32", "prefill0", "prefill1k",
                                     "mixed"], "Mixes to run.")
_ITERS = flags.DEFINE_integer("iters", 5, "Timed calls per impl and mix.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "q and K/V dtype.")
_BF16_PAGES = flags.DEFINE_enum(
    "bf16_pages", "bits", ["bits", "float"],
    "bfloat16 K/V pages as the engine stores them (uint16 bits) or as "
    "float bfloat16 arrays (which XLA:CPU widens whole for every gather).")
_PEAK = flags.DEFINE_float("peak_hbm_gbps", 0.0, "Device peak bandwidth.")
_REFERENCE = flags.DEFINE_bool("reference", True, "Time the numpy oracle.")
_SWEEP = flags.DEFINE_list("decode_sweep", [], "Decode sequence counts S.")
_CONTEXTS = flags.DEFINE_list("contexts", ["256", "512", "1024"],
                              "kv_len of every sequence in the decode sweep.")
_PROFILE_OPS = flags.DEFINE_integer(
    "profile_ops", 0, "Report the N most expensive XLA ops per call (0: off).")
_BANDWIDTH = flags.DEFINE_bool("bandwidth", False,
                               "Measure memory bandwidth and read bounds.")

_MIX_SPECS = {  # name: (T, [(history, q_len), ...])
    "decode32": (64, "decode", 32),
    "prefill0": (256, [(0, 256)]),
    "prefill1k": (256, [(1000, 256)]),
    "mixed": (256, "mixed", 31),
}
_S, _PAGES_PER_SEQ, _PAGE, _HQ, _HKV, _D = 32, 128, 16, 9, 3, 64


def _sequences(name, rng):
  if "@" in name:                      # decodeS@context: the sweep
    num_seqs, context = map(int, name[len("decode"):].split("@"))
    return max(4, 1 << (num_seqs - 1).bit_length()), [(context - 1, 1)] * num_seqs
  spec = _MIX_SPECS[name]
  if spec[1] == "decode":
    return spec[0], [(int(h), 1) for h in rng.integers(499, 1500, spec[2])]
  if spec[1] == "mixed":
    decode = [(int(h), 1) for h in rng.integers(499, 1500, spec[2])]
    return spec[0], decode + [(500, 225)]
  return spec[0], spec[1]


def _make_inputs(seqs, num_rows, dtype, rng):
  """Random pages and descriptors for ``seqs`` (at least ``_S`` slots)."""
  num_slots = max(_S, len(seqs))
  num_pages = num_slots * _PAGES_PER_SEQ + 1
  shape = (num_pages, _PAGE, _HKV, _D)
  k_pages = rng.standard_normal(shape, np.float32)
  v_pages = rng.standard_normal(shape, np.float32)
  table = np.zeros((num_slots, _PAGES_PER_SEQ), np.int32)  # page 0: null
  kv_lens = np.zeros(num_slots, np.int32)
  cu = np.zeros(num_slots + 1, np.int32)
  for s, (history, q_len) in enumerate(seqs):
    kv_lens[s] = history + q_len
    used = -(-kv_lens[s] // _PAGE)
    table[s, :used] = 1 + s * _PAGES_PER_SEQ + np.arange(used)
    cu[s + 1] = cu[s] + q_len
  cu[len(seqs) + 1:] = cu[len(seqs)]
  q = rng.standard_normal((num_rows, _HQ, _D), np.float32)
  kv_bytes = int(kv_lens.sum()) * _HKV * _D * 2 * jnp.dtype(dtype).itemsize
  k_pages, v_pages = (jnp.asarray(x, dtype) for x in (k_pages, v_pages))
  if dtype == jnp.bfloat16 and _BF16_PAGES.value == "bits":
    k_pages, v_pages = (jax.lax.bitcast_convert_type(x, ragged.KV_BITS)
                        for x in (k_pages, v_pages))
  args = (jnp.asarray(q, dtype), k_pages, v_pages, jnp.asarray(kv_lens),
          jnp.asarray(table), jnp.asarray(cu), jnp.int32(len(seqs)))
  return args, kv_bytes


@jax.jit
def _dense(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, num_seqs):
  """Dense masked attention over every sequence's whole page list."""
  seq, pos, valid = ragged.row_metadata(cu_q_lens, kv_lens, num_seqs,
                                        q.shape[0])
  k = ragged.widen_kv(k_pages[page_table]).reshape(-1, _HKV, _D)
  v = ragged.widen_kv(v_pages[page_table]).reshape(-1, _HKV, _D)
  width = page_table.shape[1] * _PAGE
  key_seq = jnp.arange(k.shape[0]) // width
  key_pos = jnp.arange(k.shape[0]) % width
  mask = ((key_seq[None] == seq[:, None]) & (key_pos[None] <= pos[:, None])
          & valid[:, None])
  qg = q.reshape(q.shape[0], _HKV, _HQ // _HKV, _D).astype(jnp.float32)
  s = jnp.einsum("tkgd,skd->tkgs", qg, k) * _D ** -0.5
  s = jnp.where(mask[:, None, None], s, -1e30)
  p = jax.nn.softmax(s, axis=-1) * mask[:, None, None]
  return jnp.einsum("tkgs,skd->tkgd", p, v).reshape(q.shape).astype(q.dtype)


def _time(fn, iters):
  jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


# Trace events that are not one compiled op: host frames, executors, loops.
_HOST_EVENTS = ("Thunk", "Execute", "Pjit", "PjRt", "block_until_ready",
                "trace", "Wait", "wait")


def _op_times(fn, iters, top):
  """ms per call of each XLA op (a thunk of the compiled program: a fusion,
  a dot, a copy), from a profiler trace of ``iters`` calls; the ``top`` most
  expensive, plus their share of the summed op time."""
  jax.block_until_ready(fn())
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(iters):
        jax.block_until_ready(fn())
    path = next(Path(trace_dir).rglob("*.trace.json.gz"))
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
  totals = collections.Counter()
  for event in events:
    name = event.get("name", "")
    if (event.get("ph") == "X" and not name.startswith(("$", "while"))
        and not any(word in name for word in _HOST_EVENTS)):
      totals[name] += event.get("dur", 0) / 1e3 / iters      # us -> ms/call
  summed = sum(totals.values()) or 1.0
  return {name: {"ms": ms, "share": ms / summed}
          for name, ms in totals.most_common(top)}


def _memory_bandwidth(iters):
  """GB/s of a jitted sum (bytes read) and a jitted copy (read + written)
  of a 256 MiB float32 array (the copy's output buffer is reused call to
  call, so after the warm-up no fresh pages are faulted in), and of a page
  gather: ``jnp.take`` of 4096 shuffled pages of the mixes' shape
  (page_size x KV heads x head_dim) out of a pool of 8192, 256 pages per
  loop step into a reused buffer, in float32 and bfloat16 (GB/s of pages
  gathered): the data movement the CPU paths start every key block with."""
  x = jnp.arange(64 << 20, dtype=jnp.float32)
  total = jax.jit(jnp.sum)
  copy = jax.jit(lambda x, out: x + 1.0, donate_argnums=1)
  out = [jnp.zeros_like(x)]

  def run_copy():
    out[0] = copy(x, out[0])
    return out[0]

  result = {"read_gbps": x.nbytes / _time(lambda: total(x), iters) / 1e6,
            "copy_gbps": 2 * x.nbytes / _time(run_copy, iters) / 1e6}
  out.clear()
  ids = jnp.asarray(np.random.default_rng(1).permutation(8192)
                    .reshape(16, 512)[:, :256], jnp.int32)

  @jax.jit
  def gather(pool, ids):                 # 16 rounds of 256 pages, in a loop
    def body(i, buf):                    # as the attention paths run them
      blk = jnp.take(pool, ids[i], axis=0, mode="clip")
      return blk.at[0, 0, 0, 0].add(buf[0, 0, 0, 0] * 0)
    return jax.lax.fori_loop(0, ids.shape[0], body,
                             jnp.zeros((ids.shape[1],) + pool.shape[1:],
                                       pool.dtype))

  for dtype in ("float32", "bfloat16"):
    pool = jnp.ones((8192, _PAGE, _HKV, _D), dtype)
    ms = _time(lambda: gather(pool, ids), iters)
    result[f"gather_{dtype}_gbps"] = pool.nbytes / 2 / ms / 1e6
  return result


def main(argv):
  del argv
  jax.config.update("jax_platforms", _BACKEND.value)
  load_at_start = list(os.getloadavg())
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(_DTYPE.value)
  results = []
  bandwidth = _memory_bandwidth(_ITERS.value) if _BANDWIDTH.value else None
  if bandwidth:
    print(json.dumps({"bandwidth": bandwidth}))
  mixes = list(_MIXES.value) + [f"decode{s}@{c}" for s in _SWEEP.value
                                for c in _CONTEXTS.value]
  for mix in mixes:
    num_rows, seqs = _sequences(mix, rng)
    args, kv_bytes = _make_inputs(seqs, num_rows, dtype, rng)
    row = {"mix": mix, "T": num_rows, "num_seqs": len(seqs),
           "kv_tokens": int(np.asarray(args[3]).sum()), "ms": {}, "max_err": {}}
    ref = ragged.reference_attention(*args, sm_scale=_D ** -0.5)
    if _REFERENCE.value:
      row["ms"]["reference"] = _time(
          lambda: ragged.reference_attention(*args, sm_scale=_D ** -0.5), 1)
    for impl in _IMPLS.value:
      if impl == "dense":
        fn = lambda: _dense(*args)
      else:
        fn = lambda impl=impl: ragged.ragged_paged_attention(
            *args, sm_scale=_D ** -0.5, impl=impl)
      row["ms"][impl] = _time(fn, _ITERS.value)
      if _PROFILE_OPS.value:
        row.setdefault("ops", {})[impl] = _op_times(fn, _ITERS.value,
                                                    _PROFILE_OPS.value)
      out = np.asarray(fn(), np.float64)
      row["max_err"][impl] = float(np.abs(out - ref).max())
    base = row["ms"]
    row["speedup_vs_reference"] = {
        k: base["reference"] / v for k, v in base.items() if "reference" in base}
    row["speedup_vs_gather"] = {
        k: base["gather"] / v for k, v in base.items() if "gather" in base}
    row["kv_gbps"] = {k: kv_bytes / v / 1e6 for k, v in base.items()}
    row["kv_mb"] = kv_bytes / 1e6
    if bandwidth:
      row["read_bound_ms"] = kv_bytes / bandwidth["read_gbps"] / 1e6
    if _PEAK.value:
      row["hbm_fraction"] = {k: g / _PEAK.value
                             for k, g in row["kv_gbps"].items()}
    print(json.dumps(row))
    results.append(row)
  meta = {"backend": jax.default_backend(), "device": str(jax.devices()[0]),
          "dtype": _DTYPE.value, "bf16_pages": _BF16_PAGES.value,
          "page_size": _PAGE, "heads": [_HQ, _HKV],
          "head_dim": _D, "max_num_seqs": _S, "pages_per_seq": _PAGES_PER_SEQ,
          "iters": _ITERS.value, "jax": jax.__version__,
          "bandwidth": bandwidth, "host_cpu": host_cpu.host_cpu(),
          "native_unavailable": native.unavailable_reason(),
          "load_average_at_start": load_at_start, "load_average_end": list(os.getloadavg())}
  Path(_OUT.value).write_text(json.dumps({"meta": meta, "results": results},
                                         indent=1))


if __name__ == "__main__":
  cli.run(main)
