r"""The fast path of memory attention (DESIGN §7), called by :func:`sketchlab.attention.memory.memory_attention`
with its checked arguments (trusted here).

(i) *The schedule* (:mod:`sketchlab.attention.ops.cache.schedule`): a no-grad pass, vectorised over
``[B, H]``, applies steps 1–3 to a detached state and records the key (if any) that enters the state
at each step and the step at which each cached key left the cache. With ``K = 0`` nothing needs the
state: the key leaving the window enters at once, and the events are formed without a loop.
(ii) *The far part*: one recurrence over the event stream (the entering key's ``φ, v`` at its step,
zeros for a null event), with autograd, through :mod:`sketchlab.attention.ops.decayed` or :mod:`~sketchlab.attention.ops.delta`.
(iii) *The exact part*, per chunk of ``C`` queries: the sinks, the cache's slots at the chunk's
start and the band of positions ``t0 − w … t0 + C − 1`` (the window's keys and every key cached during
the chunk), each masked by when it is exact for the query; a batch of chunks at a time (:func:`~sketchlab.attention.ops.cache.chunk.exact_part`), mixed
with the far part by the one hybrid combine (:mod:`sketchlab.attention.ops.hybrid`).

Keys are addressed in one *extended* axis ``X`` per call: the initial cache's ``K`` slots, the held
sinks ``L_s``, then the contiguous positions ``offset − L_w … offset + T − 1`` (the held window and
the new tokens). Layout inside: ``[B, H, ·, ·]``.
"""

from __future__ import annotations

import torch

from ._checks import denominator_counts, report_denominators
from .memory_state import MemoryState, empty_memory_state
from .ops.cache.chunk import exact_part
from .ops.cache.recurrent import decode
from .ops.cache.schedule import schedule, take_rows
from .ops.decayed.chunk import decayed_linear_core
from .ops.decayed.decay import far_log_decay
from .ops.delta.beta import far_beta, unit
from .ops.delta.chunk import delta_rule_core
from .ops.hybrid import combine, combine_delta, gate_weight

#: Decoding (``T = 1`` with a state) takes :func:`sketchlab.attention.ops.cache.recurrent.decode`; False forces
#: the general path (the tests compare the two).
_DECODE = True


def _far_additive(fq, fe, ve, log_decay, S0, z0, chunk):
    num, den, (S, z) = decayed_linear_core(fq, fe, ve, log_decay, (S0, z0), chunk)
    return num, den, S, z


def run(c):
    """The fast path on checked arguments ``c`` (:func:`sketchlab.attention.memory.check_memory_call`)."""
    if c.T == 1 and c.state is not None and _DECODE:
        return decode(c)
    work, dev = c.work, c.phi_q.device
    B, T, H, M, D, Dv, w, s, K, C = c.B, c.T, c.H, c.M, c.D, c.Dv, c.w, c.s, c.K, c.o.chunk_size
    st = c.state if c.state is not None else empty_memory_state(B, H, M, D, Dv, cache=K, like=c.phi_q, dtype=work)
    P0, Lw, Ls = st.offset, st.k_window.shape[2], st.k_sink.shape[2]
    real = torch.ones(B, T, dtype=torch.bool, device=dev) if c.mask is None else c.mask
    fq, fk, vv = (x.to(work) for x in (c.phi_q, c.phi_k, c.v))  # [B, T, H, ·]
    lg = far_log_decay(c, vv, real)  # [B, T, H] or None
    # the extended key axis: initial cache slots | held sinks | held window + new tokens
    tr = lambda x: x.transpose(1, 2)  # noqa: E731  [B, T, H, ·] -> [B, H, T, ·]
    kk = tr(c.k.to(work)) if w else torch.zeros(B, H, T, 0, dtype=work, device=dev)
    ek = torch.cat([st.k_cache, st.k_sink, st.k_window, kk], 2)  # [B, H, X, D]
    ev = torch.cat([st.v_cache, st.v_sink, st.v_window, tr(vv)], 2)  # [B, H, X, Dv]
    ef = torch.cat([st.phi_cache, st.phi_cache.new_zeros(B, H, Ls, M), st.phi_window, tr(fk)], 2)  # [B, H, X, M]
    real_x = torch.cat([torch.zeros(B, K, dtype=torch.bool, device=dev), st.mask_sink, st.mask_window, real], 1)  # [B, X]
    base, first = K + Ls, P0 - Lw  # extended index and position of the first contiguous key
    event, until, snaps, slot_x, slot_score, slot_pos, cached = schedule(c, ef, ev, real_x, lg, st, base, first, C)
    # (ii) the far part over the event stream
    null = event < 0  # [B, H, T]
    idx = event.clamp(min=0)
    fe = tr(take_rows(ef, idx) * ~null[..., None])  # [B, T, H, M]
    ve = tr(take_rows(ev, idx) * ~null[..., None])  # [B, T, H, Dv]
    if c.delta:
        beta = far_beta(c, ve) * ~tr(null)  # [B, T, H]
        far, S = delta_rule_core(unit(fq), unit(fe), ve, beta, lg, st.S, min(C, T))  # checked by the entry
        z = torch.zeros_like(st.z)
        far = tr(far)  # [B, H, T, Dv]
    else:
        num, den, S, z = _far_additive(fq, fe, ve, lg, st.S, st.z, min(C, T))
        num, den = tr(num), den.transpose(1, 2)  # [B, H, T, Dv], [B, H, T]
    # (iii) the exact part, per query chunk
    end = P0 + T
    sink_pos = list(range(min(s, end)))
    sink_x = torch.tensor([K + p if p < Ls else base + p - first for p in sink_pos], dtype=torch.long, device=dev)
    if w:
        ex_num, ex_den, some = exact_part(c, ek, ev, real_x, until, snaps, sink_pos, sink_x, base, first, P0)
        g = gate_weight(c.far["gate"], H, dtype=work, device=dev)[None, :, None]  # [1, H, 1]
        if c.delta:
            out = combine_delta(ex_num, ex_den, some, far, g)
        else:
            out, dn = combine(ex_num, ex_den, num, den, g, eps=c.o.eps)
            if c.normalize == "sum":
                report_denominators(denominator_counts(dn, real[:, None]), B * H * T, "memory_attention",
                                    c.o.denominator_check)
    elif c.delta:
        out = far
    elif c.normalize == "sum":
        report_denominators(denominator_counts(den, real[:, None]), B * H * T, "memory_attention",
                            c.o.denominator_check)
        out = num / (den + c.o.eps)[..., None]
    else:
        out = num
    out = tr(out).to(c.in_dtype)  # [B, T, H, Dv]
    if not c.final:
        return out
    Lw2 = min(w, end)
    X = ek.shape[2]
    have = cached[..., None]
    cx = slot_x.clamp(min=0)
    state = MemoryState(
        S=S, z=z, k_window=ek[:, :, X - Lw2:], v_window=ev[:, :, X - Lw2:], phi_window=ef[:, :, X - Lw2:],
        mask_window=real_x[:, X - Lw2:], k_sink=ek[:, :, sink_x], v_sink=ev[:, :, sink_x], mask_sink=real_x[:, sink_x],
        k_cache=take_rows(ek, cx) * have, v_cache=take_rows(ev, cx) * have, phi_cache=take_rows(ef, cx) * have,
        score_cache=torch.where(cached, slot_score, 0.0), cached=cached, pos_cache=torch.where(cached, slot_pos, -1),
        offset=end)
    return out, state
