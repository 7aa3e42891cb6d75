r"""DPFP, the deterministic parameter-free projection (Schlag, Irie, Schmidhuber 2021): :class:`DPFPMap` (``"dpfp"``).

With :math:`r(x) = [\mathrm{relu}(x), \mathrm{relu}(-x)] \in \mathbb R^{2D}` (non-negative, at most
``D`` of its coordinates non-zero), feature ``(ν, i)`` for ``ν = 1..n`` and ``i = 0..2D−1`` is

.. math:: \phi_{(\nu - 1)\,2D + i}(x) = r_i(x)\, r_{(i + \nu) \bmod 2D}(x),

``M = 2D·n`` features, all ``>= 0`` (so every kernel value is, and ``normalize="sum"`` is safe), no
parameters, and :math:`\phi(cx) = c^2\phi(x)` for ``c > 0``: positively homogeneous of degree 2 (its
``degree``; piecewise a quadratic form, not one polynomial). ``n`` (``nu``) defaults to
``max(1, ⌊m / 2D⌋)``, the largest with at most ``m`` features (at least one block).

References
----------
Schlag, Irie, Schmidhuber. *Linear Transformers Are Secretly Fast Weight Programmers*, ICML 2021, §5.3.
"""

from __future__ import annotations

import torch

from .._validation import check_positive_int
from .base import FeatureMap, _init_heads

__all__ = ["DPFPMap", "build_dpfp"]


class DPFPMap(FeatureMap):
    """DPFP of order ``nu`` (the same map for every head, no parameters)."""

    def __init__(self, heads: int, head_dim: int, *, nu: int = 1):
        super().__init__()
        _init_heads(self, heads, head_dim)
        self.nu = check_positive_int(nu, "nu")

    @property
    def num_features(self) -> int:
        return 2 * self.head_dim * self.nu

    @property
    def degree(self) -> int:
        return 2

    @property
    def non_negative(self) -> bool:
        return True

    def _features(self, x):
        r = torch.cat([x.relu(), (-x).relu()], -1)  # [B, T, H, 2D]
        # roll by -ν: position i of the rolled copy holds r_{(i + ν) mod 2D}
        rolled = torch.cat([r.roll(-nu, -1) for nu in range(1, self.nu + 1)], -1)  # [B, T, H, 2D·n]
        return r.repeat(1, 1, 1, self.nu) * rolled  # [B, T, H, 2D·n]

    def _features_naive(self, x, head):
        n, D = x.shape
        r = torch.zeros(n, 2 * D, dtype=torch.float64)
        for a in range(D):
            r[:, a] = torch.clamp(x[:, a], min=0.0)
            r[:, D + a] = torch.clamp(-x[:, a], min=0.0)
        out = torch.empty(n, 2 * D * self.nu, dtype=torch.float64)
        for nu in range(1, self.nu + 1):
            for i in range(2 * D):
                out[:, (nu - 1) * 2 * D + i] = r[:, i] * r[:, (i + nu) % (2 * D)]
        return out


def build_dpfp(heads, head_dim, *, m, nu, **_):
    """The registry's build: ``nu`` given, or the largest order with at most ``m`` features (at least 1)."""
    return DPFPMap(heads, head_dim, nu=max(1, m // (2 * head_dim)) if nu is None else nu)
