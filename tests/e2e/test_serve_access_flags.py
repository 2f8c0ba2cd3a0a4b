"""serve.py's access and limit flags refused by name, one line and exit
status 2, before any model loads."""

import os

import pytest

from tests.e2e import refusals


@pytest.fixture(scope="module", autouse=True)
def _stop_refusal_servers():
  yield
  refusals.stop_servers()


@pytest.mark.parametrize("args, env, line", [
    (["--api_key=a:"], None, "error: --api_key: entry 1 must be KEY or KEY:TENANT"),
    (["--api_key=k1,k1:t"], None, "error: --api_key: entry 2 repeats a key"),
    (["--api_key=k", "--api_key_file=keys.txt"], None,
     "error: --api_key and --api_key_file exclude each other"),
    (["--api_key_file=no/such/keys.txt"], None,
     "error: --api_key_file=no/such/keys.txt: No such file or directory"),
    ([], {"ITERSERVE_API_KEY": " , "}, "error: ITERSERVE_API_KEY must hold at least one"),
    (["--max_body_bytes=0"], None, "error: --max_body_bytes must be >= 1, got 0"),
    (["--max_prompt_chars=0"], None, "error: --max_prompt_chars must be >= 1, got 0"),
])
def test_bad_access_flags_are_one_line_and_exit_2(args, env, line):
  status, last = refusals.refused("serve.py", *args,
                                  env=None if env is None else {**os.environ, **env})
  assert status == 2 and last.startswith(line), last
