"""In-place control flow for the engine's jitted programs.

XLA:CPU gives a ``lax.cond``'s results buffers of their own, so every array
a branch passes through unchanged is copied, and a cond at the root of a
``lax.while_loop`` body copies its results once more into the loop's
carry. A while loop's carry is updated in place. ``when`` is a conditional
written as a loop of at most one trip: a table that ``fn`` leaves alone, or
updates with a scatter, is neither copied nor moved. The loop program of
the simulated executor (``serving.engine.sim_loop``) carries its slot
tables, page tables and event log through several such decisions an
iteration.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import jax

T = TypeVar("T")


def when(pred, fn: Callable[[T], T], operand: T) -> T:
  """``fn(operand)`` where ``pred`` (bool[]) holds, else ``operand``, as
  ``lax.cond(pred, fn, lambda x: x, operand)``; ``fn`` must return a pytree
  of ``operand``'s structure, shapes and dtypes."""
  return jax.lax.while_loop(lambda t: t[0], lambda t: (jax.numpy.bool_(False), fn(t[1])),
                            (jax.numpy.asarray(pred, bool), operand))[1]
