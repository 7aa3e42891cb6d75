r"""The decoding step of memory attention (DESIGN §7): one token (``T = 1``) after a :class:`MemoryState`,
the four steps in torch over ``[B, H]`` at once — no schedule, no event stream, no chunked recurrence.

Called by :func:`sketchlab.attention.memory_fast.run` on checked arguments (trusted here). It takes the
same decisions as the general path (the schedule's: scores in float64 against the decayed state, the
least score evicted, ties to the oldest, the evicted key's slot else the first free one) and gives the
same output and state to round-off; gradients flow through every value given the choices.

A step is a few dozen small tensor operations, so their count is its cost: every tensor stays
``[B, H, 1, ·]`` (the token's axis kept), products are row vector times matrix (``[1, D] @ [D, n]``; the
column form ``[n, D] @ [D, 1]`` takes a slow batched path on the CPU), a cache slot is written by one
``scatter`` per field (a masked ``where`` over the whole cache costs several times more), and nothing
runs for a mechanism the options do not have.
"""

from __future__ import annotations

import torch

from ._checks import report_denominators
from .memory_state import MemoryState, _beta, _gate, _log_decay, unit, vouch

#: Sorts after every position: a slot not in the running for "the oldest".
_NEVER = torch.iinfo(torch.long).max


def _score(Sz: torch.Tensor, scale: torch.Tensor | None, phi: torch.Tensor, v: torch.Tensor, *, delta: bool,
           eps: float) -> torch.Tensor:
    r"""The recall error :math:`\lVert v - r\rVert^2` of keys ``phi [B, H, n, M]``, ``v [B, H, n, Dv]``
    against the float64 state ``scale·Sz`` (``Sz [B, H, M, Dv]``: ``S``, with ``z`` as one more column
    when additive; ``scale [B, H, 1, 1]`` or None for 1) as the schedule computes it (one product for
    the read and its denominator, then the scale) → ``[B, H, n]``."""
    phi, v = phi.double(), v.double()
    r = (unit(phi) if delta else phi) @ Sz  # [B, H, n, Dv (+ 1)]
    if scale is not None:
        r = r * scale
    if not delta:
        den = r[..., -1:] + eps
        r = r[..., :-1] / torch.where(den == 0, 1.0, den)
    return (v - r).square().sum(-1)


def _local_weights(c, logits: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """The exact part's unnormalised weights of ``logits`` where ``ok`` (zero elsewhere): ``exp(logit − max)``
    (``c.o.local == "softmax"``; the max over the allowed keys, 0 for a row with none) else ``logit ** c.degree``."""
    if c.o.local == "softmax":
        logits = torch.where(ok, logits, float("-inf"))  # exp(-inf) = 0: the masked keys
        return (logits - logits.amax(-1, keepdim=True).nan_to_num(neginf=0.0)).exp()
    return torch.where(ok, logits ** c.degree, logits.new_zeros(()))


def decode(c) -> torch.Tensor | tuple[torch.Tensor, MemoryState]:
    """One step (``c.T == 1``, ``c.state`` given) on checked arguments ``c``.

    With a window, each of keys, values and features lives in one new buffer per step, ``[sinks | held
    window | new token | cache]`` (features: no sinks): one ``cat`` copies the state in, the key leaving
    the window (the window part's first row) is written into its cache slot in place, the exact part
    reads the whole buffer under one mask (one product for the logits, one for ``Σ a v``), and the new
    state's fields are views of it (one storage per field, one row more than the fields hold).
    """
    work, dev, st, o = c.work, c.phi_q.device, c.state, c.o
    B, H, w, s, K = c.B, c.H, c.w, c.s, c.K
    pos, Lw, Ls = st.offset, st.k_window.shape[2], st.k_sink.shape[2]
    end = pos + 1
    tr = lambda x: (x if x.dtype == work else x.to(work)).transpose(1, 2)  # noqa: E731  [B, 1, H, ·] -> [B, H, 1, ·]
    fq, fk, vv = tr(c.phi_q), tr(c.phi_k), tr(c.v)
    real = torch.ones(B, 1, dtype=torch.bool, device=dev) if c.mask is None else c.mask  # [B, 1]
    lg = _log_decay(c, vv.transpose(1, 2), c.mask)  # [B, 1, H] or None
    # 1. decay
    S, z, gamma = st.S, st.z, None
    if lg is not None:
        gamma = lg.transpose(1, 2).exp()[..., None]  # [B, H, 1, 1]
        S, z = S * gamma, z * gamma[..., 0]
    # the buffers; rows: sinks [0, Ls2), the window part [Ls2, Ls2 + Lw + 1) (the held window, the new
    # token), the cache [c0, c0 + K); features without the sinks (their cache from cf = Lw + 1)
    Ls2, cf = min(s, end), Lw + 1
    c0 = Ls2 + cf
    if w:
        kk, snk = tr(c.k), ([tr(c.k)], [vv]) if pos < s else ([], [])
        buf_k = torch.cat([st.k_sink, *snk[0], st.k_window, kk, st.k_cache], 2)  # [B, H, c0 + K, D]
        buf_v = torch.cat([st.v_sink, *snk[1], st.v_window, vv, st.v_cache], 2)  # [B, H, c0 + K, Dv]
        buf_f = torch.cat([st.phi_window, fk, st.phi_cache], 2)  # [B, H, cf + K, M]
    # 2. leave: the key at position pos − w (the held window's oldest, or the new token when w = 0)
    j = pos - w
    leaves = j >= s and (w == 0 or Lw == w)
    if w:
        kj, vj, fj, cand = st.k_window[:, :, :1], st.v_window[:, :, :1], st.phi_window[:, :, :1], st.mask_window[:, :1]
    else:
        vj, fj, cand = vv, fk, real
    score, cached, pos_cache = st.score_cache, st.cached, st.pos_cache
    enters = None  # [B, H | 1, 1] bool: a key enters the state (fe, ve: its φ, v [B, H, 1, ·])
    rescore = pos % o.rescore == 0
    if K and (leaves or rescore):
        with torch.no_grad():
            Sz = (st.S if c.delta else torch.cat([st.S, st.z[..., None]], -1)).double()  # [B, H, M, Dv (+ 1)]
            scale = None if gamma is None else gamma.double()
            score64 = score.double()
            if rescore and bool(cached.any()):  # re-score the cache against the state
                score64 = torch.where(cached, _score(Sz, scale, st.phi_cache, st.v_cache, delta=c.delta, eps=o.eps),
                                      score64)
        score = score64.to(work)
    if leaves and K == 0:  # every leaving key enters at once
        enters, fe, ve = cand[:, :, None], fj, vj
    elif leaves:
        with torch.no_grad():
            sj = _score(Sz, scale, fj, vj, delta=c.delta, eps=o.eps)  # [B, H, 1]
            full = cached.all(-1, keepdim=True)  # [B, H, 1]
            least = score64.amin(-1, keepdim=True)
            oldest = torch.where(score64 == least, pos_cache, _NEVER).argmin(-1, keepdim=True)  # ties: the oldest
            # the candidate is newer than every cached key: it is evicted only below every slot's score (slot K)
            target = torch.where(full, torch.where(sj < least, K, oldest),
                                 cached.to(torch.uint8).argmin(-1, keepdim=True))  # else the first free slot
            place = cand[..., None] & (target < K)  # [B, H, 1]: the candidate takes slot `target`
            enters = cand[..., None] & full
            slot = target.clamp(max=K - 1)
            put = place & (torch.arange(K, device=dev) == slot)  # [B, H, K]
            # feature rows: the evicted key (the candidate's own row 0, or its slot's), where the candidate goes
            # (its slot, or its own row: a write of the values already there)
            out_row, in_row = torch.where(target == K, 0, cf + slot), torch.where(place, cf + slot, 0)
        lane = torch.arange(B * H, device=dev).view(B, H, 1)
        # index_select of rows (unlike gather) keeps no reference to the buffer for its backward: the writes may follow
        fe, ve = (buf.view(-1, buf.shape[3]).index_select(0, (lane * buf.shape[2] + out_row + shift).flatten())
                  .view(B, H, 1, -1) for buf, shift in ((buf_f, 0), (buf_v, Ls2)))
        for buf, x, shift in ((buf_k, kj, Ls2), (buf_v, vj, Ls2), (buf_f, fj, 0)):
            buf.scatter_(2, (in_row + shift)[..., None].expand(B, H, 1, x.shape[3]), x)
        score = torch.where(put, sj, score64).to(work)
        pos_cache, cached = torch.where(put, j, pos_cache), cached | put
    # 3. enter (a null event where `enters` is False: φ = 0 additive, β = 0 delta)
    if enters is not None:
        if c.delta:
            kh, beta = unit(fe), (_beta(c, ve[:, :, 0]) * enters[..., 0])[..., None, None]  # [B, H, 1, M], [B, H, 1, 1]
            S = torch.addcmul(S, beta * kh.mT, ve - kh @ S)
        else:
            fe = fe * enters[..., None]
            S, z = torch.addcmul(S, fe.mT, ve), z + fe[:, :, 0]
    if c.delta:
        z = torch.zeros_like(st.z)
    # 4. read
    if c.delta:
        far = unit(fq) @ S  # [B, H, 1, Dv]
    else:
        num, den = fq @ S, fq @ z[..., None]  # [B, H, 1, Dv], [B, H, 1, 1]
    drop = Lw + 1 - min(w, end)  # window-part rows that left the window
    if w:
        m_win = torch.cat([st.mask_window, real], 1)  # [B, Lw + 1]
        m_snk = torch.cat([st.mask_sink, real], 1) if pos < s else st.mask_sink
        cut = min(Lw + 1, max(drop, s - (pos - Lw)))  # leading window-part rows that are not exact keys: gone, or sinks
        ok = torch.cat([m_snk[:, None].expand(B, H, -1), *([cached.new_zeros(B, H, cut)] if cut else []),
                        m_win[:, None, cut:].expand(B, H, -1), cached], -1)  # [B, H, c0 + K]: the buffer's exact keys
        g = _gate(c, work)[:, None, None]  # [H, 1, 1]
        a = _local_weights(c, c.scale * (tr(c.q) @ buf_k.mT), ok[:, :, None])  # [B, H, 1, c0 + K]
        ex_num, ex_den, g1 = a @ buf_v, a.sum(-1, keepdim=True), 1 - g  # [B, H, 1, Dv], [B, H, 1, 1]
        if c.delta:
            out = g * (ex_num / torch.where(ok.any(-1)[..., None, None], ex_den, 1.0)) + g1 * far
        else:
            num, den = g * ex_num + g1 * num, g * ex_den + g1 * den
    elif c.delta:
        out = far
    if not c.delta:
        if c.normalize == "sum" and o.denominator_check != "off" and bool((den <= 0).any()):
            report_denominators(int(((den[..., 0, 0] <= 0) & real).sum()), B * H, "memory_attention", o.denominator_check)
        out = num / (den + o.eps) if w or c.normalize == "sum" else num
    out = out.transpose(1, 2).to(c.in_dtype)  # [B, 1, H, Dv]
    if not c.final:
        return out
    if w:  # the new state's fields: views of the buffers
        k_snk, k_win, k_cache = buf_k[:, :, :Ls2], buf_k[:, :, Ls2 + drop:c0], buf_k[:, :, c0:]
        v_snk, v_win, v_cache = buf_v[:, :, :Ls2], buf_v[:, :, Ls2 + drop:c0], buf_v[:, :, c0:]
        f_win, phi_cache, m_win = buf_f[:, :, drop:cf], buf_f[:, :, cf:], m_win[:, drop:]
    else:
        k_snk, k_win, k_cache, v_snk, v_win, v_cache, f_win, phi_cache, m_win, m_snk = (
            st.k_sink, st.k_window, st.k_cache, st.v_sink, st.v_window, st.v_cache, st.phi_window, st.phi_cache,
            st.mask_window, st.mask_sink)
    if K:  # an empty slot stays zeros (the state's invariant: nothing is written there)
        score, pos_cache = torch.where(cached, score, 0.0), torch.where(cached, pos_cache, -1)
    state = MemoryState(  # a state of the checked shapes: the next call of this signature need not check it again
        S=S, z=z, k_window=k_win, v_window=v_win, phi_window=f_win, mask_window=m_win, k_sink=k_snk, v_sink=v_snk,
        mask_sink=m_snk, k_cache=k_cache, v_cache=v_cache, phi_cache=phi_cache, score_cache=score, cached=cached,
        pos_cache=pos_cache, offset=end)
    return out, vouch(state, c.sig)
