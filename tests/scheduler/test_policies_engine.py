"""Every registered policy runs the tiny-model engine to completion.

One engine per policy (its plan and publish programs are policy-specific);
the model executor compiles once and is reused through a module-scoped
persistent compilation cache, which keeps this test cheap.
"""

import jax
import pytest

from models import llama
from models.config import get_config
from scheduler.policies import POLICIES
from serving.config import EngineConfig, SamplingParams
from serving.engine import Engine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
          "jax_persistent_cache_min_entry_size_bytes")
  saved = {k: getattr(jax.config, k) for k in keys}
  jax.config.update(keys[0], str(tmp_path_factory.mktemp("xla_cache")))
  jax.config.update(keys[1], 0)
  jax.config.update(keys[2], 0)
  cfg = get_config("tiny")
  yield cfg, llama.init_params(cfg, jax.random.PRNGKey(0), layer_scale=8)
  for k, value in saved.items():
    jax.config.update(k, value)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_runs_engine_to_completion(model, name):
  cfg, params = model
  config = EngineConfig.preset("tiny", policy=name, max_num_batched_tokens=8,
                               min_bucket=8, long_prefill_token_threshold=4)
  engine = Engine(cfg, params, config)
  assert engine.policy.policy_id == name
  reqs = engine.generate([[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]],
                         SamplingParams(max_tokens=3, ignore_eos=True))
  assert [r.outcome for r in reqs] == ["completed"] * 3
  assert [len(r.output_token_ids) for r in reqs] == [3, 3, 3]
