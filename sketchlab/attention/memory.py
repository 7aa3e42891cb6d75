r"""Long-context memory for the sliding-window hybrid (DESIGN §7): a sparse exact cache of far keys,
a decaying far state, a delta-rule far state.

At each query position ``t`` (window ``w``, sinks ``s``, cache size ``K``, gate ``g = σ(gate)``):

1. *decay*: :math:`S \leftarrow \gamma_t S`, :math:`z \leftarrow \gamma_t z`;
2. *leave*: key ``j = t − w`` (a real token, ``j ≥ s``) leaves the window and is cached with the
   score :math:`e_j = \lVert v_j - r(k_j)\rVert^2` (the state's recall error for it); at
   ``t ≡ 0 (mod rescore)`` every cached key is re-scored first; with more than ``K`` cached, the
   least score (ties: the oldest) is evicted;
3. *enter*: the evicted key enters the state (additive sums, or the delta rule);
4. *read*: exact keys (window, sinks, cache) and the far state, mixed by the gate.

:func:`memory_attention_naive` is that loop, token by token over explicit key sets, in float64: the
definition. :func:`memory_attention` is the fast path (the schedule, then the far part as one
recurrence over an event stream through :mod:`sketchlab.attention.ops.decayed` or :mod:`~sketchlab.attention.ops.delta`, then the exact part per
query chunk; :mod:`sketchlab.attention.memory_fast`). Both carry a :class:`MemoryState`.

Layout: tokens ``[B, T, H, ·]``; the state ``[B, H, ·, ·]``. Scores and evictions are discrete
choices taken without gradient; gradients flow through every value given the choices.
"""

from __future__ import annotations

import torch

from ._checks import denominator_counts, report_denominators
from .memory_fast import run
from .memory_state import (
    MemoryState,
    check_memory_call,
    check_memory_state,
    empty_memory_state,
    far_log_decay,
    recall_error,
    unit,
)

__all__ = ["MemoryState", "check_memory_state", "empty_memory_state", "memory_attention", "memory_attention_naive"]


# ------------------------------------------------------------------------------------------------ the definition
def memory_attention_naive(phi_q, phi_k, v, q=None, k=None, *, options, params=None, gate=None, degree=None,
                           key_padding_mask=None, initial_state=None, output_final_state=False):
    r"""Memory attention, token by token over explicit key sets, in float64: the definition (DESIGN §7).

    Parameters
    ----------
    phi_q, phi_k : Tensor ``[B, T, H, M]``
        The far part's features, as the state uses them (already self-tensored by the caller).
    v : Tensor ``[B, T, H, Dv]``
    q, k : Tensor ``[B, T, H, D]`` or None
        Raw queries and keys for the exact part (needed when ``options.window > 0``).
    options : AttentionOptions
        Causal; ``window, sinks, local, local_scale, eps, normalize`` as the hybrid, and the memory
        fields ``cache, decay, state, beta, rescore``.
    params : FarParams or None
        ``gate`` (None: ``g = 1/2``), ``decay_bias/weight``, ``beta_bias/weight`` as the options ask.
    gate : Tensor ``[H]`` or None
        The gate logits of a module that keeps them outside its FarParams (a converted layer keeps
        ``gate`` where saved conversions have it); refused together with ``params.gate``.
    degree : int or None
        ``p`` of ``local="poly"``.
    key_padding_mask : bool Tensor ``[B, T]`` or None
        True: a real token. A pad is never an exact key, never cached, never enters the state, does
        not decay it, but occupies its position.
    initial_state : MemoryState or None
    output_final_state : bool

    Returns
    -------
    Tensor ``[B, T, H, Dv]`` float64, or ``(o, MemoryState)`` (float64).

    Notes
    -----
    The four steps of the module docstring, literally, per (batch, head) and position. Read:
    additive :math:`o = (g\sum_E a_jv_j + (1-g)S^\top\phi(q))/(g\sum_E a_j + (1-g)z\cdot\phi(q) + \varepsilon)`;
    delta :math:`o = g\sum_E a_jv_j/\sum_E a_j + (1-g)S^\top\hat q` (the exact term is 0 when ``E`` holds
    no real key: only a pad query). ``window = 0``: the far term alone (additive: normalised as
    ``normalize`` says).
    """
    c = check_memory_call(phi_q, phi_k, v, q, k, options, params, degree, key_padding_mask, initial_state, output_final_state,
                    gate)
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
                    gamma = lg[b, t, h].exp()
                    S, z = gamma * S, gamma * z
                # 2. leave: rescore, cache the leaving key, evict the least score (ties: the oldest)
                if pos % options.rescore == 0:
                    for e in slots:
                        if e is not None:
                            e["score"] = float(recall_error(S, z, e["phi"], e["v"], delta=c.delta, eps=options.eps))
                j, evicted = pos - w, None
                if j >= s and j >= 0 and tok[j][3]:
                    kj, vj, fj, _ = tok[j]
                    cand = dict(pos=j, k=kj, v=vj, phi=fj,
                                score=float(recall_error(S, z, fj, vj, delta=c.delta, eps=options.eps)))
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
                        kh, beta = unit(fj), _beta_one(c, vj, h)
                        S = S + beta * kh[:, None] * (vj - kh @ S)[None, :]
                    else:
                        S, z = S + fj[:, None] * vj[None, :], z + fj
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
                        a = (logits - logits.amax()).exp() if options.local == "softmax" else logits ** c.degree
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
                        o = num / (den + options.eps)
                    else:
                        o = num
                row.append(o)
            outs_list[b][h] = torch.stack(row) if row else torch.zeros(0, Dv, dtype=f64, device=dev)
            finals[b][h] = (S, z, tok, slots)
    outs = torch.stack([torch.stack(outs_list[b], 1) for b in range(B)])  # [B, T, H, Dv]
    if not c.delta and c.normalize == "sum":
        report_denominators(counts, B * H * T, "memory_attention_naive", options.denominator_check)
    if not output_final_state:
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


def memory_attention(phi_q, phi_k, v, q=None, k=None, *, options, params=None, gate=None, degree=None,
                     key_padding_mask=None, initial_state=None, output_final_state=False):
    r"""Memory attention, the fast path (DESIGN §7): same arguments and result as :func:`memory_attention_naive`.

    A no-grad schedule over ``[B, H]`` decides which key enters the state at each step and when
    each cached key leaves the cache; the far part is one recurrence over that event stream
    (:func:`sketchlab.attention.ops.decayed.chunk.decayed_linear_chunked` or
    :func:`~sketchlab.attention.ops.delta.chunk.delta_rule_chunked`), the exact
    part is gathered per query chunk (window band, sinks, keys cached during the chunk, masked by
    their cached interval). float32 and float64; half inputs run in float32 (the state in float32,
    the output in the inputs' dtype). Cost ``O(T·(w + s + K + C)·D + T·M·Dv)``.

    Returns
    -------
    Tensor ``[B, T, H, Dv]``, or ``(o, MemoryState)`` with ``output_final_state=True``.
    """
    c = check_memory_call(phi_q, phi_k, v, q, k, options, params, degree, key_padding_mask, initial_state, output_final_state,
                    gate)
    return run(c)
