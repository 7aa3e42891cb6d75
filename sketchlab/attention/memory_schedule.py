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

from .memory_state import _beta

#: "Still cached": a step no call reaches.
NEVER = 2**62


def _lanes(x: torch.Tensor, L: int) -> np.ndarray:
    """``[B, H, ...]`` tensor → float64 (or its own integer/bool kind) NumPy ``[L, ...]`` on the CPU."""
    x = x.detach().cpu()
    if x.is_floating_point():
        x = x.double()
    return x.reshape(L, *x.shape[2:]).numpy().copy()


def _unit(x: np.ndarray) -> np.ndarray:
    norm = np.sqrt(np.square(x).sum(-1, keepdims=True))
    return x / np.where(norm > 0, norm, 1.0)


class _Far:
    r"""The detached far state of ``L`` lanes, ``scale·(S + AᵀB)``: a decay multiplies ``scale`` only,
    a write appends a row to ``A [L, P, M]``, ``B [L, P, Dw]`` (zeros in lanes without one), and
    every ``P`` writes the rows are folded into ``S`` by one batched product — so a step costs one
    read of ``S`` rather than a rewrite of it."""

    def __init__(self, S: np.ndarray, rows: int = 32):
        L, M, Dw = S.shape
        self.S, self.scale, self.n = S, np.ones(L), 0
        self.A, self.B = np.zeros((L, rows, M)), np.zeros((L, rows, Dw))

    def read(self, phi: np.ndarray) -> np.ndarray:
        """``phi [L, n, M]`` → the state's ``phiᵀ(scale·S)`` ``[L, n, Dw]``."""
        # einsum, not @: NumPy's batched matmul dispatches each lane's tiny product to BLAS (measured
        # 1.07 ms against einsum's 0.22 ms for L = 9, M = 64, Dw = 65)
        r = np.einsum("lnm,lmd->lnd", phi, self.S)
        if self.n:
            a, b = self.A[:, :self.n], self.B[:, :self.n]
            r += np.einsum("lnp,lpd->lnd", np.einsum("lnm,lpm->lnp", phi, a), b)
        return self.scale[:, None, None] * r

    def write(self, lanes: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """Add ``a bᵀ`` (``a [n, M]``, ``b [n, Dw]``) to the state of ``lanes``."""
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


def _recall_error(far: _Far, phi: np.ndarray, v: np.ndarray, *, delta: bool, eps: float) -> np.ndarray:
    r""":func:`sketchlab.attention.memory_state.recall_error` in NumPy against the state ``far`` (``S`` with
    ``z`` as a last value column when additive) of ``phi [L, n, M]``, ``v [L, n, Dv]`` → ``[L, n]``."""
    if delta:
        r = far.read(_unit(phi))  # [L, n, Dv]
    else:
        r1 = far.read(phi)  # [L, n, Dv + 1]: Sᵀφ and z·φ
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
    far = _Far(S)
    cached = _lanes(st.cached, L)
    slot_x = np.where(cached, np.arange(K)[None, :], -1)
    # scores and positions of the K slots and, in column K, of the candidate
    score_k = np.concatenate([_lanes(st.score_cache, L), np.zeros((L, 1))], 1)  # [L, K + 1]
    pos_k = np.concatenate([_lanes(st.pos_cache, L), np.zeros((L, 1), dtype=np.int64)], 1)
    lanes, snaps = np.arange(L), []
    for t in range(T):
        if t % chunk == 0:
            snaps.append(back(slot_x))
        pos = P0 + t
        if gam is not None:  # 1. decay
            far.decay(gam[t])
        if pos % rescore == 0 and cached.any():  # 2. re-score the cache against the state
            idx = np.clip(slot_x, 0, None)
            new = _recall_error(far, f[lanes[:, None], idx], vv[lanes[:, None], idx], delta=delta, eps=eps)
            score_k[:, :K] = np.where(cached, new, score_k[:, :K])
        j = pos - w
        if j < max(s, 0):
            continue
        x = base + j - first
        cand = realx[:, x]  # [L]: a real key leaves
        if not cand.any():
            continue
        score = _recall_error(far, f[:, x, None], vv[:, x, None], delta=delta, eps=eps)[:, 0]  # [L]
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
        until[p, x] = NEVER
        o = np.nonzero(out)[0]
        if not len(o):
            continue
        xo = out_x[o]
        until[o, xo] = t
        event[o, t] = xo
        fe, ve = f[o, xo], vv[o, xo]  # [n, M], [n, Dv]
        if delta:  # 3. enter: S += β k̂ (v − Sᵀk̂)ᵀ
            kh = _unit(fe)
            err = ve - far.read(_unit(f[lanes, out_x])[:, None])[o, 0]
            far.write(o, beta[o, xo][:, None] * kh, err)
        else:  # S += φ vᵀ, z += φ
            far.write(o, fe, np.concatenate([ve, np.ones((len(o), 1))], 1))
    return (back(event), back(until), snaps, back(slot_x), back(score_k[:, :K], ef.dtype), back(pos_k[:, :K]),
            back(cached, torch.bool))
