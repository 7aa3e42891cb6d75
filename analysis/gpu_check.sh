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
#      tolerances are in tests/test_attention_triton.py; the hybrid and the carried state in
#      tests/test_attention_triton_hybrid.py); log and summary in
#      analysis/results/attention_gpu_tests.{log,md}.
#   2b. The hybrid and the state, compiled (inline script below): each kind first checked, bf16,
#      against a split of the same sequence with the carried state (T = 1000 cut at 1, 500, 501),
#      then timed side by side: pure LLoPS, hybrid softmax (w = 64, 4 sinks) and hybrid poly
#      (w = 64) against SDPA, forward and forward+backward at T = 1k/4k/16k, D = 128, M = 64; and
#      one-token decode with the carried state against SDPA over a KV cache at context 1k-16k.
#      Results in analysis/results/attention_gpu_hybrid.md.
#   3. analysis/bench_attention.py --device cuda --dtype bfloat16 --budget-s 1 (SDPA, exact
#      polynomial, BASED, LLoPS torch and Triton; fla when importable), which writes
#      analysis/results/attention_gpu.md and .png; the Triton kernel runs one fixed config
#      (SKETCHLAB_TRITON_AUTOTUNE=1 to autotune). BENCH_ARGS are appended (last flag wins, e.g.
#      BENCH_ARGS="--dtype float32" or "--quick").
# Knobs (environment): WHEELS, GPU_VENV, TEST_TIMEOUT (s, default 300), HYBRID_TIMEOUT (s, default
# 240), BENCH_TIMEOUT (s, default 360), BENCH_ARGS (extra arguments for bench_attention.py),
# SKETCHLAB_TRITON_AUTOTUNE.
# Exit status: 0 when every step passes, 1 when the tests, the hybrid step or the benchmark fail, 2 when no CUDA device
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
HYBRID_TIMEOUT=${HYBRID_TIMEOUT:-240}
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

# ---- 2b. hybrid and state: checked against a split, then timed ---------------------------------
timeout "$HYBRID_TIMEOUT" "$PY" - "$RESULTS/attention_gpu_hybrid.md" <<'PY_HYBRID'
import sys

import torch
import triton
from triton.testing import do_bench

from sketchlab.attention.triton import llops_attention_triton
from sketchlab.io import atomic_write

out_path = sys.argv[1]
dev, dt = "cuda", torch.bfloat16
B, H, D, M, P = 1, 4, 128, 64, 2
KINDS = {"pure": dict(), "hybrid softmax w64+4": dict(window=64, sinks=4, local="softmax"),
         "hybrid poly w64": dict(window=64, local="poly")}
torch.manual_seed(0)


def problem(T):
    """Non-negative q, k, Θ (the regime of normalize="sum"), bf16, [B, T, H, D] and [H, 1, P, D, M]."""
    q, k, v = (torch.randn(B, T, H, D, device=dev).abs().to(dt) for _ in range(3))
    tq, tk = (torch.randn(H, 1, P, D, M, device=dev).abs().div(D ** 0.5).to(dt) for _ in range(2))
    return q, k, v, tq, tk


def call(q, k, v, tq, tk, **kw):
    return llops_attention_triton(q, k, v, tq, tk, causal=True, normalize="sum", non_negative=False, eps=1e-6, **kw)


def sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            is_causal=q.shape[1] == k.shape[1])


lines = [f"# Hybrid and state on {torch.cuda.get_device_name(0)} (analysis/gpu_check.sh step 2b)", "",
         f"torch {torch.__version__}, triton {triton.__version__}; B={B}, H={H}, D=Dv={D}, M={M}, p={P}, bf16; "
         "times in ms (triton.testing.do_bench).", "",
         "## Split = whole (T = 1000 cut at 1, 500, 501; relative max error of the bf16 output)", ""]
ok = True
for name, kw in KINDS.items():
    q, k, v, tq, tk = problem(1000)
    whole = call(q, k, v, tq, tk, **kw).float()
    outs, state = [], None
    for a, b in ((0, 1), (1, 500), (500, 501), (501, 1000)):
        o, state = call(q[:, a:b], k[:, a:b], v[:, a:b], tq, tk, initial_state=state, output_final_state=True, **kw)
        outs.append(o.float())
    err = ((torch.cat(outs, 1) - whole).abs().max() / whole.abs().max()).item()
    ok = ok and err <= 2e-2
    lines.append(f"- {name}: {err:.1e} ({'ok' if err <= 2e-2 else 'FAILED: over 2e-2'})")
    print(lines[-1], flush=True)
lines += ["", "## Forward and forward+backward", "",
          "| T | kind | fwd ms | fwd+bwd ms | fwd / SDPA | fwd+bwd / SDPA | fwd+bwd / pure |",
          "|---|---|---|---|---|---|---|"]
for T in (1024, 4096, 16384):
    q, k, v, tq, tk = problem(T)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, tq, tk)]

    def fwd_bwd(fn):
        def run():
            o = fn(*leaves)
            o.backward(torch.ones_like(o))
        return run

    ref_f = do_bench(lambda: sdpa(q, k, v))
    ref_fb = do_bench(fwd_bwd(lambda q, k, v, tq, tk: sdpa(q, k, v)))
    lines.append(f"| {T} | SDPA | {ref_f:.3f} | {ref_fb:.3f} | 1 | 1 | |")
    pure_fb = None
    for name, kw in KINDS.items():
        f = do_bench(lambda: call(q, k, v, tq, tk, **kw))
        fb = do_bench(fwd_bwd(lambda *x: call(*x, **kw)))
        pure_fb = fb if pure_fb is None else pure_fb
        lines.append(f"| {T} | {name} | {f:.3f} | {fb:.3f} | {f / ref_f:.3f} | {fb / ref_fb:.3f} | {fb / pure_fb:.2f} |")
        print(lines[-1], flush=True)
lines += ["", "## One-token decode: carried state vs SDPA over a KV cache", "",
          "| context | kind | ms / token | SDPA+KV ms / token | speed-up |", "|---|---|---|---|---|"]
for T in (1024, 4096, 16384):
    q, k, v, tq, tk = problem(T + 1)
    ref = do_bench(lambda: sdpa(q[:, T:], k, v))  # the new query over T + 1 cached keys
    for name, kw in KINDS.items():
        _, state = call(q[:, :T], k[:, :T], v[:, :T], tq, tk, output_final_state=True, **kw)
        ms = do_bench(lambda: call(q[:, T:], k[:, T:], v[:, T:], tq, tk, initial_state=state,
                                   output_final_state=True, **kw))
        lines.append(f"| {T} | {name} | {ms:.3f} | {ref:.3f} | {ref / ms:.2f} |")
        print(lines[-1], flush=True)
with atomic_write(out_path) as tmp:
    with open(tmp, "w") as fh:
        fh.write("\n".join(lines) + "\n")
sys.exit(0 if ok else 1)
PY_HYBRID
hybrid_rc=$?

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

echo "gpu_check: tests exit $tests_rc, hybrid exit $hybrid_rc, benchmark exit $bench_rc; see" \
     "$RESULTS/attention_gpu_tests.md, $RESULTS/attention_gpu_hybrid.md and $RESULTS/attention_gpu.md"
[ "$tests_rc" -eq 0 ] && [ "$hybrid_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
