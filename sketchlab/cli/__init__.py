"""The ``sketchlab`` command line.

One sub-command per module of this package: each module has ``add_arguments(subparsers)``, which
declares the command and its arguments, and ``run(args) -> int``. :data:`COMMANDS` lists them in the
order ``sketchlab --help`` shows. Bad input (unknown option, invalid value, unreadable file, an
output onto an input, a size over its budget) prints one line ``sketchlab: error: ...`` on stderr
and exits with status 2, without a traceback, before any work; a diverged fit
(``FloatingPointError``) prints one such line and exits with status 1; any other exception keeps
its traceback (it is a bug). Warnings are one line ``sketchlab: warning: ...`` on stderr.

One convention (:mod:`sketchlab.cli._common`): the shared options (``--p`` default 2, ``--m``
default 64, ``--layers``, ``--heads``, ``--scale``, ``--seed``, ``--holdout``, ``--device``,
``--no-progress``) have one spelling, type, default and help everywhere; every output is checked
before the work (never an input, by any name or link), written atomically and all-or-nothing, its
missing parent directories created, and reported as ``wrote PATH`` on stderr; ``--json -`` and
``--markdown -`` write to standard output (which then carries nothing else); long work shows a
tqdm bar on stderr.

Usage::

    sketchlab compare DUMP [--p 2] [--m 64] [--methods optimal,llops,mlp,psf,tensorsketch,based]
                           [--layers 0,8] [--heads 0,1] [--scale sqrt-d|none|X] [--seed 0]
                           [--holdout 0.25] [--json OUT|-] [--markdown OUT|-]
    sketchlab verify DUMP [--p 2] [--m 64] [--layers 0,3] [--heads 0] [--scale sqrt-d|none|X] [--json OUT|-]
    sketchlab advise DUMP [--p 2] --target 0.05 [--method llops] [--plot OUT.png] [--json OUT|-] [--markdown OUT|-]
    sketchlab spectrum DUMP [--p 2] [--plot OUT.png] [--json OUT|-]
    sketchlab capture (--model-dir DIR | --gguf FILE) (--text FILE | --token-ids FILE) --out DUMP [--max-tokens 512] [--no-progress]
    sketchlab fit DUMP [--method llops] [--p 2] [--m 64] --out THETA.safetensors [--layers 0,3] [--heads 0,1]
                  [--scale sqrt-d|none|X] [--seed 0] [--holdout 0.25]
    sketchlab train --task mqar --attention {softmax,poly,based,psf,llops} [--p P] [--m M]
                    [--init random|based|theta FILE] [--steps N] [--seed S] --out DIR
    sketchlab linearize CHECKPOINT --p 2 --m 64 --out DIR [--steps N] [--transfer W] [--no-progress]
    sketchlab linearize (--model-dir DIR | --gguf FILE) --text FILE --out DIR [--attention llops] [--no-progress]
    sketchlab evaluate (--model-dir DIR | --gguf FILE) [--converted DIR] [--text FILE] [--passkey-lengths 1024,2048,4096]
                       [--depths 0.1,0.5,0.9] [--n 5] [--gaps 256,1024,2048] [--passage 128] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ._common import UsageError

__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]

#: Sub-command names; each is the module ``sketchlab.cli.<name>`` (a new command adds one module
#: and one entry here).
COMMANDS = ("compare", "verify", "advise", "spectrum", "fit", "train", "frontier", "linearize", "capture", "evaluate")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse calls this on bad input; never print usage + traceback
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every command of :data:`COMMANDS`."""
    parser = _Parser(prog="sketchlab", description="Polynomial-kernel sketches for linear attention.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        module.add_arguments(sub)
        sub.choices[name].set_defaults(_run=module.run)
    return parser


def _fail(message: str) -> int:
    one_line = " ".join(str(message).split())
    print(f"sketchlab: error: {one_line}", file=sys.stderr)
    return 2


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"sketchlab: warning: {' '.join(str(message).split())}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sketchlab`` console script; returns the exit status.

    Warnings raised while a command runs are printed as one line ``sketchlab: warning: ...`` on stderr.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = _one_line_warning  # restored when the command ends
        return _main(argv)


def _main(argv):
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

