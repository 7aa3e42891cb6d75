r"""Decayed linear attention and the (gated) delta rule: recurrences over a state ``S [B, H, M, Dv]``.

The long-context memory of DESIGN §7 runs its far part as one of two recurrences over a stream of
``T`` events (layout ``[B, T, H, ·]``; a null event has ``φ = 0, v = 0, β = 0``):

*decayed linear attention* (the additive state, optionally forgetting)

.. math:: S_t = \gamma_t S_{t-1} + \phi(k_t) v_t^\top,\quad z_t = \gamma_t z_{t-1} + \phi(k_t),\quad
          \text{num}_t = S_t^\top \phi(q_t),\quad \text{den}_t = z_t\cdot\phi(q_t);

*the gated delta rule* (the state overwrites what it holds for a key instead of adding to it)

.. math:: S_t = \alpha_t S_{t-1} + \beta_t k_t (v_t - \alpha_t S_{t-1}^\top k_t)^\top,\qquad o_t = S_t^\top q_t,

with :math:`\gamma_t = e^{\text{log\_decay}_t}`, :math:`\alpha_t = e^{\text{log\_alpha}_t}` in ``(0, 1]``.
Each has a step-by-step float64 twin (``*_naive``, the definition) and a chunked PyTorch form
(``*_chunked``, differentiable by autograd) that is tested against it.

References
----------
S. Yang, B. Wang, Y. Shen, R. Panda, Y. Kim. *Gated Linear Attention Transformers with
Hardware-Efficient Training*, ICML 2024. — S. Yang, B. Wang, Y. Zhang, Y. Shen, Y. Kim.
*Parallelizing Linear Transformers with the Delta Rule over Sequence Length*, NeurIPS 2024. —
S. Yang, J. Kautz, A. Hatamizadeh. *Gated Delta Networks*, ICLR 2025.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._validation import as_float_tensor, check_finite, check_positive_int
from ._checks import check_qkv

__all__ = [
    "decayed_linear_chunked",
    "decayed_linear_naive",
    "delta_rule_chunked",
    "delta_rule_naive",
]


# ----------------------------------------------------------------------------------------------- checks
def _check_tokens(x, like: torch.Tensor, name: str, *, low: float | None = None, high: float | None = None):
    """``x [B, T, H]`` (or None) with ``like``'s first three axes, finite, in ``[low, high]``."""
    if x is None:
        return None
    x = as_float_tensor(x, name)
    want = tuple(like.shape[:3])
    if tuple(x.shape) != want:
        raise ValueError(f"{name} must have shape [B, T, H] = {want} (from the token tensors), got {tuple(x.shape)}")
    check_finite(x.detach(), name)
    for bound, bad, rule in ((low, lambda t: t < low, f">= {low}"), (high, lambda t: t > high, f"<= {high}")):
        if bound is not None and bool(bad(x.detach()).any()):
            i = tuple(int(j) for j in bad(x.detach()).nonzero()[0])
            raise ValueError(f"{name} must be {rule} everywhere, got {x[i].item()!r} at index {i}")
    return x


def _check_state(x, shape: tuple, name: str):
    """An initial-state tensor of the given shape, finite."""
    x = as_float_tensor(x, name)
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    check_finite(x.detach(), name)
    return x


def _check_decayed(fq, fk, v, log_decay, initial_state):
    fq, fk, v = check_qkv(fq, fk, v, causal=True, names=("fq", "fk", "v"))
    log_decay = _check_tokens(log_decay, fk, "log_decay", high=0.0)
    B, _, H, M = fk.shape
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise TypeError(f"initial_state must be a pair (S [B, H, M, Dv], z [B, H, M]) or None, "
                            f"got {type(initial_state).__name__}")
        initial_state = (_check_state(initial_state[0], (B, H, M, v.shape[-1]), "initial_state[0] (S)"),
                         _check_state(initial_state[1], (B, H, M), "initial_state[1] (z)"))
    return fq, fk, v, log_decay, initial_state


def _check_delta(q, k, v, beta, log_alpha, initial_state):
    q, k, v = check_qkv(q, k, v, causal=True)
    if beta is None:
        raise TypeError("beta must be a tensor [B, T, H] with values in [0, 2], got None")
    beta = _check_tokens(beta, k, "beta", low=0.0, high=2.0)
    log_alpha = _check_tokens(log_alpha, k, "log_alpha", high=0.0)
    if initial_state is not None:
        B, _, H, M = k.shape
        initial_state = _check_state(initial_state, (B, H, M, v.shape[-1]), "initial_state (S)")
    return q, k, v, beta, log_alpha, initial_state


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 / float64 kept; half inputs are computed in float32."""
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


# ----------------------------------------------------------------------------------------------- naive twins
def decayed_linear_naive(fq, fk, v, log_decay=None, *, initial_state=None):
    r"""Decayed linear attention, step by step in float64: the definition.

    Parameters
    ----------
    fq, fk : Tensor ``[B, T, H, M]``
        Query and key features :math:`\phi(q_t)`, :math:`\phi(k_t)`.
    v : Tensor ``[B, T, H, Dv]``
    log_decay : Tensor ``[B, T, H]`` or None
        :math:`\log\gamma_t \le 0`, finite; applied *before* token ``t`` is added. None: no decay.
    initial_state : ``(S [B, H, M, Dv], z [B, H, M])`` or None
        The state after earlier tokens (None: zeros).

    Returns
    -------
    num : Tensor ``[B, T, H, Dv]`` float64
        :math:`S_t^\top\phi(q_t)`.
    den : Tensor ``[B, T, H]`` float64
        :math:`z_t\cdot\phi(q_t)` (the caller divides, with its own ``ε``).
    state : ``(S [B, H, M, Dv], z [B, H, M])`` float64
        After the last token.

    Notes
    -----
    For ``t = 0 … T−1``: :math:`S \leftarrow \gamma_t S + \phi(k_t) v_t^\top`,
    :math:`z \leftarrow \gamma_t z + \phi(k_t)`, then :math:`\text{num}_t = S^\top\phi(q_t)`,
    :math:`\text{den}_t = z\cdot\phi(q_t)`. Token ``t`` sees itself.
    """
    fq, fk, v, log_decay, initial_state = _check_decayed(fq, fk, v, log_decay, initial_state)
    f64 = torch.float64
    fq, fk, v = fq.to(f64), fk.to(f64), v.to(f64)
    B, T, H, M = fk.shape
    if initial_state is None:
        S, z = fk.new_zeros(B, H, M, v.shape[-1]), fk.new_zeros(B, H, M)
    else:
        S, z = initial_state[0].to(f64), initial_state[1].to(f64)
    nums, dens = [], []
    for t in range(T):
        if log_decay is not None:
            g = log_decay[:, t].to(f64).exp()  # [B, H]
            S, z = g[..., None, None] * S, g[..., None] * z
        S = S + fk[:, t, :, :, None] * v[:, t, :, None, :]  # [B, H, M, Dv]: φ(k_t) v_tᵀ
        z = z + fk[:, t]  # [B, H, M]
        nums.append(torch.einsum("bhm,bhmd->bhd", fq[:, t], S))  # [B, H, Dv]
        dens.append((fq[:, t] * z).sum(-1))  # [B, H]
    return torch.stack(nums, 1), torch.stack(dens, 1), (S, z)


def delta_rule_naive(q, k, v, beta, log_alpha=None, *, initial_state=None):
    r"""The (gated) delta rule, step by step in float64: the definition.

    Parameters
    ----------
    q, k : Tensor ``[B, T, H, M]``
        Queries and keys, L2-normalised by the caller (not normalised here).
    v : Tensor ``[B, T, H, Dv]``
    beta : Tensor ``[B, T, H]``
        Write strengths :math:`\beta_t \in [0, 2]`; ``β = 0`` is a null step (the state only decays).
    log_alpha : Tensor ``[B, T, H]`` or None
        :math:`\log\alpha_t \le 0`, finite (the gate of the gated delta rule). None: no decay.
    initial_state : Tensor ``S [B, H, M, Dv]`` or None
        The state after earlier tokens (None: zeros).

    Returns
    -------
    o : Tensor ``[B, T, H, Dv]`` float64
        :math:`S_t^\top q_t`.
    S : Tensor ``[B, H, M, Dv]`` float64
        After the last token.

    Notes
    -----
    For ``t = 0 … T−1``: :math:`S \leftarrow \alpha_t S`, then
    :math:`S \leftarrow S + \beta_t k_t (v_t - S^\top k_t)^\top` (with a unit key and ``β = 1`` the
    state's readout of ``k_t`` becomes exactly ``v_t``), then :math:`o_t = S^\top q_t`.
    ``S`` is key-dim × value-dim (flash-linear-attention's orientation).
    """
    q, k, v, beta, log_alpha, S = _check_delta(q, k, v, beta, log_alpha, initial_state)
    f64 = torch.float64
    q, k, v, beta = q.to(f64), k.to(f64), v.to(f64), beta.to(f64)
    B, T, H, M = k.shape
    S = k.new_zeros(B, H, M, v.shape[-1]) if S is None else S.to(f64)
    outs = []
    for t in range(T):
        if log_alpha is not None:
            S = log_alpha[:, t].to(f64).exp()[..., None, None] * S
        kt = k[:, t]  # [B, H, M]
        err = v[:, t] - torch.einsum("bhm,bhmd->bhd", kt, S)  # [B, H, Dv]: v_t − Sᵀk_t
        S = S + beta[:, t, :, None, None] * kt[..., :, None] * err[..., None, :]  # [B, H, M, Dv]
        outs.append(torch.einsum("bhm,bhmd->bhd", q[:, t], S))  # [B, H, Dv]
    return torch.stack(outs, 1), S


# ----------------------------------------------------------------------------------------------- chunked forms
def _chunks(x: torch.Tensor, C: int, N: int) -> torch.Tensor:
    """``[B, T, H, ·]`` (or ``[B, T, H]``) → ``[B, H, N, C, ·]`` (``[B, H, N, C]``), zero-padded to ``N·C``."""
    x = x.movedim(1, 2)  # [B, H, T, ·]
    if x.ndim == 3:
        return F.pad(x, (0, N * C - x.shape[2])).unflatten(2, (N, C))  # [B, H, N, C]
    return F.pad(x, (0, 0, 0, N * C - x.shape[2])).unflatten(2, (N, C))  # [B, H, N, C, ·]


def _decays(log_decay, like: torch.Tensor, C: int, N: int):
    """Chunk-local cumulative log-decay ``L [B, H, N, C]`` (inclusive; padded steps decay by 0) and the
    masked pairwise ``exp(L_i − L_j)`` for ``j ≤ i`` (``[B, H, N, C, C]``, zero above the diagonal)."""
    B, H = like.shape[0], like.shape[2]  # like: a token tensor [B, T, H, ·]
    if log_decay is None:
        L = like.new_zeros(B, H, N, C)
    else:
        L = _chunks(log_decay.to(like.dtype), C, N).cumsum(-1)  # [B, H, N, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=like.device).tril()  # j <= i
    diff = L[..., :, None] - L[..., None, :]  # [B, H, N, C, C]: L_i − L_j, <= 0 where j <= i
    pair = torch.where(causal, diff, torch.full((), float("-inf"), dtype=like.dtype, device=like.device)).exp()
    return L, pair


def decayed_linear_chunked(fq, fk, v, log_decay=None, *, initial_state=None, chunk_size: int = 64):
    r"""Decayed linear attention, chunked (PyTorch, differentiable by autograd).

    Same arguments and results as :func:`decayed_linear_naive`, computed in the inputs' dtype
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
    fq, fk, v, log_decay, initial_state = _check_decayed(fq, fk, v, log_decay, initial_state)
    return _decayed_linear(fq, fk, v, log_decay, initial_state, check_positive_int(chunk_size, "chunk_size"))


def _decayed_linear(fq, fk, v, log_decay, initial_state, C: int):
    """:func:`decayed_linear_chunked` on trusted arguments (the memory fast path's call: its own
    checks already cover them)."""
    dt = _work_dtype(v)
    B, T, H, M = fk.shape
    Dv = v.shape[-1]
    N = -(-T // C)
    v1 = torch.cat([v.to(dt), v.new_ones(B, T, H, 1, dtype=dt)], -1)  # [B, T, H, Dv + 1]: z as one more column
    q, k, w = _chunks(fq.to(dt), C, N), _chunks(fk.to(dt), C, N), _chunks(v1, C, N)  # [B, H, N, C, ·]
    L, pair = _decays(log_decay, v1, C, N)  # [B, H, N, C], [B, H, N, C, C]
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


def delta_rule_chunked(q, k, v, beta, log_alpha=None, *, initial_state=None, chunk_size: int = 64):
    r"""The (gated) delta rule in its chunked WY/UT form (PyTorch, differentiable by autograd).

    Same arguments and results as :func:`delta_rule_naive`, computed in the inputs' dtype
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
    q, k, v, beta, log_alpha, initial_state = _check_delta(q, k, v, beta, log_alpha, initial_state)
    return _delta_rule(q, k, v, beta, log_alpha, initial_state, check_positive_int(chunk_size, "chunk_size"))


def _delta_rule(q, k, v, beta, log_alpha, initial_state, C: int):
    """:func:`delta_rule_chunked` on trusted arguments (the memory fast path's call)."""
    dt = _work_dtype(v)
    B, T, H, M = k.shape
    Dv = v.shape[-1]
    N = -(-T // C)
    Q, K, V = _chunks(q.to(dt), C, N), _chunks(k.to(dt), C, N), _chunks(v.to(dt), C, N)  # [B, H, N, C, ·]
    b = _chunks(beta.to(dt), C, N)[..., None]  # [B, H, N, C, 1]; padded steps: β = 0, a null step
    L, pair = _decays(log_alpha, v.to(dt), C, N)  # [B, H, N, C], [B, H, N, C, C] (j <= i)
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
