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
    cmd.add_argument("--sizes", type=positive_int_list, default=None,
                     help="sketch sizes tabulated, each >= 1 and at most the number of tokens (the singular values; "
                          "a larger one is refused); default 8,16,32,64,128,256, those beyond the tokens left out with "
                          "a note")
    cmd.add_argument("--plot", default=None, help="write the σ_i/σ_1 figure (PNG) here")
    cmd.add_argument("--json", dest="json_out", default=None,
                     help="write every singular value as JSON to this file ('-': standard output)")
    add_common(cmd, "progress")


def _spectrum(args):
    """:func:`sketchlab.kernel_spectrum` of the dump, one layer at a time under a progress bar (stderr)."""
    import dataclasses

    import torch
    from tqdm.auto import tqdm

    from .._dumpsel import select_and_scale
    from .._validation import check_degree
    from ..spectrum import check_sizes, spectrum_of_selection

    p = check_degree(args.p)
    sel = select_and_scale(args.dump, layers=args.layers, heads=args.heads, scale=args.scale)
    if args.sizes is not None:  # before the factorisations: A has one singular value per token (holdout 0)
        check_sizes(args.sizes, sel.q.shape[2], sel.q.shape[2], "--sizes")
    parts = []
    for i in tqdm(range(len(sel.layers)), desc="spectrum", unit="layer", disable=args.no_progress, leave=False):
        one = dataclasses.replace(sel, q=sel.q[i:i + 1], k=sel.k[i:i + 1], layers=sel.layers[i:i + 1])
        parts.append(spectrum_of_selection(one, p, holdout=0.0, seed=0))
    return dataclasses.replace(parts[0], singular_values=torch.cat([r.singular_values for r in parts]),
                               layers=list(sel.layers))


def run(args) -> int:
    outputs = Outputs({"--json": args.json_out, "--plot": args.plot}, inputs=[args.dump], stdout=("--json",))
    result = _spectrum(args)
    text = result.to_markdown(sizes=args.sizes)

    def plot(path):
        from ..plots import plot_kernel_spectrum

        plot_kernel_spectrum(result, path)

    outputs.write({"--json": result.to_json() + "\n", "--plot": plot})
    if not outputs.stdout_taken:
        sys.stdout.write(text)
    return 0
