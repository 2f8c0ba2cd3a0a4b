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
``VirtualClock``.
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


def simulated_execute(params, kv, pages: kv_pages.PageState, buffers,
                      manifest: rec.WorkloadManifest, state: rec.SchedulerState,
                      plan: rec.IterationPlan, *, model, num_rows: int, num_seqs: int,
                      max_model_len: int):
  """Runs one plan without the model. Returns ``(kv, pages, buffers, result)``.

  Args: as ``serving.engine.executor.execute``; ``params`` is unused, ``kv`` is
  passed through, ``num_rows``/``num_seqs`` only key the
  compiled program. The truth ``manifest.hidden_realized_output_tokens``
  (i32[R]) may be None: the declared ``max_tokens`` is then the length.
  """
  del params, num_seqs
  pages = executor.allocate_for_plan(pages, plan)
  p = manifest.prompt_len
  truth = manifest.hidden_realized_output_tokens
  truth = manifest.max_tokens if truth is None else truth
  eos = jnp.asarray(model.eos_token_ids, jnp.int32)
  vocab = model.cfg.vocab_size
  token = (p * 7919 + state.emitted * 31 + 1) % vocab
  token = jnp.where(jnp.isin(token, eos), (token + 1) % vocab, token)
  # The recorded output ends here: EOS if it ended before its cap (a
  # recorded length equal to max_tokens is a length finish).
  forced_eos = state.emitted + 1 >= truth
  token = jnp.where(forced_eos, eos[0], token).astype(jnp.int32)
  pages, buffers, result = executor.take_tokens(
      pages, buffers, manifest, state, plan, token, jnp.ones_like(plan.selected),
      forced_eos & (truth < manifest.max_tokens), max_model_len=max_model_len)
  return kv, pages, buffers, result
