r"""PolySketchFormer's learned sketch, :func:`psf_learned_map` (``"psf-learned"``, self-tensored by the registry):
the two-layer MLP map :class:`~sketchlab.featuremaps.mlp.MLPMap` on per-head layer-normalised input
(:class:`~sketchlab.featuremaps.normed.InputNormed`)."""

from __future__ import annotations

import math

import torch

from .._validation import check_positive_int
from .mlp import MLPMap
from .normed import InputNormed

__all__ = ["psf_learned_map"]


def psf_learned_map(heads: int, head_dim: int, *, m: int = 8, hidden: int | None = None, degree: int = 1,
                    seed: int = 0, dtype: torch.dtype = torch.float32) -> InputNormed:
    r"""PolySketchFormer's learned sketch per head, ``LayerNorm(D) → Linear(D, hidden) → GELU → Linear(hidden, m)``:
    ``InputNormed(MLPMap(...))``, signed features (the registry's ``"psf-learned"`` wraps it in
    :class:`~sketchlab.featuremaps.SelfTensored` for PSF's non-negative degree-``2·degree`` form).

    .. math:: \phi(x) = \mathrm{GELU}(\mathrm{LN}_h(x) W_1 + b_1) W_2 + b_2

    Parameters
    ----------
    heads, head_dim : int
        ``H`` and ``D``.
    m : int
        Features per head.
    hidden : int or None
        The hidden width (default ``4·D``).
    degree : int
        The degree the sketch stands for before self-tensoring (PSF learns the degree-``p/2`` sketch): the
        :class:`MLPMap`'s ``p``; it only sets the hybrid's ``local="poly"`` degree.
    seed : int
        ``W_1, b_1, W_2, b_2`` drawn in that order from ``U(±1/√fan_in)`` (``nn.Linear``'s default range) on a CPU
        generator in float64, then cast to ``dtype``; the layer norm's affine starts at 1 and 0.

    Returns
    -------
    InputNormed
        Over an :class:`MLPMap` with ``w1 [H, D, hidden]``, ``b1 [H, hidden]``, ``w2 [H, hidden, m]``, ``b2 [H, m]``.
    """
    heads, head_dim, m = (check_positive_int(v, n) for v, n in ((heads, "heads"), (head_dim, "head_dim"), (m, "m")))
    hidden = check_positive_int(4 * head_dim if hidden is None else hidden, "hidden")
    gen = torch.Generator().manual_seed(seed)

    def uniform(*shape, fan_in):  # nn.Linear's default range, from our generator
        return ((torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(fan_in)).to(dtype)

    w1, b1 = uniform(heads, head_dim, hidden, fan_in=head_dim), uniform(heads, hidden, fan_in=head_dim)
    w2, b2 = uniform(heads, hidden, m, fan_in=hidden), uniform(heads, m, fan_in=hidden)
    return InputNormed(MLPMap(w1, b1, w2, b2, degree))
