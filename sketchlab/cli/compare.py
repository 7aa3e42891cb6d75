"""``sketchlab compare``: fit sketches to a Q/K dump and compare them with the optimum (Table 3)."""

from __future__ import annotations

import math
import sys

import torch

from ._common import check_outputs, int_list, scale_arg, seed_arg, write_text_atomic

#: Float64 ``[H, n_fit, n_fit]`` kernels alive at once while one layer is fitted and measured
#: (the exact kernel, the sketch's kernel and their difference); the SVD of the Theorem 3.1 floor
#: needs more, so this is a lower bound on the peak: a run rejected by it could not have finished.
_KERNELS_ALIVE = 3


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


def _check_heads(dump, layers: list[int], heads: list[int]) -> None:
    """Reject selected heads whose q or k is all zeros: their kernel is 0 and every relative error undefined."""
    for name in ("q", "k"):
        t = getattr(dump, name)
        for layer in layers:
            zero = t[layer, heads].abs().amax((-2, -1)) == 0  # [H']
            if bool(zero.any()):
                head = heads[int(zero.nonzero()[0])]
                raise ValueError(
                    f"{dump.path}: tensor {name} of layer {layer}, head {head} is all zeros: the kernel (qᵀk)^p is 0 "
                    "there and every relative error is undefined; leave it out with --heads/--layers"
                )


def _check_memory(dump, layers: list[int], heads: list[int], holdout: float) -> None:
    from .._validation import check_memory

    n = dump.q.shape[2]
    n_fit = n - math.ceil(holdout * n)
    check_memory(
        _KERNELS_ALIVE * len(heads) * n_fit * n_fit * 8,
        what=f"fitting one layer of {dump.path} needs at least {_KERNELS_ALIVE} float64 kernels of "
             f"[{len(heads)} heads, {n_fit}, {n_fit}] tokens",
        way_out="select fewer heads (--heads) or use a dump with fewer tokens",
    )


def _check_tokens(dump, holdout: float) -> None:
    """At least 2 fitting tokens: on ``n_fit <= 1`` every sketch size reaches the kernel's rank."""
    n = dump.q.shape[2]
    n_fit = n - math.ceil(holdout * n)
    if n_fit <= 1:
        raise ValueError(
            f"{dump.path}: n={n} token(s), and --holdout {holdout:g} leaves {n_fit} to fit: a kernel on at most one "
            "token has rank <= 1, so every sketch size m reaches it and the Theorem 3.1 floor is 0 (no yardstick); "
            "use a dump with more tokens or a smaller --holdout"
        )


def _max_abs_score(q, k, block: int = 1024) -> float:
    """``max |qᵢᵀkⱼ|`` over ``q, k [H, n, d]`` in float64, ``block`` query rows at a time (no n×n tensor)."""
    q, k = q.to(torch.float64), k.to(torch.float64)
    best = 0.0
    for start in range(0, q.shape[-2], block):
        scores = q[:, start:start + block] @ k.mT  # [H, block, n]
        best = max(best, float(scores.abs().max()))
    return best


def _check_scale(dump, layers: list[int], heads: list[int], p: int, factor: float) -> None:
    """Refuse, before fitting, a dump whose kernel (qᵀk)^p (after ``--scale``) overflows the fitting dtype.

    The fitters work in the dump's dtype and sum ``n`` products of size ``|qᵀk|^p``; when
    ``n · max|qᵀk|^p`` exceeds the dtype's largest value every sketch's kernel, loss or SVD is
    non-finite, so the comparison could only print inf/NaN.
    """
    dtype = dump.q.dtype
    limit = math.log10(torch.finfo(dtype).max)
    n = dump.q.shape[2]
    index = torch.tensor(heads)
    for layer in layers:
        top = _max_abs_score(dump.q[layer, index], dump.k[layer, index]) * factor * factor
        if top == 0:
            continue
        size = p * math.log10(top) + math.log10(n)
        if size > limit:
            raise ValueError(
                f"{dump.path}: layer {layer}: the kernel (qᵀk)^p overflows {dtype}: after the scale factor {factor:.4g}, "
                f"max |qᵀk| = {top:.4g}, and {n} tokens × {top:.4g}^{p} ≈ 1e{size:.0f} exceeds the dtype's maximum "
                f"≈ 1e{limit:.0f}; every fit would be inf/NaN. Scale the inputs down (--scale sqrt-d or a smaller "
                f"number), lower --p{'' if dtype == torch.float64 else ', or convert the dump to float64'}"
            )


def run(args) -> int:
    from .._validation import MAX_DEGREE
    from ..compare import compare, resolve_scale
    from ..io import load_qk, select_indices

    check_outputs({"--json": args.json_out, "--markdown": args.markdown_out}, inputs=[args.dump])
    dump = load_qk(args.dump)  # NAME.npy and every other form load_qk accepts; errors name the file
    L, H = dump.q.shape[:2]
    layers = select_indices(args.layers, L, "layer", str(dump.path))
    heads = select_indices(args.heads, H, "head", str(dump.path))
    _check_heads(dump, layers, heads)
    if 0 <= args.holdout < 1:  # compare() reports any other value
        _check_tokens(dump, args.holdout)
        _check_memory(dump, layers, heads, args.holdout)
    if 1 <= args.p <= MAX_DEGREE:  # compare() reports any other degree
        _, factor = resolve_scale(args.scale, dump.q.shape[-1])
        _check_scale(dump, layers, heads, args.p, factor)
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
