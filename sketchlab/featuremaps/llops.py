r"""LLoPS as a feature map: :class:`LLoPSMap` (``"llops"``; two of them go to the fused kernel)."""

from __future__ import annotations

import math

import torch

from .._validation import as_float_tensor, check_degree, check_positive_int
from .base import FeatureMap, _checked_theta, _init_heads, _store

__all__ = ["LLoPSMap"]

class LLoPSMap(FeatureMap):
    r"""The LLoPS map per head, :math:`\phi(x)_i = \sum_r \prod_j \langle\theta_{r,j,:,i}, x\rangle`.

    Parameters
    ----------
    heads, head_dim : int
    p, m, rank : int
        Degree, features ``M`` and CP rank ``t`` of a fresh Θ ``[H, t, p, D, M]``: equal factors
        :math:`\theta_{r,1} = \dots = \theta_{r,p} \sim N(0, 1/D)` (non-negative for even ``p``).
    theta : Tensor ``[H, t, p, D, M]`` or None
        A given Θ (e.g. an export's layer) instead; ``p, m, rank`` must then match it or be left at None.
    learn : bool
        Θ as a parameter (trained) or a buffer.
    seed : int
    """

    def __init__(self, heads: int, head_dim: int, *, p: int | None = None, m: int | None = None,
                 rank: int | None = None, theta=None, learn: bool = True, seed: int = 0, dtype=torch.float32):
        super().__init__()
        _init_heads(self, heads, head_dim)
        if theta is None:
            p, m, rank = check_degree(2 if p is None else p), check_positive_int(64 if m is None else m, "m"), \
                check_positive_int(1 if rank is None else rank, "rank")
            gen = torch.Generator().manual_seed(seed)
            base = torch.randn(self.heads, rank, 1, self.head_dim, m, generator=gen, dtype=torch.float64)
            theta = (base / math.sqrt(self.head_dim)).expand(-1, -1, p, -1, -1).to(dtype)
        theta = _checked_theta(self, theta, ("H", "t", "p", "D", "M"))
        for name, want, axis in (("p", p, 2), ("m", m, 4), ("rank", rank, 1)):
            if want is not None and want != theta.shape[axis]:
                raise ValueError(f"theta has {name}={theta.shape[axis]} (axis {axis} of [H, t, p, D, M]) but {name}={want}")
        _store(self, "theta", theta, learn)

    @classmethod
    def over(cls, theta) -> LLoPSMap:
        r"""The map of this very Θ ``[H, t, p, D, M]``, held as a buffer and not copied, so gradients reach
        ``theta``: a functional call of :func:`~sketchlab.attention.linear_attention` on a Θ the caller owns
        (as fla's ops take their weights).

        Parameters
        ----------
        theta : Tensor ``[H, t, p, D, M]``
            Floating; ``H, D >= 1``.

        Returns
        -------
        LLoPSMap
            ``heads = H``, ``head_dim = D``; ``map.theta is theta`` for a floating tensor (anything else is
            converted first, then held). A map over a non-leaf Θ (one computed with autograd) cannot be deep-copied
            (``select_heads``, ``copy.deepcopy``): build ``LLoPSMap(H, D, theta=...)`` for a map of its own.
        """
        theta = as_float_tensor(theta, "theta")
        if theta.ndim != 5:
            raise ValueError(f"theta must have shape [H, t, p, D, M] (rank 5), got {tuple(theta.shape)}")
        fmap = cls.__new__(cls)
        FeatureMap.__init__(fmap)
        _init_heads(fmap, theta.shape[0], theta.shape[3])
        fmap.register_buffer("theta", theta)
        return fmap

    @property
    def num_features(self) -> int:
        return self.theta.shape[-1]

    @property
    def degree(self) -> int:
        return self.theta.shape[2]

    @property
    def non_negative(self) -> bool:
        from ..llops.maps import llops_is_non_negative

        return llops_is_non_negative(self.theta)

    def _features(self, x):
        from ..llops.maps import llops_feature_fn

        dtype = torch.promote_types(x.dtype, self.theta.dtype)
        out = llops_feature_fn(self.theta.to(dtype))(x.to(dtype).transpose(1, 2))  # [B, H, T, M]
        return out.transpose(1, 2)  # [B, T, H, M]

    def _features_naive(self, x, head):  # Θ not detached: the op's reference backend passes gradients to Θ
        from ..llops.maps import llops_features_naive

        return llops_features_naive(x, self.theta[head])
