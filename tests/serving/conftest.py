import jax
import pytest

from models import llama
from tests.serving.engine_testing import CFG


@pytest.fixture(scope="session")
def params():
  """The tiny random model at layer_scale 8, so that its next token depends
  on every cached row (``llama.init_params``)."""
  return llama.init_params(CFG, jax.random.PRNGKey(1), layer_scale=8)


@pytest.fixture(scope="module")
def served(params):
  """The server on the tiny model over real HTTP, one per test module
  (``tests.serving.test_server._Served``, 64 waiting requests)."""
  from tests.serving.test_server import _Served
  s = _Served(params, max_waiting=64)
  yield s
  s.close()
