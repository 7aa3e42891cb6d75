r"""The self-tensored form of any map: :class:`SelfTensored` (PolySketchFormer's non-negativity)."""

from __future__ import annotations

import torch

from ..polynomial import self_tensor
from .base import FeatureMap

__all__ = ["SelfTensored"]

class SelfTensored(FeatureMap):
    r"""The self-tensored form :math:`\phi\otimes\phi` of any map: ``M²`` features, kernel
    :math:`(\phi(q)\cdot\phi(k))^2 \ge 0` of degree ``2·degree`` (PolySketchFormer's non-negativity)."""

    def __init__(self, inner: FeatureMap):
        super().__init__()
        if not isinstance(inner, FeatureMap):
            raise TypeError(f"SelfTensored wraps a FeatureMap, got {type(inner).__name__}")
        self.inner = inner
        self.heads, self.head_dim = inner.heads, inner.head_dim

    @property
    def per_head_parameters(self) -> bool:
        """The inner map's: this map adds no parameters of its own."""
        return self.inner.per_head_parameters

    @property
    def num_features(self) -> int:
        return self.inner.num_features ** 2

    @property
    def degree(self) -> int | None:
        return None if self.inner.degree is None else 2 * self.inner.degree

    @property
    def non_negative(self) -> bool:
        return True

    def _features(self, x):
        return self_tensor(self.inner._features(x))  # [B, T, H, M] -> [B, T, H, M²]

    def _features_naive(self, x, head):
        f = self.inner._features_naive(x, head)  # [n, M]
        n, M = f.shape
        out = torch.empty(n, M * M, dtype=torch.float64)
        for a in range(M):
            for b in range(M):
                out[:, a * M + b] = f[:, a] * f[:, b]
        return out
