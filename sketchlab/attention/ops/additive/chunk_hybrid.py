r"""The sliding-window hybrid's causal block with a hand-written backward (layout ``[B, H, ·, ·]``): exact local
weights (softmax or polynomial) over the window and the sinks, the far kernel over every older key through
:mod:`.chunk`'s prefix GEMM (the far state :func:`~.chunk.chunk_core` shares), mixed by a per-head gate (:func:`hybrid_core`).

The keys are chunk-major ``[chunks, B, H, C, ·]`` as the far state's: the held window and the block's tokens are
laid end to end into one such tensor without a joined token-major copy (:func:`_join_chunks`).

A fused form of the hybrid combine (:mod:`sketchlab.attention.ops.hybrid`, which the unfused paths share): the
local weights per key-chunk lag, the gate folded into them (num and den divided by ``1 − g``), beside a
hand-written backward; tested against the float64 twin, as the Triton kernel is.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from .far import chunk_geometry, far_backward, far_forward, from_chunks, normalized_grads, to_chunks

__all__ = ["hybrid_core"]


def _row_pieces(chunks: int, C: int, a: int, b: int):
    """The token rows ``[a, b)`` of a chunk-major ``[chunks, B, H, C, ·]`` tensor as pieces: ``(chunk, r0, r1, i)``
    (a part of one chunk, rows ``r0:r1``) or ``(c0, c1, None, i)`` (whole chunks ``c0:c1``); ``i`` the first row's
    offset from ``a``."""
    i = a
    while i < b:
        c, r = divmod(i, C)
        if r == 0 and b - i >= C:
            c1 = c + (b - i) // C
            yield c, c1, None, i - a
            i = c1 * C
        else:
            r1 = min(C, r + b - i)
            yield c, r, r1, i - a
            i += r1 - r


def _join_chunks(pieces, lead: int, chunks: int, C: int) -> torch.Tensor:
    """Token-major pieces ``[B, H, L_i, F]`` laid end to end from row ``lead`` → chunk-major ``[chunks, B, H, C, F]``
    (zeros in the other rows): one copy, no joined token-major tensor."""
    B, H, _, F = pieces[0].shape
    out = pieces[0].new_empty(chunks, B, H, C, F)
    end = lead + sum(x.shape[2] for x in pieces)
    for a, b in ((0, lead), (end, chunks * C)):  # the zero rows
        for c, r0, r1, _ in _row_pieces(chunks, C, a, b):
            (out[c:r0] if r1 is None else out[c, :, :, r0:r1]).zero_()
    for x in pieces:
        _put_rows(out, lead, x, add=False)
        lead += x.shape[2]
    return out


def _rows(xc: torch.Tensor, a: int, length: int) -> torch.Tensor:
    """Token rows ``[a, a + length)`` of chunk-major ``xc [chunks, B, H, C, F]`` → ``[B, H, length, F]`` (a copy of
    the chunks they span)."""
    C = xc.shape[3]
    c0, c1 = a // C, -(-(a + length) // C)
    return from_chunks(xc[c0:c1], a - c0 * C + length)[:, :, a - c0 * C:]


def _put_rows(xc: torch.Tensor, a: int, x: torch.Tensor, *, add: bool) -> None:
    """``xc``'s token rows ``[a, a + L)`` set to (``add``: increased by) ``x [B, H, L, F]`` in place (chunk-major
    ``xc [chunks, B, H, C, F]``)."""
    C = xc.shape[3]
    for c, r0, r1, i in _row_pieces(xc.shape[0], C, a, a + x.shape[2]):
        if r1 is None:  # whole chunks c : r0
            dst, src = xc[c:r0], x[:, :, i:i + (r0 - c) * C].unflatten(2, (r0 - c, C)).permute(2, 0, 1, 3, 4)
        else:
            dst, src = xc[c, :, :, r0:r1], x[:, :, i:i + r1 - r0]
        dst.add_(src) if add else dst.copy_(src)


@functools.lru_cache(maxsize=64)
def _hybrid_masks(C: int, window: int, lags: int, device: torch.device, dtype: torch.dtype):
    """Per key-chunk lag ``L < lags``, query ``r``, key ``u`` (``lag = L·C + r − u``): ``local [lags, C, C]`` bool
    (``0 <= lag < w``); ``empty [lags, C]`` bool, the rows without a local key at that ``L`` (and their indices
    ``(L, r)``, two index tensors); ``bias [lags, C, C]``
    in ``dtype``, ``0`` on the local keys and ``−inf`` elsewhere except on the empty rows (all ``0``, so that a
    softmax over the row stays finite: its weights are dropped); ``far [lags, C, C]`` in ``dtype`` (``lag >= w``)."""
    r = torch.arange(C, device=device)[None, :, None]
    L = torch.arange(lags, device=device)[:, None, None]
    u = torch.arange(C, device=device)[None, None, :]
    lag = L * C + r - u  # [lags, C, C]
    local = (lag >= 0) & (lag < window)
    empty = ~local.any(-1)  # [lags, C]
    bias = torch.zeros(local.shape, dtype=dtype, device=device).masked_fill_(~local & ~empty[..., None], float("-inf"))
    return local, (empty, empty.nonzero(as_tuple=True)), bias, (lag >= window).to(dtype)


class _HybridCore(torch.autograd.Function):
    """Forward and backward of one causal hybrid block, chunk-major inside (see :func:`hybrid_core`)."""

    @staticmethod
    def _setup(B, H, n, Lw, key_ok, sink_ok, off, opts, like):
        """Geometry and masks of a block of ``n`` queries after ``off`` keys (``L_w`` of them the held window)."""
        C, w = opts[:2]
        # R [N + 1, 1 + Ne]: S_in, the wholly far key chunks (among the first `reach`); row N: those wholly in S_out
        N, Wc, Ne, _, R, last, reach = chunk_geometry(n, off, w, C, like.device, like.dtype)
        n_loc = min(-(-(w + C - 1) // C), Wc + 1)  # key chunks back with a local key (further: padding)
        lead = off - Lw
        loc_m, (empty, empty_at), loc_bias, far_m = _hybrid_masks(C, w, n_loc, like.device, like.dtype)
        kks = [slice(Wc - L, Wc - L + N) for L in range(n_loc)]
        # key chunks up to `bad` hold a key that is neither local nor far (padding, sink, front zeros): the query
        # chunks below `part` read one of them and take the data masks; the others the lag masks alone
        okc, loc_ok, part, bad = None, None, 0, -1
        if not bool(key_ok.all()):
            okb = to_chunks(key_ok[:, None, :, None], Ne, C)[:, :, 0, :, 0]  # [Ne, B, C]
            bad = int((~okb).flatten(1).any(1).nonzero().max())
            part = min(N, max(0, bad - Wc + n_loc))
            loc_ok = torch.stack([okb[kk][:part] for kk in kks])[:, :, :, None, None, :] & loc_m[:, None, None, None]
            # [n_loc, part, B, 1, C, C]
            okc = okb[:bad + 1, :, None, :, None].to(like.dtype)  # [bad + 1, B, 1, C, 1]: zero their far features
        # the far lags are those with a far key, L·C + C − 1 >= w
        far_lags = [L for L in range(n_loc) if L * C + C - 1 >= w]
        sok = to_chunks(sink_ok.expand(B, 1, n, -1), N, C).mT  # [N, B, 1, Ls, C]
        sinks_ok = bool(sink_ok.all())
        return dict(N=N, Wc=Wc, Ne=Ne, n_loc=n_loc, lead=lead, kks=kks, loc_m=loc_m, loc_ok=loc_ok, part=part,
                    bad=bad, okc=okc, empty=empty, empty_at=empty_at, loc_bias=loc_bias, far_m=far_m, far_lags=far_lags,
                    R=R, reach=reach, last=last, sok=sok, sinks_ok=sinks_ok)

    @staticmethod
    def _per_chunk(x: torch.Tensor, N: int) -> torch.Tensor:
        """``x [B, H, R, F]`` (the sinks') → ``[N·B·H, R, F]``, the same for every chunk (a small copy)."""
        return x[None].expand(N, *x.shape).reshape(-1, *x.shape[2:])

    @staticmethod
    def forward(ctx, fq, fk, v, q, k, fk_w, v_w, k_w, k_sink, v_sink, S_in, z_in, g, key_ok, sink_ok, off, opts):
        C, w, non_negative, scale, softmax, degree, eps, grad = opts
        B, H, n, _ = fq.shape
        Dv, D, Ls = v.shape[-1], q.shape[-1], k_sink.shape[2]
        st = _HybridCore._setup(B, H, n, k_w.shape[2], key_ok, sink_ok, off, opts, fq)
        N, n_loc, kks, lead, Ne = st["N"], st["n_loc"], st["kks"], st["lead"], st["Ne"]
        # chunk-major copies (keys: off − L_w zero rows, the held window, the block; the backward makes its own);
        # the local scale s multiplies the products (a GEMM's alpha), never a copy
        fqc, qc = to_chunks(fq, N, C), to_chunks(q, N, C)
        fkc = _join_chunks((fk_w, fk), lead, Ne, C)
        vc, kc = _join_chunks((v_w, v), lead, Ne, C), _join_chunks((k_w, k), lead, Ne, C)
        NBH = N * B * H
        # the window the next block holds: the last min(w, L_w + n) keys, raw
        Lo = min(w, k_w.shape[2] + n)
        windows = tuple((x[:, :, n - Lo:] if Lo <= n else torch.cat([xw[:, :, xw.shape[2] - Lo + n:], x], 2)).clone()
                        for xw, x in ((fk_w, fk), (v_w, v), (k_w, k)))
        part = st["part"]
        if st["okc"] is not None:
            fkc[:st["bad"] + 1].mul_(st["okc"])  # sinks, padding: out of the far sums
        # num and den divided by 1 − g (the far part unscaled, the local one times γ = g/(1 − g), ε by 1 − g)
        # unless some g is 1: then times g and 1 − g as written
        fold = bool((g < 1).all())
        gb = g[None, None, :, None, None]  # [1, 1, H, 1, 1]
        g0 = gb[..., 0]
        loc_w = gb / (1 - gb) if fold else gb  # the local weights' factor
        # far state: per-chunk sums of the key chunks read only (the last ones, still in the window at the block's end,
        # are read by the next block as its held window), prefix by the 0/1 matrix; S_out one more row of the same GEMM
        num, den, S_out, z_out = far_forward(st["R"], N, st["last"], st["reach"], fqc, fkc, vc, S_in, z_in,
                                              non_negative=non_negative, final_state=True)  # [N, B, H, C, Dv | ·]
        if not fold:
            num.mul_(1 - gb)
            den.mul_(1 - g0)
        # local logits per lag (lag-major, each a contiguous slab) and the sinks' (transposed: [Ls, C] per chunk)
        A = q.new_empty(n_loc, N, B, H, C, C)
        for L, kk in enumerate(kks):  # softmax: the lag masks as a bias added by the matmul itself
            if softmax and part < N:
                torch.baddbmm(st["loc_bias"][L].expand(NBH - part * B * H, C, C), qc[part:].view(-1, C, D),
                              kc[kk][part:].view(-1, C, D).mT, alpha=scale, out=A[L, part:].view(-1, C, C))
            if part or not softmax:
                c1 = part if softmax else N
                torch.matmul(qc[:c1], kc[kk][:c1].mT, out=A[L, :c1]).mul_(scale)
        if Ls:
            AsT = torch.bmm(_HybridCore._per_chunk(k_sink * scale, N), qc.view(-1, C, D).mT).view(N, B, H, Ls, C)
        ties = ()
        if softmax:
            # a = exp(l − c), c the row maximum over every local key: from a softmax per lag (fast, and it never
            # takes exp(−inf)), p = softmax(l), a = p·exp(m_L − c)/max p with m_L the lag's row maximum
            if part:
                ok = st["loc_ok"]
                empty_d = ~ok.any(-1)  # [n_loc, part, B, 1, C]
                A[:, :part].masked_fill_(~(ok | empty_d[..., None]), float("-inf"))  # an empty row stays finite
            m = A.amax(-1)  # [n_loc, N, B, H, C]
            m[:, part:].masked_fill_(st["empty"][:, None, None, None, :], float("-inf"))
            if part:
                m[:, :part].masked_fill_(empty_d, float("-inf"))
            cmax = m.amax(0)
            if Ls:
                if not st["sinks_ok"]:
                    AsT.masked_fill_(~st["sok"], float("-inf"))
                cmax = torch.maximum(cmax, AsT.amax(-2))
            if part:  # (past them every query has a local key: itself)
                cmax = torch.where(torch.isfinite(cmax), cmax, 0.0)  # a row without local keys: c = 0
            p = torch.softmax(A, -1)
            if grad:  # where the max is taken (its gradient goes there): 1.0 / 0.0 in the logits' buffer
                tie = A.eq_(cmax[None, ..., None])  # (a float result: far faster than a bool one)
                eL, er = st["empty_at"]  # the few rows without local keys at some lag
                tie[eL, part:, :, :, er] = 0.0
                if part:
                    tie[:, :part].masked_fill_(empty_d[..., None], 0.0)
                ties = (tie, AsT.eq(cmax[..., None, :]).to(A.dtype)) if Ls else (tie,)
            f = (m - cmax).exp_().div_(p.amax(-1))  # [n_loc, N, B, H, C]  Σ_u a = f (0 on an empty row)
            if not grad:
                f.mul_(loc_w[..., 0])  # the factor folded in: A holds it
            A = p.mul_(f[..., None])
            den += f.sum(0) if not grad else f.sum(0).mul_(loc_w[..., 0])
            if Ls:
                AsT = (AsT - cmax[..., None, :]).exp_()
            saved = (A, AsT) if Ls else (A,)
        else:
            A[:, part:].mul_(st["loc_m"][:, None, None, None].to(A.dtype))
            if part:
                A[:, :part].masked_fill_(~st["loc_ok"], 0.0)
            if Ls:
                AsT.masked_fill_(~st["sok"], 0.0)
            saved = (A, AsT) if Ls else (A,)  # the logits, for the backward
            A = A**degree
            AsT = AsT**degree if Ls else None
            if not grad:
                A.mul_(loc_w)
            den += A.sum(-1).sum(0) if not grad else A.sum(-1).sum(0).mul_(loc_w[..., 0])
        if Ls:  # the sinks' weights times the factor (a small tensor) and their sums
            As_w = (AsT * loc_w).view(-1, Ls, C)
            den += As_w.sum(-2).view(N, B, H, C)
            num.view(-1, C, Dv).baddbmm_(As_w.mT, _HybridCore._per_chunk(v_sink, N))
        far = []  # F: the far kernel of each near-far lag, masked (kept for the backward)
        for L, kk in enumerate(kks):
            if L in st["far_lags"]:
                F = fqc @ fkc[kk].mT  # [N, B, H, C, C]
                if non_negative:
                    F.square_()
                if grad:
                    F.mul_(st["far_m"][L])
                    far.append(F)
                    W = torch.mul(A[L], loc_w) if fold else torch.mul(F, 1 - gb).addcmul_(A[L], gb)
                    if fold:
                        W += F
                    den += F.sum(-1) if fold else F.sum(-1).mul_(1 - g0)
                else:
                    F.mul_(st["far_m"][L] if fold else st["far_m"][L] * (1 - g)[:, None, None])  # (1 − g)·F
                    den += F.sum(-1)
                    W = A[L].add_(F)
            else:
                W = A[L] * loc_w if grad else A[L]
            num.view(-1, C, Dv).baddbmm_(W.view(-1, C, C), vc[kk].view(-1, C, Dv))
        # out = num / (den + ε), read chunk-major and written token-major in one pass
        e = (eps / (1 - g) if fold else torch.full_like(g, eps))[None, None, :, None]  # [1, 1, H, 1]
        out = num.new_empty(B, H, N * C, Dv)
        torch.div(num.movedim(0, 2), (den + e).movedim(0, 2)[..., None], out=out.view(B, H, N, C, Dv))
        out = out[:, :, :n]
        den = from_chunks(den, n)
        if fold:
            den = den * (1 - g)[None, :, None]  # the true denominator, [B, H, n]
        ctx.off, ctx.opts, ctx.Lw = off, opts, k_w.shape[2]
        ctx.set_materialize_grads(False)
        # q, k, v and the held window are kept as given (the caller holds them anyway): the backward copies them
        # chunk-major again rather than keeping three block-sized copies alive until then
        ctx.save_for_backward(fqc, fkc, v, v_w, q, k, k_w, k_sink, v_sink, S_in, z_in, g, key_ok, sink_ok, out, den,
                              *saved, *ties, *far)
        ctx.mark_non_differentiable(den)
        return (out, den, S_out, z_out) + windows

    @staticmethod
    @once_differentiable  # in-place work on its own buffers: no double backward
    def backward(ctx, g_out, g_den, g_S, g_z, g_fkw, g_vw, g_kw):
        off, opts = ctx.off, ctx.opts
        C, w, non_negative, scale, softmax, degree, eps, _ = opts
        fqc, fkc, v, v_w, q, k, k_w, k_sink, v_sink, S_in, z_in, g, key_ok, sink_ok, out, den, *rest = ctx.saved_tensors
        B, H, n, Dv = out.shape
        M, D, Ls, Lw = fqc.shape[-1], q.shape[-1], k_sink.shape[2], ctx.Lw
        need_g = ctx.needs_input_grad[12]  # the gate's gradient (its sums over every weight) only when asked
        st = _HybridCore._setup(B, H, n, Lw, key_ok, sink_ok, off, opts, out)
        N, Wc, kks, lead, Ne = st["N"], st["Wc"], st["kks"], st["lead"], st["Ne"]
        qc = to_chunks(q, N, C)
        vc, kc = _join_chunks((v_w, v), lead, Ne, C), _join_chunks((k_w, k), lead, Ne, C)
        gb = g[None, None, :, None, None]
        g0 = gb[..., 0]
        nA = 2 if Ls else 1
        A, AsT = rest[0], (rest[1] if Ls else None)
        if softmax:
            tie, tie_s = rest[nA], (rest[nA + 1] if Ls else None)
            far = rest[2 * nA:]
        else:
            logit, logit_s = A, AsT
            A, AsT = logit**degree, (logit_s**degree if Ls else None)
            far = rest[nA:]
        dnum, dden = normalized_grads(g_out, out, den, eps, N, C)  # [N, B, H, C, Dv], [N, B, H, C]
        # far state: (1 − g)·far, and d/dg of it per head [H] (the gate's gradient only when asked)
        need_in = ctx.needs_input_grad[10] or ctx.needs_input_grad[11]  # the incoming state's gradient when it has one
        dfq, dfk, dvc, dS_in, dz_in, dgh = far_backward(
            st["R"], N, st["last"], st["reach"], fqc, fkc, vc, S_in, z_in, dnum, dden, g_S, g_z,
            non_negative=non_negative, need_in=need_in, keep=1 - gb, need_g=need_g)
        # local and near-far lags: da = dnum·vᵀ + dden is the gradient of every weight of a (query, key)
        dA = torch.empty_like(A)  # [n_loc, N, B, H, C, C]
        for L, kk in enumerate(kks):
            torch.matmul(dnum, vc[kk].mT, out=dA[L])
        dA.add_(dden[None, ..., None])
        for L, kk in enumerate(kks):
            if L in st["far_lags"]:
                F = far[st["far_lags"].index(L)]
                if need_g:
                    dgh -= (F * dA[L]).sum(dim=(0, 1, 3, 4))
                ds = dA[L] * (st["far_m"][L] * (1 - g)[:, None, None])  # the far weights' gradient (1 − g)·da
                if non_negative:
                    ds.mul_(fqc @ fkc[kk].mT).mul_(2.0)  # d(s²) = 2s
                dfq.view(-1, C, M).baddbmm_(ds.view(-1, C, C), fkc[kk].view(-1, C, M))
                dfk[kk].view(-1, C, M).baddbmm_(ds.view(-1, C, C).mT, fqc.view(-1, C, M))
                W = torch.mul(F, 1 - gb).addcmul_(A[L], gb)
            else:
                W = A[L] * gb
            dvc[kk].view(-1, C, Dv).baddbmm_(W.view(-1, C, C).mT, dnum.view(-1, C, Dv))
        dv_sink = torch.zeros_like(v_sink)
        if Ls:  # the sinks transposed, [N, B, H, Ls, C]
            daT_s = torch.bmm(_HybridCore._per_chunk(v_sink, N), dnum.view(-1, C, Dv).mT).view(N, B, H, Ls, C)
            daT_s.add_(dden[..., None, :])
            dv_sink = torch.bmm((AsT * gb).view(-1, Ls, C), dnum.view(-1, C, Dv)).view(N, B, H, Ls, Dv).sum(0)
        # through a(logit): softmax a = exp(l − c) (c the row max: its gradient goes to where the max is
        # taken, split evenly between ties, as autograd's amax), poly a = l^p
        dl_s = None
        if softmax:
            dl = dA.mul_(A)  # a·da
            rho = dl.sum(-1).sum(0)  # [N, B, H, C]
            if Ls:
                dl_s = daT_s.mul_(AsT)
                rho += dl_s.sum(-2)
            if need_g:
                dgh += rho.sum(dim=(0, 1, 3))  # d/dg of g·Σ a v (and of g·Σ a)
            count = tie.sum(-1).sum(0)
            if Ls:
                count = count + tie_s.sum(-2)
            share = (rho * g0).neg_().div_(torch.clamp(count, min=1))  # dc / ties   [N, B, H, C]
            dl.mul_(gb).addcmul_(tie, share[None, ..., None])  # g·a·da + the share of dc at the maximum
            if Ls:
                dl_s.mul_(gb).addcmul_(tie_s, share[..., None, :])
        else:
            if need_g:
                dgh += (A * dA).sum(dim=(0, 1, 2, 4, 5))
            dl = dA.mul_(gb * degree).mul_(logit ** (degree - 1))  # g·p·l^(p−1)·da
            if Ls:
                if need_g:
                    dgh += (AsT * daT_s).sum(dim=(0, 1, 3, 4))
                dl_s = daT_s.mul_(gb * degree).mul_(logit_s ** (degree - 1))
        dqc = torch.empty_like(qc)  # the logits are s·qᵀk: dq = s·dl·k, dk = s·dlᵀq (lag 0 writes, others add)
        dkc = torch.empty_like(kc)
        dkc[:Wc].zero_()  # key chunks before the block: only lags >= 1 reach them
        # off the local keys dl is 0 already for softmax (a = 0, no tie there) and for p >= 2 (l = 0)
        unmasked = not softmax and degree < 2
        for L, kk in enumerate(kks):
            if unmasked:
                dl[L, st["part"]:].masked_fill_(~st["loc_m"][L], 0.0)
                if st["part"]:
                    dl[L, :st["part"]].masked_fill_(~st["loc_ok"][L], 0.0)
            beta = 0 if L == 0 else 1  # (beta 0: the uninitialised buffer is not read)
            torch.baddbmm(dqc.view(-1, C, D), dl[L].view(-1, C, C), kc[kk].view(-1, C, D), beta=beta, alpha=scale,
                          out=dqc.view(-1, C, D))
            torch.baddbmm(dkc[kk].view(-1, C, D), dl[L].view(-1, C, C).mT, qc.view(-1, C, D), beta=beta, alpha=scale,
                          out=dkc[kk].view(-1, C, D))
        dk_sink = torch.zeros_like(k_sink)
        if Ls:
            if unmasked:
                dl_s = dl_s.masked_fill_(~st["sok"], 0.0)
            dl_s = dl_s.view(-1, Ls, C)
            dqc.view(-1, C, D).baddbmm_(dl_s.mT, _HybridCore._per_chunk(k_sink * scale, N))
            dk_sink = torch.bmm(dl_s, qc.view(-1, C, D)).view(N, B, H, Ls, D).sum(0).mul_(scale)  # [B, H, Ls, D]
        # the held window and the block's keys: the far mask; the window outputs' gradients join the raw keys'
        if st["okc"] is not None:
            dfk[:st["bad"] + 1].mul_(st["okc"])
        grads = []
        for dx, gw in ((dfk, g_fkw), (dvc, g_vw), (dkc, g_kw)):
            if gw is not None:
                _put_rows(dx, off + n - gw.shape[2], gw, add=True)
            grads.append((_rows(dx, lead, Lw) if Lw else None, from_chunks(dx[Wc:], n)))
        (dfk_w, dfk_n), (dv_w, dv_n), (dk_w, dk_n) = grads
        return (from_chunks(dfq, n), dfk_n, dv_n, from_chunks(dqc, n), dk_n, dfk_w, dv_w, dk_w,
                dk_sink, dv_sink, dS_in, dz_in, dgh, None, None, None, None)


def hybrid_core(fq, fk, v, q, k, fk_w, v_w, k_w, k_sink, v_sink, S_in, z_in, g, key_ok, sink_ok, *, off: int,
                window: int, chunk_size: int, non_negative: bool, scale: float, local: str, degree, eps: float):
    r"""One causal block of the sliding-window hybrid, forward and backward by hand.

    The keys are ``off − L_w`` zero rows, the held window (``k_w``, ``L_w`` keys) and the block's
    ``n`` tokens, which are also the queries: query ``t`` is key ``off + t``. ``off`` is a multiple
    of ``chunk_size`` and every key more than ``off/C`` chunks before its query's chunk is padding
    (``key_ok = False``, zero features): the caller takes ``off/C >= min(⌈(w + C − 1)/C⌉,
    ⌈L_w/C⌉ + ⌈n/C⌉) − 1``. With ``a`` the local weights (``exp(s·qᵀk − c)`` over the keys
    ``0 <= lag < w`` with ``key_ok`` and the sinks, ``c`` their maximum; or ``(s·qᵀk)^p``) and ``f``
    the far kernel (keys ``lag >= w`` with ``key_ok`` through their features, and the state
    ``S_in, z_in`` of every earlier key):

    .. math:: o_t = \frac{g\sum a\,v + (1-g)\sum f\,v}{g\sum a + (1-g)\sum f + \varepsilon}.

    The near-far key chunk shares its matmul with the local one (``(g·a + (1−g)·f) @ v``); the
    softmax weights come from one ``softmax`` per key-chunk lag, rescaled to ``exp(l − c)`` (it
    never takes ``exp(−inf)``, which is slow on CPU). The backward recomputes the far states and
    the chunk-major copies of ``q, k, v`` (it keeps the features' copies, the local weights, where
    the maximum is taken, and the near-far scores).

    Parameters
    ----------
    fq : ``[B, H, n, M]``; fk : ``[B, H, n, M]``; v : ``[B, H, n, Dv]``; q, k : ``[B, H, n, D]``
        The block's tokens.
    fk_w, v_w, k_w : ``[B, H, L_w, ·]``
        The held window (``L_w <= off``), its features raw (``key_ok`` masks them here).
    k_sink, v_sink : ``[B, H, Ls, D]``, ``[B, H, Ls, Dv]``
    S_in, z_in : ``[B, H, M2, Dv]``, ``[B, H, M2]``
    g : ``[H]``, the gate ``sigmoid(gate)``
    key_ok : bool ``[B, off + n]``, a key that may be local or far; sink_ok : bool ``[B|1, 1, n, Ls]``
    off, window, chunk_size, non_negative, scale, local, degree, eps
        ``local`` is ``"softmax"`` or ``"poly"`` (degree ``p``).

    Returns
    -------
    ``(out [B, H, n, Dv], den [B, H, n] (not differentiable), S_out, z_out, fk_w', v_w', k_w')``: the
    state of every key at least ``w`` before the block's end, and the window the next block holds
    (the last ``min(w, L_w + n)`` keys, features raw).
    """
    grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad
        for x in (fq, fk, v, q, k, fk_w, v_w, k_w, k_sink, v_sink, S_in, z_in, g))
    opts = (chunk_size, window, non_negative, float(scale), local == "softmax", degree, float(eps), grad)
    return _HybridCore.apply(fq, fk, v, q, k, fk_w, v_w, k_w, k_sink, v_sink, S_in, z_in, g, key_ok, sink_ok, off,
                             opts)
