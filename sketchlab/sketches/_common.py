"""Helpers shared by the baseline sketches: randomness, batch shapes, option checks."""

from __future__ import annotations

import numbers

import torch

__all__ = ["check_batch_shape", "check_dtype", "make_generator"]


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
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {seed!r}")
    return torch.Generator().manual_seed(int(seed))


def check_batch_shape(batch_shape) -> tuple[int, ...]:
    """Validate a batch shape (a tuple of non-negative ints, e.g. ``(L, H)``)."""
    try:
        shape = tuple(batch_shape)
    except TypeError:
        raise TypeError(f"batch_shape must be a tuple of ints, got {batch_shape!r}") from None
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1:
            raise ValueError(f"batch_shape must contain integers >= 1, got {batch_shape!r}")
    return tuple(int(s) for s in shape)


def check_dtype(dtype) -> torch.dtype:
    """Validate a real floating dtype for stored random matrices."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a real floating torch.dtype, got {dtype!r}")
    return dtype
