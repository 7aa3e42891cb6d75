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

from ._fitting import balance
from .target import KernelTarget

__all__ = ["lm_step"]


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
    side_q,
    side_k,
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
    side_q, side_k : :class:`~sketchlab.llops.sides.Tokens` or :class:`~sketchlab.llops.sides.Tensors`
        The rows of each side (``N_q``, ``N_k`` of them).
    target : KernelTarget
        Products with the kernel of those rows.
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
    balance(theta_q, theta_k, side_q.features(theta_q), side_k.features(theta_k))  # same kernel, better scaled
    fq, oq = side_q.partials(theta_q)
    fk, ok = side_k.partials(theta_k)
    gram_q, gram_k = fq.mT @ fq, fk.mT @ fk  # [B, m, m]
    grad = (side_q.vjp(oq, fq @ gram_k - target.cross(fk)), side_k.vjp(ok, fk @ gram_q - target.cross_t(fq)))
    # block (j, i) of JᵀJ: G_ii Σ_rows ∂φ_i/∂θ_{:,j,:,i} ∂φ_i/∂θ_{:,j,:,i}ᵀ, the ALS normal matrices times G_ii
    blk_q = side_q.blocks(oq) * gram_k.diagonal(dim1=-2, dim2=-1)[:, None, :, None, None]  # [B, p, m, td, td]
    blk_k = side_k.blocks(ok) * gram_q.diagonal(dim1=-2, dim2=-1)[:, None, :, None, None]
    shape = theta_q.shape
    lam = damping[:, None, None, None]

    def gn(v, with_damping=True):
        dfq, dfk = side_q.jvp(oq, v[0]), side_k.jvp(ok, v[1])
        out_q = side_q.vjp(oq, dfq @ gram_k + fq @ (dfk.mT @ fk))
        out_k = side_k.vjp(ok, dfk @ gram_q + fk @ (dfq.mT @ fq))
        if with_damping:
            out_q = out_q + _from_blocks(lam * (blk_q @ _to_blocks(v[0])[..., None])[..., 0], shape)
            out_k = out_k + _from_blocks(lam * (blk_k @ _to_blocks(v[1])[..., None])[..., 0], shape)
        return out_q, out_k

    eye = torch.eye(blk_q.shape[-1], dtype=blk_q.dtype, device=blk_q.device)
    inverses = []
    for blk in (blk_q, blk_k):
        scale = blk.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]  # [B, p, m, 1, 1]
        # symmetric positive (semi)definite blocks, damped and shifted: explicit inverses, used in every CG iteration
        inverses.append(torch.linalg.inv((1 + lam[..., None]) * blk + (1e-12 * scale + torch.finfo(blk.dtype).tiny) * eye))

    def precondition(r):
        return tuple(_from_blocks((inv @ _to_blocks(v)[..., None])[..., 0], shape) for inv, v in zip(inverses, r))

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
    new = target.loss(side_q.features(cand_q), side_k.features(cand_k))
    take = torch.isfinite(new) & (new < loss)
    keep = take[:, None, None, None, None]  # torch.where, not boolean indexing: no host sync, any device
    theta_q.copy_(torch.where(keep, cand_q, theta_q))
    theta_k.copy_(torch.where(keep, cand_k, theta_k))
    gain = (loss - new) / predicted.clamp_min(tiny)
    damping = torch.where(take & (gain > 0.75), damping / 3, torch.where(take & (gain >= 0.25), damping, damping * 2))
    return torch.where(take, new, loss), damping.clamp(1e-9, 1e6)
