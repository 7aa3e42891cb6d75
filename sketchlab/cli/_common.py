"""Pieces every ``sketchlab`` sub-command shares: the usage error, argument types, output checks and writing."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["UsageError", "check_outputs", "device_arg", "int_list", "positive_int", "scale_arg", "seed_arg", "write_text_atomic"]


class UsageError(Exception):
    """Bad command-line input; reported as one ``sketchlab: error:`` line, exit status 2."""


def int_list(text: str) -> list[int]:
    """``"0,3"`` → ``[0, 3]`` (an argparse type)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def seed_arg(text: str) -> int:
    """An integer seed in torch's 64-bit range (an argparse type; see :func:`sketchlab._validation.check_seed`)."""
    from .._validation import check_seed

    try:
        return check_seed(int(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            str(err) if "must lie in" in str(err) else f"expected an integer seed, got {text!r}"
        ) from None


def device_arg(text: str):
    """A torch device this machine has: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` (an argparse type)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected a device such as 'cpu', 'cuda' or 'cuda:0', got {text!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"expected a device of type 'cpu' or 'cuda', got {text!r}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"device {text!r}: CUDA is not available on this machine")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"device {text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def positive_int(text: str) -> int:
    """An integer >= 1 (an argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def scale_arg(text: str):
    """``"sqrt-d"``, ``"none"`` or a number (an argparse type; the value is checked where it is used)."""
    if text in ("none", "sqrt-d"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'sqrt-d', 'none' or a positive number, got {text!r}") from None
    return value


def check_outputs(outputs: dict, inputs=(), *, dumps=()) -> None:
    """Check every output of a command before it does any work (:func:`sketchlab.io.check_output_paths`).

    ``outputs`` maps option names (``"--json"``) to paths (``None`` when not given); ``inputs``
    are the dumps/files the command reads (a ``.npy`` dump counts with all its parts); ``dumps``
    the labels of outputs that are Q/K dumps (a ``.npy`` one counts with all its parts). Refused:
    a missing output directory, an output that is a directory, two outputs that are the same
    file, an output that is one of the inputs (same inode, through symlinks).
    """
    from ..io import check_output_paths, dump_files

    files = [f for path in inputs if path is not None for f in dump_files(path)]
    check_output_paths(outputs, files, dumps=dumps)


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`sketchlab.io.atomic_write`; through symlinks)."""
    from ..io import atomic_write

    with atomic_write(Path(path)) as tmp:
        tmp.write_text(text, encoding="utf-8")
