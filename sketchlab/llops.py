r"""LLoPS: the learnable low-rank polynomial sketch.

:math:`\Theta \in \mathbb R^{t \times p \times d \times m}` defines
:math:`\phi(x)_i = \sum_{r=1}^t \prod_{j=1}^p \langle \theta_{r,j,:,i}, x\rangle`, i.e.
:math:`\phi(X) = \sum_r \prod_j (X\Theta_{r,j})` (element-wise product over ``j``). This equals
:math:`\psi_p(x)^\top W` where column ``i`` of ``W``, reshaped to a ``d × … × d`` tensor, is the
rank-``t`` CP tensor :math:`\sum_r \theta_{r,1,:,i} \otimes \dots \otimes \theta_{r,p,:,i}`.

References
----------
Qin, Deng, Cong, Sun. *Learnable Low-Rank Polynomial Sketch for Effective Linear Attention*, 2026, §3.2.
"""

from __future__ import annotations

import torch
from torch import nn

from ._validation import as_float_tensor
from .sketch import Sketch

__all__ = ["LLoPS", "llops_features", "llops_features_naive"]


def _check_theta(theta, name: str = "theta") -> torch.Tensor:
    theta = as_float_tensor(theta, name)
    if theta.ndim < 4 or 0 in theta.shape[-4:]:
        raise ValueError(f"{name} must have shape [..., t, p, d, m] with every size >= 1, got {tuple(theta.shape)}")
    return theta


def llops_features(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    r"""LLoPS features :math:`\phi(X) = \sum_r \prod_j X\Theta_{r,j}`.

    Parameters
    ----------
    x : Tensor ``[..., n, d]``
    theta : Tensor ``[..., t, p, d, m]``
        Leading axes broadcast against those of ``x`` (e.g. ``[L, H]`` for one map per head).

    Returns
    -------
    Tensor ``[..., n, m]``. Cost ``O(n d m t p)``.
    """
    proj = x[..., None, None, :, :] @ theta  # [..., t, p, n, m] = ⟨θ_{r,j,:,i}, x⟩
    return proj.prod(dim=-3).sum(dim=-3)  # ∏ over j, then Σ over r


def llops_features_naive(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Float64 twin of :func:`llops_features` for ``x[n, d]``, ``theta[t, p, d, m]``: loops over r, j."""
    x = as_float_tensor(x, "x").to(torch.float64)
    theta = _check_theta(theta).to(torch.float64)
    if x.ndim != 2 or theta.ndim != 4 or x.shape[-1] != theta.shape[-2]:
        raise ValueError(f"llops_features_naive takes x[n, d] and theta[t, p, d, m], got {tuple(x.shape)}, {tuple(theta.shape)}")
    t, p, _, m = theta.shape
    out = torch.zeros(x.shape[0], m, dtype=torch.float64)
    for r in range(t):
        term = torch.ones(x.shape[0], m, dtype=torch.float64)
        for j in range(p):
            term = term * (x @ theta[r, j])  # [n, m]
        out = out + term
    return out


class LLoPS(nn.Module, Sketch):
    r"""LLoPS feature maps with parameters ``theta_q``, ``theta_k`` of shape ``[..., t, p, d, m]``.

    Parameters
    ----------
    theta_q : Tensor ``[..., t, p, d, m]``
        Query-side factors; leading axes (e.g. ``[L, H]``) hold one map per head.
    theta_k : Tensor or None
        Key-side factors, same shape; ``None`` ties the key map to the query map.
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
