r"""The decoding step of memory attention, every memory mechanism (DESIGN §7): one token (``T = 1``) after a :class:`MemoryState`,
the four steps in torch over ``[B, H]`` at once — no schedule, no event stream, no chunked recurrence.

Called by :func:`sketchlab.attention.memory_fast.run` on checked arguments (trusted here). It takes the
same decisions as the general path (the schedule's: scores in float64 against the decayed state, the
least score evicted, ties to the oldest, the evicted key's slot else the first free one) and gives the
same output and state to round-off; gradients flow through every value given the choices.

A step is a few dozen small tensor operations, so their count is its cost: every tensor stays
``[B, H, 1, ·]`` (the token's axis kept), products are row vector times matrix (``[1, D] @ [D, n]``; the
column form ``[n, D] @ [D, 1]`` takes a slow batched path on the CPU), a key's ``k, v, φ`` are one row of
one buffer (one copy, one write, one read for the three), and nothing runs for a mechanism the options
do not have.

:func:`leave_cached` is the cache's choice in the lean in-place step
(:class:`sketchlab.attention.recurrent.RecurrentStep`'s torch twin), on that step's buffers.
"""

from __future__ import annotations

import torch

from ..._checks import denominator_counts, report_denominators
from ...memory_state import MemoryState, vouch
from ..decayed.decay import far_log_decay
from ..delta.beta import far_beta, unit
from ..hybrid import combine_delta, gate_weight, local_weights, mix
from .score import recall_score

__all__ = ["decode", "leave_cached", "rescored"]

#: Sorts after every position: a slot not in the running for "the oldest".
_NEVER = torch.iinfo(torch.long).max


def _rows(st: MemoryState) -> torch.Tensor:
    """The held keys of ``st`` as rows ``[k | v | 1 | φ]`` ``[B, H, L_s + L_w + K, D + Dv + 1 + M]``: the
    sinks (φ zero: never read), the window, the cache."""
    f = st.phi_window
    phi = torch.cat([f.new_zeros(*f.shape[:2], st.k_sink.shape[2], f.shape[3]), f, st.phi_cache], 2)
    k, v = (torch.cat([a, b, c], 2) for a, b, c in ((st.k_sink, st.k_window, st.k_cache),
                                                     (st.v_sink, st.v_window, st.v_cache)))
    return torch.cat([k, v, v.new_ones(*v.shape[:3], 1), phi], -1)


def decode(c) -> torch.Tensor | tuple[torch.Tensor, MemoryState]:
    """One step (``c.T == 1``, ``c.state`` given) of every memory mechanism on checked arguments ``c``.

    Every held key is one row ``[k | v | 1 | φ]`` of one buffer per step, ``[sinks | held window | new
    token | cache]`` (sinks: φ unused): one ``cat`` copies the state in, the key leaving the window (the
    window part's first row) is written into its cache slot in place (one ``scatter``), the entering key
    is one row (one ``index_select``), the exact part reads the whole buffer under one mask (one product
    for the logits, one for ``[Σ a v | Σ a]``: the column of ones). The additive far state is ``[S | z]``
    ``[B, H, M, Dv + 1]``: one product decays it, enters a key (its ``[v | 1]``) and reads it. The new
    state's fields are views of the buffer and of ``[S | z]``, which the state keeps (``_rows``; its
    ``.detach()`` and ``.to()`` too) for the next step: a state made otherwise is laid out once (:func:`_rows`).

    Parameters
    ----------
    c : types.SimpleNamespace
        A checked memory call (:func:`sketchlab.attention.memory_state.check_memory_call`) of one token with a state.

    Returns
    -------
    Tensor ``[B, 1, H, Dv]`` (the inputs' dtype), or ``(o, MemoryState)`` when ``c.final``.
    """
    work, dev, st, o = c.work, c.phi_q.device, c.state, c.o
    B, H, w, s, K, D, Dv = c.B, c.H, c.w, c.s, c.K, c.D, c.Dv
    pos, Lw, Ls = st.offset, st.k_window.shape[2], st.k_sink.shape[2]
    end, F1 = pos + 1, D + Dv + 1  # φ's first column
    tr = lambda x: (x if x.dtype == work else x.to(work)).transpose(1, 2)  # noqa: E731  [B, 1, H, ·] -> [B, H, 1, ·]
    fq, vv = tr(c.phi_q), tr(c.v)
    real = torch.ones(B, 1, dtype=torch.bool, device=dev) if c.mask is None else c.mask  # [B, 1]
    lg = far_log_decay(c, vv.transpose(1, 2), c.mask)  # [B, 1, H] or None
    old, row0, Sz = st.__dict__.get("_rows", (None, Ls, None))
    if Sz is None:
        Sz = st.S if c.delta else torch.cat([st.S, st.z[..., None]], -1)  # [B, H, M, Dv (+ 1)]
    row = torch.cat([*([tr(c.k)] if w else []), vv, vv.new_ones(B, H, 1, 1), tr(c.phi_k)], -1)  # [B, H, 1, F]
    # the buffer's rows: sinks [0, Ls2), the window part [Ls2, c0) (the held window, the new token), the cache [c0, c0 + K)
    Ls2 = min(s, end)
    c0 = Ls2 + Lw + 1
    if w:
        old = _rows(st) if old is None else old
        buf = torch.cat([old[:, :, :Ls], *([row] if pos < s else []), old[:, :, row0:row0 + Lw], row,
                         old[:, :, old.shape[2] - K:]], 2)  # [B, H, c0 + K, F]
    # 1. decay (the scores below read the state before it, times γ)
    S0, gamma = Sz, None
    if lg is not None:
        gamma = lg.transpose(1, 2).exp()[..., None]  # [B, H, 1, 1]
        Sz = Sz * gamma
    # 2. leave: the key at position pos − w (the held window's oldest, or the new token when w = 0)
    j = pos - w
    leaves = j >= s and (w == 0 or Lw == w)
    cr, cand = (old[:, :, row0:row0 + 1], st.mask_window[:, :1]) if w else (row, real)  # its row [B, H, 1, F], real
    score, cached, pos_cache = st.score_cache, st.cached, st.pos_cache
    enters = None  # [B, H | 1, 1] bool: a key enters the state (er: its row [B, H, 1, F])
    rescore = pos % o.rescore == 0
    if K and (leaves or rescore):
        with torch.no_grad():
            Sz64, scale, score64 = S0.double(), None if gamma is None else gamma.double(), score.double()
            if rescore and bool(cached.any()):  # re-score the cache against the state
                fresh = recall_score(Sz64, scale, buf[:, :, c0:, F1:], buf[:, :, c0:, D:D + Dv], delta=c.delta,
                                     eps=o.eps)
                score64 = torch.where(cached, fresh, score64)
        score = score if leaves else score64.to(work)  # leaving: set below
    if leaves and K == 0:  # every leaving key enters at once
        enters, er = cand[:, :, None], cr
    elif leaves:
        with torch.no_grad():
            sj = recall_score(Sz64, scale, cr[..., F1:], cr[..., D:D + Dv], delta=c.delta, eps=o.eps)  # [B, H, 1]
            ranked = torch.where(cached, score64, float("-inf"))  # an empty slot first (pos_cache −1: the first)
            least = ranked.amin(-1, keepdim=True)
            # the candidate is newer than every cached key: it is evicted only below every slot's score (slot K)
            target = torch.where(sj < least, K, torch.where(ranked == least, pos_cache, _NEVER).argmin(-1, keepdim=True))
            place = cand[..., None] & (target < K)  # [B, H, 1]: the candidate takes slot `target`
            enters = cand[..., None] & (least > float("-inf"))  # a full cache: a key enters the state
            # the candidate's row goes to its slot, else to its own row Ls2 (a write of the values already there);
            # where a key enters, that row held it (the evicted slot's, or the candidate's own)
            at = torch.where(place, target + c0, Ls2)  # [B, H, 1]
            put = torch.arange(c0, c0 + K, device=dev) == at  # [B, H, K]: the slot taken (none: at = Ls2 < c0)
            lane = torch.arange(0, B * H * buf.shape[2], buf.shape[2], device=dev).view(B, H, 1)
        # index_select (unlike gather) keeps no reference to the buffer for its backward: the write may follow
        er = buf.view(-1, buf.shape[3]).index_select(0, (lane + at).flatten()).view(B, H, 1, -1)
        buf.scatter_(2, at[..., None].expand(B, H, 1, buf.shape[3]), cr)
        score = torch.where(put, sj, score64).to(work)
        pos_cache, cached = torch.where(put, j, pos_cache), cached | put
    # 3. enter (a null event where `enters` is False: φ = 0 additive, β = 0 delta)
    if enters is not None:
        fe = er[..., F1:]
        if c.delta:
            kh, beta = unit(fe), (far_beta(c, er[:, :, 0, D:D + Dv]) * enters[..., 0])[..., None, None]  # [B, H, 1, ·]
            Sz = torch.addcmul(Sz, beta * kh.mT, er[..., D:D + Dv] - kh @ Sz)
        else:  # [S | z] += φ [v | 1]
            Sz = torch.addcmul(Sz, (fe * enters[..., None]).mT, er[..., D:F1])
    # 4. read
    far = unit(fq) @ Sz if c.delta else fq @ Sz  # [B, H, 1, Dv]; additive [Σ φ·v | φ·z] [B, H, 1, Dv + 1]
    drop = Lw + 1 - min(w, end)  # window-part rows that left the window
    if w:
        m_win = torch.cat([st.mask_window, real], 1)  # [B, Lw + 1]
        m_snk = torch.cat([st.mask_sink, real], 1) if pos < s else st.mask_sink
        cut = min(Lw + 1, max(drop, s - (pos - Lw)))  # leading window-part rows that are not exact keys: gone, or sinks
        ok = torch.cat([m_snk[:, None].expand(B, H, -1), *([cached.new_zeros(B, H, cut)] if cut else []),
                        m_win[:, None, cut:].expand(B, H, -1), cached], -1)  # [B, H, c0 + K]: the buffer's exact keys
        g = gate_weight(c.far["gate"], H, dtype=work, device=dev)[:, None]  # [H, 1]
        logits = c.scale * (tr(c.q) @ buf[..., :D].mT)  # [B, H, 1, c0 + K]
        a = local_weights(logits, ok[:, :, None], local=o.local, degree=c.degree)
        ex = a @ buf[..., D:F1]  # [Σ a v | Σ a] [B, H, 1, Dv + 1]
        if c.delta:
            out = combine_delta(ex[..., :Dv], ex[..., Dv], ok.any(-1)[..., None], far, g)
        else:  # the gate on the packed sums [Σ v | Σ 1] (a linear mix): [num | den] of the one combine
            far = mix(ex, far, g[..., None])
    elif c.delta:
        out = far
    if not c.delta:
        den = far[..., Dv:]
        if c.normalize == "sum" and o.denominator_check != "off" and bool((den <= 0).any()):
            report_denominators(denominator_counts(den[..., 0, 0], real), B * H, "memory_attention",
                                o.denominator_check)
        out = far[..., :Dv] / (den + o.eps) if w or c.normalize == "sum" else far[..., :Dv]
    out = out.transpose(1, 2).to(c.in_dtype)  # [B, 1, H, Dv]
    if not c.final:
        return out
    if w:  # the new state's fields: views of the buffer
        snk, win, cache = buf[:, :, :Ls2], buf[:, :, Ls2 + drop:c0], buf[:, :, c0:]
        fields = dict(k_sink=snk[..., :D], v_sink=snk[..., D:D + Dv], k_window=win[..., :D], v_window=win[..., D:D + Dv],
                      phi_window=win[..., F1:], k_cache=cache[..., :D], v_cache=cache[..., D:D + Dv],
                      phi_cache=cache[..., F1:], mask_window=m_win[:, drop:], mask_sink=m_snk)
    else:
        fields = {name: getattr(st, name) for name in ("k_sink", "v_sink", "k_window", "v_window", "phi_window",
                                                        "k_cache", "v_cache", "phi_cache", "mask_window", "mask_sink")}
    S, z = (Sz, torch.zeros_like(st.z)) if c.delta else (Sz[..., :Dv], Sz[..., Dv])
    state = MemoryState(S=S, z=z, score_cache=score, cached=cached, pos_cache=pos_cache, offset=end, **fields)
    # the layout the next step reads (a state of the checked shapes: the next call of this signature need not check it)
    object.__setattr__(state, "_rows", (buf if w else None, Ls2 + drop, None if c.delta else Sz))
    return out, vouch(state, c.sig)


def rescored(rs, gamma) -> torch.Tensor:
    """The lean step's cache scores ``[B·H, K]`` float64 with every cached key scored again against the far state
    before this token's decay times ``γ`` (``gamma [B·H, 1, 1]`` or None), unrounded; the empty slots' as held.
    Every ``rescore`` positions, in the torch twin (:func:`leave_cached`) and the compiled step alike."""
    c0 = rs.s + rs.w
    S64 = (rs.S if rs.delta else rs.Sz).double()
    fresh = recall_score(S64, None if gamma is None else gamma.double(), rs.Phi[:, c0:], rs.V[:, c0:], delta=rs.delta,
                         eps=rs.o.eps)
    return torch.where(rs.cached, fresh, rs.score64)


def leave_cached(rs, P: int, i: int, gamma):
    """The lean step's cache choice, in place on the buffers of ``rs`` (a laid-out
    :class:`~sketchlab.attention.recurrent.RecurrentStep`: its torch twin; the compiled step makes the same choice):
    step 2 with a cache (DESIGN §7), before the decay is applied (the scores read ``γ·S``): every
    ``rescore`` positions re-score the cached keys; the key leaving the window (row ``i``, position
    ``P − w``) is scored and takes the least-scored slot (an empty slot first; ties: the oldest key)
    unless it scores below all of them. Returns what enters the state (the key pushed out, or the
    candidate itself; ``(φ, [v | 1], real)``) or None.

    The scores are float64 as the reference's; :attr:`rs.score64` holds them as the state stores them
    (rounded to its dtype), so a choice compares exactly what the reference compares."""
    w, s, Dv, eps = rs.w, rs.s, rs.Dv, rs.o.eps
    j = P - w
    leaves, rescore = j >= s, P % rs.o.rescore == 0
    if not (leaves or rescore):
        return None
    c0, delta = s + w, rs.delta
    # the choice's scores: re-scored ones unrounded, as the reference's
    score = rescored(rs, gamma) if rescore and bool(rs.cached.any()) else rs.score64
    if not leaves:
        rs.score64.copy_(score.to(rs.work))
        return None
    S64, scale = (rs.S if delta else rs.Sz).double(), None if gamma is None else gamma.double()
    sj = recall_score(S64, scale, rs.Phi[:, i:i + 1], rs.V[:, i:i + 1], delta=delta, eps=eps)  # [BH, 1]
    ranked = score if rs.cache_full else torch.where(rs.cached, score, float("-inf"))
    least = ranked.amin(-1, keepdim=True)  # [BH, 1]
    oldest = torch.where(ranked == least, rs.pos_cache, rs.never).argmin(-1, keepdim=True)
    below = sj < least  # the candidate is newer than every cached key: evicted only below all their scores
    real = None if i not in rs.holes else rs.real[:, i, None]  # [BH, 1]
    stay = below if real is None else below | ~real  # the candidate takes no slot
    at = torch.where(stay, i, oldest + c0)  # [BH, 1]: the row that enters the state (and takes the candidate)
    put = rs.slots == at  # [BH, K]
    f = rs.Phi.gather(1, at[..., None].expand(-1, 1, rs.F))  # [BH, 1, F] (copies: the rows are written next)
    v1 = rs.VS.gather(1, at[..., None].expand(-1, 1, Dv + 1))  # [BH, 1, Dv + 1]
    rs.Kt.scatter_(2, at[:, None].expand(-1, rs.D, 1), rs.Kt[:, :, i:i + 1].clone())
    rs.Phi.scatter_(1, at[..., None].expand(-1, 1, rs.F), rs.Phi[:, i:i + 1].clone())
    rs.VS.scatter_(1, at[..., None].expand(-1, 1, Dv + 1), rs.VS[:, i:i + 1].clone())
    # stored as the state stores them, rounded to its dtype: the candidate's score and this step's re-scores alike
    kept = torch.where(put, sj, score)
    rs.score64.copy_(kept if rs.work == torch.float64 else kept.to(rs.work).double())
    rs.pos_cache.masked_fill_(put, j)
    enters = None  # a full cache: a key enters the state wherever the candidate is real
    if not rs.cache_full:
        enters = least > float("-inf")
        rs.cached |= put
        rs._cache_filled()
    if real is not None:
        enters = real if enters is None else enters & real
    return f, v1, None if enters is None else enters[..., None].to(f.dtype)
