"""The request table's intake (``serving.engine.request_table``): a request
that can never fit the KV cache is rejected on arrival, its reason saying
the usable pages' makeup and the num_pages that would hold it; one a policy
can never schedule is told the same makeup (``never_reason``)."""

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


def test_a_request_the_policy_can_never_schedule_is_told_its_prompt_and_pages():
  """Accepted (20 + 4 - 1 = 23 KV rows, 6 pages of the 9 usable), then
  refused by a policy: the reason gives its prompt beside the token budget
  and its pages beside the cache's makeup, the admission rejection's
  wording; a 20-token prompt wider than the 16-token budget is told the
  budget that takes it whole."""
  table = RequestTable(dataclasses.replace(TINY, num_pages=10, watermark_pages=2), 512)
  wide = table.accept("w", list(range(1, 21)), SamplingParams(max_tokens=4), 0.0, 0, "c",
                      None, None, False, False)
  assert not wide.finished
  assert table.never_reason(wide, "orca") == (
      "policy orca can never schedule it: its prompt has 20 tokens, the token budget "
      "(max_num_batched_tokens) 16; it needs 6 KV pages for 23 KV rows (prompt + max_tokens "
      "- 1); the cache has 9 (num_pages 10 less page 0, the null page; its 2 watermark pages "
      "are kept free only while other requests run); to run its prompt whole, raise "
      "max_num_batched_tokens (--max_num_batched_tokens) to at least 20")


def test_a_never_reason_within_the_budget_gives_the_numbers_alone():
  """12 + 8 - 1 = 19 KV rows, 5 pages: the prompt fits the budget and the
  pages the cache, so the policy's own rule refused it and no fix is said."""
  table = RequestTable(TINY, 512)
  req = table.accept("r", list(range(1, 13)), SamplingParams(max_tokens=8), 0.0, 0, "c",
                     None, None, False, False)
  assert table.never_reason(req, "mine") == (
      "policy mine can never schedule it: its prompt has 12 tokens, the token budget "
      "(max_num_batched_tokens) 16; it needs 5 KV pages for 19 KV rows (prompt + max_tokens "
      "- 1); the cache has 63 (num_pages 64 less page 0, the null page)")
