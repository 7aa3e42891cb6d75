r"""The chunked causal linear-attention core with a hand-written backward (layout ``[B, H, ·, ·]``).

One call handles one block of ``n`` queries against ``off + n`` keys (the ``off`` keys before
the queries, then one key per query: query ``t`` is key ``off + t``; ``off`` a multiple of the
chunk size ``C``) and a carried state ``S_in [B, H, M2, Dv]``, ``z_in [B, H, M2]`` of every key
before those. Query ``t`` sees key ``e`` through the features when it lies at least ``lag``
positions back (``lag = 0``: plain causal linear attention; ``lag = w``: the far part of the
sliding-window hybrid, the keys that left the window):

.. math:: \text{num}_t = \phi(q_t)^\top S_{in} + \sum_{e \le \text{off} + t - \text{lag}} (\phi(q_t)\cdot\phi(k_e))\, v_e,
          \qquad \text{den}_t = \phi(q_t)\cdot z_{in} + \sum_{e \le \text{off} + t - \text{lag}} \phi(q_t)\cdot\phi(k_e),

and returns the state of every key at least ``lag`` positions before the block's end,
``S_out = S_in + Σ_{e ≤ off + n − 1 − lag} φ(k_e)ᵀ v_e`` (``z_out`` alike). Padded keys, sinks
and any key the caller wants out of the far sums carry zero features. ``non_negative``: the
kernel is ``(φ(q)·φ(k))²``, the state holds ``φ ⊗ φ`` (``M2 = M²``).

Inside, tensors are chunk-major ``[chunks, B, H, C, ·]`` so that a shift by whole chunks is a
slice, never a copy. For query chunk ``c`` (key chunk ``c + off/C`` holds the same tokens) a key
chunk ``L`` chunks back is either wholly far (``L·C − (C − 1) ≥ lag``: read from the prefix of
per-chunk states, one matmul by a 0/1 prefix matrix), partly far (at most two such ``L``:
``C × C`` scores with a fixed mask) or wholly near (not seen here). The backward pass keeps the
masked ``C × C`` scores and recomputes the per-chunk states of the block from the saved inputs
(``O(T·C)`` kept, not the ``(T/C)·M·Dv`` states): ``dS`` flows backwards by the transposed
prefix matrix. Its float64 twin is
:func:`sketchlab.attention.feature_attention_naive`; the gradients are tested with ``gradcheck``.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from .reference import self_tensor

__all__ = ["chunk_core", "hybrid_core"]


@functools.lru_cache(maxsize=64)
def _geometry(n: int, off: int, lag: int, C: int, device: torch.device, dtype: torch.dtype):
    """Chunk counts, the partly-far lags with their ``[C, C]`` masks and the ``[N, Ne]`` prefix matrix."""
    N, Wc = -(-n // C), off // C
    Ne = Wc + N
    full = -(-(lag + C - 1) // C)  # first lag (in chunks) whose keys are all far
    first = max(0, -(-(lag - C + 1) // C))  # first lag with some far key
    r = torch.arange(C, device=device)[:, None]
    u = torch.arange(C, device=device)[None, :]
    lags = []
    for L in range(first, min(full, Ne)):
        c0 = max(0, L - Wc)  # the first query chunk whose key chunk exists
        if c0 < N:
            lags.append((L, c0, (L * C + r - u >= lag).to(dtype)))  # [C, C]
    c = torch.arange(N, device=device)[:, None]
    e = torch.arange(Ne, device=device)[None, :]
    prefix = (e <= Wc + c - full).to(dtype)  # [N, Ne]  key chunk e wholly far for query chunk c
    last = off + n - lag  # keys e < last enter S_out
    return N, Wc, Ne, lags, prefix, max(0, last)


def _chunks(x: torch.Tensor, chunks: int, C: int, scale: float | None = None) -> torch.Tensor:
    """``x [B, H, L, F]`` → chunk-major ``[chunks, B, H, C, F]`` (zero-padded at the end), contiguous;
    times ``scale`` in the same copy when given."""
    B, H, L, F = x.shape
    if chunks * C != L:
        x = torch.nn.functional.pad(x, (0, 0, 0, chunks * C - L))
    x = x.view(B, H, chunks, C, F).permute(2, 0, 1, 3, 4)  # [chunks, B, H, C, F]
    if scale is None:
        return x.contiguous()
    return torch.mul(x, scale, out=x.new_empty(x.shape))


def _unchunk(x: torch.Tensor, length: int) -> torch.Tensor:
    """Chunk-major ``[N, B, H, C, ·]`` (or ``[N, B, H, C]``) → ``[B, H, length, ·]``."""
    x = x.movedim(0, 2)  # [B, H, N, C, ·]
    return x.flatten(2, 3)[:, :, :length]


def _unlift(grad: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """Gradient through ``φ ↦ φ ⊗ φ``: ``grad [..., M²]`` → ``(G + Gᵀ) φ`` ``[..., M]``."""
    M = phi.shape[-1]
    G = grad.unflatten(-1, (M, M))  # [..., M, M]
    return (G @ phi[..., None] + G.mT @ phi[..., None])[..., 0]


def _far_state_grads(prefix, dP, dzP, lk, vc, g_S, g_z, last: int):
    r"""The backward of the far state shared by both cores: gradients of the incoming state and of the key
    chunks' features and values.

    The forward read ``P_c = Σ_e prefix[c, e]·upd_e + S_in`` (``upd_e = lk_eᵀ v_e``, likewise ``z``) and, with
    ``output_final_state``, returned ``S_out = S_in + Σ_{j < last} lk_jᵀ v_j``: so ``dupd = prefixᵀ·dP`` (+ ``g_S``
    on the ``last // C`` whole chunks and on the first ``last % C`` keys of the next), ``dlk = v·dupdᵀ + dzc``,
    ``dv = lk·dupd``.

    Shapes: ``prefix [N, Ne]``, ``dP [N, B, H, M2, Dv]``, ``dzP [N, B, H, M2]``, ``lk [Ne, B, H, C, M2]``,
    ``vc [Ne, B, H, C, Dv]``, ``g_S [B, H, M2, Dv]`` / ``g_z [B, H, M2]`` or ``None``; ``last`` the keys that entered
    the state. Returns ``dS_in, dz_in, dlk [Ne, B, H, C, M2], dvc [Ne, B, H, C, Dv]``.
    """
    Ne, B, H, C, M2 = lk.shape
    Dv = vc.shape[-1]
    dupd = (prefix.T @ dP.flatten(1)).view(Ne, B, H, M2, Dv)  # Σ over the query chunks that read key chunk e
    dzc = (prefix.T @ dzP.flatten(1)).view(Ne, B, H, M2)
    dS_in, dz_in = dP.sum(0), dzP.sum(0)
    full, rem = divmod(last, C)
    if g_S is not None:
        dS_in = dS_in + g_S
        dupd[:full] += g_S
    if g_z is not None:
        dz_in = dz_in + g_z
        dzc[:full] += g_z
    dlk = vc @ dupd.mT + dzc[..., None, :]  # [Ne, B, H, C, M2]
    dvc = lk @ dupd  # [Ne, B, H, C, Dv]
    if rem and g_S is not None:
        dlk[full, :, :, :rem] += vc[full, :, :, :rem] @ g_S.mT
        dvc[full, :, :, :rem] += lk[full, :, :, :rem] @ g_S
    if rem and g_z is not None:
        dlk[full, :, :, :rem] += g_z[:, :, None, :]
    return dS_in, dz_in, dlk, dvc


class _Core(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fq, fk, v, S_in, z_in, off, lag, C, non_negative, normalize, eps):
        B, H, n, _ = fq.shape
        N, Wc, Ne, lags, prefix, last = _geometry(n, off, lag, C, fq.device, fq.dtype)
        fqc, fkc, vc = _chunks(fq, N, C), _chunks(fk, Ne, C), _chunks(v, Ne, C)
        lift = self_tensor if non_negative else (lambda f: f)
        lq, lk = lift(fqc), lift(fkc)  # [N|Ne, B, H, C, M2]
        upd = lk.mT @ vc  # [Ne, B, H, M2, Dv]  per-chunk Σ φ(k)ᵀ v
        zc = lk.sum(3)  # [Ne, B, H, M2]
        P = (prefix @ upd.flatten(1)).view(N, *upd.shape[1:]) + S_in  # [N, B, H, M2, Dv]  the far state per chunk
        zP = (prefix @ zc.flatten(1)).view(N, *zc.shape[1:]) + z_in  # [N, B, H, M2]
        num = lq @ P  # [N, B, H, C, Dv]
        den = (lq @ zP[..., None])[..., 0]  # [N, B, H, C]
        Dv = v.shape[-1]
        kept = []  # the masked scores, for the backward
        for L, c0, mask in lags:  # partly-far key chunks: masked C × C scores
            kk = slice(Wc + c0 - L, Wc + N - L)
            s = fqc[c0:] @ fkc[kk].mT  # [N', B, H, C, C]
            a = (s.square_() if non_negative else s).mul_(mask)
            kept.append(a)
            num[c0:].view(-1, C, Dv).baddbmm_(a.view(-1, C, C), vc[kk].view(-1, C, Dv))
            den[c0:] += a.sum(-1)
        full, rem = divmod(last, C)  # S_out: key chunks < full, and `rem` keys of chunk `full`
        S_out, z_out = S_in + upd[:full].sum(0), z_in + zc[:full].sum(0)
        if rem:
            S_out = S_out + lk[full, :, :, :rem].mT @ vc[full, :, :, :rem]
            z_out = z_out + lk[full, :, :, :rem].sum(2)
        num, den = _unchunk(num, n), _unchunk(den, n)  # [B, H, n, Dv], [B, H, n]
        ctx.geo = (off, lag, C, non_negative, normalize, eps)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (skipped below)
        if normalize:
            out = num / (den[..., None] + eps)
            ctx.save_for_backward(fq, fk, v, S_in, z_in, out, den, *kept)
            ctx.mark_non_differentiable(den)
            return out, den, S_out, z_out
        ctx.save_for_backward(fq, fk, v, S_in, z_in, *kept)
        return num, den, S_out, z_out

    @staticmethod
    @once_differentiable  # in-place work on its own buffers: no double backward
    def backward(ctx, g_num, g_den, g_S, g_z):
        off, lag, C, non_negative, normalize, eps = ctx.geo
        if normalize:
            fq, fk, v, S_in, z_in, out, den, *kept = ctx.saved_tensors
        else:
            fq, fk, v, S_in, z_in, *kept = ctx.saved_tensors
        B, H, n, M = fq.shape
        Dv = v.shape[-1]
        N, Wc, Ne, lags, prefix, last = _geometry(n, off, lag, C, fq.device, fq.dtype)
        fqc, fkc, vc = _chunks(fq, N, C), _chunks(fk, Ne, C), _chunks(v, Ne, C)
        lift = self_tensor if non_negative else (lambda f: f)
        lq, lk = lift(fqc), lift(fkc)
        zero_q = fq.new_zeros(B, H, n, Dv)
        if normalize:  # out = num / (den + eps)
            r = 1.0 / (den + eps)  # [B, H, n]
            g_out = zero_q if g_num is None else g_num
            dnum = g_out * r[..., None]
            dden = -(g_out * out).sum(-1) * r
        else:
            dnum = zero_q if g_num is None else g_num
            dden = fq.new_zeros(B, H, n) if g_den is None else g_den
        dnum = _chunks(dnum, N, C)  # [N, B, H, C, Dv]
        dden = _chunks(dden[..., None], N, C)[..., 0]  # [N, B, H, C]
        upd = lk.mT @ vc  # recomputed: [Ne, B, H, M2, Dv]
        zc = lk.sum(3)
        P = (prefix @ upd.flatten(1)).view(N, *upd.shape[1:]) + S_in
        zP = (prefix @ zc.flatten(1)).view(N, *zc.shape[1:]) + z_in
        dP = lq.mT @ dnum  # [N, B, H, M2, Dv]
        dzP = (lq.mT @ dden[..., None])[..., 0]  # [N, B, H, M2]
        dlq = dnum @ P.mT + dden[..., None] * zP[..., None, :]  # [N, B, H, C, M2]
        dS_in, dz_in, dlk, dvc = _far_state_grads(prefix, dP, dzP, lk, vc, g_S, g_z, last)
        if non_negative:
            dfq, dfk = _unlift(dlq, fqc), _unlift(dlk, fkc)
        else:
            dfq, dfk = dlq, dlk
        for (L, c0, mask), a in zip(lags, kept):
            kk = slice(Wc + c0 - L, Wc + N - L)
            da = (dnum[c0:] @ vc[kk].mT).add_(dden[c0:, ..., None]).mul_(mask)  # [N', B, H, C, C]
            ds = da.mul_(fqc[c0:] @ fkc[kk].mT).mul_(2.0) if non_negative else da  # d(s²) = 2s
            dfq[c0:] += ds @ fkc[kk]
            dfk[kk] += ds.mT @ fqc[c0:]
            dvc[kk] += a.mT @ dnum[c0:]
        L_k = fk.shape[2]
        return (_unchunk(dfq, n), _unchunk(dfk, L_k), _unchunk(dvc, L_k), dS_in, dz_in,
                None, None, None, None, None, None)


def chunk_core(fq, fk, v, S_in, z_in, *, off: int, lag: int, chunk_size: int, non_negative: bool,
               normalize: bool, eps: float):
    r"""The causal chunked core of one block (see the module docstring for the formula).

    Parameters
    ----------
    fq : Tensor ``[B, H, n, M]``
        Query features.
    fk : Tensor ``[B, H, off + n, M]``
        Key features (zero for keys outside the far sums); key ``off + t`` is query ``t``'s token.
    v : Tensor ``[B, H, off + n, Dv]``
    S_in, z_in : Tensor ``[B, H, M2, Dv]``, ``[B, H, M2]``
        The far state of every key before ``fk``'s first.
    off : int
        Keys before the first query, a multiple of ``chunk_size``.
    lag : int >= 0
        Query ``t`` reads key ``e`` when ``e <= off + t - lag``.
    chunk_size : int
    non_negative : bool
        Kernel ``(φ(q)·φ(k))²`` (state of ``φ ⊗ φ``).
    normalize : bool
        Return ``num / (den + eps)`` in place of ``num``.
    eps : float

    Returns
    -------
    ``(num or out [B, H, n, Dv], den [B, H, n], S_out [B, H, M2, Dv], z_out [B, H, M2])``; ``den`` is
    not differentiable when ``normalize``.
    """
    if off % chunk_size:
        raise ValueError(f"off={off} must be a multiple of chunk_size={chunk_size}")
    if fk.shape[2] != off + fq.shape[2] or v.shape[2] != fk.shape[2]:
        raise ValueError(f"fk and v must hold off + n = {off + fq.shape[2]} keys, got {fk.shape[2]} and {v.shape[2]}")
    return _Core.apply(fq, fk, v, S_in, z_in, off, lag, chunk_size, non_negative, normalize, eps)


@functools.lru_cache(maxsize=64)
def _hybrid_masks(C: int, window: int, lags: int, device: torch.device, dtype: torch.dtype):
    """Per key-chunk lag ``L < lags``: ``local [lags, C, C]`` bool (``0 <= L·C + r − u < w``), the
    same as an additive ``0 / −inf`` bias in ``dtype``, and ``far [lags, C, C]`` in ``dtype``
    (``L·C + r − u >= w``), query ``r``, key ``u``."""
    r = torch.arange(C, device=device)[None, :, None]
    L = torch.arange(lags, device=device)[:, None, None]
    u = torch.arange(C, device=device)[None, None, :]
    lag = L * C + r - u  # [lags, C, C]
    local = (lag >= 0) & (lag < window)
    bias = torch.zeros(local.shape, dtype=dtype, device=device).masked_fill_(~local, float("-inf"))
    return local, bias, (lag >= window).to(dtype)


class _HybridCore(torch.autograd.Function):
    """Forward and backward of one causal hybrid block, chunk-major inside (see :func:`hybrid_core`)."""

    @staticmethod
    def _setup(fq, fk, v, q, k, key_ok, sink_ok, off, opts):
        C, w, non_negative = opts[:3]
        n = fq.shape[2]
        N, Wc, Ne, _, prefix, _ = _geometry(n, off, w, C, fq.device, fq.dtype)  # prefix [N, Ne]: wholly far chunks
        n_loc = min(-(-(w + C - 1) // C), Wc + 1)  # key chunks back with a local key (further: padding)
        lift = self_tensor if non_negative else (lambda f: f)
        fqc, fkc, vc = _chunks(fq, N, C), _chunks(fk, Ne, C), _chunks(v, Ne, C)
        qc, kc = _chunks(q, N, C, opts[3]), _chunks(k, Ne, C)  # q scaled by s
        loc_m, loc_bias, far_m = _hybrid_masks(C, w, n_loc, fq.device, fq.dtype)
        kks = [slice(Wc - L, Wc - L + N) for L in range(n_loc)]
        all_ok = bool(key_ok.all())
        if all_ok:  # every key real (no padding, sink or front zeros): the lag masks alone
            loc_ok = loc_m[:, None, None, None]  # [n_loc, 1, 1, 1, C, C]
        else:
            okc = _chunks(key_ok[:, None, :, None], Ne, C)[:, :, 0, :, 0]  # [Ne, B, C]
            loc_ok = torch.stack([okc[kk] for kk in kks])[:, :, :, None, None, :] & loc_m[:, None, None, None]
        # [n_loc, N, B, 1, C, C]; the far lags are those with a far key, L·C + C − 1 >= w
        far_lags = [L for L in range(n_loc) if L * C + C - 1 >= w]
        sok = _chunks(sink_ok.expand(fq.shape[0], 1, n, -1), N, C)  # [N, B, 1, C, Ls]
        return dict(N=N, Wc=Wc, Ne=Ne, n_loc=n_loc, lift=lift, fqc=fqc, fkc=fkc, vc=vc, qc=qc, kc=kc, kks=kks,
                    loc_ok=loc_ok, all_ok=all_ok, loc_bias=loc_bias, far_m=far_m, far_lags=far_lags, prefix=prefix, sok=sok)

    @staticmethod
    def forward(ctx, fq, fk, v, q, k, k_sink, v_sink, S_in, z_in, g, key_ok, sink_ok, off, opts):
        C, w, non_negative, scale, softmax, degree, eps, _ = opts
        B, H, n, _ = fq.shape
        Dv = v.shape[-1]
        st = _HybridCore._setup(fq, fk, v, q, k, key_ok, sink_ok, off, opts)
        N, n_loc, kks = st["N"], st["n_loc"], st["kks"]
        qc, kc, vc, fqc, fkc = st["qc"], st["kc"], st["vc"], st["fqc"], st["fkc"]
        lq, lk = st["lift"](fqc), st["lift"](fkc)
        gb = g[None, None, :, None, None]  # [1, 1, H, 1, 1]
        # far state: per-chunk sums, prefix by the 0/1 matrix
        upd, zc = lk.mT @ vc, lk.sum(3)  # [Ne, B, H, M2, Dv], [Ne, B, H, M2]
        P = (st["prefix"] @ upd.flatten(1)).view(N, *upd.shape[1:]) + S_in
        zP = (st["prefix"] @ zc.flatten(1)).view(N, *zc.shape[1:]) + z_in
        num = (lq @ P).mul_(1 - gb)  # [N, B, H, C, Dv]
        den = (lq @ zP[..., None])[..., 0].mul_(1 - gb[..., 0])  # [N, B, H, C]
        # local logits per lag (lag-major, each a contiguous slab) and the sinks'
        A = q.new_empty(n_loc, N, B, H, C, C)
        bias = softmax and st["all_ok"]  # the lag masks as a −inf bias added by the matmul itself
        D = q.shape[-1]
        for L, kk in enumerate(kks):
            if bias:
                torch.baddbmm(st["loc_bias"][L].expand(N * B * H, C, C), qc.view(-1, C, D),
                              kc[kk].reshape(-1, C, D).mT, out=A[L].view(-1, C, C))
            else:
                torch.matmul(qc, kc[kk].mT, out=A[L])
        Ls = k_sink.shape[2]
        As = qc @ k_sink[None].mT  # [N, B, H, C, Ls]  (qc holds s·q)
        if softmax:
            if not bias:
                A.masked_fill_(~st["loc_ok"], float("-inf"))
            As.masked_fill_(~st["sok"], float("-inf"))
            cmax = As.amax(-1) if Ls else None  # [N, B, H, C]
            for L in range(n_loc):  # lag by lag: contiguous reductions
                cmax = A[L].amax(-1) if cmax is None else torch.maximum(cmax, A[L].amax(-1))
            cmax = torch.where(torch.isfinite(cmax), cmax, 0.0)  # a row without local keys: c = 0
            # where the max is taken (its gradient goes there), only when a backward will run
            ties = (A == cmax[None, ..., None], As == cmax[..., None]) if opts[7] else ()
            A.sub_(cmax[None, ..., None]).exp_()
            As.sub_(cmax[..., None]).exp_()
            saved = (A, As)
        else:
            saved = (A.masked_fill_(~st["loc_ok"], 0.0), As.masked_fill_(~st["sok"], 0.0))  # logits, for the backward
            A, As = A**degree, As**degree
            ties = ()
        if Ls:
            den += As.sum(-1).mul_(gb[..., 0])
            num += (As @ v_sink[None]).mul_(gb)
        far = []  # F: the far kernel of each near-far lag, masked (kept for the backward)
        for L, kk in enumerate(kks):
            if L in st["far_lags"]:
                F = fqc @ fkc[kk].mT  # [N, B, H, C, C]
                F = (F.square_() if non_negative else F).mul_(st["far_m"][L])
                far.append(F)
                W = torch.addcmul(F * (1 - gb), A[L], gb)  # g·a + (1 − g)·F
            else:
                W = A[L] * gb
            den += W.sum(-1)
            num.view(-1, C, Dv).baddbmm_(W.view(-1, C, C), vc[kk].view(-1, C, Dv))
        full, rem = divmod(max(0, off + n - w), C)
        S_out, z_out = S_in + upd[:full].sum(0), z_in + zc[:full].sum(0)
        if rem:
            S_out = S_out + lk[full, :, :, :rem].mT @ vc[full, :, :, :rem]
            z_out = z_out + lk[full, :, :, :rem].sum(2)
        num, den = _unchunk(num, n), _unchunk(den, n)
        out = num / (den[..., None] + eps)
        ctx.off, ctx.opts = off, opts
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(fq, fk, v, q, k, k_sink, v_sink, S_in, z_in, g, key_ok, sink_ok, out, den,
                              *saved, *ties, *far)
        ctx.mark_non_differentiable(den)
        return out, den, S_out, z_out

    @staticmethod
    @once_differentiable  # in-place work on its own buffers: no double backward
    def backward(ctx, g_out, g_den, g_S, g_z):
        off, opts = ctx.off, ctx.opts
        C, w, non_negative, scale, softmax, degree, eps, _ = opts
        fq, fk, v, q, k, k_sink, v_sink, S_in, z_in, g, key_ok, sink_ok, out, den, *rest = ctx.saved_tensors
        B, H, n, M = fq.shape
        Dv = v.shape[-1]
        st = _HybridCore._setup(fq, fk, v, q, k, key_ok, sink_ok, off, opts)
        N, n_loc, kks = st["N"], st["n_loc"], st["kks"]
        qc, kc, vc, fqc, fkc = st["qc"], st["kc"], st["vc"], st["fqc"], st["fkc"]
        lq, lk = st["lift"](fqc), st["lift"](fkc)
        gb = g[None, None, :, None, None]
        if softmax:
            (A, As, tie, tie_s), far = rest[:4], rest[4:]
        else:
            (logit, logit_s), far = rest[:2], rest[2:]
            A, As = logit**degree, logit_s**degree
        r = 1.0 / (den + eps)  # [B, H, n]
        g_out = fq.new_zeros(B, H, n, Dv) if g_out is None else g_out
        dnum = _chunks(g_out * r[..., None], N, C)  # [N, B, H, C, Dv]
        dden = _chunks((-(g_out * out).sum(-1) * r)[..., None], N, C)[..., 0]  # [N, B, H, C]
        # far state
        upd, zc = lk.mT @ vc, lk.sum(3)
        P = (st["prefix"] @ upd.flatten(1)).view(N, *upd.shape[1:]) + S_in
        zP = (st["prefix"] @ zc.flatten(1)).view(N, *zc.shape[1:]) + z_in
        dP0 = lq.mT @ dnum  # [N, B, H, M2, Dv]   (before the factor 1 − g)
        dzP0 = (lq.mT @ dden[..., None])[..., 0]  # [N, B, H, M2]
        dgh = -((dP0 * P).sum(dim=(0, 1, 3, 4)) + (dzP0 * zP).sum(dim=(0, 1, 3)))  # [H]  d/dg of (1 − g)·far
        dP, dzP = dP0.mul_(1 - gb), dzP0.mul_(1 - gb[..., 0])
        dlq = (dnum @ P.mT + dden[..., None] * zP[..., None, :]).mul_(1 - gb)  # [N, B, H, C, M2]
        dS_in, dz_in, dlk, dvc = _far_state_grads(st["prefix"], dP, dzP, lk, vc, g_S, g_z, max(0, off + n - w))
        dfq, dfk = (_unlift(dlq, fqc), _unlift(dlk, fkc)) if non_negative else (dlq, dlk)
        # local and near-far lags: da = dnum·vᵀ + dden is the gradient of every weight of a (query, key)
        dA = []
        for L, kk in enumerate(kks):
            da = (dnum @ vc[kk].mT).add_(dden[..., None])  # [N, B, H, C, C]
            if L in st["far_lags"]:
                F = far[st["far_lags"].index(L)]
                W = torch.addcmul(F * (1 - gb), A[L], gb)
                dgh -= (F * da).sum(dim=(0, 1, 3, 4))
                ds = (da * st["far_m"][L]).mul_(1 - gb)
                if non_negative:
                    ds.mul_(fqc @ fkc[kk].mT).mul_(2.0)  # d(s²) = 2s
                dfq += ds @ fkc[kk]
                dfk[kk] += ds.mT @ fqc
            else:
                W = A[L] * gb
            dvc[kk] += W.mT @ dnum
            dA.append(da)  # the local weights' gradient is g·da
        Ls = k_sink.shape[2]
        dv_sink = torch.zeros_like(v_sink)
        da_s = None
        if Ls:
            da_s = (dnum @ v_sink[None].mT).add_(dden[..., None])  # [N, B, H, C, Ls]
            dv_sink = ((As * gb).mT @ dnum).sum(0)  # [B, H, Ls, Dv]
        # through a(logit): softmax a = exp(l − c) (c the row max: its gradient goes to where the max is
        # taken, split evenly between ties, as autograd's amax), poly a = l^p
        dl = [A[L] * dA[L] for L in range(n_loc)] + ([As * da_s] if Ls else [])  # a·da, then g·a·da
        for x in dl:
            dgh += x.sum(dim=(0, 1, 3, 4))  # d/dg of g·Σ a v (and of g·Σ a)
        if softmax:
            dl = [x.mul_(gb) for x in dl]
            dl, dl_s = dl[:n_loc], (dl[n_loc] if Ls else None)
            dc = -sum(x.sum(-1) for x in dl)  # [N, B, H, C]
            count = sum(t.sum(-1) for t in tie[:n_loc]) if n_loc else 0
            if Ls:
                dc = dc - dl_s.sum(-1)
                count = count + tie_s.sum(-1)
            share = dc / torch.clamp(count, min=1)  # [N, B, H, C]
            for L in range(n_loc):
                dl[L] += tie[L] * share[..., None]
            if Ls:
                dl_s += tie_s * share[..., None]
        else:
            dl = [dA[L].mul_(gb * degree) * logit[L] ** (degree - 1) for L in range(n_loc)]
            dl_s = da_s.mul_(gb * degree) * logit_s ** (degree - 1) if Ls else None
        dqc = torch.zeros_like(qc)  # gradient w.r.t. the scaled q
        dkc = torch.zeros_like(kc)
        # off the local keys dl is 0 already for softmax (a = 0, no tie there) and for p >= 2 (l = 0)
        unmasked = not softmax and degree < 2
        for L, kk in enumerate(kks):
            if unmasked:
                dl[L] = dl[L].masked_fill_(~st["loc_ok"][L], 0.0)
            dqc += dl[L] @ kc[kk]
            dkc[kk] += dl[L].mT @ qc
        dk_sink = torch.zeros_like(k_sink)
        if Ls:
            if unmasked:
                dl_s = dl_s.masked_fill_(~st["sok"], 0.0)
            dqc += dl_s @ k_sink[None]
            dk_sink = (dl_s.mT @ qc).sum(0)  # [B, H, Ls, D]
        Lk = fk.shape[2]
        return (_unchunk(dfq, n), _unchunk(dfk, Lk), _unchunk(dvc, Lk), _unchunk(dqc, n) * scale, _unchunk(dkc, Lk),
                dk_sink, dv_sink, dS_in, dz_in, dgh, None, None, None, None)


def hybrid_core(fq, fk, v, q, k, k_sink, v_sink, S_in, z_in, g, key_ok, sink_ok, *, off: int, window: int,
                chunk_size: int, non_negative: bool, scale: float, local: str, degree, eps: float):
    r"""One causal block of the sliding-window hybrid, forward and backward by hand.

    Queries ``t = 0 … n−1`` are keys ``off + t`` of ``k``/``fk``/``v``; ``off`` is a multiple of
    ``chunk_size`` and every key more than ``off/C`` chunks before its query's chunk is padding
    (``key_ok = False``, zero features): the caller takes ``off/C >= min(⌈(w + C − 1)/C⌉,
    ⌈L_w/C⌉ + ⌈n/C⌉) − 1`` with ``L_w`` the held window. With ``a`` the local
    weights (``exp(s·qᵀk − c)`` over the keys ``0 <= lag < w`` with ``key_ok`` and the sinks,
    ``c`` their maximum; or ``(s·qᵀk)^p``) and ``f`` the far kernel (keys ``lag >= w`` through
    ``fk``, and the state ``S_in, z_in`` of every earlier key):

    .. math:: o_t = \frac{g\sum a\,v + (1-g)\sum f\,v}{g\sum a + (1-g)\sum f + \varepsilon}.

    The near-far key chunk shares its matmul with the local one (``(g·a + (1−g)·f) @ v``); the
    backward recomputes the far states and keeps the local weights and the near-far scores.

    Parameters
    ----------
    fq : ``[B, H, n, M]``; fk : ``[B, H, off + n, M]`` (zero off the far keys); v : ``[B, H, off + n, Dv]``
    q : ``[B, H, n, D]``; k : ``[B, H, off + n, D]``
    k_sink, v_sink : ``[B, H, Ls, D]``, ``[B, H, Ls, Dv]``
    S_in, z_in : ``[B, H, M2, Dv]``, ``[B, H, M2]``
    g : ``[H]``, the gate ``sigmoid(gate)``
    key_ok : bool ``[B, off + n]``, a key that may be local; sink_ok : bool ``[B|1, 1, n, Ls]``
    off, window, chunk_size, non_negative, scale, local, degree, eps
        ``local`` is ``"softmax"`` or ``"poly"`` (degree ``p``).

    Returns
    -------
    ``(out [B, H, n, Dv], den [B, H, n] (not differentiable), S_out, z_out)``, the state of every
    key at least ``w`` before the block's end.
    """
    grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (fq, fk, v, q, k, k_sink, v_sink, S_in, z_in, g))
    opts = (chunk_size, window, non_negative, float(scale), local == "softmax", degree, float(eps), grad)
    return _HybridCore.apply(fq, fk, v, q, k, k_sink, v_sink, S_in, z_in, g, key_ok, sink_ok, off, opts)
