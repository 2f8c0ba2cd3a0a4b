"""The engine's request table: who is accepted, where each request waits or
which slot it holds, and the client indices the device counts service by.

``RequestTable`` owns the host tables ``Engine`` reads and writes between
iterations: every accepted request by id, the slot table (one request or
None per slot of the scheduler's tables), requests accepted since the last
step (``pending``: the next step places every one of them, so this list
never decides an order), requests accepted ahead of their arrival
(``future``, for ``Engine.simulate``), and the client name -> index map.
It checks a request before accepting it, builds the ``Arrival`` records
the ``arrive`` program writes, ends requests (``end``: the one place an
outcome is set; other owners of per-request records hook ``on_end``) and
takes each iteration's news into the requests' records (``drain`` after a
step, ``take_news`` for both it and the simulate driver; logprobs with
``take_logprobs``). The device tables stay with ``Engine``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import jax
import numpy as np

from scheduler import records as rec
from serving.engine import handoffs
from serving.engine.config import OUTCOMES, EngineConfig, SamplingParams
from serving.engine.facts import Arrival
from serving.engine.requests import (PromptLogprobs, QueueFull, Request, RequestOutput,
                                     TokenLogprobs)
from serving.engine.sampling import MAX_LOGPROBS
from serving.kv import pages as kv_pages


def _usable_pages(c: EngineConfig) -> str:
  """The pages a request may take, said with their makeup: every page but
  the null page. The watermark's pages are kept free at admission only
  while other requests run, so a request alone may take them."""
  held = (f"; its {c.watermark_pages} watermark pages are kept free only while other "
          f"requests run" if c.watermark_pages else "")
  return f"{c.num_pages - 1} (num_pages {c.num_pages} less page 0, the null page{held})"


def _needs_pages(c: EngineConfig, rows: int, need: int) -> str:
  """A request's KV need beside the cache, the one wording of both
  rejections: ``need`` pages for ``rows`` KV rows, and the usable pages'
  makeup (``_usable_pages``)."""
  return (f"needs {need} KV pages for {rows} KV rows (prompt + max_tokens - 1); the cache "
          f"has {_usable_pages(c)}")


class RequestTable:
  """Accepted requests, their slots and queues, and client indices.

  Args:
    config: ``EngineConfig`` (limits: queue bound, clients, stop ids, context).
    vocab_size: the model's vocabulary (prompt ids are checked against it).
  """

  def __init__(self, config: EngineConfig, vocab_size: int):
    self.config = config
    self.vocab_size = vocab_size
    self.slots: List[Optional[Request]] = [None] * config.max_request_slots
    self.pending: List[Request] = []
    self.future: List[Request] = []        # in arrival order
    # uid -> (device arrival ms, its ``arrival`` record): the loop's queue
    # of future requests, kept from one loop call to the next (sim_driver).
    self.future_arrivals: Dict[int, tuple] = {}
    self.requests: Dict[str, Request] = {}
    self.clients: Dict[str, int] = {}
    self.client_refs: Dict[str, int] = {}   # requests per client in ``requests``
    self.free_client_indices: List[int] = []
    self.next_uid = 0
    self.num_ended = 0                      # requests given an outcome (``end``)
    # Called with each request that ends (``end``): the owners of per-request
    # records elsewhere (prefix bookkeeping, suspensions) forget it.
    self.on_end: List[Callable[[Request], None]] = []
    # On a prefill engine, whether a request whose first token ended its
    # capped run really ends there (the simulated executor's recorded
    # length of 1: its length cap hides the EOS it would have drawn).
    self.ends_at_first: Callable[[Request], bool] = lambda req: False

  # ----------------------------------------------------------------- counts
  def num_live(self) -> int:
    """Requests holding a slot."""
    return sum(r is not None for r in self.slots)

  def num_unfinished(self) -> int:
    """Accepted requests without an outcome, the count
    ``max_queued_requests`` bounds: pending, live (in a slot) and still to
    enter a slot from ``add_future_request`` (``simulate`` may return with
    some whose arrival has passed, before it takes them)."""
    return len(self.pending) + len(self.future) + self.num_live()

  def has_unfinished(self) -> bool:
    """Whether an accepted request, one still to arrive included, has no
    outcome yet."""
    return bool(self.pending or self.future) or self.num_live() > 0

  def live(self) -> List[Request]:
    return [r for r in self.slots if r is not None]

  # ----------------------------------------------------------------- intake
  def accept(self, request_id, prompt_token_ids, sampling, arrival_ms: float, priority,
             client, slo_ttft_ms, slo_tpot_ms, logprobs, prompt_logprobs) -> Request:
    """``Engine.add_request``'s checks and records (``arrival_ms`` on the
    engine clock); a request that can never fit the KV cache is returned
    ended (``rejected``). Raises ValueError naming the bad field, or
    ``QueueFull``."""
    c = self.config
    ids = [int(t) for t in prompt_token_ids]
    if request_id in self.requests:
      raise ValueError(f"request_id {request_id!r} is already in use")
    if not ids:
      raise ValueError(f"request {request_id!r}: prompt_token_ids must be non-empty")
    if len(ids) >= c.max_model_len:
      raise ValueError(
          f"request {request_id!r}: prompt_token_ids has {len(ids)} tokens; the "
          f"context (max_model_len={c.max_model_len}) leaves room for at most "
          f"{c.max_model_len - 1} prompt tokens")
    bad = [t for t in ids if not 0 <= t < self.vocab_size]
    if bad:
      raise ValueError(f"request {request_id!r}: prompt_token_ids must be in "
                       f"[0, {self.vocab_size}), got {bad[:4]}")
    if not isinstance(sampling, SamplingParams):
      raise ValueError(f"request {request_id!r}: sampling must be SamplingParams")
    if len(sampling.stop_token_ids) > c.max_stop_ids:
      raise ValueError(f"request {request_id!r}: stop_token_ids holds at most "
                       f"{c.max_stop_ids} ids, got {len(sampling.stop_token_ids)}")
    if not -2**31 <= int(priority) < 2**31:
      raise ValueError(f"request {request_id!r}: priority must be in [-2**31, 2**31) "
                       f"(an int32; lower runs first), got {priority}")
    for name, limit in (("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms)):
      if limit is not None and not limit > 0:
        raise ValueError(f"request {request_id!r}: {name} must be > 0 ms (None for "
                         f"no objective), got {limit!r}")
    if (logprobs or prompt_logprobs) and c.executor == "simulated":
      raise ValueError(f"request {request_id!r}: logprobs need the model executor "
                       f"(EngineConfig.executor='simulated' computes no logits)")
    if self.num_unfinished() >= c.max_queued_requests:
      raise QueueFull(request_id, c.max_queued_requests)
    if client not in self.clients:
      if len(self.clients) >= c.num_clients:
        raise ValueError(f"client {client!r}: at most {c.num_clients} clients "
                         f"with requests held by the engine (EngineConfig.num_clients; "
                         f"evict finished requests to free a client)")
      self.clients[client] = (self.free_client_indices.pop(0)
                              if self.free_client_indices else len(self.clients))
    self.client_refs[client] = self.client_refs.get(client, 0) + 1
    req = Request(request_id=request_id, uid=self.next_uid, prompt_token_ids=ids,
                  sampling=sampling, priority=int(priority), client=client,
                  slo_ttft_ms=float("inf") if slo_ttft_ms is None else float(slo_ttft_ms),
                  slo_tpot_ms=float("inf") if slo_tpot_ms is None else float(slo_tpot_ms),
                  arrival_ms=float(arrival_ms), want_logprobs=bool(logprobs))
    if prompt_logprobs:
      req.prompt_logprobs = PromptLogprobs.empty(len(ids), min(MAX_LOGPROBS, self.vocab_size))
    self.next_uid += 1
    self.requests[request_id] = req
    rows, need = self.kv_need(req)
    if need > c.num_pages - 1:
      self.end(req, "rejected", f"{_needs_pages(c, rows, need)}: raise num_pages "
               f"(--num_pages) to at least {need + 1}")
    return req

  def kv_need(self, req: Request) -> Tuple[int, int]:
    """(KV rows, KV pages) ``req`` writes at most: ``p + m - 1`` rows (the
    last output is never fed back; ``m`` is ``max_tokens``), never past the
    context (rows ``[0, max_model_len - 1)``), in pages of ``page_size``."""
    c = self.config
    rows = min(rec.kv_rows(len(req.prompt_token_ids), self.max_tokens(req.sampling)),
               c.max_model_len - 1)
    return rows, kv_pages.pages_for(rows, c.page_size)

  def never_reason(self, req: Request, policy_id: str) -> str:
    """Why ``req``, accepted, is rejected when policy ``policy_id`` says it
    can never schedule it: its prompt beside the token budget, its KV need
    beside the cache (``_needs_pages``: admission took it, so its pages fit),
    and, where its prompt is wider than the budget, the budget that would
    take the prompt whole (what a policy that does not chunk prompts, e.g.
    ``orca``, needs; the policy alone knows which rule it broke)."""
    c = self.config
    prompt, budget = len(req.prompt_token_ids), c.max_num_batched_tokens
    rows, need = self.kv_need(req)
    wide = (f"; to run its prompt whole, raise max_num_batched_tokens "
            f"(--max_num_batched_tokens) to at least {prompt}" if prompt > budget else "")
    return (f"policy {policy_id} can never schedule it: its prompt has {prompt} tokens, the "
            f"token budget (max_num_batched_tokens) {budget}; it "
            f"{_needs_pages(c, rows, need)}{wide}")

  def max_tokens(self, sampling: SamplingParams) -> int:
    """The output tokens this engine runs for a request: its
    ``max_tokens``, at most 1 on a prefill engine (``EngineConfig.role``)."""
    if self.config.role == "prefill":
      return min(sampling.max_tokens, 1)
    return sampling.max_tokens

  def end(self, req: Request, outcome: str, reason: str) -> None:
    """Gives ``req`` its one outcome (``OUTCOMES``) and why; ``on_end`` hooks
    run. The caller frees its slot and pages."""
    assert outcome in OUTCOMES
    req.outcome, req.finish_reason = outcome, reason
    self.num_ended += 1
    for hook in self.on_end:
      hook(req)

  def get(self, request_id: str) -> Request:
    """The request, or ValueError for an unknown id."""
    req = self.requests.get(request_id)
    if req is None:
      raise ValueError(f"unknown request_id {request_id!r}")
    return req

  def withdraw(self, req: Request) -> bool:
    """Takes a request that holds no slot out of its queue (pending or
    future); False when it is in neither."""
    for waiting in (self.pending, self.future):
      if req in waiting:
        waiting.remove(req)
        return True
    return False

  def drop(self, req: Request) -> Optional[int]:
    """Forgets a finished request; returns its client's index when no
    request of that client is left (the index is free again), else None."""
    del self.requests[req.request_id]
    self.client_refs[req.client] -= 1
    if self.client_refs[req.client]:
      return None
    del self.client_refs[req.client]
    index = self.clients.pop(req.client)
    self.free_client_indices.append(index)
    return index

  def take_arrived(self, now_ms: float) -> None:
    """Future requests that arrived by ``now_ms`` become pending."""
    n = 0
    while n < len(self.future) and self.future[n].arrival_ms <= now_ms:
      n += 1
    self.pending += self.future[:n]
    del self.future[:n]

  # ------------------------------------------------------------------ slots
  def free_slots(self) -> List[int]:
    return [s for s, r in enumerate(self.slots) if r is None]

  def place(self, slot: int, req: Request) -> None:
    req.slot = slot
    self.slots[slot] = req

  def vacate(self, slot: int) -> None:
    self.slots[slot] = None

  def sizes(self) -> List[int]:
    """The slot-table sizes in use: ``max_request_slots``, doubled until
    ``max_queued_requests`` (the last one capped there)."""
    c = self.config
    sizes = [c.max_request_slots]
    while sizes[-1] < c.max_queued_requests:
      sizes.append(min(2 * sizes[-1], c.max_queued_requests))
    return sizes

  def resized(self, num_requests: int) -> int:
    """The slot-table size for ``num_requests`` requests (live ones and
    pending ones): the next sizes up (``sizes``) until it holds them, or
    the next ones down while the smaller size would be at most
    three-quarters full (so a table that shrank grows again only after
    its requests grew by a third); else the current size.

    Raises:
      RuntimeError: ``num_requests`` over ``max_queued_requests`` (a
        request got past the bound: a bug in the count, not bad input).
    """
    c = self.config
    if num_requests > c.max_queued_requests:
      raise RuntimeError(
          f"slot table asked for {num_requests} slots, over "
          f"EngineConfig.max_queued_requests={c.max_queued_requests} (every accepted, "
          f"unfinished request counts against it; more than that got past the bound)")
    sizes = self.sizes()
    i = sizes.index(len(self.slots))
    while sizes[i] < num_requests:
      i += 1
    while i > 0 and 4 * num_requests <= 3 * sizes[i - 1]:
      i -= 1
    return sizes[i]

  def moved_slots(self, size: int) -> np.ndarray:
    """i32[n]: the slots whose rows a table of ``size`` slots keeps, slot
    ``moved[j]`` becoming slot j: every slot when it grows (none moves),
    the occupied ones in slot order when it shrinks."""
    if size >= len(self.slots):
      return np.arange(len(self.slots), dtype=np.int32)
    return np.array([s for s, r in enumerate(self.slots) if r is not None], np.int32)

  def move_slots(self, size: int, moved: np.ndarray) -> None:
    """Resizes the host's slots to ``size``: slot ``moved[j]``'s request
    (``moved_slots``) to slot j, the rest free."""
    slots = [self.slots[s] for s in moved.tolist()]
    self.slots = slots + [None] * (size - len(slots))
    for j, req in enumerate(slots):
      if req is not None:
        req.slot = j

  def arrival(self, req: Request, device_arrival_ms) -> Arrival:
    """The ``Arrival`` record the ``arrive`` program writes for ``req``;
    ``device_arrival_ms`` is its arrival on the device clock."""
    c, s = self.config, req.sampling
    prompt = np.zeros(c.max_model_len, np.int32)
    p = len(req.prompt_token_ids)
    prompt[:p] = req.prompt_token_ids
    if req.received_tokens:            # handed over: its first token is fed next
      prompt[p] = req.output_token_ids[0]
    stop = np.full(c.max_stop_ids, -1, np.int32)
    stop[:len(s.stop_token_ids)] = s.stop_token_ids
    i32, f32 = np.int32, np.float32
    return Arrival(
        request_id=i32(req.uid), arrival_seq=i32(req.uid),
        arrival_ms=f32(device_arrival_ms),
        prompt_len=i32(p), max_tokens=i32(self.max_tokens(s)),
        priority=i32(req.priority), client=i32(self.clients[req.client]),
        ttft_ms=f32(req.slo_ttft_ms), tbt_ms=f32(req.slo_tpot_ms),
        temperature=f32(s.temperature), top_k=i32(s.top_k), top_p=f32(s.top_p),
        seed=np.uint32(s.seed), min_tokens=i32(s.min_tokens),
        ignore_eos=np.bool_(s.ignore_eos), prompt=prompt, stop_ids=stop,
        logprobs=np.bool_(req.want_logprobs),
        prompt_logprobs=np.bool_(req.prompt_logprobs is not None),
        received=i32(req.received_tokens))

  def arrival_batch(self, batch, hits, size: int, device_ms: Callable):
    """One ``arrive`` program call's inputs for ``batch`` ((slot, request)
    pairs, at most ``size``) and their prefix ``hits``, padded to ``size``
    entries: (slots i32[size] with -1 for padding, ``Arrival`` with a
    leading axis of ``size``, hits i32[size]). ``device_ms`` maps a host
    time to the device clock."""
    pad = size - len(batch)
    slots = np.array([s for s, _ in batch] + [-1] * pad, np.int32)
    arrivals = [self.arrival(req, device_ms(req.arrival_ms)) for _, req in batch]
    arrivals += [jax.tree.map(np.zeros_like, arrivals[0])] * pad
    stacked = jax.tree.map(lambda *x: np.stack(x), *arrivals)
    return slots, stacked, np.array(list(hits) + [0] * pad, np.int32)

  def realized(self, recorded: Dict[str, int]) -> np.ndarray:
    """i32[R] recorded output length of each slot's request (declared
    max_tokens when ``recorded`` has none): the simulated executor's truth."""
    out = np.zeros(len(self.slots), np.int32)
    for slot, req in enumerate(self.slots):
      if req is not None:
        out[slot] = recorded.get(req.request_id, req.sampling.max_tokens)
    return out

  # ------------------------------------------------------------------ drain
  def take_news(self, req: Request, tokens, times_ms, failed, finished, reason,
                extensions: Callable[[], int]) -> None:
    """Records one request's news from committed iterations, for both
    drains (``drain`` after a step, ``sim_driver.take_log`` after a loop
    call): its new tokens and their times (engine ms), then its end (failed,
    or finished with ``reason``, a ``FINISH_*`` code) and its §0x06
    extensions (``extensions()``, read only when it ended)."""
    req.output_token_ids.extend(tokens)
    req.token_times_ms.extend(times_ms)
    if failed:
      self.end(req, "failed", "non-finite logits")
    elif finished:
      name = rec.FINISH_NAMES[int(reason)]
      if handoffs.hands_off(self.config.role, req, name, self.config.max_model_len):
        name = "eos" if self.ends_at_first(req) else handoffs.HANDOFF
      self.end(req, "completed", name)
    if req.finished:
      req.num_extensions = int(extensions())

  def drain(self, emit_ms: float, emitted, token, finished, reason, failed, preempt,
            token_logprobs: Dict[int, TokenLogprobs], extensions: Callable,
            max_preemptions: int):
    """One step's news, per slot (host arrays over R: the ``StepFacts``;
    ``token`` may be a list over R of each slot's emitted tokens, and
    ``token_logprobs`` a slot's list of them, with speculative decoding):
    preemptions counted, new tokens and logprobs recorded (``take_news``),
    ended requests' slots vacated. ``extensions()`` fetches i32[R] §0x06
    extensions (once, when a request ended). A request preempted more than
    ``max_preemptions`` times (0: no limit) is left for the caller to fail.

    Returns ``(outputs, release bool[R], thrashing bool[R])``: the
    ``RequestOutput``s, the slots whose request ended (to free on the
    device) and those preempted too often.
    """
    outputs, release = [], np.zeros(len(self.slots), bool)
    thrashing = np.zeros_like(release)
    fetched = []

    def extensions_of(slot):
      if not fetched:
        fetched.append(extensions())
      return fetched[0][slot]

    for slot in np.flatnonzero(emitted | failed | preempt):
      req = self.slots[slot]
      if preempt[slot]:
        req.num_preemptions += 1
        if max_preemptions and req.num_preemptions > max_preemptions:
          thrashing[slot] = True
          continue
      new, new_logprobs = [], None
      if emitted[slot]:
        got = token[slot]
        new = [int(t) for t in got] if isinstance(got, list) else [int(got)]
        if req.want_logprobs:
          got = token_logprobs[slot]
          new_logprobs = got[:len(new)] if isinstance(got, list) else [got]
          req.output_logprobs.extend(new_logprobs)
      self.take_news(req, new, [emit_ms] * len(new), failed[slot], finished[slot],
                     reason[slot], lambda: extensions_of(slot))
      if req.finished:
        release[slot] = True
        self.vacate(slot)
      if new or req.finished:
        outputs.append(RequestOutput(req.request_id, new, req.finished, req.outcome,
                                     req.finish_reason, new_logprobs or None))
    return outputs, release, thrashing

  # --------------------------------------------------------- step records
  def take_logprobs(self, logprobs, emitted, fetch: Callable, spec=None
                    ) -> Dict[int, TokenLogprobs]:
    """Fetches a step's ``StepLogprobs`` (with ``fetch``) when a request that
    asked used them (one more fetch; none otherwise): records the prompt rows of
    requests still in their prompt, and returns each emitting slot's
    ``TokenLogprobs`` (slot -> logprobs) for requests with ``logprobs``.
    A prompt row computed again (a recompute after preemption) writes the
    same values again. Both kinds are the raw model logits' ``log_softmax``
    (vLLM's default "raw_logprobs": before the stop mask, temperature and
    top-k/top-p), float32, from the rows the step ran
    (``serving.engine.executor.StepLogprobs``); a request that wants prompt
    logprobs takes no prefix hit, so every prompt row runs and is scored.
    With speculative decoding (``spec``, the ``StepFacts.spec`` on the host)
    a slot's value is the list of its emitted tokens' logprobs."""
    if logprobs is None:
      return {}
    out = [s for s in np.flatnonzero(emitted)
           if self.slots[s] is not None and self.slots[s].want_logprobs]
    prompt = any(r is not None and r.prompt_logprobs is not None and not r.output_token_ids
                 for r in self.slots)
    if not out and not prompt:
      return {}
    tree = {}
    if out:
      tree["out"] = (logprobs.token, logprobs.top_ids, logprobs.top)
    if prompt:
      tree["prompt"] = (logprobs.num_prompt, logprobs.prompt_slot, logprobs.prompt_pos,
                        logprobs.prompt_token, logprobs.prompt_top_ids, logprobs.prompt_top)
    got = fetch(tree)
    if prompt:
      count, slots, positions, chosen, top_ids, top = got["prompt"]
      for j in range(int(count)):
        req = self.slots[int(slots[j])]
        if req is None or req.prompt_logprobs is None:
          continue
        at = int(positions[j]) + 1
        req.prompt_logprobs.token[at] = chosen[j]
        req.prompt_logprobs.top_ids[at] = top_ids[j]
        req.prompt_logprobs.top[at] = top[j]
    if not out:
      return {}
    chosen, top_ids, top = got["out"]
    if spec is not None:
      accepted = spec[1]
      return {int(s): [TokenLogprobs(float(chosen[s, j]), np.array(top_ids[s, j]),
                                     np.array(top[s, j])) for j in range(1 + int(accepted[s]))]
              for s in out}
    return {int(s): TokenLogprobs(float(chosen[s]), np.array(top_ids[s]), np.array(top[s]))
            for s in out}

  def plan_entry(self, plan, fetched) -> dict:
    """A plan as host data for ``Engine.plan_log``: its request ids,
    intervals, kinds and intents. ``fetched`` is the plan's (selected,
    start, end, kind, rank, admit, preempt, decision_id) and the state's
    status, on the host."""
    sel, start, end, kind, rank, admit, preempt, decision, status = fetched
    name = lambda s: self.slots[s].request_id
    rows = sorted(np.flatnonzero(sel), key=lambda s: rank[s])
    return dict(
        decision_id=int(decision), policy_id=plan.policy_id,
        scheduled=[(name(s), int(start[s]), int(end[s]), rec.KIND_NAMES[kind[s]])
                   for s in rows],
        admitted=[name(s) for s in rows if admit[s]],
        preempted=[name(s) for s in np.flatnonzero(preempt)],
        running=[name(s) for s in np.flatnonzero(status == rec.RUNNING)])
