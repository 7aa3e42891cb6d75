"""Pieces every ``sketchlab`` sub-command shares: the usage error, argument types, output writing."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["UsageError", "int_list", "scale_arg", "write_text_atomic"]


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


def scale_arg(text: str):
    """``"sqrt-d"``, ``"none"`` or a number (an argparse type; the value is checked where it is used)."""
    if text in ("none", "sqrt-d"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'sqrt-d', 'none' or a positive number, got {text!r}") from None
    return value


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`sketchlab.io.atomic_write`)."""
    from ..io import atomic_write

    target = Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(f"output directory {str(target.parent)!r} does not exist (for {path!r})")
    with atomic_write(target) as tmp:
        tmp.write_text(text, encoding="utf-8")
