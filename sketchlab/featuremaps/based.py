r"""BASED's feature maps on a per-head projection ``P : R^d → R^{d'}`` (Arora et al. 2024): :class:`TaylorMap`
(``"based-taylor"``) and :class:`ExpandMap` (``"based-expand"``), their pure functions and their fitter.

Two forms, both applied to :math:`u = xP` (``P`` of shape ``[d, d']``):

``"taylor"``
    BASED's second-order Taylor map :math:`[1,\; u/d'^{1/4},\; u\otimes u/(\sqrt2\sqrt{d'})]`,
    kernel :math:`1 + s + s^2/2` with :math:`s = u_q^\top u_k/\sqrt{d'}` (``d' = 16`` → 273 features
    in the full form, 153 in the symmetric form). It is inhomogeneous (degree 0, 1 and 2 terms), so
    it is not a degree-``p`` polynomial sketch; it is provided for reference, with ``degree = 2``.
``"expand"``
    its homogeneous degree-``p`` part, "project-then-expand": :math:`\phi(x) = \psi_p(xP)`, kernel
    :math:`(q^\top P P^\top k)^p`; full (``d'^p`` features) or symmetric
    (``C(d'+p−1, p)`` features, the same kernel, see :func:`sketchlab.poly_features`).

How ``P`` is obtained when fitted on data (``fit_sketch("based-expand" / "based-taylor", ...)``, a map with
the fitted ``P`` as a fixed buffer ``[H, d, d']``): in a BASED model ``P`` is
the learned query/key projection to the feature dimension, so the natural data-driven stand-in is
``projection="pca"`` (default): the top-``d'`` right singular vectors of the stacked, *uncentred*
token matrix ``[Q; K]`` of each head, i.e. the ``d'``-dimensional subspace that keeps the most
energy of the queries and keys (orthonormal columns, so the kernel is
:math:`(q^\top \Pi k)^p` with ``Π`` the orthogonal projector onto it). ``projection="random"`` draws
``P`` with i.i.d. N(0, 1/d') entries from ``seed`` (a Johnson–Lindenstrauss projection,
:math:`E[PP^\top] = I`). ``P`` is not learned by gradient descent.

Choice of ``d'`` for a budget ``m`` (``dim=None``): the largest ``d' <= d`` whose feature count
does not exceed ``m``; e.g. ``m = 64``, ``d = 32``: expand-symmetric ``p=2`` → ``d'=10`` (55
features), ``p=3`` → ``d'=6`` (56); expand-full ``p=2`` → ``d'=8`` (64). ``num_features`` always
reports the count actually used. The symmetric form is the fitter's default for ``"expand"`` (more
directions for the same budget, identical kernel); the full form is the default for ``"taylor"``
(BASED's own layout).

References
----------
Arora et al. *Simple linear attention language models balance the recall-throughput tradeoff*, ICML 2024.
"""

from __future__ import annotations

import math

import torch

from .._validation import as_float_tensor, check_positive_int
from ..polynomial import num_poly_features, poly_features, poly_features_naive
from ._common import make_generator
from .base import FeatureMap, FittedMaps, _init_heads, _store

__all__ = ["ExpandMap", "TaylorMap", "based_dim_for_budget", "based_num_features", "expand_features",
           "expand_features_naive", "pca_projection", "taylor_features", "taylor_features_naive"]

_FORMS = ("expand", "taylor")


def based_num_features(dim: int, p: int, form: str = "expand", symmetric: bool = False) -> int:
    """Feature count of a BASED map on a ``dim``-dimensional projection."""
    dim = check_positive_int(dim, "dim (the projected dimension d')")
    if form == "expand":
        return num_poly_features(dim, p, symmetric)
    if form == "taylor":
        return 1 + dim + num_poly_features(dim, 2, symmetric)
    raise ValueError(f"form must be one of {_FORMS}, got {form!r}")


def based_dim_for_budget(d: int, p: int, m: int, form: str = "expand", symmetric: bool = False) -> int:
    """Largest ``d' <= d`` with ``based_num_features(d', p, form, symmetric) <= m``."""
    d = check_positive_int(d, "d")
    m = check_positive_int(m, "m (the sketch size)")
    best = 0
    for dim in range(1, d + 1):
        if based_num_features(dim, p, form, symmetric) <= m:
            best = dim
    if best == 0:
        raise ValueError(
            f"m={m} is below the smallest BASED {form} map (d'=1 has "
            f"{based_num_features(1, p, form, symmetric)} features)"
        )
    return best


def taylor_features(x: torch.Tensor, proj: torch.Tensor, symmetric: bool = False) -> torch.Tensor:
    r"""BASED Taylor features :math:`[1, u/d'^{1/4}, u\otimes u/(\sqrt2\sqrt{d'})]`, :math:`u = xP`.

    Parameters
    ----------
    x : Tensor ``[..., n, d]``
    proj : Tensor ``[..., d, d']``
    symmetric : bool
        Use the ``C(d'+1, 2)`` symmetric coordinates of ``u ⊗ u`` (same kernel).

    Returns
    -------
    Tensor ``[..., n, 1 + d' + d'^2]`` (or ``1 + d' + C(d'+1, 2)``); kernel :math:`1 + s + s^2/2`,
    :math:`s = u_q^\top u_k / \sqrt{d'}`.
    """
    u = x.to(proj.dtype) @ proj  # [..., n, d']
    dim = u.shape[-1]
    ones = torch.ones(*u.shape[:-1], 1, dtype=u.dtype, device=u.device)  # [..., n, 1]
    second = poly_features(u, 2, symmetric) / (math.sqrt(2.0) * math.sqrt(dim))  # [..., n, d'^2]
    return torch.cat([ones, u / dim**0.25, second], dim=-1)


def taylor_features_naive(x, proj, symmetric: bool = False) -> torch.Tensor:
    """Float64 twin of :func:`taylor_features` for ``x[n, d]``, ``proj[d, d']``."""
    x = as_float_tensor(x, "x").to(torch.float64)
    proj = as_float_tensor(proj, "proj").to(torch.float64)
    if x.ndim != 2:
        raise ValueError(f"taylor_features_naive takes x[n, d], got shape {tuple(x.shape)}")
    if proj.ndim != 2 or proj.shape[0] != x.shape[1]:
        raise ValueError(
            f"taylor_features_naive takes proj[d, d'] with d = x.shape[1] = {x.shape[1]}, got shape {tuple(proj.shape)}"
        )
    n, dim = x.shape[0], proj.shape[1]
    u = torch.zeros(n, dim, dtype=torch.float64)
    for a in range(dim):
        for i in range(x.shape[1]):
            u[:, a] += x[:, i] * proj[i, a]
    second = poly_features_naive(u, 2, symmetric) / (math.sqrt(2.0) * math.sqrt(dim))
    return torch.cat([torch.ones(n, 1, dtype=torch.float64), u / dim**0.25, second], dim=1)


def expand_features(x: torch.Tensor, proj: torch.Tensor, p: int, symmetric: bool = False) -> torch.Tensor:
    r"""Project-then-expand features :math:`\psi_p(xP)`: ``x[..., n, d]``, ``proj[..., d, d']`` →
    ``[..., n, d'^p]`` (or ``C(d'+p−1, p)`` when ``symmetric``); kernel :math:`(q^\top PP^\top k)^p`."""
    return poly_features(x.to(proj.dtype) @ proj, p, symmetric)


def expand_features_naive(x, proj, p: int, symmetric: bool = False) -> torch.Tensor:
    """Float64 twin of :func:`expand_features` for ``x[n, d]``, ``proj[d, d']``: explicit projection sums, then ψ_p."""
    x = as_float_tensor(x, "x").to(torch.float64)
    proj = as_float_tensor(proj, "proj").to(torch.float64)
    if x.ndim != 2 or proj.ndim != 2 or proj.shape[0] != x.shape[1]:
        raise ValueError(f"expand_features_naive takes x[n, d] and proj[d, d'], got {tuple(x.shape)}, {tuple(proj.shape)}")
    u = torch.zeros(x.shape[0], proj.shape[1], dtype=torch.float64)
    for a in range(proj.shape[1]):
        for i in range(x.shape[1]):
            u[:, a] += x[:, i] * proj[i, a]
    return poly_features_naive(u, p, symmetric)


def pca_projection(q: torch.Tensor, k: torch.Tensor, dim: int) -> torch.Tensor:
    """Top-``dim`` right singular vectors of the uncentred ``[q; k]`` per head: ``[..., d, dim]``.

    ``dim`` must be an integer with ``1 <= dim <= min(n_q + n_k, d)``.
    """
    dim = check_positive_int(dim, "dim (the projected dimension d')")
    d = q.shape[-1]
    if dim > d:
        raise ValueError(f"dim (the projected dimension d') must be <= d = {d}, got {dim}")
    x = torch.cat([q, k], dim=-2).to(torch.float64)  # [..., n_q + n_k, d]
    _, _, vh = torch.linalg.svd(x, full_matrices=False)  # vh [..., min(n, d), d]
    if dim > vh.shape[-2]:
        raise ValueError(f"dim={dim} exceeds the rank bound min(n_q + n_k, d) = {vh.shape[-2]} of the PCA projection")
    return vh[..., :dim, :].mT.to(q.dtype)  # [..., d, dim]


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
    with :math:`s = u_q^\top u_k/\sqrt{d'}` (:func:`taylor_features`).

    ``proj [H, D, d']`` defaults to the first ``dim`` coordinates (``[I; 0]``); ``learn=True``
    trains it (BASED's feature-dimension projection).
    """

    def __init__(self, heads: int, head_dim: int, *, dim: int | None = None, proj=None, symmetric: bool = False,
                 learn: bool = False, dtype=torch.float32):
        super().__init__()
        _init_heads(self, heads, head_dim)
        _init_proj(self, dim, proj, symmetric, learn, dtype)

    @property
    def dim(self) -> int:
        """The projected dimension ``d'``."""
        return self.proj.shape[-1]

    @property
    def num_features(self) -> int:
        return based_num_features(self.proj.shape[-1], 2, "taylor", self.symmetric)

    @property
    def degree(self) -> int:
        return 2

    @property
    def non_negative(self) -> bool:
        return True  # the kernel 1 + s + s²/2 = ((1 + s)² + 1)/2 > 0 (features signed, every product positive)

    def _features(self, x):
        return taylor_features(x.transpose(1, 2), self.proj, self.symmetric).transpose(1, 2)  # [B, T, H, M]

    def _features_naive(self, x, head):
        return taylor_features_naive(x, self.proj[head].detach(), self.symmetric)


class ExpandMap(FeatureMap):
    r"""BASED's project-then-expand map :math:`\psi_p(xP_h)` (homogeneous, degree ``p``; kernel
    :math:`(q^\top P_hP_h^\top k)^p`, :func:`expand_features`): ``d'^p``
    features, or ``C(d'+p−1, p)`` with ``symmetric``. ``proj [H, D, d']`` defaults to the first
    ``dim`` coordinates; ``learn=True`` trains it."""

    def __init__(self, heads: int, head_dim: int, *, p: int = 2, dim: int | None = None, proj=None,
                 symmetric: bool = True, learn: bool = False, dtype=torch.float32):
        super().__init__()
        _init_heads(self, heads, head_dim)
        self.p = check_positive_int(p, "p")
        _init_proj(self, dim, proj, symmetric, learn, dtype)

    @property
    def dim(self) -> int:
        """The projected dimension ``d'``."""
        return self.proj.shape[-1]

    @property
    def num_features(self) -> int:
        return based_num_features(self.proj.shape[-1], self.p, "expand", self.symmetric)

    @property
    def degree(self) -> int:
        return self.p

    @property
    def non_negative(self) -> bool:
        return self.p % 2 == 0  # (qᵀPPᵀk)^p >= 0 for even p (the features are signed)

    def _features(self, x):
        return expand_features(x.transpose(1, 2), self.proj, self.p, self.symmetric).transpose(1, 2)  # [B, T, H, M]

    def _features_naive(self, x, head):
        return expand_features_naive(x, self.proj[head].detach(), self.p, self.symmetric)


def _fit_based(q, k, *, p: int, m: int, seed: int = 0, form: str = "expand", projection: str = "pca",
               dim: int | None = None, symmetric: bool | None = None) -> FittedMaps:
    """``fit_sketch("based", ...)``: ``P`` from ``projection`` ("pca" or "random"), ``d'`` from ``dim``
    or the budget rule (see the module docstring); ``symmetric=None`` → True for "expand", False for "taylor"."""
    if form not in _FORMS:
        raise ValueError(f"form must be one of {_FORMS}, got {form!r}")
    if form == "taylor" and p != 2:
        raise ValueError(f"the BASED Taylor map is a degree-2 expansion (1 + s + s²/2); p must be 2, got p={p}")
    if symmetric is None:
        symmetric = form == "expand"
    d = q.shape[-1]
    dim = based_dim_for_budget(d, p, m, form, symmetric) if dim is None else check_positive_int(dim, "dim")
    if projection == "pca":
        proj = pca_projection(q, k, dim)
    elif projection == "random":
        gen = make_generator(seed)
        # Draw on the CPU generator (same seed → same P on every device), then move to q's device.
        proj = torch.randn(*q.shape[:-2], d, dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)
        proj = proj.to(device=q.device, dtype=q.dtype)
    else:
        raise ValueError(f"projection must be 'pca' or 'random', got {projection!r}")
    heads = math.prod(q.shape[:-2])
    proj = proj.reshape(heads, d, dim)  # [H, d, d'], one map for both sides
    fmap = (TaylorMap(heads, d, proj=proj, symmetric=symmetric) if form == "taylor"
            else ExpandMap(heads, d, p=p, proj=proj, symmetric=symmetric))
    return FittedMaps(fmap, fmap, {"steps": 0, "converged": True, "dim": dim, "form": form, "projection": projection})


def _fit_based_expand(q, k, *, p: int, m: int, seed: int = 0, projection: str = "pca", dim: int | None = None,
                      symmetric: bool | None = None) -> FittedMaps:
    """``fit_sketch("based-expand", ...)``: :func:`_fit_based` with ``form="expand"``."""
    return _fit_based(q, k, p=p, m=m, seed=seed, form="expand", projection=projection, dim=dim, symmetric=symmetric)


def _fit_based_taylor(q, k, *, p: int, m: int, seed: int = 0, projection: str = "pca", dim: int | None = None,
                      symmetric: bool | None = None) -> FittedMaps:
    """``fit_sketch("based-taylor", ...)``: :func:`_fit_based` with ``form="taylor"`` (``p`` must be 2)."""
    if p != 2:
        raise ValueError(f"the BASED Taylor map is a degree-2 expansion (1 + s + s²/2); p must be 2, got p={p}")
    return _fit_based(q, k, p=p, m=m, seed=seed, form="taylor", projection=projection, dim=dim, symmetric=symmetric)
