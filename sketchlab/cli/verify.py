"""``sketchlab verify``: every theorem check of the notebooks, on your own dump (PASS/FAIL with numbers)."""

from __future__ import annotations

import argparse
import sys

from ._common import Outputs, add_common, positive_int

HELP = ("run every theorem check of the notebooks on a Q/K dump: exact features, Theorem 3.1 equality and its two "
        "routes, Theorem 3.4 identity and per-feature bound, special cases as LLoPS Θ; PASS/FAIL with numbers and "
        "tolerances (exit 1 if any check fails or cannot be made)")

#: Most HOPM starts per spectral norm: each start is a full power iteration on a d^p tensor per column
#: and head; 1000 already makes a real dump's run minutes long.
MAX_RESTARTS = 1000
#: Most columns of W*_Q checked (each costs ``restarts`` power iterations per head).
MAX_COLUMNS = 1024


def _bounded(limit: int, what: str):
    def parse(text: str) -> int:
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{what} must be at most {limit} (the work bound), got {value}")
        return value

    return parse


def add_arguments(sub) -> None:
    cmd = sub.add_parser("verify", help=HELP, description=HELP + ". Tolerances are explained in sketchlab.verify.")
    cmd.add_argument("dump", help="Q/K dump (.safetensors, .pt, .npy/.npz) with q, k of shape [L, H, n, d]")
    add_common(cmd, "p", "m", "layers", "heads", "scale")
    cmd.add_argument("--columns", type=_bounded(MAX_COLUMNS, "--columns"), default=4,
                     help=f"columns of W*_Q checked for Theorem 3.4 (default 4, at most {MAX_COLUMNS})")
    cmd.add_argument("--restarts", type=_bounded(MAX_RESTARTS, "--restarts"), default=4,
                     help=f"HOPM starts per spectral norm (default 4, at most {MAX_RESTARTS})")
    add_common(cmd, "seed")
    cmd.add_argument("--json", dest="json_out", default=None,
                     help="write the checks as JSON to this file ('-': standard output; never onto the dump)")
    add_common(cmd, "progress")


def run(args) -> int:
    from ..verify import verify

    outputs = Outputs({"--json": args.json_out}, inputs=[args.dump], stdout=("--json",))
    result = verify(args.dump, p=args.p, m=args.m, layers=args.layers, heads=args.heads, scale=args.scale,
                    columns=args.columns, restarts=args.restarts, seed=args.seed, progress=not args.no_progress)
    outputs.write({"--json": result.to_json() + "\n"})
    if not outputs.stdout_taken:
        sys.stdout.write(result.to_text())
    return 0 if result.passed else 1
