"""``sketchlab spectrum``: singular-value decay of (QKᵀ)^∘p per layer/head, table and plot."""

from __future__ import annotations

import sys

from ._common import int_list, scale_arg, write_text_atomic
from ._outputs import output_dir_exists

HELP = ("singular-value decay of A = (QKᵀ)^∘p per layer/head of a Q/K dump: σ_m/σ_1 and the Theorem 3.1 relative "
        "floor at several m, the m holding 99%% of ‖A‖_F², and a plot")


def add_arguments(sub) -> None:
    cmd = sub.add_parser("spectrum", help=HELP, description=HELP)
    cmd.add_argument("dump", help="Q/K dump (.safetensors, .pt, .npy/.npz) with q, k of shape [L, H, n, d]")
    cmd.add_argument("--p", type=int, default=2, help="polynomial degree (default 2)")
    cmd.add_argument("--layers", type=int_list, default=None, help="comma-separated layer positions (default: all)")
    cmd.add_argument("--heads", type=int_list, default=None, help="comma-separated head positions (default: all)")
    cmd.add_argument("--scale", type=scale_arg, default="sqrt-d",
                     help="'sqrt-d' (q, k × d^-1/4 so qᵀk → qᵀk/√d; default), 'none', or a number multiplying q and k")
    cmd.add_argument("--sizes", type=int_list, default=[8, 16, 32, 64, 128, 256],
                     help="sketch sizes tabulated (default 8,16,32,64,128,256)")
    cmd.add_argument("--plot", default=None, help="write the σ_i/σ_1 figure (PNG) here")
    cmd.add_argument("--json", dest="json_out", default=None, help="write every singular value as JSON to this file")


def run(args) -> int:
    from ..spectrum import kernel_spectrum

    for out in (args.plot, args.json_out):
        output_dir_exists(out)
    result = kernel_spectrum(args.dump, p=args.p, layers=args.layers, heads=args.heads, scale=args.scale)
    if args.json_out:
        write_text_atomic(args.json_out, result.to_json() + "\n")
    if args.plot:
        from ..plots import plot_kernel_spectrum

        plot_kernel_spectrum(result, args.plot)
    sys.stdout.write(result.to_markdown(sizes=args.sizes))
    return 0
