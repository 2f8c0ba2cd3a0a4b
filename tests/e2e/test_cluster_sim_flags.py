"""cluster_sim.py's P/D flags and pd_goodput.py's: a bad value is one line
naming the flag and its rule, exit status 2, before the trace or a model
config loads."""

import pytest

from tests.e2e import refusals


@pytest.fixture(scope="module", autouse=True)
def _stop_refusal_servers():
  yield
  refusals.stop_servers()


@pytest.mark.parametrize("args,line", [
    (["--prefill_replicas=1"],
     "error: --decode_replicas must be given with --prefill_replicas (both or neither)"),
    (["--decode_replicas=2"],
     "error: --prefill_replicas must be given with --decode_replicas (both or neither)"),
    (["--prefill_replicas=0", "--decode_replicas=1"],
     "error: --prefill_replicas must be >= 1, got 0"),
    (["--prefill_replicas=1", "--decode_replicas=0"],
     "error: --decode_replicas must be >= 1, got 0"),
    (["--prefill_replicas=1", "--decode_replicas=1", "--router=fastest"],
     "error: --router must be one of ['distserve', 'prefix_aware', 'round_robin'] for "
     "prefill/decode replicas, got 'fastest'"),
    (["--router=distserve"], "error: --router must be one of ['prefix_aware', 'round_robin'] "
                             "for mixed replicas, got 'distserve'"),
    (["--prefill_replicas=1", "--decode_replicas=1", "--replicas=2"],
     "error: --replicas: give either --replicas (mixed replicas) or "
     "--prefill_replicas/--decode_replicas, not both"),
    (["--link=inter"], "error: --link applies to --prefill_replicas/--decode_replicas only"),
])
def test_cluster_sim_refuses_a_bad_pd_flag_before_loading(args, line):
  assert refusals.refused("cluster_sim.py", *args) == (2, line)


@pytest.mark.parametrize("args,line", [
    (["--splits=1P0D"], "error: --splits entries must be N or PpDd with counts >= 1 (e.g. 2, "
                        "1P2D), got '1P0D'"),
    (["--slos=1000"], "error: --slos entries must be TTFT_MS:TPOT_MS, both > 0, got '1000'"),
    (["--rate_scales=0"], "error: --rate_scales must be numbers > 0, got ['0']"),
])
def test_pd_goodput_refuses_a_bad_flag_before_loading(args, line):
  assert refusals.refused("pd_goodput.py", *args) == (2, line)
