r"""The parallel (quadratic) form of pure linear attention, for short sequences (layout ``[B, H, ·, ·]``).

When the whole call fits in one chunk (``T, S <= chunk_size``) the chunked core's state machinery
(chunk-major copies, the per-chunk state ``[B, H, M, Dv]`` that no query of the first chunk reads,
its recomputation in the backward) is pure overhead beside the masked ``C × C`` scores it computes
anyway, so the pure path (``window = 0``, no carried state) forms those scores directly, as fla
does for short sequences:

.. math:: A = (\phi(Q)\,\phi(K)^\top) \odot \text{mask} \quad (\text{non\_negative: } (\phi(Q)\,\phi(K)^\top)^{\circ 2}),
          \qquad o = A V \;\; \text{or} \;\; o = \frac{A V}{A \mathbf 1 + \varepsilon},

the mask being ``s ≤ t`` (causal; padded keys arrive with zero features, as in the chunked
engine, so they add nothing). Gradients are autograd's. It is the same formula as
:func:`sketchlab.attention.ops.additive.naive.feature_attention_naive` (tested against it in float64), in the chunked
path's compute dtype (float32 for fp16/bf16 inputs). Memory ``O(B·H·T·S)``, at most the chunked
core's ``C × C`` scores.
The gain is measured by ``analysis/bench_parallel.py`` (``analysis/results/parallel.md``).
"""

from __future__ import annotations

import torch

__all__ = ["parallel_core", "use_parallel"]


def use_parallel(T: int, S: int, *, chunk_size: int, window: int, stateful: bool) -> bool:
    """The dispatch rule of the chunked driver: pure (``window == 0``), no state in or out, and the
    call within one chunk (``T, S <= chunk_size``)."""
    return not window and not stateful and max(T, S) <= chunk_size


def parallel_core(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, *, causal: bool, non_negative: bool,
                  normalize: bool, eps: float):
    r"""Pure linear attention through the masked ``T × S`` kernel matrix (arguments trusted: the caller validated).

    Parameters
    ----------
    fq : Tensor ``[B, H, T, M]``
        Query features.
    fk : Tensor ``[B, H, S, M]``
        Key features (zero for padded keys).
    v : Tensor ``[B, H, S, Dv]``
    causal : bool
        Query ``t`` sees keys ``s ≤ t`` (``T == S``).
    non_negative : bool
        Kernel ``(φ(q)·φ(k))²`` (the self-tensored map, never materialised).
    normalize : bool
        Divide by the row sums ``A 1 + eps``.
    eps : float

    Returns
    -------
    ``(o [B, H, T, Dv], den [B, H, T])``: ``den = A 1`` (the denominators, for the sign check).
    """
    T, S = fq.shape[2], fk.shape[2]
    a = fq @ fk.mT  # [B, H, T, S]
    if non_negative:
        a = a.square()
    if causal:
        a = a.masked_fill(~torch.ones(T, S, dtype=torch.bool, device=fq.device).tril(), 0.0)  # s > t out
    num = a @ v  # [B, H, T, Dv]
    den = a.sum(-1)  # [B, H, T]
    if normalize:
        return num / (den[..., None] + eps), den
    return num, den
