"""Attention through polynomial sketches (layout ``[B, T, H, D]`` everywhere).

``reference`` holds the naive float64 twins every fast path is tested against, ``chunked`` the
PyTorch chunked linear attention (the CPU path), ``functional`` the public entry points with the
backend choice, ``module`` the :class:`LLoPSAttention` block, ``triton`` the fused kernel
(imported lazily, only for ``backend="triton"``).
"""

from .chunked import feature_attention, llops_attention_chunked
from .memory import MemoryState, memory_attention, memory_attention_naive
from .options import AttentionOptions, FarParams
from .module import LLoPSAttention, llops_is_non_negative
from .state import AttentionState
from ._checks import count_denominators
from .functional import BACKENDS, dump_segments, featuremap_attention, llops_attention, poly_attention, resolve_backend, sketch_attention, softmax_attention
from .reference import (
    attention_mask,
    feature_attention_naive,
    kernel_attention_naive,
    llops_attention_naive,
    poly_attention_naive,
    softmax_attention_naive,
)

__all__ = [
    "AttentionOptions",
    "AttentionState",
    "FarParams",
    "MemoryState",
    "BACKENDS",
    "LLoPSAttention",
    "dump_segments",
    "attention_mask",
    "count_denominators",
    "feature_attention",
    "feature_attention_naive",
    "featuremap_attention",
    "kernel_attention_naive",
    "llops_attention",
    "llops_attention_chunked",
    "llops_attention_naive",
    "llops_is_non_negative",
    "memory_attention",
    "memory_attention_naive",
    "poly_attention",
    "poly_attention_naive",
    "resolve_backend",
    "sketch_attention",
    "softmax_attention",
    "softmax_attention_naive",
]
