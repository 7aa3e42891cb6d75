r"""Naive float64 twins of every attention path (layout ``[B, T, H, D]``), written for clarity.

Each forms the dense ``T × S`` score matrix of every (batch, head) and applies the mask and the
normalisation literally. They are what the chunked PyTorch path and the Triton kernel are tested
against; memory grows with ``T·S``, so they are for tests and small problems. The twin of attention through
features (the additive state and its hybrid) is its mechanism's own,
:func:`sketchlab.attention.ops.additive.naive.feature_attention_naive`; here are the exact attentions', the
kernel's and LLoPS's.

Normalisation (identical in every backend of :mod:`sketchlab.attention`), for scores
:math:`a_{ts}` and the allowed positions :math:`s \in \mathcal M(t)` (``s ≤ t`` when causal, all
``s`` otherwise, never across a segment boundary):

``normalize="none"``
    :math:`o_t = \sum_{s\in\mathcal M(t)} a_{ts} v_s` — unnormalised, safe for any (signed) map;
    the scale of the output then follows the kernel's.
``normalize="sum"``
    :math:`o_t = \sum_s a_{ts} v_s / (\sum_s a_{ts} + \varepsilon)` — the usual linear-attention
    normaliser. Only safe when :math:`a_{ts} \ge 0`: with a signed map (rank-``t`` LLoPS,
    TensorSketch, plain PolySketch) the denominator can be ``≤ 0`` or near 0 and the output
    explodes or flips sign.
``non_negative=True``
    replaces the features by the self-tensor :math:`\phi \otimes \phi` (PolySketchFormer), whose
    kernel :math:`(\phi(q)\cdot\phi(k))^2 \ge 0` has degree ``2p`` and ``M²`` features; with it
    ``normalize="sum"`` is safe. The naive twins materialise ``φ ⊗ φ`` literally.
"""

from __future__ import annotations

import torch

from .._validation import check_degree, check_real
from ._checks import (
    check_eps,
    check_flag,
    check_key_padding_mask,
    check_normalize,
    check_qkv,
    check_segments,
)

__all__ = [
    "attention_mask",
    "kernel_attention_naive",
    "poly_attention_naive",
    "softmax_attention_naive",
]


def attention_mask(length_q: int, length_k: int, *, causal: bool, segments=None, device=None) -> torch.Tensor:
    """Boolean mask ``[T, S]``: ``True`` where query ``t`` may attend to key ``s``.

    Causal: ``s ≤ t`` (needs ``T == S``). ``segments`` (lengths of sequences joined along the token
    axis, summing to ``T == S``, or one int for equal lengths) forbids every pair in different
    segments.
    """
    if causal and length_q != length_k:
        raise ValueError(f"a causal mask needs T == S, got T={length_q}, S={length_k}")
    mask = torch.ones(length_q, length_k, dtype=torch.bool, device=device)
    if causal:
        mask = mask.tril()
    segs = check_segments(segments, length_k)
    if segs is not None:
        if length_q != length_k:
            raise ValueError(f"segments need T == S (queries and keys from the same joined sequences), got T={length_q}, S={length_k}")
        ids = torch.repeat_interleave(torch.arange(len(segs), device=device), torch.tensor(segs, device=device))  # [T]
        mask = mask & (ids[:, None] == ids[None, :])
    return mask


def kernel_attention_naive(scores, v, *, causal: bool = True, normalize: str = "sum", eps: float = 1e-6,
                           segments=None) -> torch.Tensor:
    r"""Attention through a given score matrix, in float64: the one definition every path follows.

    Parameters
    ----------
    scores : Tensor ``[..., T, S]``
        Kernel values :math:`a_{ts}` between queries (rows) and keys (columns).
    v : Tensor ``[..., S, Dv]``
        Values, the same leading (batch) shape.
    causal : bool
        Keep only ``s ≤ t`` (``T == S``).
    normalize : ``"none"`` or ``"sum"``
        See the module docstring.
    eps : float >= 0
        Added to the normaliser (``"sum"`` only).
    segments : None, int or sequence of int
        Lengths of sequences joined along the token axis; no query attends across them.

    Returns
    -------
    Tensor ``[..., T, Dv]`` float64: :math:`(A\odot M)V` or :math:`(A\odot M)V / ((A\odot M)\mathbf 1 + \varepsilon)`.
    """
    from .._validation import as_float_tensor

    scores = as_float_tensor(scores, "scores").to(torch.float64)
    v = as_float_tensor(v, "v").to(torch.float64)
    check_flag(causal, "causal")
    normalize = check_normalize(normalize)
    eps = check_eps(eps)
    if scores.ndim < 2 or v.ndim < 2 or v.shape[-2] != scores.shape[-1] or v.shape[:-2] != scores.shape[:-2]:
        raise ValueError(
            f"scores must be [..., T, S] and v [..., S, Dv] with the same S and batch, got "
            f"{tuple(scores.shape)} and {tuple(v.shape)}"
        )
    mask = attention_mask(scores.shape[-2], scores.shape[-1], causal=causal, segments=segments, device=scores.device)
    masked = torch.where(mask, scores, torch.zeros((), dtype=torch.float64, device=scores.device))  # [..., T, S]
    out = masked @ v  # [..., T, Dv]
    if normalize == "sum":
        out = out / (masked.sum(-1, keepdim=True) + eps)
    return out



def poly_attention_naive(q, k, v, p: int, *, causal: bool = True, normalize: str = "sum", eps: float = 1e-6,
                         segments=None) -> torch.Tensor:
    r"""Exact polynomial attention, scores :math:`a_{ts} = (q_t\cdot k_s)^p`, dense float64.

    ``q [B, T, H, D]``, ``k [B, S, H, D]``, ``v [B, S, H, Dv]`` → ``[B, T, H, Dv]``. No scaling is
    applied (scale ``q`` and ``k`` by ``D^{-1/4}`` for ``q·k/√D``). ``normalize="sum"`` is safe
    for even ``p`` only.
    """
    p = check_degree(p)
    check_flag(causal, "causal")
    q, k, v = check_qkv(q, k, v, causal=causal)
    q, k, v = (x.to(torch.float64).transpose(1, 2) for x in (q, k, v))  # [B, H, T|S, ·]
    scores = (q @ k.mT) ** p  # [B, H, T, S]
    return kernel_attention_naive(scores, v, causal=causal, normalize=normalize, eps=eps,
                                  segments=segments).transpose(1, 2)  # [B, T, H, Dv]


def softmax_attention_naive(q, k, v, *, causal: bool = True, scale: float | None = None, window: int = 0,
                            segments=None, key_padding_mask=None) -> torch.Tensor:
    r"""Softmax attention :math:`\mathrm{softmax}(q k^\top \cdot \mathrm{scale} + \text{mask})\, v`, dense float64.

    ``q [B, T, H, D]``, ``k [B, S, H, D]``, ``v [B, S, H, Dv]`` → ``[B, T, H, Dv]``;
    ``scale`` defaults to ``1/√D``. ``causal``: the queries are the last ``T ≤ S`` positions, query ``t`` at
    ``i = S − T + t`` sees the keys ``s ≤ i``; ``window = w ≥ 1`` (causal only) keeps ``i − w < s`` of them.
    ``segments`` (``T == S``) as in :func:`attention_mask`. ``key_padding_mask`` ``[B, S]`` bool (``True`` = a
    real token): padded keys are masked out; a query that sees no key at all gets 0.
    """
    check_flag(causal, "causal")
    q, k, v = check_qkv(q, k, v, causal=False)
    T, S = q.shape[1], k.shape[1]
    if causal and T > S:
        raise ValueError(f"causal attention needs T <= S (the queries are the last T keys), got T={T}, S={S}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0 or (window and not causal):
        raise ValueError(f"window must be an integer >= 0 (0 = none; >= 1 needs causal=True), got {window!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else check_real(scale, "scale", positive=True)
    key_padding_mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[1], q.device)
    q, k, v = (x.to(torch.float64).transpose(1, 2) for x in (q, k, v))  # [B, H, T|S, ·]
    logits = (q @ k.mT) * scale  # [B, H, T, S]
    lag = torch.arange(S - T, S, device=q.device)[:, None] - torch.arange(S, device=q.device)  # [T, S]: i − s
    mask = attention_mask(T, S, causal=False, segments=segments, device=q.device)
    if causal:
        mask = mask & (lag >= 0) & ((lag < window) if window else True)
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, :]  # [B, 1, T, S]
    weights = logits.masked_fill(~mask, float("-inf")).softmax(-1).masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return (weights @ v).transpose(1, 2)  # [B, T, H, Dv]
