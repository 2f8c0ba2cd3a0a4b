"""The simulated executor and the virtual clock.

``simulated_execute`` has the signature of ``serving.executor.execute`` and
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
from serving import kv_pages


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


def simulated_execute(params, kv, pages: kv_pages.PageState, buffers, manifest: rec.WorkloadManifest,
                      state: rec.SchedulerState, plan: rec.IterationPlan, *, model,
                      num_rows: int, num_seqs: int, sample_rows: int, max_model_len: int):
  """Runs one plan without the model. Returns ``(kv, pages, buffers, result)``.

  Args: as ``serving.executor.execute``; ``params`` is unused, ``kv`` is
  passed through, ``num_rows``/``num_seqs``/``sample_rows`` only key the
  compiled program. The truth ``manifest.hidden_realized_output_tokens``
  (i32[R]) may be None: the declared ``max_tokens`` is then the length.
  """
  del params, num_seqs, sample_rows
  pages = kv_pages.deallocate(pages, plan.preempt)
  rows_needed = jnp.where(plan.selected, plan.end, 0)
  max_new = -(-(plan.token_budget + pages.page_size) // pages.page_size)
  pages = kv_pages.allocate(pages, rows_needed, max_new_per_slot=max_new)

  p = manifest.prompt_len
  truth = manifest.hidden_realized_output_tokens
  truth = manifest.max_tokens if truth is None else truth
  eos = jnp.asarray(model.eos_token_ids, jnp.int32)
  vocab = model.cfg.vocab_size
  token = (p * 7919 + state.emitted * 31 + 1) % vocab
  token = jnp.where(jnp.isin(token, eos), (token + 1) % vocab, token)
  emits = plan.selected & ((plan.kind == rec.DECODE_ROW) | (
      (plan.kind == rec.PREFILL_CHUNK) & (plan.end == p)))
  new_e = state.emitted + 1
  forced_eos = new_e >= truth
  token = jnp.where(forced_eos, eos[0], token).astype(jnp.int32)
  is_stop = jnp.any(token[:, None] == buffers.stop_ids, axis=1) & ~forced_eos
  at_length = (new_e >= manifest.max_tokens) | (p + new_e >= max_model_len)
  reason = jnp.select([is_stop, at_length, forced_eos],
                      [rec.FINISH_STOP, rec.FINISH_LENGTH, rec.FINISH_EOS],
                      rec.NOT_FINISHED)
  finished = emits & (reason != rec.NOT_FINISHED)
  num_slots = plan.selected.shape[0]
  write_col = jnp.where(emits, p + state.emitted, max_model_len)      # OOB -> drop
  buffers = buffers.replace(tokens=buffers.tokens.at[jnp.arange(num_slots), write_col].set(
      token, mode="drop"))
  pages = kv_pages.deallocate(pages, finished)
  done = plan.selected
  result = rec.IterationResult(
      decision_id=plan.decision_id,
      input_state_version=plan.input_state_version,
      completed=done,
      completed_end=jnp.where(done, plan.end, state.computed),
      emitted=emits,
      token=jnp.where(emits, token, -1),
      emit_ms=jnp.float32(0.0),
      finished=finished,
      finish_reason=jnp.where(finished, reason, rec.NOT_FINISHED).astype(jnp.int32),
      failed=jnp.zeros_like(done),
      service_rows=jnp.where(done, plan.end - plan.start, 0))
  return kv, pages, buffers, result
