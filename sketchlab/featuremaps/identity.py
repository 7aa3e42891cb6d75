r"""The identity map, :math:`\phi(x) = x`: :class:`IdentityMap` (``"identity"``).

DeltaNet's feature map (Schlag, Irie, Schmidhuber 2021; Yang et al. 2024, flash-linear-attention's
``DeltaNet`` with no query/key activation): the keys themselves, ``M = D`` features, no parameters.
With ``state="delta"`` the rule L2-normalises them (:func:`sketchlab.attention.ops.delta.beta.unit`), which
is DeltaNet's ``qk_norm="l2"``. The kernel ``qᵀk`` is signed (degree 1): in a normalised additive
attention the toy model and :func:`sketchlab.attention.linear_attention` self-tensor it by default
(``(qᵀk)² >= 0``); the delta rule has no denominator and takes it as it is.
"""

from __future__ import annotations

import torch

from .base import FeatureMap, _init_heads

__all__ = ["IdentityMap", "build_identity"]


class IdentityMap(FeatureMap):
    """``φ(x) = x`` for every head (no parameters)."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        _init_heads(self, heads, head_dim)

    @property
    def num_features(self) -> int:
        return self.head_dim

    @property
    def degree(self) -> int:
        return 1

    def _features(self, x):
        return x.clone()  # a new tensor, as every other map returns

    def _features_naive(self, x, head):
        n, D = x.shape
        out = torch.empty(n, D, dtype=torch.float64)
        for j in range(n):
            for i in range(D):
                out[j, i] = float(x[j, i])
        return out


def build_identity(heads, head_dim, **_):
    """The registry's build: ``p``, ``m``, ``rank``, ``seed``, ``dtype`` are ignored (``M = D``, nothing drawn)."""
    return IdentityMap(heads, head_dim)
