"""``sketchlab spectrum``: singular-value decay of (QKᵀ)^∘p per layer/head, table and plot."""

from __future__ import annotations

import sys

from ._common import Outputs, add_common, positive_int_list

HELP = ("singular-value decay of A = (QKᵀ)^∘p per layer/head of a Q/K dump: σ_m/σ_1 and the Theorem 3.1 relative "
        "floor at several m, the m holding 99%% of ‖A‖_F², and a plot")


def add_arguments(sub) -> None:
    # ``help`` (the command list) is %-formatted by argparse; ``description`` is printed as is.
    cmd = sub.add_parser("spectrum", help=HELP, description=HELP.replace("%%", "%"))
    cmd.add_argument("dump", help="Q/K dump (.safetensors, .pt, .npy/.npz) with q, k of shape [L, H, n, d]")
    add_common(cmd, "p", "layers", "heads", "scale")
    cmd.add_argument("--sizes", type=positive_int_list, default=[8, 16, 32, 64, 128, 256],
                     help="sketch sizes tabulated, each >= 1 (default 8,16,32,64,128,256)")
    cmd.add_argument("--plot", default=None, help="write the σ_i/σ_1 figure (PNG) here")
    cmd.add_argument("--json", dest="json_out", default=None,
                     help="write every singular value as JSON to this file ('-': standard output)")
    add_common(cmd, "progress")


def run(args) -> int:
    from ..spectrum import kernel_spectrum

    outputs = Outputs({"--json": args.json_out, "--plot": args.plot}, inputs=[args.dump], stdout=("--json",))
    result = kernel_spectrum(args.dump, p=args.p, layers=args.layers, heads=args.heads, scale=args.scale)
    text = result.to_markdown(sizes=args.sizes)

    def plot(path):
        from ..plots import plot_kernel_spectrum

        plot_kernel_spectrum(result, path)

    outputs.write({"--json": result.to_json() + "\n", "--plot": plot})
    if not outputs.stdout_taken:
        sys.stdout.write(text)
    return 0
