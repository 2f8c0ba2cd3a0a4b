"""Fixtures the launcher tests share."""

import pytest


@pytest.fixture
def short_trace(tmp_path):
  """An Azure trace of two requests, arriving at 0 and 3 s (its path)."""
  path = tmp_path / "short.csv"
  path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                  "2023-11-16 18:15:10.0000000,20,4\n2023-11-16 18:15:13.0000000,30,4\n")
  return path
