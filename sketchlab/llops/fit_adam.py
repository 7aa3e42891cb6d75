r"""The naive LLoPS fit: ``torch.optim.Adam`` on the shared kernel loss (:mod:`sketchlab.objective`)."""

from __future__ import annotations

import torch

from .._validation import DEFAULT_MAX_BYTES
from ..featuremaps.base import FittedMaps
from ..objective import DEFAULT_LR, DEFAULT_STEPS, train_kernel_sketch
from ._fitting import prepare
from .inits import llops_init
from .maps import llops_features
from .pair import llops_maps

__all__ = ["fit_llops_adam"]


def fit_llops_adam(
    q,
    k,
    *,
    p: int,
    m: int,
    rank: int = 1,
    init="random",
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
    tol: float = 1e-4,
    seed: int = 0,
    progress: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    cp_options: dict | None = None,
) -> FittedMaps:
    r"""Fit LLoPS by ``torch.optim.Adam`` on :func:`kernel_loss` with a fixed step budget.

    The naive baseline: every head's loss is divided by :math:`\|A\|_F^2` and the sum is
    minimised for ``steps`` steps (learning rate ``lr``), in float64; the best Θ seen per head
    (initialisation included) is returned. ``converged`` means the summed loss moved by less
    than ``tol`` (relative) over the last 10 steps. Other arguments and the result (an untied pair of
    :class:`~sketchlab.featuremaps.LLoPSMap`, as :class:`~sketchlab.featuremaps.FittedMaps` with the fit's ``info``) as :func:`~sketchlab.llops.fit_llops_direct`. Forms the ``n × n`` kernel (checked against ``max_bytes``).
    """
    q, k, p, m, rank, out_dtype, batch, q64, k64 = prepare(q, k, p, m, rank)
    theta_q, theta_k = llops_init(q, k, p=p, m=m, rank=rank, init=init, seed=seed, max_bytes=max_bytes, **(cp_options or {}))
    d = q.shape[-1]
    theta_q = theta_q.reshape(-1, rank, p, d, m).to(device=q64.device, dtype=torch.float64).clone().requires_grad_(True)  # [B, t, p, d, m]
    theta_k = theta_k.reshape(-1, rank, p, d, m).to(device=q64.device, dtype=torch.float64).clone().requires_grad_(True)  # [B, t, p, d, m]
    info = train_kernel_sketch(
        [theta_q, theta_k], lambda x, y: (llops_features(x, theta_q), llops_features(y, theta_k)), q64, k64, p,
        steps=steps, lr=lr, tol=tol, what="LLoPS Adam", progress=progress, max_bytes=max_bytes,
    )
    map_q, map_k = llops_maps(theta_q.detach().reshape(*batch, rank, p, d, m).to(out_dtype),
                              theta_k.detach().reshape(*batch, rank, p, d, m).to(out_dtype))
    return FittedMaps(map_q, map_k, {
        **info,
        "init": init if isinstance(init, str) else type(init).__name__,
        "init_rel_fro": info["init_rel_fro"].reshape(batch),
        "rel_fro": info["rel_fro"].reshape(batch),
    })
