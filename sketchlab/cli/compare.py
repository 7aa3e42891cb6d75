"""``sketchlab compare``: fit sketches to a Q/K dump and compare them with the optimum (Table 3)."""

from __future__ import annotations

import sys

from ._common import Outputs, add_common


def add_arguments(sub) -> None:
    from ..compare import DEFAULT_METHODS

    cmd = sub.add_parser("compare", help="fit sketches to a Q/K dump and compare them with the optimum (Table 3)")
    cmd.add_argument("dump", help="Q/K dump (.safetensors, .pt, .npz, or NAME.npy for the sibling files "
                                  "NAME.q.npy, NAME.k.npy) with q, k of shape [L, H, n, d]")
    add_common(cmd, "p", "m")
    cmd.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                     help="comma-separated methods (default: %(default)s)")
    add_common(cmd, "layers", "heads", "scale", "seed", "holdout")
    cmd.add_argument("--stat", choices=("mean", "median"), default="mean", help="statistic over heads in each cell")
    cmd.add_argument("--json", dest="json_out", default=None,
                     help="write all rows as JSON to this file ('-': standard output; never onto the dump)")
    cmd.add_argument("--markdown", dest="markdown_out", default=None,
                     help="write the markdown table to this file ('-': standard output; never onto the dump)")
    add_common(cmd, "progress")


def run(args) -> int:
    from ..compare import compare
    from ..io import load_qk

    outputs = Outputs({"--json": args.json_out, "--markdown": args.markdown_out}, inputs=[args.dump],
                      stdout=("--json", "--markdown"))
    dump = load_qk(args.dump)  # NAME.npy and every other form load_qk accepts; errors name the file
    table = compare(
        dump, p=args.p, m=args.m, methods=args.methods, layers=args.layers, heads=args.heads,
        seed=args.seed, holdout=args.holdout, scale=args.scale, progress=not args.no_progress,
    )
    text = table.to_markdown(stat=args.stat)
    outputs.write({"--json": table.to_json() + "\n", "--markdown": text})
    if not outputs.stdout_taken:
        sys.stdout.write(text)
    return 0
