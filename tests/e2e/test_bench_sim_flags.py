"""bench_sim.py's flags: a bad value is one line naming the flag and its
rule, exit status 2, before the trace or a model config loads."""

from pathlib import Path

import pytest

from tests.e2e import refusals

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _stop_refusal_servers():
  yield
  refusals.stop_servers()


@pytest.mark.parametrize("args,line", [
    (["--log_every=0"], "error: --log_every must be >= 1, got 0"),
    (["--max_wall_s=-1"], "error: --max_wall_s must be finite and > 0 (unset: no limit), "
                          "got -1.0"),
    (["--max_wall_s=0"], "error: --max_wall_s must be finite and > 0 (unset: no limit), "
                         "got 0.0"),
    (["--max_wall_s=nan"], "error: --max_wall_s must be finite and > 0 (unset: no limit), "
                           "got nan"),
    (["--window_s=5,2"], "error: --window_s must be N > 0 (the trace's first N seconds of "
                         "arrivals) or A,B with 0 <= A < B (its arrivals in [A, B) seconds "
                         "after the first), finite, got '5,2'"),
    (["--window_s=-60"], "error: --window_s must be N > 0 (the trace's first N seconds of "
                         "arrivals) or A,B with 0 <= A < B (its arrivals in [A, B) seconds "
                         "after the first), finite, got '-60'"),
    (["--out="], "error: --out must be a file path for the report JSON, got ''"),
    (["--out=scripts"], "error: --out must be a file path for the report JSON, got 'scripts'"),
    (["--out=README.md/x.json"], "error: --out 'README.md/x.json' cannot be created: "
                                 f"'{ROOT}/README.md' is a file, not a directory"),
])
def test_bench_sim_refuses_a_bad_flag_before_loading(args, line):
  assert refusals.refused("bench_sim.py", *args) == (2, line)


def test_bench_sim_makes_the_out_folder_before_it_runs(tmp_path):
  """--out's missing parent folders are made at the start (the help says
  so): a bad flag after it still refuses, and the folder is there."""
  out = tmp_path / "new" / "deeper" / "r.json"
  status, last = refusals.refused("bench_sim.py", f"--out={out}", "--trace=nosuch:x")
  assert (status, last) == (2, "error: --trace must be KIND:PATH with KIND in ['azure', "
                                "'mooncake', 'vtc'], got 'nosuch:x'")
  assert out.parent.is_dir() and not out.exists()
  status, last = refusals.refused("bench_sim.py", f"--out={out}", "--trace=azure:/nonexist.csv")
  assert (status, last) == (2, "error: --trace: '/nonexist.csv' (of 'azure:/nonexist.csv') "
                                "is not a file")
