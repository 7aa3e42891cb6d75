r"""The sparse exact cache's exact part by query chunks (DESIGN §7, fast path (iii)), called by
:func:`sketchlab.attention.memory_fast.run` on checked arguments (trusted here): for each chunk of ``C`` queries
the sinks, the cache's slots at the chunk's start and the band of positions ``t0 − w … t0 + C − 1``, each masked
by when it is exact for the query, summed with one shift by the one hybrid combine's :func:`exact_sums
<sketchlab.attention.ops.hybrid.exact_sums>`. Keys are addressed in the call's extended axis ``X``
(:mod:`sketchlab.attention.memory_fast`); layout inside ``[B, H, ·, ·]``.
"""

from __future__ import annotations

import torch

from ..hybrid import exact_sums
from .schedule import take_rows

__all__ = ["exact_part"]

#: The exact part's logits per batch of query chunks (elements): bounds its memory at long contexts.
EXACT_ELEMENTS = 2**21


def exact_part(c, ek, ev, real_x, until, snaps, sink_pos, sink_x, base, first, P0):
    """The exact part (iii) of every query: ``Σ a v`` ``[B, H, T, Dv]``, ``Σ a`` and "some key allowed"
    ``[B, H, T]``, for the query chunks of :data:`EXACT_ELEMENTS` logits at a time (one gather of
    their keys: its gradient is one scatter into ``ek, ev``)."""
    B, H, T, C, w, s, K = c.B, c.H, c.T, c.o.chunk_size, c.w, c.s, c.K
    dev, X = ek.device, ek.shape[2]
    n_chunks = -(-T // C)
    Lk = len(sink_pos) + K + w + C  # a chunk's keys: sinks | the slots at its start | the band t0 − w … t0 + C − 1
    per = max(1, EXACT_ELEMENTS // (B * H * C * Lk))
    qq = torch.nn.functional.pad(c.q.to(c.work).transpose(1, 2), (0, 0, 0, n_chunks * C - T))  # [B, H, T', D]
    snap = torch.stack(snaps, 2) if K else torch.zeros(B, H, n_chunks, 0, dtype=torch.long, device=dev)
    spos = torch.tensor(sink_pos, dtype=torch.long, device=dev)
    outs = []
    for n0 in range(0, n_chunks, per):
        n1 = min(n0 + per, n_chunks)
        t0 = torch.arange(n0, n1, device=dev)[:, None] * C  # [g, 1] the chunks' first steps
        steps = t0 + torch.arange(C, device=dev)  # [g, C]
        qpos = P0 + steps
        band = P0 + t0 - w + torch.arange(w + C, device=dev)  # [g, w + C]
        bx = (base + band - first).clamp(0, X - 1)
        sx = snap[:, :, n0:n1].clamp(min=0)  # [B, H, g, K]
        g = n1 - n0
        idx = torch.cat([sink_x.expand(B, H, g, -1), sx, bx.expand(B, H, -1, -1)], 3).flatten(2)  # [B, H, g·Lk]
        keys, vals = take_rows(ek, idx).unflatten(2, (g, Lk)), take_rows(ev, idx).unflatten(2, (g, Lk))
        ok_sink = (spos <= qpos[..., None]) & real_x[:, None, None, sink_x]  # [B, g, C, s]
        ok_slot = (snap[:, :, n0:n1, None] >= 0) & (until.gather(2, sx.flatten(2)).view(B, H, g, 1, K) > steps[..., None])
        in_win = (band[:, None] > qpos[..., None] - w) & (band[:, None] <= qpos[..., None])  # [g, C, w + C]
        enter = (band + w - P0)[:, None]  # [g, 1, w + C]: the step each band key leaves the window
        in_cache = (enter <= steps[..., None]) & (until.gather(2, bx.flatten().expand(B, H, -1)).view(B, H, g, 1, -1)
                                                  > steps[..., None])  # [B, H, g, C, w + C]
        real_b = real_x.gather(1, bx.flatten().expand(B, -1)).view(B, g, 1, -1) & (band >= s)[:, None]  # >= 0: held
        ok_band = (in_win | in_cache) & real_b[:, None]
        ok = torch.cat([ok_sink[:, None].expand(B, H, -1, -1, -1), ok_slot, ok_band], -1)  # [B, H, g, C, Lk]
        logits = c.scale * (qq[:, :, n0 * C:n1 * C].unflatten(2, (g, C)) @ keys.mT)
        outs.append((*exact_sums([(logits, ok, vals)], local=c.o.local, degree=c.degree), ok.any(-1)))
    ex_num, ex_den, some = (torch.cat([o[i].flatten(2, 3) for o in outs], 2)[:, :, :T] for i in range(3))
    return ex_num, ex_den, some
