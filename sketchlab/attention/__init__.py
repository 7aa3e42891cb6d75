"""Attention through polynomial sketches (layout ``[B, T, H, D]`` everywhere).

``reference`` holds the naive float64 twins every fast path is tested against.
"""

from .reference import (
    attention_mask,
    feature_attention_naive,
    kernel_attention_naive,
    llops_attention_naive,
    poly_attention_naive,
    self_tensor,
    softmax_attention_naive,
)

__all__ = [
    "attention_mask",
    "feature_attention_naive",
    "kernel_attention_naive",
    "llops_attention_naive",
    "poly_attention_naive",
    "self_tensor",
    "softmax_attention_naive",
]
