r"""The schedule of memory attention (DESIGN §7, fast path (i)): steps 1–3 of every position, without
gradient, on a detached copy of the far state — which key enters the state at each step, and when
each cached key leaves the cache.

It runs in float64 torch on the CPU over the ``L = B·H`` lanes at once, whatever the inputs' device
and dtype, one *block* of steps at a time (the steps between two re-scorings or query chunks, at most
:data:`BLOCK`), and hands back tensors on the inputs' device. Keys are addressed in the call's
extended axis ``X`` (:mod:`sketchlab.attention.memory_fast`). Arguments are trusted.

Inside a block the cached keys' scores are fixed, so the choices follow from the ranks of
``(score, position)`` alone: after the block's ``i``-th real candidate the cache holds the ``K``
greatest of the keys cached at its start and its candidates so far, so the key evicted at that step
is the candidate if it ranks below the ``q``-th least of the keys before it (``q`` evictions so far),
else that key. A candidate's score depends on the keys that entered before it; for a guess of the
entries all the block's scores are one batched read (the state at the block's start, plus the
entries through the Gram matrix of the block's keys, decays as differences of cumulative log-decay;
the delta rule's entries by one triangular solve). The guess starts empty and is replaced by the
entries it implies until it reproduces itself: a step's entry depends on earlier entries only, so
each pass settles at least one more step and the fixed point is the step-by-step schedule (two or
three passes in practice).
"""

from __future__ import annotations

import torch

from .memory_state import _beta, unit

#: "Still cached": a step no call reaches.
NEVER = 2**62
#: The longest block: its Gram matrices are ``[L, n, 2n]``.
BLOCK = 64


def _lanes(x: torch.Tensor, L: int) -> torch.Tensor:
    """``[B, H, ...]`` → a detached CPU copy ``[L, ...]`` (float64 if floating)."""
    x = x.detach().to("cpu", torch.float64 if x.is_floating_point() else x.dtype, copy=True)
    return x.reshape(L, *x.shape[2:])


def _recall(num: torch.Tensor, v: torch.Tensor, *, delta: bool, eps: float) -> torch.Tensor:
    r"""The recall error :math:`\lVert v - r\rVert^2` from the state's read ``num = Sᵀφ`` ``[..., Dw]``
    (additive: ``z·φ`` as its last column, :func:`sketchlab.attention.memory_state.recall_error`)."""
    if not delta:
        den = num[..., -1:] + eps
        num = num[..., :-1] / torch.where(den == 0, 1.0, den)
    return (v - num).square().sum(-1)


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[l, idx[l, i]]`` of ``x [L, N, F]`` for ``idx [L, n]`` → ``[L, n, F]`` (``index_select`` of whole
    rows: several times faster than ``gather``)."""
    L, N, F = x.shape
    rows = (torch.arange(L)[:, None] * N + idx).flatten()
    return x.reshape(L * N, F).index_select(0, rows).view(L, idx.shape[1], F)


def _ranked(score: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The order of ``[L, N]`` keys by score, ties by position (the eviction order): indices ``[L, N]``."""
    by_pos = pos.argsort(1)
    return by_pos.gather(1, score.gather(1, by_pos).argsort(dim=1, stable=True))


def schedule(c, ef, ev, real_x, lg, st, base: int, first: int, chunk: int):
    """Steps 1–3 over the call's ``T`` steps.

    Parameters
    ----------
    c : the checked call; ``ef [B, H, X, M]``, ``ev [B, H, X, Dv]``: features and values of the
        extended keys; ``real_x [B, X]``: real tokens (the initial cache's slots: False, they are
        never candidates); ``lg [B, T, H]`` or None: ``log γ_t``; ``st``: the initial MemoryState;
        ``base, first``: the extended index and position of the first contiguous key; ``chunk``:
        the exact part's query chunk (a snapshot of the slots at each chunk's start).

    Returns
    -------
    event : long ``[B, H, T]``
        The extended index of the key entering the state at each step, −1 for none.
    until : long ``[B, H, X]``
        The step at which each key left the cache (:data:`NEVER`: still cached; a key never
        cached: the step it left the window, an empty interval).
    snaps : list of long ``[B, H, K]``
        The slots' extended indices (−1: empty) at the start of each query chunk.
    slot_x, slot_score, slot_pos, cached : ``[B, H, K]``
        The final slots (scores in the state's dtype).
    """
    B, H, T, K, w, s, P0 = c.B, c.H, c.T, c.K, c.w, c.s, st.offset
    X, L, dev = ef.shape[2], c.B * c.H, ef.device
    back = lambda a, dt=torch.long: a.to(dev, dt).reshape(B, H, *a.shape[1:])  # noqa: E731
    until = torch.full((L, X), NEVER, dtype=torch.long)
    until[:, base:] = torch.arange(X - base) + first + w - P0  # the step each key leaves the window
    js = torch.arange(T) + P0 - w  # the key leaving at each step
    xs = base + (js - first).clamp(min=0)
    leaves = (js >= max(s, 0))[None, :] & real_x.cpu().repeat_interleave(H, 0)[:, xs]  # [L, T], lane = b·H + h
    if K == 0:  # every leaving key enters at once: no state needed for the choice
        empty = torch.zeros(L, 0, dtype=torch.long)
        return (back(torch.where(leaves, xs, -1)), back(until), [], back(empty), back(empty, ef.dtype), back(empty),
                back(empty, torch.bool))
    delta, eps, rescore, M, Dv = c.delta, c.o.eps, c.o.rescore, c.M, c.Dv
    with torch.no_grad():  # a key's row: φ (delta: k̂) | v | the entry's weight (additive: 1, z's column; delta: β)
        last = _beta(c, ev.detach().transpose(1, 2)).transpose(1, 2)[..., None] if delta else ev.new_ones(B, H, X, 1)
        rows = _lanes(torch.cat([ef.detach(), ev.detach(), last.detach()], -1), L)  # [L, X, M + Dv + 1]
        S = _lanes(st.S, L)
        if delta:
            rows[..., :M] = unit(rows[..., :M])
        else:  # z as one more value column; a key enters as [v, 1]
            S = torch.cat([S, _lanes(st.z, L)[..., None]], -1)  # [L, M, Dv + 1]
        lgl = None if lg is None else lg.detach().cpu().double().permute(0, 2, 1).reshape(L, T)
    win = slice(M + Dv, None) if delta else slice(M, None)  # an entry's value row: β (times its error), or [v, 1]
    cached = _lanes(st.cached, L)
    slot_x = torch.where(cached, torch.arange(K), -1)
    slot_rows = _take(rows, slot_x.clamp(min=0))  # [L, K, ·]: the cached keys' rows
    score_k, pos_k = _lanes(st.score_cache, L), _lanes(st.pos_cache, L)
    event = torch.full((L, T), -1, dtype=torch.long)
    cuts = sorted({0, T, *range(0, T, chunk), *range(0, T, BLOCK), *range(-P0 % rescore, T, rescore)})
    snaps = []
    for t0, t1 in zip(cuts[:-1], cuts[1:]):
        if t0 % chunk == 0:
            snaps.append(back(slot_x.clone()))
        n, cand = t1 - t0, leaves[:, t0:t1]  # [L, n]: a real candidate at the step
        lc = torch.zeros(L, n, dtype=S.dtype) if lgl is None else lgl[:, t0:t1].cumsum(1)  # log decay since t0 − 1
        P = lc.exp()  # [L, n]
        xc = xs[t0:t1]
        Cr = rows[:, xc[0]:xc[-1] + 1] if xc[-1] - xc[0] == n - 1 else rows[:, xc]  # [L, n, ·]: the candidates' rows
        Fc = Cr[..., :M]
        if (P0 + t0) % rescore == 0 and bool(cached.any()):  # 2. re-score the cache against the state
            new = _recall(P[:, :1, None] * (slot_rows[..., :M] @ S), slot_rows[..., M:M + Dv], delta=delta, eps=eps)
            score_k = torch.where(cached, new, score_k)
        elif not bool(cand.any()):
            S = P[:, -1, None, None] * S
            continue
        Rc = Fc @ S  # [L, n, Dw]: the candidates' reads of the block's initial state
        # the block's universe: the cached keys that can be evicted in it (the least n) and its candidates
        nl = min(K, int(cand.sum(1).max()))
        low = _ranked(torch.where(cached, score_k, float("inf")), torch.where(cached, pos_k, NEVER))[:, :nl]
        U = torch.cat([slot_x.gather(1, low).clamp(min=0), xc.expand(L, n)], 1)  # [L, nu]: extended indices
        upos = torch.cat([pos_k.gather(1, low), js[t0:t1].expand(L, n)], 1)
        UR = torch.cat([_take(slot_rows, low), Cr], 1)  # [L, nu, ·]
        FU, VU, IU = UR[..., :M], UR[..., M:M + Dv], UR[..., win]
        # the universe's Gram matrix (k̂ᵀk̂ delta, φᵀφ additive) and the delta rule's reads, filled as the
        # entries need them: the candidates' at once, the low keys' (they leave in rank order) as a prefix
        G = FU.new_zeros(L, nl + n, nl + n)
        G[:, nl:, nl:] = Fc @ Fc.mT
        RU = torch.cat([FU.new_zeros(L, nl, S.shape[2]), Rc], 1) if delta else None
        have = 0
        causal = torch.ones(n, n, dtype=torch.bool).tril(-1)
        Wd = torch.where(causal, (lc[:, :, None] - lc[:, None, :]).exp(), 0.0)  # [L, n, n]: decay from u to i > u
        # eviction bookkeeping: members (the low keys; candidates before the step), the q-th least
        q = cached.sum(1, keepdim=True) + cand.cumsum(1) - K  # [L, n]: q >= 1: the step evicts the q-th least
        evicting = cand & (q >= 1)
        member = torch.cat([cached.gather(1, low)[:, :, None].expand(L, nl, n), cand[:, :, None] & causal.T], 1)
        member = member.to(torch.uint8)  # [L, nu, n]: the key is cached (or evicted) before the step
        score_low, steps_n = score_k.gather(1, low), torch.arange(n)
        ent = torch.full((L, n), -1, dtype=torch.long)  # the guess: universe index entering at each step
        for _ in range(n + 2):
            has, e = ent >= 0, ent.clamp(min=0)
            need = int(torch.where(has & (ent < nl), ent + 1, 0).max())
            if need > have:
                G[:, have:need, have if delta else nl:] = FU[:, have:need] @ FU[:, have if delta else nl:].mT
                G[:, :, have:need] = G[:, have:need].mT
                if delta:
                    RU[:, have:need] = FU[:, have:need] @ S
                have = need
            num = P[..., None] * Rc
            if bool(has.any()):
                b = _take(IU, e) * has[..., None]  # [L, n, Dw] additive: [v, 1]; delta: β
                Ge = _take(G, e)  # [L, n, nu]: the entries' rows
                if delta:  # 3. the entries' errors v − Sᵀk̂ against the state when each enters
                    A = Wd * Ge.gather(2, e[:, None, :].expand(-1, n, -1))  # [L, n, n]: k̂ᵀk̂ of the entries
                    rhs = (_take(VU, e) - P[..., None] * _take(RU, e)) * has[..., None]
                    err = torch.linalg.solve_triangular(A * b.mT + torch.eye(n, dtype=A.dtype), rhs, upper=False,
                                                        unitriangular=True)
                    b = b * err
                num = num + (Wd * Ge[:, :, nl:].mT) @ b
            sc = _recall(num, VU[:, nl:], delta=delta, eps=eps)  # [L, n] the candidates' scores
            order = _ranked(torch.cat([score_low, sc], 1), upos)  # [L, nu]
            rank = torch.empty_like(order).scatter_(1, order, torch.arange(nl + n).expand(L, -1))
            at = (_take(member, order).cumsum(1, dtype=torch.int16) < q[:, None, :]).sum(1)  # the q-th member by rank
            least = order.gather(1, at.clamp(max=nl + n - 1))  # [L, n]: the cache's least before the step
            at_once = rank[:, nl:] < rank.gather(1, least)  # the candidate ranks below it: it enters at once
            new = torch.where(evicting, torch.where(at_once, nl + steps_n, least), -1)
            if torch.equal(new, ent):
                break
            ent = new
        else:
            raise RuntimeError("memory_schedule: the block's entries did not settle (the scores are not causal)")
        # the settled block: events, cache intervals, slots, the state
        has, e = ent >= 0, ent.clamp(min=0)
        xe = U.gather(1, e)
        event[:, t0:t1] = torch.where(has, xe, -1)
        placed = cand & ~(evicting & at_once)
        li, ui = placed.nonzero(as_tuple=True)
        until[li, xc[ui]] = NEVER
        li, ui = has.nonzero(as_tuple=True)
        until[li, xe[li, ui]] = t0 + ui
        # a placed candidate takes the first free slot, or the slot of the key it evicts (a chain within the block)
        free = cached.to(torch.uint8).argsort(dim=1, stable=True).gather(1, (cand.cumsum(1) - 1).clamp(0, K - 1))
        slot = torch.cat([low, torch.where(placed & ~evicting, free, torch.where(placed, -2, -1))], 1)  # -2: unresolved
        parent = torch.cat([torch.arange(nl).expand(L, nl), torch.where(placed & evicting, least, nl + steps_n)], 1)
        for _ in range(n.bit_length() + 1):
            slot = torch.where(slot == -2, slot.gather(1, parent), slot)
            parent = parent.gather(1, parent)
        entered = torch.zeros(L, nl + n, dtype=torch.bool).scatter_(1, e, has)
        li, ui = (placed & ~entered[:, nl:]).nonzero(as_tuple=True)  # the block's candidates still cached
        si = slot[li, nl + ui]
        slot_x[li, si], score_k[li, si], pos_k[li, si], cached[li, si] = xc[ui], sc[li, ui], js[t0 + ui], True
        slot_rows[li, si] = Cr[li, ui]
        S = P[:, -1, None, None] * S
        if bool(has.any()):
            S = S + (_take(FU, e) * (has[..., None] * (lc[:, -1:] - lc).exp()[..., None])).mT @ b  # decayed to the end
    return (back(event), back(until), snaps, back(slot_x), back(score_k, ef.dtype), back(pos_k),
            back(cached, torch.bool))
