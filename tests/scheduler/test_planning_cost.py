"""Planning cost is linear in the queue, and the plans are the ones before.

Two kinds of check, neither timed:

* Plan equality. Every registered policy plans a few seeded random states
  (running decoders, partial prefills, rebuilds, resumed decoders, waiting
  requests, page pressure, several clients, prefix hits); the plans must
  equal the ones recorded in ``expected_plans.json`` from the pairwise,
  loop-per-slot implementation these replaced. The pairwise plan rules of
  ``validate.plan_violations`` are compared slot by slot with a plain
  O(R^2) reference on forged plans (duplicate ids, inverted ranks).
* Shape of the program. In the jaxpr of one policy's plan plus its
  validation at R slots, no value holds R * R elements, and no loop body
  whose trip count grows with R computes a value of R elements (only
  single-slot reads and writes), so each step costs O(1) and the whole plan
  O(R log R) (the sorts).

Regenerate the expectations (only when a policy's decisions change on
purpose): ``PYTHONPATH=. python tests/scheduler/test_planning_cost.py``.
"""

import collections
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scheduler import policy_fairness as pf
from scheduler import records as rec
from scheduler import validate as v
from scheduler.ledger import Budgets
from scheduler.policies import make_policy
from scheduler.registry import POLICIES
from serving.engine import programs as programs_lib

EXPECTED = pathlib.Path(__file__).with_name("expected_plans.json")
PAGE_SIZE = 4
NUM_CLIENTS = 4
MAX_OUTPUT_TOKENS = 32
BUDGETS = {
    "tight": Budgets(token_budget=32, seq_budget=8, chunk_cap=8),
    "quantile": Budgets(token_budget=64, seq_budget=16, chunk_cap=16, watermark_pages=2,
                        reservation="quantile", reservation_quantile=0.75),
}
# (seed, slots, share of live slots that run): two table sizes (one
# compilation each), mixed tables, and mostly-waiting queues where admission
# decides (odd seeds have pages to spare).
STATES = [(0, 48, 0.45), (1, 48, 0.45), (2, 48, 0.45), (3, 48, 0.45), (4, 160, 0.45),
          (5, 160, 0.45), (6, 48, 0.1), (7, 160, 0.1), (9, 48, 0.05), (11, 160, 0.0)]


# ------------------------------------------------------------ random states


def random_policy_state(policy, rng, num_slots: int):
  """Seeded random counters in ``policy``'s own state (VTC, MLFQ, prefix
  streak; None for a policy without state). The draws are the same, in the
  same order, whatever the policy, so the rest of the table is too."""
  n = num_slots
  counter = jnp.asarray(rng.randint(0, 200, size=NUM_CLIENTS), jnp.int32)
  done = jnp.asarray(rng.randint(0, 200, size=NUM_CLIENTS), jnp.int32)
  active = jnp.asarray(rng.rand(NUM_CLIENTS) < 0.5)
  last_left = jnp.int32(rng.randint(0, 100))
  level = jnp.asarray(rng.randint(-1, 4, size=n), jnp.int32)
  used = jnp.asarray(rng.randint(0, 8, size=n), jnp.int32)
  wait = jnp.asarray(rng.randint(0, 10, size=n), jnp.int32)
  hot_streak = jnp.int32(rng.randint(0, 4))
  own = None if policy is None else rec.initial_state(n, NUM_CLIENTS, policy=policy).policy_state
  if isinstance(own, pf.VtcState):
    return own.replace(counter=own.counter.replace(value=counter),
                       done=own.done.replace(value=done),
                       active=own.active.replace(value=active), last_left=last_left)
  if isinstance(own, pf.MlfqState):
    return own.replace(level=own.level.replace(value=level),
                       used=own.used.replace(value=used), wait=own.wait.replace(value=wait))
  if isinstance(own, pf.PrefixState):
    return own.replace(hot_streak=hot_streak)
  assert own is None, f"no random state for {type(own).__name__}"
  return None


def random_state(seed: int, num_slots: int, running_share: float = 0.45, policy=None):
  """(manifest, state, view): a seeded random table of mixed work, with
  random counters in ``policy``'s own state (``random_policy_state``).

  Slots are free (10 %), finished (10 %), or live (80 %): running (a
  ``running_share`` of them: prefill, decode or rebuild) or waiting (fresh,
  part-way through a prefix, recompute-preempted, or resumed at the decode
  frontier); a few are not ready. Pages
  held follow the computed rows; free pages are scarce under even seeds (decode
  rows preempt, admissions block) and plentiful under odd ones.
  """
  rng = np.random.RandomState(seed)
  n = num_slots
  status = rng.choice([rec.FREE, rec.FINISHED, rec.WAITING, rec.RUNNING], size=n,
                      p=[0.10, 0.10, 0.8 * (1 - running_share), 0.8 * running_share]
                      ).astype(np.int32)
  live = (status == rec.WAITING) | (status == rec.RUNNING)
  prompt = rng.randint(1, 41, size=n).astype(np.int32)
  max_tokens = rng.randint(1, MAX_OUTPUT_TOKENS, size=n).astype(np.int32)
  emitted = np.where(rng.rand(n) < 0.5, 0, rng.randint(1, 8, size=n)).astype(np.int32)
  emitted = np.minimum(emitted, max_tokens)
  frontier = prompt + emitted - 1                     # decode frontier when e >= 1
  target = np.where(emitted == 0, prompt, frontier)
  shape = rng.rand(n)
  computed = np.where(emitted == 0, (shape * prompt).astype(np.int32),
                      np.where(shape < 0.5, frontier, (shape * frontier).astype(np.int32)))
  computed = np.clip(computed, 0, np.maximum(target, frontier)).astype(np.int32)
  computed = np.where(live, computed, 0).astype(np.int32)
  held = np.where(live, (computed + PAGE_SIZE - 1) // PAGE_SIZE, 0).astype(np.int32)
  shared = np.minimum(held, rng.randint(0, 2, size=n)).astype(np.int32)
  request_id = np.where(status == rec.FREE, -1, rng.permutation(n) + 100).astype(np.int32)
  arrival_seq = rng.permutation(n).astype(np.int32)
  arrival_ms = (arrival_seq * 3.0 + rng.rand(n)).astype(np.float32)
  now_ms = np.float32(arrival_ms.max() + 50.0)
  last_ms = np.where(emitted > 0, now_ms - rng.randint(1, 60, size=n), -1.0)
  ttft = np.where(rng.rand(n) < 0.7, rng.randint(20, 400, size=n), np.inf)
  tbt = np.where(rng.rand(n) < 0.7, rng.randint(5, 80, size=n), np.inf)
  manifest = rec.WorkloadManifest(
      request_id=jnp.asarray(request_id), arrival_ms=jnp.asarray(arrival_ms),
      arrival_seq=jnp.asarray(arrival_seq), prompt_len=jnp.asarray(prompt),
      max_tokens=jnp.asarray(max_tokens),
      priority=jnp.asarray(rng.randint(0, 3, size=n), jnp.int32),
      client=jnp.asarray(rng.randint(0, NUM_CLIENTS, size=n), jnp.int32),
      ttft_ms=jnp.asarray(ttft, jnp.float32), tbt_ms=jnp.asarray(tbt, jnp.float32))
  completed = np.zeros(MAX_OUTPUT_TOKENS + 1, np.int32)
  completed[rng.randint(1, MAX_OUTPUT_TOKENS, size=12)] += 1
  state = rec.initial_state(n, NUM_CLIENTS, MAX_OUTPUT_TOKENS).replace(
      decision_id=jnp.int32(rng.randint(0, 50)), state_version=jnp.int32(rng.randint(0, 50)),
      now_ms=jnp.float32(now_ms), status=jnp.asarray(status),
      ready=jnp.asarray(live & (rng.rand(n) < 0.9)),
      generation=jnp.asarray(rng.randint(0, 3, size=n), jnp.int32),
      snapshot_version=jnp.asarray(rng.randint(0, 5, size=n), jnp.int32),
      emitted=jnp.asarray(emitted), computed=jnp.asarray(computed),
      committed=jnp.asarray(computed),
      first_token_ms=jnp.asarray(np.where(emitted > 0, last_ms - 5.0, -1.0), jnp.float32),
      last_token_ms=jnp.asarray(last_ms, jnp.float32),
      num_preemptions=jnp.asarray(np.where(rng.rand(n) < 0.2, 1, 0), jnp.int32),
      rebuild_target=jnp.asarray(np.where(emitted > 0, frontier, 0), jnp.int32),
      policy_state=random_policy_state(policy, rng, n),
      completed_outputs=jnp.asarray(completed))
  hits = np.where(live & (emitted == 0) & (rng.rand(n) < 0.4),
                  (rng.rand(n) * prompt).astype(np.int32), 0)
  view = rec.AllocatorView(
      free_pages=jnp.int32(rng.randint(0, 3 * n // 8) if seed % 2 == 0
                           else rng.randint(n, 4 * n)),
      pages_held=jnp.asarray(held),
      page_size=PAGE_SIZE, prefix_hit_tokens=jnp.asarray(hits, jnp.int32),
      reclaimable_pages=jnp.asarray(held - shared))
  return manifest, state, view


# ------------------------------------------------------------ plan equality


_PLAN_ARRAYS = ("selected", "start", "end", "kind", "rank", "admit", "preempt",
                "sort_key", "num_tokens", "num_seqs", "unschedulable", "extend")


@jax.jit
def _violation_bits(manifest, state, plan, view):
  return v.plan_violations(manifest, state, plan, view)


def plan_summary(plan) -> dict:
  """The plan in readable form: selected slots in rank order with their
  ``[start, end)`` and kind, intent lists, ledger, and a sha256 of every
  plan array (``None`` ones as the word)."""
  arr = {k: None if getattr(plan, k) is None else np.asarray(getattr(plan, k))
         for k in _PLAN_ARRAYS}
  ranked = np.argsort(np.where(arr["selected"], arr["rank"], 1 << 30), kind="stable")
  ranked = ranked[:int(arr["selected"].sum())]
  digest = hashlib.sha256()
  for k in _PLAN_ARRAYS:
    digest.update(k.encode())
    digest.update(b"None" if arr[k] is None else arr[k].astype(np.int64).tobytes())
  slots = lambda mask: [] if mask is None else np.flatnonzero(mask).tolist()
  return {
      "rows": [[int(s), int(arr["start"][s]), int(arr["end"][s]), int(arr["kind"][s])]
               for s in ranked],
      "admit": slots(arr["admit"]), "preempt": slots(arr["preempt"]),
      "extend": slots(arr["extend"]), "unschedulable": slots(arr["unschedulable"]),
      "num_tokens": int(arr["num_tokens"]), "num_seqs": int(arr["num_seqs"]),
      "sha256": digest.hexdigest(),
  }


def all_summaries() -> dict:
  """``{"policy/budgets/seed": plan_summary}`` over every registered policy."""
  out = {}
  for name in sorted(POLICIES):
    for budget_name, budgets in BUDGETS.items():
      policy = make_policy(name, budgets)
      plan_fn = jax.jit(lambda m, s, a, policy=policy: policy(m, s, a))
      for seed, num_slots, running_share in STATES:
        manifest, state, view = random_state(seed, num_slots, running_share, policy)
        plan = plan_fn(manifest, state, view)
        bits = _violation_bits(manifest, state, plan, view)
        broken = sorted(k for k, b in bits.items() if bool(np.any(b)))
        assert not broken, f"{name}/{budget_name}/{seed}: plan rules {broken}"
        out[f"{name}/{budget_name}/{seed}"] = plan_summary(plan)
  return out


@pytest.mark.extended   # ~200 s on 2 cores: a plan program per policy, budget and queue size
def test_every_policy_plans_as_recorded():
  """Same plans, slot for slot, as the recorded ones, for every policy."""
  expected = json.loads(EXPECTED.read_text())
  got = all_summaries()
  assert sorted(got) == sorted(expected)
  # The workload exercises the paths that matter: admissions, preemptions,
  # and (ORCA) unschedulable requests.
  assert sum(len(s["preempt"]) for s in got.values()) > 20
  assert sum(len(s["admit"]) for s in got.values()) > 100
  for key in sorted(expected):
    assert got[key] == expected[key], key


# ------------------------------------------------------ key order


def test_key_order_is_lexsorts_stable_order():
  """``key_order``'s packed sorts (one word or two) give ``jnp.lexsort``'s
  order on tables of every kind: ties (small ranges, constant and negative
  columns), ranges that fit one word or need both, full 32-bit columns (the
  lexsort fallback), and columns that copy an earlier one (which take no
  bits: a copy of a wide column leaves a table in one word), at slot
  counts with 3, 7, 8, 9 and 11 slot bits."""
  from scheduler.keys import key_order
  rng = np.random.RandomState(7)
  order = jax.jit(key_order)
  kinds = [lambda n: rng.randint(0, 4, n), lambda n: rng.randint(-3, 3, n),
           lambda n: np.full(n, 5), lambda n: rng.randint(0, 20000, n),
           lambda n: rng.randint(-2**31, 2**31, n, dtype=np.int64)]
  words = collections.Counter()
  for n in (5, 96, 256, 300, 2000):
    for _ in range(16):
      num_keys = rng.randint(1, 6)
      keys = np.stack([kinds[rng.randint(len(kinds))](n) for _ in range(num_keys)],
                      axis=1).astype(np.int32)
      if num_keys >= 2 and rng.rand() < 0.4:      # a later column copies an earlier one
        j = rng.randint(1, num_keys)
        keys[:, j] = keys[:, rng.randint(j)]
      want = np.lexsort(keys.T[::-1])
      np.testing.assert_array_equal(np.asarray(order(jnp.asarray(keys))), want)
      spans = [int(keys[:, j].astype(np.int64).max() - keys[:, j].astype(np.int64).min())
               if not any((keys[:, i] == keys[:, j]).all() for i in range(j)) else 0
               for j in range(num_keys)]
      bits, digit = sum(s.bit_length() for s in spans), 32 - max(1, (n - 1).bit_length())
      words[1 if bits <= digit else 2 if bits <= 2 * digit else "lexsort"] += 1
  assert words[1] > 15 and words[2] > 10 and words["lexsort"] > 5, words


def test_sort_u32_is_a_sort_natively_on_the_cpu():
  """``keys.sort_u32`` (the native radix sort on the CPU) gives
  ``np.sort``'s values for every digit pattern its passes treat apart: all
  values equal (no pass), one byte varying (one pass), every byte, packed
  keys over a slot lane, duplicates, sizes 0-4,097 and under ``vmap``; and
  the jitted program calls the kernel (not ``jax.lax.sort``)."""
  from attention import native_build
  from scheduler import keys
  reason = native_build.load(keys.SORT_KERNEL)
  if reason is not None:
    pytest.skip(f"the native sort does not run here: {reason}")
  rng = np.random.default_rng(11)
  sort = jax.jit(keys.sort_u32)
  patterns = [lambda n: np.full(n, 7), lambda n: rng.integers(0, 256, n),
              lambda n: rng.integers(0, 256, n) << 24, lambda n: rng.integers(0, 2**32, n),
              lambda n: (rng.integers(0, 2**18, n) << 14) | rng.permutation(n),
              lambda n: rng.integers(0, 3, n) * 0x01010101]
  for n in (0, 1, 2, 255, 256, 257, 4097):
    for make in patterns:
      values = np.asarray(make(n), np.uint64).astype(np.uint32)
      np.testing.assert_array_equal(np.asarray(sort(jnp.asarray(values))), np.sort(values))
  # ordered_low_bits: the passes over the low bits left out where they
  # ascend (the key order's slot lane), every bit sorted where they do not.
  for n in (1, 2, 255, 4097, 16384):
    slot_bits = max(1, (n - 1).bit_length())
    for key_bits in (0, 3, 18, 32 - slot_bits):
      lane = np.arange(n, dtype=np.uint64)
      packed = ((rng.integers(0, 2**key_bits, n).astype(np.uint64) << np.uint64(slot_bits))
                | lane).astype(np.uint32)
      anything = rng.integers(0, 2**32, n).astype(np.uint32)
      for values, b in ((packed, slot_bits), (anything, slot_bits), (packed, 0),
                        (np.sort(anything), 32), (anything, 32)):
        got = jax.jit(lambda v, b=b: keys.sort_u32(v, b))(jnp.asarray(values))
        np.testing.assert_array_equal(np.asarray(got), np.sort(values))
  batch = rng.integers(0, 2**32, (3, 300)).astype(np.uint32)
  np.testing.assert_array_equal(np.asarray(jax.vmap(keys.sort_u32)(jnp.asarray(batch))),
                                np.sort(batch, axis=1))
  assert keys.SORT_TARGET in sort.lower(jnp.zeros(8, jnp.uint32)).as_text()
  assert keys.sort_impl() == "native radix sort"
  with pytest.raises(ValueError, match=r"u32\[n\], got uint32\[2, 3\]"):
    keys.sort_u32(jnp.zeros((2, 3), jnp.uint32))
  with pytest.raises(ValueError, match=r"got int32\[4\]"):
    keys.sort_u32(jnp.zeros(4, jnp.int32))
  for bad in (33, -1, 1.5, True, "3", None):
    with pytest.raises(ValueError, match=r"ordered_low_bits must be a static int in \[0, 32\], "
                                         rf"got {re.escape(repr(bad))}$"):
      keys.sort_u32(jnp.zeros(4, jnp.uint32), bad)


def test_scan_kernels_give_xla_bits_natively_on_the_cpu():
  """``scan``'s kernels (native on the CPU) give the ``jnp`` forms' and
  numpy's bits: ``cumsum_i32`` for bools and int32s of sizes 0-4,097,
  wrapping an int32 overflow as XLA and numpy do; ``suffix_min_i32``;
  ``inverse_permutation``
  and ``stable_partition`` for random permutations and masks (none, all,
  some held); each under ``vmap``; the jitted programs call the kernels
  (no ``reduce-window``, no ``scatter``); other dtypes and shapes are
  refused by name."""
  from attention import native_build
  from scheduler import scan
  reason = native_build.load(scan.SCAN_KERNEL)
  if reason is not None:
    pytest.skip(f"the native scan kernels do not run here: {reason}")
  rng = np.random.default_rng(5)
  cumsum = jax.jit(scan.cumsum_i32)
  inverse = jax.jit(scan.inverse_permutation)
  partition = jax.jit(scan.stable_partition)
  for n in (0, 1, 2, 255, 256, 4097):
    ints = rng.integers(-2**31, 2**31, n).astype(np.int32)     # overflows wrap
    small = rng.integers(-3, 40, n).astype(np.int32)
    flags = rng.random(n) < 0.3
    for values in (ints, small, flags):
      got = np.asarray(cumsum(jnp.asarray(values)))
      assert got.dtype == np.int32
      np.testing.assert_array_equal(got, np.cumsum(values.astype(np.int32), dtype=np.int32))
    least = np.asarray(jax.jit(scan.suffix_min_i32)(jnp.asarray(ints)))
    np.testing.assert_array_equal(least, np.minimum.accumulate(ints[::-1])[::-1])
    order = rng.permutation(n).astype(np.int32)
    pos = np.empty(n, np.int32)
    pos[order] = np.arange(n)
    np.testing.assert_array_equal(np.asarray(inverse(jnp.asarray(order))), pos)
    for mask in (np.zeros(n, bool), np.ones(n, bool), rng.random(n) < 0.4):
      walk, count = partition(jnp.asarray(order), jnp.asarray(mask))
      held = order[mask[order]]
      np.testing.assert_array_equal(np.asarray(walk),
                                    np.concatenate([held, order[~mask[order]]]))
      assert int(count) == len(held)
  batch = rng.integers(-9, 9, (3, 300)).astype(np.int32)
  np.testing.assert_array_equal(np.asarray(jax.vmap(scan.cumsum_i32)(jnp.asarray(batch))),
                                np.cumsum(batch, axis=1, dtype=np.int32))
  orders = np.stack([rng.permutation(300) for _ in range(3)]).astype(np.int32)
  masks = rng.random((3, 300)) < 0.5
  walks, counts = jax.vmap(scan.stable_partition)(jnp.asarray(orders), jnp.asarray(masks))
  for o, m, w, c in zip(orders, masks, np.asarray(walks), np.asarray(counts)):
    np.testing.assert_array_equal(w, np.concatenate([o[m[o]], o[~m[o]]]))
    assert c == m.sum()
  np.testing.assert_array_equal(np.asarray(jax.vmap(scan.inverse_permutation)(
      jnp.asarray(orders))), np.argsort(orders, axis=1))
  z, f = jnp.zeros(8, jnp.int32), jnp.zeros(8, bool)
  for fn, target, args in ((cumsum, scan.CUMSUM_TARGET, (z,)),
                           (jax.jit(scan.suffix_min_i32), scan.SUFFIX_MIN_TARGET, (z,)),
                           (inverse, scan.INVERSE_TARGET, (z,)),
                           (partition, scan.PARTITION_TARGET, (z, f))):
    text = fn.lower(*args).as_text()
    assert target in text and "reduce_window" not in text and "scatter" not in text
  assert scan.scan_impl() == "native"
  # Narrower integers and host arrays are taken as int32 (numpy's int64 is
  # int32 without jax_enable_x64); an entry outside [0, R) fails the program.
  np.testing.assert_array_equal(np.asarray(scan.cumsum_i32(np.array([3, -1, 2], np.int16))),
                                [3, 2, 4])
  np.testing.assert_array_equal(np.asarray(scan.inverse_permutation(np.array([2, 0, 1],
                                                                            np.int32))),
                                [1, 2, 0])
  with pytest.raises(Exception, match=r"order\[1\] = 3 is outside \[0, 3\)"):
    np.asarray(inverse(jnp.asarray([0, 3, 1], jnp.int32)))
  with pytest.raises(Exception, match=r"order\[1\] = -1 is outside \[0, 3\)"):
    np.asarray(partition(jnp.asarray([0, -1, 1], jnp.int32), jnp.ones(3, bool))[0])
  with pytest.raises(ValueError, match=r"mask must have order's length 4 \(one flag per slot\), "
                                       r"got 2"):
    scan.stable_partition(jnp.arange(4, dtype=jnp.int32), jnp.ones(2, bool))
  # A host array of int64 is taken where its values fit in int32, refused
  # (not truncated, as JAX's conversion would) where they do not.
  np.testing.assert_array_equal(np.asarray(scan.cumsum_i32(np.array([4, 5], np.int64))), [4, 9])
  with pytest.raises(ValueError, match=r"inverse_permutation: order must be a vector of int32 "
                                       r"or a narrower integer, got int64\[2\]"):
    scan.inverse_permutation(np.array([2**32, 0], np.int64))
  with pytest.raises(ValueError, match=r"got float64\[3\]"):
    scan.cumsum_i32(np.zeros(3))
  with pytest.raises(ValueError, match=r"cumsum_i32: values must be a vector of bool or of int32 "
                                       r"or a narrower integer, got int32\[2, 3\]"):
    scan.cumsum_i32(jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match=r"got float32\[4\]"):
    scan.cumsum_i32(jnp.zeros(4, jnp.float32))
  with pytest.raises(ValueError, match=r"stable_partition: mask must be a vector of bool, "
                                       r"got int32\[8\]"):
    scan.stable_partition(z, z)


def test_without_a_compiler_the_key_order_says_it_sorts_with_xla(tmp_path):
  """Where the native kernels cannot build (no compiler, an empty kernel
  cache), ``sort_u32`` falls back to ``jax.lax.sort`` and ``scan``'s
  functions to their ``jnp`` forms, with the same values, and ``sort_impl``
  and ``scan_impl`` (which reports record) say so and why."""
  code = ("import jax, jax.numpy as jnp, numpy as np; from scheduler import keys; "
          "v = np.random.default_rng(3).integers(0, 2**32, 1000).astype(np.uint32); "
          "s = jax.jit(keys.sort_u32); "
          "assert (np.asarray(s(jnp.asarray(v))) == np.sort(v)).all(); "
          "assert keys.SORT_TARGET not in s.lower(jnp.asarray(v)).as_text(); "
          "from scheduler import scan; c = jax.jit(scan.cumsum_i32); "
          "w = (v % 7).astype(np.int32); o = np.argsort(v).astype(np.int32); "
          "assert (np.asarray(c(jnp.asarray(w))) == np.cumsum(w, dtype=np.int32)).all(); "
          "p = jax.jit(scan.stable_partition); m = jnp.asarray(w > 2); "
          "assert (np.asarray(p(jnp.asarray(o), m)[0]) == np.concatenate("
          "[o[(w > 2)[o]], o[(w <= 2)[o]]])).all(); "
          "assert (np.asarray(jax.jit(scan.inverse_permutation)(jnp.asarray(o)))"
          " == np.argsort(o)).all(); "
          "s = np.asarray(jax.jit(scan.suffix_min_i32)(jnp.asarray(w - 3))); "
          "assert (s == np.minimum.accumulate((w - 3)[::-1])[::-1]).all(); "
          "assert scan.CUMSUM_TARGET not in c.lower(jnp.asarray(w)).as_text(); "
          "print(keys.sort_impl()); print(scan.scan_impl())")
  env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"),
             ITERSERVE_NATIVE_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=pathlib.Path(__file__).resolve().parents[2], check=True).stdout
  why = f"C++ compiler '{tmp_path / 'no-such-c++'}' not found (set CXX)"
  assert out.splitlines() == [f"jax.lax.sort ({why})", f"xla ({why})"]


# ------------------------------------------------------ decode runs


def _decoding_state(seed: int, num_slots: int = 160):
  """``random_state`` with nine in ten running slots moved to their decode
  frontier (pages held to match): long runs of decode rows, some of them
  needing a page, scarce pages under even seeds."""
  manifest, state, view = random_state(seed, num_slots, 0.9)
  rng = np.random.RandomState(1000 + seed)
  running = np.asarray(state.status) == rec.RUNNING
  prompt = np.asarray(manifest.prompt_len)
  emitted = np.where(running, np.maximum(np.asarray(state.emitted), 1),
                     np.asarray(state.emitted)).astype(np.int32)
  frontier = prompt + emitted - 1
  computed = np.where(running & (rng.rand(num_slots) < 0.9), frontier,
                      np.asarray(state.computed)).astype(np.int32)
  held = np.where(np.asarray(view.pages_held) > 0,
                  (computed + PAGE_SIZE - 1) // PAGE_SIZE, 0).astype(np.int32)
  shared = np.asarray(view.pages_held) - np.asarray(view.reclaimable_pages)
  manifest = manifest.replace(max_tokens=jnp.asarray(
      np.maximum(np.asarray(manifest.max_tokens), emitted + 1), jnp.int32))
  state = state.replace(
      emitted=jnp.asarray(emitted), computed=jnp.asarray(computed),
      committed=jnp.asarray(computed), ready=state.ready | jnp.asarray(running),
      rebuild_target=jnp.asarray(np.where(emitted > 0, frontier, 0), jnp.int32))
  view = view.replace(pages_held=jnp.asarray(held),
                      reclaimable_pages=jnp.asarray(held - np.minimum(shared, held)))
  return manifest, state, view


@pytest.mark.parametrize("name", [
    "sarathi_serve",
    # ~25 s each on 2 cores (four plan programs at R = 160).
    pytest.param("sarathi", marks=pytest.mark.extended),
    pytest.param("fastserve", marks=pytest.mark.extended),
    pytest.param("vtc", marks=pytest.mark.extended)])
def test_decode_runs_plan_as_one_offer_per_row(name, monkeypatch):
  """``take_decode_run`` (up to ``DECODE_RUN`` decode rows in one step)
  leaves the plan that offering each row on its own leaves (``DECODE_RUN
  = 0``), on wide budgets where runs span several windows and on scarce
  pages where a run stops at a row that must preempt. The policies cover
  FCFS break, one anchor chunk, running-only walks and no break."""
  from scheduler import ledger as policies
  wide = [Budgets(token_budget=256, seq_budget=96, chunk_cap=16),
          Budgets(token_budget=256, seq_budget=96, chunk_cap=16, watermark_pages=2,
                  reservation="quantile", reservation_quantile=0.75)]
  states = [_decoding_state(seed) for seed in (21, 24, 28, 30)]   # 1-577 free pages

  def plans(run):
    monkeypatch.setattr(policies, "DECODE_RUN", run)
    out = []
    for budgets in wide:
      policy = make_policy(name, budgets)
      plan_fn = jax.jit(lambda m, s, a: policy(m, s, a))
      out += [plan_summary(plan_fn(*state)) for state in states]
    return out

  window = policies.DECODE_RUN
  one_by_one = plans(0)
  assert plans(window) == one_by_one
  decode_rows = [sum(1 for row in p["rows"] if row[3] == rec.DECODE_ROW)
                 for p in one_by_one]
  assert max(decode_rows) > 32                    # more than one window
  assert sum(len(p["preempt"]) for p in one_by_one) > 0


# ---------------------------------------------------- pairwise plan rules


def _pairwise_reference(manifest, state, plan, keys):
  """The three pairwise rules of ``plan_violations`` as plain O(R^2) loops
  over numpy arrays: ``duplicate_generation``, ``duplicate_member`` and the
  rank-inversion half of ``tie_break``."""
  rid = np.asarray(manifest.request_id)
  gen = np.asarray(plan.generation)
  sel = np.asarray(plan.selected)
  admit = np.asarray(plan.admit)
  rank = np.asarray(plan.rank)
  status = np.asarray(state.status)
  live = (status == rec.WAITING) | (status == rec.RUNNING)
  keys = [tuple(row) for row in np.asarray(keys).tolist()]
  n = rid.shape[0]
  dup_gen = np.zeros(n, bool)
  dup_member = np.zeros(n, bool)
  inverted = np.zeros(n, bool)
  for i in range(n):
    for j in range(n):
      if i == j:
        continue
      if rid[i] == rid[j] and gen[i] == gen[j] and sel[i] and sel[j]:
        dup_gen[i] = True
      if rid[i] == rid[j] and live[j] and (sel[i] or admit[i]):
        dup_member[i] = True
      if sel[i] and sel[j] and keys[i] < keys[j] and rank[i] > rank[j]:
        inverted[i] = True
  return dup_gen, dup_member, inverted


@pytest.mark.parametrize("seed", range(6))
def test_pairwise_plan_rules_match_the_quadratic_reference(seed):
  """Forged plans: request ids drawn from few values (duplicates), random
  selection and generations, ranks shuffled with ties; every pairwise rule
  flags exactly the slots the O(R^2) definition flags."""
  rng = np.random.RandomState(100 + seed)
  policy = make_policy("vllm_v1_priority", BUDGETS["tight"])
  manifest, state, view = random_state(seed, 48)
  n = manifest.num_slots
  manifest = manifest.replace(
      request_id=jnp.asarray(rng.randint(0, 12, size=n), jnp.int32))
  plan = jax.jit(lambda m, s, a: policy(m, s, a))(manifest, state, view)
  sel = rng.rand(n) < 0.6
  rank = np.where(sel, rng.randint(-1, n // 2, size=n), -1)
  keys = np.asarray(policy.sort_keys(manifest, state, view))
  if seed % 2:           # collapse key columns so equal keys are common
    keys = keys.copy()
    keys[:, 1:] = keys[:, 1:] % 2
  plan = plan.replace(
      selected=jnp.asarray(sel), rank=jnp.asarray(rank, jnp.int32),
      generation=jnp.asarray(rng.randint(0, 2, size=n), jnp.int32),
      admit=jnp.asarray(rng.rand(n) < 0.3), sort_key=jnp.asarray(keys, jnp.int32))
  bits = _violation_bits(manifest, state, plan, view)
  dup_gen, dup_member, inverted = _pairwise_reference(manifest, state, plan, keys)
  assert dup_gen.any() and dup_member.any() and inverted.any()
  np.testing.assert_array_equal(np.asarray(bits["duplicate_generation"]), dup_gen)
  np.testing.assert_array_equal(np.asarray(bits["duplicate_member"]), dup_member)
  # With the recorded keys forged, tie_break also flags the slots whose
  # recorded key differs from the replayed one.
  replay_differs = np.any(keys != np.asarray(policy.sort_keys(manifest, state, view)),
                          axis=1)
  np.testing.assert_array_equal(np.asarray(bits["tie_break"]), inverted | replay_differs)


@pytest.mark.parametrize("seed", range(4))
def test_pairwise_rules_on_positional_ranks_match_the_reference(seed):
  """Plans whose ranks are positions (each of 0 .. n-1 once) and whose ids
  are distinct, as a policy's are: the checks that count instead of sorting
  (ids modulo 4R, keys compared along the rank order) flag what the O(R^2)
  definition flags. Keys in rank order (no inversion) or with one adjacent
  pair swapped; ids 0 .. R-1 (no two in a bucket) or multiples of 4R (all
  in one bucket, the sorted check decides), one id repeated in odd seeds."""
  rng = np.random.RandomState(200 + seed)
  policy = make_policy("vllm_v1_priority", BUDGETS["tight"])
  manifest, state, view = random_state(seed, 48)
  n = manifest.num_slots
  rid = np.arange(n) * (4 * n if seed >= 2 else 1)
  if seed % 2:
    rid[7] = rid[3]
  manifest = manifest.replace(request_id=jnp.asarray(rid, jnp.int32))
  plan = jax.jit(lambda m, s, a: policy(m, s, a))(manifest, state, view)
  sel = rng.rand(n) < 0.6
  rank = np.full(n, -1)
  rank[sel] = rng.permutation(int(sel.sum()))
  keys = np.zeros((n, 3), np.int32)
  keys[sel, 0] = np.sort(rng.randint(0, 5, size=int(sel.sum())))[rank[sel]]
  keys[:, 1] = rng.randint(0, 3, size=n)
  keys[sel, 1] = 0                                # equal keys: ties allowed
  if seed in (0, 3):                              # one inversion
    first, second = np.flatnonzero(sel)[np.argsort(rank[sel])][[2, 3]]
    keys[first, 0], keys[second, 0] = 9, 1
  plan = plan.replace(
      selected=jnp.asarray(sel), rank=jnp.asarray(rank, jnp.int32),
      generation=jnp.zeros((n,), jnp.int32), admit=jnp.zeros((n,), bool),
      sort_key=jnp.asarray(keys))
  live = np.isin(np.asarray(state.status), (rec.WAITING, rec.RUNNING))
  member = jnp.asarray(live | sel)
  shares = bool(v._shares_an_id(jnp.asarray(rid, jnp.int32), member))  # pylint: disable=protected-access
  assert shares == (seed % 2 == 1 and bool(live[3] | sel[3]) and bool(live[7] | sel[7]))
  _, _, inverted = _pairwise_reference(manifest, state, plan, keys)
  assert inverted.any() == (seed in (0, 3))
  got = v._rank_inverted(jnp.asarray(keys), jnp.asarray(sel), jnp.asarray(rank, jnp.int32),  # pylint: disable=protected-access
                         v._ranks_are_positions(jnp.asarray(sel), jnp.asarray(rank)))  # pylint: disable=protected-access
  np.testing.assert_array_equal(np.asarray(got), inverted)


def test_rank_inversion_of_keys_other_than_int32_compares_as_the_sort_does():
  """Keys of another dtype skip the adjacent-rank shortcut: the key-order
  check casts each column to int32 (0.2 and 0.7 tie, 3 < 5 decides), so the
  slot ranked second is inverted although its float key is larger."""
  keys = jnp.asarray([[0.2, 5.0], [0.7, 3.0]], jnp.float32)
  sel, rank = jnp.asarray([True, True]), jnp.asarray([0, 1], jnp.int32)
  got = v._rank_inverted(keys, sel, rank, v._ranks_are_positions(sel, rank))  # pylint: disable=protected-access
  assert np.asarray(got).tolist() == [False, True]


@pytest.mark.parametrize("slots", [64, 1500, 2048])
def test_rows_bound_sum_of_largest_matches_sorting(slots):
  """``_sum_of_largest`` (one ``sort_u32``) equals numpy's sum of the k
  largest, ties and k = 0, 1, R and > R included."""
  rng = np.random.RandomState(slots)
  width = rng.randint(0, 40, size=slots) * (rng.rand(slots) < 0.7)
  width[:5] = 2**27 + 3                          # large values, repeated
  fn = jax.jit(programs_lib._sum_of_largest)     # pylint: disable=protected-access
  for k in (0, 1, 3, 5, 6, slots // 3, slots, slots + 7):
    expected = int(np.sort(width)[::-1][:k].sum())
    assert int(fn(jnp.asarray(width, jnp.int32), jnp.int32(k))) == expected


# ------------------------------------------------------- program shape

_LOOPS = ("while", "scan")
# Single-slot writes and control flow: O(1) per loop step (in place).
_PER_STEP_OK = ("dynamic_update_slice", "scatter", "cond", "while", "scan", "pjit",
                "closed_call", "custom_jvp_call", "custom_vjp_call")


def _sub_jaxprs(eqn):
  for param in eqn.params.values():
    for item in (param if isinstance(param, (list, tuple)) else [param]):
      if hasattr(item, "eqns"):                       # a Jaxpr
        yield item
      elif hasattr(getattr(item, "jaxpr", None), "eqns"):   # a ClosedJaxpr
        yield item.jaxpr


def _size(var):
  shape = getattr(var.aval, "shape", ())
  return int(np.prod(shape)) if shape else 1


def program_faults(jaxpr, num_slots: int, in_loop: bool = False):
  """Equations that make a plan superlinear in ``num_slots``: any value of
  ``num_slots**2`` elements or more, and, inside a loop body, any equation
  other than a single-slot write or control flow that produces a value of
  ``num_slots`` elements or more (an O(R) step repeated up to R times)."""
  faults = []
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    big = max((_size(o) for o in eqn.outvars), default=0)
    if big >= num_slots * num_slots:
      faults.append(f"{name} -> {[o.aval for o in eqn.outvars]}")
    elif in_loop and big >= num_slots and name not in _PER_STEP_OK:
      faults.append(f"{name} in a loop -> {[o.aval for o in eqn.outvars]}")
    for sub in _sub_jaxprs(eqn):
      faults += program_faults(sub, num_slots, in_loop or name in _LOOPS)
  return faults


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_plan_and_validation_are_linear_in_the_queue(name):
  """No R x R value anywhere, and no O(R) work per loop step, in the jaxpr
  of the policy's plan plus ``plan_violations`` (what the engine's plan
  program runs), at R = 96 slots."""
  policy = make_policy(name, BUDGETS["tight"])
  manifest, state, view = random_state(0, 96)

  def plan_and_check(manifest, state, view):
    plan = policy(manifest, state, view)
    return plan, v.any_violation(v.plan_violations(manifest, state, plan, view))

  jaxpr = jax.make_jaxpr(plan_and_check)(manifest, state, view).jaxpr
  assert program_faults(jaxpr, 96) == []


def test_program_faults_sees_quadratic_constructs():
  """The check itself: a pairwise matrix and an O(R) reduction per scan step
  are both reported."""
  x = jnp.arange(96)
  pairwise = jax.make_jaxpr(lambda x: jnp.any(x[:, None] < x[None, :], axis=1))(x)
  looped = jax.make_jaxpr(lambda x: jax.lax.scan(
      lambda c, s: (c + jnp.sum(x < s), None), 0, x)[0])(x)
  single = jax.make_jaxpr(lambda x: jax.lax.fori_loop(
      0, 96, lambda i, c: c.at[i].set(x[i] + 1), x))(x)
  assert program_faults(pairwise.jaxpr, 96)
  assert program_faults(looped.jaxpr, 96)
  assert program_faults(single.jaxpr, 96) == []


if __name__ == "__main__":
  EXPECTED.write_text(json.dumps(all_summaries(), indent=1, sort_keys=True) + "\n")
  print(f"wrote {EXPECTED}")
