#!/usr/bin/env bash
# GPU check of the attention kernel and the engine; every step writes JSON
# into one folder, the whole run bounded by 8 minutes.
#
#   bash scripts/device_check.sh                      # on a GPU machine
#   bash scripts/device_check.sh --dry_run            # every CPU-able step
#
# Steps (each under `timeout`, results in $OUT/*.json, summary.json last):
#   install   pip install "jax[cuda12]==<installed jax version>" into
#             $PYTHON's environment (--wheelhouse=DIR installs offline from
#             DIR; --cuda=13 for CUDA 13; skipped by --dry_run).
#   sweep     the Triton kernel's correctness tests against the numpy
#             reference (tests/attention/test_ragged.py, "pallas" cases),
#             compiled for the GPU (dry run: the same cases in interpret
#             mode on the CPU, a short selection).
#   bench     scripts/bench_attention.py --backend=gpu: ms per call and the
#             achieved K/V bandwidth as a fraction of the device's peak
#             (--peak_hbm_gbps, default from the device name; dry run: one
#             mix on the CPU).
#   tokens    SmolLM2-135M, 3 short prompts, 8 greedy tokens each: the CPU
#             run's tokens (default path), then the GPU run's (the Triton
#             kernel and "gather"), compared (dry run: the CPU run only).
#
# Options: --out=DIR (default runs/device_check), --python=PATH (default
# .venv/bin/python, else python3), --wheelhouse=DIR, --cuda=12|13,
# --peak_hbm_gbps=N, --dry_run.
# Exit status: 0 when every step that ran passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=runs/device_check
PY=""
WHEELHOUSE=""
CUDA=12
PEAK=""
DRY=0
for arg in "$@"; do
  case "$arg" in
    --out=*) OUT="${arg#*=}" ;;
    --python=*) PY="${arg#*=}" ;;
    --wheelhouse=*) WHEELHOUSE="${arg#*=}" ;;
    --cuda=*) CUDA="${arg#*=}" ;;
    --peak_hbm_gbps=*) PEAK="${arg#*=}" ;;
    --dry_run) DRY=1 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "device_check.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ "$CUDA" != 12 && "$CUDA" != 13 ]]; then
  echo "device_check.sh: --cuda must be 12 or 13, got '$CUDA'" >&2; exit 2
fi
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
BUDGET_S=480
declare -A RC SECS

# run_step NAME LIMIT_S CMD...: runs CMD under `timeout`, never past the
# 8-minute budget; its output goes to $OUT/NAME.log.
run_step() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  (( limit > left )) && limit=$left
  if (( limit < 10 )); then
    echo "== $name: skipped, the 8-minute budget is spent"; RC[$name]=124; SECS[$name]=0; return
  fi
  echo "== $name (at most ${limit} s)"
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  RC[$name]=$?
  SECS[$name]=$(( $(date +%s) - t0 ))
  tail -n 4 "$OUT/$name.log"
  echo "== $name: rc=${RC[$name]} in ${SECS[$name]} s"
}

JAX_VERSION=$("$PY" -c 'import jax; print(jax.__version__)')
if (( DRY )); then
  PLATFORM=cpu
  SWEEP_K="pallas and (decode16 or small_blocks or no_live)"
  BENCH=(--backend=cpu --impls=blocked_dot --mixes=decode32 --iters=1 --noreference)
else
  PLATFORM=cuda
  SWEEP_K="pallas"
  BENCH=(--backend=gpu --impls=pallas,gather,dense --iters=10 --noreference)
  PIP=("$PY" -m pip install -q "jax[cuda${CUDA}]==${JAX_VERSION}")
  [[ -n "$WHEELHOUSE" ]] && PIP+=(--no-index --find-links "$WHEELHOUSE")
  run_step install 240 "${PIP[@]}"
fi

# The sweep: pytest's JUnit XML, summarised as JSON.
run_step sweep 150 env JAX_PLATFORMS=$PLATFORM "$PY" -m pytest -q -p no:cacheprovider \
  tests/attention/test_ragged.py -k "$SWEEP_K" --junitxml="$OUT/sweep.xml"
"$PY" - "$OUT" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
try:
  root = ET.parse(f"{out}/sweep.xml").getroot()
  cases = [{"test": c.get("name"), "seconds": float(c.get("time", 0)),
            "passed": all(c.find(t) is None for t in ("failure", "error", "skipped"))}
           for c in root.iter("testcase")]
except (OSError, ET.ParseError) as e:
  cases = [{"test": "sweep", "passed": False, "error": str(e)}]
if not cases:
  cases = [{"test": "sweep", "passed": False, "error": "no test ran"}]
json.dump({"cases": cases, "passed": sum(c["passed"] for c in cases),
           "failed": sum(not c["passed"] for c in cases)},
          open(f"{out}/sweep.json", "w"), indent=1)
EOF

# The bandwidth bench: peak HBM from the device name unless given.
if [[ -z "$PEAK" && $DRY == 0 ]]; then
  PEAK=$(JAX_PLATFORMS=cuda "$PY" - <<'EOF'
import jax
kind = jax.devices()[0].device_kind
peaks = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "L4": 300,
         "A10G": 600, "B200": 8000}
print(next((v for k, v in peaks.items() if k in kind), 0))
EOF
)
fi
[[ -n "$PEAK" && "$PEAK" != 0 ]] && BENCH+=(--peak_hbm_gbps="$PEAK")
run_step bench 120 "$PY" scripts/bench_attention.py "${BENCH[@]}" --out="$OUT/bench_attention.json"

# Greedy tokens: the CPU run, then (full form) the GPU run compared with it.
TOKENS=(--model=smollm2-135m --engine=cpu_small --max_tokens=8)
run_step tokens_cpu 150 env JAX_PLATFORMS=cpu "$PY" scripts/greedy_tokens.py \
  "${TOKENS[@]}" --impls=auto --out="$OUT/tokens_cpu.json"
if (( ! DRY )); then
  run_step tokens_gpu 120 env JAX_PLATFORMS=cuda "$PY" scripts/greedy_tokens.py \
    "${TOKENS[@]}" --impls=pallas,gather --compare="$OUT/tokens_cpu.json" \
    --out="$OUT/tokens_gpu.json"
fi

STATUS=0
SUMMARY="{\"dry_run\": $DRY, \"jax\": \"$JAX_VERSION\", \"seconds\": $(( $(date +%s) - START )), \"steps\": {"
SEP=""
for name in install sweep bench tokens_cpu tokens_gpu; do
  [[ -z "${RC[$name]+x}" ]] && continue
  (( RC[$name] != 0 )) && STATUS=1
  SUMMARY+="$SEP\"$name\": {\"rc\": ${RC[$name]}, \"seconds\": ${SECS[$name]}}"
  SEP=", "
done
echo "$SUMMARY}}" > "$OUT/summary.json"
cat "$OUT/summary.json"
exit $STATUS
