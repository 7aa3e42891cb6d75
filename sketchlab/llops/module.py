r"""The LLoPS sketch class :class:`LLoPS` (``nn.Module`` and :class:`~sketchlab.sketch.Sketch`), left only for
:func:`sketchlab.sketches.as_llops`'s results until it returns :class:`~sketchlab.featuremaps.LLoPSMap` pairs (then this
module goes): every LLoPS fit returns the pair of maps (:func:`sketchlab.llops.pair.llops_maps`)."""

from __future__ import annotations

import torch
from torch import nn

from ..sketch import Sketch
from .cp import projector_to_theta
from .maps import _check_theta, llops_features, llops_projector

__all__ = ["LLoPS"]


class LLoPS(nn.Module, Sketch):
    r"""LLoPS feature maps with parameters ``theta_q``, ``theta_k`` of shape ``[..., t, p, d, m]``.

    Parameters
    ----------
    theta_q : Tensor ``[..., t, p, d, m]``
        Query-side factors; leading axes (e.g. ``[L, H]``) hold one map per head.
    theta_k : Tensor or None
        Key-side factors, same shape; ``None`` ties the key map to the query map.

    Notes
    -----
    :meth:`projector` materialises ``W ∈ R^{d^p × m}`` (small ``d``; tests and theory) and
    :meth:`from_projector` builds Θ from a projector by a CP of each column. Fits:
    ``fit_sketch("llops", ...)`` (module docstring). The kernel is
    :math:`\hat A = \phi_Q(Q)\phi_K(K)^\top = \psi_p(Q) W_Q W_K^\top \psi_p(K)^\top`.
    """

    def __init__(self, theta_q: torch.Tensor, theta_k: torch.Tensor | None = None):
        super().__init__()
        theta_q = _check_theta(theta_q, "theta_q")
        self.theta_q = nn.Parameter(theta_q.detach().clone())
        if theta_k is None:
            self.theta_k = None
        else:
            theta_k = _check_theta(theta_k, "theta_k")
            if theta_k.shape != theta_q.shape:
                raise ValueError(
                    f"theta_k must have the shape of theta_q {tuple(theta_q.shape)}, got {tuple(theta_k.shape)}"
                )
            self.theta_k = nn.Parameter(theta_k.detach().clone())

    @property
    def tied(self) -> bool:
        """Whether the key map shares the query map's parameters."""
        return self.theta_k is None

    @property
    def rank(self) -> int:
        """CP rank ``t``."""
        return self.theta_q.shape[-4]

    @property
    def degree(self) -> int:
        return self.theta_q.shape[-3]

    @property
    def num_features(self) -> int:
        return self.theta_q.shape[-1]

    @property
    def num_parameters(self) -> int:
        per_side = self.theta_q[(0,) * (self.theta_q.ndim - 4)].numel()
        return per_side if self.tied else 2 * per_side

    def features_q(self, x: torch.Tensor) -> torch.Tensor:
        """:math:`\\phi_Q(x)`: ``x[..., n, d]`` → ``[..., n, m]``, in the dtype of ``theta_q``."""
        return llops_features(x.to(self.theta_q.dtype), self.theta_q)

    def features_k(self, x: torch.Tensor) -> torch.Tensor:
        """:math:`\\phi_K(x)`: ``x[..., n, d]`` → ``[..., n, m]`` (the query map when tied)."""
        theta = self.theta_q if self.theta_k is None else self.theta_k
        return llops_features(x.to(theta.dtype), theta)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The approximate kernel ``φ_Q(q) φ_K(k)ᵀ``, ``[..., n_q, n_k]``."""
        return self.kernel(q, k)

    @property
    def non_negative(self) -> bool:
        from .maps import llops_is_non_negative

        return llops_is_non_negative(self.theta_q) and (self.tied or llops_is_non_negative(self.theta_k))

    def features_naive(self, x, side: str = "q", index: tuple = ()) -> torch.Tensor:
        from .maps import llops_features_naive

        theta = self.theta_q if side == "q" or self.theta_k is None else self.theta_k
        return llops_features_naive(x, theta[index].detach())

    def select(self, index) -> LLoPS:
        return LLoPS(self.theta_q[index], None if self.theta_k is None else self.theta_k[index])

    def projector(self, side: str = "q") -> torch.Tensor:
        """The projector of one side (``"q"`` or ``"k"``), ``[..., d**p, m]`` (see :func:`llops_projector`).

        ``features_q(x) == poly_features(x, p) @ projector("q")`` to round-off.
        """
        if side not in ("q", "k"):
            raise ValueError(f"side must be 'q' or 'k', got {side!r}")
        theta = self.theta_q if side == "q" or self.theta_k is None else self.theta_k
        return llops_projector(theta.detach())

    @classmethod
    def from_projector(
        cls,
        w_q,
        w_k=None,
        rank: int = 1,
        *,
        p: int,
        seed: int = 0,
        n_iter_max: int = 200,
        tol: float = 1e-10,
    ) -> LLoPS:
        r"""Rank-``rank`` LLoPS from projectors ``w[..., d**p, m]`` by a CP of each column tensor.

        Each column of ``w_q`` (and ``w_k``), reshaped to a ``d × … × d`` tensor, is decomposed by
        tensorly's ``parafac`` (see :func:`projector_to_theta`). ``w_k=None`` ties the key map to
        the query map. ``p`` is required: ``d**p`` alone does not determine ``d`` and ``p``.
        """
        theta_q = projector_to_theta(w_q, p, rank, seed=seed, n_iter_max=n_iter_max, tol=tol, name="w_q")
        theta_k = None
        if w_k is not None:
            theta_k = projector_to_theta(w_k, p, rank, seed=seed, n_iter_max=n_iter_max, tol=tol, name="w_k")
        return cls(theta_q, theta_k)
