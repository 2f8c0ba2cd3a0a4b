"""Every registered policy runs the tiny-model engine to completion.

One engine per policy, on the simulated executor (``serving.engine.sim_executor``:
the engine's own plan and step programs with only the model call replaced, so the
policy, validation and publication programs are the ones the model path
runs): which tokens a policy's plans produce is the model's business and is
checked elsewhere; what this checks is that every policy's decisions carry
every request to its end through the engine. The compiled step holds the
policy, so each case compiles its own; without the model it compiles in
about half the time.
"""

import jax
import pytest

from models import llama
from models.config import get_config
from scheduler.registry import POLICIES
from serving.engine.config import EngineConfig, SamplingParams
from serving.engine.engine import Engine


@pytest.fixture(scope="module")
def model():
  cfg = get_config("tiny")
  return cfg, llama.init_params(cfg, jax.random.PRNGKey(0), layer_scale=8)


# One policy of each family runs by default; the conformance kit drives
# every registered policy through the engine in the extended profile too.
DEFAULT_POLICIES = ("orca", "sarathi_serve", "srpt", "vllm_v1", "vtc")


@pytest.mark.parametrize("name", [
    n if n in DEFAULT_POLICIES else pytest.param(n, marks=pytest.mark.extended)
    for n in sorted(POLICIES)])
def test_policy_runs_engine_to_completion(model, name):
  cfg, params = model
  config = EngineConfig.preset("tiny", policy=name, max_num_batched_tokens=8,
                               min_bucket=8, long_prefill_token_threshold=4,
                               executor="simulated")
  engine = Engine(cfg, params, config)
  assert engine.policy.policy_id == name
  reqs = engine.generate([[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]],
                         SamplingParams(max_tokens=3, ignore_eos=True))
  assert [r.outcome for r in reqs] == ["completed"] * 3
  assert [len(r.output_token_ids) for r in reqs] == [3, 3, 3]
