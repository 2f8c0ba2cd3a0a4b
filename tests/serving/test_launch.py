"""The launchers' startup line: the model phrase names the context the
engine serves (its ``max_model_len``), not only the model's own."""

import dataclasses

from serving.cli import launch
from tests.serving.engine_testing import CFG


def test_the_model_line_names_the_context_served():
  assert CFG.max_position == 512 and not CFG.is_moe
  assert launch.describe_model(CFG) == "llama, 2 layers, d_model 64, context 512"
  assert launch.describe_model(CFG, 512) == "llama, 2 layers, d_model 64, context 512"
  assert (launch.describe_model(CFG, 128)
          == "llama, 2 layers, d_model 64, context 128 (the model's 512)")
  big = dataclasses.replace(CFG, max_position=8192)
  assert launch.describe_model(big, 512).endswith("context 512 (the model's 8192)")
