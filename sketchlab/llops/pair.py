r"""LLoPS Θ as the family's maps: :func:`llops_maps` (Θ → the pair of :class:`~sketchlab.featuremaps.LLoPSMap` s every
LLoPS fit returns) and :func:`llops_from_projector` (a projector → its CP → the maps)."""

from __future__ import annotations

from ..featuremaps.llops import LLoPSMap
from .cp import projector_to_theta
from .maps import _check_theta

__all__ = ["llops_from_projector", "llops_maps"]


def llops_maps(theta_q, theta_k=None):
    r"""The pair of :class:`~sketchlab.featuremaps.LLoPSMap` s of Θ: ``(map_q, map_k)``, one map when tied.

    Parameters
    ----------
    theta_q : Tensor ``[..., t, p, d, m]``
        Query-side factors; the leading axes (e.g. ``[L, H]``, or none) are the heads, flattened row-major
        (layer ``l``, head ``j`` of ``[L, H]`` is head ``l·H + j``; no leading axis: one head).
    theta_k : Tensor or None
        Key-side factors of the shape of ``theta_q``; ``None`` ties the key map to the query map.

    Returns
    -------
    (LLoPSMap, LLoPSMap)
        Θ copied as trained parameters ``[prod(...), t, p, d, m]`` in ``theta_q``'s dtype; the same object
        twice when tied. The kernel is :math:`\phi_Q(q)\cdot\phi_K(k) = \psi_p(q)^\top W_Q W_K^\top \psi_p(k)`
        (:func:`~sketchlab.llops.maps.llops_projector` of each ``map.theta``).
    """
    theta_q = _check_theta(theta_q, "theta_q")
    if theta_k is not None:
        theta_k = _check_theta(theta_k, "theta_k")
        if theta_k.shape != theta_q.shape:
            raise ValueError(f"theta_k must have the shape of theta_q {tuple(theta_q.shape)}, got {tuple(theta_k.shape)}")

    def one(theta):
        flat = theta.detach().reshape(-1, *theta.shape[-4:])  # [H, t, p, d, m]
        return LLoPSMap(flat.shape[0], flat.shape[-2], theta=flat)

    map_q = one(theta_q)
    return map_q, (map_q if theta_k is None else one(theta_k))


def llops_from_projector(w_q, w_k=None, rank: int = 1, *, p: int, seed: int = 0, n_iter_max: int = 200,
                         tol: float = 1e-10):
    r"""Rank-``rank`` LLoPS maps from projectors ``w[..., d**p, m]`` by a CP of each column tensor.

    Each column of ``w_q`` (and ``w_k``), reshaped to a ``d × … × d`` tensor, is decomposed by
    tensorly's ``parafac`` (:func:`projector_to_theta`). ``p`` is required: ``d**p`` alone does not determine
    ``d`` and ``p``.

    Returns
    -------
    (LLoPSMap, LLoPSMap)
        :func:`llops_maps` of the two Θ ``[..., rank, p, d, m]`` (heads: the leading
        axes of ``w``, flattened); ``w_k=None`` ties the key map to the query map (one object).
        ``llops_projector(map_q.theta) ≈ w_q`` (flattened heads).
    """
    theta_q = projector_to_theta(w_q, p, rank, seed=seed, n_iter_max=n_iter_max, tol=tol, name="w_q")
    theta_k = None
    if w_k is not None:
        theta_k = projector_to_theta(w_k, p, rank, seed=seed, n_iter_max=n_iter_max, tol=tol, name="w_k")
    return llops_maps(theta_q, theta_k)
