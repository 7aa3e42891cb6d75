"""Decayed linear attention by chunks (PyTorch, differentiable by autograd), tested against
:func:`~sketchlab.attention.ops.decayed.naive.decayed_linear_naive`; its chunk layout and decays are the gated
delta rule's too (:mod:`sketchlab.attention.ops.delta.chunk`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...._validation import check_positive_int
from ..._checks import check_decayed

__all__ = ["chunk_decays", "chunk_tokens", "decayed_linear_chunked", "decayed_linear_core", "work_dtype"]


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the chunked recurrences compute in: float32 and float64 kept, half inputs in float32.

    Parameters
    ----------
    x : Tensor
        Any tensor of the call (its dtype decides).

    Returns
    -------
    torch.dtype
    """
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def chunk_tokens(x: torch.Tensor, C: int, N: int) -> torch.Tensor:
    """Tokens in chunks of ``C``: ``[B, T, H, ·]`` (or ``[B, T, H]``) → ``[B, H, N, C, ·]`` (``[B, H, N, C]``).

    Parameters
    ----------
    x : Tensor ``[B, T, H, ·]`` or ``[B, T, H]``
    C, N : int
        The chunk size and the number of chunks, ``N·C >= T``.

    Returns
    -------
    Tensor ``[B, H, N, C, ·]`` (``[B, H, N, C]``), zero-padded to ``N·C`` tokens.
    """
    x = x.movedim(1, 2)  # [B, H, T, ·]
    if x.ndim == 3:
        return F.pad(x, (0, N * C - x.shape[2])).unflatten(2, (N, C))  # [B, H, N, C]
    return F.pad(x, (0, 0, 0, N * C - x.shape[2])).unflatten(2, (N, C))  # [B, H, N, C, ·]


def chunk_decays(log_decay, like: torch.Tensor, C: int, N: int):
    r"""The decays inside each chunk: the cumulative log-decay :math:`L_i = \sum_{s \le i} \log\gamma_s` and the
    pairwise :math:`e^{L_i - L_j}` for ``j ≤ i``, masked *before* the exponential (every exponent ``<= 0``).

    Parameters
    ----------
    log_decay : Tensor ``[B, T, H]`` or None
        :math:`\log\gamma_t \le 0`; None: no decay (``L = 0``).
    like : Tensor ``[B, T, H, ·]``
        A token tensor of the call: its ``B, H``, dtype and device.
    C, N : int
        The chunk size and the number of chunks.

    Returns
    -------
    L : Tensor ``[B, H, N, C]``
        Inclusive, relative to the chunk's start; padded steps decay by 0.
    pair : Tensor ``[B, H, N, C, C]``
        :math:`e^{L_i - L_j}` for ``j ≤ i``, 0 above the diagonal.
    """
    B, H = like.shape[0], like.shape[2]  # like: a token tensor [B, T, H, ·]
    if log_decay is None:
        L = like.new_zeros(B, H, N, C)
    else:
        L = chunk_tokens(log_decay.to(like.dtype), C, N).cumsum(-1)  # [B, H, N, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=like.device).tril()  # j <= i
    diff = L[..., :, None] - L[..., None, :]  # [B, H, N, C, C]: L_i − L_j, <= 0 where j <= i
    pair = torch.where(causal, diff, torch.full((), float("-inf"), dtype=like.dtype, device=like.device)).exp()
    return L, pair


def decayed_linear_chunked(fq, fk, v, log_decay=None, *, initial_state=None, chunk_size: int = 64):
    r"""Decayed linear attention, chunked (PyTorch, differentiable by autograd).

    Same arguments and results as :func:`~sketchlab.attention.ops.decayed.naive.decayed_linear_naive`, computed in the inputs' dtype
    (float16/bfloat16 inputs: computed and returned in float32) by chunks of ``C = chunk_size`` tokens.

    Parameters
    ----------
    fq, fk : Tensor ``[B, T, H, M]``
    v : Tensor ``[B, T, H, Dv]``
    log_decay : Tensor ``[B, T, H]`` or None
        :math:`\log\gamma_t \le 0`, finite.
    initial_state : ``(S [B, H, M, Dv], z [B, H, M])`` or None
    chunk_size : int >= 1
        ``T`` need not be a multiple of it.

    Returns
    -------
    num ``[B, T, H, Dv]``, den ``[B, T, H]``, ``(S [B, H, M, Dv], z [B, H, M])``.

    Notes
    -----
    With :math:`L_i` the cumulative log-decay inside the chunk (:math:`L_i = \sum_{s\le i}\log\gamma_s`,
    relative to the chunk's start) and the incoming state :math:`S_0`:

    .. math:: \text{num}_i = e^{L_i}\,\phi(q_i)^\top S_0
              + \sum_{j\le i} e^{L_i - L_j}\,(\phi(q_i)\cdot\phi(k_j))\, v_j,\qquad
              S_{\text{end}} = e^{L_{C}} S_0 + \sum_j e^{L_C - L_j}\,\phi(k_j) v_j^\top,

    and ``den``, ``z`` the same with :math:`v_j = 1` (one more value column). Stability: every
    exponent is :math:`\le 0` — the pairwise :math:`L_i - L_j` is masked to ``j ≤ i`` *before* the
    exponential, never formed as :math:`e^{L_i}e^{-L_j}` — so strong decay or long sequences
    underflow to 0 and never overflow.
    """
    fq, fk, v, log_decay, initial_state = check_decayed(fq, fk, v, log_decay, initial_state)
    return decayed_linear_core(fq, fk, v, log_decay, initial_state, check_positive_int(chunk_size, "chunk_size"))


def decayed_linear_core(fq, fk, v, log_decay, initial_state, C: int):
    """:func:`decayed_linear_chunked` on trusted arguments (the memory fast path's call: its own checks cover them).

    Parameters
    ----------
    fq, fk : Tensor ``[B, T, H, M]``
    v : Tensor ``[B, T, H, Dv]``
    log_decay : Tensor ``[B, T, H]`` or None
    initial_state : ``(S [B, H, M, Dv], z [B, H, M])`` or None
    C : int >= 1
        The chunk size.

    Returns
    -------
    num ``[B, T, H, Dv]``, den ``[B, T, H]``, ``(S [B, H, M, Dv], z [B, H, M])``, in :func:`work_dtype`; the formula
    is :func:`decayed_linear_chunked`'s.
    """
    dt = work_dtype(v)
    B, T, H, M = fk.shape
    Dv = v.shape[-1]
    N = -(-T // C)
    v1 = torch.cat([v.to(dt), v.new_ones(B, T, H, 1, dtype=dt)], -1)  # [B, T, H, Dv + 1]: z as one more column
    q, k, w = chunk_tokens(fq.to(dt), C, N), chunk_tokens(fk.to(dt), C, N), chunk_tokens(v1, C, N)  # [B, H, N, C, ·]
    L, pair = chunk_decays(log_decay, v1, C, N)  # [B, H, N, C], [B, H, N, C, C]
    intra = ((q @ k.mT) * pair) @ w  # [B, H, N, C, Dv + 1]
    last = L[..., -1:]  # [B, H, N, 1]: the whole chunk's log-decay
    step = (k * (last - L).exp()[..., None]).mT @ w  # [B, H, N, M, Dv + 1]: the chunk's own contribution
    if initial_state is None:
        state = v1.new_zeros(B, H, M, Dv + 1)
    else:
        state = torch.cat([initial_state[0].to(dt), initial_state[1].to(dt)[..., None]], -1)  # [B, H, M, Dv + 1]
    starts = []
    for n in range(N):  # the state carried from chunk to chunk
        starts.append(state)
        state = last[:, :, n, :, None].exp() * state + step[:, :, n]
    inter = (q * L.exp()[..., None]) @ torch.stack(starts, 2)  # [B, H, N, C, Dv + 1]
    out = (intra + inter).flatten(2, 3)[:, :, :T].movedim(1, 2)  # [B, T, H, Dv + 1]
    return out[..., :Dv], out[..., Dv], (state[..., :Dv], state[..., Dv])
