"""Attention through feature maps (layout ``[B, T, H, D]`` everywhere): one op, the exact attentions,
the modules, the options and the state types.

:func:`linear_attention` is the op (fla's ``(o, state)``): any :class:`~sketchlab.featuremaps.FeatureMap`,
the hybrid's exact keys, the memory mechanisms and a carried state, as one :class:`AttentionOptions`
says; LLoPS Θ (an :class:`~sketchlab.featuremaps.LLoPSMap`) runs the fused Triton kernel on CUDA.
:func:`softmax_attention` and :func:`poly_attention` are the exact attentions (with their float64
twins); :class:`LLoPSAttention` the block. The backends the op picks live in their modules: ``ops/``
(one folder per mechanism: ``naive`` float64 twins, ``chunk`` the PyTorch CPU path, ``recurrent`` the
decoding step), ``memory`` (the memory mechanisms on features), ``triton`` (the fused kernel, imported
lazily); ``reference`` holds the exact attentions' float64 twins.
"""

from ._checks import count_denominators
from .functional import dump_segments, linear_attention, poly_attention, resolve_backend, softmax_attention
from .memory_state import MemoryState
from .module import LLoPSAttention
from .options import BACKENDS, AttentionOptions, FarParams
from .reference import attention_mask, poly_attention_naive, softmax_attention_naive
from .state import AttentionState

__all__ = [
    "BACKENDS",
    "AttentionOptions",
    "AttentionState",
    "FarParams",
    "LLoPSAttention",
    "MemoryState",
    "attention_mask",
    "count_denominators",
    "dump_segments",
    "linear_attention",
    "poly_attention",
    "poly_attention_naive",
    "resolve_backend",
    "softmax_attention",
    "softmax_attention_naive",
]
