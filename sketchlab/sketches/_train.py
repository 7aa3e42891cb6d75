r"""Gradient fitting of a learnable sketch to the polynomial kernel (shared by ``mlp`` and ``elementwise``).

Loss (per head, averaged over heads): the relative squared Frobenius error

.. math:: \mathcal L = \frac{\|\phi_Q(Q)\phi_K(K)^\top - (QK^\top)^{\circ p}\|_F^2}{\|(QK^\top)^{\circ p}\|_F^2},

minimised with Adam and a cosine-decayed learning rate over a fixed number of full-batch steps.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .._validation import check_positive_int

__all__ = ["relative_kernel_loss", "train_kernel_sketch"]


def relative_kernel_loss(approx: torch.Tensor, exact: torch.Tensor, exact_sq_norm: torch.Tensor) -> torch.Tensor:
    """Mean over heads of ``‖approx − exact‖_F² / ‖exact‖_F²`` for ``[..., n_q, n_k]`` kernels."""
    return (((approx - exact) ** 2).sum((-2, -1)) / exact_sq_norm).mean()


def train_kernel_sketch(
    params: list[torch.Tensor],
    kernel_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    p: int,
    *,
    steps: int,
    lr: float,
) -> dict:
    """Fit ``params`` (leaf tensors, updated in place) so that ``kernel_fn(q, k) ≈ (qkᵀ)^p``.

    Returns ``fit_info``: ``steps``, ``converged`` (the loss fell by less than 1% of its value over
    the last tenth of the steps), ``loss`` (final relative squared error, mean over heads),
    ``initial_loss``.
    """
    steps = check_positive_int(steps, "steps")
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    exact = (q @ k.mT) ** p  # [..., n_q, n_k]
    exact_sq = (exact**2).sum((-2, -1)).clamp_min(torch.finfo(exact.dtype).tiny)
    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    history = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = relative_kernel_loss(kernel_fn(q, k), exact, exact_sq)
        loss.backward()
        opt.step()
        sched.step()
        history.append(float(loss))
    with torch.no_grad():
        final = float(relative_kernel_loss(kernel_fn(q, k), exact, exact_sq))
    tenth = max(1, steps // 10)
    before = history[-tenth] if len(history) >= tenth else history[0]
    converged = bool(before - final <= 0.01 * abs(before))
    return {"steps": steps, "converged": converged, "loss": final, "initial_loss": history[0]}
