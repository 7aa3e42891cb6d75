"""Fused Triton kernel of LLoPS linear attention, layout ``[B, T, H, D]``.

Layering (docs/DESIGN.md §2): ``@triton.jit`` kernels (``_kernels``) → plain launchers
``llops_attention_fwd`` / ``llops_attention_bwd`` (``launch``) → the ``autograd.Function``
``LLoPSAttentionTriton`` → the entry ``llops_attention_triton`` (``function``), which
``sketchlab.attention.llops_attention(backend="triton")`` calls.
"""

from sketchlab.attention.triton.function import LLoPSAttentionTriton, llops_attention_triton
from sketchlab.attention.triton.launch import llops_attention_bwd, llops_attention_fwd

__all__ = ["LLoPSAttentionTriton", "llops_attention_bwd", "llops_attention_fwd", "llops_attention_triton"]
