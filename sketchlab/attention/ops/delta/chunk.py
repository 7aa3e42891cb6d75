"""The (gated) delta rule in its chunked WY/UT form (PyTorch, differentiable by autograd), tested against
:func:`~sketchlab.attention.ops.delta.naive.delta_rule_naive`."""

from __future__ import annotations

import torch

from ...._validation import check_positive_int
from ..._checks import check_delta
from ..decayed.chunk import chunk_decays, chunk_tokens, work_dtype

__all__ = ["delta_rule_chunked", "delta_rule_core"]


def delta_rule_chunked(q, k, v, beta, log_alpha=None, *, initial_state=None, chunk_size: int = 64):
    r"""The (gated) delta rule in its chunked WY/UT form (PyTorch, differentiable by autograd).

    Same arguments and results as :func:`~sketchlab.attention.ops.delta.naive.delta_rule_naive`, computed in the inputs' dtype
    (float16/bfloat16 inputs: computed and returned in float32) by chunks of ``C = chunk_size`` tokens.

    Parameters
    ----------
    q, k : Tensor ``[B, T, H, M]``
        L2-normalised by the caller.
    v : Tensor ``[B, T, H, Dv]``
    beta : Tensor ``[B, T, H]``, values in ``[0, 2]``
    log_alpha : Tensor ``[B, T, H]`` or None
        :math:`\log\alpha_t \le 0`, finite.
    initial_state : Tensor ``S [B, H, M, Dv]`` or None
    chunk_size : int >= 1
        ``T`` need not be a multiple of it.

    Returns
    -------
    o ``[B, T, H, Dv]``, S ``[B, H, M, Dv]``.

    Notes
    -----
    Inside a chunk, with :math:`L_i` the cumulative log-gate (relative to the chunk's start) and the
    incoming state :math:`S_0`, the state after step ``i`` is
    :math:`S_i = e^{L_i}S_0 + \sum_{j\le i} e^{L_i-L_j} k_j u_j^\top` with the pseudo-values

    .. math:: u_i = \beta_i\bigl(v_i - e^{L_i}S_0^\top k_i - \textstyle\sum_{j<i} e^{L_i-L_j}(k_i\cdot k_j)\,u_j\bigr),

    i.e. :math:`(I + A)U = \mathrm{diag}(\beta)(V - e^{L}\!\odot K\,S_0)` with
    :math:`A = \mathrm{tril}(\mathrm{diag}(\beta)(KK^\top\odot e^{L_i-L_j}), -1)`. So with
    :math:`\mathcal T = (I + A)^{-1}\mathrm{diag}(\beta)` (one unitriangular solve),
    :math:`W = \mathcal T(e^{L}\odot K)`, :math:`U = \mathcal T V` and :math:`V' = U - WS_0`:

    .. math:: O = (e^{L}\odot Q)S_0 + (QK^\top\odot e^{L_i-L_j}\odot[j\le i])V',\qquad
              S_{\text{end}} = e^{L_C}S_0 + (e^{L_C-L}\odot K)^\top V'.

    ``A, 𝒯, W, U`` and the intra-chunk scores are formed for every chunk at once; only
    :math:`V'`, ``O``'s first term and the state are carried chunk by chunk. Stability: every
    exponent is :math:`\le 0` (pairwise differences masked before the exponential), and
    ``I + A`` is unit lower triangular (solved, never inverted).
    """
    q, k, v, beta, log_alpha, initial_state = check_delta(q, k, v, beta, log_alpha, initial_state)
    return delta_rule_core(q, k, v, beta, log_alpha, initial_state, check_positive_int(chunk_size, "chunk_size"))


def delta_rule_core(q, k, v, beta, log_alpha, initial_state, C: int):
    """:func:`delta_rule_chunked` on trusted arguments (the memory fast path's call: its own checks cover them).

    Parameters
    ----------
    q, k : Tensor ``[B, T, H, M]``
    v : Tensor ``[B, T, H, Dv]``
    beta : Tensor ``[B, T, H]``
    log_alpha : Tensor ``[B, T, H]`` or None
    initial_state : Tensor ``[B, H, M, Dv]`` or None
    C : int >= 1
        The chunk size.

    Returns
    -------
    o ``[B, T, H, Dv]``, S ``[B, H, M, Dv]``; the formula is :func:`delta_rule_chunked`'s.
    """
    dt = work_dtype(v)
    B, T, H, M = k.shape
    Dv = v.shape[-1]
    N = -(-T // C)
    Q, K, V = chunk_tokens(q.to(dt), C, N), chunk_tokens(k.to(dt), C, N), chunk_tokens(v.to(dt), C, N)  # [B, H, N, C, ·]
    b = chunk_tokens(beta.to(dt), C, N)[..., None]  # [B, H, N, C, 1]; padded steps: β = 0, a null step
    L, pair = chunk_decays(log_alpha, v.to(dt), C, N)  # [B, H, N, C], [B, H, N, C, C] (j <= i)
    eL = L.exp()[..., None]  # [B, H, N, C, 1]
    eye = torch.eye(C, dtype=dt, device=V.device)
    A = (b * (K @ K.mT) * pair).tril(-1)  # [B, H, N, C, C]: β_i e^{L_i−L_j} k_i·k_j, j < i
    rhs = b * torch.cat([V, eL * K], -1)  # [B, H, N, C, Dv + M]
    UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)  # 𝒯 [V, e^L K]
    U, W = UW[..., :Dv], UW[..., Dv:]  # [B, H, N, C, Dv], [B, H, N, C, M]
    P = (Q @ K.mT) * pair  # [B, H, N, C, C]
    Qd = Q * eL  # [B, H, N, C, M]
    Kd = K * (L[..., -1:] - L).exp()[..., None]  # [B, H, N, C, M]: e^{L_C − L_j} k_j
    gate = L[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    S = V.new_zeros(B, H, M, Dv) if initial_state is None else initial_state.to(dt)
    outs = []
    for n in range(N):  # the state-dependent part, chunk by chunk
        Vn = U[:, :, n] - W[:, :, n] @ S  # [B, H, C, Dv]: V' = U − W S_0
        outs.append(Qd[:, :, n] @ S + P[:, :, n] @ Vn)  # [B, H, C, Dv]
        S = gate[:, :, n] * S + Kd[:, :, n].mT @ Vn  # [B, H, M, Dv]
    o = torch.stack(outs, 2).flatten(2, 3)[:, :, :T].movedim(1, 2)  # [B, T, H, Dv]
    return o, S
