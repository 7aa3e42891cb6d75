r"""The LLoPS features of one decoded token's q and k, both sides at once: what a converted layer's lean decoder
(:class:`sketchlab.convert.sketched.LayerDecoder`) computes before each :class:`~sketchlab.attention.recurrent.RecurrentStep`
step. One compiled call on the CPU (:func:`sketchlab.attention.ops.fused_recurrent.pair_features`), its torch twin
elsewhere; Hedgehog's counterpart is :func:`sketchlab.featuremaps.hedgehog.hedgehog_pair_features`.
"""

from __future__ import annotations

import torch

from . import fused_recurrent as fused

__all__ = ["llops_pair_features"]


def llops_pair_features(theta_q: torch.Tensor, theta_k: torch.Tensor, batch: int):
    r"""A function ``(q, k) → (φ_Q(q), φ_K(k))`` for decoding one token with per-head LLoPS maps.

    Parameters
    ----------
    theta_q, theta_k : Tensor ``[H, t, p, D, M]``
        The two sides' Θ (``theta_k is theta_q``: a tied map).
    batch : int
        ``B``: the function takes ``q, k [B·H, 1, D]`` (rows batch-major).

    Returns
    -------
    A function of ``q, k`` returning ``(φ_Q(q), φ_K(k))``, each ``[B·H, 1, M]``:
    :math:`\phi(x)_m = \sum_{r<t}\prod_{j<p} (x^\top\Theta_{r,j})_m`, the map of
    :func:`sketchlab.llops.maps.llops_feature_fn` (tested against the maps' float64 twins). On the CPU in
    float32/float64 one compiled call (under :data:`~sketchlab.attention.ops.fused_recurrent.USE_COMPILED`, as the step); its torch twin is one batched
    product ``[q; k] @ [Θ_Q; Θ_K]_flat`` (``[2·B·H, 1, D] @ [2·B·H, D, t·p·M]``; tied: ``[q, k] [B·H, 2, D] @
    Θ_flat``), then the ``p``-fold products and the sum over ``t``. ``Θ_flat`` is made once per version of each
    Θ (a training step in place makes it again); no gradient. Cost ``O(B·H·D·t·p·M)`` per token.
    """
    H, t, p, D, M = theta_q.shape
    tied = theta_k is theta_q
    memo = {}

    def stacked() -> torch.Tensor:
        try:
            key = tuple((id(x), x._version) for x in (theta_q, theta_k))
        except RuntimeError:  # inference tensors have no version: stacked again every call
            key = None
        if key is None or memo.get("key") != key:
            with torch.no_grad():
                flats = [x.detach().permute(0, 3, 1, 2, 4).reshape(H, D, t * p * M).repeat(batch, 1, 1)
                         for x in ((theta_q,) if tied else (theta_q, theta_k))]
                memo["flat"], memo["key"] = torch.cat(flats, 0).contiguous(), key  # [(1|2)·B·H, D, t·p·M]
        return memo["flat"]

    def product(proj: torch.Tensor) -> torch.Tensor:  # [..., t·p·M] -> [..., M]
        f = proj.unflatten(-1, (t, p, M))
        return (f[..., 0, 0, :] * f[..., 0, 1, :]) if (t, p) == (1, 2) else f.prod(-2).sum(-2)

    def features(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = stacked()
        if flat.device.type == "cpu" and q.dtype == k.dtype == flat.dtype in (torch.float32, torch.float64) \
                and fused.available():  # one compiled call
            return fused.pair_features(q, k, flat, 0 if tied else flat.shape[0] // 2, t, p)
        if tied:
            f = product(torch.bmm(torch.cat([q, k], 1), flat))  # [B·H, 2, M]
            return f[:, :1], f[:, 1:]
        f = product(torch.bmm(torch.cat([q, k], 0), flat))  # [2·B·H, 1, M]
        return f[:q.shape[0]], f[q.shape[0]:]

    return features
