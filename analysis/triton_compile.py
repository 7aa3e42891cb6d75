"""Compile the fused LLoPS attention kernels for a CUDA target without a GPU (ahead of time).

Checks that the kernels of ``sketchlab.attention.triton`` compile to a cubin for the given target
(default sm_90, the H100/H200) at given shapes, and reports each compile's wall time and shared
memory (an H200 block may use at most 227 KiB; a config over it fails at launch and the
autotuner skips it). Needs only triton's bundled ptxas, not a GPU. Usage:

    TRITON_INTERPRET= PYTHONPATH=. python analysis/triton_compile.py --shapes 64,48,72 128,256,128 \
        --dtype bfloat16 --out analysis/results/triton_compile.md

Each shape is ``D,M,Dv``; every forward and backward config of ``_kernels.FWD_CONFIGS`` /
``BWD_CONFIGS`` (or only the fixed ones, ``--fixed``) is compiled, causal with ``normalize="sum"``
(``--state``: with a carried state), then the hybrid's fixed configs (``_hybrid.HYBRID_FWD_FIXED``,
``HYBRID_BWD_FIXED``; softmax local, or poly with ``--poly``; causal, or ``--non-causal``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret (before triton is imported)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sketchlab.attention.triton import _hybrid, _kernels  # noqa: E402
from sketchlab.io import atomic_write  # noqa: E402

TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def compile_kernel(kind: str, D: int, M: int, DV: int, block_t: int, block_dv: int | None, warps: int,
                   dtype: str, self_tensor: bool, arch: int, state: bool = False, softmax: bool = True,
                   causal: bool = True):
    """Compile one kernel specialisation (``kind``: fwd, bwd, hybrid-fwd, hybrid-bwd); return
    (seconds, shared bytes) or raise."""
    dt = TYPES[dtype]
    consts = dict(SELF=self_tensor, HAS_STATE=state, BLOCK_T=block_t, BLOCK_D=_block(D),
                  BLOCK_M=_block(M), BLOCK_F=_block(M) ** (2 if self_tensor else 1),
                  BLOCK_DV=block_dv or _block(DV), PREC="ieee" if dt == "fp32" else "tf32")
    states = dict.fromkeys("S0 Z0 DS0 DZ0".split(), "fp32")
    if kind.startswith("hybrid"):
        consts |= dict(SOFTMAX=softmax, HAS_MASK=state, CAUSAL=causal)  # --state also compiles the key-padding mask
    else:
        consts |= dict(CAUSAL=True, NORMALIZE=True)
    if kind == "fwd":
        fn = _kernels._llops_fwd_kernel
        ptrs = dict.fromkeys("Q K V TQ TK O".split(), dt) | {"DEN": "fp32"} | states
        floats = {"eps"}
    elif kind == "bwd":
        fn = _kernels._llops_bwd_kernel
        ptrs = dict.fromkeys("Q K V TQ TK DQ DK DVV".split(), dt) | dict.fromkeys("G C DTQ DTK".split(), "fp32") | states
        floats = set()
    elif kind == "hybrid-fwd":
        fn = _hybrid._hybrid_fwd_kernel
        ptrs = (dict.fromkeys("Q K V TQ TK O".split(), dt) | dict.fromkeys("GATE DEN CMAX".split(), "fp32")
                | {"ARG": "i32", "KVALID": "i8"} | states)
        floats = {"eps", "scale"}
    else:
        fn = _hybrid._hybrid_bwd_kernel
        ptrs = (dict.fromkeys("Q K V TQ TK DVV".split(), dt)
                | dict.fromkeys("GATE G C CMAX DQ DK DTQ DTK RHO ZETA".split(), "fp32") | {"KVALID": "i8"} | states)
        floats = {"scale"}
    signature = {n: "constexpr" if n in consts else "*" + ptrs[n] if n in ptrs else "fp32" if n in floats else "i32"
                 for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    start = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": 2})
    return time.perf_counter() - start, compiled.metadata.shared


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["64,48,72"], help="D,M,Dv triples")
    parser.add_argument("--dtype", default="bfloat16", choices=tuple(TYPES))
    parser.add_argument("--self-tensor", action="store_true", help="non_negative=True (φ⊗φ features)")
    parser.add_argument("--fixed", action="store_true", help="only the fixed configs (FWD_FIXED, BWD_FIXED)")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability ×10")
    parser.add_argument("--state", action="store_true", help="with a carried state (HAS_STATE; the hybrid also HAS_MASK)")
    parser.add_argument("--poly", action="store_true", help="the hybrid's local part polynomial, not softmax")
    parser.add_argument("--non-causal", action="store_true", help="the hybrid non-causal (|i−j| < w); no state")
    parser.add_argument("--out", default=None, help="markdown table (default: print only)")
    args = parser.parse_args(argv)
    fwd = [_kernels.FWD_FIXED] if args.fixed else _kernels.FWD_CONFIGS
    bwd = [_kernels.BWD_FIXED] if args.fixed else _kernels.BWD_CONFIGS
    rows = ["| kernel | D, M, Dv | BLOCK_T | BLOCK_DV | warps | compile s | shared KiB |", "|---|---|---|---|---|---|---|"]
    failed = 0
    for shape in args.shapes:
        D, M, DV = (int(x) for x in shape.split(","))
        jobs = [("fwd", t, dv, w) for t, dv, w in fwd] + [("bwd", t, None, w) for t, w in bwd]
        (t, dv, w), (tb, wb) = _hybrid.HYBRID_FWD_FIXED, _hybrid.HYBRID_BWD_FIXED
        jobs += [("hybrid-fwd", t, min(dv, _block(DV)), w), ("hybrid-bwd", tb, None, wb)]
        for kind, block_t, block_dv, warps in jobs:
            try:
                seconds, shared = compile_kernel(kind, D, M, DV, block_t, block_dv, warps, args.dtype,
                                                 args.self_tensor, args.arch, args.state, not args.poly,
                                                 not args.non_causal)
                cells = f"{seconds:.1f} | {shared / 1024:.0f}"
            except Exception as err:  # a compile error is the finding; report it and go on
                failed += 1
                cells = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''} | -"
            row = f"| {kind} | {D}, {M}, {DV} | {block_t} | {block_dv or _block(DV)} | {warps} | {cells} |"
            print(row, flush=True)
            rows.append(row)
    if args.out:
        header = (f"# Ahead-of-time compile of the LLoPS attention kernels (sm_{args.arch}, {args.dtype}"
                  f"{', self-tensor' if args.self_tensor else ''}{', state' if args.state else ''}"
                  f"{', poly local' if args.poly else ''}{', non-causal hybrid' if args.non_causal else ''})\n\n"
                  f"`python analysis/triton_compile.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
                  f"(triton {triton.__version__}; wall times on this machine, shared by other jobs)\n\n")
        with atomic_write(args.out) as tmp:
            Path(tmp).write_text(header + "\n".join(rows) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
