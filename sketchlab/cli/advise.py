"""``sketchlab advise``: per head, the smallest m the Theorem 3.1 floor allows and the m a method needs."""

from __future__ import annotations

import sys

from ._common import Outputs, add_common, positive_int

HELP = ("per layer/head: the smallest sketch size m whose Theorem 3.1 floor meets a target relative error, and the "
        "m the chosen method needs in practice (fitted, bisected); table + plot of floor and achieved error vs m")


def add_arguments(sub) -> None:
    cmd = sub.add_parser("advise", help=HELP, description=HELP + ". The algorithm is described in sketchlab.advise.")
    cmd.add_argument("dump", help="Q/K dump (.safetensors, .pt, .npy/.npz) with q, k of shape [L, H, n, d]")
    add_common(cmd, "p")
    cmd.add_argument("--target", type=float, required=True,
                     help="target relative error ‖Â−A‖_F/‖A‖_F on the fitting tokens, in (0, 1)")
    cmd.add_argument("--method", default="llops", help="sketch fitted for the practical m (default: llops)")
    add_common(cmd, "layers", "heads", "scale", "holdout", "seed")
    cmd.add_argument("--max-m", type=positive_int, default=None, help="largest m tried (default: the rank bound of A)")
    cmd.add_argument("--plot", default=None, help="write the floor / achieved error vs m figure (PNG) here")
    cmd.add_argument("--json", dest="json_out", default=None,
                     help="write the advice as JSON to this file ('-': standard output; never onto the dump)")
    cmd.add_argument("--markdown", dest="markdown_out", default=None,
                     help="write the table to this file ('-': standard output; never onto the dump)")
    add_common(cmd, "progress")


def run(args) -> int:
    from ..advise import advise

    outputs = Outputs({"--json": args.json_out, "--markdown": args.markdown_out, "--plot": args.plot},
                      inputs=[args.dump], stdout=("--json", "--markdown"))
    result = advise(args.dump, p=args.p, target=args.target, method=args.method, layers=args.layers, heads=args.heads,
                    scale=args.scale, holdout=args.holdout, seed=args.seed, max_m=args.max_m,
                    progress=not args.no_progress)
    text = result.to_markdown()

    def plot(path):
        from ..plots import plot_advice

        plot_advice(result, path)

    outputs.write({"--json": result.to_json() + "\n", "--markdown": text, "--plot": plot})
    if not outputs.stdout_taken:
        sys.stdout.write(text)
    return 0
