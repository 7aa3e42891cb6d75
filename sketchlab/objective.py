r"""The kernel-fitting objective shared by every learned sketch, and its gradient trainer.

Every fitted sketch (LLoPS, the MLP and element-wise baselines) minimises the same loss,

.. math:: \mathcal L = \|\phi_Q(Q)\phi_K(K)^\top - A\|_F^2, \qquad A = (QK^\top)^{\circ p},

per head, so that they are compared on equal terms. :func:`train_kernel_sketch` is the one
gradient loop they share: ``torch.optim.Adam`` on :math:`\sum_h \mathcal L_h / \|A_h\|_F^2` with a
fixed step budget, keeping the best parameters seen for each head. (LLoPS's default fit is exact
alternating least squares and Levenberg–Marquardt, :func:`sketchlab.llops.fit_llops_direct`; its Adam
fit goes through here.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from ._validation import DEFAULT_MAX_BYTES, check_memory, check_positive_int, check_real
from .polynomial import poly_kernel

__all__ = ["DEFAULT_LR", "DEFAULT_STEPS", "check_finite_loss", "kernel_loss", "train_kernel_sketch"]

#: Adam budget shared by every gradient fit (LLoPS ``method="adam"``, the MLP, element-wise).
DEFAULT_STEPS = 500
DEFAULT_LR = 1e-2


def kernel_loss(phi_q: torch.Tensor, phi_k: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    r"""Squared Frobenius kernel error :math:`\|\Phi_Q\Phi_K^\top - A\|_F^2`, per batch entry.

    Parameters
    ----------
    phi_q : Tensor ``[..., n_q, m]``
    phi_k : Tensor ``[..., n_k, m]``
    exact : Tensor ``[..., n_q, n_k]``
        The target, usually ``poly_kernel(q, k, p)``.

    Returns
    -------
    Tensor ``[...]`` (batch shape), differentiable. Divide by ``(exact**2).sum((-2, -1))`` for
    ``rel_fro**2``, or by the tail bound for ``optimality_ratio**2``.

    Notes
    -----
    Cost ``O(n_q n_k m)``. When the feature dimension ``D`` of the exact map is below ``n``, the
    same value is a function of the ``D × D`` Gram matrices of :math:`\psi_p(Q)`, :math:`\psi_p(K)`
    only; for the sizes this toolkit targets (``n ≈ D``) the ``n``-level form here is cheaper.
    """
    if phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(
            f"phi_q and phi_k must have the same number of features (last axis), got "
            f"{phi_q.shape[-1]} and {phi_k.shape[-1]}"
        )
    expected = (*phi_q.shape[:-1], phi_k.shape[-2])
    if tuple(exact.shape) != expected:
        raise ValueError(f"exact must have shape {expected} (batch, n_q, n_k), got {tuple(exact.shape)}")
    return ((phi_q @ phi_k.mT - exact) ** 2).sum((-2, -1))


def check_finite_loss(loss: torch.Tensor, step: int, what: str, batch: tuple | None = None) -> None:
    """Stop a fit whose loss (per head) went non-finite, with a ``FloatingPointError`` saying where.

    ``batch`` (the heads' batch shape, e.g. ``(L, H)``) turns flattened indices into ``(layer, head)``.
    """
    bad = ~torch.isfinite(loss)
    if bool(bad.any()):
        flat = bad.reshape(-1).nonzero().flatten().tolist()
        if batch is not None and len(batch) == 2:
            where = f"(layer, head) {[(i // batch[1], i % batch[1]) for i in flat[:8]]}"
        else:
            where = f"flattened batch indices {flat[:8]}"
        raise FloatingPointError(
            f"{what} fit stopped: the kernel loss (or the target ‖A‖²) is non-finite at step {step} for "
            f"{len(flat)} head(s), {where}; likely cause: the input scale — (qᵀk)^p overflows for large "
            "inputs (x · d^-1/4 is the usual choice), or lower the learning rate"
        )


def train_kernel_sketch(
    params: list[torch.Tensor],
    features: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    k: torch.Tensor,
    p: int,
    *,
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
    tol: float = 1e-4,
    what: str = "Adam",
    progress: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    per_head: bool = True,
) -> dict:
    r"""Fit ``params`` in place by Adam on the relative kernel loss; keep each head's best (``per_head``).

    Parameters
    ----------
    params : list of leaf Tensors
        Each leads with the batch shape ``q.shape[:-2]`` (one independent sketch per head), unless
        ``per_head=False``.
    features : callable ``(q, k) -> (φ_Q(q), φ_K(k))``
        Features computed from ``params``.
    q : Tensor ``[..., n_q, d]``
    k : Tensor ``[..., n_k, d]``
    p : int
        Degree of the target :math:`A = (QK^\top)^{\circ p}`.
    steps, lr : Adam budget (``steps`` updates, learning rate ``lr``).
    tol : float
        ``converged`` means the summed loss moved by less than ``tol`` (relative) over the last 10 steps.
    what : str
        Name of the fit in the error raised when the loss goes non-finite.
    progress : bool
        tqdm progress bar.
    max_bytes : int
        Memory budget: the loop forms the ``n_q × n_k`` kernel (and its residual) per head.
    per_head : bool
        ``False``: the parameters are shared by the heads (e.g. one module for all, as fla's maps), so the
        step kept is the one of least summed loss, for all heads at once, and they need no batch axis.

    Returns
    -------
    dict
        The fit's ``info`` (:class:`~sketchlab.featuremaps.FittedMaps`): ``steps``, ``converged``, and per head
        (batch shape) ``init_rel_fro`` (at the start) and ``rel_fro`` (of the parameters kept), both
        :math:`\|\hat A - A\|_F/\|A\|_F`.
    """
    steps = check_positive_int(steps, "steps")
    lr = check_real(lr, "lr", positive=True)
    batch = q.shape[:-2]
    n_batch = math.prod(batch)
    lead, groups = (tuple(batch), n_batch) if per_head else ((), 1)  # the independent snapshots kept: [groups, ...]
    for i, t in enumerate(params):
        if tuple(t.shape[: len(lead)]) != lead:
            raise ValueError(f"params[{i}] must lead with the batch shape {tuple(batch)}, got {tuple(t.shape)}")
    check_memory(3 * n_batch * q.shape[-2] * k.shape[-2] * q.element_size(),
                 what=f"the kernel, residual and gradient of {n_batch} head(s) ({q.shape[-2]} x {k.shape[-2]}, {q.dtype})",
                 way_out="fit fewer tokens (fit_tokens) or fewer heads at a time, or use LLoPS method='direct'",
                 max_bytes=max_bytes)
    exact = poly_kernel(q, k, p)  # [..., n_q, n_k]
    norm = (exact**2).sum((-2, -1))  # [...]
    check_finite_loss(norm, 0, what, tuple(batch))
    norm = norm.clamp_min(torch.finfo(exact.dtype).tiny)
    opt = torch.optim.Adam(params, lr=lr)
    kept = torch.full((n_batch,), math.inf, dtype=norm.dtype, device=norm.device)  # each head's loss at the step kept
    best = [t.detach().reshape(groups, *t.shape[len(lead):]).clone() for t in params]  # [groups, ...] each
    totals: list[float] = []
    initial = None
    for step in tqdm(range(steps + 1), desc=what, disable=not progress, leave=False):
        loss = kernel_loss(*features(q, k), exact) / norm  # [...], relative squared error
        flat = loss.detach().reshape(n_batch)
        check_finite_loss(flat, step, what, tuple(batch))
        if initial is None:
            initial = flat.clone()
        better = flat < kept if per_head else (flat.sum() < kept.sum())[None]  # [groups]
        kept = torch.where(better.expand(n_batch), flat, kept)
        for b, t in zip(best, params):
            b[better] = t.detach().reshape(groups, *t.shape[len(lead):])[better]
        totals.append(float(flat.sum()))
        if step == steps:
            break  # the last evaluation only scores the final step
        opt.zero_grad(set_to_none=True)
        loss.sum().backward()
        opt.step()
    with torch.no_grad():
        for b, t in zip(best, params):
            t.copy_(b.reshape(t.shape))
    converged = len(totals) > 10 and abs(totals[-11] - totals[-1]) <= tol * totals[-11]
    return {"steps": steps, "converged": bool(converged), "init_rel_fro": initial.sqrt().reshape(batch),
            "rel_fro": kept.sqrt().reshape(batch)}
