r"""The tied (element-wise) LLoPS map :class:`TiedLLoPSMap` (``"elementwise"``), each feature
:math:`\sum_r \langle\theta_{r,:,i}, x\rangle^p` (:func:`elementwise_features`), and the element-wise sketch's
fitter (``fit_sketch("elementwise", ...)``).

At rank 1 this is the element-wise polynomial feature map :math:`\phi(x) = (x\Theta)^{\circ p}`, the special case
:math:`\Theta_1 = \dots = \Theta_p` of rank-1 LLoPS: feature ``i`` is :math:`\langle\theta_i, x\rangle^p`. A fit
gives queries and keys their own ``Θ`` (two maps) unless tied, fitted with the same relative kernel loss, optimiser
and budget as the MLP sketch and LLoPS's Adam fit (:mod:`sketchlab.objective`), from a random N(0, 1/d) start.
Even ``p`` gives non-negative features and kernel (conversion's non-negative LLoPS, ``sketchlab.convert.scale``,
is this map); odd ``p`` a signed one (``signed=True``).
"""

from __future__ import annotations

import math

import torch

from .._validation import as_float_tensor, check_positive_int
from ..objective import DEFAULT_LR, DEFAULT_STEPS, train_kernel_sketch
from ._common import check_features_finite, make_generator
from .base import FeatureMap, FittedMaps, _checked_theta, _init_heads, _store
from .heads import batch_features

__all__ = ["TiedLLoPSMap", "elementwise_features", "elementwise_features_naive"]


def elementwise_features(x: torch.Tensor, theta: torch.Tensor, p: int) -> torch.Tensor:
    r""":math:`\sum_r (x\Theta_r)^{\circ p}`: ``x [..., n, D]``, ``theta [..., t, D, M]`` → ``[..., n, M]``.

    Leading axes broadcast (one map per head). Raises ``FloatingPointError`` when the power overflows the dtype
    (inputs too large for ``p``).
    """
    proj = x.to(theta.dtype)[..., None, :, :] @ theta  # [..., t, n, M]
    return check_features_finite((proj**p).sum(-3), x, p, "element-wise sketch")


def elementwise_features_naive(x, theta, p: int) -> torch.Tensor:
    """Float64 twin for ``x[n, d]``, ``theta[t, d, m]``: explicit inner products, then the power, summed over ``t``."""
    x = as_float_tensor(x, "x").to(torch.float64)
    theta = as_float_tensor(theta, "theta").to(torch.float64)
    if x.ndim != 2:
        raise ValueError(f"elementwise_features_naive takes x[n, d], got shape {tuple(x.shape)}")
    if theta.ndim != 3 or theta.shape[1] != x.shape[1]:
        raise ValueError(
            f"elementwise_features_naive takes theta[t, d, m] with d = x.shape[1] = {x.shape[1]}, "
            f"got shape {tuple(theta.shape)}"
        )
    out = torch.zeros(x.shape[0], theta.shape[2], dtype=torch.float64)
    for r in range(theta.shape[0]):
        for i in range(theta.shape[2]):
            dot = torch.zeros(x.shape[0], dtype=torch.float64)
            for a in range(x.shape[1]):
                dot += x[:, a] * theta[r, a, i]
            out[:, i] += dot**p
    return out


class TiedLLoPSMap(FeatureMap):
    r"""Tied LLoPS map per head, :math:`\phi(x)_i = \sum_r \langle\theta_{r,:,i}, x\rangle^p` (:func:`elementwise_features`).

    Parameters
    ----------
    heads, head_dim : int
    theta : Tensor ``[H, t, D, M]``
        One factor per rank term and feature (e.g. :func:`tie_theta` of a fitted Θ; the element-wise sketch: ``t = 1``).
    p : int
        Degree (default 2); even unless ``signed``.
    learn : bool
        Θ as a parameter (trained, and tied by construction) or a buffer.
    signed : bool
        Allow an odd ``p``: the features and the kernel are then signed (the element-wise sketch at odd ``p``).

    Notes
    -----
    For even ``p`` every feature is ``>= 0`` for every input, so a kernel of two such maps is ``>= 0`` and the
    hybrid's far denominators are never negative (:attr:`non_negative`).
    """

    def __init__(self, heads: int, head_dim: int, theta, *, p: int = 2, learn: bool = True, signed: bool = False):
        super().__init__()
        _init_heads(self, heads, head_dim)
        p = check_positive_int(p, "p")
        if not isinstance(signed, bool):
            raise TypeError(f"signed must be a bool, got {signed!r}")
        if p % 2 and not signed:
            raise ValueError(f"TiedLLoPSMap needs an even degree p (features <x, θ>^p >= 0), got p={p} "
                             "(signed=True takes an odd p: signed features)")
        self.p = p
        theta = _checked_theta(self, theta, ("H", "t", "D", "M"))
        _store(self, "theta", theta, learn)

    @property
    def num_features(self) -> int:
        return self.theta.shape[-1]

    @property
    def degree(self) -> int:
        return self.p

    @property
    def non_negative(self) -> bool:
        return self.p % 2 == 0

    def _features(self, x):
        dtype = torch.promote_types(x.dtype, self.theta.dtype)
        return elementwise_features(x.to(dtype).transpose(1, 2), self.theta.to(dtype), self.p).transpose(1, 2)

    def _features_naive(self, x, head):
        return elementwise_features_naive(x, self.theta[head].detach(), self.p)


def _fit_elementwise(q, k, *, p: int, m: int, seed: int = 0, tied: bool = False, steps: int = DEFAULT_STEPS,
                     lr: float = DEFAULT_LR) -> FittedMaps:
    """``fit_sketch("elementwise", ...)``: N(0, 1/d) start from ``seed`` (the query side drawn first), then Adam on
    the kernel loss; rank-1 maps of ``prod(batch)`` heads, one for both sides when ``tied``."""
    if not isinstance(tied, bool):
        raise TypeError(f"tied must be a bool, got {tied!r}")
    gen = make_generator(seed)
    heads, d = math.prod(q.shape[:-2]), q.shape[-1]

    def draw():
        # Draw on the CPU generator (same seed → same start on every device), then move to q's device.
        theta = torch.randn(heads, 1, d, m, generator=gen, dtype=torch.float64) / math.sqrt(d)
        return TiedLLoPSMap(heads, d, theta.to(device=q.device, dtype=q.dtype), p=p, signed=True)

    map_q = draw()
    map_k = map_q if tied else draw()
    params = list(map_q.parameters()) if tied else [*map_q.parameters(), *map_k.parameters()]
    flat_q, flat_k = q.reshape(heads, *q.shape[-2:]), k.reshape(heads, *k.shape[-2:])  # [H, n, d]
    info = train_kernel_sketch(params, lambda a, b: (batch_features(map_q, a), batch_features(map_k, b)),
                               flat_q, flat_k, p, steps=steps, lr=lr, what="element-wise sketch")
    info.update({key: info[key].reshape(q.shape[:-2]) for key in ("init_rel_fro", "rel_fro") if key in info})
    return FittedMaps(map_q, map_k, info)
