r"""The schedule of memory attention (DESIGN §7, fast path (i)): steps 1–3 of every position, without
gradient, on a detached copy of the far state — which key enters the state at each step, and when
each cached key leaves the cache.

It runs on the CPU in float64 NumPy over the ``L = B·H`` lanes (a step is a few dozen small
operations; NumPy's per-call cost is a fraction of torch's, and on an accelerator the step loop
would be launch-bound), whatever the inputs' device and dtype, and hands back torch tensors on it.
Keys are addressed in the call's extended axis ``X`` (:mod:`sketchlab.attention.memory_fast`).
Arguments are trusted.
"""

from __future__ import annotations

import numpy as np
import torch

from .memory import _beta

#: "Still cached": a step no call reaches.
NEVER = 2**62


def _lanes(x: torch.Tensor, L: int) -> np.ndarray:
    """``[B, H, ...]`` tensor → float64 (or its own integer/bool kind) NumPy ``[L, ...]`` on the CPU."""
    x = x.detach().cpu()
    if x.is_floating_point():
        x = x.double()
    return x.reshape(L, *x.shape[2:]).numpy().copy()


def _recall_error(S: np.ndarray, phi: np.ndarray, v: np.ndarray, *, delta: bool, eps: float) -> np.ndarray:
    r""":func:`sketchlab.attention.memory.recall_error` in NumPy: ``S [L, M, Dv (+1: z)]``,
    ``phi [L, n, M]``, ``v [L, n, Dv]`` → ``[L, n]``."""
    if delta:
        norm = np.linalg.norm(phi, axis=-1, keepdims=True)
        r = (phi / np.where(norm > 0, norm, 1.0)) @ S  # [L, n, Dv]
    else:
        r1 = phi @ S  # [L, n, Dv + 1]: Sᵀφ and z·φ
        den = r1[..., -1:] + eps
        r = r1[..., :-1] / np.where(den == 0, 1.0, den)
    return np.square(v - r).sum(-1)


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
    back = lambda a, dt=torch.long: torch.from_numpy(a.copy()).to(dev, dt).reshape(B, H, *a.shape[1:])  # noqa: E731  (a copy: a is mutated later)
    until = np.full((L, X), NEVER, dtype=np.int64)
    until[:, base:] = np.arange(X - base) + first + w - P0  # the step each key leaves the window
    event = np.full((L, T), -1, dtype=np.int64)
    realx = np.repeat(real_x.cpu().numpy(), H, axis=0)  # [L, X], lane = b·H + h
    if K == 0:  # every leaving key enters at once: no state needed for the choice
        js = np.arange(T) + P0 - w  # the key leaving at each step
        xs = base + np.clip(js - first, 0, None)
        event[:] = np.where((js >= max(s, 0))[None, :] & realx[:, xs], xs, -1)
        empty = np.zeros((L, 0), dtype=np.int64)
        return (back(event), back(until), [], back(empty), back(empty, ef.dtype), back(empty),
                back(empty, torch.bool))
    delta, eps, rescore = c.delta, c.o.eps, c.o.rescore
    with torch.no_grad():
        f, vv = _lanes(ef, L), _lanes(ev, L)  # [L, X, M], [L, X, Dv]
        S = _lanes(st.S, L)
        if not delta:  # z as one more value column
            S = np.concatenate([S, _lanes(st.z, L)[..., None]], -1)  # [L, M, Dv + 1]
        gam = None if lg is None else lg.detach().double().exp().permute(1, 0, 2).reshape(T, L).cpu().numpy()
        beta = _lanes(_beta(c, ev.detach().transpose(1, 2)).transpose(1, 2), L) if delta else None  # [L, X]
    cached = _lanes(st.cached, L)
    slot_x = np.where(cached, np.arange(K)[None, :], -1)
    slot_score, slot_pos = _lanes(st.score_cache, L), _lanes(st.pos_cache, L)
    lanes, snaps = np.arange(L), []
    for t in range(T):
        if t % chunk == 0:
            snaps.append(back(slot_x))
        pos = P0 + t
        if gam is not None:  # 1. decay
            S *= gam[t][:, None, None]
        if pos % rescore == 0 and cached.any():  # 2. re-score the cache against the state
            idx = np.clip(slot_x, 0, None)
            new = _recall_error(S, f[lanes[:, None], idx], vv[lanes[:, None], idx], delta=delta, eps=eps)
            slot_score = np.where(cached, new, slot_score)
        j = pos - w
        if j < max(s, 0):
            continue
        x = base + j - first
        cand = realx[:, x]  # [L]: a real key leaves
        if not cand.any():
            continue
        score = _recall_error(S, f[:, x, None], vv[:, x, None], delta=delta, eps=eps)[:, 0]  # [L]
        full = cached.all(1)
        all_s = np.concatenate([slot_score, score[:, None]], 1)  # [L, K + 1]
        all_p = np.concatenate([slot_pos, np.full((L, 1), j)], 1)
        least = all_s == all_s.min(1, keepdims=True)
        e = np.where(least, all_p, NEVER).argmin(1)  # least score, then the oldest; K: the candidate
        target = np.where(full, e, np.argmin(cached, 1))  # the evicted key's slot, or the first free one
        place = cand & (~full | (e < K))
        out = cand & full
        out_x = np.where(e == K, x, slot_x[lanes, np.minimum(e, K - 1)])
        p = np.nonzero(place)[0]
        slot_x[p, target[p]], slot_score[p, target[p]], slot_pos[p, target[p]] = x, score[p], j
        cached[p, target[p]] = True
        until[p, x] = NEVER
        o = np.nonzero(out)[0]
        if not len(o):
            continue
        xo = out_x[o]
        until[o, xo] = t
        event[o, t] = xo
        fe, ve = f[o, xo], vv[o, xo]  # [n, M], [n, Dv]
        if delta:  # 3. enter
            norm = np.linalg.norm(fe, axis=-1, keepdims=True)
            kh = fe / np.where(norm > 0, norm, 1.0)
            err = ve - np.einsum("nm,nmd->nd", kh, S[o])
            S[o] += beta[o, xo][:, None, None] * kh[:, :, None] * err[:, None, :]
        else:
            S[o] += fe[:, :, None] * np.concatenate([ve, np.ones((len(o), 1))], 1)[:, None, :]
    return (back(event), back(until), snaps, back(slot_x), back(slot_score, ef.dtype), back(slot_pos),
            back(cached, torch.bool))
