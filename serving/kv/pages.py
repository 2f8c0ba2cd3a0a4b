"""KV page allocator: a free stack, per-slot page tables and shared pages.

Pure functions ``(PageState, ...) -> PageState`` run inside the jitted engine
step. Physical page ``NULL_PAGE`` is reserved: it is never on the free list,
never owned by a live request, and unused page-table entries point at it (its
contents are never read unmasked; writes of padding rows are dropped).

Automatic prefix caching (vLLM's hashed blocks) splits the work in two, as
vLLM does: the device keeps ownership, the host keeps content.

* Device (this module, ``PageState``): ``refcount[page]`` counts the live
  page tables holding a page (a cached prompt page may sit in several at
  once) and ``cached[page]`` marks pages whose content key the host's prefix
  table holds. ``deallocate`` drops one reference per released holder; a
  page whose count reaches 0 returns to the free stack unless it is cached,
  in which case it stays resident and evictable. ``map_prefix`` puts cached
  pages into a slot's table (+1 reference each); ``sync_cached`` publishes
  the host table's page set and frees the pages it evicted.
* Host (``serving.kv.prefix_cache.PrefixCache``): chained content keys, the
  key -> page table and the LRU order. It only ever evicts pages with
  refcount 0 and only registers pages a live table holds.

Every page but the null page is in exactly one of three sets, so
``free + cached-evictable + in-use == num_pages - 1`` (``page_census``):
free (on the stack, refcount 0, not cached), evictable (refcount 0,
cached) and in use (refcount >= 1). The scheduler sees only ``view()``:
free pages there count evictable ones (an allocation may evict them), and
``prefix_hit_tokens`` (the cached prefix mapped into each slot), never page
ids (§0x06: reservation is not allocation).

Preemption: a recompute-preempted request releases its references like a
finished one; its cached prompt pages stay cached (evictable) and serve any
later request with that prefix. Swap copies the bytes of the victim's pages
to host memory and then releases its references; a page other tables still
hold stays theirs (refcount > 0, never freed or handed on), and the restore
writes the copy into fresh private pages.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from scheduler import scan
from scheduler.records import AllocatorView

NULL_PAGE = 0


@flax.struct.dataclass
class PageState:
  """Allocator state.

  Attributes:
    page_table: i32[R, pages_per_seq], physical page of each logical page;
      NULL_PAGE where not held.
    pages_held: i32[R], pages referenced by each slot (a prefix of its row).
    free_stack: i32[num_pages], free page ids in ``free_stack[:num_free]``.
    num_free: i32[].
    refcount: i32[num_pages], page tables holding each page.
    cached: bool[num_pages], the page's content key is in the host prefix
      table (written only by ``sync_cached``).
    page_size: static rows per page.
  """

  page_table: jax.Array
  pages_held: jax.Array
  free_stack: jax.Array
  num_free: jax.Array
  refcount: jax.Array
  cached: jax.Array
  page_size: int = flax.struct.field(pytree_node=False)

  @property
  def num_pages(self) -> int:
    return self.free_stack.shape[0]


def init_pages(num_slots: int, pages_per_seq: int, num_pages: int,
               page_size: int) -> PageState:
  """Every page but NULL_PAGE free; page ids pop in ascending order."""
  free = jnp.arange(num_pages - 1, 0, -1, dtype=jnp.int32)  # top = 1
  return PageState(
      page_table=jnp.full((num_slots, pages_per_seq), NULL_PAGE, jnp.int32),
      pages_held=jnp.zeros((num_slots,), jnp.int32),
      free_stack=jnp.concatenate([free, jnp.full((1,), NULL_PAGE, jnp.int32)]),
      num_free=jnp.int32(num_pages - 1),
      refcount=jnp.zeros((num_pages,), jnp.int32),
      cached=jnp.zeros((num_pages,), bool),
      page_size=page_size)


def num_evictable(pages: PageState) -> jax.Array:
  """i32[]: cached pages no page table holds (LRU eviction candidates)."""
  return jnp.sum(pages.cached & (pages.refcount == 0)).astype(jnp.int32)


def page_census(pages: PageState):
  """(free, evictable, in_use) i32[] counts; they sum to ``num_pages - 1``."""
  in_use = jnp.sum(pages.refcount > 0).astype(jnp.int32)
  return pages.num_free, num_evictable(pages), in_use


def reclaimable(pages: PageState) -> jax.Array:
  """i32[R]: each slot's held pages that no other page table holds (refcount
  1): what releasing the slot returns to the free pool (free, or evictable
  when cached). A page shared with another table stays held, so a policy
  that credits a victim with this (not ``pages_held``) never counts a page
  twice, and every plan made against ``view`` can be allocated (over any set
  of victims the credits sum to at most the pages their release frees)."""
  def count(pages):
    pages_per_seq = pages.page_table.shape[1]
    j = jnp.arange(pages_per_seq, dtype=jnp.int32)
    held = j[None, :] < pages.pages_held[:, None]
    alone = pages.refcount[pages.page_table] == 1
    return jnp.sum(held & alone, axis=1).astype(jnp.int32)

  # With no page shared (no refcount above 1: always without prefix
  # caching) every held page is the slot's alone; skip the gather.
  return jax.lax.cond(jnp.any(pages.refcount > 1), count,
                      lambda pages: pages.pages_held.astype(jnp.int32), pages)


def view(pages: PageState, prefix_hit_tokens=None, caching: bool = True) -> AllocatorView:
  """The facts a policy may read: ``free_pages`` = free + evictable pages;
  ``pages_held`` and ``reclaimable_pages`` (``reclaimable``) per slot; the
  prefix-hit tokens (i32[R]) when caching. ``caching`` (static) False says
  prefix caching is off: no page is then cached (none evictable) or held
  by two tables (refcount <= 1: ``allocate`` takes free pages only), so
  the counts over the ``num_pages`` refcounts are skipped for their values:
  ``free_pages`` is the free stack, ``reclaimable_pages`` ``pages_held``."""
  if not caching:
    return AllocatorView(free_pages=pages.num_free, pages_held=pages.pages_held,
                         page_size=pages.page_size, prefix_hit_tokens=prefix_hit_tokens,
                         reclaimable_pages=pages.pages_held.astype(jnp.int32))
  return AllocatorView(free_pages=pages.num_free + num_evictable(pages),
                       pages_held=pages.pages_held, page_size=pages.page_size,
                       prefix_hit_tokens=prefix_hit_tokens,
                       reclaimable_pages=reclaimable(pages))


def pages_for(rows, page_size: int):
  """Pages needed to hold ``rows`` token rows."""
  return (rows + page_size - 1) // page_size


def allocate(pages: PageState, rows_needed, *, max_new_per_slot: int,
             max_new_total: Optional[int] = None) -> PageState:
  """Grows each slot's pages to cover ``rows_needed`` rows.

  Args:
    rows_needed: i32[R], rows each slot must be able to hold after this call
      (a slot never shrinks here).
    max_new_per_slot: static bound on new pages for one slot in one call.
    max_new_total: static bound on new pages in all (default ``R *
      max_new_per_slot``). The work is O(max_new_total): an iteration's plan
      takes at most ``ceil(token_budget / page_size) + seq_budget`` pages
      (``executor.allocate_for_plan``), far fewer than one lane per slot
      and possible page.

  New pages come from the free stack only (refcount 0 -> 1), the stack's
  top to the lowest slot first; the host evicts cached pages onto it first
  when the plan needs them (``sync_cached``). The caller guarantees enough
  free pages (the policy planned against ``view``) and at most
  ``max_new_total`` new pages; otherwise the call leaves the state
  unchanged.
  """
  num_slots, pages_per_seq = pages.page_table.shape
  target = jnp.minimum(pages_for(rows_needed, pages.page_size), pages_per_seq)
  need = jnp.minimum(jnp.maximum(target - pages.pages_held, 0), max_new_per_slot)
  total = jnp.sum(need)
  lanes = num_slots * max_new_per_slot if max_new_total is None else max_new_total
  ok = (total <= pages.num_free) & (total <= lanes)
  offset = scan.cumsum_i32(need) - need                     # [R] first new page's lane
  # Lane k (the k-th new page, popped from the stack's top) belongs to the
  # slot whose [offset, offset + need) holds k: count the slots with pages
  # that start at or before k.
  k = jnp.arange(lanes, dtype=jnp.int32)
  has = need > 0
  starts = jnp.zeros((lanes,), jnp.int32).at[jnp.where(has, offset, lanes)].add(
      1, mode="drop")
  nth = scan.cumsum_i32(starts) - 1                         # among slots with pages
  with_pages = jnp.zeros((num_slots,), jnp.int32).at[
      jnp.where(has, scan.cumsum_i32(has) - 1, num_slots)].set(
          jnp.arange(num_slots, dtype=jnp.int32), mode="drop")
  slot = with_pages[jnp.clip(nth, 0, num_slots - 1)]
  take = (k < total) & ok
  new_ids = pages.free_stack[jnp.clip(pages.num_free - 1 - k, 0, pages.num_pages - 1)]
  col = pages.pages_held[slot] + k - offset[slot]
  table = pages.page_table.at[jnp.where(take, slot, num_slots), col].set(
      new_ids, mode="drop")
  refcount = pages.refcount.at[jnp.where(take, new_ids, pages.num_pages)].add(
      1, mode="drop")
  return pages.replace(
      page_table=table,
      pages_held=jnp.where(ok, pages.pages_held + need, pages.pages_held),
      num_free=jnp.where(ok, pages.num_free - total, pages.num_free),
      refcount=refcount)


def _push_free(pages: PageState, give) -> PageState:
  """Pushes the pages in ``give`` (bool[num_pages]) onto the free stack in
  ascending id order."""
  give = give.at[NULL_PAGE].set(False)
  count = give.astype(jnp.int32)
  pos = jnp.where(give, pages.num_free + scan.cumsum_i32(count) - count, pages.num_pages)
  stack = pages.free_stack.at[pos].set(
      jnp.arange(pages.num_pages, dtype=jnp.int32), mode="drop")
  return pages.replace(free_stack=stack, num_free=pages.num_free + jnp.sum(count))


def deallocate(pages: PageState, release) -> PageState:
  """Drops the ``release`` (bool[R]) slots' references to their pages.

  A page whose last reference goes returns to the free stack, unless it is
  cached: then it stays resident and evictable (refcount 0). A page another
  table still holds is untouched. The slots go one at a time in ascending
  order, each pushing its freed pages in its table's order (its last page
  ends on top). The work is O(released slots x pages_per_seq): none when no
  slot is released, as in most iterations, and never a pass over every
  page.
  """
  pages_per_seq = pages.page_table.shape[1]
  j = jnp.arange(pages_per_seq, dtype=jnp.int32)

  def drop_one(carry):
    pages, left = carry
    slot = jnp.argmax(left)
    row = pages.page_table[slot]                       # i32[pages_per_seq]
    held = j < pages.pages_held[slot]
    refcount = pages.refcount.at[jnp.where(held, row, pages.num_pages)].add(-1, mode="drop")
    freed = held & (refcount[row] == 0) & ~pages.cached[row]
    count = jnp.sum(freed, dtype=jnp.int32)
    pos = jnp.where(freed, pages.num_free + scan.cumsum_i32(freed) - 1,
                    pages.num_pages)
    pages = pages.replace(
        page_table=pages.page_table.at[slot].set(NULL_PAGE),
        pages_held=pages.pages_held.at[slot].set(0), refcount=refcount,
        free_stack=pages.free_stack.at[pos].set(row, mode="drop"),
        num_free=pages.num_free + count)
    return pages, left.at[slot].set(False)

  return jax.lax.while_loop(lambda carry: jnp.any(carry[1]), drop_one,
                            (pages, jnp.asarray(release, bool)))[0]


def trim(pages: PageState, rows_kept) -> PageState:
  """Each slot keeps the pages of its first ``rows_kept`` (i32[R]) rows and
  drops its references to the pages after them (a slot holding fewer is
  unchanged): the pages a verified decode row took for drafts that were
  rejected (speculative decoding). A page whose last reference goes returns
  to the free stack (ascending ids) unless it is cached, as in
  ``deallocate``. O(R x pages_per_seq), under a cond that skips it when no
  slot holds a page past its rows."""
  pages_per_seq = pages.page_table.shape[1]
  j = jnp.arange(pages_per_seq, dtype=jnp.int32)
  keep = jnp.minimum(pages_for(rows_kept, pages.page_size), pages.pages_held)

  def drop(pages):
    out = (j[None, :] >= keep[:, None]) & (j[None, :] < pages.pages_held[:, None])
    ids = jnp.where(out, pages.page_table, pages.num_pages).reshape(-1)
    refcount = pages.refcount.at[ids].add(-1, mode="drop")
    dropped = jnp.zeros((pages.num_pages,), bool).at[ids].set(True, mode="drop")
    freed = dropped & (refcount == 0) & ~pages.cached
    pages = pages.replace(page_table=jnp.where(out, NULL_PAGE, pages.page_table),
                          pages_held=keep.astype(pages.pages_held.dtype), refcount=refcount)
    return _push_free(pages, freed)

  return jax.lax.cond(jnp.any(keep < pages.pages_held), drop, lambda p: p, pages)


def map_prefix(pages: PageState, slot, page_ids, num_hit) -> PageState:
  """Maps cached pages into an empty slot's table (a prefix hit).

  Args:
    slot: i32[], a slot holding no pages.
    page_ids: i32[pages_per_seq], cached pages in logical order; entries at
      and beyond ``num_hit`` are ignored.
    num_hit: i32[], pages hit. Each gains one reference (an evictable page
      becomes in use).
  """
  pages_per_seq = pages.page_table.shape[1]
  j = jnp.arange(pages_per_seq, dtype=jnp.int32)
  hit = j < num_hit
  ids = jnp.where(hit, page_ids, NULL_PAGE)
  return pages.replace(
      page_table=pages.page_table.at[slot].set(ids),
      pages_held=pages.pages_held.at[slot].set(num_hit),
      refcount=pages.refcount.at[jnp.where(hit, page_ids, pages.num_pages)].add(
          1, mode="drop"))


def sync_cached(pages: PageState, cached) -> PageState:
  """Publishes the host prefix table's page set ``cached`` (bool[num_pages]).

  Pages that leave the set with refcount 0 (LRU evictions) return to the
  free stack. The host adds only pages a live table holds.
  """
  evicted = pages.cached & ~cached & (pages.refcount == 0)
  return _push_free(pages.replace(cached=cached), evicted)
