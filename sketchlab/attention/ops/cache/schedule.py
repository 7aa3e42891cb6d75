r"""The schedule of memory attention (DESIGN §7, fast path (i)): steps 1–3 of every position, without
gradient, on a detached float64 copy of the far state on the CPU (whatever the inputs' device and
dtype) over the ``L = B·H`` lanes at once — which key enters the state at each step, and when each
cached key leaves the cache. Keys are addressed in the call's extended axis ``X``
(:mod:`sketchlab.attention.memory_fast`). Arguments are trusted.

The additive state goes one *block* of steps at a time in torch (the steps between two re-scorings
or query chunks, at most :data:`BLOCK`). Inside a block the cached keys' scores are fixed, so the
choices follow from the ranks of ``(score, position)`` alone: after the block's ``i``-th real
candidate the cache holds the ``K`` greatest of the keys cached at its start and its candidates so
far, so the key evicted at that step is the candidate if it ranks below the ``q``-th least of the
keys before it (``q``: the evictions so far), else that key. A candidate's score depends on the keys
that entered before it; for a guess of the entries all the block's scores are one batched read (the
state at the block's start, plus the entries through the Gram matrix of the block's keys, decays as
differences of cumulative log-decay). The guess starts empty and is replaced by the entries it
implies until it reproduces itself: a step's entry depends on earlier entries only, so each pass
settles at least one more step and the fixed point is the step-by-step schedule (two to four passes
on a converted model's features).

The delta rule's choices hang on each other from step to step (the fixed-point passes would settle
about every other step), so its state goes step by step in NumPy (:func:`_delta_steps`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..delta.beta import far_beta

__all__ = ["schedule", "take_rows"]

#: "Still cached": a step no call reaches.
NEVER = 2**62
#: The longest block: its Gram matrices are ``[L, n, 2n]``.
BLOCK = 64


def _lanes(x: torch.Tensor, L: int) -> torch.Tensor:
    """``[B, H, ...]`` → a detached CPU copy ``[L, ...]`` (float64 if floating)."""
    x = x.detach().to("cpu", torch.float64 if x.is_floating_point() else x.dtype, copy=True)
    return x.reshape(L, *x.shape[2:])


def _recall(num: torch.Tensor, v: torch.Tensor, *, eps: float) -> torch.Tensor:
    r"""The additive recall error :math:`\lVert v - r\rVert^2` from the state's read ``num = [Sᵀφ, z·φ]``
    ``[..., Dv + 1]`` (:func:`sketchlab.attention.ops.cache.score.recall_error`)."""
    den = num[..., -1:] + eps
    return (v - num[..., :-1] / torch.where(den == 0, 1.0, den)).square().sum(-1)


def take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Whole rows by index: ``out[a, i] = x[a, idx[a, i]]``.

    ``index_select`` of whole rows, several times faster than ``gather`` or advanced indexing on CPU.

    Parameters
    ----------
    x : Tensor ``[*A, N, F]``
    idx : Tensor ``[*A, n]``, int64, every entry in ``[0, N)``

    Returns
    -------
    Tensor ``[*A, n, F]``
    """
    N, F = x.shape[-2:]
    rows = (torch.arange(idx.shape[:-1].numel(), device=idx.device)[:, None] * N + idx.flatten(0, -2)).flatten()
    return x.flatten(0, -2).index_select(0, rows).view(*idx.shape, F)


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
    with torch.no_grad():
        S = _lanes(st.S, L)
        lgl = None if lg is None else lg.detach().cpu().double().permute(0, 2, 1).reshape(L, T)
        slots = (_lanes(st.cached, L), _lanes(st.score_cache, L), _lanes(st.pos_cache, L))
        if c.delta:
            beta = _lanes(far_beta(c, ev.detach().transpose(1, 2)).transpose(1, 2), L)  # [L, X]
            event, snaps, slots = _delta_steps(c, _lanes(ef, L), _lanes(ev, L), beta, S, lgl, slots, until, leaves, xs,
                                               P0, chunk)
        else:
            S = torch.cat([S, _lanes(st.z, L)[..., None]], -1)  # z as one more value column: [L, M, Dv + 1]
            rows = _lanes(torch.cat([ef.detach(), ev.detach(), ev.new_ones(B, H, X, 1)], -1), L)  # φ | v | 1
            event, snaps, slots = _additive_blocks(c, rows, S, lgl, slots, until, leaves, xs, js, P0, chunk)
    slot_x, score_k, pos_k, cached = slots
    snaps = [back(x) for x in snaps]
    return (back(event), back(until), snaps, back(slot_x), back(score_k, ef.dtype), back(pos_k),
            back(cached, torch.bool))


def _additive_blocks(c, rows, S, lgl, slots, until, leaves, xs, js, P0, chunk):
    """Steps 1–3 of the additive state block by block (the module docstring): ``rows [L, X, M + Dv + 1]``
    (each key's ``φ | v | 1``), ``S [L, M, Dv + 1]`` (``z`` its last column), ``lgl [L, T]`` or None, the
    initial ``slots`` (cached, score, pos ``[L, K]``), ``xs, js [T]``: the extended index and position of
    the key leaving at each step; fills ``until`` and returns ``(event, snaps, slots)``."""
    L, T, K, M, Dv, eps, rescore = c.B * c.H, c.T, c.K, c.M, c.Dv, c.o.eps, c.o.rescore
    cached, score_k, pos_k = slots
    slot_x = torch.where(cached, torch.arange(K), -1)
    slot_rows = take_rows(rows, slot_x.clamp(min=0))  # [L, K, ·]: the cached keys' rows
    event = torch.full((L, T), -1, dtype=torch.long)
    cuts = sorted({0, T, *range(0, T, chunk), *range(0, T, BLOCK), *range(-P0 % rescore, T, rescore)})
    snaps = []
    for t0, t1 in zip(cuts[:-1], cuts[1:]):
        if t0 % chunk == 0:
            snaps.append(slot_x.clone())
        n, cand = t1 - t0, leaves[:, t0:t1]  # [L, n]: a real candidate at the step
        lc = torch.zeros(L, n, dtype=S.dtype) if lgl is None else lgl[:, t0:t1].cumsum(1)  # log decay since t0 − 1
        P = lc.exp()  # [L, n]
        xc = xs[t0:t1]
        Cr = rows[:, xc[0]:xc[-1] + 1] if xc[-1] - xc[0] == n - 1 else rows[:, xc]  # [L, n, ·]: the candidates' rows
        Fc = Cr[..., :M]
        if (P0 + t0) % rescore == 0 and bool(cached.any()):  # 2. re-score the cache against the state
            new = _recall(P[:, :1, None] * (slot_rows[..., :M] @ S), slot_rows[..., M:M + Dv], eps=eps)
            score_k = torch.where(cached, new, score_k)
        elif not bool(cand.any()):
            S = P[:, -1, None, None] * S
            continue
        Rc = Fc @ S  # [L, n, Dw]: the candidates' reads of the block's initial state
        # the block's universe: the cached keys that can be evicted in it (the least n) and its candidates
        nl = min(K, int(cand.sum(1).max()))
        low = _ranked(torch.where(cached, score_k, float("inf")), torch.where(cached, pos_k, NEVER))[:, :nl]
        U = torch.cat([slot_x.gather(1, low).clamp(min=0), xc.expand(L, n)], 1)  # [L, nu]: extended indices
        UR = torch.cat([take_rows(slot_rows, low), Cr], 1)  # [L, nu, ·]
        FU, VU = UR[..., :M], UR[..., M:].contiguous()  # [L, nu, M], [L, nu, Dv + 1]
        # the universe's φᵀφ, filled as the entries need it: the candidates' at once, the low keys' (they
        # leave in rank order) as a prefix
        G = FU.new_zeros(L, nl + n, nl + n)
        G[:, nl:, nl:] = Fc @ Fc.mT
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
                G[:, have:need, nl:] = FU[:, have:need] @ Fc.mT
                G[:, nl:, have:need] = G[:, have:need, nl:].mT
                have = need
            num = P[..., None] * Rc
            if bool(has.any()):
                b = take_rows(VU, e) * has[..., None]  # [L, n, Dv + 1]: the entries' [v, 1]
                num = num + (Wd * take_rows(G, e)[:, :, nl:].mT) @ b  # 3. what entered before each candidate
            sc = _recall(num, Cr[..., M:M + Dv], eps=eps)  # [L, n] the candidates' scores
            order = torch.cat([score_low, sc], 1).argsort(dim=1, stable=True)  # [L, nu] (ties: the universe is by age)
            rank = torch.empty_like(order).scatter_(1, order, torch.arange(nl + n).expand(L, -1))
            at = (take_rows(member, order).cumsum(1, dtype=torch.int16) < q[:, None, :]).sum(1)  # the q-th member by rank
            least = order.gather(1, at.clamp(max=nl + n - 1))  # [L, n]: the cache's least before the step
            at_once = rank[:, nl:] < rank.gather(1, least)  # the candidate ranks below it: it enters at once
            new = torch.where(evicting, torch.where(at_once, nl + steps_n, least), -1)
            if torch.equal(new, ent):
                break
            ent = new
        else:
            raise RuntimeError("ops.cache.schedule: the block's entries did not settle (the scores are not causal)")
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
            S = S + (take_rows(UR, e)[..., :M] * (has[..., None] * (lc[:, -1:] - lc).exp()[..., None])).mT @ b  # decayed
    return event, snaps, (slot_x, score_k, pos_k, cached)


def _unit(x: np.ndarray) -> np.ndarray:
    norm = np.sqrt(np.square(x).sum(-1, keepdims=True))
    return x / np.where(norm > 0, norm, 1.0)


class _Far:
    r"""The detached delta-rule state of ``L`` lanes, ``scale·(S + AᵀB)``: a decay multiplies ``scale``
    only, a write appends a row to ``A [L, P, M]``, ``B [L, P, Dv]`` (zeros in lanes without one), and
    every ``P`` writes the rows are folded into ``S`` by one batched product — so a step costs one
    read of ``S`` rather than a rewrite of it."""

    def __init__(self, S: np.ndarray, rows: int = 32):
        L, M, Dw = S.shape
        self.S, self.scale, self.n = S, np.ones(L), 0
        self.A, self.B = np.zeros((L, rows, M)), np.zeros((L, rows, Dw))

    def read(self, phi: np.ndarray) -> np.ndarray:
        """``phi [L, n, M]`` → the state's ``phiᵀ(scale·S)`` ``[L, n, Dv]``."""
        if phi.shape[1] > 1:  # the re-scoring: torch's batched BLAS (NumPy's matmul and einsum: ~5× slower)
            t = torch.from_numpy
            r = t(phi) @ t(self.S)
            if self.n:
                r += (t(phi) @ t(self.A[:, :self.n]).mT) @ t(self.B[:, :self.n])
            return self.scale[:, None, None] * r.numpy()
        # one key: einsum, not @ (NumPy's batched matmul dispatches each lane's tiny product to BLAS)
        r = np.einsum("lnm,lmd->lnd", phi, self.S)
        if self.n:
            a, b = self.A[:, :self.n], self.B[:, :self.n]
            r += np.einsum("lnp,lpd->lnd", np.einsum("lnm,lpm->lnp", phi, a), b)
        return self.scale[:, None, None] * r

    def write(self, lanes: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """Add ``a bᵀ`` (``a [n, M]``, ``b [n, Dv]``) to the state of ``lanes``."""
        self.A[lanes, self.n] = a / self.scale[lanes, None]
        self.B[lanes, self.n] = b
        self.n += 1
        if self.n == self.A.shape[1]:
            self.fold()

    def fold(self) -> None:
        if self.n:
            self.S += self.A[:, :self.n].transpose(0, 2, 1) @ self.B[:, :self.n]
            self.A[:, :self.n], self.B[:, :self.n], self.n = 0.0, 0.0, 0

    def decay(self, gamma: np.ndarray) -> None:
        self.scale *= gamma
        if self.scale.min() < 1e-150:  # renormalise before it underflows
            self.fold()
            self.S *= self.scale[:, None, None]
            self.scale[:] = 1.0


def _delta_steps(c, f, vv, beta, S, lgl, slots, until, leaves, xs, P0, chunk):
    """Steps 1–3 of the delta rule one step at a time (float64 NumPy over the lanes): ``f [L, X, M]``,
    ``vv [L, X, Dv]``, ``beta [L, X]``, ``S [L, M, Dv]``, ``lgl [L, T]`` or None, the initial ``slots``
    (cached, score, pos ``[L, K]``); fills ``until`` and returns ``(event, snaps, slots)``."""
    L, T, K, w, rescore = c.B * c.H, c.T, c.K, c.w, c.o.rescore
    f, vv, beta, lv, xs, un = f.numpy(), vv.numpy(), beta.numpy(), leaves.numpy(), xs.numpy(), until.numpy()
    gam = None if lgl is None else np.exp(lgl.numpy()).T  # [T, L]
    cached = slots[0].numpy()
    slot_x = np.where(cached, np.arange(K)[None, :], -1)
    # scores and positions of the K slots and, in column K, of the candidate
    score_k = np.concatenate([slots[1].numpy(), np.zeros((L, 1))], 1)  # [L, K + 1]
    pos_k = np.concatenate([slots[2].numpy(), np.zeros((L, 1), dtype=np.int64)], 1)
    event = np.full((L, T), -1, dtype=np.int64)
    far, lanes, snaps = _Far(S.numpy()), np.arange(L), []

    def error(phi, v):  # the recall error ‖v − Sᵀk̂‖² of phi [L, n, M], v [L, n, Dv] → [L, n]
        return np.square(v - far.read(_unit(phi))).sum(-1)

    for t in range(T):
        if t % chunk == 0:
            snaps.append(torch.from_numpy(slot_x.copy()))
        pos = P0 + t
        if gam is not None:  # 1. decay
            far.decay(gam[t])
        if pos % rescore == 0 and cached.any():  # 2. re-score the cache against the state
            idx = np.clip(slot_x, 0, None)
            score_k[:, :K] = np.where(cached, error(f[lanes[:, None], idx], vv[lanes[:, None], idx]), score_k[:, :K])
        cand = lv[:, t]  # [L]: a real key leaves
        if not cand.any():
            continue
        x, j = xs[t], pos - w
        score = error(f[:, x, None], vv[:, x, None])[:, 0]  # [L]
        full = cached.all(1)
        score_k[:, K], pos_k[:, K] = score, j
        least = score_k == score_k.min(1, keepdims=True)
        e = np.where(least, pos_k, NEVER).argmin(1)  # least score, then the oldest; K: the candidate
        target = np.where(full, e, np.argmin(cached, 1))  # the evicted key's slot, or the first free one
        place = cand & (~full | (e < K))
        out = cand & full
        out_x = np.where(e == K, x, slot_x[lanes, np.minimum(e, K - 1)])
        p = np.nonzero(place)[0]
        slot_x[p, target[p]], score_k[p, target[p]], pos_k[p, target[p]] = x, score[p], j
        cached[p, target[p]] = True
        un[p, x] = NEVER
        o = np.nonzero(out)[0]
        if not len(o):
            continue
        xo = out_x[o]
        un[o, xo] = t
        event[o, t] = xo
        # 3. enter: S += β k̂ (v − Sᵀk̂)ᵀ
        err = vv[o, xo] - far.read(_unit(f[lanes, out_x])[:, None])[o, 0]
        far.write(o, beta[o, xo][:, None] * _unit(f[o, xo]), err)
    return (torch.from_numpy(event), snaps, (torch.from_numpy(slot_x), torch.from_numpy(score_k[:, :K].copy()),
                                             torch.from_numpy(pos_k[:, :K].copy()), torch.from_numpy(cached)))
