#!/usr/bin/env bash
# GPU check of sketchlab's attention: the Triton kernel compiled (not interpreted) on CUDA, then the
# attention benchmark on the GPU. Run from anywhere on a machine with an NVIDIA GPU:
#
#     bash analysis/gpu_check.sh                   # installs what is missing from the package index
#     WHEELS=/path/to/wheels bash analysis/gpu_check.sh   # offline: pip installs only from that folder
#
# Steps (a few minutes on an H100/H200; each step has a time limit):
#   1. Python: the repo's .venv if its torch sees CUDA, else python3 (if that lacks a CUDA torch, a
#      venv at $GPU_VENV, default ~/.sketchlab-gpu-venv, built on the system site-packages), and
#      pip installs the modules below that do not import.
#   2. The attention tests on CUDA (TRITON_INTERPRET unset, so Triton compiles; fp32 and bf16
#      tolerances are in tests/test_attention_triton.py); log and summary in
#      analysis/results/attention_gpu_tests.{log,md}.
#   3. analysis/bench_attention.py --device cuda --dtype bfloat16 --budget-s 1 (SDPA, exact
#      polynomial, BASED, LLoPS torch and Triton; fla when importable), which writes
#      analysis/results/attention_gpu.md and .png; the Triton kernel runs one fixed config
#      (SKETCHLAB_TRITON_AUTOTUNE=1 to autotune). BENCH_ARGS are appended (last flag wins, e.g.
#      BENCH_ARGS="--dtype float32" or "--quick").
# Knobs (environment): WHEELS, GPU_VENV, TEST_TIMEOUT (s, default 300), BENCH_TIMEOUT (s, default
# 360), BENCH_ARGS (extra arguments for bench_attention.py), SKETCHLAB_TRITON_AUTOTUNE.
# Exit status: 0 when both steps pass, 1 when the tests or the benchmark fail, 2 when no CUDA device
# or the environment cannot be set up. Never part of CI.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
RESULTS=analysis/results
mkdir -p "$RESULTS"
unset TRITON_INTERPRET
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-360}
MODULES="torch triton numpy scipy tensorly safetensors tqdm pytest matplotlib"

has_cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }

# ---- 1. Python and packages ------------------------------------------------------------------
if [ -x .venv/bin/python ] && has_cuda_torch .venv/bin/python; then
    PY=.venv/bin/python
elif has_cuda_torch python3; then
    PY=python3
else
    GPU_VENV=${GPU_VENV:-$HOME/.sketchlab-gpu-venv}
    if [ ! -x "$GPU_VENV/bin/python" ]; then
        python3 -m venv --system-site-packages "$GPU_VENV" || { echo "gpu_check: cannot create a venv at $GPU_VENV" >&2; exit 2; }
    fi
    PY=$GPU_VENV/bin/python
fi
missing=""
for mod in $MODULES; do
    "$PY" -c "import $mod" >/dev/null 2>&1 || missing="$missing $mod"
done
if [ -n "$missing" ]; then
    echo "gpu_check: installing:$missing"
    if [ -n "${WHEELS:-}" ]; then
        "$PY" -m pip install --no-index --find-links "$WHEELS" $missing || { echo "gpu_check: pip install from $WHEELS failed" >&2; exit 2; }
    else
        "$PY" -m pip install $missing || { echo "gpu_check: pip install failed (offline? set WHEELS=dir)" >&2; exit 2; }
    fi
fi
if ! has_cuda_torch "$PY"; then
    echo "gpu_check: $PY has no CUDA device through torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1))" >&2
    exit 2
fi
"$PY" - <<'EOF'
import platform, torch, triton
print(f"gpu_check: python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}, "
      f"{torch.cuda.get_device_name(0)}")
EOF

# ---- 2. attention tests, compiled on CUDA ------------------------------------------------------
XDIST=""
"$PY" -c "import xdist" >/dev/null 2>&1 && XDIST="-n 12"  # kernel compiles (CPU-bound) dominate: spread them
LOG=$RESULTS/attention_gpu_tests.log
start=$(date +%s)
timeout "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider -rs $XDIST tests/test_attention_*.py >"$LOG.tmp" 2>&1
tests_rc=$?
mv "$LOG.tmp" "$LOG"
elapsed=$(( $(date +%s) - start ))
tail -n 15 "$LOG"
{
    echo "# Attention tests on CUDA (analysis/gpu_check.sh)"
    echo
    echo "- device: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"
    echo "- versions: $("$PY" -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")')"
    echo "- command: \`pytest -q -rs $XDIST tests/test_attention_*.py\` (TRITON_INTERPRET unset), ${elapsed} s, exit status $tests_rc"
    echo
    echo '```'
    tail -n 30 "$LOG"
    echo '```'
} >"$RESULTS/attention_gpu_tests.md.tmp" && mv "$RESULTS/attention_gpu_tests.md.tmp" "$RESULTS/attention_gpu_tests.md"

# ---- 3. benchmark -------------------------------------------------------------------------------
if [ ! -f analysis/bench_attention.py ]; then
    echo "gpu_check: analysis/bench_attention.py is missing" >&2
    bench_rc=1
else
    # One fixed kernel config unless SKETCHLAB_TRITON_AUTOTUNE=1: autotuning compiles every config
    # for each m (an sm_90 backward compile takes tens of seconds), which a short GPU loan cannot spare.
    SKETCHLAB_TRITON_AUTOTUNE=${SKETCHLAB_TRITON_AUTOTUNE:-0} \
        timeout "$BENCH_TIMEOUT" "$PY" analysis/bench_attention.py --device cuda --dtype bfloat16 --budget-s 1 \
        --out "$RESULTS/attention_gpu.md" ${BENCH_ARGS:-}
    bench_rc=$?
fi

echo "gpu_check: tests exit $tests_rc, benchmark exit $bench_rc; see $RESULTS/attention_gpu_tests.md and $RESULTS/attention_gpu.md"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
