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

from sketchlab.attention.triton import _hybrid, _kernels

__all__ = ["hybrid_attention_bwd", "hybrid_attention_fwd", "llops_attention_bwd", "llops_attention_fwd"]

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


def llops_attention_fwd(q, k, v, theta_q, theta_k, *, causal: bool, normalize: bool, non_negative: bool, eps: float,
                        initial_state=None):
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
    initial_state : None or (S0 [B, H, F, Dv], z0 [B, H, F])
        Causal only: the carried ``S = Σ φ(k)ᵀv``, ``z = Σ φ(k)`` of earlier tokens (``F = M``, or
        ``M²`` with ``non_negative``, index ``a·M + b``), the start of the recurrence.

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
    s0, z0, state_strides = _state_args(initial_state, q)
    args = (
        q, k, v, theta_q, theta_k, out, den, s0, z0,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *den_strides, *state_strides,
        *_theta_strides(theta_q), *_theta_strides(theta_k),
        H, T, k.shape[1], R, P, D, M, DV, float(eps),
    )
    meta = dict(
        CAUSAL=bool(causal), NORMALIZE=bool(normalize), SELF=bool(non_negative), HAS_STATE=initial_state is not None,
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
                        non_negative: bool, initial_state=None):
    """Fused backward of :func:`llops_attention_fwd`: features recomputed, no per-chunk states stored.

    Parameters
    ----------
    q, k, v, theta_q, theta_k, causal, normalize, non_negative : as in :func:`llops_attention_fwd`
    out : Tensor [B, T, H, Dv]
        The forward's output (used only when ``normalize``).
    den : Tensor [B, T, H] fp32
        The forward's ``Σ_s a_ts + eps`` (used only when ``normalize``).
    grad_out : Tensor [B, T, H, Dv]
    initial_state : None or (S0, z0), as in :func:`llops_attention_fwd`

    Returns
    -------
    dq : Tensor [B, T, H, D]
    dk : Tensor [B, S, H, D]
    dv : Tensor [B, S, H, Dv]
    dtheta_q, dtheta_k : Tensor [H, R, P, D, M]
    dstate : None, or (dS0 [B, H, F, Dv], dz0 [B, H, F]) fp32 when ``initial_state`` is given:
        ``Σ_t φ(q_t)ᵀ g_t`` and ``Σ_t c_t φ(q_t)`` (0 without ``normalize``)

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
    s0, z0, state_strides = _state_args(initial_state, q)
    ds0, dz0 = (_empty(x.shape, like=x, dtype=torch.float32) for x in (s0, z0))  # same strides as s0, z0
    args = (
        q, k, v, theta_q, theta_k, g, c, dq, dk, dv, dtq, dtk, s0, z0, ds0, dz0,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *c_strides,
        *dq.stride(), *dk.stride(), *dv.stride(),
        *_theta_strides(theta_q), *_theta_strides(theta_k), *dtq.stride(), *state_strides,
        H, T, k.shape[1], R, P, D, M, DV,
    )
    meta = dict(
        CAUSAL=bool(causal), NORMALIZE=bool(normalize), SELF=bool(non_negative), HAS_STATE=initial_state is not None,
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
    dstate = None if initial_state is None else (ds0, dz0)
    return dq, dk, dv, dtheta_q, dtheta_k, dstate


def _mask_args(key_valid, like: torch.Tensor):
    """``(KVALID int8 [B, NK], its 2 strides)`` for the hybrid kernels, or an empty placeholder."""
    if key_valid is None:
        return torch.empty(0, device=like.device, dtype=torch.int8), (0, 0)
    kval = key_valid.to(device=like.device, dtype=torch.int8).contiguous()
    return kval, kval.stride()


def _state_args(state, like: torch.Tensor):
    """``(S0, z0, their 7 strides)`` for a kernel: contiguous fp32 copies, or empty placeholders
    (strides 0) when there is no state."""
    if state is None:
        empty = torch.empty(0, device=like.device, dtype=torch.float32)
        return empty, empty, (0,) * 7
    s0, z0 = (x.to(torch.float32).contiguous() for x in state)
    return s0, z0, (*s0.stride(), *z0.stride())


def hybrid_attention_fwd(q, k, v, theta_q, theta_k, gate, *, qoff: int, window: int, sinks: int, softmax: bool,
                         scale: float, non_negative: bool, eps: float, initial_state=None, key_valid=None,
                         causal: bool = True):
    """Fused forward of the sliding-window hybrid (see :mod:`sketchlab.attention.triton._hybrid`).

    Parameters
    ----------
    q : Tensor [B, T, H, D]
    k : Tensor [B, NK, H, D]
    v : Tensor [B, NK, H, Dv]
        ``NK = qoff + T``: the carried sink keys, then the carried window keys (``qoff`` rows in
        all), then the keys of the ``T`` queries; query ``t`` is key index ``qoff + t``.
    theta_q, theta_k : Tensor [H, R, P, D, M]
    gate : Tensor [H]
        The local weight ``γ ∈ [0, 1]`` per head (already through the sigmoid).
    qoff, window, sinks : int
        Key indices ``< sinks`` are sinks; the window is ``qi − window < r ≤ qi``.
    softmax : bool
        Local scores ``exp(s·qᵀk − c_i)`` (True) or ``(s·qᵀk)^p`` (False).
    scale : float
        ``s``.
    non_negative : bool
        Far features ``φ ⊗ φ``.
    eps : float
    initial_state : None or (S0 [B, H, F, Dv], z0 [B, H, F])
        Far state of the tokens folded before the carried keys.
    key_valid : None or bool Tensor [B, NK]
        False for padded keys, which leave the local sums; the caller zeroes those keys (features
        0, so they leave the far sums too).
    causal : bool
        ``r ≤ qi`` (True), or every key with the window ``|qi − r| < window`` (then ``NK = T``,
        ``qoff = 0``, no state).

    Returns
    -------
    out : Tensor [B, T, H, Dv], dtype of ``v``
    den, cmax : Tensor [B, T, H] fp32
        ``den + ε`` and the local row max ``c_i`` (softmax; ``-1e30`` for poly).
    arg : Tensor [B, T, H] int32
        Key index of the local arg-max (softmax).
    """
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    theta_q, theta_k = theta_q.contiguous(), theta_k.contiguous()
    gate = gate.to(torch.float32).contiguous()
    B, T, H, D = q.shape
    NK, DV = k.shape[1], v.shape[-1]
    _, R, P, _, M = theta_q.shape
    out = _empty((B, T, H, DV), like=v)
    den = _empty((B, T, H), like=q, dtype=torch.float32)
    cmax = _empty((B, T, H), like=q, dtype=torch.float32)
    arg = _empty((B, T, H), like=q, dtype=torch.int32)
    s0, z0, state_strides = _state_args(initial_state, q)
    kval, kval_strides = _mask_args(key_valid, q)
    args = (
        q, k, v, theta_q, theta_k, gate, s0, z0, kval, out, den, cmax, arg,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *den.stride(), *state_strides, *kval_strides,
        *_theta_strides(theta_q), *_theta_strides(theta_k),
        H, T, NK, int(qoff), int(window), int(sinks), R, P, D, M, DV, float(scale), float(eps),
    )
    meta = dict(
        CAUSAL=bool(causal), SOFTMAX=bool(softmax), HAS_STATE=initial_state is not None, HAS_MASK=key_valid is not None,
        SELF=bool(non_negative),
        BLOCK_D=_block(D), BLOCK_M=_block(M), BLOCK_F=_block(M) ** (2 if non_negative else 1),
        PREC=_precision(q.dtype),
    )
    if _interpreting():
        _hybrid.hybrid_fwd_kernel[(B * H, triton.cdiv(DV, INTERPRET_BLOCK_DV))](
            *args, **meta, BLOCK_T=INTERPRET_BLOCK_T, BLOCK_DV=INTERPRET_BLOCK_DV,
        )
    else:
        block_t, block_dv, warps = _hybrid.HYBRID_FWD_FIXED
        block_dv = min(block_dv, _block(DV))
        _hybrid.hybrid_fwd_kernel[(B * H, triton.cdiv(DV, block_dv))](
            *args, **meta, BLOCK_T=block_t, BLOCK_DV=block_dv, num_warps=warps,
        )
    return out, den, cmax, arg


def hybrid_attention_bwd(q, k, v, theta_q, theta_k, gate, out, den, cmax, arg, grad_out, *, qoff: int, window: int,
                         sinks: int, softmax: bool, scale: float, non_negative: bool, initial_state=None,
                         key_valid=None, causal: bool = True):
    """Fused backward of :func:`hybrid_attention_fwd` (features and local scores recomputed).

    Parameters
    ----------
    q, k, v, theta_q, theta_k, gate, qoff, window, sinks, softmax, scale, non_negative, initial_state, key_valid, causal
        As in :func:`hybrid_attention_fwd`.
    out, den, cmax, arg
        The forward's outputs.
    grad_out : Tensor [B, T, H, Dv]

    Returns
    -------
    dq : Tensor [B, T, H, D]
    dk : Tensor [B, NK, H, D]
    dv : Tensor [B, NK, H, Dv]
    dtheta_q, dtheta_k : Tensor [H, R, P, D, M]
    dgate : Tensor [H] fp32, ``∂L/∂γ``
    dstate : None, or (dS0 [B, H, F, Dv], dz0 [B, H, F]) fp32

    Notes
    -----
    ``G = dO/den`` and ``C = −G·o`` are formed here; the kernel returns per query
    ``ρ_i = Σ_L a_ij δ_ij`` and ``ζ_i = Σ_F f_ij δ_ij``, so ``∂L/∂γ = Σ (ρ − ζ)``, and, for the
    softmax, the gradient through ``c_i = s·q_iᵀk_{j*}`` (``e_i = −γ ρ_i``) is added here:
    ``dq_i += s e_i k_{j*}``, ``dk_{j*} += s e_i q_i``.
    """
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    theta_q, theta_k = theta_q.contiguous(), theta_k.contiguous()
    gate = gate.to(torch.float32).contiguous()
    B, T, H, D = q.shape
    NK, DV = k.shape[1], v.shape[-1]
    _, R, P, _, M = theta_q.shape
    g = (grad_out.to(torch.float32) / den[..., None]).contiguous()  # [B, T, H, Dv]
    c = -(g * out.to(torch.float32)).sum(-1).contiguous()  # [B, T, H]
    cmax = cmax.contiguous()
    dq = _empty(q.shape, like=q, dtype=torch.float32)
    dk = _empty(k.shape, like=k, dtype=torch.float32)
    dv = _empty(v.shape, like=v)
    dtq = _empty((B, H, R, P, D, M), like=theta_q, dtype=torch.float32)
    dtk = _empty((B, H, R, P, D, M), like=theta_k, dtype=torch.float32)
    rho = _empty((B, T, H), like=q, dtype=torch.float32)
    zeta = _empty((B, T, H), like=q, dtype=torch.float32)
    s0, z0, state_strides = _state_args(initial_state, q)
    ds0, dz0 = (_empty(x.shape, like=x, dtype=torch.float32) for x in (s0, z0))
    kval, kval_strides = _mask_args(key_valid, q)
    args = (
        q, k, v, theta_q, theta_k, gate, s0, z0, kval, g, c, cmax, dq, dk, dv, dtq, dtk, rho, zeta, ds0, dz0,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *c.stride(),
        *dq.stride(), *dk.stride(), *dv.stride(), *state_strides, *kval_strides,
        *_theta_strides(theta_q), *_theta_strides(theta_k), *dtq.stride(),
        H, T, NK, int(qoff), int(window), int(sinks), R, P, D, M, DV, float(scale),
    )
    meta = dict(
        CAUSAL=bool(causal), SOFTMAX=bool(softmax), HAS_STATE=initial_state is not None, HAS_MASK=key_valid is not None,
        SELF=bool(non_negative),
        BLOCK_D=_block(D), BLOCK_M=_block(M), BLOCK_F=_block(M) ** (2 if non_negative else 1),
        BLOCK_DV=_block(DV), PREC=_precision(q.dtype),
    )
    if _interpreting():
        _hybrid.hybrid_bwd_kernel[(B * H,)](*args, **meta, BLOCK_T=INTERPRET_BLOCK_T)
    else:
        block_t, warps = _hybrid.HYBRID_BWD_FIXED
        _hybrid.hybrid_bwd_kernel[(B * H,)](*args, **meta, BLOCK_T=block_t, num_warps=warps)
    if softmax:  # the gradient through c_i = s·q_iᵀk_{j*}
        e = (-scale) * gate * rho  # [B, T, H]: s·e_i
        idx = arg.long()[..., None].expand(B, T, H, D)  # [B, T, H, D]
        dq += e[..., None] * torch.gather(k.to(torch.float32), 1, idx)
        dk.scatter_add_(1, idx, e[..., None] * q.to(torch.float32))
    dgate = (rho - zeta).sum((0, 1))  # [H]
    dstate = None if initial_state is None else (ds0, dz0)
    return (dq.to(q.dtype), dk.to(k.dtype), dv, dtq.sum(0).to(theta_q.dtype), dtk.sum(0).to(theta_k.dtype), dgate,
            dstate)
