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
``C × C`` scores with a fixed mask) or wholly near (not seen here). The backward pass recomputes
the per-chunk states and scores of the block from the saved inputs (autograd keeps nothing of the
inside): ``dS`` flows backwards by the transposed prefix matrix. Its float64 twin is
:func:`sketchlab.attention.feature_attention_naive`; the gradients are tested with ``gradcheck``.
"""

from __future__ import annotations

import functools

import torch

from .reference import self_tensor

__all__ = ["chunk_core"]


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


def _chunks(x: torch.Tensor, chunks: int, C: int) -> torch.Tensor:
    """``x [B, H, L, F]`` → chunk-major ``[chunks, B, H, C, F]`` (zero-padded at the end), contiguous."""
    B, H, L, F = x.shape
    if chunks * C != L:
        x = torch.nn.functional.pad(x, (0, 0, 0, chunks * C - L))
    return x.view(B, H, chunks, C, F).permute(2, 0, 1, 3, 4).contiguous()  # [chunks, B, H, C, F]


def _unchunk(x: torch.Tensor, length: int) -> torch.Tensor:
    """Chunk-major ``[N, B, H, C, ·]`` (or ``[N, B, H, C]``) → ``[B, H, length, ·]``."""
    x = x.movedim(0, 2)  # [B, H, N, C, ·]
    return x.flatten(2, 3)[:, :, :length]


def _unlift(grad: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """Gradient through ``φ ↦ φ ⊗ φ``: ``grad [..., M²]`` → ``(G + Gᵀ) φ`` ``[..., M]``."""
    M = phi.shape[-1]
    G = grad.unflatten(-1, (M, M))  # [..., M, M]
    return (G @ phi[..., None] + G.mT @ phi[..., None])[..., 0]


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
        for L, c0, mask in lags:  # partly-far key chunks: masked C × C scores
            kk = slice(Wc + c0 - L, Wc + N - L)
            s = fqc[c0:] @ fkc[kk].mT  # [N', B, H, C, C]
            a = (s.square_() if non_negative else s).mul_(mask)
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
            ctx.save_for_backward(fq, fk, v, S_in, z_in, out, den)
            ctx.mark_non_differentiable(den)
            return out, den, S_out, z_out
        ctx.save_for_backward(fq, fk, v, S_in, z_in)
        return num, den, S_out, z_out

    @staticmethod
    def backward(ctx, g_num, g_den, g_S, g_z):
        off, lag, C, non_negative, normalize, eps = ctx.geo
        if normalize:
            fq, fk, v, S_in, z_in, out, den = ctx.saved_tensors
        else:
            fq, fk, v, S_in, z_in = ctx.saved_tensors
        B, H, n, M = fq.shape
        Dv = v.shape[-1]
        N, Wc, Ne, lags, prefix, last = _geometry(n, off, lag, C, fq.device, fq.dtype)
        fqc, fkc, vc = _chunks(fq, N, C), _chunks(fk, Ne, C), _chunks(v, Ne, C)
        lift = self_tensor if non_negative else (lambda f: f)
        lq, lk = lift(fqc), lift(fkc)
        M2 = lq.shape[-1]
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
        if non_negative:
            dfq, dfk = _unlift(dlq, fqc), _unlift(dlk, fkc)
        else:
            dfq, dfk = dlq, dlk
        for L, c0, mask in lags:
            kk = slice(Wc + c0 - L, Wc + N - L)
            s = fqc[c0:] @ fkc[kk].mT  # [N', B, H, C, C]
            a = s.square() * mask if non_negative else s * mask
            da = (dnum[c0:] @ vc[kk].mT).add_(dden[c0:, ..., None]).mul_(mask)  # [N', B, H, C, C]
            ds = da.mul_(s).mul_(2.0) if non_negative else da
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
