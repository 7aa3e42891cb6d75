r"""The delta rule's per-key quantities: the write strength :math:`\beta` and the unit keys and queries
:math:`\hat k = k/\lVert k\rVert`, shared by every form of the memory mechanisms (naive, chunk, recurrent)."""

from __future__ import annotations

import torch

__all__ = ["far_beta", "unit"]


def far_beta(call, v: torch.Tensor) -> torch.Tensor:
    r"""The delta rule's write strength :math:`\beta = \sigma(b + w\cdot v)` of keys with values ``v``.

    Parameters
    ----------
    call : namespace
        A checked memory call (:func:`sketchlab.attention.memory_state.check_memory_call`).
    v : Tensor ``[..., H, Dv]``

    Returns
    -------
    Tensor ``[..., H]``
    """
    f = call.far
    x = f["beta_bias"].to(v.dtype).expand(v.shape[:-1])
    if f["beta_weight"] is not None:
        x = x + (v * f["beta_weight"].to(v.dtype)).sum(-1)
    return torch.sigmoid(x)


def unit(x: torch.Tensor) -> torch.Tensor:
    r"""``x / ‖x‖`` along the last axis, 0 where ``x = 0`` (a null event): the delta rule's ``k̂, q̂``."""
    fi = torch.finfo(x.dtype)
    return x / x.norm(dim=-1, keepdim=True).clamp_min(fi.tiny * fi.eps)  # the least subnormal: any ‖x‖ > 0 as is
