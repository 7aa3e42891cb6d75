r"""Levenberg–Marquardt steps on the full LLoPS parameter vector of each head.

The residual :math:`R = \Phi_Q\Phi_K^\top - A` has the Jacobian-vector product
:math:`J\delta = \delta\Phi_Q\Phi_K^\top + \Phi_Q\delta\Phi_K^\top`, so the Gauss–Newton product
:math:`J^\top J\delta` needs only ``m × m`` Gram matrices and the feature derivatives
(:func:`~sketchlab.llops.maps.features_jvp` / :func:`~sketchlab.llops.maps.features_vjp`):

.. math:: (J^\top J\delta)_Q = \partial\Phi_Q^\top\big[\delta\Phi_Q G_K + \Phi_Q(\delta\Phi_K^\top\Phi_K)\big],
          \quad G_K = \Phi_K^\top\Phi_K

(and the same with ``Q ↔ K``), ``O(n m² + n d m t p)`` per product, never ``n × n``. The gradient
:math:`J^\top R` needs :math:`A\Phi_K` and :math:`A^\top\Phi_Q` once per step
(:class:`~sketchlab.llops.target.KernelTarget`). Each step solves
:math:`(J^\top J + \lambda B)\delta = -J^\top R` by preconditioned conjugate gradients, with
``B`` the block diagonal of :math:`J^\top J` — exactly the normal matrices of the alternating
least-squares blocks (one column, one factor, one side) — as damping metric and (times
``1 + λ``) as preconditioner. A step is kept per head only where it lowers the loss; ``λ`` falls
(÷3) when the gain ratio exceeds 3/4 and rises (×2) below 1/4 or on rejection (Nielsen-style
schedule, clamped to ``[1e-9, 1e6]``).
"""

from __future__ import annotations

import torch

from .maps import feature_partials, features_jvp, features_vjp
from .target import KernelTarget
from ._fitting import balance

__all__ = ["lm_step"]


def _blocks(x: torch.Tensor, others: torch.Tensor, g_diag: torch.Tensor) -> torch.Tensor:
    r"""Block diagonal of :math:`J^\top J` for one side, ``[B, p, m, t·d, t·d]``.

    Block ``(j, i)``: :math:`G_{ii}\sum_n O_{r,j,n,i}O_{s,j,n,i}\,x_n x_n^\top`, formed as one
    ``(t² m) × n × d(d+1)/2`` product per head and factor.
    """
    B, t, p, n, m = others.shape
    d = x.shape[-1]
    row, col = torch.triu_indices(d, d, device=x.device)
    out = torch.empty(B, p, t, t, m, d, d, dtype=x.dtype, device=x.device)
    for b in range(B):
        pairs = x[b, :, row] * x[b, :, col]  # [n, d(d+1)/2]
        for j in range(p):
            o = others[b, :, j]  # [t, n, m]
            w = (o[:, None] * o[None, :]).transpose(-2, -1)  # [t, s, m, n]
            packed = (w.reshape(-1, n) @ pairs).reshape(t, t, m, -1)
            out[b, j, :, :, :, row, col] = packed
            out[b, j, :, :, :, col, row] = packed
    out = out.permute(0, 1, 4, 2, 5, 3, 6).reshape(B, p, m, t * d, t * d)  # [B, p, m, (t, d), (s, e)]
    return out * g_diag[:, None, :, None, None]


def _to_blocks(v: torch.Tensor) -> torch.Tensor:
    """``[B, t, p, d, m]`` → ``[B, p, m, t·d]``."""
    B, t, p, d, m = v.shape
    return v.permute(0, 2, 4, 1, 3).reshape(B, p, m, t * d)


def _from_blocks(u: torch.Tensor, shape) -> torch.Tensor:
    """``[B, p, m, t·d]`` → ``[B, t, p, d, m]``."""
    B, t, p, d, m = shape
    return u.reshape(B, p, m, t, d).permute(0, 3, 1, 4, 2)


def _dot(u, v) -> torch.Tensor:
    return sum((a * b).sum((1, 2, 3, 4)) for a, b in zip(u, v))


def lm_step(
    x_q: torch.Tensor,
    x_k: torch.Tensor,
    target: KernelTarget,
    theta_q: torch.Tensor,
    theta_k: torch.Tensor,
    loss: torch.Tensor,
    damping: torch.Tensor,
    *,
    cg_iters: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""One Levenberg–Marquardt step per head, in place on ``theta_q``, ``theta_k`` ``[B, t, p, d, m]``.

    Parameters
    ----------
    x_q : Tensor ``[B, n_q, d]``
    x_k : Tensor ``[B, n_k, d]``
    target : KernelTarget
    theta_q, theta_k : Tensor ``[B, t, p, d, m]``
        Updated in place where the step lowers the loss.
    loss : Tensor ``[B]``
        The current loss :math:`\|\Phi_Q\Phi_K^\top - A\|_F^2`.
    damping : Tensor ``[B]``
        ``λ`` per head.
    cg_iters : int
        Conjugate-gradient iterations for the step.

    Returns
    -------
    (loss, damping) : the new loss (never above the old one) and ``λ`` per head.
    """
    fq, fk = feature_partials(x_q, theta_q)[0], feature_partials(x_k, theta_k)[0]
    balance(theta_q, theta_k, fq, fk)  # the kernel is unchanged; the problem is better scaled
    fq, oq = feature_partials(x_q, theta_q)
    fk, ok = feature_partials(x_k, theta_k)
    gram_q, gram_k = fq.mT @ fq, fk.mT @ fk  # [B, m, m]
    grad = (features_vjp(x_q, oq, fq @ gram_k - target.cross(fk)),
            features_vjp(x_k, ok, fk @ gram_q - target.cross_t(fq)))
    blk_q = _blocks(x_q, oq, gram_k.diagonal(dim1=-2, dim2=-1))  # [B, p, m, td, td]
    blk_k = _blocks(x_k, ok, gram_q.diagonal(dim1=-2, dim2=-1))
    shape = theta_q.shape
    lam = damping[:, None, None, None]

    def gn(v, with_damping=True):
        dfq, dfk = features_jvp(x_q, oq, v[0]), features_jvp(x_k, ok, v[1])
        out_q = features_vjp(x_q, oq, dfq @ gram_k + fq @ (dfk.mT @ fk))
        out_k = features_vjp(x_k, ok, dfk @ gram_q + fk @ (dfq.mT @ fq))
        if with_damping:  # block-times-vector as a broadcast product: many tiny matmuls are slower
            out_q = out_q + _from_blocks(lam * (blk_q * _to_blocks(v[0])[..., None, :]).sum(-1), shape)
            out_k = out_k + _from_blocks(lam * (blk_k * _to_blocks(v[1])[..., None, :]).sum(-1), shape)
        return out_q, out_k

    eye = torch.eye(blk_q.shape[-1], dtype=blk_q.dtype, device=blk_q.device)
    inverses = []
    for blk in (blk_q, blk_k):
        scale = blk.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]  # [B, p, m, 1, 1]
        # symmetric positive (semi)definite blocks, damped and shifted: explicit inverses, used in every CG iteration
        inverses.append(torch.linalg.inv((1 + lam[..., None]) * blk + (1e-12 * scale + torch.finfo(blk.dtype).tiny) * eye))

    def precondition(r):
        return tuple(_from_blocks((inv * _to_blocks(v)[..., None, :]).sum(-1), shape) for inv, v in zip(inverses, r))

    step = (torch.zeros_like(theta_q), torch.zeros_like(theta_k))
    resid = (-grad[0], -grad[1])
    z = precondition(resid)
    direction = z
    rz = _dot(resid, z)
    tiny = torch.finfo(theta_q.dtype).tiny
    for _ in range(cg_iters):
        applied = gn(direction)
        curv = _dot(direction, applied)
        alpha = torch.where(curv > 0, rz / curv.clamp_min(tiny), torch.zeros_like(rz))[:, None, None, None, None]
        step = (step[0] + alpha * direction[0], step[1] + alpha * direction[1])
        resid = (resid[0] - alpha * applied[0], resid[1] - alpha * applied[1])
        z = precondition(resid)
        rz_new = _dot(resid, z)
        beta = (rz_new / rz.clamp_min(tiny))[:, None, None, None, None]
        direction = (z[0] + beta * direction[0], z[1] + beta * direction[1])
        rz = rz_new
    # predicted decrease of the Gauss–Newton model ‖R + Jδ‖²: −(2 gᵀδ + δᵀJᵀJδ)
    predicted = -(2 * _dot(grad, step) + _dot(step, gn(step, with_damping=False)))
    cand_q, cand_k = theta_q + step[0], theta_k + step[1]
    new = target.loss(feature_partials(x_q, cand_q)[0], feature_partials(x_k, cand_k)[0])
    take = torch.isfinite(new) & (new < loss)
    keep = take[:, None, None, None, None]  # torch.where, not boolean indexing: no host sync, any device
    theta_q.copy_(torch.where(keep, cand_q, theta_q))
    theta_k.copy_(torch.where(keep, cand_k, theta_k))
    gain = (loss - new) / predicted.clamp_min(tiny)
    damping = torch.where(take & (gain > 0.75), damping / 3, torch.where(take & (gain >= 0.25), damping, damping * 2))
    return torch.where(take, new, loss), damping.clamp(1e-9, 1e6)
