"""Autograd wrappers and public entry of the fused LLoPS attention kernels, layout ``[B, T, H, D]``.

Two kernels: pure linear attention (``_kernels``, causal or not, optionally from a carried state)
and the causal sliding-window hybrid (``_hybrid``: exact softmax or polynomial attention over the
window and the sinks, LLoPS features beyond, one shared denominator, a gate per head).
"""

from __future__ import annotations

import numbers
import os

import torch
from torch.autograd.function import once_differentiable

from sketchlab.attention.triton.launch import (
    hybrid_attention_bwd,
    hybrid_attention_fwd,
    llops_attention_bwd,
    llops_attention_fwd,
)
from sketchlab.attention.triton.state import AttentionState
from sketchlab.llops.maps import llops_features

__all__ = ["HybridAttentionTriton", "LLoPSAttentionTriton", "llops_attention_triton"]

_NORMALIZE = ("none", "sum")
_LOCAL = ("softmax", "poly")
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
    and the carried far state ``s0, z0`` (or None); gradients to all of them."""

    @staticmethod
    def forward(ctx, q, k, v, theta_q, theta_k, gate, s0, z0, qoff: int, window: int, sinks: int, softmax: bool,
                scale: float, non_negative: bool, eps: float):
        state = None if s0 is None else (s0, z0)
        out, den, cmax, arg = hybrid_attention_fwd(
            q, k, v, theta_q, theta_k, gate, qoff=qoff, window=window, sinks=sinks, softmax=softmax, scale=scale,
            non_negative=non_negative, eps=eps, initial_state=state,
        )
        ctx.save_for_backward(q, k, v, theta_q, theta_k, gate, s0, z0, out, den, cmax, arg)
        ctx.opts = dict(qoff=qoff, window=window, sinks=sinks, softmax=softmax, scale=scale, non_negative=non_negative)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, theta_q, theta_k, gate, s0, z0, out, den, cmax, arg = ctx.saved_tensors
        state = None if s0 is None else (s0, z0)
        dq, dk, dv, dtq, dtk, dgate, dstate = hybrid_attention_bwd(
            q, k, v, theta_q, theta_k, gate, out, den, cmax, arg, grad_out, initial_state=state, **ctx.opts,
        )
        ds0, dz0 = (None, None) if dstate is None else (dstate[0].to(s0.dtype), dstate[1].to(z0.dtype))
        return (dq, dk, dv, dtq, dtk, dgate.to(gate.dtype), ds0, dz0) + (None,) * 7


def _count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def _features_torch(x: torch.Tensor, theta: torch.Tensor, non_negative: bool) -> torch.Tensor:
    """φ(x) in fp32 through torch (autograd): ``x [B, n, H, D]``, Θ ``[H, R, P, D, M]`` → ``[B, H, n, F]``."""
    phi = llops_features(x.transpose(1, 2).to(torch.float32), theta.to(torch.float32))  # [B, H, n, M]
    if non_negative:
        phi = (phi[..., :, None] * phi[..., None, :]).flatten(-2)  # [B, H, n, M²], index a·M + b
    return phi


def _check_state(state, *, B: int, H: int, D: int, DV: int, F: int, window: int, sinks: int, like: torch.Tensor):
    """Validate a carried state against this call; returns it with its tensors on ``like``'s device."""
    fields = AttentionState._fields
    if not all(hasattr(state, f) for f in fields):
        raise ValueError(f"initial_state must have the fields {fields} (an AttentionState), got {type(state).__name__}")
    offset = state.offset
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or offset < 0:
        raise ValueError(f"initial_state.offset must be an int >= 0, got {offset!r}")
    n_s = min(sinks, offset)
    n_w = min(window, max(offset - sinks, 0))
    want = dict(S=(B, H, F, DV), z=(B, H, F), k_window=(B, H, n_w, D), v_window=(B, H, n_w, DV),
                k_sink=(B, H, n_s, D), v_sink=(B, H, n_s, DV))
    for name, shape in want.items():
        x = getattr(state, name)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"initial_state.{name} must have shape {shape} for offset={offset}, window={window}, sinks={sinks} "
                f"(a state of this call's B, H, features and window), got {got}"
            )
        if x.device != like.device:
            raise ValueError(f"initial_state.{name} is on {x.device}, q on {like.device}")
    return state


def llops_attention_triton(q, k, v, theta_q, theta_k, *, causal: bool, normalize: str, non_negative: bool, eps: float,
                           window: int = 0, sinks: int = 0, local: str = "softmax", local_scale=None, gate=None,
                           key_padding_mask=None, initial_state=None, output_final_state: bool = False):
    r"""LLoPS linear attention, or the sliding-window hybrid, through the fused Triton kernels.

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
        only safe when ``a_ts = φ(q_t)·φ(k_s) ≥ 0``. The hybrid needs ``"sum"``.
    non_negative : bool
        Use the self-tensored features ``φ ⊗ φ`` (kernel ``(φ(q)·φ(k))² ≥ 0``, ``M²`` features),
        formed chunk by chunk in registers, never in memory; the running state is ``[M², Dv]``.
    eps : float
    window, sinks : int >= 0
        The hybrid (when either is > 0; causal only): query ``i`` sees the keys ``i−w < j ≤ i`` and
        ``j < sinks`` (``j ≤ i``) exactly, the other keys ``j ≤ i`` through the features:
        ``o_i = (γ Σ_L a_ij v_j + (1−γ) Σ_F φ(q_i)·φ(k_j) v_j) / (γ Σ_L a_ij + (1−γ) Σ_F φ(q_i)·φ(k_j) + eps)``.
        ``window = sinks = 0`` is the pure linear attention above (no gate), unchanged.
    local : {"softmax", "poly"}
        ``a_ij = exp(s·q_iᵀk_j − c_i)`` with ``c_i = max_L s·q_iᵀk_j`` (part of the definition:
        gradients flow through it), or ``a_ij = (s·q_iᵀk_j)^p`` with the Θ's ``p``.
    local_scale : float > 0 or None
        ``s``; None: ``1/√D``.
    gate : None or Tensor [H]
        Logits of the local weight ``γ = sigmoid(gate)`` per head (differentiable); None: ``γ = 1/2``.
        Unused without the hybrid.
    key_padding_mask : None or bool Tensor [B, S]
        True = a real key. Pure linear attention only (a masked key's features are zero, which
        removes it exactly); the hybrid rejects it (use ``backend='torch'``).
    initial_state : None or AttentionState
        Causal only: the state of the tokens before this call (``(o, state)`` of an earlier call with
        the same options and ``output_final_state=True``); see :class:`~.state.AttentionState`.
    output_final_state : bool
        Also return the state after this call's tokens (causal only).

    Returns
    -------
    Tensor [B, T, H, Dv], or ``(out, AttentionState)`` with ``output_final_state``; differentiable in
    q, k, v, theta_q, theta_k, the gate and the initial state's tensors. Splitting a sequence and
    carrying the state gives the whole sequence's output.

    Notes
    -----
    Shapes, devices and finiteness of q, k, v, Θ are checked by the caller
    (:func:`sketchlab.attention.llops_attention`, which validates once); here only what the kernel
    itself cannot do is rejected, and the new options are validated. Inputs of any strides are
    accepted (made contiguous). On CPU tensors the kernel runs only in Triton's interpreter
    (``TRITON_INTERPRET=1``, fp32). The final state is assembled in torch (fp32) from the tokens
    that leave the window: ``S += Σ φ(k)ᵀv``, ``z += Σ φ(k)`` (autograd flows through it).
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
    window, sinks = _count(window, "window"), _count(sinks, "sinks")
    if local not in _LOCAL:
        raise ValueError(f"local must be one of {_LOCAL}, got {local!r}")
    if not isinstance(output_final_state, bool):
        raise ValueError(f"output_final_state must be True or False, got {output_final_state!r}")
    B, T, H, D = q.shape
    DV = v.shape[-1]
    M = theta_q.shape[-1]
    hybrid = window > 0 or sinks > 0
    stateful = initial_state is not None or output_final_state
    if not causal and (hybrid or stateful):
        what = "window/sinks" if hybrid else "initial_state/output_final_state"
        raise ValueError(f"{what} with causal=False is not in the Triton kernel (the state and the "
                         "kernel's hybrid are causal); use backend='torch'")
    if hybrid and normalize != "sum":
        raise ValueError(f"the hybrid (window={window}, sinks={sinks}) is always normalised: normalize must be "
                         f"'sum', got {normalize!r}")
    if key_padding_mask is not None:
        if hybrid:
            raise ValueError("key_padding_mask with the hybrid (window or sinks > 0) is not in the Triton kernel; "
                             "use backend='torch'")
        if (not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool
                or tuple(key_padding_mask.shape) != (B, k.shape[1])):
            got = (f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}" if isinstance(key_padding_mask, torch.Tensor)
                   else type(key_padding_mask).__name__)
            raise ValueError(f"key_padding_mask must be a bool tensor [B, S] = {(B, k.shape[1])}, got {got}")
        # φ(0) = 0 (every feature is a product of p >= 1 linear forms): a zeroed key drops out exactly
        k = torch.where(key_padding_mask.to(k.device)[:, :, None, None], k, torch.zeros((), dtype=k.dtype, device=k.device))
    F = M * M if non_negative else M
    state = None
    if initial_state is not None:
        state = _check_state(initial_state, B=B, H=H, D=D, DV=DV, F=F, window=window, sinks=sinks, like=q)
    s0 = None if state is None else state.S
    z0 = None if state is None else state.z
    offset = 0 if state is None else int(state.offset)

    if not hybrid:
        out = LLoPSAttentionTriton.apply(q, k, v, theta_q, theta_k, s0, z0, bool(causal), normalize == "sum",
                                         bool(non_negative), float(eps))
        kx, vx = k, v
    else:
        if local_scale is None:
            scale = D ** -0.5
        elif isinstance(local_scale, bool) or not isinstance(local_scale, numbers.Real) or not 0 < local_scale < float("inf"):
            raise ValueError(f"local_scale must be a finite number > 0 or None, got {local_scale!r}")
        else:
            scale = float(local_scale)
        if gate is None:
            gam = torch.full((H,), 0.5, device=q.device, dtype=torch.float32)
        else:
            if not isinstance(gate, torch.Tensor) or tuple(gate.shape) != (H,) or not gate.is_floating_point():
                got = f"{gate.dtype} {tuple(gate.shape)}" if isinstance(gate, torch.Tensor) else type(gate).__name__
                raise ValueError(f"gate must be a float tensor [H] = [{H}] of logits or None, got {got}")
            gam = torch.sigmoid(gate.to(device=q.device, dtype=torch.float32))  # [H]
        if state is None:
            kx, vx, qoff = k, v, 0
        else:  # the carried sinks, then the carried window, then this call's keys: [B, qoff + T, H, ·]
            kx = torch.cat([state.k_sink.transpose(1, 2).to(k.dtype), state.k_window.transpose(1, 2).to(k.dtype), k], 1)
            vx = torch.cat([state.v_sink.transpose(1, 2).to(v.dtype), state.v_window.transpose(1, 2).to(v.dtype), v], 1)
            qoff = state.k_sink.shape[2] + state.k_window.shape[2]
        out = HybridAttentionTriton.apply(q, kx, vx, theta_q, theta_k, gam, s0, z0, int(qoff), window, sinks,
                                          local == "softmax", scale, bool(non_negative), float(eps))
    if not output_final_state:
        return out
    # the final state: kx's rows are [sinks][non-sinks]; the last n_w non-sinks stay, the others fold into S, z
    NK = kx.shape[1]
    n_s = min(sinks, NK)
    n_w = min(window, NK - n_s)
    phi = _features_torch(kx[:, n_s:NK - n_w], theta_k, non_negative)  # [B, H, n, F]
    vf = vx[:, n_s:NK - n_w].transpose(1, 2).to(torch.float32)  # [B, H, n, Dv]
    S = phi.mT @ vf  # [B, H, F, Dv]
    z = phi.sum(2)  # [B, H, F]
    if state is not None:
        S = S + state.S.to(torch.float32)
        z = z + state.z.to(torch.float32)
    final = AttentionState(
        S=S, z=z,
        k_window=kx[:, NK - n_w:].transpose(1, 2), v_window=vx[:, NK - n_w:].transpose(1, 2),
        k_sink=kx[:, :n_s].transpose(1, 2), v_sink=vx[:, :n_s].transpose(1, 2),
        offset=offset + T,
    )
    return out, final
