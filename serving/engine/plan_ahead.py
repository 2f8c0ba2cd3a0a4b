"""Planning one iteration ahead: the next plan computed on the device right
after a step, fetched with the step's facts, used when nothing changed it.

An iteration makes two blocking round trips when it plans and steps
separately (``Engine.step``: the ``plan`` program's ``PlanFacts``, then the
``step`` program's ``StepFacts``), and the device waits for the host between
them. With plan-ahead, right after dispatching iteration N's step the engine
dispatches iteration N+1's ``plan`` program on the step's published tables,
and fetches both programs' facts in one round trip. The next ``Engine.step``
uses that plan when it is the plan the policy would make then:

- every device input of the plan program is the very object it was planned
  on (``manifest``, ``state``, ``pages``: JAX arrays are immutable, and every
  host action that changes them, an arrival, a release or cancellation, a
  clock rebase, a prefix-cache registration, an unpin, replaces them), and
  the host's prefix-hit column is equal;
- the policy's plan reads no time (``reads_clock``): the early plan was made
  before iteration N's emissions were stamped with their publication time
  and before iteration N+1's launch time was known. A policy that reads the
  clock (deadlines, slack, waiting time) always plans at launch.

The state the step then runs on is the one the plan program would have
published (``programs.ticked_state``: N's emission correction, then the
launch tick), so the published state, the plan, its facts and every token
are those of planning at launch; only the count of blocking round trips
(``Engine.host_fetches``) and the device's idle time between the plan and
the step change. It removes the plan's round trip, not the host's drain
between steps (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax._src.interpreters import partial_eval as pe

# Primitives through which a program reads the host (a clock among others):
# a plan using one is planned at launch.
HOST_READS = ("pure_callback", "io_callback")


@dataclasses.dataclass
class Ahead:
  """A plan made one iteration early and the inputs it was made on.

  Attributes:
    manifest, state, pages: the device tables planned on (identity is the
      validity test).
    hits: i32[R] prefix-hit column planned with, or None (caching off).
    plan: the ``IterationPlan`` (device); facts: its ``PlanFacts`` (host);
    refcount: i32[num_pages] or None (device; ``programs.plan_step``).
  """

  manifest: object
  state: object
  pages: object
  hits: Optional[np.ndarray]
  plan: object
  facts: object
  refcount: object

  @property
  def taken(self):
    """(plan, facts, refcount), as the ``plan`` program returns them."""
    return self.plan, self.facts, self.refcount


def reads_clock(plan_program, manifest, state, pages, hits, fix) -> bool:
  """Whether ``plan_program``'s plan or facts depend on the time: its launch
  time or the state's clock and emission times (``now_ms``,
  ``first_token_ms``, ``last_token_ms``), found by dead-code elimination on
  the program's jaxpr (``jax.make_jaxpr``): an input no output needs is not
  read. Conservative: a primitive without an elimination rule counts as
  reading all its inputs, a host callback with results (``HOST_READS``:
  it could read the host's clock) counts as reading the clock, and any
  failure of the analysis says True.

  Args:
    plan_program: ``_Programs.plan``; manifest, state, pages, hits: tables
      of the engine's shapes; fix: a no-op emission correction triple.
  """
  def plan_of(launch, now, first, last):
    timed = state.replace(now_ms=now, first_token_ms=first, last_token_ms=last)
    _, plan, facts, refcount = plan_program(manifest, timed, pages, hits, launch, *fix)
    return plan, facts, refcount

  try:
    closed = jax.make_jaxpr(plan_of)(jnp.float32(0), state.now_ms, state.first_token_ms,
                                     state.last_token_ms)
    _, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
  except Exception:                       # pylint: disable=broad-except
    return True
  return any(used) or bool(set(_primitives(closed.jaxpr)) & set(HOST_READS))


def _primitives(jaxpr):
  """The names of the primitives in ``jaxpr`` and its sub-jaxprs."""
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name
  for sub in core.subjaxprs(jaxpr):
    yield from _primitives(sub)


class PlanAhead:
  """The engine's plan-ahead: at most one early plan pending.

  Args:
    enabled: ``Engine.plan_ahead.enabled`` (True by default; False plans
      every iteration at launch).
  Attributes:
    used, dropped: early plans taken / dropped because an input changed.
  """

  def __init__(self, enabled: bool):
    self.enabled = enabled
    self.used = 0
    self.dropped = 0
    self._reads_clock: Optional[bool] = None
    self._pending: Optional[Ahead] = None
    self._dispatched = None

  @property
  def pending(self) -> bool:
    """Whether a plan made ahead waits for the next ``take``."""
    return self._pending is not None

  def dispatch(self, programs, manifest, state, pages, hits, fix, likely=True):
    """Dispatches the ``plan`` program on the step's published tables
    (``state``, ``pages``) when the policy reads no clock; returns its
    device ``PlanFacts`` to fetch with the step's (None when not planned
    ahead). ``fix``: the pending emission correction (none right after a
    step: its own is known only once its facts are fetched); the launch
    time passed is 0 (the policy reads neither). ``likely`` False skips
    a plan the host expects to drop (with prefix caching, a step that ran
    prompt rows registers their pages, which replaces ``pages``)."""
    self._pending = self._dispatched = None
    if not (self.enabled and likely):
      return None
    if self._reads_clock is None:
      self._reads_clock = reads_clock(programs.plan, manifest, state, pages, hits, fix)
    if self._reads_clock:
      return None
    _, plan, facts, refcount = programs.plan(manifest, state, pages, hits, np.float32(0),
                                             *fix)
    self._dispatched = Ahead(manifest, state, pages, hits, plan, None, refcount)
    return facts

  def fetch(self, fetch, step_facts, facts):
    """Fetches the step's facts and the early plan's (``dispatch``) in one
    round trip (``fetch``: ``Engine._fetch``), keeps the early plan with
    its facts and returns the step's. Should the early plan's program fail
    on the device, the step's facts are fetched alone and the plan is
    dropped: the plan made at launch then fails where it did before."""
    ahead, self._dispatched = self._dispatched, None
    if ahead is None:
      return fetch(step_facts)
    try:
      step_facts, facts = fetch((step_facts, facts))
    except Exception:                     # pylint: disable=broad-except
      self.dropped += 1
      return fetch(step_facts)
    self._pending = dataclasses.replace(ahead, facts=facts)
    return step_facts

  def take(self, manifest, state, pages, hits) -> Optional[Ahead]:
    """The pending early plan when planning ahead is still ``enabled`` and
    it was made on exactly these tables, else None (dropped). Either way
    nothing stays pending."""
    ahead, self._pending = self._pending, None
    if ahead is None:
      return None
    same_hits = (hits is None and ahead.hits is None) or (
        hits is not None and ahead.hits is not None and np.array_equal(hits, ahead.hits))
    if (self.enabled and ahead.manifest is manifest and ahead.state is state
        and ahead.pages is pages and same_hits):
      self.used += 1
      return ahead
    self.dropped += 1
    return None
