"""Shared pieces of the engine tests: the tiny model, its prompts and
tokenizer, one mixed engine's tokens (the reference of every split run) and
the SmolLM2 cross-check's requests."""

import socket
import time

import httpx
import numpy as np
from tokenizers import pre_tokenizers

from models.config import get_config
from models.tokenizer import Tokenizer, build_bpe_tokenizer
from serving.engine.config import SamplingParams
from serving.engine.engine import Engine

CFG = get_config("tiny")


def prompts(lengths, seed=0):
  """Random prompts (token ids in [3, vocab)) of the given lengths."""
  rng = np.random.default_rng(seed)
  return [rng.integers(3, CFG.vocab_size, size=n).tolist() for n in lengths]


def mixed_tokens(params, config, prompts, samplings, cfg=CFG):
  """Each request's output tokens (requests ``r0``, ``r1``, ... in order)
  on one in-process mixed engine of ``cfg`` (default the tiny model)."""
  engine = Engine(cfg, params, config)
  reqs = [engine.add_request(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, samplings))]
  engine.run()
  return [r.output_token_ids for r in reqs]


SMOLLM2_TEXTS = ("The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):",
                 "A haiku about the sea:")


def smollm2_requests(tok):
  """The SmolLM2 cross-checks' requests: ``SMOLLM2_TEXTS`` encoded by
  ``tok``, the first two greedy, the last two seeded (seeds 7, 8) at
  temperature 0.9, 12 tokens each. Returns ``(prompts, samplings)``."""
  prompts = [tok.encode(t) for t in SMOLLM2_TEXTS]
  samplings = [SamplingParams(max_tokens=12, ignore_eos=True)] * 2 + [
      SamplingParams(max_tokens=12, temperature=0.9, seed=7 + i) for i in range(2)]
  return prompts, samplings


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer():
  """A byte-level tokenizer covering all 512 ids of the tiny model (id 1 is
  its EOS): specials, the 256 byte symbols, then two-letter pieces."""
  tokens = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]
  tokens += sorted(pre_tokenizers.ByteLevel.alphabet())
  letters = "abcdefghijklmnopqrstuvwxyz"
  pairs = (a + b for a in letters for b in letters)
  while len(tokens) < CFG.vocab_size:
    tokens.append("Ġ" + next(pairs))
  return Tokenizer(build_bpe_tokenizer(tokens, [], [3, 3, 3] + [1] * (len(tokens) - 3)),
                   eos_token_id=1, chat_template=CHAT_TEMPLATE)


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def wait_until(cond, timeout_s: float = 30.0) -> None:
  """Polls ``cond()`` every 20 ms; fails the test after ``timeout_s``."""
  deadline = time.monotonic() + timeout_s
  while not cond():
    assert time.monotonic() < deadline, "condition not met in time"
    time.sleep(0.02)


class HttpApp:
  """A FastAPI app served by uvicorn in a thread on a free port, with an
  httpx client at ``http``; ``close()`` stops both."""

  def __init__(self, app, join_timeout_s: float = 60.0):
    from tests.serving.http_testing import serve_in_thread
    self.uvicorn, self.thread, port = serve_in_thread(app)
    self.url = f"http://127.0.0.1:{port}"
    self.http = httpx.Client(base_url=self.url, timeout=60)
    self._join_timeout_s = join_timeout_s

  def close(self):
    self.http.close()
    self.uvicorn.should_exit = True
    self.thread.join(timeout=self._join_timeout_s)


def assert_pages_free(engine):
  """Every page of ``engine`` is free or cached (held by no request): the
  free stack and the cached pages are together pages 1..num_pages - 1."""
  pages = engine.pages
  assert int(np.sum(np.asarray(pages.pages_held))) == 0
  assert not np.asarray(pages.refcount).any()
  free = np.asarray(pages.free_stack)[: int(pages.num_free)].tolist()
  cached = np.flatnonzero(np.asarray(pages.cached)).tolist()
  assert sorted(free + cached) == list(range(1, engine.config.num_pages))


# The simulator tests' cost model (ms per step, per row, per attention
# GFLOP, per GB of KV read) and, worked out by hand for the tiny model (2
# layers, 4 query and 2 KV heads of 16, float32), its FLOPs per query-key
# pair (4 * 4 * 16 per layer) and KV bytes per cached token (2 * 2 * 16 * 4
# per layer).
STEP_MS, ROW_MS, ATTN_MS_PER_GFLOP, KV_MS_PER_GB = 5.0, 0.5, 2000.0, 400.0
PAIR_FLOPS, KV_BYTES = 2 * 4 * 4 * 16, 2 * 2 * 2 * 16 * 4


def step_ms(rows, pairs, keys):
  """The test cost model's step time (ms) for ``rows`` token rows,
  ``pairs`` query-key pairs and ``keys`` cached tokens read."""
  return (STEP_MS + ROW_MS * rows + ATTN_MS_PER_GFLOP * pairs * PAIR_FLOPS / 1e9
          + KV_MS_PER_GB * keys * KV_BYTES / 1e9)


def save_test_cost_model(path) -> str:
  """Writes the test cost model to ``path``; returns it as a str."""
  from serving.engine import cost_model as cost_lib
  cost_lib.CostModel.of(step=STEP_MS, rows=ROW_MS, attention_gflop=ATTN_MS_PER_GFLOP,
                        kv_read_gb=KV_MS_PER_GB).save(path)
  return str(path)
