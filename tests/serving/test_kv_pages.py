"""KV page allocator: free stack, page tables, the reserved null page."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from serving.kv import pages as kv_pages
from serving.kv.pages import NULL_PAGE

SLOTS, PAGES_PER_SEQ, NUM_PAGES, PAGE_SIZE = 4, 6, 16, 4
allocate = jax.jit(kv_pages.allocate, static_argnames=("max_new_per_slot", "max_new_total"))
deallocate = jax.jit(kv_pages.deallocate)


def _owned(pages):
  table, held = np.asarray(pages.page_table), np.asarray(pages.pages_held)
  return {s: table[s, : held[s]].tolist() for s in range(SLOTS)}


def test_allocate_pops_ascending_pages_and_never_the_null_page():
  pages = kv_pages.init_pages(SLOTS, PAGES_PER_SEQ, NUM_PAGES, PAGE_SIZE)
  assert int(pages.num_free) == NUM_PAGES - 1
  pages = allocate(pages, jnp.array([5, 0, 4, 1]), max_new_per_slot=PAGES_PER_SEQ)
  # Slot 0 needs ceil(5/4) = 2 pages, slot 2 one, slot 3 one: ids 1..4 in order.
  assert _owned(pages) == {0: [1, 2], 1: [], 2: [3], 3: [4]}
  assert int(pages.num_free) == NUM_PAGES - 1 - 4
  assert np.asarray(pages.page_table)[1].tolist() == [NULL_PAGE] * PAGES_PER_SEQ


def test_allocation_beyond_the_free_list_changes_nothing():
  pages = kv_pages.init_pages(SLOTS, PAGES_PER_SEQ, NUM_PAGES, PAGE_SIZE)
  rows = jnp.array([24, 24, 24, 0])            # 18 pages > 15 free
  assert 3 * kv_pages.pages_for(24, PAGE_SIZE) > int(pages.num_free)
  after = allocate(pages, rows, max_new_per_slot=PAGES_PER_SEQ)
  assert int(after.num_free) == NUM_PAGES - 1 and _owned(after) == _owned(pages)


def test_release_pushes_each_slots_freed_pages_in_slot_then_table_order():
  """Worked by hand: slots 0 and 2 hold [1, 2] and [4, 5, 6], and page 4
  is mapped into slot 3 as well; releasing slots 0 and 2 pushes 1, 2 (slot
  0's table order), then 5, 6 on top; page 4, still held by slot 3, stays
  off the stack with its count lowered, and slot 1 keeps its page 3."""
  pages = kv_pages.init_pages(SLOTS, PAGES_PER_SEQ, NUM_PAGES, PAGE_SIZE)
  pages = allocate(pages, jnp.array([8, 4, 12, 0]), max_new_per_slot=PAGES_PER_SEQ)
  assert _owned(pages) == {0: [1, 2], 1: [3], 2: [4, 5, 6], 3: []}
  pages = kv_pages.map_prefix(pages, 3, jnp.array([4] + [0] * (PAGES_PER_SEQ - 1)), 1)
  free_before = np.asarray(pages.free_stack)[: int(pages.num_free)].tolist()
  after = deallocate(pages, jnp.array([True, False, True, False]))
  free = np.asarray(after.free_stack)[: int(after.num_free)].tolist()
  assert free == free_before + [1, 2, 5, 6]
  assert _owned(after) == {0: [], 1: [3], 2: [], 3: [4]}
  refcount = np.asarray(after.refcount)
  assert refcount[4] == 1 and refcount[3] == 1 and refcount[[1, 2, 5, 6]].tolist() == [0] * 4
  assert np.asarray(after.page_table)[[0, 2]].tolist() == [[NULL_PAGE] * PAGES_PER_SEQ] * 2
  # Nothing released: nothing changes.
  same = deallocate(after, jnp.zeros((SLOTS,), bool))
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), same, after))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 24), min_size=SLOTS,
                                                   max_size=SLOTS),
                          st.lists(st.booleans(), min_size=SLOTS, max_size=SLOTS)),
                min_size=1, max_size=12),
       st.sampled_from([None, 3, 7]))
def test_random_grow_and_release_keeps_ownership_exclusive(ops, lanes):
  """Against a plain-Python model: pages are owned once, counts conserve;
  a call that needs more than ``max_new_total`` (``lanes``) new pages, or
  more than are free, changes nothing."""
  pages = kv_pages.init_pages(SLOTS, PAGES_PER_SEQ, NUM_PAGES, PAGE_SIZE)
  model = {s: 0 for s in range(SLOTS)}
  for grow, rows, release in ops:
    if grow:
      want = {s: max(model[s], -(-rows[s] // PAGE_SIZE)) for s in range(SLOTS)}
      new = sum(want[s] - model[s] for s in range(SLOTS))
      fits = new <= NUM_PAGES - 1 - sum(model.values()) and (lanes is None or new <= lanes)
      pages = allocate(pages, jnp.array(rows), max_new_per_slot=PAGES_PER_SEQ,
                       max_new_total=lanes)
      if fits:
        model = want
    else:
      pages = deallocate(pages, jnp.array(release))
      model = {s: 0 if release[s] else model[s] for s in range(SLOTS)}
    owned = _owned(pages)
    assert {s: len(v) for s, v in owned.items()} == model
    flat = [p for v in owned.values() for p in v]
    free = np.asarray(pages.free_stack)[: int(pages.num_free)].tolist()
    assert NULL_PAGE not in flat and NULL_PAGE not in free
    assert len(set(flat)) == len(flat)
    assert sorted(flat + free) == list(range(1, NUM_PAGES))
