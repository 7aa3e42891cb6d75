r"""The chunked PyTorch path of the sliding-window hybrid (layout inside: ``[B, H, T, ·]``).

Split from :mod:`.chunk`, whose driver (called by the op, which validates the call) dispatches here. The
causal path runs :func:`sketchlab.attention.ops.additive.chunk_hybrid.hybrid_core` block by block: for query
chunk ``c`` of ``C`` tokens the local keys (window ``w`` and sinks) are read from the key chunks
``0 … ⌈(w + C − 1)/C⌉ − 1`` back with fixed masks, so the local part costs ``O(T·(w + C))``,
never ``T²``; the far keys come from the carried :class:`~sketchlab.attention.AttentionState`
(a key enters ``S, z`` only once it has left the window). The non-causal path reads a band of keys
through the one hybrid combine, :mod:`sketchlab.attention.ops.hybrid`; decoding one token is
:mod:`.recurrent`'s.
The formula and its float64 twin:
:func:`sketchlab.attention.ops.additive.naive.feature_attention_naive`. Inputs are trusted (checked by the
public entry points).
"""

from __future__ import annotations

import torch

from ....polynomial import self_tensor
from ..hybrid import combine, exact_sums, gate_weight
from .chunk_hybrid import hybrid_core

__all__ = ["HybridSettings", "hybrid_causal_block", "hybrid_noncausal"]


def _pad_tokens(x: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad ``x[B, H, n, ·]`` along the token axis to ``length`` (zero features/values add nothing)."""
    extra = length - x.shape[2]
    return x if extra == 0 else torch.nn.functional.pad(x, (0, 0, 0, extra))


def _band(x: torch.Tensor, width: int, step: int) -> torch.Tensor:
    """Overlapping windows ``x[:, :, cC : cC + width]`` of ``x[B, H, L, F]`` → ``[B, H, N, width, F]``."""
    return x.unfold(2, width, step).movedim(-1, 3)  # [B, H, N, width, F] (a view)


def _pad_front(x: torch.Tensor, before: int, after: int = 0) -> torch.Tensor:
    """Zero-pad ``x[B, H, L, F]`` (or a mask ``[B, L]``) along the token axis."""
    if x.ndim == 2:
        return torch.nn.functional.pad(x, (before, after), value=False)
    return torch.nn.functional.pad(x, (0, 0, before, after))


class HybridSettings:
    """The settings of one hybrid call, shared by its blocks and decoding steps; the exact sums and the combine are
    :mod:`sketchlab.attention.ops.hybrid`'s.

    Parameters
    ----------
    window, sinks : int
    local : str
        ``"softmax"`` or ``"poly"``.
    scale : float
        The local logits' scale.
    degree : int or None
        ``p`` of ``local="poly"``.
    gate : Tensor ``[H]`` or None
        The gate logits; held as ``g [1, H, 1, 1]`` (:func:`~sketchlab.attention.ops.hybrid.gate_weight`).
    eps : float
    non_negative : bool
        The far features self-tensored (``lift``: ``φ ⊗ φ``).
    heads : int
    like : Tensor
        The dtype and device of ``g``.
    """

    def __init__(self, *, window, sinks, local, scale, degree, gate, eps, non_negative, heads, like):
        self.window, self.sinks, self.local, self.scale, self.degree, self.eps = window, sinks, local, scale, degree, eps
        self.non_negative = non_negative
        self.g = gate_weight(gate, heads, dtype=like.dtype, device=like.device)[None, :, None, None]  # [1, H, 1, 1]
        self.lift = self_tensor if non_negative else (lambda f: f)

    def exact(self, qc, keys):
        r"""The exact sums ``(Σ a v [B, H, N, C, Dv], Σ a [B, H, N, C])`` of query chunks ``qc [B, H, N, C, D]``
        against groups of exact keys ``(k [B, H, N|1, U, D], v [B, H, N|1, U, Dv], ok [B|1, 1, N|1, C|1, U])``
        (the band of local keys, the sinks), one shift over them all (:func:`~sketchlab.attention.ops.hybrid.exact_sums`)."""
        return exact_sums([((qc @ k.mT) * self.scale, ok, v) for k, v, ok in keys],  # logits [B, H, N, C, U]
                          local=self.local, degree=self.degree)


def hybrid_causal_block(h: HybridSettings, state, q_new, k_new, v_new, fq_new, fk_new, valid_new, C: int, counter):
    """One block of ``n`` new tokens of the causal hybrid, continuing ``state`` (positions from ``state.offset``).

    The keys are the held window and the block's tokens behind zeros to whole chunks (``off`` keys
    before the block, ``off/C >= `` the local lags in chunks − 1, so every query chunk has a key
    chunk at each lag): :func:`~sketchlab.attention.ops.additive.chunk_hybrid.hybrid_core` joins them in its own
    chunk-major copy and returns the new ``S, z`` and the window the next block holds. Far part:
    lag ``w`` on the keys' features with the sinks and padding out; local part: for query chunk
    ``c`` the ``C × C`` logits against each key chunk ``L = 0 … ⌈(w + C − 1)/C⌉ − 1`` back (each a
    slice), the sinks' beside them, masked by one precomputed lag mask and the keys' validity, the
    row maximum ``c_i`` taken over all of them. Cost ``O(n·(w + C + sinks)·(D + M))``.

    Parameters
    ----------
    h : HybridSettings
    state : AttentionState
    q_new, k_new : Tensor ``[B, H, n, D]``
    v_new : Tensor ``[B, H, n, Dv]``
    fq_new, fk_new : Tensor ``[B, H, n, M]``
    valid_new : Tensor ``[B, n]`` bool or None
        Real keys (None: all).
    C : int
        The chunk size.
    counter : DenominatorCounter or None

    Returns
    -------
    out : Tensor ``[B, H, n, Dv]``
    state : AttentionState
        After the block.
    """
    from ...state import AttentionState

    B, H, n, Dv = v_new.shape
    P0, w, sinks = state.offset, h.window, h.sinks
    dev = v_new.device
    # sinks: the first `sinks` positions, held apart; they never enter the local lags or the far sums
    ns = max(0, min(sinks - P0, n))
    mask_sink = state.mask_sink
    if ns:
        old_ms = torch.ones(B, state.k_sink.shape[2], dtype=torch.bool, device=dev) if mask_sink is None else mask_sink
        mask_sink = None if valid_new is None and mask_sink is None else torch.cat(
            [old_ms, torch.ones(B, ns, dtype=torch.bool, device=dev) if valid_new is None else valid_new[:, :ns]], 1)
        k_sink = torch.cat([state.k_sink, k_new[:, :, :ns]], 2)
        v_sink = torch.cat([state.v_sink, v_new[:, :, :ns]], 2)
    else:
        k_sink, v_sink = state.k_sink, state.v_sink
    Ls = k_sink.shape[2]
    Lw = state.k_window.shape[2]
    N = -(-n // C)
    n_loc = -(-(w + C - 1) // C)  # key chunks back with a local key: 0 <= L·C − (C − 1) < w
    Wc0 = -(-Lw // C)
    n_loc = min(n_loc, Wc0 + N)  # further back there are no keys but the far state's
    Wc = max(Wc0, n_loc - 1)
    off = Wc * C
    front = off - Lw

    mw = torch.ones(B, Lw, dtype=torch.bool, device=dev) if state.mask_window is None else state.mask_window
    mn = torch.ones(B, n, dtype=torch.bool, device=dev) if valid_new is None else valid_new
    mp = torch.cat([mw.new_zeros(B, front), mw, mn], 1)  # [B, off + n]: front zeros | held window | new tokens
    pos = torch.arange(P0 - off, P0 + n, device=dev)  # [off + n]
    ok = mp & (pos >= sinks)[None, :]  # a local / far key: real and not a sink
    qpos = P0 + torch.arange(n, device=dev)  # [n]
    sink_ok = (torch.arange(Ls, device=dev) <= qpos[:, None])[None, None]  # [1, 1, n, Ls]
    if mask_sink is not None:
        sink_ok = sink_ok & mask_sink[:, None, None, :]
    out, den, S_new, z_new, phi_w, v_w, k_w = hybrid_core(
        fq_new, fk_new, v_new, q_new, k_new, state.phi_window, state.v_window, state.k_window, k_sink, v_sink,
        state.S, state.z, h.g.view(-1), ok, sink_ok, off=off, window=w, chunk_size=C,
        non_negative=h.non_negative, scale=h.scale, local=h.local, degree=h.degree, eps=h.eps)
    if counter is not None:
        counter.add(den, mn)
    we = min(w, P0 + n)  # the new window: the last `we` positions (the core returns their keys)
    has_mask = state.mask_window is not None or valid_new is not None
    new_state = AttentionState(
        S=S_new, z=z_new, k_window=k_w, v_window=v_w, phi_window=phi_w, k_sink=k_sink, v_sink=v_sink, offset=P0 + n,
        mask_window=mp[:, off + n - we:] if has_mask else None, mask_sink=mask_sink)
    return out, new_state


def hybrid_noncausal(h: HybridSettings, q, k, v, fq, fk, valid, C: int, counter):
    """The non-causal hybrid on whole sequences (``T == S``): local ``|i−j| < w`` and the sinks, far every other key,
    as a prefix state (keys before the chunk's band), the band ``a − w_e … a + C + w_e − 1`` with masks, and a
    suffix state (keys after it).

    Parameters
    ----------
    h : HybridSettings
    q, k : Tensor ``[B, H, T, D]``
    v : Tensor ``[B, H, T, Dv]``
    fq, fk : Tensor ``[B, H, T, M]``
    valid : Tensor ``[B, T]`` bool or None
        Real keys (None: all).
    C : int
        The chunk size.
    counter : DenominatorCounter or None

    Returns
    -------
    Tensor ``[B, H, T, Dv]``
    """
    B, H, T, Dv = v.shape
    dev = v.device
    w, sinks = h.window, h.sinks
    we = min(w, T)
    N = -(-T // C)
    tail = N * C - T
    mn = torch.ones(B, T, dtype=torch.bool, device=dev) if valid is None else valid
    ok = mn & (torch.arange(T, device=dev) >= sinks)[None, :]  # [B, T]
    Ls = min(sinks, T)
    k_sink, v_sink = k[:, :, :Ls], v[:, :, :Ls]
    lf = h.lift(fk * ok[:, None, :, None])  # [B, H, T, M2]

    def chunk_sums(x_f, x_v):  # [B, H, N·C, ·] -> per-chunk Σ φᵀv, Σ φ
        xf, xv = x_f.unflatten(2, (N, C)), x_v.unflatten(2, (N, C))
        return xf.mT @ xv, xf.sum(3)  # [B, H, N, M2, Dv], [B, H, N, M2]

    # prefix: keys j < cC − we  ⇔  (j + we) in chunks before c
    up, zp = chunk_sums(_pad_front(lf, we, N * C)[:, :, : N * C], _pad_front(v, we, N * C)[:, :, : N * C])
    pre = torch.cat([torch.zeros_like(up[:, :, :1]), up[:, :, :-1]], 2).cumsum(2)
    zpre = torch.cat([torch.zeros_like(zp[:, :, :1]), zp[:, :, :-1]], 2).cumsum(2)
    # suffix: keys j >= cC + C + we  ⇔  (j − we) in chunks after c
    us, zs = chunk_sums(_pad_tokens(lf[:, :, we:], N * C), _pad_tokens(v[:, :, we:], N * C))
    suf = torch.cat([us[:, :, 1:], torch.zeros_like(us[:, :, :1])], 2).flip(2).cumsum(2).flip(2)
    zsuf = torch.cat([zs[:, :, 1:], torch.zeros_like(zs[:, :, :1])], 2).flip(2).cumsum(2).flip(2)
    U = C + 2 * we
    kp, vp, fp = (_pad_front(x, we, tail + we) for x in (k, v, fk))  # [B, H, N·C + 2we, ·]
    okp = _pad_front(ok, we, tail + we)  # [B, N·C + 2we]
    band_ok = okp.unfold(1, U, C)[:, None, :, None, :]  # [B, 1, N, 1, U]
    r = torch.arange(C, device=dev)[:, None]
    u = torch.arange(U, device=dev)[None, :]
    lag = (we + r - u).abs()  # |i − j|   [C, U]
    far_ok, loc_ok = band_ok & (lag >= w), band_ok & (lag < w)
    sink_ok = torch.ones(1, 1, 1, 1, Ls, dtype=torch.bool, device=dev)
    if valid is not None:
        sink_ok = sink_ok & valid[:, None, None, None, :Ls]
    fqc = _pad_tokens(fq, N * C).unflatten(2, (N, C))  # [B, H, N, C, M]
    qc = _pad_tokens(q, N * C).unflatten(2, (N, C))  # [B, H, N, C, D]
    lq = h.lift(fqc)
    band_v = _band(vp, U, C)
    # far: the prefix and suffix states, and the band's far keys read directly
    fs = fqc @ _band(fp, U, C).mT  # [B, H, N, C, U]
    if h.non_negative:
        fs = fs.square()  # (φq·φk)² = (φ⊗φ)(q)·(φ⊗φ)(k)
    fs = torch.where(far_ok, fs, fs.new_zeros(()))
    far_num = lq @ (pre + suf) + fs @ band_v  # [B, H, N, C, Dv]
    far_den = (lq @ (zpre + zsuf)[..., None]).squeeze(-1) + fs.sum(-1)  # [B, H, N, C]
    ex_num, ex_den = h.exact(qc, [(_band(kp, U, C), band_v, loc_ok), (k_sink[:, :, None], v_sink[:, :, None], sink_ok)])
    out, den = combine(ex_num, ex_den, far_num, far_den, h.g, eps=h.eps)
    if counter is not None:
        counter.add(den.flatten(2, 3)[:, :, :T], mn)
    return out.flatten(2, 3)[:, :, :T]  # [B, H, T, Dv]

