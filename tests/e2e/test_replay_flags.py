"""replay.py's model and workload flags: a model flag's refusal naming its
value once."""

import pytest

from serving.cli import launch


def test_a_model_that_cannot_be_found_is_named_once(tmp_path):
  """``check_model_spec`` names the flag and its value, and the loader's
  reason without the value again."""
  missing, bare = tmp_path / "nope.gguf", tmp_path / "bare"
  bare.mkdir()
  for spec, why in ((missing, "unknown model: not a preset (['smollm2-135m']) and no such path"),
                    (bare, "expected a *.gguf file or a directory containing config.json")):
    with pytest.raises(ValueError) as e:
      launch.check_model_spec("--model", str(spec))
    assert str(e.value) == f"--model={spec}: {why}"
