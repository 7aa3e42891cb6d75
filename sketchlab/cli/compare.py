"""``sketchlab compare``: fit sketches to a Q/K dump and compare them with the optimum (Table 3)."""

from __future__ import annotations

import sys

from ._common import check_outputs, int_list, scale_arg, seed_arg, write_text_atomic


def add_arguments(sub) -> None:
    from ..compare import DEFAULT_METHODS

    cmd = sub.add_parser("compare", help="fit sketches to a Q/K dump and compare them with the optimum (Table 3)")
    cmd.add_argument("dump", help="Q/K dump (.safetensors, .pt, .npz, or NAME.npy for the sibling files "
                                  "NAME.q.npy, NAME.k.npy) with q, k of shape [L, H, n, d]")
    cmd.add_argument("--p", type=int, required=True, help="polynomial degree")
    cmd.add_argument("--m", type=int, required=True, help="sketch size (features per map)")
    cmd.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                     help="comma-separated methods (default: %(default)s)")
    cmd.add_argument("--layers", type=int_list, default=None, help="comma-separated layer positions (default: all)")
    cmd.add_argument("--heads", type=int_list, default=None, help="comma-separated head positions (default: all)")
    cmd.add_argument("--scale", type=scale_arg, default="sqrt-d",
                     help="'sqrt-d' (x·d^-1/4, default), 'none', or a number multiplying q and k")
    cmd.add_argument("--seed", type=seed_arg, default=0, help="seed of the held-out split and random sketches")
    cmd.add_argument("--holdout", type=float, default=0.25, help="fraction of tokens held out (default 0.25)")
    cmd.add_argument("--stat", choices=("mean", "median"), default="mean", help="statistic over heads in each cell")
    cmd.add_argument("--json", dest="json_out", default=None,
                     help="write all rows as JSON to this file (written through a symlink; never onto the dump)")
    cmd.add_argument("--markdown", dest="markdown_out", default=None,
                     help="write the markdown table to this file (written through a symlink; never onto the dump)")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from ..compare import compare
    from ..io import load_qk

    check_outputs({"--json": args.json_out, "--markdown": args.markdown_out}, inputs=[args.dump])
    dump = load_qk(args.dump)  # NAME.npy and every other form load_qk accepts; errors name the file
    table = compare(
        dump, p=args.p, m=args.m, methods=args.methods, layers=args.layers, heads=args.heads,
        seed=args.seed, holdout=args.holdout, scale=args.scale, progress=not args.no_progress,
    )
    text = table.to_markdown(stat=args.stat)
    if args.json_out:
        write_text_atomic(args.json_out, table.to_json() + "\n")
    if args.markdown_out:
        write_text_atomic(args.markdown_out, text)
    sys.stdout.write(text)
    return 0
