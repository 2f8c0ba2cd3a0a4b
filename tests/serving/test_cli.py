"""The launchers' shared refusals (``serving.cli``)."""

import jax
import pytest

from serving import cli


def test_x64_is_refused_for_a_reason_true_of_every_launcher():
  """The refusal names iterserve's rule and the launcher, not the
  scheduler's tables: bench_attention.py, fit_profiles.py and
  slice_mooncake.py build no scheduler program."""
  cli.refuse_x64("slice_mooncake.py")                # off: nothing to refuse
  jax.config.update("jax_enable_x64", True)
  try:
    with pytest.raises(ValueError) as refused:
      cli.refuse_x64("slice_mooncake.py")
  finally:
    jax.config.update("jax_enable_x64", False)
  assert str(refused.value) == (
      "jax_enable_x64 must be off in every iterserve launcher, slice_mooncake.py included "
      "(iterserve's JAX programs are written for int32 and float32, and the flag makes jnp's "
      "Python numbers and aranges 64-bit), got on: unset JAX_ENABLE_X64")
