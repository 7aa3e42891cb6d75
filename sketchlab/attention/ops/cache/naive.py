r"""The sparse exact cache of far keys, token by token over explicit key sets in float64: the definition of every
memory mechanism (DESIGN §7; the four steps of :mod:`sketchlab.attention.memory`, per (batch, head) and position).
The far state decays and takes the keys the cache evicts by the decayed state's and the delta rule's own steps
(:func:`~sketchlab.attention.ops.decayed.naive.decay_step`, :func:`~sketchlab.attention.ops.decayed.naive.additive_write`,
:func:`~sketchlab.attention.ops.delta.naive.delta_write`).
The arguments are trusted: :func:`sketchlab.attention.memory.memory_attention_naive` checks them.
"""

from __future__ import annotations

import torch

from ..._checks import denominator_counts, report_denominators
from ...memory_state import MemoryState, empty_memory_state
from ..decayed.decay import far_log_decay
from ..decayed.naive import additive_write, decay_step
from ..delta.beta import unit
from ..delta.naive import delta_write
from .score import recall_error

__all__ = ["memory_naive"]


def memory_naive(c):
    """The memory mechanisms' float64 loop on a checked call.

    Parameters
    ----------
    c : types.SimpleNamespace
        A checked memory call (:func:`sketchlab.attention.memory_state.check_memory_call`).

    Returns
    -------
    Tensor ``[B, T, H, Dv]`` float64, or ``(o, MemoryState)`` (float64) when ``c.final``.
    """
    f64, dev = torch.float64, c.phi_q.device
    B, T, H, M, D, Dv, w, s, K = c.B, c.T, c.H, c.M, c.D, c.Dv, c.w, c.s, c.K
    st = c.state if c.state is not None else empty_memory_state(B, H, M, D, Dv, cache=K, like=c.phi_q)
    st = st.to(f64)
    P0 = st.offset
    fq, fk, vv = (x.to(f64) for x in (c.phi_q, c.phi_k, c.v))
    qq, kk = (c.q.to(f64), c.k.to(f64)) if w else (None, None)
    real = torch.ones(B, T, dtype=torch.bool, device=dev) if c.mask is None else c.mask
    lg = far_log_decay(c, vv, real)  # [B, T, H] or None
    g = _gate(c, f64)
    zero_k = torch.zeros(D, dtype=f64, device=dev)
    outs_list = [[None] * H for _ in range(B)]
    finals, counts = [[None] * H for _ in range(B)], torch.zeros(2, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            # every position this call can read: the held sinks, the held window, the new tokens
            tok = {}  # position -> (k [D], v [Dv], φ [M] or None, real)
            for i in range(st.k_sink.shape[2]):
                tok[i] = (st.k_sink[b, h, i], st.v_sink[b, h, i], None, bool(st.mask_sink[b, i]))
            Lw = st.k_window.shape[2]
            for i in range(Lw):
                tok[P0 - Lw + i] = (st.k_window[b, h, i], st.v_window[b, h, i], st.phi_window[b, h, i],
                                    bool(st.mask_window[b, i]))
            for t in range(T):
                tok[P0 + t] = (kk[b, t, h] if w else zero_k, vv[b, t, h], fk[b, t, h], bool(real[b, t]))
            slots = [None] * K  # each: dict(pos, k, v, phi, score)
            for i in range(K):
                if st.cached[b, h, i]:
                    slots[i] = dict(pos=int(st.pos_cache[b, h, i]), k=st.k_cache[b, h, i], v=st.v_cache[b, h, i],
                                    phi=st.phi_cache[b, h, i], score=float(st.score_cache[b, h, i]))
            S, z = st.S[b, h], st.z[b, h]
            row = []
            for t in range(T):
                pos = P0 + t
                # 1. decay (not at a pad)
                if lg is not None:
                    S, z = decay_step(S, z, lg[b, t, h].exp())
                # 2. leave: rescore, cache the leaving key, evict the least score (ties: the oldest)
                if pos % c.o.rescore == 0:
                    for e in slots:
                        if e is not None:
                            e["score"] = float(recall_error(S, z, e["phi"], e["v"], delta=c.delta, eps=c.o.eps))
                j, evicted = pos - w, None
                if j >= s and j >= 0 and tok[j][3]:
                    kj, vj, fj, _ = tok[j]
                    cand = dict(pos=j, k=kj, v=vj, phi=fj,
                                score=float(recall_error(S, z, fj, vj, delta=c.delta, eps=c.o.eps)))
                    held = [e for e in slots if e is not None]
                    if len(held) + 1 > K:
                        evicted = min(held + [cand], key=lambda e: (e["score"], e["pos"]))
                        if evicted is not cand:
                            slots[next(i for i, e in enumerate(slots) if e is evicted)] = cand
                    else:
                        slots[slots.index(None)] = cand
                # 3. enter
                if evicted is not None:
                    fj, vj = evicted["phi"], evicted["v"]
                    if c.delta:
                        S = delta_write(S, unit(fj), vj, _beta_one(c, vj, h))
                    else:
                        S, z = additive_write(S, z, fj, vj)
                # 4. read
                ex_num, ex_den, n_exact = torch.zeros(Dv, dtype=f64, device=dev), torch.zeros((), dtype=f64, device=dev), 0
                if w:
                    E = [j for j in range(max(0, pos - w + 1), pos + 1) if j >= s and tok[j][3]]
                    E += [j for j in range(min(s, pos + 1)) if tok[j][3]]
                    keys = [tok[j][0] for j in E] + [e["k"] for e in slots if e is not None]
                    vals = [tok[j][1] for j in E] + [e["v"] for e in slots if e is not None]
                    n_exact = len(keys)
                    if keys:
                        logits = c.scale * (torch.stack(keys) @ qq[b, t, h])  # [n]
                        a = (logits - logits.amax()).exp() if c.o.local == "softmax" else logits ** c.degree
                        ex_num, ex_den = a @ torch.stack(vals), a.sum()
                if c.delta:
                    far = unit(fq[b, t, h]) @ S  # [Dv]
                    if w:
                        exact = ex_num / ex_den if n_exact else ex_num
                        o = g[h] * exact + (1 - g[h]) * far
                    else:
                        o = far
                else:
                    num, den = fq[b, t, h] @ S, fq[b, t, h] @ z
                    if w:
                        num, den = g[h] * ex_num + (1 - g[h]) * num, g[h] * ex_den + (1 - g[h]) * den
                    if c.normalize == "sum":
                        counts += denominator_counts(den, real[b, t])
                        o = num / (den + c.o.eps)
                    else:
                        o = num
                row.append(o)
            outs_list[b][h] = torch.stack(row) if row else torch.zeros(0, Dv, dtype=f64, device=dev)
            finals[b][h] = (S, z, tok, slots)
    outs = torch.stack([torch.stack(outs_list[b], 1) for b in range(B)])  # [B, T, H, Dv]
    if not c.delta and c.normalize == "sum":
        report_denominators(counts, B * H * T, "memory_attention_naive", c.o.denominator_check)
    if not c.final:
        return outs
    return outs, _naive_final(c, finals, P0 + T, f64)


def _gate(call, dtype) -> torch.Tensor:
    """``g [H]``: σ(gate), or 1/2 without one: the float64 twin's own (the fast paths take
    :func:`sketchlab.attention.ops.hybrid.gate_weight`)."""
    g = call.far["gate"]
    return torch.full((call.H,), 0.5, dtype=dtype, device=call.phi_q.device) if g is None else torch.sigmoid(g.to(dtype))


def _beta_one(c, vj: torch.Tensor, h: int) -> torch.Tensor:
    """``β`` of one key of head ``h`` with value ``vj [Dv]``."""
    x = c.far["beta_bias"][h].to(vj.dtype)
    if c.far["beta_weight"] is not None:
        x = x + vj @ c.far["beta_weight"][h].to(vj.dtype)
    return torch.sigmoid(x)


def _naive_final(c, finals, end: int, f64) -> MemoryState:
    """Assemble the per-(batch, head) final states of the naive loop into a :class:`MemoryState`."""
    B, H, M, D, Dv, K, dev = c.B, c.H, c.M, c.D, c.Dv, c.K, c.phi_q.device
    win = range(max(0, end - c.w), end)
    snk = range(min(c.s, end))

    def per(fn):  # stack fn(b, h) over [B, H]
        return torch.stack([torch.stack([fn(b, h) for h in range(H)]) for b in range(B)])

    def seq(positions, field, width):
        return per(lambda b, h: torch.stack([finals[b][h][2][p][field] for p in positions]) if len(positions)
                   else torch.zeros(0, width, dtype=f64, device=dev))

    def slot(b, h, i, key, width):
        e = finals[b][h][3][i]
        return e[key] if e is not None else torch.zeros(width, dtype=f64, device=dev)

    def slots(key, width):
        return per(lambda b, h: torch.stack([slot(b, h, i, key, width) for i in range(K)]) if K
                   else torch.zeros(0, width, dtype=f64, device=dev))

    info = lambda key, dt, empty: torch.tensor(  # noqa: E731
        [[[finals[b][h][3][i][key] if finals[b][h][3][i] is not None else empty for i in range(K)] for h in range(H)]
         for b in range(B)], dtype=dt, device=dev).reshape(B, H, K)
    mask = lambda positions: torch.tensor([[finals[b][0][2][p][3] for p in positions] for b in range(B)],  # noqa: E731
                                          dtype=torch.bool, device=dev).reshape(B, len(positions))
    return MemoryState(
        S=per(lambda b, h: finals[b][h][0]), z=per(lambda b, h: finals[b][h][1]),
        k_window=seq(win, 0, D), v_window=seq(win, 1, Dv), phi_window=seq(win, 2, M), mask_window=mask(win),
        k_sink=seq(snk, 0, D), v_sink=seq(snk, 1, Dv), mask_sink=mask(snk),
        k_cache=slots("k", D), v_cache=slots("v", Dv), phi_cache=slots("phi", M),
        score_cache=info("score", f64, 0.0), cached=info("pos", torch.long, -1) >= 0, pos_cache=info("pos", torch.long, -1),
        offset=end)
