r"""Gradient fitting of a learnable sketch to the polynomial kernel (shared by ``mlp`` and ``elementwise``).

The objective and the optimiser budget are those of LLoPS's gradient fit
(:func:`sketchlab.llops.fit_llops_adam`), so that the baselines and LLoPS are compared on equal
terms: the loss of each head is :func:`sketchlab.llops.kernel_loss` divided by
:math:`\|A\|_F^2`,

.. math:: \mathcal L_h = \frac{\|\phi_Q(Q_h)\phi_K(K_h)^\top - (Q_hK_h^\top)^{\circ p}\|_F^2}{\|(Q_hK_h^\top)^{\circ p}\|_F^2},

the sum over heads is minimised by ``torch.optim.Adam`` (default ``lr = 1e-2``, 500 steps, the
defaults of ``fit_llops_adam``), and the best parameters seen for each head (the start included)
are kept.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .._validation import check_positive_int
from ..llops import kernel_loss

__all__ = ["DEFAULT_LR", "DEFAULT_STEPS", "train_kernel_sketch"]

#: Adam steps and learning rate: the defaults of :func:`sketchlab.llops.fit_llops_adam`.
DEFAULT_STEPS = 500
DEFAULT_LR = 1e-2


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
) -> dict:
    """Fit ``params`` (leaf tensors whose leading axes are the batch axes ``q.shape[:-2]``) in place.

    ``features(q, k)`` returns ``(φ_Q(q), φ_K(k))``. After the call each head holds the best
    parameters seen. Returns ``fit_info``: ``steps``, ``converged`` (the summed loss moved by less
    than ``tol``, relative, over the last 10 steps, as in ``fit_llops_adam``), ``loss`` (final
    per-head relative squared error, mean over heads) and ``initial_loss``.
    """
    steps = check_positive_int(steps, "steps")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    batch = q.shape[:-2]
    n_batch = math.prod(batch)
    for i, t in enumerate(params):
        if tuple(t.shape[: len(batch)]) != tuple(batch):
            raise ValueError(f"params[{i}] must lead with the batch shape {tuple(batch)}, got {tuple(t.shape)}")
    exact = (q @ k.mT) ** p  # [..., n_q, n_k]
    norm = (exact**2).sum((-2, -1)).clamp_min(torch.finfo(exact.dtype).tiny)  # [...]
    opt = torch.optim.Adam(params, lr=lr)
    best_loss = torch.full((n_batch,), math.inf, dtype=norm.dtype)
    best = [t.detach().reshape(n_batch, *t.shape[len(batch):]).clone() for t in params]  # [B, ...] each
    totals: list[float] = []
    initial = None
    for step in range(steps + 1):
        loss = kernel_loss(*features(q, k), exact) / norm  # [...]
        flat = loss.detach().reshape(n_batch)
        if not bool(torch.isfinite(flat).all()):
            raise FloatingPointError(f"the kernel loss became non-finite at step {step}; lower lr (now {lr})")
        if initial is None:
            initial = flat.clone()
        better = flat < best_loss
        best_loss = torch.where(better, flat, best_loss)
        for b, t in zip(best, params):
            b[better] = t.detach().reshape(n_batch, *t.shape[len(batch):])[better]
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
    return {"steps": steps, "converged": bool(converged), "loss": float(best_loss.mean()),
            "initial_loss": float(initial.mean())}
