r"""The tied (element-wise) LLoPS map: :class:`TiedLLoPSMap` (``"elementwise"``), each feature
:math:`\sum_r \langle\theta_{r,:,i}, x\rangle^p \ge 0` for even ``p`` — the fitted element-wise sketch's map
(``sketchlab.sketches.elementwise``, rank 1) and conversion's non-negative LLoPS (``sketchlab.convert.scale``)."""

from __future__ import annotations

import torch

from .._validation import check_positive_int
from .base import FeatureMap, _checked_theta, _init_heads, _store

__all__ = ["TiedLLoPSMap"]


class TiedLLoPSMap(FeatureMap):
    r"""Tied even-degree LLoPS map per head, :math:`\phi(x)_i = \sum_r \langle\theta_{r,:,i}, x\rangle^p \ge 0`.

    Parameters
    ----------
    heads, head_dim : int
    theta : Tensor ``[H, t, D, M]``
        One factor per rank term and feature (e.g. :func:`tie_theta` of a fitted Θ).
    p : int
        Even degree (default 2).
    learn : bool
        Θ as a parameter (trained, and tied by construction) or a buffer.

    Notes
    -----
    Every feature is ``>= 0`` for every input, so a kernel of two such maps is ``>= 0`` and the
    hybrid's far denominators are never negative (:attr:`non_negative`).
    """

    def __init__(self, heads: int, head_dim: int, theta, *, p: int = 2, learn: bool = True):
        super().__init__()
        _init_heads(self, heads, head_dim)
        p = check_positive_int(p, "p")
        if p % 2:
            raise ValueError(f"TiedLLoPSMap needs an even degree p (features <x, θ>^p >= 0), got p={p}")
        self.p = p
        theta = _checked_theta(self, theta, ("H", "t", "D", "M"))
        _store(self, "theta", theta, learn)

    @property
    def num_features(self) -> int:
        return self.theta.shape[-1]

    @property
    def degree(self) -> int:
        return self.p

    @property
    def non_negative(self) -> bool:
        return True

    def _features(self, x):
        dtype = torch.promote_types(x.dtype, self.theta.dtype)
        proj = torch.einsum("bthd,hrdm->bthrm", x.to(dtype), self.theta.to(dtype))  # [B, T, H, t, M]
        return (proj**self.p).sum(-2)  # [B, T, H, M]

    def _features_naive(self, x, head):
        th = self.theta[head].detach().double()  # [t, D, M]
        n, M = x.shape[0], th.shape[-1]
        out = torch.zeros(n, M, dtype=torch.float64)
        for j in range(n):
            for i in range(M):
                out[j, i] = sum(float(x[j] @ th[r, :, i]) ** self.p for r in range(th.shape[0]))
        return out
