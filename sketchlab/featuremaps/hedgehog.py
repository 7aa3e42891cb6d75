r"""Hedgehog (LoLCATs): :class:`HedgehogMap` (``"hedgehog"``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validation import check_positive_int
from .base import FeatureMap, _init_heads

__all__ = ["HedgehogMap"]

class HedgehogMap(FeatureMap):
    r"""Hedgehog (as in LoLCATs): :math:`[\mathrm{softmax}(xW_h), \mathrm{softmax}(-xW_h)]` over
    the ``m/2`` projected features, learnable ``W_h [D, m/2]`` per head (initialised to the
    identity where ``m/2 = D``, else ``N(0, 1/D)``). Non-negative features (``m`` of them)."""

    def __init__(self, heads: int, head_dim: int, *, m: int = 64, seed: int = 0, dtype=torch.float32):
        super().__init__()
        _init_heads(self, heads, head_dim)
        m = check_positive_int(m, "m")
        if m % 2:
            raise ValueError(f"m must be even for Hedgehog ([softmax(xW), softmax(-xW)], m/2 each), got {m}")
        half = m // 2
        if half == self.head_dim:
            w = torch.eye(self.head_dim, dtype=torch.float64).expand(self.heads, -1, -1)
        else:
            gen = torch.Generator().manual_seed(seed)
            w = torch.randn(self.heads, self.head_dim, half, generator=gen, dtype=torch.float64) / math.sqrt(self.head_dim)
        self.weight = nn.Parameter(w.to(dtype).clone())  # [H, D, m/2]

    @property
    def num_features(self) -> int:
        return 2 * self.weight.shape[-1]

    @property
    def non_negative(self) -> bool:
        return True

    def _features(self, x):
        dtype = torch.promote_types(x.dtype, self.weight.dtype)
        u = torch.einsum("bthd,hde->bthe", x.to(dtype), self.weight.to(dtype))  # [B, T, H, m/2]
        return torch.cat([u.softmax(-1), (-u).softmax(-1)], -1)  # [B, T, H, m]

    def _features_naive(self, x, head):
        u = x @ self.weight[head].detach().to(torch.float64)  # [n, m/2]
        pos = torch.exp(u - u.max(-1, keepdim=True).values)
        neg = torch.exp(-u - (-u).max(-1, keepdim=True).values)
        return torch.cat([pos / pos.sum(-1, keepdim=True), neg / neg.sum(-1, keepdim=True)], -1)


def hedgehog_pair_features(map_q: HedgehogMap, map_k: HedgehogMap, batch: int):
    r"""A function ``(q, k) → (φ_Q(q), φ_K(k))`` for decoding one token: ``q, k [B·H, 1, D]`` (rows batch-major,
    ``B = batch``) → ``[B·H, 1, m]`` each; the maps of :meth:`HedgehogMap.features` (tested against them) with
    both sides in one product ``[q; k] @ [W_Q; W_K]`` and one softmax over ``[u; −u]``. The stacked weights
    are made once per version of each (a training step in place makes them again); no gradient."""
    memo = {}

    def features(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            key = tuple((id(m.weight), m.weight._version) for m in (map_q, map_k))
        except RuntimeError:  # inference tensors have no version: made again every call
            key = None
        if key is None or memo.get("key") != key:
            with torch.no_grad():
                memo["w"] = torch.cat([m.weight.detach().repeat(batch, 1, 1) for m in (map_q, map_k)], 0)
                memo["key"] = key
        w = memo["w"]  # [2·B·H, D, m/2]
        u = torch.bmm(torch.cat([q, k], 0).to(w.dtype), w)  # [2·B·H, 1, m/2]
        f = torch.cat([u, -u], 1).softmax(-1).view(u.shape[0], 1, -1)  # [softmax(u) | softmax(−u)]
        return f[:q.shape[0]], f[q.shape[0]:]

    return features
