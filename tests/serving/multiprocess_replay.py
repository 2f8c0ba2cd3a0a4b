"""One small replay on the tiny model, in this process or as one of several
``jax.distributed`` processes (``python -m tests.serving.multiprocess_replay
COORDINATOR NUM_PROCESSES PROCESS_ID MESH``, with XLA_FLAGS giving each
process its fake CPU devices); prints ``{"tokens": {request_id: ids}}``."""

import dataclasses
import json
import sys

import jax

from models import llama, sharding
from models.config import get_config
from serving.harness import synthetic
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.harness.replay import replay
from serving.engine.sim_executor import VirtualClock

# The tiny model with an MLP width and vocabulary that 2, 3, 4 and 8 divide.
CFG = dataclasses.replace(get_config("tiny"), ffn_dim=192, vocab_size=768)


def replay_tokens(mesh: str) -> dict:
  """{request_id: output ids} of a 6-request synthetic replay (virtual clock,
  so every process admits and schedules alike)."""
  params = jax.device_get(llama.init_params(CFG, jax.random.PRNGKey(1), layer_scale=8))
  engine = Engine(CFG, params, EngineConfig.preset("tiny", mesh=mesh, min_bucket=16),
                  clock=VirtualClock())
  workload = synthetic.synthetic_azure_conv(6, rate_scale=1.0, seed=3, max_prompt_len=30,
                                            max_output_len=4, vocab_size=CFG.vocab_size)
  records, _ = replay(engine, workload)
  assert all(r.outcome == "completed" for r in records), [r.outcome for r in records]
  return {r.request_id: list(r.output_token_ids) for r in records}


if __name__ == "__main__":
  coordinator, num_processes, process_id, mesh = sys.argv[1:5]
  sharding.initialize_processes(coordinator, int(num_processes), int(process_id))
  tokens = replay_tokens(mesh)
  print(json.dumps(dict(process=jax.process_index(), devices=len(jax.devices()),
                        local_devices=len(jax.local_devices()), tokens=tokens)), flush=True)
