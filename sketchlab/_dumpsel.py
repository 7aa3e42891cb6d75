"""The first step of every dump-level entry point: read, validate, select and scale (one place).

:func:`sketchlab.compare`, :func:`sketchlab.verify`, :func:`sketchlab.advise` and
:func:`sketchlab.kernel_spectrum` all start here, so they accept the same inputs, select layers
and heads by the same rule (:func:`sketchlab.io.select_indices`) and apply the same scale
(:mod:`sketchlab.scaling`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .io import dump_files, load_qk, select_indices, validate_qk
from .scaling import describe_scale, resolve_scale, scale_label

__all__ = ["Selection", "load_dump", "select_and_scale"]


def load_dump(dump_or_qk):
    """``(q, k, source)`` with ``q, k`` validated and of shape ``[L, H, n, d]``.

    ``dump_or_qk`` is a path (read with :func:`sketchlab.load_qk`), a loaded dump (anything with
    ``.q`` and ``.k``) or a tuple ``(q, k)`` of ``[L, H, n, d]``, ``[H, n, d]`` or ``[n, d]`` tensors.
    """
    if isinstance(dump_or_qk, (str, os.PathLike)):
        path = Path(dump_or_qk)
        if not os.path.lexists(path) and not dump_files(path):  # NAME.npy: its sibling parts NAME.q.npy, ...
            raise FileNotFoundError(f"Q/K dump {str(path)!r} does not exist")  # else load_qk names the cause
        dump = load_qk(path)
        q, k, source = dump.q, dump.k, str(path)
    elif isinstance(dump_or_qk, tuple) and len(dump_or_qk) == 2:
        (q, k), source = dump_or_qk, "in-memory (q, k)"
    elif hasattr(dump_or_qk, "q") and hasattr(dump_or_qk, "k"):
        q, k = dump_or_qk.q, dump_or_qk.k
        source = str(getattr(dump_or_qk, "path", None) or "in-memory dump")
    else:
        raise TypeError(
            "dump_or_qk must be a path to a Q/K dump, a QKDump (with .q and .k) or a tuple (q, k), "
            f"got {type(dump_or_qk).__name__}"
        )
    q, k, _ = validate_qk(q, k, where=source)  # [L, H, n, d] each, finite floats, same shape
    return q, k, source


@dataclass
class Selection:
    """Scaled ``q, k [L', H', n, d]`` (the dump's dtype) of the selected layers and heads, and how they were made."""

    q: torch.Tensor
    k: torch.Tensor
    layers: list[int]
    heads: list[int]
    source: str
    scale: str
    scale_factor: float
    scale_description: str

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.q.shape)

    @property
    def label(self) -> str:
        """The dump and its scale, as messages about the scaled tensors name them."""
        return f"{self.source} (after the scale: {self.scale_description})"


def select_and_scale(dump_or_qk, *, layers=None, heads=None, scale="sqrt-d") -> Selection:
    """Load (:func:`load_dump`), select ``layers``/``heads`` and multiply q, k by the scale factor.

    The returned tensors keep the dump's dtype (the fitters and the float64 checks convert as they
    need), so every entry point fits exactly the tensors :func:`sketchlab.compare` fits.
    """
    q, k, source = load_dump(dump_or_qk)
    d = q.shape[-1]
    factor = resolve_scale(scale, d)
    layers = select_indices(layers, q.shape[0], "layer", source)
    heads = select_indices(heads, q.shape[1], "head", source)
    li, hi = torch.tensor(layers), torch.tensor(heads)
    q = q[li][:, hi] * factor  # [L', H', n, d]
    k = k[li][:, hi] * factor  # [L', H', n, d]
    return Selection(q=q, k=k, layers=layers, heads=heads, source=source, scale=scale_label(scale),
                     scale_factor=factor, scale_description=describe_scale(scale, d))
