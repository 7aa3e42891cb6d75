r"""The exact degree-``p`` features :math:`\psi_p`: :class:`ExactPolyMap` (``"exact-poly"``)."""

from __future__ import annotations

from .._validation import check_degree
from .base import FeatureMap, _init_heads

__all__ = ["ExactPolyMap"]

class ExactPolyMap(FeatureMap):
    r"""The exact degree-``p`` features :math:`\psi_p(x)` of :func:`sketchlab.poly_features` (the
    same for every head): ``D^p`` coordinates, or ``C(D+p−1, p)`` with ``symmetric`` — for small ``D``."""

    def __init__(self, heads: int, head_dim: int, *, p: int = 2, symmetric: bool = True):
        super().__init__()
        _init_heads(self, heads, head_dim)
        self.p = check_degree(p)
        if not isinstance(symmetric, bool):
            raise TypeError(f"symmetric must be a bool, got {symmetric!r}")
        self.symmetric = symmetric

    @property
    def num_features(self) -> int:
        from ..polynomial import num_poly_features

        return num_poly_features(self.head_dim, self.p, self.symmetric)

    @property
    def degree(self) -> int:
        return self.p

    @property
    def non_negative(self) -> bool:
        return self.p % 2 == 0  # features are signed; the kernel (qᵀk)^p is >= 0 for even p

    def _features(self, x):
        from ..polynomial import poly_features

        return poly_features(x, self.p, self.symmetric)

    def _features_naive(self, x, head):
        from ..polynomial import poly_features_naive

        return poly_features_naive(x, self.p, self.symmetric)
