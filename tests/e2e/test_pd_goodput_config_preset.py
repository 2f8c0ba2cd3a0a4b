"""pd_goodput.py on a config preset (``--model=tiny``: a config without
weights or tokenizer): it runs only the simulated executor and tokenizes no
text, so it takes it, as replay.py does, and replays a trace to the end on
a P/D pair (cluster_sim.py's run on the preset is
tests/e2e/test_cluster_sim_flags.py's SLO test)."""

import json

import pytest

from serving.engine.config import OUTCOMES
from tests.e2e import refusals

PRESET_LINE = ("model: tiny (llama, 2 layers, d_model 64, context 64 (the model's 512)) config "
               "preset (simulated executor: no weights)")
TINY = ["--model=tiny", "--engine=tiny", "--cache_dir="]


@pytest.fixture(scope="module", autouse=True)
def _stop_refusal_servers():
  yield
  refusals.stop_servers()


def _ended(report: dict) -> list:
  """The outcome of each request of a run's report, every one checked to be one."""
  outcomes = [r["outcome"] for r in report["requests"]]
  assert all(o in OUTCOMES for o in outcomes), outcomes
  return outcomes


def test_pd_goodput_measures_a_config_preset(tmp_path, short_trace):
  """A P/D pair at one rate: both requests of the trace are offered and
  complete, each handed off once; the SLO attainment is the valid share."""
  out = tmp_path / "pd.json"
  status, stdout, stderr = refusals.run(
      "pd_goodput.py", *TINY, f"--trace=azure:{short_trace}", "--splits=1P1D",
      "--rate_scales=1", "--slos=1000:100", "--cost_model=profile:h100", f"--out={out}")
  assert status == 0, stderr[-3000:]
  assert PRESET_LINE in stdout
  result = json.loads(out.read_text())
  assert result["config"]["model"] == "tiny"
  (run,) = result["runs"]["1P1D"]
  assert (run["offered"], run["completed"], run["transfers"]["count"]) == (2, 2, 2)
  slo = run["slos"]["1000:100"]
  assert 0 <= slo["valid"] <= 2 and slo["attainment"] == slo["valid"] / 2, slo
