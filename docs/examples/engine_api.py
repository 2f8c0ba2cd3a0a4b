"""The engine from Python, without a launcher: load a model, build an
``Engine`` from an engine preset, add requests, step it until they end.

    .venv/bin/python docs/examples/engine_api.py                  # SmolLM2-135M, real weights
    .venv/bin/python docs/examples/engine_api.py --simulated      # same engine, a cost model

Each ``Engine.step()`` is one iteration (§0x03): the policy plans the
batch, the model (or the simulated executor's cost model) runs it, and
the step returns each request's new tokens and, at its end, its outcome
(completed, rejected, cancelled or failed). ``--model`` takes a model
name (``smollm2-135m``), a GGUF file or an HF checkpoint directory, as
replay.py's does, and with ``--simulated`` also a config preset without
weights (``tiny``: no tokenizer either, so the prompts' bytes stand in for
token ids); ``--engine`` a preset of ``configs/`` (``tiny`` is the tests'
small one), ``--max_model_len`` its context where the model's is shorter
(``tiny``'s 512). A bad argument ends with one ``error:`` line (exit 2):
every ValueError below names the field and the rule.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # run from anywhere

from models.loaders import load_model  # noqa: E402
from serving.cli.model_spec import check_model_spec, model_config  # noqa: E402
from serving.engine.config import EngineConfig, SamplingParams  # noqa: E402
from serving.engine.engine import Engine  # noqa: E402
from serving.engine.sim_executor import VirtualClock  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Continuous batching means"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="smollm2-135m")
  parser.add_argument("--engine", default="cpu_default")
  parser.add_argument("--policy", default="sarathi_serve", help="a registered policy")
  parser.add_argument("--max_model_len", type=int, default=None,
                      help="the context in tokens (default: the --engine preset's)")
  parser.add_argument("--max_tokens", type=int, default=16)
  parser.add_argument("--simulated", action="store_true",
                      help="the simulated executor: no weights, step times from a cost model "
                           "on a virtual clock (token ids are placeholders)")
  args = parser.parse_args()
  try:
    run(args)
  except ValueError as e:       # a bad preset, policy, model or sampling value
    parser.error(str(e))


def run(args) -> None:
  """Builds the engine of ``args``, runs the prompts, prints what ended."""
  # An engine preset is a JSON file of EngineConfig fields; any field can
  # be replaced (dataclasses.replace, or keyword overrides of preset(),
  # which keeps the preset's value where an override is None).
  config = EngineConfig.preset(args.engine, policy=args.policy,
                               max_model_len=args.max_model_len)
  # The launchers' check: a config preset (tiny) only with --simulated.
  check_model_spec("--model", args.model, simulated=args.simulated,
                   simulated_flag="--simulated")
  if args.simulated:
    config = dataclasses.replace(config, executor="simulated")
    model_cfg, tokenizer = model_config(args.model)        # no weights; a preset: no tokenizer
    engine = Engine(model_cfg, None, config, clock=VirtualClock())
  else:
    model_cfg, params, tokenizer = load_model(args.model)   # float32 on the CPU
    engine = Engine(model_cfg, params, config)               # wall clock

  sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)   # greedy
  for i, text in enumerate(PROMPTS):
    ids = (tokenizer.encode(text, add_special_tokens=True) if tokenizer is not None
           else list(text.encode()))        # placeholder ids: the simulated executor's
    engine.add_request(f"req-{i}", ids, sampling)

  tokens = {f"req-{i}": [] for i in range(len(PROMPTS))}
  iterations = 0
  while engine.has_unfinished():
    for out in engine.step():             # one iteration: plan, run, commit
      tokens[out.request_id] += out.new_token_ids
      if out.finished:
        print(f"{out.request_id}: {out.outcome} ({out.finish_reason}), "
              f"{len(tokens[out.request_id])} tokens")
    iterations += 1
  clock = "virtual" if args.simulated else "wall (compiling included)"
  print(f"{iterations} iterations, policy {engine.config.policy}, {clock} clock at "
        f"{engine.now_ms():.1f} ms")
  for i, text in enumerate(PROMPTS):
    rid = f"req-{i}"
    shown = repr(tokenizer.decode(tokens[rid])) if not args.simulated else tokens[rid][:8]
    print(f"{rid} {text!r} -> {shown}")


if __name__ == "__main__":
  main()
