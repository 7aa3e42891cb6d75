r"""The sparse exact cache's score: how badly the far state recalls a key, :math:`\lVert v - r(k)\rVert^2`
(DESIGN §7, step 2); the greatest stay exact. The naive twin's form (:func:`recall_error`) and the decoding
steps' float64 form (:func:`recall_score`)."""

from __future__ import annotations

import torch

from ..delta.beta import unit

__all__ = ["recall_error", "recall_score"]


def recall_error(S, z, phi, v, *, delta: bool, eps: float) -> torch.Tensor:
    r"""The cache score :math:`\lVert v - r(k)\rVert^2` of keys (``phi [..., M]``, ``v [..., Dv]``)
    against the state ``S [..., M, Dv]``, ``z [..., M]`` (leading axes broadcast): additive
    :math:`r = S^\top\phi/(z\cdot\phi + \varepsilon)` (0 where that denominator is 0: an empty state with
    ``eps = 0``), delta :math:`r = S^\top\hat k`. No gradient."""
    with torch.no_grad():
        if delta:
            r = (unit(phi)[..., None, :] @ S)[..., 0, :]  # [..., Dv]
        else:
            den = (phi * z).sum(-1, keepdim=True) + eps
            r = (phi[..., None, :] @ S)[..., 0, :] / torch.where(den == 0, 1.0, den)  # an empty state (eps = 0): r = 0
        return (v - r).square().sum(-1)


def recall_score(S64: torch.Tensor, scale: torch.Tensor | None, phi: torch.Tensor, v: torch.Tensor, *, delta: bool,
                 eps: float) -> torch.Tensor:
    r"""The cache's score :math:`\lVert v - r\rVert^2` of keys (``phi [B, H, n, M]``, ``v [B, H, n, Dv]``)
    against the float64 far state ``scale·S64`` (``S64 [B, H, M, Dv (+ 1)]``: ``S``, with ``z`` as one
    more column when additive; ``scale [B, H, 1, 1]`` or None for 1), as the schedule computes it: one
    product for the read and its denominator, then the scale; additive :math:`r = S^\top\phi/(z\cdot\phi
    + \varepsilon)` (0 where that denominator is 0), delta :math:`r = S^\top\hat k` (``k̂`` in float64) →
    ``[B, H, n]`` float64. The decoding steps' choices (``ops.cache.recurrent``, ``RecurrentStep``)."""
    phi = phi.double()
    r = (unit(phi) if delta else phi) @ S64  # [B, H, n, Dv (+ 1)]
    if scale is not None:
        r = r * scale
    if not delta:
        den = r[..., -1:] + eps
        r = r[..., :-1] / den.masked_fill_(den == 0, 1.0)
    return (v.double() - r).square().sum(-1)
