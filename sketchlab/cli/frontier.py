"""``sketchlab frontier``: Zoology's MQAR recall frontier, accuracy against state bytes per layer.

A thin layer over :mod:`sketchlab.tasks.frontier`: the grid ``--methods`` × their sizes × ``--seeds``, a
learning-rate sweep (``--lrs``) per (method, size) on the first seed and the other seeds at the best rate,
``--jobs`` runs at a time, one thread each. Every finished run is cached in ``--work`` (one JSON per run,
named by a hash of its settings): the same command again trains only what is missing, and Ctrl-C loses no
finished run. The report (``--out`` + ``.md``, ``.json``, ``.png``) is written from the cached runs alone;
``--report-only`` writes it without training.

Usage::

    sketchlab frontier --methods softmax,based,deltanet --seeds 0,1,2 --lrs 3e-3,1e-2 --work RUNS --out REPORT
    sketchlab frontier ... --report-only
    sketchlab frontier --preset kernel --methods based,llops,hedgehog --seeds 0 --work RUNS --out REPORT

``--preset kernel`` runs the kernel-only harness (:mod:`sketchlab.tasks.recall_kernel`): the report adds each
point's attention-matrix error against exact softmax and degree-2 polynomial attention.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace

from ._common import UsageError, add_common, positive_int


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, got {text!r}")
    return values


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return values


def add_arguments(sub) -> None:
    cmd = sub.add_parser("frontier", help="MQAR recall frontier: accuracy against state bytes per layer",
                         description=__doc__.splitlines()[0])
    cmd.add_argument("--methods", default="softmax,based,llops,deltanet,gated-deltanet",
                     help="comma-separated methods of sketchlab.tasks.frontier.METHODS (default: the main five)")
    cmd.add_argument("--sizes", action="append", default=[], metavar="METHOD=S1,S2",
                     help="a method's sizes (its knob's values), instead of its defaults; repeatable")
    cmd.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="seeds (the first runs the sweep; default 0,1,2)")
    cmd.add_argument("--lrs", type=_floats, default=[3e-3, 1e-2], help="learning rates swept (default 3e-3,1e-2)")
    cmd.add_argument("--preset", choices=("cpu", "zoology", "kernel"), default="cpu",
                     help="the protocol: cpu (Zoology's lengths / 4, vocabulary 512, d_model 64, 600 steps; default), "
                          "zoology, or kernel (the kernel-only harness: continuous MQAR, one layer over frozen "
                          "embeddings, P <= 32 for training, to 128 for the tests; sketchlab.tasks.recall_kernel)")
    cmd.add_argument("--steps", type=positive_int, default=None, help="training steps (default: the preset's)")
    cmd.add_argument("--batch", type=positive_int, default=None, help="batch size (default: the preset's)")
    cmd.add_argument("--vocab", type=positive_int, default=None, help="vocabulary (default: the preset's)")
    cmd.add_argument("--d-model", type=positive_int, default=None, help="model width (default: the preset's)")
    cmd.add_argument("--eval-sequences", type=positive_int, default=None,
                     help="held-out sequences per test slice (default: the preset's)")
    cmd.add_argument("--random-non-queries", action=argparse.BooleanOptionalAction, default=None,
                     help="random tokens between the queries (Zoology's default) or, --no-random-non-queries, the "
                          "filler 0 (default: the preset's: cpu the filler, zoology random)")
    cmd.add_argument("--threshold", type=float, default=0.9, help="the score per method's smallest state must reach")
    cmd.add_argument("--jobs", type=positive_int, default=1, help="runs at a time (one thread each; default 1)")
    cmd.add_argument("--work", required=True, help="directory of the cached runs (created)")
    cmd.add_argument("--out", required=True, help="report path without suffix: writes OUT.md, OUT.json, OUT.png")
    cmd.add_argument("--report-only", action="store_true", help="write the report from the cached runs only")
    add_common(cmd, "progress")


def _points(args):
    from ..tasks.frontier import METHODS, method_points

    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise UsageError(f"--methods must name methods of {sorted(METHODS)}, got {args.methods!r}")
    sizes = {}
    for text in args.sizes:
        name, _, values = text.partition("=")
        if name not in methods:
            raise UsageError(f"--sizes {text!r}: {name!r} is not one of --methods {methods}")
        try:
            sizes[name] = [int(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise UsageError(f"--sizes {text!r}: the sizes must be comma-separated integers") from None
    return [p for m in methods for p in method_points(m, sizes.get(m))]


def run(args) -> int:
    from ..tasks.frontier import CPU, KERNEL_CPU, ZOOLOGY, frontier_report, load_runs, run_frontier

    protocol = {"cpu": CPU, "zoology": ZOOLOGY, "kernel": KERNEL_CPU}[args.preset]
    if args.preset == "kernel" and args.random_non_queries is not None:
        raise UsageError("--random-non-queries is a setting of the token MQAR: the kernel-only harness (--preset "
                         "kernel) has no tokens between its queries")
    names = ("steps", "batch", "vocab", "d_model", "eval_sequences", "random_non_queries")
    changes = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    protocol = replace(protocol, **changes)
    points = _points(args)
    if args.report_only:
        runs = load_runs(args.work)
    else:
        runs = run_frontier(points, protocol, lrs=args.lrs, seeds=args.seeds, work=args.work, jobs=args.jobs,
                            progress=not args.no_progress)
    command = "sketchlab frontier " + " ".join(shlex.quote(a) for a in _argv(args))
    summary = frontier_report(runs, points, protocol, lrs=args.lrs, seeds=args.seeds, out=args.out, command=command,
                              threshold=args.threshold)
    for suffix in (".md", ".json", ".png"):
        print(f"wrote {args.out}{suffix}", file=sys.stderr)
    print(f"{len(summary['points'])} of {len(points)} points reported "
          f"({summary['train_seconds'] / 60:.1f} min of training)", file=sys.stderr)
    return 0


def _argv(args) -> list[str]:
    """The command line as given, without ``--report-only`` and ``--no-progress`` (the report is the same)."""
    argv = sys.argv[sys.argv.index("frontier") + 1:] if "frontier" in sys.argv else []
    return [a for a in argv if a not in ("--report-only", "--no-progress")]
