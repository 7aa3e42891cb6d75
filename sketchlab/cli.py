"""The ``sketchlab`` command line.

One sub-command per task; each is a function ``_cmd_<name>(args) -> int`` registered in
:data:`_COMMANDS` by an ``_add_<name>(subparsers)`` function that declares its arguments. Bad input
(unknown option, invalid value, unreadable file) prints one line ``sketchlab: error: ...`` on
stderr and exits with status 2, without a traceback; a diverged fit (``FloatingPointError``) prints
one such line and exits with status 1.

Usage::

    sketchlab compare DUMP --p 2 --m 64 [--methods optimal,llops,mlp,psf,tensorsketch,based]
                           [--layers 0,8] [--heads 0,1] [--scale sqrt-d|none] [--seed 0]
                           [--holdout 0.25] [--json OUT] [--markdown OUT]
    sketchlab capture --model-dir DIR (--text FILE | --token-ids FILE) --out DUMP [--max-tokens 512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]


class UsageError(Exception):
    """Bad command-line input; reported as one ``sketchlab: error:`` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse calls this on bad input; never print usage + traceback
        raise UsageError(message)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def _scale(text: str):
    if text in ("none", "sqrt-d"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'sqrt-d', 'none' or a positive number, got {text!r}") from None
    return value


def _write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`sketchlab.io.atomic_write`)."""
    from .io import atomic_write

    target = Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(f"output directory {str(target.parent)!r} does not exist (for {path!r})")
    with atomic_write(target) as tmp:
        tmp.write_text(text, encoding="utf-8")


# ---- compare --------------------------------------------------------------------------------------

def _add_compare(sub) -> None:
    from .compare import DEFAULT_METHODS

    cmd = sub.add_parser("compare", help="fit sketches to a Q/K dump and compare them with the optimum (Table 3)")
    cmd.add_argument("dump", help="Q/K dump (.safetensors, .pt, .npy/.npz) with q, k of shape [L, H, n, d]")
    cmd.add_argument("--p", type=int, required=True, help="polynomial degree")
    cmd.add_argument("--m", type=int, required=True, help="sketch size (features per map)")
    cmd.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                     help="comma-separated methods (default: %(default)s)")
    cmd.add_argument("--layers", type=_int_list, default=None, help="comma-separated layer positions (default: all)")
    cmd.add_argument("--heads", type=_int_list, default=None, help="comma-separated head positions (default: all)")
    cmd.add_argument("--scale", type=_scale, default="sqrt-d",
                     help="'sqrt-d' (x·d^-1/4, default), 'none', or a number multiplying q and k")
    cmd.add_argument("--seed", type=int, default=0, help="seed of the held-out split and random sketches")
    cmd.add_argument("--holdout", type=float, default=0.25, help="fraction of tokens held out (default 0.25)")
    cmd.add_argument("--stat", choices=("mean", "median"), default="mean", help="statistic over heads in each cell")
    cmd.add_argument("--json", dest="json_out", default=None, help="write all rows as JSON to this file")
    cmd.add_argument("--markdown", dest="markdown_out", default=None, help="write the markdown table to this file")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")


def _cmd_compare(args) -> int:
    from .compare import compare

    for out in (args.json_out, args.markdown_out):
        if out is not None and not Path(out).parent.is_dir():
            raise FileNotFoundError(f"output directory {str(Path(out).parent)!r} does not exist (for {out!r})")
    table = compare(
        args.dump, p=args.p, m=args.m, methods=args.methods, layers=args.layers, heads=args.heads,
        seed=args.seed, holdout=args.holdout, scale=args.scale, progress=not args.no_progress,
    )
    text = table.to_markdown(stat=args.stat)
    if args.json_out:
        _write_atomic(args.json_out, table.to_json() + "\n")
    if args.markdown_out:
        _write_atomic(args.markdown_out, text)
    sys.stdout.write(text)
    return 0


# ---- capture --------------------------------------------------------------------------------------

def _add_capture(sub) -> None:
    cmd = sub.add_parser("capture", help="dump Q/K/V [L, H, n, d] from a local transformers model directory")
    cmd.add_argument("--model-dir", required=True, help="directory written by save_pretrained (no download)")
    src = cmd.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="UTF-8 text file, tokenised as one sequence by the directory's tokenizer")
    src.add_argument("--token-ids", help="file of integer token ids, one sequence per line (no tokenizer needed)")
    cmd.add_argument("--out", required=True, help="output dump (.safetensors, .pt, .npz or .npy)")
    cmd.add_argument("--max-tokens", type=int, default=512, help="longest sequence captured (default 512)")


def _cmd_capture(args) -> int:
    from .capture import capture_pretrained

    if not Path(args.out).parent.is_dir():
        raise FileNotFoundError(f"output directory {str(Path(args.out).parent)!r} does not exist (for {args.out!r})")
    dump = capture_pretrained(args.model_dir, text=args.text, token_ids=args.token_ids,
                              max_tokens=args.max_tokens, path=args.out)
    L, H, n, d = dump.q.shape
    print(f"{dump.path}: q, k{', v' if dump.v is not None else ''} of shape [L={L}, H={H}, n={n}, d={d}] "
          f"({dump.meta['captured']})")
    return 0


# ---- registry -------------------------------------------------------------------------------------

#: name -> (add arguments, run). A new command adds ``_add_<name>`` / ``_cmd_<name>`` and one entry.
_COMMANDS = {
    "compare": (_add_compare, _cmd_compare),
    "capture": (_add_capture, _cmd_capture),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every command of :data:`_COMMANDS`."""
    parser = _Parser(prog="sketchlab", description="Polynomial-kernel sketches for linear attention.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (add, run) in _COMMANDS.items():
        add(sub)
        sub.choices[name].set_defaults(_run=run)
    return parser


def _fail(message: str) -> int:
    one_line = " ".join(str(message).split())
    print(f"sketchlab: error: {one_line}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sketchlab`` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as err:
        return _fail(str(err))
    try:
        return int(args._run(args))
    except (ValueError, OSError, UsageError) as err:  # bad input; anything else is a bug and keeps its traceback
        return _fail(str(err))
    except FloatingPointError as err:  # a fit diverged: not bad input, but still one line
        _fail(str(err))
        return 1


if __name__ == "__main__":
    sys.exit(main())
