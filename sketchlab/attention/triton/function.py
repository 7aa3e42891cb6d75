"""Autograd wrappers and public entry of the fused LLoPS attention kernels, layout ``[B, T, H, D]``.

Two kernels: pure linear attention (``_kernels``, causal or not, optionally from a carried state)
and the causal sliding-window hybrid (``_hybrid``: exact softmax or polynomial attention over the
window and the sinks, LLoPS features beyond, one shared denominator, a gate per head).
"""

from __future__ import annotations

import os

import torch
from torch.autograd.function import once_differentiable

from sketchlab.attention.state import AttentionState, state_dtype, state_in
from sketchlab.attention.triton.launch import (
    hybrid_attention_bwd,
    hybrid_attention_fwd,
    llops_attention_bwd,
    llops_attention_fwd,
)
from sketchlab.llops.maps import llops_features
from sketchlab.polynomial import self_tensor

__all__ = ["HybridAttentionTriton", "LLoPSAttentionTriton", "llops_attention_triton"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LLoPSAttentionTriton(torch.autograd.Function):
    """Fused LLoPS attention: the forward saves its inputs, output and denominators; the backward
    recomputes the features (see :mod:`sketchlab.attention.triton._kernels`). ``s0, z0``: the
    carried state (causal) or None. First derivatives only (a second backward raises)."""

    @staticmethod
    def forward(ctx, q, k, v, theta_q, theta_k, s0, z0, causal: bool, normalize: bool, non_negative: bool, eps: float):
        state = None if s0 is None else (s0, z0)
        out, den = llops_attention_fwd(q, k, v, theta_q, theta_k, causal=causal, normalize=normalize,
                                       non_negative=non_negative, eps=eps, initial_state=state)
        ctx.save_for_backward(q, k, v, theta_q, theta_k, out, den, s0, z0)
        ctx.causal, ctx.normalize, ctx.non_negative = causal, normalize, non_negative
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, theta_q, theta_k, out, den, s0, z0 = ctx.saved_tensors
        state = None if s0 is None else (s0, z0)
        dq, dk, dv, dtq, dtk, dstate = llops_attention_bwd(
            q, k, v, theta_q, theta_k, out, den, grad_out, causal=ctx.causal, normalize=ctx.normalize,
            non_negative=ctx.non_negative, initial_state=state,
        )
        ds0, dz0 = (None, None) if dstate is None else (dstate[0].to(s0.dtype), dstate[1].to(z0.dtype))
        return dq, dk, dv, dtq, dtk, ds0, dz0, None, None, None, None


class HybridAttentionTriton(torch.autograd.Function):
    """Fused causal hybrid attention (see :mod:`sketchlab.attention.triton._hybrid`): inputs
    ``q, k, v`` (``k, v`` with the carried keys in front, ``qoff`` rows), Θ's, the gate ``γ [H]``
    and the carried far state ``s0, z0`` (or None); gradients to all of them. ``key_valid`` (bool
    ``[B, NK]`` or None) marks the real keys (padded ones zeroed by the caller)."""

    @staticmethod
    def forward(ctx, q, k, v, theta_q, theta_k, gate, s0, z0, key_valid, qoff: int, window: int, sinks: int,
                softmax: bool, scale: float, non_negative: bool, eps: float, causal: bool):
        state = None if s0 is None else (s0, z0)
        out, den, cmax, arg = hybrid_attention_fwd(
            q, k, v, theta_q, theta_k, gate, qoff=qoff, window=window, sinks=sinks, softmax=softmax, scale=scale,
            non_negative=non_negative, eps=eps, initial_state=state, key_valid=key_valid, causal=causal,
        )
        ctx.save_for_backward(q, k, v, theta_q, theta_k, gate, s0, z0, key_valid, out, den, cmax, arg)
        ctx.opts = dict(qoff=qoff, window=window, sinks=sinks, softmax=softmax, scale=scale, non_negative=non_negative,
                        causal=causal)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, theta_q, theta_k, gate, s0, z0, key_valid, out, den, cmax, arg = ctx.saved_tensors
        state = None if s0 is None else (s0, z0)
        dq, dk, dv, dtq, dtk, dgate, dstate = hybrid_attention_bwd(
            q, k, v, theta_q, theta_k, gate, out, den, cmax, arg, grad_out, initial_state=state,
            key_valid=key_valid, **ctx.opts,
        )
        ds0, dz0 = (None, None) if dstate is None else (dstate[0].to(s0.dtype), dstate[1].to(z0.dtype))
        return (dq, dk, dv, dtq, dtk, dgate.to(gate.dtype), ds0, dz0) + (None,) * 9


def llops_attention_triton(q, k, v, theta_q, theta_k, options, *, gate=None, key_padding_mask=None, initial_state=None,
                           output_final_state: bool = False):
    r"""LLoPS linear attention, or the sliding-window hybrid, through the fused Triton kernels: the backend
    :func:`sketchlab.attention.linear_attention` runs for two LLoPS maps (arguments checked by linear_attention).

    Parameters
    ----------
    q : Tensor [B, T, H, D]
    k : Tensor [B, S, H, D]
    v : Tensor [B, S, H, Dv]
        ``S == T`` when causal.
    theta_q, theta_k : Tensor [H, R, P, D, M]
        Per-head LLoPS factors, ``φ(x)_i = Σ_r ∏_j ⟨Θ_{r,j}[:, i], x⟩``.
    options : AttentionOptions
        Built and resolved by the caller (``normalize`` and ``non_negative`` decided:
        :meth:`~sketchlab.attention.AttentionOptions.resolve`) and read as given: ``causal``, ``normalize``,
        ``non_negative`` (the state then holds ``M²``), ``eps``, the hybrid's ``window`` (0: the pure kernel),
        ``sinks``, ``local`` (``"poly"`` uses Θ's ``p``) and ``local_scale`` (None: ``1/√D``); the formula is
        :func:`~sketchlab.attention.ops.additive.naive.feature_attention_naive`'s. ``φ ⊗ φ`` is formed chunk by
        chunk in registers, never in memory; the running state is then ``[M², Dv]``. The memory options and
        ``backend``, ``chunk_size``, ``block_chunks``, ``denominator_check`` are not this kernel's.
    gate : None or Tensor [H]
        Logits of ``g = sigmoid(gate)`` (None: ``g = 1/2``); unused without a window.
    key_padding_mask : None or bool Tensor [B, S]
        True = a real key. A padded key leaves every sum (and the state); positions (window,
        sinks) still count it, as in :func:`~sketchlab.attention.ops.additive.naive.feature_attention_naive`.
    initial_state : None or AttentionState
        Causal only: the state of the tokens before this call (returned by an earlier call with
        the same options and ``output_final_state=True``, on any backend), checked by the op; read in the
        kernel's working dtype.
    output_final_state : bool
        Also return the :class:`~sketchlab.attention.AttentionState` after this call's tokens (causal only).

    Returns
    -------
    Tensor [B, T, H, Dv], or ``(out, AttentionState)`` with ``output_final_state``; differentiable in
    q, k, v, theta_q, theta_k, the gate and the initial state's tensors. Splitting a sequence and
    carrying the state gives the whole sequence's output.

    Notes
    -----
    The arguments are checked by :func:`sketchlab.attention.linear_attention`, once: the shapes, dtypes,
    devices and finiteness of q, k, v, Θ, the gate and the mask, the options (built and checked by their
    one set of rules), the non-causal window's ``T == S``. Here only what the kernel itself cannot do is
    rejected (a dtype other than fp32, fp16, bf16; a tensor off CUDA without the interpreter), and the
    carried state is checked against this call as the torch backend
    (:func:`~sketchlab.attention.ops.additive.chunk.chunk_attention`) checks it. Inputs of any strides are
    accepted (made contiguous). On CPU tensors the kernel runs only in Triton's interpreter
    (``TRITON_INTERPRET=1``, fp32).

    The carried window keys' far contributions are recomputed in the kernel from their keys and
    ``theta_k`` (the state's ``phi_window`` is used only to fold them into ``S, z`` when they
    leave); the two agree while Θ_K is the one that made the state. The final state is assembled in
    torch from the keys that leave the window: ``S += Σ φ(k)ᵀv``, ``z += Σ φ(k)`` (autograd flows
    through it). States follow the torch path's dtype rule
    (:func:`~sketchlab.attention.state.state_dtype`): every floating field of the returned state is
    float32 (the held keys and values too, for fp16/bf16 inputs), and an ``initial_state`` of
    another floating dtype is cast to float32, so states pass between the backends as they are.
    """
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
    causal, non_negative, eps = options.causal, options.non_negative, options.eps
    window, sinks = options.window, options.sinks
    B, T, H, D = q.shape
    mask = key_padding_mask
    st = None if initial_state is None else state_in(initial_state, state_dtype(q.dtype))  # checked by the op
    s0 = None if st is None else st.S
    z0 = None if st is None else st.z
    P0 = 0 if st is None else st.offset
    valid = torch.ones(B, k.shape[1], dtype=torch.bool, device=q.device) if mask is None else mask  # [B, S]
    win_valid = sink_valid = None
    if st is not None:
        ls, lw = st.k_sink.shape[2], st.k_window.shape[2]
        sink_valid = torch.ones(B, ls, dtype=torch.bool, device=q.device) if st.mask_sink is None else st.mask_sink
        win_valid = torch.ones(B, lw, dtype=torch.bool, device=q.device) if st.mask_window is None else st.mask_window
    masked = mask is not None or (st is not None and (st.mask_sink is not None or st.mask_window is not None))

    def zero_padded(x, ok):  # x [B, n, H, ·]; a padded key becomes 0 (φ(0) = 0: it leaves the far sums)
        return torch.where(ok[:, :, None, None], x, torch.zeros((), dtype=x.dtype, device=x.device))

    if not window:  # the pure kernel (a gate is unused)
        out = LLoPSAttentionTriton.apply(q, zero_padded(k, valid) if mask is not None else k, v, theta_q, theta_k,
                                         s0, z0, causal, options.normalize == "sum", non_negative, eps)
    else:
        scale = D ** -0.5 if options.local_scale is None else options.local_scale
        gam = (torch.full((H,), 0.5, device=q.device, dtype=torch.float32) if gate is None
               else torch.sigmoid(gate.to(torch.float32)))  # [H]
        if st is None:
            kx, vx, qoff, kvalid = k, v, 0, valid
        else:  # the carried sinks, the carried window without its sink positions, this call's keys
            keep = torch.arange(P0 - lw, P0, device=q.device) >= ls  # [lw]
            kx = torch.cat([st.k_sink.transpose(1, 2).to(k.dtype), st.k_window[:, :, keep].transpose(1, 2).to(k.dtype),
                            k], 1)  # [B, qoff + T, H, D]
            vx = torch.cat([st.v_sink.transpose(1, 2).to(v.dtype), st.v_window[:, :, keep].transpose(1, 2).to(v.dtype),
                            v], 1)
            kvalid = torch.cat([sink_valid, win_valid[:, keep], valid], 1)  # [B, qoff + T]
            qoff = kx.shape[1] - T
        if masked:
            kx = zero_padded(kx, kvalid)
        out = HybridAttentionTriton.apply(q, kx, vx, theta_q, theta_k, gam, s0, z0, kvalid if masked else None,
                                          int(qoff), window, sinks, options.local == "softmax", scale, non_negative,
                                          eps, causal)
    if not output_final_state:
        return out
    return out, _final_state(st, k, v, valid, win_valid, sink_valid, theta_k, P0=P0, window=window, sinks=sinks,
                             non_negative=non_negative, masked=masked)


def _final_state(st, k, v, valid, win_valid, sink_valid, theta_k, *, P0: int, window: int, sinks: int,
                 non_negative: bool, masked: bool) -> AttentionState:
    """The state after this call's keys (torch, autograd; every floating field in
    :func:`~sketchlab.attention.state.state_dtype` of the inputs', float32; ``st`` is already in it).

    The rows not yet in ``S``: the carried window (positions ``P0 − L_w …``) and this call's keys
    (``k [B, T, H, D]``, positions ``P0 …``). Real keys at positions ``sinks ≤ j < end − w`` enter
    ``S, z``; the last ``min(w, end)`` positions form the new window (sink positions included, as
    the state's layout holds them), and the positions ``< sinks`` not yet held join the sinks.
    """
    B, T, H, D = k.shape
    end = P0 + T
    dt = state_dtype(k.dtype)
    k_new, v_new = k.transpose(1, 2).to(dt), v.transpose(1, 2).to(dt)  # [B, H, T, ·]
    phi_new = llops_features(k_new, theta_k.to(dt))  # [B, H, T, M]
    if st is None:
        r_k, r_v, r_f, r_valid = k_new, v_new, phi_new, valid
        lw, old_s = 0, 0
    else:
        r_k = torch.cat([st.k_window, k_new], 2) if window else k_new
        r_v = torch.cat([st.v_window, v_new], 2)
        r_f = torch.cat([st.phi_window, phi_new], 2)
        r_valid = torch.cat([win_valid, valid], 1)  # [B, R]
        lw, old_s = st.k_window.shape[2], st.k_sink.shape[2]
    r_pos = torch.arange(P0 - lw, end, device=k.device)  # [R]
    enters = r_valid & ((r_pos >= sinks) & (r_pos < end - window))[None, :]  # [B, R]
    lf = (self_tensor(r_f) if non_negative else r_f) * enters[:, None, :, None]  # [B, H, R, F]
    S = lf.mT @ r_v  # [B, H, F, Dv]
    z = lf.sum(2)  # [B, H, F]
    if st is not None:
        S = S + st.S
        z = z + st.z
    keep_w = r_pos >= end - window
    take = (r_pos < sinks) & (r_pos >= old_s)
    if st is None:
        k_sink, v_sink, m_sink = r_k[:, :, take], r_v[:, :, take], r_valid[:, take]
    else:
        k_sink = torch.cat([st.k_sink, r_k[:, :, take]], 2)
        v_sink = torch.cat([st.v_sink, r_v[:, :, take]], 2)
        m_sink = torch.cat([sink_valid, r_valid[:, take]], 1)
    return AttentionState(
        S=S, z=z, k_window=r_k[:, :, keep_w], v_window=r_v[:, :, keep_w], phi_window=r_f[:, :, keep_w],
        k_sink=k_sink, v_sink=v_sink, offset=end,
        mask_window=r_valid[:, keep_w] if masked else None, mask_sink=m_sink if masked else None,
    )
