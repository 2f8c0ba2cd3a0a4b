"""pd_goodput.py on a config preset (``--model=tiny``: a config without
weights or tokenizer): it runs only the simulated executor and tokenizes no
text, so it takes it, as replay.py does, and replays the synthetic workload
to the end on a P/D pair at each rate scale (cluster_sim.py's run on the
preset is tests/e2e/test_cluster_sim_flags.py's SLO test)."""

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


def test_pd_goodput_measures_a_config_preset_at_each_rate_scale(tmp_path):
  """A P/D pair on the synthetic workload (no --trace) at rate scales 1 and
  4: each run offers the 4 requests drawn at --rate_scale x r (their
  offered rate is the workload's own, drawn here independently), every
  request completes, each handed off once; the SLO attainment is the valid
  share. (Before, the synthetic workload ignored --rate_scales.)"""
  from serving.harness import synthetic
  out = tmp_path / "pd.json"
  status, stdout, stderr = refusals.run(
      "pd_goodput.py", *TINY, "--num_requests=4", "--rate_scale=0.1", "--splits=1P1D",
      "--rate_scales=1,4", "--slos=1000:100", "--cost_model=profile:h100", f"--out={out}")
  assert status == 0, stderr[-3000:]
  assert PRESET_LINE in stdout
  result = json.loads(out.read_text())
  assert result["config"]["model"] == "tiny"
  runs = result["runs"]["1P1D"]
  assert [run["rate_scale"] for run in runs] == [1.0, 4.0]
  for run, rate in zip(runs, (0.1, 0.4)):
    drawn = synthetic.synthetic_azure_conv(4, rate, 0, max_prompt_len=1, max_output_len=1)
    assert run["offered_rate"] == pytest.approx(4 / drawn.duration_s, rel=1e-12)
    assert (run["offered"], run["completed"], run["transfers"]["count"]) == (4, 4, 4)
    slo = run["slos"]["1000:100"]
    assert 0 <= slo["valid"] <= 4 and slo["attainment"] == slo["valid"] / 4, slo
  assert runs[1]["offered_rate"] > 3.9 * runs[0]["offered_rate"]
