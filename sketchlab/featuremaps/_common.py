"""Helpers shared by the random and fitted maps of the family: randomness, option checks, overflow messages."""

from __future__ import annotations

import math

import torch

from .._validation import check_seed

__all__ = ["check_dtype", "check_features_finite", "make_generator"]


def make_generator(seed=None, generator: torch.Generator | None = None) -> torch.Generator:
    """Return ``generator`` or a CPU generator seeded with ``seed`` (exactly one must be given).

    Random sketches draw all their randomness once, at construction, from this generator; the same
    seed always gives the same sketch.
    """
    if generator is not None:
        if seed is not None:
            raise ValueError("give either seed or generator, not both")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        return generator
    if seed is None:
        raise ValueError("a random sketch needs an explicit seed (int) or generator (torch.Generator)")
    return torch.Generator().manual_seed(check_seed(seed))


def check_dtype(dtype) -> torch.dtype:
    """Validate a real floating dtype for stored random matrices."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a real floating torch.dtype, got {dtype!r}")
    return dtype


def check_features_finite(out: torch.Tensor, x: torch.Tensor, p: int, what: str) -> torch.Tensor:
    """Return ``out`` (the features of the finite input ``x``) or raise ``FloatingPointError``.

    A degree-``p`` sketch multiplies ``p`` projections of ``x``, so its features grow like
    ``‖x‖^p``: a non-finite feature of a finite input is an overflow of ``out.dtype``. The message
    names the sketch (``what``), ``p``, the dtype, the largest row norm ``‖x‖`` with the size of its
    ``p``-th power, and the way out (scale the inputs down, lower ``p``, or use float64).
    """
    if out.is_meta:
        return out  # shapes only, no values
    bad = ~torch.isfinite(out)
    if not bool(bad.any()):
        return out
    top = float(torch.linalg.vector_norm(x.detach().to(torch.float64), dim=-1).max())
    log10 = p * math.log10(top) if top > 0 else -math.inf
    raise FloatingPointError(
        f"{what} features of degree p={p} overflow {out.dtype}: {int(bad.sum())} of {out.numel()} values are "
        f"non-finite (the largest input row norm is ‖x‖ = {top:.4g}, and the features grow like ‖x‖^p ≈ "
        f"1e{log10:.0f}); the inputs are too large for this degree: scale q and k down (e.g. scale='sqrt-d' "
        "or a smaller factor), lower p, or use float64"
    )
