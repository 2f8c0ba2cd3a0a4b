import jax
import pytest

from models import llama
from tests.serving.engine_testing import CFG


@pytest.fixture(scope="session")
def params():
  """The tiny random model at layer_scale 8, so that its next token depends
  on every cached row (``llama.init_params``)."""
  return llama.init_params(CFG, jax.random.PRNGKey(1), layer_scale=8)
