"""``sketchlab verify``: every theorem check of the notebooks, on your own dump (PASS/FAIL with numbers)."""

from __future__ import annotations

import sys

from ._common import int_list, scale_arg, write_text_atomic
from ._outputs import output_dir_exists

HELP = ("run every theorem check of the notebooks on a Q/K dump: exact features, Theorem 3.1 equality and its two "
        "routes, Theorem 3.4 identity and per-feature bound, special cases as LLoPS Θ; PASS/FAIL with numbers and "
        "tolerances (exit 1 if any check fails or cannot be made)")


def add_arguments(sub) -> None:
    cmd = sub.add_parser("verify", help=HELP, description=HELP + ". Tolerances are explained in sketchlab.verify.")
    cmd.add_argument("dump", help="Q/K dump (.safetensors, .pt, .npy/.npz) with q, k of shape [L, H, n, d]")
    cmd.add_argument("--p", type=int, default=2, help="polynomial degree (default 2)")
    cmd.add_argument("--m", type=int, default=64, help="sketch size of the Theorem 3.1/3.4 checks (default 64)")
    cmd.add_argument("--layers", type=int_list, default=None, help="comma-separated layer positions (default: all)")
    cmd.add_argument("--heads", type=int_list, default=None, help="comma-separated head positions (default: all)")
    cmd.add_argument("--scale", type=scale_arg, default="sqrt-d",
                     help="'sqrt-d' (q, k × d^-1/4 so qᵀk → qᵀk/√d; default), 'none', or a number multiplying q and k")
    cmd.add_argument("--columns", type=int, default=4, help="columns of W*_Q checked for Theorem 3.4 (default 4)")
    cmd.add_argument("--restarts", type=int, default=4, help="HOPM starts per spectral norm (default 4)")
    cmd.add_argument("--seed", type=int, default=0, help="seed of the HOPM starts and random special-case sketches")
    cmd.add_argument("--json", dest="json_out", default=None, help="write the checks as JSON to this file")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from ..verify import verify

    output_dir_exists(args.json_out)
    result = verify(args.dump, p=args.p, m=args.m, layers=args.layers, heads=args.heads, scale=args.scale,
                    columns=args.columns, restarts=args.restarts, seed=args.seed, progress=not args.no_progress)
    if args.json_out:
        write_text_atomic(args.json_out, result.to_json() + "\n")
    sys.stdout.write(result.to_text())
    return 0 if result.passed else 1
