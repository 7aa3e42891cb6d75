"""Fused Triton kernels of LLoPS linear attention and of the sliding-window hybrid, layout ``[B, T, H, D]``.

Layering (docs/DESIGN.md §2): ``@triton.jit`` kernels (``_kernels``: pure linear attention;
``_hybrid``: exact local + LLoPS far; the device functions both call, a chunk's features and their backward, in
``features``) → plain launchers ``llops_attention_fwd`` / ``_bwd`` and
``hybrid_attention_fwd`` / ``_bwd`` (``launch``) → the ``autograd.Function``s
``LLoPSAttentionTriton`` / ``HybridAttentionTriton`` → the backend ``llops_attention_triton``
(``function``), which ``sketchlab.attention.linear_attention`` calls for two LLoPS maps (``backend="triton"``) with its
checked arguments and resolved ``AttentionOptions``, read as given. The carried state is
:class:`sketchlab.attention.AttentionState`.
"""

from sketchlab.attention.triton.function import HybridAttentionTriton, LLoPSAttentionTriton, llops_attention_triton
from sketchlab.attention.triton.launch import (
    hybrid_attention_bwd,
    hybrid_attention_fwd,
    llops_attention_bwd,
    llops_attention_fwd,
)

__all__ = [
    "HybridAttentionTriton",
    "LLoPSAttentionTriton",
    "hybrid_attention_bwd",
    "hybrid_attention_fwd",
    "llops_attention_bwd",
    "llops_attention_fwd",
    "llops_attention_triton",
]
