"""``scripts/calibrate.py --quick``: its smaller grid, flags given explicitly
winning over it (refusals only: nothing is measured here)."""

from tests.e2e import refusals


def test_quick_grid_is_refused_like_the_full_one():
  # --quick sets decode_tokens 4; an explicit --decode_tokens wins and is checked.
  status, last = refusals.refused("calibrate.py", "--quick", "--decode_tokens=0")
  assert (status, last) == (2, "error: --decode_tokens must be >= 1, got 0")
  # Its grid (batch 1, 8 x prompts 32, 256) against --max_case_tokens: the
  # smallest case is 1 x 32 tokens.
  status, last = refusals.refused("calibrate.py", "--quick", "--max_case_tokens=31")
  assert (status, last) == (2, "error: --max_case_tokens=31 skips every grid case: the "
                               "smallest N x L of --batch_sizes and --prompt_lens is 32")
