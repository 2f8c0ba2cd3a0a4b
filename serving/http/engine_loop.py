"""The engine thread of the OpenAI server: ``EngineLoop`` drives ``Engine.step``
and fans each request's output out to its HTTP handler.

Threads: one engine thread owns the ``Engine``. Between iterations it drains
a command queue (add, abort), runs one ``step``, detokenizes each request's
new tokens, matches its stop strings on the text and pushes events to the
request's asyncio queue on the HTTP event loop. When nothing is live it
blocks on the command queue (no spin). HTTP handlers never touch engine
state: they validate the body, enqueue an add, and read their queue.

Request lifecycle: every request the server accepts ends completed,
cancelled (client disconnected: aborted at the next iteration boundary,
its KV pages freed), rejected or failed, and ``/metrics`` counts each. Once
its final event is out the request and, if idle, its client are evicted
from the engine's host tables (bounded memory for a long-running server).

Text rules: ``IncrementalDetokenizer`` (one rule for an unfinished UTF-8
character, stream and final text alike); stop strings match across token
boundaries on the text, the matched text is not returned (OpenAI), and the
request ends ``completed`` with finish_reason "stop" through
``Engine.finish``. While streaming, the last ``len(longest stop) - 1``
characters are held back until they can no longer start a stop string, so
the concatenated deltas always equal the non-streamed text.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Dict, List, Optional

import jax
import numpy as np

from scheduler import records as rec
from serving.engine.engine import Engine
from serving.engine.requests import TokenLogprobs
from serving.http.metrics import ServerMetrics
from serving.http.parsing import ParsedRequest
from serving.http.protocol import OVERLOAD_ERRORS

# The identity every client past the engine's table shares (``EngineLoop``).
OVERFLOW_CLIENT = "~overflow"


class _Live:
  """Server-side state of one engine request, choice ``index`` of its HTTP
  request (owned by the engine thread after add)."""

  def __init__(self, rid: str, index: int, parsed: ParsedRequest, detok,
               events: asyncio.Queue, loop: asyncio.AbstractEventLoop):
    self.rid = rid
    self.index = index
    self.parsed = parsed
    self.prompt_token_ids = parsed.prompts[index]
    self.sampling = parsed.samplings[index]
    self.detok = detok
    self.events = events
    self.loop = loop
    self.text = ""          # text so far, stop-string match removed
    self.sent = 0           # characters of ``text`` already pushed
    # (token id, ``engine.TokenLogprobs``) of every output token, when asked,
    # and how many of them were pushed.
    self.logprobs: List[tuple] = []
    self.logprobs_sent = 0
    # ``echo``: the prompt's text and its (token id, logprobs or None)
    # entries, set and pushed with the first output token.
    self.echo_text = ""
    self.echo_logprobs: List[tuple] = []
    self.echoed = False
    self.queued_ms: Optional[float] = None
    # Prompt tokens taken from the prefix cache when it was first scheduled
    # (a recompute preemption's later lookup finds its own pages: not counted).
    self.cached_tokens = 0
    # The fairness identity the engine got (``ParsedRequest.client``, or
    # OVERFLOW_CLIENT when the identity table was full).
    self.client = parsed.client
    # Original arrival (``time.monotonic()`` s) when a front forwarded it.
    self.arrival_s: Optional[float] = None
    # Copy j > 0 of a prompt: the id of copy 0, which computes the prompt
    # first (``EngineLoop`` holds this copy back until then); else None.
    self.leader: Optional[str] = None

  def push(self, event: dict) -> None:
    event["index"] = self.index
    self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineLoop:
  """The thread that owns the engine (see the module docstring).

  Parallel sampling's prompt sharing lives here: a copy whose ``leader``
  (copy 0 of its prompt) is live and whose prompt can hit the prefix cache
  is accepted but held on the host; when the leader emits its first token
  (its prompt is computed and its full pages cached) or ends, the held
  copies enter the engine, which maps those pages into their tables. A
  held copy that is aborted enters the engine and is cancelled there, so
  every copy ends with an engine outcome and is counted once.

  Identities: the engine's fairness table holds ``num_clients`` clients
  with requests in it; here the first ``num_clients - 1`` distinct ones
  get their own place and every other shares OVERFLOW_CLIENT (one place
  kept for it), so no request is refused for its identity.

  Death: when a step raises, every request the loop holds, and every add
  still queued or sent later, ends with an "error" event; then
  ``on_death(error)`` runs (the server stops, its launcher exits non-zero).

  Args:
    engine: the Engine (used from this thread only once ``start`` ran).
    tokenizer: ``models.tokenizer.Tokenizer``.
    metrics: ``ServerMetrics``.
    on_death: called with the exception once the engine thread failed.
  """

  def __init__(self, engine: Engine, tokenizer, metrics: ServerMetrics, on_death=None):
    self.engine = engine
    self.tokenizer = tokenizer
    self.metrics = metrics
    self.on_death = on_death
    self._clients: Dict[str, int] = {}           # identity -> requests in the engine
    self._dead = threading.Lock()                # held while adds and death race
    self._commands: "queue.Queue[tuple]" = queue.Queue()
    self._live: Dict[str, _Live] = {}
    self._held: Dict[str, _Live] = {}             # held copies by id
    self._waiting: Dict[str, List[_Live]] = {}    # leader id -> its held copies
    self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
    self._stopping = False
    self.error: Optional[BaseException] = None

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    self._stopping = True
    self._commands.put(("stop",))
    self._thread.join(timeout=30)

  def add(self, lives: List[_Live]) -> None:
    """Adds the engine requests of one HTTP request (its choices) between
    two iterations, in ``index`` order (after the engine's death: each ends
    with an "error" event at once)."""
    with self._dead:
      if self.error is None:
        self._commands.put(("add", lives))
        return
    self._fail(lives, self.error)

  def abort(self, rid: str) -> None:
    self._commands.put(("abort", rid))

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and self.error is None

  # --------------------------------------------------------- engine thread
  def _run(self) -> None:
    try:
      while not self._stopping:
        block = not self.engine.has_unfinished()
        if self._drain_commands(block):
          self.metrics.observe_engine(self.engine, self._unslotted())
        if self._stopping:
          break
        if self.engine.has_unfinished():
          start_ms = self.engine.now_ms()
          outputs = self.engine.step()
          self._stamp_queue_time(start_ms, outputs)
          # Gauges first: a client that sees its last event sees them too.
          self.metrics.observe_engine(self.engine, self._unslotted())
          if self._deliver(outputs):           # stop strings freed slots
            self.metrics.observe_engine(self.engine, self._unslotted())
      while self._live or self._held:     # shutting down: end what is live
        self._abort(next(iter(self._held or self._live)))
    except BaseException as e:          # the engine broke: fail every request
      with self._dead:
        self.error = e
        queued = []
        while not self._commands.empty():
          command = self._commands.get()
          if command[0] == "add":
            queued += command[1]
      self._fail(list(self._live.values()) + list(self._held.values()) + queued, e)
      self._live.clear()
      self._held.clear()
      self._waiting.clear()
      if self.on_death is not None:
        self.on_death(e)
      raise

  def _fail(self, lives: List[_Live], error: BaseException) -> None:
    """Ends each of ``lives`` (admitted, engine dead) with an "error" event."""
    for live in lives:
      live.push({"type": "error", "status": 500,
                 "error": f"engine failed: {type(error).__name__}: {error}"})
      self.metrics.outcome("failed", "engine error")
      self.metrics.release()

  def _unslotted(self) -> int:
    """Live requests with no engine slot yet (held copies included)."""
    return (sum(1 for rid in self._live if self.engine.requests[rid].slot < 0)
            + len(self._held))

  def _drain_commands(self, block: bool) -> int:
    """Runs queued commands (blocking for the first when ``block``); returns
    how many ran."""
    ran = 0
    while True:
      try:
        command = self._commands.get(block=block)
      except queue.Empty:
        return ran
      block = False
      ran += 1
      if command[0] == "stop":
        self._stopping = True
        return ran
      if command[0] == "add":
        self._add_all(command[1])
      elif command[0] == "abort":
        self._abort(command[1])

  def _add_all(self, lives: List[_Live]) -> None:
    """Adds one HTTP request's choices; each pushes its first event
    (accepted, refused, or the end of a request rejected at once). After a
    refusal the choices before it are cancelled and those after it are
    never added (the handler answers with the refusal). A copy whose
    leader is live is held (``_hold``)."""
    for i, live in enumerate(lives):
      if live.leader in self._live and self._shares_prompt(live):
        self._hold(live)
        continue
      if not self._add(live):
        for done in lives[:i]:
          self._abort(done.rid)
        for never in lives[i + 1:]:
          self.metrics.release()
        return

  def _shares_prompt(self, live: _Live) -> bool:
    """Whether ``live`` can take its prompt's full pages from the prefix
    cache once its leader computed them: caching on, no prompt logprobs
    (such a request takes no hit), and at least one full page before the
    prompt's last token."""
    c = self.engine.config
    return (c.enable_prefix_caching and not live.parsed.extra.get("prompt_logprobs")
            and len(live.prompt_token_ids) > c.page_size)

  def _hold(self, live: _Live) -> None:
    """Accepts a copy without adding it to the engine yet."""
    self._held[live.rid] = live
    self._waiting.setdefault(live.leader, []).append(live)
    live.push({"type": "accepted"})

  def _release(self, leader: str) -> None:
    """Adds the copies held for ``leader`` to the engine."""
    for live in self._waiting.pop(leader, []):
      del self._held[live.rid]
      self._add(live, accepted=True)

  def _release_one(self, live: _Live) -> None:
    """Adds one held copy to the engine ahead of its leader's signal."""
    del self._held[live.rid]
    self._waiting[live.leader].remove(live)
    self._add(live, accepted=True)

  def _add(self, live: _Live, accepted: bool = False) -> bool:
    """Adds one engine request; False when the engine refused it. A held
    copy (``accepted``: its client already saw it accepted) that the
    engine refuses ends with that refusal as its "end" event."""
    p = live.parsed
    arrival_ms = None
    if live.arrival_s is not None and self.engine.clock is time.monotonic:
      arrival_ms = self.engine.now_ms() - (time.monotonic() - live.arrival_s) * 1e3
    live.client = p.client
    own = len(self._clients) - (OVERFLOW_CLIENT in self._clients)
    if p.client not in self._clients and own >= self.engine.config.num_clients - 1:
      live.client = OVERFLOW_CLIENT
    try:
      req = self.engine.add_request(live.rid, live.prompt_token_ids, live.sampling,
                                    arrival_ms=arrival_ms, priority=p.priority,
                                    client=live.client, **p.extra)
    except Exception as e:          # refused by the engine: never accepted
      if accepted:
        live.push({"type": "end", "outcome": "rejected", "reason": str(e), "exc": e,
                   "finish_reason": None})
      else:
        live.push({"type": "refused", "exc": e})
      self.metrics.refused("overloaded" if isinstance(e, OVERLOAD_ERRORS) else "bad_request")
      self.metrics.release()
      return False
    self._live[live.rid] = live
    self._clients[live.client] = self._clients.get(live.client, 0) + 1
    self.metrics.prompt_tokens.inc(len(live.prompt_token_ids))
    if req.finished:          # rejected at once (can never fit the KV cache): its
      self._end(live, req)    # "end" is the first event, a 400 before any stream
      return True
    if not accepted:
      live.push({"type": "accepted"})
    return True

  def _stamp_queue_time(self, start_ms: float, outputs) -> None:
    """Queue time (arrival -> start of the first iteration that scheduled
    the request) for requests first seen running or emitting in this step."""
    status = np.asarray(jax.device_get(self.engine.state.status))
    news = {o.request_id for o in outputs}
    for rid, live in self._live.items():
      if live.queued_ms is not None:
        continue
      req = self.engine.requests[rid]
      if rid in news or (req.slot >= 0 and status[req.slot] == rec.RUNNING):
        live.queued_ms = start_ms - req.arrival_ms
        live.cached_tokens = req.prefix_hit_tokens
        self.metrics.queue_time.observe(max(live.queued_ms, 0.0) / 1e3)

  def _abort(self, rid: str) -> None:
    if rid in self._held:                 # into the engine, to be cancelled there
      self._release_one(self._held[rid])
    live = self._live.get(rid)
    if live is None:                      # already ended
      return
    self.engine.abort(rid)
    self._end(live, self.engine.requests[rid])

  def _deliver(self, outputs) -> bool:
    """Pushes each output's text to its client; True when a stop string
    ended a request here (``Engine.finish``)."""
    finished_here = False
    for out in outputs:
      live = self._live.get(out.request_id)
      if live is None:
        continue
      req = self.engine.requests[out.request_id]
      self.metrics.generation_tokens.inc(len(out.new_token_ids))
      if live.parsed.echo_texts is not None and not live.echoed:
        self._echo(live, req)
      if live.parsed.score_only:        # the one token the engine needs: dropped
        self._end(live, req)
        continue
      if out.new_logprobs:
        live.logprobs.extend(zip(out.new_token_ids, out.new_logprobs))
      piece = live.detok.push_many(out.new_token_ids)
      if out.finished:
        piece += live.detok.flush()
      # Like EOS and stop ids, stop strings count from min_tokens on.
      stopped = self._append(live, piece, check=len(req.output_token_ids) >=
                             live.sampling.min_tokens)
      if stopped and not out.finished:
        self.engine.finish(out.request_id, "stop")
        finished_here = True
      if stopped or out.finished:
        self._end(live, req, stop_string=stopped)
      else:
        self._push_text(live, len(req.output_token_ids), final=False)
      self._release(out.request_id)   # its prompt is computed: the copies start
    return finished_here

  def _echo(self, live: _Live, req) -> None:
    """Pushes the prompt's text and, with logprobs, its tokens' logprobs
    (the engine's ``Request.prompt_logprobs``, complete once the first
    output token is out; the first token has none) as the first delta."""
    live.echoed = True
    live.echo_text = live.parsed.echo_texts[live.index]
    if live.parsed.logprobs is not None:
      prompt = req.prompt_logprobs
      live.echo_logprobs = [(req.prompt_token_ids[0], None)] + [
          (t, TokenLogprobs(float(prompt.token[j]), prompt.top_ids[j], prompt.top[j]))
          for j, t in enumerate(req.prompt_token_ids) if j > 0]
    live.push({"type": "delta", "text": live.echo_text, "completion_tokens": 0,
               "logprobs": live.echo_logprobs})

  def _append(self, live: _Live, piece: str, check: bool) -> bool:
    """Adds ``piece`` to the text; when ``check``, True if a stop string
    ends in it (the text is then cut where the match starts)."""
    stops = live.parsed.stop
    if not piece:
      return False
    start = max(0, len(live.text) - max((len(s) for s in stops), default=0) + 1)
    live.text += piece
    if not check:
      return False
    hits = [i for i in (live.text.find(s, start) for s in stops) if i >= 0]
    if hits:
      live.text = live.text[:min(hits)]
      return True
    return False

  def _push_text(self, live: _Live, completion_tokens: int, final: bool) -> None:
    """Pushes the text not sent yet (all of it when ``final``, else all but
    what could still start a stop string) as a "delta" event, with the
    request's output tokens so far and the logprobs of the tokens not sent
    yet (with the next text, or at the end; so a chunk's logprobs may run
    ahead of its text while a stop string could still match)."""
    hold = 0 if final else max((len(s) for s in live.parsed.stop), default=1) - 1
    upto = max(live.sent, len(live.text) - hold)
    if upto > live.sent or (final and live.logprobs_sent < len(live.logprobs)):
      live.push({"type": "delta", "text": live.text[live.sent:upto],
                 "completion_tokens": completion_tokens,
                 "logprobs": live.logprobs[live.logprobs_sent:]})
      live.sent = upto
      live.logprobs_sent = len(live.logprobs)

  def _end(self, live: _Live, req, stop_string: bool = False) -> None:
    self._push_text(live, len(req.output_token_ids), final=True)
    outcome, reason = req.outcome, req.finish_reason
    finish = None
    if outcome == "completed":   # OpenAI: "stop" (EOS, stop id or string) or "length"
      finish = "length" if reason == "length" and not stop_string else "stop"
      if live.parsed.score_only:   # max_tokens 0: the length it asked for
        finish = "length"
    self.metrics.finished(self.engine, req, finish)
    live.push({"type": "end", "outcome": outcome, "reason": reason, "finish_reason": finish,
               "prompt_tokens": len(req.prompt_token_ids),
               "cached_tokens": live.cached_tokens,
               "completion_tokens": (0 if live.parsed.score_only else
                                     len(req.output_token_ids)),
               "text": live.echo_text + live.text,
               "logprobs": live.echo_logprobs + live.logprobs})
    del self._live[live.rid]
    self._clients[live.client] -= 1
    if not self._clients[live.client]:
      del self._clients[live.client]
    self.engine.evict(live.rid)
    self.metrics.release()
    self._release(live.rid)         # a leader that ended: its copies start
