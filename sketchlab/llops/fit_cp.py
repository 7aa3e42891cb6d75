r"""LLoPS from a CP of the columns of the Theorem 3.1 projector ``W*`` (``method="cp"``), and its gauge."""

from __future__ import annotations

import torch

from .._validation import check_pair
from ..featuremaps.base import FittedMaps
from ..featuremaps.heads import batch_features
from ..optimal import optimal_sketch
from ._fitting import prepare
from .cp import projector_to_theta
from .maps import llops_features
from .pair import llops_maps
from .svd_init import _init_svd

__all__ = ["GAUGES", "aligned_gauge", "fit_llops_cp"]

GAUGES = ("balanced", "aligned")


def aligned_gauge(q, k, opt, *, seed: int = 0) -> torch.Tensor:
    r"""The ``m × m`` map ``G`` of the ``"aligned"`` gauge for the optimum ``opt`` of ``(q, k)``
    (:func:`sketchlab.optimal_sketch`'s :class:`~sketchlab.optimal.Optimum`).

    ``G = argmin ‖ψ_p(Q) W*_Q G − Φ_ref‖_F`` (least squares), with ``Φ_ref`` the query features of the
    ``"svd"`` initialisation (rank-1 columns by construction). ``W*_Q G`` and ``W*_K G^{-ᵀ}`` have
    the kernel of ``W*``; their columns are much closer to rank 1 than the balanced split's.
    ``q[..., n_q, d]``, ``k[..., n_k, d]``; returns float64 ``[..., m, m]``.
    """
    q, k = check_pair(q, k)
    batch = q.shape[:-2]
    q64 = q.to(torch.float64).reshape(-1, *q.shape[-2:])  # [B, n_q, d]
    k64 = k.to(torch.float64).reshape(-1, *k.shape[-2:])  # [B, n_k, d]
    map_q = opt.map_q
    p, m = map_q.degree, map_q.num_features
    ref_q, _ = _init_svd(q64, k64, p, m, torch.Generator().manual_seed(seed))
    target = llops_features(q64, ref_q)  # [B, n_q, m]
    current = batch_features(map_q, q64).detach()  # [B, n_q, m]: head b's map on problem b
    return torch.linalg.lstsq(current, target).solution.reshape(*batch, m, m)


def fit_llops_cp(
    q,
    k,
    *,
    p: int,
    m: int,
    rank: int = 1,
    gauge: str = "balanced",
    seed: int = 0,
    n_iter_max: int = 200,
    tol: float = 1e-10,
    route: str = "auto",
) -> FittedMaps:
    r"""LLoPS from a CP of every column tensor of the Theorem 3.1 optimal projector ``W*``.

    Parameters
    ----------
    q, k : Tensor ``[..., n, d]``
    p, m, rank : int
    gauge : {"balanced", "aligned"}
        ``W*`` is only defined up to an invertible ``G`` (``W*_Q G``, ``W*_K G^{-ᵀ}``).
        ``"balanced"``: the split :math:`\Sigma_m^{1/2}` on both sides that
        :func:`sketchlab.optimal_sketch` returns; its columns are generally far from rank 1 and
        the CP is poor. ``"aligned"``: ``G`` is the least-squares map taking the optimal query
        features :math:`\psi_p(Q)W^*_Q` to those of the ``"svd"`` initialisation of
        :func:`llops_init` (rank-1 columns by construction), so the columns of
        :math:`W^*_Q G` are close to rank 1; the kernel of ``W*`` is unchanged by ``G``.
    seed, n_iter_max, tol
        Passed to ``parafac`` (see :func:`projector_to_theta`).
    route : passed to :func:`sketchlab.optimal_sketch`.

    Returns
    -------
    FittedMaps
        The untied pair ``(map_q, map_k)`` of :class:`~sketchlab.featuremaps.LLoPSMap`
        (:func:`~sketchlab.llops.llops_maps`: the leading axes of ``q`` flattened into heads), with
        ``info = {"steps": 1, "converged": True, "gauge": gauge}``.

    Notes
    -----
    Cost: the optimal sketch (an SVD of ``A`` or of the QR core) and ``m`` parafac runs per head
    on ``d**p``-entry tensors, so this is for small ``d**p``. By Theorem 3.4 (as stated in
    DESIGN.md — the paper's appendix is unavailable to us) the projector error of a rank-1
    CP is at least :math:`\sum_i (\|W_i\|_F^2 - \|W_i\|_\sigma^2)`; measure it with
    :func:`sketchlab.spectral.rank1_residuals`.
    """
    q, k, p, m, rank, out_dtype, batch, q64, k64 = prepare(q, k, p, m, rank)
    if gauge not in GAUGES:
        raise ValueError(f"gauge must be one of {GAUGES}, got {gauge!r}")
    opt = optimal_sketch(q64, k64, p, m, route=route)
    w_q, w_k = opt.map_q.projector(), opt.map_k.projector()  # [B, d^p, m] full basis
    if gauge == "aligned":
        gmap = aligned_gauge(q64, k64, opt, seed=seed)  # [B, m, m]
        w_q = w_q @ gmap
        w_k = torch.linalg.solve(gmap, w_k.mT).mT  # W_K G^{-ᵀ}
    theta_q = projector_to_theta(w_q, p, rank, seed=seed, n_iter_max=n_iter_max, tol=tol, name="W*_Q")
    theta_k = projector_to_theta(w_k, p, rank, seed=seed, n_iter_max=n_iter_max, tol=tol, name="W*_K")
    d = q.shape[-1]
    map_q, map_k = llops_maps(theta_q.reshape(*batch, rank, p, d, m).to(out_dtype),
                              theta_k.reshape(*batch, rank, p, d, m).to(out_dtype))
    return FittedMaps(map_q, map_k, {"steps": 1, "converged": True, "gauge": gauge})
