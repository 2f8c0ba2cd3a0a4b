"""Automatic prefix caching: keys, shared pages, eviction, and exact hits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from serving.kv import pages as kv_pages
from serving.kv import prefix_cache as pc
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine
from serving.kv.pages import NULL_PAGE
from tests.serving.engine_testing import CFG, prompts as _prompts

SLOTS, PAGES_PER_SEQ, NUM_PAGES, PS = 4, 6, 14, 4
allocate = jax.jit(kv_pages.allocate, static_argnames=("max_new_per_slot",))
deallocate = jax.jit(kv_pages.deallocate)
map_prefix = jax.jit(kv_pages.map_prefix)
sync_cached = jax.jit(kv_pages.sync_cached)

BASE = EngineConfig.preset("tiny")            # page 4, chunk cap 8, 4 seqs
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


def test_chain_keys_share_exactly_the_equal_prefix_and_the_root():
  root = pc.root_key("m", "float32", 4)
  a = pc.chain_keys(root, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 2)
  b = pc.chain_keys(root, [1, 2, 3, 4, 5, 6, 7, 0], 4, 2)
  assert a[0] == b[0] and a[1] != b[1]
  assert pc.chain_keys(pc.root_key("m", "bfloat16", 4), [1, 2, 3, 4], 4, 1)[0] != a[0]
  # The same page content after a different predecessor is a different key.
  assert pc.chain_keys(root, [0, 0, 0, 0, 5, 6, 7, 8], 4, 2)[1] != a[1]
  with pytest.raises(ValueError, match="num_pages 3"):
    pc.chain_keys(root, [1] * 9, 4, 3)


def _check(pages, cache=None):
  """The allocator invariant: census, refcounts equal to table holders, the
  null page never held, and the three sets disjoint."""
  num_pages = pages.num_pages
  table, held = np.asarray(pages.page_table), np.asarray(pages.pages_held)
  refcount, cached = np.asarray(pages.refcount), np.asarray(pages.cached)
  free = np.asarray(pages.free_stack)[: int(pages.num_free)].tolist()
  holders = np.zeros(num_pages, int)
  for s in range(table.shape[0]):
    live = table[s, : held[s]]
    assert NULL_PAGE not in live.tolist()
    assert np.all(table[s, held[s]:] == NULL_PAGE)
    np.add.at(holders, live, 1)
  assert holders.tolist() == refcount.tolist()
  evictable = np.flatnonzero(cached & (refcount == 0)).tolist()
  in_use = np.flatnonzero(refcount > 0).tolist()
  assert sorted(free + evictable + in_use) == list(range(1, num_pages))
  n_free, n_evict, n_use = map(int, kv_pages.page_census(pages))
  assert (n_free, n_evict, n_use) == (len(free), len(evictable), len(in_use))
  assert n_free + n_evict + n_use == num_pages - 1
  if cache is not None:
    assert cache.cached_mask().tolist() == cached.tolist()


# Prompts from two shared "system prompts" so that hits happen often.
_HEADS = ([5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 1, 2, 3, 4])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "finish", "evict"]),
                          st.integers(0, SLOTS - 1), st.integers(0, 1),
                          st.integers(1, 14)), min_size=1, max_size=25))
def test_random_share_release_and_evict_keep_every_page_accounted(ops):
  """Admissions with hits, growth, registration, releases (finish, abort and
  recompute preemption release alike) and LRU evictions, against the census."""
  pages = kv_pages.init_pages(SLOTS, PAGES_PER_SEQ, NUM_PAGES, PS)
  cache = pc.PrefixCache(NUM_PAGES, PS, pc.root_key("test"))
  live = {}                                    # slot -> (keys, rows)
  for op, slot, head, n in ops:
    if op == "admit" and slot not in live:
      prompt = (_HEADS[head] + [head + 20 + n] * n)[:PAGES_PER_SEQ * PS - 1]
      keys = cache.keys_for(prompt)
      hit = cache.match(keys, len(prompt))
      ids = np.full(PAGES_PER_SEQ, NULL_PAGE, np.int32)
      ids[:len(hit)] = hit
      pages = map_prefix(pages, jnp.int32(slot), jnp.asarray(ids), jnp.int32(len(hit)))
      live[slot] = (keys, len(hit) * PS, len(prompt))
    elif op == "grow" and slot in live:
      keys, rows, p = live[slot]
      rows = min(rows + n, p)
      need_rows = np.zeros(SLOTS, np.int32)
      need_rows[slot] = rows
      held = np.asarray(pages.pages_held)
      short = max(kv_pages.pages_for(rows, PS) - int(held[slot]), 0) - int(pages.num_free)
      if short > int(kv_pages.num_evictable(pages)):
        continue                               # the policy would not plan it
      if short > 0:
        before = np.asarray(pages.refcount).copy()
        victims = cache.evict(short, before)
        assert all(before[v] == 0 for v in victims)
        pages = sync_cached(pages, jnp.asarray(cache.cached_mask()))
      pages = allocate(pages, jnp.asarray(need_rows), max_new_per_slot=PAGES_PER_SEQ)
      assert int(np.asarray(pages.pages_held)[slot]) == kv_pages.pages_for(rows, PS)
      full = rows // PS
      cache.register(keys[:full], np.asarray(pages.page_table)[slot, :full])
      pages = sync_cached(pages, jnp.asarray(cache.cached_mask()))
      live[slot] = (keys, rows, p)
    elif op == "finish" and slot in live:
      mask = np.zeros(SLOTS, bool)
      mask[slot] = True
      # A policy crediting this victim with its reclaimable pages never
      # counts on more than its release really makes available.
      view = kv_pages.view(pages)
      credit = int(view.free_pages) + int(np.asarray(view.reclaimable_pages)[slot])
      pages = deallocate(pages, jnp.asarray(mask))
      assert credit <= int(pages.num_free) + int(kv_pages.num_evictable(pages))
      del live[slot]
    elif op == "evict":
      refcount = np.asarray(pages.refcount)
      k = min(n, int(kv_pages.num_evictable(pages)))
      victims = cache.evict(k, refcount)
      assert len(victims) == k and all(refcount[v] == 0 for v in victims)
      pages = sync_cached(pages, jnp.asarray(cache.cached_mask()))
    _check(pages, cache)
  pages = deallocate(pages, jnp.ones(SLOTS, bool))
  _check(pages, cache)
  assert int(kv_pages.page_census(pages)[2]) == 0


def test_eviction_is_lru_with_the_chain_tail_first_and_refuses_held_pages():
  cache = pc.PrefixCache(8, 2, pc.root_key("t"))
  a = cache.keys_for([1, 2, 3, 4, 5, 6])        # 3 pages, used at tick 1
  cache.register(a, [1, 2, 3])
  b = cache.keys_for([9, 9, 8, 8])              # 2 pages, used at tick 2
  cache.register(b, [4, 5])
  refcount = np.zeros(8, int)
  refcount[4] = 1                               # page 4 is in a live table
  # Oldest chain first, deepest page of it first; then the newer chain.
  assert cache.evict(2, refcount) == [3, 2]
  assert cache.evict(2, refcount) == [1, 5]
  with pytest.raises(RuntimeError, match="only 0 cached pages are unreferenced"):
    cache.evict(1, refcount)
  assert cache.cached_mask().tolist() == [False] * 4 + [True] + [False] * 3


# ------------------------------------------------------------------ engine
def _engine(params, config=BASE):
  return Engine(CFG, params, config)


def _staggered(engine, prompts, order, sampling=GREEDY):
  """Adds the requests in ``order``, one per engine step, then runs."""
  reqs = {}
  for i in order:
    reqs[i] = engine.add_request(f"r{i}", prompts[i], sampling)
    engine.step()
  engine.run()
  return [reqs[i] for i in range(len(prompts))]


def _reference(params, prompts):
  """Tokens with caching off (no hit can happen)."""
  engine = _engine(params, dataclasses.replace(BASE, enable_prefix_caching=False))
  reqs = engine.generate(prompts, GREEDY)
  assert all(r.prefix_hit_tokens == 0 for r in reqs)
  return [r.output_token_ids for r in reqs]


# Prefix lengths: k = 2 pages, k pages - 1, k pages + 1, and 16 tokens (two
# full prefill chunks of the tiny preset's cap 8: the first request's chunk
# boundary is the end of the shared prefix).
@pytest.mark.parametrize("prefix_len", [8, 7, 9, 16])
def test_six_requests_sharing_a_prefix_give_the_same_tokens_in_three_orders(
    params, prefix_len):
  head = _prompts([prefix_len], seed=11)[0]
  tails = _prompts([1, 2, 3, 5, 4, 6], seed=12 + prefix_len)
  prompts = [head + t for t in tails]
  want = _reference(params, prompts)
  full_hit = {i: (len(p) - 1) // 4 * 4 for i, p in enumerate(prompts)}
  shared = prefix_len // 4 * 4
  for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4], [2, 4, 0, 5, 1, 3]):
    engine = _engine(params)
    reqs = _staggered(engine, prompts, order)
    assert [r.output_token_ids for r in reqs] == want, order
    hits = [r.prefix_hit_tokens for r in reqs]
    # The first arrival computes everything; from the third on, each arrives
    # after the shared pages were computed and hits exactly them (capped so
    # one prompt token is left to compute).
    assert hits[order[0]] == 0
    assert all(hits[i] == min(shared, full_hit[i]) for i in order[2:]), hits
    stats = engine.prefix_cache_stats()
    assert stats["prefix_cache_queries"] == sum(map(len, prompts))
    assert stats["prefix_cache_hits"] == sum(hits) > 0
    assert engine.prefill_tokens_computed == sum(map(len, prompts)) - sum(hits)


def test_an_identical_prompt_of_whole_pages_keeps_one_token_to_compute(params):
  prompt = _prompts([12], seed=3)[0]
  want = _reference(params, [prompt])[0]
  engine = _engine(params)
  first, again = _staggered(engine, [prompt, prompt], [0, 1])
  assert (first.prefix_hit_tokens, again.prefix_hit_tokens) == (0, 8)
  assert first.output_token_ids == again.output_token_ids == want


FORCED = dataclasses.replace(BASE, num_pages=12, force_preempt_every=3)  # 11 pages


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemptions_with_shared_pages_keep_tokens_and_every_page(params, mode):
  """Recompute: the victim's cached pages stay cached and it resumes from its
  prefix hit. Swap: the copy of a shared page leaves the page with its other
  holders. Either way the tokens are those of a run without caching."""
  head = _prompts([8], seed=21)[0]
  prompts = [head + t for t in _prompts([5, 3, 6], seed=22)] + _prompts([9], seed=23)
  want = _reference(params, prompts)
  engine = _engine(params, dataclasses.replace(FORCED, preemption_mode=mode))
  reqs = {}
  for i, p in enumerate(prompts):
    reqs[i] = engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    _check(engine.pages, engine.prefix_cache)
  while engine.has_unfinished():
    engine.step()
    _check(engine.pages, engine.prefix_cache)
  assert [reqs[i].output_token_ids for i in range(4)] == want
  assert engine.num_preemptions > 0
  if mode == "recompute":
    # A preempted request looked its prompt up again and found its own (or
    # its siblings') pages: fewer prompt rows than prompts plus full rebuilds.
    rehit = [r for r in reqs.values() if r.num_preemptions and r.prefix_hit_tokens]
    assert rehit
  else:
    assert engine.swap.swapped_in > 0
  free, evictable, in_use = map(int, kv_pages.page_census(engine.pages))
  assert (free + evictable, in_use) == (FORCED.num_pages - 1, 0)


def _random_workload(params, requests, mode, abort_at):
  """Body of the property below, also run on the examples it found."""
  heads = _prompts([8, 6], seed=31)
  prompts = [heads[h] + _prompts([n], seed=40 + i)[0] for i, (h, n) in enumerate(requests)]
  want = _reference(params, prompts)
  engine = _engine(params, dataclasses.replace(FORCED, preemption_mode=mode))
  reqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts[:2])]
  step = 0
  while engine.has_unfinished() or len(reqs) < len(prompts):
    if len(reqs) < len(prompts):
      reqs.append(engine.add_request(f"r{len(reqs)}", prompts[len(reqs)], GREEDY))
    for k in abort_at:
      if k == step and not reqs[k % len(reqs)].finished:
        engine.abort(reqs[k % len(reqs)].request_id)
    engine.step()
    step += 1
    _check(engine.pages, engine.prefix_cache)
  for r, w in zip(reqs, want):
    assert r.outcome in ("completed", "cancelled")
    if r.outcome == "completed":
      assert r.output_token_ids == w
  free, evictable, in_use = map(int, kv_pages.page_census(engine.pages))
  assert (free + evictable, in_use) == (FORCED.num_pages - 1, 0)


def test_a_swapped_request_ending_with_its_last_prompt_chunk_frees_each_page_once(params):
  """Found by the property below: three requests on one 8-token head and
  one on the other, one prompt token each past it, swap preemption every
  3 iterations in 11 pages: a page was left both free and cached."""
  _random_workload(params, [(0, 1), (0, 1), (0, 1), (1, 1)], "swap", [])


@settings(max_examples=5, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(1, 9)), min_size=3, max_size=7),
       st.sampled_from(["recompute", "swap"]),
       st.lists(st.integers(0, 12), max_size=2))
def test_random_engine_workloads_with_aborts_and_preemptions_account_every_page(
    params, requests, mode, abort_at):
  """Shared heads, KV pressure (11 pages: evictions), forced preemptions and
  aborts at random steps: the census holds after every step, eviction never
  takes a referenced page (``PrefixCache.evict`` refuses), completed requests
  get the tokens of a run without caching, and every page ends free or
  cached."""
  _random_workload(params, requests, mode, abort_at)


def test_kv_pressure_evicts_least_recently_used_pages_tail_first(params):
  """11 pages; three distinct 17-token prompts run one after another, each
  leaving 4 cached pages: C must evict 3, A's (oldest) from its tail, so a
  rerun of A hits exactly its first page. Tokens are unchanged."""
  a, b, c = _prompts([17, 17, 17], seed=51)
  want = _reference(params, [a, b, c])
  engine = _engine(params, dataclasses.replace(BASE, num_pages=12))
  got = [engine.generate([p], GREEDY)[0] for p in (a, b, c)]
  assert [r.output_token_ids for r in got] == want
  assert engine.prefix_cache_stats()["prefix_cache_evictions"] == 3
  again = engine.generate([a], GREEDY)[0]
  assert again.prefix_hit_tokens == 4 and again.output_token_ids == want[0]
  _check(engine.pages, engine.prefix_cache)


def _cold_wait(params, quota_hot, monkeypatch, steps=6):
  """prefix_aware on real hits: one cold 12-token prompt (two chunks) waits
  while four hot ones (9 tokens, 8 of them a cached head) arrive every step
  and fill the 4-sequence budget. Returns the steps the cold request took to
  finish, or None if it did not within ``steps``."""
  from scheduler import policies
  from scheduler.policy_fairness import PrefixAware
  name = f"prefix_aware_quota{quota_hot}"
  monkeypatch.setitem(policies.POLICIES, name,
                      lambda b: PrefixAware(b, quota_hot=quota_hot, policy_id=name))
  engine = _engine(params, dataclasses.replace(BASE, policy=name))
  one = SamplingParams(max_tokens=1, ignore_eos=True)
  head = _prompts([8], seed=61)[0]
  tails = iter(_prompts([1] * (4 * steps + 5), seed=62))
  engine.generate([head + next(tails)], one)            # warms the cache
  cold = engine.add_request("cold", _prompts([12], seed=63)[0], one)
  for step in range(steps):
    for _ in range(4):
      hot = engine.add_request(f"hot{engine.table.next_uid}", head + next(tails), one)
    engine.step()
    assert hot.prefix_hit_tokens == 8 or hot.slot < 0
    if cold.finished:
      return step + 1
  return None


@pytest.mark.extended   # ~17 s; prefix_aware conforms in the conformance kit
def test_prefix_aware_quota_bounds_the_wait_that_reuse_greedy_makes_unbounded(
    params, monkeypatch):
  """Quota 2: hot x4 (streak 4), cold chunk 1 + hot x3, hot x4, cold chunk 2
  + hot x3: done at step 4. Reuse greedy: never within 6 steps."""
  assert _cold_wait(params, 0, monkeypatch) is None      # starved while hot arrive
  assert _cold_wait(params, 2, monkeypatch) == 4


def test_synthetic_shared_system_prompts_replay_with_hits_and_the_same_tokens(params):
  from serving.harness import synthetic
  from serving.harness.replay import replay
  w = synthetic.synthetic_shared_prefix(
      num_requests=8, system_prompt_len=12, num_system_prompts=2, user_len=(1, 8),
      max_output_len=3, rate_per_s=50.0, seed=3, vocab_size=CFG.vocab_size,
      reserved_token_ids=())
  specs = list(w)
  assert all(s.prompt_token_ids[:12] == specs[i % 2].prompt_token_ids[:12]
             for i, s in enumerate(specs))
  assert specs[0].prompt_token_ids[:12] != specs[1].prompt_token_ids[:12]
  runs = {}
  for on in (False, True):
    engine = _engine(params, dataclasses.replace(BASE, enable_prefix_caching=on))
    records, _ = replay(engine, w, realtime=False)
    runs[on] = records
  assert [r.output_token_ids for r in runs[True]] == [r.output_token_ids for r in runs[False]]
  hits = [r.prefix_hit_tokens for r in runs[True]]
  # A hit is whole pages of a system prompt (12 tokens = 3 pages), at most.
  assert all(h in (0, 4, 8, 12) for h in hits) and sum(hits) > 0
  assert not any(r.prefix_hit_tokens for r in runs[False])


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_a_request_that_ends_with_its_last_prompt_chunk_still_caches_its_pages(
    params, max_tokens):
  """A prompt whose last chunk emits its only output token (max_tokens 1)
  ends in the step that computed its last pages; those pages join the cache
  before they are released, so the same prompt afterwards hits every full
  page (and gets the same tokens as with caching off)."""
  prompt = _prompts([13], seed=5)[0]            # 3 full pages and 1 token
  sampling = dataclasses.replace(GREEDY, max_tokens=max_tokens)
  engine = _engine(params)
  first = engine.add_request("first", prompt, sampling)
  engine.run()
  assert first.finished and len(first.output_token_ids) == max_tokens
  again = engine.add_request("again", prompt, sampling)
  engine.run()
  assert again.prefix_hit_tokens == 12
  assert engine.prefill_tokens_computed == 13 + 1
  ref = _engine(params, dataclasses.replace(BASE, enable_prefix_caching=False))
  assert again.output_token_ids == ref.generate([prompt], sampling)[0].output_token_ids
