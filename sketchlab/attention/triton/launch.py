"""Plain launchers of the fused LLoPS attention kernels, layout ``[B, T, H, D]``.

``llops_attention_fwd`` and ``llops_attention_bwd`` take tensors (any strides: they are made
contiguous here), allocate the outputs, pick the block sizes and launch one program per
(batch, head) (the forward also splits the value dimension). No autograd here: see
:mod:`sketchlab.attention.triton.function`.

Block sizes: ``BLOCK_D``, ``BLOCK_M``, ``BLOCK_DV`` are the next power of two ≥ 16 of ``D``, ``M``,
``Dv`` (``tl.dot`` needs every dimension ≥ 16; padding is masked). Under Triton's interpreter
(``TRITON_INTERPRET=1``, CPU, fp32) the chunk is a fixed 16 tokens and the forward's value block 16
columns; on CUDA ``BLOCK_T`` (and the forward's ``BLOCK_DV``) and the warp count are autotuned
(``SKETCHLAB_TRITON_AUTOTUNE=0``: one fixed config instead, ``_kernels.FWD_FIXED``/``BWD_FIXED``).
"""

from __future__ import annotations

import os

import torch
import triton

from sketchlab.attention.triton import _kernels

__all__ = ["llops_attention_bwd", "llops_attention_fwd"]

#: Chunk length (tokens) under the interpreter: small, so tests on T ∈ {17, 64, 100} cross chunks.
INTERPRET_BLOCK_T = 16
#: The forward's value block under the interpreter: the smallest, so Dv > 16 runs several blocks.
INTERPRET_BLOCK_DV = 16


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _autotuning() -> bool:
    """Autotune on CUDA unless ``SKETCHLAB_TRITON_AUTOTUNE=0`` (then one fixed config: faster to
    compile, used by the broad correctness tests on a GPU)."""
    return os.environ.get("SKETCHLAB_TRITON_AUTOTUNE", "1") != "0"


def _block(n: int) -> int:
    """Next power of two ≥ max(n, 16)."""
    return max(16, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision: exact fp32 products for fp32 inputs; TF32 for 16-bit inputs, whose
    own rounding (2⁻⁸ for bf16) dominates TF32's (2⁻¹¹)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _empty(shape, *, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every buffer the kernels write is allocated here (tests fill it with NaN instead, so an
    element the kernel fails to write shows)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype if dtype is None else dtype)


def _theta_strides(theta: torch.Tensor):
    return theta.stride()  # [H, R, P, D, M]


def llops_attention_fwd(q, k, v, theta_q, theta_k, *, causal: bool, normalize: bool, non_negative: bool, eps: float):
    """Fused forward of LLoPS linear attention.

    Parameters
    ----------
    q : Tensor [B, T, H, D]
    k : Tensor [B, S, H, D]
    v : Tensor [B, S, H, Dv]
        ``S == T`` when ``causal``.
    theta_q, theta_k : Tensor [H, R, P, D, M]
        LLoPS factors per head: ``φ(x) = Σ_r ∏_j x Θ_{r,j}``.
    causal : bool
        ``s ≤ t`` (True) or all ``s``.
    normalize : bool
        Divide by ``Σ_s a_ts + eps`` (True) or not.
    non_negative : bool
        Features ``φ ⊗ φ`` (scores ``a_ts = (φ(q_t)·φ(k_s))² ≥ 0``), formed chunk by chunk in
        registers; the state is then ``[M², Dv]`` (padded to ``BLOCK_M²``).
    eps : float

    Returns
    -------
    out : Tensor [B, T, H, Dv], dtype of ``v``
    den : Tensor [B, T, H] fp32, ``Σ_s a_ts + eps`` (empty ``[0]`` when not ``normalize``)
    """
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    theta_q, theta_k = theta_q.contiguous(), theta_k.contiguous()
    B, T, H, D = q.shape
    DV = v.shape[-1]
    _, R, P, _, M = theta_q.shape
    out = _empty((B, T, H, DV), like=v)
    den = _empty((B, T, H) if normalize else (0,), like=q, dtype=torch.float32)
    den_strides = den.stride() if normalize else (0, 0, 0)
    args = (
        q, k, v, theta_q, theta_k, out, den,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *den_strides,
        *_theta_strides(theta_q), *_theta_strides(theta_k),
        H, T, k.shape[1], R, P, D, M, DV, float(eps),
    )
    meta = dict(
        CAUSAL=bool(causal), NORMALIZE=bool(normalize), SELF=bool(non_negative),
        BLOCK_D=_block(D), BLOCK_M=_block(M), BLOCK_F=_block(M) ** (2 if non_negative else 1),
        PREC=_precision(q.dtype),
    )
    if _interpreting():
        _kernels.llops_fwd_kernel[(B * H, triton.cdiv(DV, INTERPRET_BLOCK_DV))](
            *args, **meta, BLOCK_T=INTERPRET_BLOCK_T, BLOCK_DV=INTERPRET_BLOCK_DV,
        )
    elif _autotuning():
        grid = lambda META: (B * H, triton.cdiv(DV, META["BLOCK_DV"]))  # noqa: E731
        _kernels.llops_fwd_kernel_tuned[grid](*args, **meta)
    else:
        block_t, block_dv, warps = _kernels.FWD_FIXED
        block_dv = min(block_dv, _block(DV))
        _kernels.llops_fwd_kernel[(B * H, triton.cdiv(DV, block_dv))](
            *args, **meta, BLOCK_T=block_t, BLOCK_DV=block_dv, num_warps=warps,
        )
    return out, den


def llops_attention_bwd(q, k, v, theta_q, theta_k, out, den, grad_out, *, causal: bool, normalize: bool,
                        non_negative: bool):
    """Fused backward of :func:`llops_attention_fwd`: features recomputed, no per-chunk states stored.

    Parameters
    ----------
    q, k, v, theta_q, theta_k, causal, normalize, non_negative : as in :func:`llops_attention_fwd`
    out : Tensor [B, T, H, Dv]
        The forward's output (used only when ``normalize``).
    den : Tensor [B, T, H] fp32
        The forward's ``Σ_s a_ts + eps`` (used only when ``normalize``).
    grad_out : Tensor [B, T, H, Dv]

    Returns
    -------
    dq : Tensor [B, T, H, D]
    dk : Tensor [B, S, H, D]
    dv : Tensor [B, S, H, Dv]
    dtheta_q, dtheta_k : Tensor [H, R, P, D, M]

    Notes
    -----
    With ``normalize``, ``out_t = N_t / den_t`` gives ``∂L/∂N_t = dO_t / den_t =: g_t`` and
    ``∂L/∂den_t = -(dO_t·out_t)/den_t =: c_t``, so ``∂L/∂a_ts = g_t·v_s + c_t``; these two O(T·Dv)
    tensors are formed here in fp32 and the kernel does the rest (see ``_kernels``).
    """
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    theta_q, theta_k = theta_q.contiguous(), theta_k.contiguous()
    B, T, H, D = q.shape
    DV = v.shape[-1]
    _, R, P, _, M = theta_q.shape
    g = grad_out.to(torch.float32)
    if normalize:
        g = g / den[..., None]  # [B, T, H, Dv]
        c = -(g * out.to(torch.float32)).sum(-1).contiguous()  # [B, T, H]
        c_strides = c.stride()
    else:
        c = torch.empty(0, device=q.device, dtype=torch.float32)
        c_strides = (0, 0, 0)
    g = g.contiguous()
    dq = _empty(q.shape, like=q)
    dk = _empty(k.shape, like=k)
    dv = _empty(v.shape, like=v)
    dtq = _empty((B, H, R, P, D, M), like=theta_q, dtype=torch.float32)  # per (b, h) slices
    dtk = _empty((B, H, R, P, D, M), like=theta_k, dtype=torch.float32)
    args = (
        q, k, v, theta_q, theta_k, g, c, dq, dk, dv, dtq, dtk,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *c_strides,
        *dq.stride(), *dk.stride(), *dv.stride(),
        *_theta_strides(theta_q), *_theta_strides(theta_k), *dtq.stride(),
        H, T, k.shape[1], R, P, D, M, DV,
    )
    meta = dict(
        CAUSAL=bool(causal), NORMALIZE=bool(normalize), SELF=bool(non_negative),
        BLOCK_D=_block(D), BLOCK_M=_block(M), BLOCK_F=_block(M) ** (2 if non_negative else 1),
        BLOCK_DV=_block(DV), PREC=_precision(q.dtype),
    )
    if _interpreting():
        _kernels.llops_bwd_kernel[(B * H,)](*args, **meta, BLOCK_T=INTERPRET_BLOCK_T)
    elif _autotuning():
        _kernels.llops_bwd_kernel_tuned[(B * H,)](*args, **meta)
    else:
        block_t, warps = _kernels.BWD_FIXED
        _kernels.llops_bwd_kernel[(B * H,)](*args, **meta, BLOCK_T=block_t, num_warps=warps)
    dtheta_q = dtq.sum(0).to(theta_q.dtype)  # [H, R, P, D, M]
    dtheta_k = dtk.sum(0).to(theta_k.dtype)
    return dq, dk, dv, dtheta_q, dtheta_k
