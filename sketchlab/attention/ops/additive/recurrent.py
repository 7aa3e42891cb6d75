r"""The decoding step of the additive state with the sliding-window hybrid: one token after an
:class:`~sketchlab.attention.AttentionState` (tensors ``[B, H, 1, ·]`` inside), with autograd, a new state per
token; the exact keys and the far part read through the one hybrid combine (:mod:`sketchlab.attention.ops.hybrid`).
The lean in-place step for inference is :class:`sketchlab.attention.recurrent.RecurrentStep`, held equal to this one
in float64; the additive write it makes in place is :func:`additive_enter_` here. The formula and its float64 twin: :func:`sketchlab.attention.ops.additive.naive.feature_attention_naive`. Inputs
are trusted (checked by the public entry points).
"""

from __future__ import annotations

import torch

from ..hybrid import combine
from .hybrid_driver import HybridSettings

__all__ = ["additive_enter_", "hybrid_decode_one"]


def hybrid_decode_one(h: HybridSettings, state, q, k, v, fq, fk, valid, counter):
    """The causal hybrid for one new token at position ``P = state.offset``.

    The window key at ``P − w`` (when there is one) leaves: it enters ``S, z`` unless it is a sink
    or padding. The local keys are the rest of the window and the token itself (positions
    ``≥ sinks``) plus the sinks; the far part is ``φ(q)`` against the updated ``S, z``. Equal to
    :func:`~sketchlab.attention.ops.additive.hybrid_driver.hybrid_causal_block` on one token (tested through the
    split-anywhere tests).

    Parameters
    ----------
    h : HybridSettings
    state : AttentionState
    q, k : Tensor ``[B, H, 1, D]``
    v : Tensor ``[B, H, 1, Dv]``
    fq, fk : Tensor ``[B, H, 1, M]``
    valid : Tensor ``[B, 1]`` bool or None
    counter : DenominatorCounter or None

    Returns
    -------
    out : Tensor ``[B, H, 1, Dv]``
    state : AttentionState
        After the token.
    """
    from ...state import AttentionState

    B, H, _, Dv = v.shape
    P, w, sinks = state.offset, h.window, h.sinks
    dev = v.device
    Lw = state.k_window.shape[2]
    mw = torch.ones(B, Lw, dtype=torch.bool, device=dev) if state.mask_window is None else state.mask_window
    mn = torch.ones(B, 1, dtype=torch.bool, device=dev) if valid is None else valid
    S, z = state.S, state.z
    drop = 1 if Lw == w else 0  # the oldest window key, position P − w, leaves the window
    if drop and P - w >= sinks:
        lf = h.lift(state.phi_window[:, :, :1] * mw[:, None, :1, None])  # [B, H, 1, M2]
        S, z = S + lf.mT @ state.v_window[:, :, :1], z + lf[:, :, 0]
    k_sink, v_sink, mask_sink = state.k_sink, state.v_sink, state.mask_sink
    if P < sinks:  # the new token is a sink
        k_sink, v_sink = torch.cat([k_sink, k], 2), torch.cat([v_sink, v], 2)
        if mask_sink is not None or valid is not None:
            old = torch.ones(B, state.k_sink.shape[2], dtype=torch.bool, device=dev) if mask_sink is None else mask_sink
            mask_sink = torch.cat([old, mn], 1)
    loc_k = torch.cat([state.k_window[:, :, drop:], k], 2)  # [B, H, U, D], positions P − Lw + drop … P
    loc_v = torch.cat([state.v_window[:, :, drop:], v], 2)
    loc_m = torch.cat([mw[:, drop:], mn], 1)  # [B, U]
    pos = torch.arange(P - Lw + drop, P + 1, device=dev)
    loc_ok = (loc_m & (pos >= sinks)[None, :])[:, None, None, None, :]  # [B, 1, 1, 1, U]
    sink_ok = torch.ones(1, 1, 1, 1, k_sink.shape[2], dtype=torch.bool, device=dev)
    if mask_sink is not None:
        sink_ok = sink_ok & mask_sink[:, None, None, None, :]
    lq = h.lift(fq)[:, :, None]  # [B, H, 1, 1, M2]
    ex_num, ex_den = h.exact(q[:, :, None], [(loc_k[:, :, None], loc_v[:, :, None], loc_ok),
                                             (k_sink[:, :, None], v_sink[:, :, None], sink_ok)])
    out, den = combine(ex_num, ex_den, lq @ S[:, :, None], (lq @ z[:, :, None, :, None]).squeeze(-1), h.g, eps=h.eps)
    if counter is not None:
        counter.add(den[:, :, 0], mn)
    out = out[:, :, 0]  # [B, H, 1, Dv]
    keep = slice(-min(w, P + 1), None)
    win_k, win_v = torch.cat([state.k_window, k], 2), torch.cat([state.v_window, v], 2)
    win_f = torch.cat([state.phi_window, fk], 2)
    has_mask = state.mask_window is not None or valid is not None
    new_state = AttentionState(
        S=S, z=z, k_window=win_k[:, :, keep], v_window=win_v[:, :, keep], phi_window=win_f[:, :, keep],
        k_sink=k_sink, v_sink=v_sink, offset=P + 1,
        mask_window=torch.cat([mw, mn], 1)[:, keep] if has_mask else None, mask_sink=mask_sink)
    return out, new_state


def additive_enter_(Sz: torch.Tensor, f: torch.Tensor, v1: torch.Tensor, real: torch.Tensor | None) -> None:
    r"""Add keys to the additive far state ``[S | z]`` ``[B·H, M, Dv + 1]`` in place, :math:`[S \mid z] \mathrel{+}=
    \phi\,[v \mid 1]`: features ``f [B·H, 1, M]`` (already self-tensored where the layer lifts them),
    ``v1 = [v | 1] [B·H, 1, Dv + 1]``, ``real [B·H, 1, 1]`` (0: a null event) or None for all. The lean step's
    write (:class:`~sketchlab.attention.recurrent.RecurrentStep`); its float64 twin is
    :func:`sketchlab.attention.ops.decayed.naive.additive_write`."""
    if real is not None:
        f = f * real
    Sz.addcmul_(f.mT, v1)
