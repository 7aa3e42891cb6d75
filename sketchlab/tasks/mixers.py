r"""Two sequence mixers the recall frontier (:mod:`sketchlab.tasks.frontier`) needs beside the feature maps:
exact softmax attention over a sliding window, and DeltaNet's SiLU feature map.

Importing this module registers the toy attention ``"sliding-window"`` (option ``window``: the ``w`` most
recent keys, the query's own included) and the feature map ``"silu"`` (:class:`SiLUMap`,
``φ(x) = silu(x) = x·σ(x)``, ``M = D``) with its :class:`~sketchlab.tasks.ToyKernel`. DeltaNet (Yang et al.
2024, flash-linear-attention's default ``DeltaNet``) is ``"silu"`` with ``state="delta"``: the delta rule
L2-normalises ``φ(q), φ(k)`` (:func:`sketchlab.attention.ops.delta.beta.unit`), ``beta="input"`` makes β a
function of the token, and the toy model's ``short_conv`` is its short convolution (on the block's input,
shared by ``q, k, v``, where DeltaNet convolves each of them).

References
----------
Yang, Wang, Zhang, Shen, Kim. *Parallelizing Linear Transformers with the Delta Rule over Sequence Length*,
NeurIPS 2024. Arora et al. *Zoology*, ICLR 2024 (``SlidingAttn``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.softmax import _softmax_attention
from ..featuremaps import feature_map_names, register_feature_map
from ..featuremaps.identity import IdentityMap
from .attention import register_feature_map_kernels
from .model import TransformerConfig, register_attention

__all__ = ["SiLUMap", "SlidingWindowAttention"]


class SiLUMap(IdentityMap):
    """``φ(x) = x·σ(x)`` for every head (no parameters; ``M = D``, as the identity map it derives from): DeltaNet's
    query/key activation. Not a polynomial (``degree`` None)."""

    @property
    def degree(self) -> None:
        return None

    def _features(self, x):
        return F.silu(x)

    def _features_naive(self, x, head):
        return x.to(torch.float64) / (1 + torch.exp(-x.to(torch.float64)))


class SlidingWindowAttention(nn.Module):
    """Causal softmax attention of each query on its ``window`` most recent keys (itself included), logits
    ``qᵀk/√D``; layout ``[B, T, H, D]`` in and out. Its state is the last ``window`` keys and values."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _softmax_attention(q, k, v, causal=True, window=self.window)  # [B, T, H, D]


def _window_options(opts: dict, config: TransformerConfig) -> dict:
    unknown = sorted(set(opts) - {"window"})
    if unknown:
        raise ValueError(f"unknown attention option(s) {unknown} for attention 'sliding-window'; it takes ['window']")
    w = opts.get("window")
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"attention 'sliding-window' needs option window, an integer >= 1, got {w!r}")
    return {"window": w}


register_attention("sliding-window", options=_window_options)(
    lambda config, layer: SlidingWindowAttention(config.attention_options["window"]))
if "silu" not in feature_map_names():
    register_feature_map("silu", lambda heads, head_dim, **_: SiLUMap(heads, head_dim))
register_feature_map_kernels()
