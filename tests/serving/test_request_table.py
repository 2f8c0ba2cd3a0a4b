"""The request table's intake (``serving.engine.request_table``): a request
that can never fit the KV cache is rejected on arrival, its reason saying
the usable pages' makeup and the num_pages that would hold it."""

import dataclasses

from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.request_table import RequestTable

TINY = EngineConfig.preset("tiny")           # page_size 4, no watermark


def _accept(config, prompt_len, max_tokens):
  table = RequestTable(config, vocab_size=512)
  return table.accept("r", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                      0.0, 0, "c", None, None, False, False)


def test_a_request_too_large_for_the_cache_is_told_the_pages_and_the_fix():
  """20 + 4 - 1 = 23 KV rows, 6 pages of 4; num_pages=4 is the null page and
  3 usable ones, and 7 would hold the request."""
  req = _accept(dataclasses.replace(TINY, num_pages=4), 20, 4)
  assert (req.outcome, req.finish_reason) == (
      "rejected", "needs 6 KV pages for 23 KV rows (prompt + max_tokens - 1); the cache has 3 "
                  "(num_pages 4 less page 0, the null page): raise num_pages (--num_pages) to at "
                  "least 7")
  assert not _accept(dataclasses.replace(TINY, num_pages=7), 20, 4).finished


def test_the_watermark_is_said_not_to_count_against_a_request_alone():
  """The watermark's pages are kept free at admission only while anything
  else runs: the bound is still num_pages - 1, and the reason says why."""
  config = dataclasses.replace(TINY, num_pages=4, watermark_pages=2)
  assert _accept(config, 20, 4).finish_reason == (
      "needs 6 KV pages for 23 KV rows (prompt + max_tokens - 1); the cache has 3 (num_pages 4 "
      "less page 0, the null page; its 2 watermark pages are kept free only while other "
      "requests run): raise num_pages (--num_pages) to at least 7")
  assert not _accept(dataclasses.replace(config, num_pages=7), 20, 4).finished
