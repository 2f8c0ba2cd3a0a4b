"""A closed loop on the engine API, and the prompt-copying workload it runs
in ``scripts/bench_speculative.py``.

A closed loop of concurrency c keeps c requests live: it adds the first c,
then one more each time one ends, until every request has ended (no
arrival times: the load is the concurrency). Prompt copying asks the model
to repeat a passage word for word, the workload where n-gram drafts (prompt
lookup) find their continuations in the prompt.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable, Dict, List, Sequence

from serving.engine.config import SamplingParams

COPY_INSTRUCTION = "Repeat the following passage word for word, and write nothing else."


def copy_passages(path: str, num: int, words: int) -> List[str]:
  """``num`` passages of ``words`` words each from the first turns of an
  MT-Bench question file (JSON lines with a ``turns`` list), joined in file
  order into one stream of words (wrapping round at its end): passage i
  starts with question ``i`` (modulo the number of questions: past it the
  passages repeat) and runs on into the questions after it.

  Raises:
    ValueError: naming the file (and line): it does not read, a row that is
      not JSON with a non-empty text ``turns[0]``, or no words at all.
  """
  try:
    with open(path) as f:
      lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
  except OSError as e:
    raise ValueError(f"{path}: cannot read ({e.strerror})") from None
  stream, starts = [], []
  for i, line in lines:
    try:
      turn = json.loads(line)["turns"][0]
    except (json.JSONDecodeError, KeyError, IndexError, TypeError):
      raise ValueError(f"{path}:{i}: each row must be JSON with a non-empty 'turns' "
                       f"list") from None
    if not isinstance(turn, str) or not turn.strip():
      raise ValueError(f"{path}:{i}: turns[0] must be non-empty text")
    starts.append(len(stream))
    stream += turn.split()
  if not stream:
    raise ValueError(f"{path}: no questions")
  return [" ".join(stream[(starts[i % len(starts)] + j) % len(stream)] for j in range(words))
          for i in range(num)]


def copy_prompt_ids(tokenizer, passage: str, prime_words: int = 0) -> List[int]:
  """The chat prompt asking to repeat ``passage`` (``COPY_INSTRUCTION``),
  rendered by the model's chat template, its answer begun with the
  passage's first ``prime_words`` words (a small model otherwise tends to
  answer the question the passage asks), as token ids (the rendered text
  holds its special tokens: none added again)."""
  text = tokenizer.apply_chat_template(
      [{"role": "user", "content": f"{COPY_INSTRUCTION}\n\n{passage}"}],
      add_generation_prompt=True)
  return tokenizer.encode(text + " ".join(passage.split()[:prime_words]),
                          add_special_tokens=False)


@dataclasses.dataclass(frozen=True)
class ClosedLoopRun:
  """What one closed loop did.

  Attributes:
    output_token_ids: request id -> its output token ids, in the order the
      requests were added.
    token_times_ms: request id -> its tokens' emission times (engine clock, ms).
    seconds: wall seconds from the first request added to the last ended.
    iterations: engine iterations run.
    max_live: the most requests added and not yet ended at once.
  """

  output_token_ids: Dict[str, List[int]]
  token_times_ms: Dict[str, List[float]]
  seconds: float
  iterations: int
  max_live: int

  @property
  def output_tokens(self) -> int:
    return sum(map(len, self.output_token_ids.values()))

  @property
  def mean_tpot_ms(self) -> float | None:
    """Mean over requests of at least 2 tokens of (last - first token time)
    / (tokens - 1), ms; None when no request has 2."""
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in self.token_times_ms.values() if len(t) > 1]
    return sum(tpots) / len(tpots) if tpots else None


def run_closed_loop(engine, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                    concurrency: int, *, id_prefix: str = "r", cache_salt: str = "",
                    wall: Callable[[], float] = time.perf_counter) -> ClosedLoopRun:
  """Runs ``prompts`` (request ids ``{id_prefix}{i}``, each with ``sampling``
  and ``cache_salt``) through ``engine`` with ``concurrency`` of them live at
  a time, until every one has ended.

  Raises:
    ValueError: ``concurrency`` below 1, or ``add_request``'s refusals.
    RuntimeError: a request ended other than ``completed`` (its id, outcome
      and reason).
  """
  if concurrency < 1:
    raise ValueError(f"concurrency must be >= 1, got {concurrency}")
  ids = [f"{id_prefix}{i}" for i in range(len(prompts))]
  start_iterations, added, live, max_live = engine.num_iterations, 0, 0, 0
  t = wall()

  def add():
    nonlocal added, live, max_live
    engine.add_request(ids[added], prompts[added], sampling, cache_salt=cache_salt)
    added, live = added + 1, live + 1
    max_live = max(max_live, live)

  while added < min(concurrency, len(ids)):
    add()
  while engine.has_unfinished():
    for out in engine.step():
      if out.finished:
        live -= 1
        if added < len(ids):
          add()
  seconds = wall() - t
  reqs = [engine.requests[i] for i in ids]
  for r in reqs:
    if r.outcome != "completed":
      raise RuntimeError(f"request {r.request_id} ended {r.outcome!r}: {r.finish_reason}")
  return ClosedLoopRun({r.request_id: list(r.output_token_ids) for r in reqs},
                       {r.request_id: list(r.token_times_ms) for r in reqs}, seconds,
                       engine.num_iterations - start_iterations, max_live)
