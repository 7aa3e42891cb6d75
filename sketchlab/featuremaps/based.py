r"""BASED's maps on a per-head projection: :class:`TaylorMap` (``"based-taylor"``) and :class:`ExpandMap` (``"based-expand"``)."""

from __future__ import annotations

import torch

from .._validation import as_float_tensor, check_positive_int
from .base import FeatureMap, _init_heads, _store

__all__ = ["ExpandMap", "TaylorMap"]


def _init_proj(m: FeatureMap, dim, proj, symmetric: bool, learn: bool, dtype) -> None:
    """Check and store ``m.proj [H, D, d']`` (default: the first ``dim`` coordinates, ``[I; 0]``) and ``m.symmetric``."""
    if proj is None:
        dim = check_positive_int(min(16, m.head_dim) if dim is None else dim, "dim")
        if dim > m.head_dim:
            raise ValueError(f"dim (BASED's d') must be <= head_dim={m.head_dim}, got {dim}")
        proj = torch.eye(m.head_dim, dim, dtype=dtype).expand(m.heads, -1, -1)
    proj = as_float_tensor(proj, "proj").detach().clone()
    if proj.ndim != 3 or proj.shape[:2] != (m.heads, m.head_dim):
        raise ValueError(f"proj must have shape [H={m.heads}, D={m.head_dim}, d'], got {tuple(proj.shape)}")
    m.symmetric = symmetric
    _store(m, "proj", proj, learn)


class TaylorMap(FeatureMap):
    r"""BASED's Taylor map on ``d'`` projected coordinates :math:`u = xP_h`:
    :math:`[1, u/d'^{1/4}, u\otimes u/(\sqrt2\sqrt{d'})]`, kernel :math:`1 + s + s^2/2 > 0`
    with :math:`s = u_q^\top u_k/\sqrt{d'}` (:func:`sketchlab.sketches.based.taylor_features`).

    ``proj [H, D, d']`` defaults to the first ``dim`` coordinates (``[I; 0]``); ``learn=True``
    trains it (BASED's feature-dimension projection).
    """

    def __init__(self, heads: int, head_dim: int, *, dim: int | None = None, proj=None, symmetric: bool = False,
                 learn: bool = False, dtype=torch.float32):
        super().__init__()
        _init_heads(self, heads, head_dim)
        _init_proj(self, dim, proj, symmetric, learn, dtype)

    @property
    def num_features(self) -> int:
        from ..sketches.based import based_num_features

        return based_num_features(self.proj.shape[-1], 2, "taylor", self.symmetric)

    @property
    def degree(self) -> int:
        return 2

    @property
    def non_negative(self) -> bool:
        return True  # the kernel 1 + s + s²/2 = ((1 + s)² + 1)/2 > 0 (features signed, every product positive)

    def _features(self, x):
        from ..sketches.based import taylor_features

        return taylor_features(x.transpose(1, 2), self.proj, self.symmetric).transpose(1, 2)  # [B, T, H, M]

    def _features_naive(self, x, head):
        from ..sketches.based import taylor_features_naive

        return taylor_features_naive(x, self.proj[head].detach(), self.symmetric)


class ExpandMap(FeatureMap):
    r"""BASED's project-then-expand map :math:`\psi_p(xP_h)` (homogeneous, degree ``p``; kernel
    :math:`(q^\top P_hP_h^\top k)^p`, :func:`sketchlab.sketches.based.expand_features`): ``d'^p``
    features, or ``C(d'+p−1, p)`` with ``symmetric``. ``proj [H, D, d']`` defaults to the first
    ``dim`` coordinates; ``learn=True`` trains it."""

    def __init__(self, heads: int, head_dim: int, *, p: int = 2, dim: int | None = None, proj=None,
                 symmetric: bool = True, learn: bool = False, dtype=torch.float32):
        super().__init__()
        _init_heads(self, heads, head_dim)
        self.p = check_positive_int(p, "p")
        _init_proj(self, dim, proj, symmetric, learn, dtype)

    @property
    def num_features(self) -> int:
        from ..sketches.based import based_num_features

        return based_num_features(self.proj.shape[-1], self.p, "expand", self.symmetric)

    @property
    def degree(self) -> int:
        return self.p

    @property
    def non_negative(self) -> bool:
        return self.p % 2 == 0  # (qᵀPPᵀk)^p >= 0 for even p (the features are signed)

    def _features(self, x):
        from ..sketches.based import expand_features

        return expand_features(x.transpose(1, 2), self.proj, self.p, self.symmetric).transpose(1, 2)  # [B, T, H, M]

    def _features_naive(self, x, head):
        from ..sketches.based import expand_features_naive

        return expand_features_naive(x, self.proj[head].detach(), self.p, self.symmetric)
