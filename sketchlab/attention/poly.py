r"""Exact polynomial attention, blocked over queries (layout ``[B, T, H, D]``): :func:`poly_attention`,
re-exported by :mod:`sketchlab.attention.functional`.
"""

from __future__ import annotations

import torch

from .._validation import DEFAULT_MAX_BYTES, check_degree, check_memory, check_positive_int
from ._checks import (
    check_denominator_check,
    check_eps,
    check_flag,
    check_normalize,
    check_qkv,
    denominator_counts,
    report_denominators,
)
from ._entry import by_segments

__all__ = ["poly_attention"]


def poly_attention(q, k, v, p: int, *, causal: bool = True, normalize: str = "sum", eps: float = 1e-6,
                   block_size: int = 256, max_bytes: int = DEFAULT_MAX_BYTES, segments=None,
                   denominator_check: str = "warn") -> torch.Tensor:
    r"""Exact polynomial attention, scores :math:`a_{ts} = (q_t\cdot k_s)^p`, blocked over queries.

    Quadratic time (``T·S·D``); memory ``O(block_size · S)`` per (batch, head) for the scores of
    one query block, never ``T × S`` at once (blocks are checkpointed under autograd). ``q [B, T, H, D]``, ``k [B, S, H, D]``,
    ``v [B, S, H, Dv]`` → ``[B, T, H, Dv]``; no scaling applied. Causal blocks read only the keys
    up to their last query. ``normalize="sum"`` is safe for even ``p`` only: for odd ``p`` the rows whose
    denominator is ``<= 0`` are counted and reported as the feature-map paths do (``denominator_check``:
    ``"warn"``, ``"raise"`` or ``"off"``). Scores that overflow the dtype (``(q·k)^p`` beyond its range)
    are refused (``ValueError`` naming the rows, the largest ``|q·k|`` and the way out), never returned as
    NaN rows. ``segments``: as in :func:`~sketchlab.attention.linear_attention`.
    """
    p = check_degree(p)
    check_flag(causal, "causal")
    normalize, eps = check_normalize(normalize), check_eps(eps)
    block_size = check_positive_int(block_size, "block_size")
    q, k, v = check_qkv(q, k, v, causal=causal)
    B, H = q.shape[0], q.shape[2]
    check_memory(B * H * block_size * k.shape[1] * q.element_size(),
                 what=f"the scores of one query block ([B={B}, H={H}, {block_size}, S={k.shape[1]}])",
                 way_out="lower block_size", max_bytes=max_bytes)
    mode = check_denominator_check(denominator_check)
    out = by_segments(lambda qs, ks, vs, _: _poly_blocks(qs, ks, vs, p, causal, normalize, eps, block_size),
                       segments, q, k, v)
    with torch.no_grad():
        bad = ~torch.isfinite(out).all(-1)  # [B, T, H]
        if bool(bad.any()):
            top = float(torch.einsum("bthd,bshd->bhts", q.double(), k.double()).abs().max())
            raise ValueError(f"poly_attention: (q·k)^{p} overflows {str(q.dtype).removeprefix('torch.')} in "
                             f"{int(bad.sum())} of {bad.numel()} query rows (largest |q·k| = {top:.3g}, to the power "
                             f"{p}: {top ** p if top < 1e300 ** (1 / p) else float('inf'):.3g}); scale q and k down "
                             "(e.g. by d^-1/4), use float64, or a smaller p")
        if normalize == "sum" and p % 2 and mode != "off":
            rows = _poly_denominators(q, k, p, causal, segments, block_size)
            report_denominators(denominator_counts(rows), rows.numel(), "poly_attention", mode)
    return out


def _poly_denominators(q, k, p, causal, segments, block_size) -> torch.Tensor:
    """``Σ_s (q_t·k_s)^p`` of every query row ``[B, H, T]`` (odd ``p``: its sign decides ``normalize="sum"``)."""
    ones = torch.ones(*k.shape[:3], 1, dtype=q.dtype, device=q.device)
    sums = by_segments(lambda qs, ks, vs, _: _poly_blocks(qs, ks, vs, p, causal, "none", 0.0, block_size),
                        segments, q, k, ones)  # [B, T, H, 1]
    return sums[..., 0]


def _poly_block(q_blk, k, v, start, p, causal, normalize, eps):
    """One query block of exact polynomial attention on ``[B, H, ·, ·]`` tensors; keys already cut to the block's end when causal."""
    scores = (q_blk @ k.mT) ** p  # [B, H, n_blk, S']
    if causal:
        rows = torch.arange(start, start + q_blk.shape[2], device=q_blk.device)[:, None]
        scores = scores.masked_fill(torch.arange(k.shape[2], device=q_blk.device)[None, :] > rows, 0.0)
    out = scores @ v  # [B, H, n_blk, Dv]
    if normalize == "sum":
        out = out / (scores.sum(-1, keepdim=True) + eps)
    return out


def _poly_blocks(q, k, v, p, causal, normalize, eps, block_size):
    """Blocked exact polynomial attention on validated ``[B, T, H, ·]`` tensors (see :func:`poly_attention`).

    Under autograd each block is checkpointed (its scores recomputed in the backward pass), so the
    backward pass also holds one block's scores at a time, not ``T × S``.
    """
    from torch.utils.checkpoint import checkpoint

    T = q.shape[1]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T|S, ·]
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    outs = []
    for a in range(0, T, block_size):
        b = min(a + block_size, T)
        stop = b if causal else k.shape[1]
        args = (qt[:, :, a:b], kt[:, :, :stop], vt[:, :, :stop], a, p, causal, normalize, eps)
        outs.append(checkpoint(_poly_block, *args, use_reentrant=False) if grad else _poly_block(*args))
    return torch.cat(outs, 2).transpose(1, 2)  # [B, T, H, Dv]
