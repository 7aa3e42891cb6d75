r"""The hybrid combine, written once for every torch path: exact keys (window, sinks, cache) and a far part,
mixed by a per-head gate under one shared normaliser (DESIGN §6, §7).

For one query with exact logits :math:`x_j = s\,q^\top k_j` over its exact keys :math:`E` (the window, the
sinks, the memory cache) and the far part's sums (additive: :math:`n_{far} = S^\top\phi(q)`,
:math:`d_{far} = z\cdot\phi(q)` plus the far keys read directly; delta: the read :math:`r_{far} = S^\top\hat q`),
with :math:`g = \sigma(\text{gate})`:

.. math::
    a_j &= e^{x_j - c},\ c = \max_E x_j \quad (\texttt{local="softmax"};\ c = 0 \text{ for a query without
    exact keys}) \qquad\text{or}\qquad a_j = x_j^{\,p} \quad (\texttt{"poly"}),\\
    o &= \frac{g\sum_E a_j v_j + (1-g)\,n_{far}}{g\sum_E a_j + (1-g)\,d_{far} + \varepsilon}
    \quad\text{(additive)},\qquad
    o = g\,\frac{\sum_E a_j v_j}{\sum_E a_j} + (1-g)\,r_{far} \quad\text{(delta; the exact term 0 without exact keys)}.

``c`` is part of the definition and differentiated through (LoLCATs). :func:`exact_sums` forms the exact
part (one shift over every piece of exact keys), :func:`mix` the gate, :func:`combine` the additive
read and its normaliser, :func:`combine_delta` the delta read; :func:`local_far_masks` says which keys a
query sees exactly and which through the far part (the float64 twin and ``convert/scale.py``'s far-mass gate
read it). Callers: the chunked hybrid's one-token and non-causal paths
(:mod:`sketchlab.attention.ops.additive.hybrid_driver`), the memory mechanisms' fast path and decoding step
(:mod:`~sketchlab.attention.memory_fast`, :mod:`~sketchlab.attention.ops.cache.recurrent`).

The float64 twins (:func:`sketchlab.attention.ops.additive.naive.feature_attention_naive`,
:func:`sketchlab.attention.ops.cache.naive.memory_naive`) write the formula out on their own: they are
what these functions are tested against, so a slip here cannot hide in both (they share only
:func:`local_far_masks`, the split of the keys, with this module). The fused kernels keep their
fused forms, tested against the same twins: the causal block with its hand-written backward
(:mod:`~sketchlab.attention.ops.additive.chunk_hybrid`: the gate folded into the local weights), the Triton kernel, and
the in-place decoding step (:mod:`~sketchlab.attention.recurrent`). Inputs are trusted (checked by the
public entry points). Any leading shape; keys on the last axis of the logits, ``[..., n]``.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["combine", "combine_delta", "exact_sums", "gate_weight", "local_far_masks", "local_weights", "mix"]


def local_far_masks(q_pos: torch.Tensor, k_pos: torch.Tensor, k_rel: torch.Tensor, *, window: int, sinks: int,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The sliding-window hybrid's split of the keys a query sees: bool ``(local, far)`` ``[T, X]``.

    ``q_pos [T]``, ``k_pos [X]``: positions; ``k_rel [X]``: each key's position inside its own
    sequence (the sinks are ``k_rel < sinks``). A key is seen when ``k_pos <= q_pos`` (causal) or
    always; seen keys are local when ``|q_pos − k_pos| < window`` or a sink, far otherwise
    (``window = 0``: every seen key is far, pure linear attention).
    """
    seen = (k_pos[None, :] <= q_pos[:, None]) if causal else torch.ones(len(q_pos), len(k_pos), dtype=torch.bool,
                                                                       device=q_pos.device)
    if not window:
        return torch.zeros_like(seen), seen
    near = ((q_pos[:, None] - k_pos[None, :]).abs() < window) | (k_rel < sinks)[None, :]
    return seen & near, seen & ~near


def gate_weight(gate: torch.Tensor | None, heads: int, *, dtype: torch.dtype, device) -> torch.Tensor:
    """The exact part's weight ``g [H]``: ``σ(gate)`` of the logits ``gate [H]``, ``1/2`` without them."""
    if gate is None:
        return torch.full((heads,), 0.5, dtype=dtype, device=device)
    return torch.sigmoid(gate.to(dtype))


def local_weights(logits: torch.Tensor, ok: torch.Tensor | None, *, local: str, degree: int | None,
                  shift: torch.Tensor | None = None) -> torch.Tensor:
    r"""The exact part's unnormalised weights ``a [..., n]`` of ``logits [..., n]`` where ``ok`` (0 elsewhere).

    ``local="softmax"``: :math:`a_j = e^{x_j - c}` with ``c`` the row maximum over the allowed keys (0 for a
    row with none), or the given ``shift [..., 1]`` (a maximum over more keys than these); ``"poly"``:
    :math:`a_j = x_j^{\,p}`, ``p = degree``. ``ok`` is a bool mask broadcastable to ``logits``; ``None`` with
    ``"softmax"``: the logits are already ``−inf`` off the allowed keys.
    """
    if local == "softmax":
        if ok is not None:
            logits = torch.where(ok, logits, float("-inf"))  # exp(-inf) = 0: the masked keys
        c = logits.amax(-1, keepdim=True).nan_to_num(neginf=0.0) if shift is None else shift  # [..., 1]
        return (logits - c).exp()
    if ok is None:  # poly scores have no −inf to mark the keys left out
        raise ValueError("local_weights: ok=None (logits already -inf off the allowed keys) needs local='softmax'; "
                         f"local={local!r} takes the allowed keys' mask")
    return torch.where(ok, logits**degree, logits.new_zeros(()))


def exact_sums(pieces, *, local: str, degree: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The exact part's sums :math:`(\sum_E a_j v_j, \sum_E a_j)`, ``[..., Dv]`` and ``[...]``.

    ``pieces``: ``(logits [..., n_i], ok [..., n_i], values [..., n_i, Dv])`` per group of exact keys (the
    band of window keys, the sinks, ...), masks and values broadcastable to the logits; with ``"softmax"``
    one shift ``c``, the maximum over every piece's allowed keys, serves them all (:func:`local_weights`).
    Pieces without keys are skipped; at least one has keys.
    """
    pieces = [p for p in pieces if p[0].shape[-1]]  # (no sinks: an empty piece)
    shift = None
    if local == "softmax" and len(pieces) > 1:
        pieces = [(torch.where(ok, x, float("-inf")), None, v) for x, ok, v in pieces]  # masked once
        maxima = [x.amax(-1, keepdim=True) for x, _, _ in pieces]  # [..., 1] each
        shift = functools.reduce(torch.maximum, maxima).nan_to_num(neginf=0.0)  # c over every exact key
    num = den = None
    for logits, ok, values in pieces:
        a = local_weights(logits, ok, local=local, degree=degree, shift=shift)  # [..., n_i]
        n, d = a @ values, a.sum(-1)
        num, den = (n, d) if num is None else (num + n, den + d)
    return num, den


def mix(exact: torch.Tensor, far: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    r"""The gate: :math:`g\cdot\text{exact} + (1 - g)\cdot\text{far}`, ``g`` broadcast against both (a linear
    mix, so sums packed ``[Σ v | Σ 1]`` on the last axis mix as they are)."""
    return torch.addcmul((1 - g) * far, g, exact)


def combine(exact_num, exact_den, far_num, far_den, g, *, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The additive hybrid's read: ``(o [..., Dv], den [...])``.

    :math:`\text{den} = g\sum_E a + (1-g)\,d_{far}`, :math:`o = (g\sum_E a v + (1-g)\,n_{far}) / (\text{den} +
    \varepsilon)`: one normaliser for both parts. ``exact_num, far_num [..., Dv]``; ``exact_den, far_den
    [...]``; ``g`` broadcastable to ``[...]`` (the per-head gate, e.g. ``[1, H, 1]``). ``den`` is returned for
    the denominator check.
    """
    den = mix(exact_den, far_den, g)
    return mix(exact_num, far_num, g[..., None]) / (den + eps)[..., None], den


def combine_delta(exact_num, exact_den, some, far, g) -> torch.Tensor:
    r"""The delta rule's read ``[..., Dv]``: :math:`g\sum_E a v / \sum_E a + (1-g)\,r_{far}` (the delta state
    has no denominator: both parts are on the values' scale). ``some [...]`` bool: the query has an exact
    key (else its exact term is 0, no ``0/0``); ``g`` broadcastable to ``[...]``."""
    exact = exact_num / torch.where(some, exact_den, 1.0)[..., None]
    return mix(exact, far, g[..., None])
