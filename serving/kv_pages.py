"""KV page allocator: a free stack and per-slot page tables, as a pytree.

Pure functions ``(PageState, ...) -> PageState`` run inside the jitted engine
step. Physical page ``NULL_PAGE`` is reserved: it is never on the free list,
never owned by a live request, and unused page-table entries point at it (its
contents are never read unmasked; writes of padding rows are dropped).

The scheduler sees only ``view()`` (free-page count and pages held), never
page ids (§0x06: reservation is not allocation).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from scheduler.records import AllocatorView

NULL_PAGE = 0


@flax.struct.dataclass
class PageState:
  """Allocator state.

  Attributes:
    page_table: i32[R, pages_per_seq], physical page of each logical page;
      NULL_PAGE where not held.
    pages_held: i32[R], pages owned by each slot (a prefix of its row).
    free_stack: i32[num_pages], free page ids in ``free_stack[:num_free]``.
    num_free: i32[].
    page_size: static rows per page.
  """

  page_table: jax.Array
  pages_held: jax.Array
  free_stack: jax.Array
  num_free: jax.Array
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
      page_size=page_size)


def view(pages: PageState) -> AllocatorView:
  """The facts a policy may read."""
  return AllocatorView(free_pages=pages.num_free, pages_held=pages.pages_held,
                       page_size=pages.page_size)


def pages_for(rows, page_size: int):
  """Pages needed to hold ``rows`` token rows."""
  return (rows + page_size - 1) // page_size


def can_allocate(pages: PageState, num_new_pages) -> jax.Array:
  """bool[]: the free list holds ``num_new_pages`` pages."""
  return pages.num_free >= num_new_pages


def allocate(pages: PageState, rows_needed, *, max_new_per_slot: int) -> PageState:
  """Grows each slot's pages to cover ``rows_needed`` rows.

  Args:
    rows_needed: i32[R], rows each slot must be able to hold after this call
      (a slot never shrinks here).
    max_new_per_slot: static bound on new pages for one slot in one call.

  The caller guarantees enough free pages (the policy planned against
  ``view``); a shortfall is reported by ``allocation_ok`` being False and
  leaves the state unchanged.
  """
  num_slots, pages_per_seq = pages.page_table.shape
  target = jnp.minimum(pages_for(rows_needed, pages.page_size), pages_per_seq)
  need = jnp.maximum(target - pages.pages_held, 0)
  total = jnp.sum(need)
  ok = total <= pages.num_free
  offset = jnp.cumsum(need) - need                     # [R]
  j = jnp.arange(max_new_per_slot, dtype=jnp.int32)    # [J]
  take = j[None, :] < need[:, None]                    # [R, J]
  stack_pos = pages.num_free - 1 - (offset[:, None] + j[None, :])
  new_ids = pages.free_stack[jnp.clip(stack_pos, 0, pages.num_pages - 1)]
  col = pages.pages_held[:, None] + j[None, :]
  rows = jnp.broadcast_to(jnp.arange(num_slots)[:, None], col.shape)
  col = jnp.where(take & ok, col, pages_per_seq)       # OOB -> dropped
  table = pages.page_table.at[rows, col].set(new_ids, mode="drop")
  return pages.replace(
      page_table=table,
      pages_held=jnp.where(ok, pages.pages_held + need, pages.pages_held),
      num_free=jnp.where(ok, pages.num_free - total, pages.num_free))


def allocation_ok(pages: PageState, rows_needed) -> jax.Array:
  """bool[]: ``allocate`` would succeed for ``rows_needed``."""
  target = jnp.minimum(pages_for(rows_needed, pages.page_size),
                       pages.page_table.shape[1])
  return jnp.sum(jnp.maximum(target - pages.pages_held, 0)) <= pages.num_free


def deallocate(pages: PageState, release) -> PageState:
  """Returns every page of the ``release`` (bool[R]) slots to the free list."""
  num_slots, pages_per_seq = pages.page_table.shape
  count = jnp.where(release, pages.pages_held, 0)
  offset = jnp.cumsum(count) - count
  j = jnp.arange(pages_per_seq, dtype=jnp.int32)
  give = j[None, :] < count[:, None]
  pos = jnp.where(give, pages.num_free + offset[:, None] + j[None, :],
                  pages.num_pages)                     # OOB -> dropped
  stack = pages.free_stack.at[pos].set(pages.page_table, mode="drop")
  table = jnp.where(release[:, None], NULL_PAGE, pages.page_table)
  return pages.replace(
      page_table=table,
      pages_held=jnp.where(release, 0, pages.pages_held),
      free_stack=stack,
      num_free=pages.num_free + jnp.sum(count))
