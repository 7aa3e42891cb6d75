"""Autograd wrapper and public entry of the fused LLoPS attention kernel, layout ``[B, T, H, D]``."""

from __future__ import annotations

import os

import torch
from torch.autograd.function import once_differentiable

from sketchlab.attention.triton.launch import llops_attention_bwd, llops_attention_fwd

__all__ = ["LLoPSAttentionTriton", "llops_attention_triton"]

_NORMALIZE = ("none", "sum")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LLoPSAttentionTriton(torch.autograd.Function):
    """Fused LLoPS attention: the forward saves its inputs, output and denominators; the backward
    recomputes the features (see :mod:`sketchlab.attention.triton._kernels`). First derivatives
    only (a second backward raises)."""

    @staticmethod
    def forward(ctx, q, k, v, theta_q, theta_k, causal: bool, normalize: bool, non_negative: bool, eps: float):
        out, den = llops_attention_fwd(q, k, v, theta_q, theta_k, causal=causal, normalize=normalize,
                                       non_negative=non_negative, eps=eps)
        ctx.save_for_backward(q, k, v, theta_q, theta_k, out, den)
        ctx.causal, ctx.normalize, ctx.non_negative = causal, normalize, non_negative
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, theta_q, theta_k, out, den = ctx.saved_tensors
        dq, dk, dv, dtq, dtk = llops_attention_bwd(
            q, k, v, theta_q, theta_k, out, den, grad_out, causal=ctx.causal, normalize=ctx.normalize,
            non_negative=ctx.non_negative,
        )
        return dq, dk, dv, dtq, dtk, None, None, None, None


def llops_attention_triton(q, k, v, theta_q, theta_k, *, causal: bool, normalize: str, non_negative: bool, eps: float):
    """LLoPS linear attention through the fused Triton kernel (forward and backward).

    Parameters
    ----------
    q : Tensor [B, T, H, D]
    k : Tensor [B, S, H, D]
    v : Tensor [B, S, H, Dv]
        ``S == T`` when ``causal``.
    theta_q, theta_k : Tensor [H, R, P, D, M]
        Per-head LLoPS factors, ``φ(x)_i = Σ_r ∏_j ⟨Θ_{r,j}[:, i], x⟩``.
    causal : bool
        Sum over ``s ≤ t`` (True) or over all ``s``.
    normalize : {"none", "sum"}
        ``"none"``: ``out_t = Σ_s a_ts v_s``; ``"sum"``: ``out_t = Σ_s a_ts v_s / (Σ_s a_ts + eps)``,
        only safe when ``a_ts = φ(q_t)·φ(k_s) ≥ 0``.
    non_negative : bool
        Use the self-tensored features ``φ ⊗ φ`` (kernel ``(φ(q)·φ(k))² ≥ 0``, ``M²`` features),
        formed chunk by chunk in registers, never in memory; the running state is ``[M², Dv]``.
    eps : float

    Returns
    -------
    Tensor [B, T, H, Dv], differentiable in q, k, v, theta_q, theta_k.

    Notes
    -----
    Shapes, devices and finiteness are checked by the caller
    (:func:`sketchlab.attention.llops_attention`, which validates once); here only what the kernel
    itself cannot do is rejected. Inputs of any strides are accepted (made contiguous). On CPU
    tensors the kernel runs only in Triton's interpreter (``TRITON_INTERPRET=1``, fp32).
    """
    if normalize not in _NORMALIZE:
        raise ValueError(f"normalize must be one of {_NORMALIZE}, got {normalize!r}")
    for name, x in (("q", q), ("k", k), ("v", v), ("theta_q", theta_q), ("theta_k", theta_k)):
        if x.dtype not in _DTYPES:
            raise ValueError(
                f"{name} has dtype {x.dtype}; the Triton kernel takes float32, float16 or bfloat16 "
                "(it accumulates in float32); use backend='torch' or 'reference' for float64"
            )
        if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"{name} is on {x.device}; the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 "
                "set before triton is imported, to interpret it on the CPU); use backend='torch'"
            )
    return LLoPSAttentionTriton.apply(q, k, v, theta_q, theta_k, bool(causal), normalize == "sum", bool(non_negative),
                                      float(eps))
