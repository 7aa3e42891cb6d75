r"""Softmax attention, written once (layout ``[B, T, H, D]``): the public :func:`softmax_attention` checks
its arguments and hands them to :func:`_softmax_attention`, which the toy model (its softmax kernel, forward
and KV-cache step; the sliding-window mixer) and the converted models' exact layers call directly (their
inputs are built by them, not by a user). The float64 twin is
:func:`sketchlab.attention.reference.softmax_attention_naive`.
"""

from __future__ import annotations

import torch

from .._validation import check_real
from ._checks import check_flag, check_key_padding_mask, check_qkv

__all__ = ["softmax_attention"]


def softmax_attention(q, k, v, *, causal: bool = True, scale: float | None = None, window: int = 0,
                      key_padding_mask=None) -> torch.Tensor:
    r"""Softmax attention through ``torch.nn.functional.scaled_dot_product_attention`` (SDPA).

    Parameters
    ----------
    q : Tensor ``[B, T, H, D]``
    k : Tensor ``[B, S, H, D]``
    v : Tensor ``[B, S, H, Dv]``
    causal : bool
        Query ``t`` sits at position ``S − T + t`` (the queries are the *last* ``T`` of the ``S`` keys, so
        ``T ≤ S``: a decoding step's new tokens against its KV cache) and sees the keys ``s ≤ S − T + t``.
    scale : float, optional
        Logit scale, default ``1/√D``.
    window : int
        ``0``: every key the mask allows; ``w ≥ 1`` (causal only): query at position ``i`` sees only its
        last ``w`` keys ``i − w < s ≤ i`` (sliding-window attention, its own key included).
    key_padding_mask : Tensor ``[B, S]`` bool, optional
        ``True`` = a real token: padded keys are masked out; a query that sees no real key (left padding
        under the causal mask) gets 0.

    Returns
    -------
    Tensor ``[B, T, H, Dv]``

    Notes
    -----
    :math:`o_t = \sum_{s \in M(t)} e^{\mathrm{scale}\, q_t^\top k_s} v_s / \sum_{s \in M(t)} e^{\mathrm{scale}\,
    q_t^\top k_s}`, ``M(t)`` the keys allowed by ``causal``, ``window`` and ``key_padding_mask``.
    """
    check_flag(causal, "causal")
    q, k, v = check_qkv(q, k, v, causal=False)
    T, S = q.shape[1], k.shape[1]
    if causal and T > S:
        raise ValueError(f"causal attention needs at most as many queries as keys (the queries are the last T of "
                         f"the S keys): q has T={T}, k has S={S}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an integer >= 0 (0 = no window), got {window!r}")
    if window and not causal:
        raise ValueError(f"window={window} needs causal=True (each query sees its last `window` keys)")
    if scale is not None:
        scale = check_real(scale, "scale", positive=True)
    key_padding_mask = check_key_padding_mask(key_padding_mask, q.shape[0], S, q.device)
    return _softmax_attention(q, k, v, causal=causal, scale=scale, window=window, key_padding_mask=key_padding_mask)


def _softmax_attention(q, k, v, *, causal: bool = True, scale: float | None = None, window: int = 0,
                       key_padding_mask=None) -> torch.Tensor:
    """:func:`softmax_attention` on trusted arguments (no checks, no device sync), and grouped-query attention:
    ``k, v`` may hold ``H_kv`` heads, a divisor of ``q``'s ``H`` (query head ``h`` reads ``h // (H / H_kv)``, in
    place). ``q [B, T, H, D]``, ``k [B, S, H_kv, D]``, ``v [B, S, H_kv, Dv]`` → ``[B, T, H, Dv]``."""
    T, S = q.shape[1], k.shape[1]
    allowed = None  # [T, S] or [B, 1, T, S] bool; None: every key, or SDPA's own causal mask (T == S)
    if causal and (window or T != S or key_padding_mask is not None) and not (T == 1 and not window):
        k_pos = torch.arange(S, device=q.device)  # [S]
        q_pos = torch.arange(S - T, S, device=q.device)[:, None]  # [T, 1]: the queries are the last T positions
        allowed = k_pos <= q_pos
        if window:
            allowed = allowed & (k_pos > q_pos - window)  # [T, S]
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, None, :]  # [B, 1, 1, S]
        allowed = pad if allowed is None else allowed & pad  # [B, 1, T|1, S]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed,
        is_causal=causal and T == S and T > 1 and allowed is None, scale=scale,
        enable_gqa=k.shape[2] != q.shape[2])  # [B, H, T, Dv]
    if key_padding_mask is not None:  # rows without any real key: 0 (SDPA's own result for them is not documented)
        out = out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    return out.transpose(1, 2)
