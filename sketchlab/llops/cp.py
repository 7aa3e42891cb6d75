r"""CP decomposition of projector columns: Θ from a projector ``W`` (tensorly ``parafac``)."""

from __future__ import annotations

import torch

from .._validation import as_float_tensor, check_degree, check_positive_int

__all__ = ["projector_to_theta"]


def projector_to_theta(
    w, p: int, rank: int = 1, *, seed: int = 0, n_iter_max: int = 200, tol: float = 1e-10, name: str = "w"
) -> torch.Tensor:
    r"""Θ ``[..., rank, p, d, m]`` from a projector ``w[..., d**p, m]``: a CP of each column tensor.

    Column ``i`` of ``w`` is reshaped (row-major) to a ``d × … × d`` tensor and decomposed by
    ``tensorly.decomposition.parafac`` (rank ``rank``, SVD initialisation, inside
    ``tl.backend_context("pytorch")``), in float64. ``p == 1`` is exact: ``θ_{r,1,:,i} = w_i / rank``.

    Notes
    -----
    For ``rank = 1`` the best possible error is, per column, :math:`\|W_i\|_F^2 - \|W_i\|_\sigma^2`
    (Theorem 3.4 as stated in DESIGN.md; see :func:`sketchlab.spectral.rank1_residuals`).
    ``parafac`` is a local method: for ``p >= 3`` it may stop above that floor.
    """
    import tensorly as tl
    from tensorly.decomposition import parafac

    p = check_degree(p)
    rank = check_positive_int(rank, "rank")
    w = as_float_tensor(w, name)
    if w.ndim < 2:
        raise ValueError(f"{name} must have shape [..., d**p, m], got {tuple(w.shape)}")
    d = round(w.shape[-2] ** (1.0 / p))
    if d < 1 or d**p != w.shape[-2]:
        raise ValueError(f"{name} must have d**p rows for p={p}; {w.shape[-2]} is not a {p}-th power")
    *batch, _, m = w.shape
    flat = w.detach().to(torch.float64).reshape(-1, d**p, m)  # [B, d^p, m]
    theta = torch.zeros(flat.shape[0], rank, p, d, m, dtype=torch.float64, device=w.device)
    if p == 1:
        theta[:, :, 0] = flat[:, None] / rank
        return theta.reshape(*batch, rank, p, d, m).to(w.dtype)
    with tl.backend_context("pytorch"):
        for b in range(flat.shape[0]):
            for i in range(m):
                tensor = flat[b, :, i].reshape((d,) * p)  # [d, ..., d]
                if float(tensor.abs().max()) == 0.0:
                    continue  # the zero tensor: all factors zero
                cp = parafac(tensor, rank, n_iter_max=n_iter_max, tol=tol, init="svd", random_state=seed)
                weights, factors = cp
                for j in range(p):
                    fac = factors[j]  # [d, rank]
                    if j == 0:
                        fac = fac * weights[None, :]
                    theta[b, :, j, :, i] = fac.mT
    return theta.reshape(*batch, rank, p, d, m).to(w.dtype)

