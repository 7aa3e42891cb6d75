r"""The delta rule's part of the lean decoding step (:class:`sketchlab.attention.recurrent.RecurrentStep`, its torch
twin; the compiled step does the same in :mod:`sketchlab.attention.ops.fused_recurrent`): β of every lane laid out
once per parameter version, and a key written into the state in place,

.. math:: S \leftarrow S + \beta\,\hat k\,(v - \hat k^\top S)^\top,\qquad \hat k = \phi(k)/\lVert\phi(k)\rVert

(:mod:`sketchlab.attention.ops.delta`; the float64 twin of the write is :func:`~.naive.delta_write`).
"""

from __future__ import annotations

import torch

from .beta import unit

__all__ = ["delta_enter_", "lane_beta"]


def lane_beta(far: dict, rows):
    r"""β of every lane: ``σ(b) [B·H, 1, 1]`` (one per head), or ``(b [B·H, 1, 1], w [B·H, Dv, 1])`` when β is
    read from the value (:math:`\beta = \sigma(b + v^\top w)`); ``far`` and ``rows`` as
    :func:`sketchlab.attention.ops.decayed.recurrent.lane_decay` takes them."""
    bias, weight = rows(far["beta_bias"]).view(-1, 1, 1), far["beta_weight"]
    return torch.sigmoid(bias) if weight is None else (bias, rows(weight)[..., None])


def delta_enter_(S: torch.Tensor, f: torch.Tensor, v: torch.Tensor, beta, real: torch.Tensor | None) -> None:
    r"""Write keys into the delta state ``S [B·H, M, Dv]`` in place: features ``f [B·H, 1, M]``, values
    ``v [B·H, 1, Dv]``, ``beta`` from :func:`lane_beta`, ``real [B·H, 1, 1]`` (0: a null event, nothing written)
    or None for all."""
    kh = unit(f)
    b = beta if isinstance(beta, torch.Tensor) else torch.sigmoid(torch.baddbmm(beta[0], v, beta[1]))  # [BH, 1, 1]
    if real is not None:
        b = b * real
    S.addcmul_(kh.mT * b, v - kh @ S)
