r"""The decoding step of memory attention (DESIGN §7): one token (``T = 1``) after a :class:`MemoryState`,
the four steps in torch over ``[B, H]`` at once — no schedule, no event stream, no chunked recurrence.

Called by :func:`sketchlab.attention.memory_fast.run` on checked arguments (trusted here). It takes the
same decisions as the general path (the schedule's: scores in float64 against the decayed state, the
least score evicted, ties to the oldest, the evicted key's slot else the first free one) and gives the
same output and state to round-off; gradients flow through every value given the choices.
"""

from __future__ import annotations

import torch

from ._checks import report_denominators
from .memory_state import MemoryState, _beta, _gate, _log_decay, unit


def _score(S64: torch.Tensor, z64: torch.Tensor | None, scale: torch.Tensor, phi: torch.Tensor, v: torch.Tensor, *,
           eps: float) -> torch.Tensor:
    r"""The recall error :math:`\lVert v - r\rVert^2` of keys ``phi [B, H, n, M]``, ``v [B, H, n, Dv]``
    against the float64 state ``scale·S64`` (``S64 [B, H, M, Dv]``; ``z64 [B, H, M]`` additive, None
    delta; ``scale [B, H]``) as the schedule computes it (the read first, then the scale) → ``[B, H, n]``."""
    phi, v = phi.detach().double(), v.detach().double()
    sc = scale[..., None, None]
    if z64 is None:
        r = (unit(phi) @ S64) * sc
    else:
        den = (phi @ z64[..., None]) * sc + eps  # [B, H, n, 1]
        r = (phi @ S64) * sc / torch.where(den == 0, 1.0, den)
    return (v - r).square().sum(-1)


def _local_weights(c, logits: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """The exact part's unnormalised weights of ``logits`` where ``ok`` (zero elsewhere): ``exp(logit − max)``
    (``c.o.local == "softmax"``; the max over the allowed keys, 0 for a row with none) else ``logit ** c.degree``."""
    zero = logits.new_zeros(())
    if c.o.local == "softmax":
        top = torch.where(ok, logits, float("-inf")).amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, zero)
        return torch.where(ok, (logits - top).exp(), zero)
    return torch.where(ok, logits ** c.degree, zero)


def decode(c) -> torch.Tensor | tuple[torch.Tensor, MemoryState]:
    """One step (``c.T == 1``, ``c.state`` given) on checked arguments ``c``."""
    work, dev, st = c.work, c.phi_q.device, c.state
    B, H, M, Dv, w, s, K = c.B, c.H, c.M, c.Dv, c.w, c.s, c.K
    pos, Lw, Ls = st.offset, st.k_window.shape[2], st.k_sink.shape[2]
    real = torch.ones(B, 1, dtype=torch.bool, device=dev) if c.mask is None else c.mask  # [B, 1]
    fq, fk, vv = (x.to(work)[:, 0] for x in (c.phi_q, c.phi_k, c.v))  # [B, H, ·]
    kk = c.k.to(work)[:, 0] if w else st.k_window.new_zeros(B, H, st.k_window.shape[3])  # [B, H, D]
    lg = _log_decay(c, vv[:, None], real)  # [B, 1, H] or None
    # 1. decay
    S, z = st.S, st.z
    if lg is not None:
        gamma = lg[:, 0].exp()  # [B, H]
        S, z = gamma[..., None, None] * S, gamma[..., None] * z
    # 2. leave: the key at position pos − w (the held window's oldest, or the new token when w = 0)
    j = pos - w
    leaves = j >= s and (w == 0 or Lw == w)
    k_cache, v_cache, phi_cache, score, cached, pos_cache = (
        st.k_cache, st.v_cache, st.phi_cache, st.score_cache, st.cached, st.pos_cache)
    out_mask = None  # [B, H] bool: a key enters the state
    if K and (leaves or pos % c.o.rescore == 0):
        with torch.no_grad():
            S64 = st.S.detach().double()
            z64 = None if c.delta else st.z.detach().double()
            scale = (lg[:, 0].detach().double().exp() if lg is not None
                     else torch.ones(B, H, dtype=torch.float64, device=dev))
            score64 = score.double()
            if pos % c.o.rescore == 0 and bool(cached.any()):  # re-score the cache against the state
                new = _score(S64, z64, scale, phi_cache, v_cache, eps=c.o.eps)
                score64 = torch.where(cached, new, score64)
        score = score64.to(work)
    if leaves:
        if w:
            kj, vj, fj, cand = st.k_window[:, :, 0], st.v_window[:, :, 0], st.phi_window[:, :, 0], st.mask_window[:, 0]
        else:
            kj, vj, fj, cand = kk, vv, fk, real[:, 0]
        cand = cand[:, None].expand(B, H)  # [B, H]
        if K == 0:  # every leaving key enters at once
            out_mask, fe, ve = cand, fj, vj
        else:
            with torch.no_grad():
                sj = _score(S64, z64, scale, fj[:, :, None], vj[:, :, None], eps=c.o.eps)  # [B, H, 1]
                full = cached.all(-1)  # [B, H]
                sk = torch.cat([score64, sj], -1)  # [B, H, K + 1]; column K: the candidate
                pk = torch.cat([pos_cache, pos_cache.new_full((B, H, 1), j)], -1)
                least = sk == sk.amin(-1, keepdim=True)
                e = torch.where(least, pk, torch.iinfo(torch.long).max).argmin(-1)  # least score, then the oldest
                free = (~cached).to(torch.uint8).argmax(-1)  # the first free slot
                target = torch.where(full, e, free)  # [B, H]
                place = cand & (~full | (e < K))
                out_mask = cand & full
                put = place[..., None] & (torch.arange(K, device=dev) == target[..., None])  # [B, H, K]
                slot_e = e.clamp(max=K - 1)[..., None, None]
            # the evicted key: the candidate itself (e = K) or slot e's key, before the candidate takes the slot
            pick = lambda x: x.gather(2, slot_e.expand(B, H, 1, x.shape[3]))[:, :, 0]  # noqa: E731
            from_cand = (e == K)[..., None]
            fe, ve = torch.where(from_cand, fj, pick(phi_cache)), torch.where(from_cand, vj, pick(v_cache))
            if bool(place.any()):
                p4 = put[..., None]
                k_cache = torch.where(p4, kj[:, :, None], k_cache)
                v_cache = torch.where(p4, vj[:, :, None], v_cache)
                phi_cache = torch.where(p4, fj[:, :, None], phi_cache)
                score = torch.where(put, sj, score64).to(work)
                pos_cache = torch.where(put, j, pos_cache)
                cached = cached | put
    # 3. enter
    if out_mask is not None:
        om = out_mask[..., None].to(work)
        fe, ve = fe * om, ve * om  # a null event: φ = 0, v = 0
        if c.delta:
            kh, beta = unit(fe), _beta(c, ve) * out_mask
            S = S + beta[..., None, None] * kh[..., :, None] * (ve - (kh[..., None, :] @ S)[..., 0, :])[..., None, :]
        else:
            S, z = S + fe[..., :, None] * ve[..., None, :], z + fe
    if c.delta:
        z = torch.zeros_like(st.z)
    # the new window and sinks
    end = pos + 1
    Lw2 = min(w, end)
    k_win = torch.cat([st.k_window, kk[:, :, None]], 2)[:, :, Lw + 1 - Lw2:]
    v_win = torch.cat([st.v_window, vv[:, :, None]], 2)[:, :, Lw + 1 - Lw2:]
    f_win = torch.cat([st.phi_window, fk[:, :, None]], 2)[:, :, Lw + 1 - Lw2:]
    m_win = torch.cat([st.mask_window, real], 1)[:, Lw + 1 - Lw2:]
    if pos < s:
        k_snk, v_snk = torch.cat([st.k_sink, kk[:, :, None]], 2), torch.cat([st.v_sink, vv[:, :, None]], 2)
        m_snk = torch.cat([st.mask_sink, real], 1)
    else:
        k_snk, v_snk, m_snk = st.k_sink, st.v_sink, st.mask_sink
    # 4. read
    if c.delta:
        far = (unit(fq)[..., None, :] @ S)[..., 0, :]  # [B, H, Dv]
    else:
        num, den = (fq[..., None, :] @ S)[..., 0, :], (fq * z).sum(-1)  # [B, H, Dv], [B, H]
    if w:
        g = _gate(c, work)[None, :, None]  # [1, H, 1]
        win_pos = torch.arange(end - Lw2, end, device=dev)
        groups = ((k_snk, v_snk, m_snk[:, None].expand(B, H, -1)),
                  (k_win, v_win, (m_win & (win_pos >= s))[:, None].expand(B, H, -1)), (k_cache, v_cache, cached))
        qc = c.q.to(work)[:, 0, :, :, None]  # [B, H, D, 1]
        # logits per group (no copy of the keys into one tensor), then one masked softmax over them all
        logits = torch.cat([c.scale * (kx @ qc)[..., 0] for kx, _, _ in groups], -1)  # [B, H, L]
        ok = torch.cat([m for _, _, m in groups], -1)  # [B, H, L]
        a = _local_weights(c, logits, ok)
        ex_num, i0 = 0, 0
        for _, vx, _ in groups:  # Σ a v per group
            n = vx.shape[2]
            if n:
                ex_num = ex_num + (a[..., None, i0:i0 + n] @ vx)[..., 0, :]  # [B, H, Dv]
            i0 += n
        ex_den = a.sum(-1)  # [B, H]
        if c.delta:
            exact = ex_num / torch.where(ok.any(-1), ex_den, 1.0)[..., None]
            out = g * exact + (1 - g) * far
        else:
            gh = g[..., 0]
            nm, dn = g * ex_num + (1 - g) * num, gh * ex_den + (1 - gh) * den
            if c.normalize == "sum":
                report_denominators(int(((dn <= 0) & real).sum()), B * H, "memory_attention", c.o.denominator_check)
            out = nm / (dn + c.o.eps)[..., None]
    elif c.delta:
        out = far
    elif c.normalize == "sum":
        report_denominators(int(((den <= 0) & real).sum()), B * H, "memory_attention", c.o.denominator_check)
        out = num / (den + c.o.eps)[..., None]
    else:
        out = num
    out = out[:, None].to(c.in_dtype)  # [B, 1, H, Dv]
    if not c.final:
        return out
    state = MemoryState(  # an empty slot stays zeros (the state's invariant: nothing is written there)
        S=S, z=z, k_window=k_win, v_window=v_win, phi_window=f_win, mask_window=m_win, k_sink=k_snk, v_sink=v_snk,
        mask_sink=m_snk, k_cache=k_cache, v_cache=v_cache, phi_cache=phi_cache,
        score_cache=torch.where(cached, score, 0.0), cached=cached, pos_cache=torch.where(cached, pos_cache, -1),
        offset=end)
    return out, state
