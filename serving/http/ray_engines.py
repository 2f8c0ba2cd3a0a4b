"""Engines as Ray actors: ``EngineActor`` owns one ``Engine`` and the thread
that steps it; ``start_engines`` starts a pool of them.

The actor (a threaded Ray actor: its methods run on Ray's threads while the
stepping thread owns the engine) takes commands between two iterations,
in the order they came: ``submit`` (requests; each one's refusal, e.g.
``QueueFull``, is returned to the caller), ``add_handoff`` (a decode engine
admits a prefill engine's ``KVHandoff``, passed as a Ray object reference,
so the pages travel through Ray's object store from the prefill actor's
node to the decode actor's without passing the front), ``abort`` and
``finish``. It reports through ``poll``: every request's news since the
last poll (new tokens, logprobs, and at the end its outcome), each prefill
handoff as a ticket of its ``serving.http.ray_transfer`` transport (the
object store's: an ObjectRef; ``jax.experimental.transfer``'s: a pull id),
and the engine's gauges (``EngineActor.stats``). A request that ended is evicted
from the engine once its end is reported.

Faults: a step that raises kills the actor's process (status 1); Ray
restarts it (``max_restarts``) as a fresh engine, and the front fails every
request the dead one held (``serving.http.ray_front``). Text, stop strings
and the OpenAI formats stay on the front (``serving.http.engine_loop``): an
actor sees token ids only.

``start_engines`` joins a running Ray cluster (``address``) or starts a
local one with the machine's CPUs, then starts one actor per engine, each
built in its own worker process by ``build`` (a picklable zero-argument
callable returning an ``Engine``, e.g. ``FlagsEngine``: the launcher's
flags parsed again in the worker).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import threading
import time
from typing import Callable, List, Optional, Sequence

import jax
import numpy as np
import ray

from scheduler import records as rec
from serving.http import ray_transfer
from serving.kv import pages as kv_pages

# Seconds a ``poll`` waits for news before it returns an empty batch.
POLL_S = 0.05


class FlagsEngine:
  """Builds the engine from launcher flags in the actor's process:
  ``serving.cli.launch``'s engine flags parsed from ``argv`` (each
  ``--name=value``), then ``launch.build_engine`` and, when ``warmup``,
  ``launch.warmup`` up to ``num_requests`` requests. Relative paths in the
  flags (``--model``, ``--cache_dir``) resolve against ``cwd`` (the
  launcher's directory) where the actor's node has it."""

  def __init__(self, argv: Sequence[str], warmup: bool, num_requests: int,
               cwd: Optional[str] = None, **overrides):
    self.argv, self.warmup, self.num_requests = list(argv), warmup, num_requests
    self.cwd, self.overrides = cwd, overrides

  def __call__(self):
    from absl import flags

    if self.cwd and os.path.isdir(self.cwd):
      os.chdir(self.cwd)

    from serving.cli import launch

    if "model" not in flags.FLAGS:
      launch.define_engine_flags()
    flags.FLAGS(["engine_actor", *self.argv], known_only=True)
    engine, _, _ = launch.build_engine(**self.overrides)
    if self.warmup:
      launch.warmup(engine, num_requests=self.num_requests)
    return engine


def engine_name(role: str, index: int) -> str:
  """An engine's one name across a front: its role and its index in its
  pool ("mixed-1", "prefill-0", "decode-0"); pool indices alone repeat
  across the prefill and decode pools."""
  return f"{role}-{index}"


class EngineActor:
  """One engine and its stepping thread (module docstring).

  Args:
    build: zero-argument callable returning the ``Engine`` (called here,
      in the actor's process).
    replica: this actor's index in its pool (named in its facts).
    transport: how handoffs travel (``ray_transfer.TRANSPORTS``; prefill
      and decode actors of one deployment use the same).
  """

  def __init__(self, build: Callable, replica: int = 0, transport: str = "object_store"):
    self.engine = build()
    self.replica = replica
    self.transport = ray_transfer.make_transport(transport)
    self.role = getattr(self.engine.config, "role", "mixed")
    self.name = engine_name(self.role, replica)
    self._commands: "queue.Queue[tuple]" = queue.Queue()
    self._news = threading.Condition()
    self._updates: List[dict] = []
    self._reported: set = set()              # ids whose first output went out
    self._stats = self._gauges()
    self.corrupt_handoffs = False            # a test's fault: flip a byte of each
    self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
    self._thread.start()

  # ------------------------------------------------------------ methods
  def facts(self) -> dict:
    """What the front needs: the configs, the role, the name, the process id."""
    return dict(config=self.engine.config, model_cfg=self.engine.model_cfg, role=self.role,
                replica=self.replica, engine=self.name, pid=os.getpid(),
                node=ray.get_runtime_context().get_node_id())

  def submit(self, specs: List[dict]) -> List[Optional[BaseException]]:
    """Adds requests (``spec``: ``request_id``, ``prompt_token_ids``,
    ``sampling``, ``waited_ms`` (how long ago it arrived at the front),
    ``priority``, ``client``, ``extra`` (engine keywords)) between two
    iterations; returns each one's refusal (an exception), its end when
    the engine rejected it at once (``{outcome, finish_reason}``), or None
    where accepted."""
    return self._call("submit", specs)

  def add_handoff(self, request_id: str, tickets: list, waited_ms: float):
    """Decode role: receives the handoff of ticket ``tickets[0]`` (inside a
    list, so that Ray passes an ObjectRef on as a reference: the bytes come
    here from the object store, on this method's thread while the engine
    steps), then admits it between two iterations; returns its refusal
    (e.g. ``ChecksumMismatch``) or None."""
    try:
      handoff = self.transport.receive(tickets[0])
    except Exception as e:              # noqa: BLE001 - the bytes never came
      return e
    return self._call("handoff", (request_id, handoff, waited_ms))

  def abort(self, request_id: str) -> None:
    self._commands.put(("abort", request_id))

  def finish(self, request_id: str, reason: str) -> None:
    self._commands.put(("finish", request_id, reason))

  def poll(self, timeout_s: float = POLL_S) -> dict:
    """Waits up to ``timeout_s`` for news; returns ``{"updates": [...],
    "stats": ...}`` (each update: ``request_id``, ``new_token_ids``,
    ``new_logprobs``, ``finished``, ``outcome``, ``finish_reason``, and on
    its first one ``queued_ms``, ``prefix_hit_tokens``, ``prompt_logprobs``;
    a prefill handoff's ``handoff``: [ObjectRef])."""
    with self._news:
      if not self._updates:
        self._news.wait(timeout_s)
      updates, self._updates = self._updates, []
      return dict(updates=updates, stats=self._stats)

  def stats(self) -> dict:
    return self._call("stats", None)

  def set_fault(self, corrupt_handoffs: bool) -> None:
    """Tests: every later handoff carries one flipped byte (its checksum
    then fails on import)."""
    self.corrupt_handoffs = corrupt_handoffs

  def exit(self, status: int = 1) -> None:
    """Tests: the process dies at once, as a crash would."""
    os._exit(status)

  # ------------------------------------------------------ engine thread
  def _call(self, kind: str, payload):
    done = threading.Event()
    box = []
    self._commands.put((kind, payload, done, box))
    if not done.wait(600):
      raise TimeoutError(f"engine {self.name}: {kind} not run within 600 s")
    if isinstance(box[0], BaseException) and kind == "stats":
      raise box[0]
    return box[0]

  def _run(self) -> None:
    try:
      while True:
        try:                 # idle: block (bounded) for the next command
          command = (self._commands.get_nowait() if self.engine.has_unfinished()
                     else self._commands.get(timeout=1.0))
        except queue.Empty:
          command = None
        while command is not None:
          self._do(command)
          try:
            command = self._commands.get_nowait()
          except queue.Empty:
            command = None
        if self.engine.has_unfinished():
          start_ms = self.engine.now_ms()
          self._report(self.engine.step(), start_ms)
    except BaseException as e:            # the engine broke: the process dies
      print(f"error: engine {self.name} failed ({type(e).__name__}: {e}); the actor "
            f"exits", file=sys.stderr, flush=True)
      os._exit(1)

  def _do(self, command: tuple) -> None:
    kind = command[0]
    if kind == "abort":
      req = self.engine.requests.get(command[1])
      if req is not None and not req.finished:
        self.engine.abort(command[1])
        self._ended(req)
      return
    if kind == "finish":
      req = self.engine.requests.get(command[1])
      if req is not None and not req.finished:
        self.engine.finish(command[1], command[2])
        self._ended(req)
      return
    payload, done, box = command[1:]
    try:
      if kind == "submit":
        box.append([self._add(spec) for spec in payload])
      elif kind == "handoff":
        box.append(self._add_handoff(*payload))
      elif kind == "stats":
        box.append(self._gauges())
    except BaseException as e:          # noqa: BLE001 - returned to the caller
      box.append(e)
    done.set()

  def _arrival_ms(self, waited_ms: float) -> Optional[float]:
    if self.engine.clock is time.monotonic:
      return self.engine.now_ms() - max(waited_ms, 0.0)
    return None

  def _add(self, spec: dict) -> Optional[BaseException]:
    try:
      req = self.engine.add_request(spec["request_id"], spec["prompt_token_ids"],
                                    spec["sampling"],
                                    arrival_ms=self._arrival_ms(spec["waited_ms"]),
                                    priority=spec["priority"], client=spec["client"],
                                    **spec["extra"])
    except Exception as e:              # noqa: BLE001 - the engine's refusal
      return e
    if req.finished:                    # rejected at once: its end, not reported
      end = dict(outcome=req.outcome, finish_reason=req.finish_reason)
      self._forget(req)
      return end
    return None

  def _add_handoff(self, request_id: str, handoff,
                   waited_ms: float) -> Optional[BaseException]:
    try:
      self.engine.add_handoff(handoff, arrival_ms=self._arrival_ms(waited_ms))
    except Exception as e:              # noqa: BLE001 - refused, or a bad checksum
      return e
    self._reported.add(request_id)      # its first token came from the prefill side
    return None

  def _report(self, outputs, start_ms: float) -> None:
    handoffs = {}
    if self.role == "prefill":
      for h in self.engine.take_handoffs():
        if self.corrupt_handoffs and h.k is not None:
          k = np.array(h.k, copy=True)
          k.reshape(-1).view(np.uint8)[0] ^= 1
          h = dataclasses.replace(h, k=k)
        handoffs[h.request_id] = [self.transport.send(h)]
    updates = []
    for out in outputs:
      req = self.engine.requests[out.request_id]
      update = dict(request_id=out.request_id, new_token_ids=list(out.new_token_ids),
                    new_logprobs=out.new_logprobs, finished=out.finished,
                    outcome=out.outcome, finish_reason=out.finish_reason,
                    handoff=handoffs.pop(out.request_id, None))
      if out.request_id not in self._reported:
        self._reported.add(out.request_id)
        update.update(queued_ms=start_ms - req.arrival_ms,
                      prefix_hit_tokens=req.prefix_hit_tokens,
                      prompt_logprobs=req.prompt_logprobs)
      updates.append(update)
      if out.finished:
        self._forget(req)
    assert not handoffs, f"handoffs without an output: {sorted(handoffs)}"
    self._publish(updates)

  def _ended(self, req) -> None:
    """A request ended by a command (abort, finish, rejected at once)."""
    self._publish([dict(request_id=req.request_id, new_token_ids=[], new_logprobs=None,
                        finished=True, outcome=req.outcome, finish_reason=req.finish_reason,
                        handoff=None)])
    self._forget(req)

  def _forget(self, req) -> None:
    self._reported.discard(req.request_id)
    self.engine.evict(req.request_id)

  def _publish(self, updates: List[dict]) -> None:
    stats = self._gauges()
    with self._news:
      self._updates.extend(updates)
      self._stats = stats
      self._news.notify_all()

  def _gauges(self) -> dict:
    """The engine's gauges and counters (what ``ServerMetrics`` reads)."""
    e = self.engine
    status, generation, (free, evictable, _) = jax.device_get((
        e.state.status, e.state.generation, kv_pages.page_census(e.pages)))
    status, generation = np.asarray(status), np.asarray(generation)
    waiting = status == rec.WAITING
    return dict(replica=self.replica, running=int(np.sum(status == rec.RUNNING)),
                suspended=int(np.sum(waiting & (generation > 0))),
                waiting=int(np.sum(waiting & (generation == 0))),
                free_pages=int(free), evictable_pages=int(evictable),
                num_pages=e.config.num_pages, unfinished=bool(e.has_unfinished()),
                live=sum(1 for r in e.requests.values() if not r.finished),
                prefill_tokens_computed=int(e.prefill_tokens_computed),
                num_preemptions=int(e.num_preemptions), **e.prefix_cache_stats())


@dataclasses.dataclass(frozen=True)
class Pool:
  """Engine actors of one role and their facts (``facts()`` of each)."""
  role: str
  actors: list
  facts: List[dict]


def init_ray(address: Optional[str], num_cpus: Optional[int] = None) -> None:
  """Joins the Ray cluster at ``address``, or starts a local one with
  ``num_cpus`` (None: the machine's CPUs); a no-op when Ray already runs in
  this process."""
  if ray.is_initialized():
    return
  if address:
    ray.init(address=address, include_dashboard=False, log_to_driver=True)
  else:
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
             log_to_driver=True)


def start_engines(build: Callable, num: int, *, role: str = "mixed",
                  max_restarts: int = 3, num_cpus: float = 1.0,
                  ready_timeout_s: float = 1800.0, first_index: int = 0,
                  transport: str = "object_store") -> Pool:
  """Starts ``num`` engine actors (``build`` makes each one's engine) and
  waits until every one answers ``facts``; Ray restarts one that dies up to
  ``max_restarts`` times (-1: always).

  Raises:
    RuntimeError: an actor failed to start (its error named) or was not
      ready within ``ready_timeout_s`` (all are stopped).
  """
  cls = ray.remote(EngineActor).options(max_restarts=max_restarts, max_task_retries=0,
                                        max_concurrency=64, num_cpus=num_cpus)
  actors = [cls.remote(build, first_index + i, transport) for i in range(num)]
  try:
    facts = ray.get([a.facts.remote() for a in actors], timeout=ready_timeout_s)
  except Exception as e:
    for a in actors:
      ray.kill(a, no_restart=True)
    cause = getattr(e, "cause", None) or e
    raise RuntimeError(f"{role} engines did not start: {type(cause).__name__}: "
                       f"{str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"
                       ) from None
  for f in facts:
    if f["role"] != role:
      for a in actors:
        ray.kill(a, no_restart=True)
      raise RuntimeError(f"engine {f['engine']} has role {f['role']!r}, expected {role!r}")
  return Pool(role, actors, facts)


def stop_engines(pools: Sequence[Pool]) -> None:
  """Stops every actor of ``pools`` (no restart)."""
  for pool in pools:
    for a in pool.actors:
      try:
        ray.kill(a, no_restart=True)
      except Exception:                   # noqa: BLE001 - already gone
        pass
