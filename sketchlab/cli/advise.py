"""``sketchlab advise``: per head, the smallest m the Theorem 3.1 floor allows and the m a method needs."""

from __future__ import annotations

import sys

from ._common import int_list, scale_arg, write_text_atomic
from ._outputs import output_dir_exists

HELP = ("per layer/head: the smallest sketch size m whose Theorem 3.1 floor meets a target relative error, and the "
        "m the chosen method needs in practice (fitted, bisected); table + plot of floor and achieved error vs m")


def add_arguments(sub) -> None:
    cmd = sub.add_parser("advise", help=HELP, description=HELP + ". The algorithm is described in sketchlab.advise.")
    cmd.add_argument("dump", help="Q/K dump (.safetensors, .pt, .npy/.npz) with q, k of shape [L, H, n, d]")
    cmd.add_argument("--p", type=int, required=True, help="polynomial degree")
    cmd.add_argument("--target", type=float, required=True,
                     help="target relative error ‖Â−A‖_F/‖A‖_F on the fitting tokens, in (0, 1)")
    cmd.add_argument("--method", default="llops", help="sketch fitted for the practical m (default: llops)")
    cmd.add_argument("--layers", type=int_list, default=None, help="comma-separated layer positions (default: all)")
    cmd.add_argument("--heads", type=int_list, default=None, help="comma-separated head positions (default: all)")
    cmd.add_argument("--scale", type=scale_arg, default="sqrt-d",
                     help="'sqrt-d' (q, k × d^-1/4 so qᵀk → qᵀk/√d; default), 'none', or a number multiplying q and k")
    cmd.add_argument("--holdout", type=float, default=0.25, help="fraction of tokens held out, as in compare (default 0.25)")
    cmd.add_argument("--seed", type=int, default=0, help="seed of the held-out split and the fits (as in compare)")
    cmd.add_argument("--max-m", type=int, default=None, help="largest m tried (default: the rank bound of A)")
    cmd.add_argument("--plot", default=None, help="write the floor / achieved error vs m figure (PNG) here")
    cmd.add_argument("--json", dest="json_out", default=None, help="write the advice as JSON to this file")
    cmd.add_argument("--markdown", dest="markdown_out", default=None, help="write the table to this file")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from ..advise import advise

    for out in (args.plot, args.json_out, args.markdown_out):
        output_dir_exists(out)
    result = advise(args.dump, p=args.p, target=args.target, method=args.method, layers=args.layers, heads=args.heads,
                    scale=args.scale, holdout=args.holdout, seed=args.seed, max_m=args.max_m,
                    progress=not args.no_progress)
    text = result.to_markdown()
    if args.json_out:
        write_text_atomic(args.json_out, result.to_json() + "\n")
    if args.markdown_out:
        write_text_atomic(args.markdown_out, text)
    if args.plot:
        from ..plots import plot_advice

        plot_advice(result, args.plot)
    sys.stdout.write(text)
    return 0
