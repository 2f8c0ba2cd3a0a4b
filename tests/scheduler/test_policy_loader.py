"""``--policy=module:Class`` / ``path/to/file.py:Class`` (``scheduler.policy_loader``).

A user's policy is loaded from their own module or file, checked by the
conformance kit's fast profile when the engine builds it, and refused with
the broken rule named; bad specs are refused by ``EngineConfig`` naming the
field.
"""

import textwrap

import jax
import pytest

from models import llama
from models.config import get_config
from scheduler.policies import Budgets, make_policy
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine

BUDGETS = Budgets(token_budget=8, seq_budget=3, chunk_cap=4)

FIFO = '''
import dataclasses

from scheduler import ledger as base


class NotPolicy:
  pass


@dataclasses.dataclass(frozen=True)
class Fifo(base.PolicyBase):
  budgets: base.Budgets
  policy_id: str = "fifo"
  version: str = "1"
  tie_break: tuple = ("work_rank", "arrival_seq", "request_id", "generation")

  def sort_keys(self, manifest, state, view=None):
    return base.identity_keys(manifest, state, base.work_rank(manifest, state))

  def plan(self, manifest, state, alloc):
    keys = self.sort_keys(manifest, state)
    order = base.key_order(keys)
    x, c = base.ledger(manifest, state, alloc, self.budgets, order)
    c = base.greedy_scan(x, c, order, fcfs_break=True)
    return base.finish_plan(manifest, state, x, c, keys, order, self)
'''

# Fifo, but it skips the refusal and sorts by the hidden realized length
# whenever the manifest carries it.
PEEKS = FIFO.replace('policy_id: str = "fifo"', 'policy_id: str = "peeks"').replace(
    '("work_rank", "arrival_seq"', '("work_rank", "length", "arrival_seq"').replace(
    "  def sort_keys(self, manifest, state, view=None):\n"
    "    return base.identity_keys(manifest, state, base.work_rank(manifest, state))",
    "  def __call__(self, manifest, state, alloc):\n"
    "    return self.plan(manifest, state, alloc)\n\n"
    "  def sort_keys(self, manifest, state, view=None):\n"
    "    g = manifest.hidden_realized_output_tokens\n"
    "    g = manifest.max_tokens if g is None else g\n"
    "    return base.identity_keys(manifest, state, base.work_rank(manifest, state), g)")


@pytest.fixture
def user_file(tmp_path):
  def write(name, text):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return path
  return write


def test_a_policy_from_a_file_is_checked_and_built(user_file):
  spec = f"{user_file('mine', FIFO)}:Fifo"
  assert EngineConfig.preset("tiny", policy=spec).policy == spec
  policy = make_policy(spec, BUDGETS)
  assert (policy.policy_id, policy.budgets) == ("fifo", BUDGETS)


def test_a_policy_from_a_module_is_checked_and_built():
  policy = make_policy("scheduler.policy_length:ShortestPrefillFirst", BUDGETS)
  assert policy.policy_id == "spf" and policy == make_policy("spf", BUDGETS)


def test_a_policy_that_breaks_a_rule_is_refused_naming_it(user_file):
  """The kit refuses it when the engine builds its programs, before any
  request runs: the message names the rule and the shrunk example."""
  spec = f"{user_file('peeks', PEEKS)}:Fifo"
  config = EngineConfig.preset("tiny", policy=spec, executor="simulated")
  cfg = get_config("tiny")
  with pytest.raises(ValueError, match=r"(?s)refused by the conformance kit.*breaks rule "
                                       r"'hidden_truth'.*minimal example: Workload\("):
    Engine(cfg, llama.init_params(cfg, jax.random.PRNGKey(0)), config)
  with pytest.raises(ValueError, match="breaks rule 'hidden_truth'"):
    make_policy(spec, BUDGETS)                # the verdict is kept per process


@pytest.mark.parametrize("spec, message", [
    ("sjf_fast", r"EngineConfig.policy must be one of \[.*'sjf'.*\] or 'module:Class'"),
    ("no_such_module:Fifo", "policy must name an importable module: cannot import module "
                            "'no_such_module'"),
    ("{dir}/none.py:Fifo", "policy must name an existing file: no such file"),
    ("{file}:Lifo", "has no attribute 'Lifo'"),
    ("{file}:", "must be a registered name or 'module:Class'"),
    ("{file}", r"\('.*mine.py' names a file but not the class in it: "
               r"write '.*mine.py:Class'\), got '.*mine.py'"),
    ("{dir}/none.py", r"\(no such file '.*none.py', and no class named\), got '.*none.py'"),
    ("{broken}:Fifo", r"failed to load \(SyntaxError"),
    ("{file}:NotPolicy", r"EngineConfig.policy 'NotPolicy' must be a scheduling policy "
                         r"class \(a subclass of PolicyBase, or one whose instances are "
                         r"callable as policy\(manifest, state, alloc\)\)"),
])
def test_bad_specs_are_refused_naming_the_field(user_file, tmp_path, spec, message):
  spec = spec.format(dir=tmp_path, file=user_file("mine", FIFO),
                     broken=user_file("broken", "def f(:\n"))
  with pytest.raises(ValueError, match=message):
    EngineConfig.preset("tiny", policy=spec)


def test_a_class_that_is_no_policy_is_refused_in_one_error_line(user_file):
  """The launcher's refusal path: one ``error:`` line naming the flag, the
  spec and the rule, no traceback."""
  from tests.e2e import refusals
  spec = f"{user_file('mine', FIFO)}:NotPolicy"
  try:
    status, last = refusals.refused("replay.py", "--engine=cpu_small", f"--policy={spec}")
  finally:
    refusals.stop_servers()
  assert status == 2
  assert last == (f"error: --policy 'NotPolicy' must be a scheduling policy class (a "
                  f"subclass of PolicyBase, or one whose instances are callable as "
                  f"policy(manifest, state, alloc)) constructible from Budgets, or a "
                  f"Budgets -> policy factory, got '{spec}'")
