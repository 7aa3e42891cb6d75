"""``sketchlab fit``: fit one sketch to a Q/K dump and export its Θ (DESIGN.md §3)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ..io import dump_files
from ._common import Outputs, UsageError, add_common, positive_int

#: Methods whose sketch has an exact Θ form (sketchlab.as_llops); the others cannot be exported.
EXPORTABLE = ("llops", "elementwise", "based-expand", "psf-random", "based", "psf")  # the last two: deprecated names


def add_arguments(sub) -> None:
    cmd = sub.add_parser("fit", help="fit one sketch to a Q/K dump and export its Θ as safetensors")
    cmd.add_argument("dump", help="Q/K dump (.safetensors, .pt, .npy/.npz) with q, k of shape [L, H, n, d]")
    cmd.add_argument("--method", default="llops", choices=EXPORTABLE,
                     help="sketch to fit (one with an exact Θ form; default %(default)s)")
    add_common(cmd, "p", "m")
    cmd.add_argument("--out", required=True,
                     help="output Θ file (.safetensors; parent directories created; never the input dump)")
    add_common(cmd, "layers", "heads", "scale", "seed", "holdout")
    cmd.add_argument("--fit-tokens", type=positive_int, default=None,
                     help="fit on a random subset of this many tokens per head (errors still on all of them)")
    cmd.add_argument("--quality", choices=("default", "high"), default=None,
                     help="--method llops only: the fit's preset (sketchlab.llops.QUALITY; default 'default')")
    cmd.add_argument("--work", type=_work_arg, default=None,
                     help="--method llops only: cap on each head's estimated multiply-adds, e.g. 1e12, or 'inf' "
                          "for the preset's whole schedule (default: the preset's cap)")
    add_common(cmd, "device", "progress")


def _work_arg(text: str) -> float:
    """A number > 0 or ``inf`` (an argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0 or 'inf', got {text!r}") from None
    if not value > 0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a number > 0 or 'inf', got {text!r}")
    return value


def _check_output(out: str, dump: str) -> Outputs:
    """Reject a bad output location before any work: not ``.safetensors``, or anything
    :class:`~sketchlab.cli._common.Outputs` refuses (the input dump by any name, a directory)."""
    if Path(out).suffix.lower() != ".safetensors":
        raise UsageError(f"--out must be a .safetensors file, got {out!r}")
    if not dump_files(dump):
        raise FileNotFoundError(f"Q/K dump {dump!r} does not exist")
    return Outputs({"--out": out}, inputs=[dump])


def run(args) -> int:
    from .._dumpsel import select_and_scale
    from .._validation import check_symmetric_features
    from ..fit import fit_sketch
    from ..numerics import ratio_text

    for flag, value in (("--quality", args.quality), ("--work", args.work)):
        if value is not None and args.method != "llops":
            raise UsageError(f"{flag} applies to --method llops only, got --method {args.method}")
    outputs = _check_output(args.out, args.dump)
    sel = select_and_scale(args.dump, layers=args.layers, heads=args.heads, scale=args.scale)
    # the fit's report measures it against the Theorem 3.1 optimum on the exact symmetric features of every
    # head's fitting tokens: their enumeration and size, estimated before the fit (not after minutes of it)
    L, H, n, d = sel.q.shape
    check_symmetric_features(d, args.p, L * H * (n - math.ceil(args.holdout * n)),
                             where=f"{args.dump}: fit at p={args.p}, d={d}",
                             lower_p="lower --p", fewer_rows="fit fewer heads at once (--layers, --heads)")
    options = {key: value for key, value in (("quality", args.quality), ("work", args.work)) if value is not None}
    if args.method == "llops":  # the one fitter that iterates long enough to need a bar
        options["progress"] = not args.no_progress
    fit = fit_sketch(args.method, sel.q.to(args.device), sel.k.to(args.device), p=args.p, m=args.m, seed=args.seed,
                     holdout=args.holdout, fit_tokens=args.fit_tokens, **options)
    fit.scale = args.scale
    with outputs.parents_created():
        fit.save_theta(args.out, dump=args.dump)  # one file, written atomically by export_theta
    outputs.announce(args.out)
    report = fit.report
    ratio, undefined = report.optimality_ratio.nanmean().item(), int(report.optimality_ratio.isnan().sum())
    line = (f"{args.method}: p={args.p} m={args.m} layers×heads={list(sel.q.shape[:2])} ({sel.scale_description}) "
            f"rel_fro={report.rel_fro.mean().item():.4g} optimality_ratio={ratio_text(ratio, '.4g')}"
            + (f" (mean of the defined; {undefined} of {report.optimality_ratio.numel()} heads undefined)"
               if 0 < undefined < report.optimality_ratio.numel() else ""))
    if report.holdout_rel_fro is not None:
        line += f" holdout_rel_fro={report.holdout_rel_fro.mean().item():.4g}"
    sys.stdout.write(f"{line}\n")
    return 0
