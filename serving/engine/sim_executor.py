"""The simulated executor and the virtual clock.

``simulated_execute`` has the signature of ``serving.engine.executor.execute`` and
runs the same allocator steps (release preempted pages, allocate the planned
intervals, free finished requests); only the model call is replaced. Each
emitting sequence gets a deterministic non-EOS token id until its recorded
output length, the workload's hidden truth
(``manifest.hidden_realized_output_tokens``, which ``online()`` strips, so no
policy sees it), where it emits EOS. The declared ``max_tokens`` and the
context length still end a request first ("length"), as in the model
executor. The step's time is charged by the engine from a cost model on a
``VirtualClock``. With speculative decoding a verified row accepts drafts
at a stated per-token rate (``EngineConfig.spec_acceptance``), drawn from
a hash of (seed, request id, output index) (``accepted_drafts``).
"""

from __future__ import annotations

import jax.numpy as jnp

from scheduler import records as rec
from serving.engine import executor
from serving.kv import pages as kv_pages


class VirtualClock:
  """A clock (seconds) that moves only when told: ``advance(seconds)``.

  Callable like ``time.monotonic``; the engine charges modelled step times
  to it, a replay jumps it to the next arrival when idle.
  """

  def __init__(self, start_s: float = 0.0):
    self._now_s = float(start_s)

  def __call__(self) -> float:
    return self._now_s

  def advance(self, seconds: float) -> None:
    if not seconds >= 0:
      raise ValueError(f"VirtualClock.advance needs seconds >= 0, got {seconds!r}")
    self._now_s += float(seconds)

  def advance_to(self, seconds: float) -> None:
    """Moves the clock to ``seconds`` (not back): where a simulation that
    advanced a copy of it elsewhere (``Engine.simulate``) left it."""
    if not seconds >= self._now_s:
      raise ValueError(f"VirtualClock.advance_to needs seconds >= now ({self._now_s!r}), "
                       f"got {seconds!r}")
    self._now_s = float(seconds)


def _mix32(x):
  """u32 -> u32: an integer finalizer (xor-shift-multiply), a counter-based
  hash: equal inputs give equal outputs, no state is carried."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def draft_uniform(seed: int, request_id, index):
  """f32[...] in [0, 1): the draw of the draft that guesses output
  ``index`` (0-based) of request ``request_id``, under ``seed``: a hash of
  the three (``_mix32``), its top 24 bits over 2**24 (exact in float32).

  Args:
    seed: static int >= 0 (``EngineConfig.spec_seed``).
    request_id, index: i32 arrays, broadcast together.
  """
  u32 = lambda v: jnp.asarray(v).astype(jnp.uint32)
  h = _mix32(u32(seed) + jnp.uint32(0x9E3779B9))
  h = _mix32(h ^ u32(request_id))
  h = _mix32(h ^ u32(index))
  return (h >> 8).astype(jnp.float32) / jnp.float32(1 << 24)


def accepted_drafts(seed: int, acceptance: float, request_id, emitted, num_draft, k: int):
  """i32[R]: the drafts each verified row accepts: the leading successes of
  per-position Bernoulli(``acceptance``) draws, at most ``num_draft``.

  Draft j (0-based) of a row at ``emitted`` outputs guesses output
  ``emitted + 1 + j`` and succeeds iff ``draft_uniform(seed, request_id,
  emitted + 1 + j) < acceptance``: the same draws whatever k, bucket or
  batch the row ran in.

  Args:
    seed: static int; acceptance: static alpha in (0, 1].
    request_id, emitted, num_draft: i32[R]; k: static, the most drafts.
  """
  j = jnp.arange(k, dtype=jnp.int32)
  u = draft_uniform(seed, request_id[:, None], emitted[:, None] + 1 + j[None, :])
  hit = (u < acceptance) & (j[None, :] < num_draft[:, None])
  return jnp.sum(jnp.cumprod(hit.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def simulated_execute(params, kv, pages: kv_pages.PageState, buffers,
                      manifest: rec.WorkloadManifest, state: rec.SchedulerState,
                      plan: rec.IterationPlan, *, model, num_rows: int, num_seqs: int,
                      max_model_len: int, speculation=None, acceptance: float = 1.0,
                      seed: int = 0):
  """Runs one plan without the model. Returns ``(kv, pages, buffers, result)``.

  Args: as ``serving.engine.executor.execute``; ``params`` is unused, ``kv`` is
  passed through, ``num_rows``/``num_seqs`` only key the
  compiled program. The truth ``manifest.hidden_realized_output_tokens``
  (i32[R]) may be None: the declared ``max_tokens`` is then the length.
  speculation: static ``Speculation`` or None. With it, a decode row
  carrying ``plan.num_draft`` drafts offers the tokens of outputs ``e``,
  ``e + 1``, ... (the ones it emits without speculation, so a request's
  tokens do not change) and accepts ``accepted_drafts(seed, acceptance,
  ...)`` of its drafts; the recorded length still ends it (its EOS is
  among the offered tokens: ``stop_rules`` emits up to it).
  acceptance, seed: static (``EngineConfig.spec_acceptance``, ``spec_seed``).
  """
  del params, num_seqs
  pages = executor.allocate_for_plan(pages, plan)
  p = manifest.prompt_len
  truth = manifest.hidden_realized_output_tokens
  truth = manifest.max_tokens if truth is None else truth
  eos = jnp.asarray(model.eos_token_ids, jnp.int32)
  vocab = model.cfg.vocab_size
  width = 1 if speculation is None else 1 + speculation.k
  index = state.emitted[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]    # [R, W]
  token = (p[:, None] * 7919 + index * 31 + 1) % vocab
  token = jnp.where(jnp.isin(token, eos), (token + 1) % vocab, token)
  # The recorded output ends here: EOS if it ended before its cap (a
  # recorded length equal to max_tokens is a length finish).
  forced_eos = index + 1 >= truth[:, None]
  token = jnp.where(forced_eos, eos[0], token).astype(jnp.int32)
  is_eos = forced_eos & (truth < manifest.max_tokens)[:, None]
  verified = None
  if speculation is None:
    token, is_eos = token[:, 0], is_eos[:, 0]
  else:
    verified = accepted_drafts(seed, acceptance, manifest.request_id, state.emitted,
                               rec.num_draft(plan), speculation.k)
  pages, buffers, result = executor.take_tokens(
      pages, buffers, manifest, state, plan, token, jnp.ones(plan.selected.shape, bool),
      is_eos, max_model_len=max_model_len, verified=verified)
  return kv, pages, buffers, result
