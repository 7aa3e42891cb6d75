r"""Any map on layer-normalised input: :class:`InputNormed` (the registry's ``input_norm=True``)."""

from __future__ import annotations

import torch
from torch import nn

from .base import FeatureMap, WrappedMap

__all__ = ["InputNormed"]


class InputNormed(WrappedMap):
    r"""The map ``inner`` applied to per-head layer-normalised input with a learnable per-head affine,
    :math:`\phi(\gamma_h \odot (x - \bar x)/\sqrt{\mathrm{var}(x) + \epsilon} + \beta_h)` (as
    PolySketchFormer's learned sketch normalises its input): bounds a polynomial map's magnitude, which
    otherwise grows as ``|x|^p`` (DESIGN §6).

    Parameters
    ----------
    inner : FeatureMap
        The map of the normalised input; its ``num_features``, ``degree`` and ``non_negative`` are this map's.

    Attributes
    ----------
    weight, bias : Parameter ``[H, D]``
        The affine, started at 1 and 0 (in ``inner``'s dtype); ``eps = 1e-5``.
    """

    eps = 1e-5

    def __init__(self, inner: FeatureMap):
        super().__init__()
        if not isinstance(inner, FeatureMap):
            raise TypeError(f"InputNormed wraps a FeatureMap, got {type(inner).__name__}")
        self.inner, self.heads, self.head_dim = inner, inner.heads, inner.head_dim
        dtype = next((t.dtype for t in inner.parameters() if t.is_floating_point()), torch.get_default_dtype())
        self.weight = nn.Parameter(torch.ones(self.heads, self.head_dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.heads, self.head_dim, dtype=dtype))

    def _features(self, x):
        dtype = torch.promote_types(x.dtype, self.weight.dtype)
        y = nn.functional.layer_norm(x.to(dtype), (self.head_dim,), eps=self.eps)  # [B, T, H, D]
        return self.inner._features(y * self.weight.to(dtype) + self.bias.to(dtype))

    def _features_naive(self, x, head):
        w, b = self.weight[head].detach().double(), self.bias[head].detach().double()
        y = torch.empty_like(x)
        for j, row in enumerate(x):  # [D]
            mean = row.sum() / row.numel()
            var = ((row - mean) ** 2).sum() / row.numel()
            y[j] = (row - mean) / torch.sqrt(var + self.eps) * w + b
        return self.inner._features_naive(y, head)
