"""The carried attention state of the Triton path, in the layout of docs/DESIGN.md §6.

Placeholder until ``sketchlab.attention.AttentionState`` (the shared class, built with the torch
paths) is merged: same fields, same shapes, same meaning, so the two are interchangeable.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["AttentionState"]


class AttentionState(NamedTuple):
    """What a causal call needs of the tokens before it (``offset`` of them).

    Fields
    ------
    S : Tensor [B, H, F, Dv] fp32
        ``Σ φ(k_j)ᵀ v_j`` over the far tokens ``sinks ≤ j < offset − w`` (``F = M``, or ``M²`` for the
        self-tensor, index ``a·M + b``); for pure linear attention (``w = sinks = 0``) every token.
    z : Tensor [B, H, F] fp32
        ``Σ φ(k_j)`` over the same tokens.
    k_window, v_window : Tensor [B, H, n_w, D], [B, H, n_w, Dv]
        The keys and values of the last ``n_w = min(w, max(offset − sinks, 0))`` tokens that are
        not sinks (positions ``offset − n_w … offset − 1``), oldest first.
    k_sink, v_sink : Tensor [B, H, n_s, D], [B, H, n_s, Dv]
        The sink tokens seen so far, ``n_s = min(sinks, offset)`` (positions ``0 … n_s − 1``).
    offset : int
        Tokens consumed so far.
    """

    S: torch.Tensor
    z: torch.Tensor
    k_window: torch.Tensor
    v_window: torch.Tensor
    k_sink: torch.Tensor
    v_sink: torch.Tensor
    offset: int
