r"""PolySketchFormer's learned sketch: :class:`PSFLearnedMap` (``"psf-learned"``, self-tensored by the registry)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validation import check_degree, check_positive_int
from .base import FeatureMap, _init_heads

__all__ = ["PSFLearnedMap"]

class PSFLearnedMap(FeatureMap):
    r"""PolySketchFormer's learned sketch per head: ``LayerNorm(D) → Linear(D, hidden) → GELU →
    Linear(hidden, m)`` (signed features; wrap in :class:`SelfTensored` for PSF's non-negative
    degree-``2·degree`` form, as :func:`make_feature_map` does).

    ``degree`` is the degree the sketch stands for before self-tensoring (PSF learns the degree
    ``p/2`` sketch); it only sets the hybrid's ``local="poly"`` degree.
    """

    def __init__(self, heads: int, head_dim: int, *, m: int = 8, hidden: int | None = None, degree: int = 1,
                 seed: int = 0, dtype=torch.float32):
        super().__init__()
        _init_heads(self, heads, head_dim)
        m = check_positive_int(m, "m")
        hidden = check_positive_int(4 * self.head_dim if hidden is None else hidden, "hidden")
        self._degree = check_degree(degree)
        gen = torch.Generator().manual_seed(seed)
        H, D = self.heads, self.head_dim

        def uniform(*shape, fan_in):  # nn.Linear's default range, from our generator
            return ((torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(fan_in)).to(dtype)

        self.ln_weight = nn.Parameter(torch.ones(H, D, dtype=dtype))
        self.ln_bias = nn.Parameter(torch.zeros(H, D, dtype=dtype))
        self.w1 = nn.Parameter(uniform(H, D, hidden, fan_in=D))  # [H, D, hidden]
        self.b1 = nn.Parameter(uniform(H, hidden, fan_in=D))
        self.w2 = nn.Parameter(uniform(H, hidden, m, fan_in=hidden))  # [H, hidden, m]
        self.b2 = nn.Parameter(uniform(H, m, fan_in=hidden))
        self.ln_eps = 1e-5

    @property
    def num_features(self) -> int:
        return self.w2.shape[-1]

    @property
    def degree(self) -> int:
        return self._degree

    def _features(self, x):
        dtype = torch.promote_types(x.dtype, self.w1.dtype)
        x = torch.nn.functional.layer_norm(x.to(dtype), (self.head_dim,), eps=self.ln_eps)  # [B, T, H, D]
        x = x * self.ln_weight.to(dtype) + self.ln_bias.to(dtype)  # per-head affine
        h = torch.nn.functional.gelu(torch.einsum("bthd,hde->bthe", x, self.w1.to(dtype)) + self.b1.to(dtype))
        return torch.einsum("bthe,hem->bthm", h, self.w2.to(dtype)) + self.b2.to(dtype)  # [B, T, H, M]

    def _features_naive(self, x, head):
        f64 = torch.float64
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        y = (x - mean) / torch.sqrt(var + self.ln_eps) * self.ln_weight[head].detach().to(f64) + \
            self.ln_bias[head].detach().to(f64)
        pre = y @ self.w1[head].detach().to(f64) + self.b1[head].detach().to(f64)
        h = 0.5 * pre * (1 + torch.erf(pre / math.sqrt(2)))  # exact GELU
        return h @ self.w2[head].detach().to(f64) + self.b2[head].detach().to(f64)
