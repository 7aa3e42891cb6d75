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
``S_out = S_in + Σ_{e ≤ off + n − 1 − lag} φ(k_e)ᵀ v_e`` (``z_out`` alike; a caller that reads none skips it, and
``S_in = None`` is a zero state). Padded keys, sinks
and any key the caller wants out of the far sums carry zero features. ``non_negative``: the
kernel is ``(φ(q)·φ(k))²``, the state holds ``φ ⊗ φ`` (``M2 = M²``).

The far state (the prefix GEMM of the wholly far key chunks, recomputed in the backward) is
:mod:`.chunk_state`'s; here are the partly-far key chunks (``C × C`` scores with a fixed mask, kept for the
backward). Its float64 twin is :func:`sketchlab.attention.reference.feature_attention_naive`; the gradients are tested with
``gradcheck``.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .chunk_state import _chunks, _far_backward, _far_forward, _geometry, _normalized_grads, _unchunk

__all__ = ["chunk_core"]


class _Core(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fq, fk, v, S_in, z_in, off, lag, C, non_negative, normalize, eps, final_state):
        B, H, n, _ = fq.shape
        N, Wc, Ne, lags, R, last, reach = _geometry(n, off, lag, C, fq.device, fq.dtype)
        fqc, fkc, vc = _chunks(fq, N, C), _chunks(fk, Ne, C), _chunks(v, Ne, C)
        # S_out, z_out: one more row of the far states' GEMM (not formed when the caller reads no final state)
        num, den, S_out, z_out = _far_forward(R, N, last, reach, fqc, fkc, vc, S_in, z_in, non_negative=non_negative,
                                              final_state=final_state)  # [N, B, H, C, Dv], [N, B, H, C]
        Dv = v.shape[-1]
        kept = []  # the masked scores, for the backward
        for L, c0, mask in lags:  # partly-far key chunks: masked C × C scores
            kk = slice(Wc + c0 - L, Wc + N - L)
            s = fqc[c0:] @ fkc[kk].mT  # [N', B, H, C, C]
            a = (s.square_() if non_negative else s).mul_(mask)
            kept.append(a)
            num[c0:].view(-1, C, Dv).baddbmm_(a.view(-1, C, C), vc[kk].view(-1, C, Dv))
            den[c0:] += a.sum(-1)
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
        n = fq.shape[2]
        N, Wc, Ne, lags, R, last, reach = _geometry(n, off, lag, C, fq.device, fq.dtype)
        fqc, fkc, vc = _chunks(fq, N, C), _chunks(fk, Ne, C), _chunks(v, Ne, C)
        if normalize:  # out = num / (den + eps)
            dnum, dden = _normalized_grads(g_num, out, den, eps, N, C)  # [N, B, H, C, Dv], [N, B, H, C]
        else:
            dnum = _chunks(fq.new_zeros(*fq.shape[:3], v.shape[-1]) if g_num is None else g_num, N, C)
            dden = _chunks((fq.new_zeros(fq.shape[:3]) if g_den is None else g_den)[..., None], N, C)[..., 0]
        # the incoming state's gradient only when it has one (S_in None: a zero state, not a tensor)
        need_in = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        dfq, dfk, dvc, dS_in, dz_in, _ = _far_backward(R, N, last, reach, fqc, fkc, vc, S_in, z_in, dnum, dden, g_S,
                                                       g_z, non_negative=non_negative, need_in=need_in)
        for (L, c0, mask), a in zip(lags, kept):
            kk = slice(Wc + c0 - L, Wc + N - L)
            da = (dnum[c0:] @ vc[kk].mT).add_(dden[c0:, ..., None]).mul_(mask)  # [N', B, H, C, C]
            ds = da.mul_(fqc[c0:] @ fkc[kk].mT).mul_(2.0) if non_negative else da  # d(s²) = 2s
            dfq[c0:] += ds @ fkc[kk]
            dfk[kk] += ds.mT @ fqc[c0:]
            dvc[kk] += a.mT @ dnum[c0:]
        L_k = fk.shape[2]
        return (_unchunk(dfq, n), _unchunk(dfk, L_k), _unchunk(dvc, L_k), dS_in, dz_in,
                None, None, None, None, None, None, None)


def _check_core_args(fq, fk, v, S_in, z_in, *, off, lag, chunk_size, non_negative, final_state) -> None:
    """``chunk_core``'s arguments: ranks, the shared ``B, H``, the feature and value widths, the state's shapes (or both
    ``None``), one dtype and device, the offsets and the flag (shape arithmetic only: nothing is read from the
    tensors)."""
    if (S_in is None) != (z_in is None):
        raise ValueError(f"S_in and z_in must both be tensors or both None (a zero state), got S_in "
                         f"{type(S_in).__name__} and z_in {type(z_in).__name__}")
    if not isinstance(final_state, bool):
        raise ValueError(f"final_state must be a bool, got {final_state!r}")
    state = (("S_in", S_in, 4), ("z_in", z_in, 3)) if S_in is not None else ()
    for name, x, rank in (("fq", fq, 4), ("fk", fk, 4), ("v", v, 4), *state):
        if not isinstance(x, torch.Tensor) or x.ndim != rank:
            got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a {rank}-D tensor, got {got}")
        if not x.is_floating_point() or x.dtype != fq.dtype or x.device != fq.device:
            raise ValueError(f"{name} must be a floating tensor of fq's dtype and device ({fq.dtype}, {fq.device}), "
                             f"got {x.dtype} on {x.device}")
    for name, value, low in (("chunk_size", chunk_size, 1), ("off", off, 0), ("lag", lag, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if off % chunk_size:
        raise ValueError(f"off={off} must be a multiple of chunk_size={chunk_size}")
    B, H, n, M = fq.shape
    Dv = v.shape[-1]
    M2 = M * M if non_negative else M
    want = {"fk": (B, H, off + n, M), "v": (B, H, off + n, Dv), "S_in": (B, H, M2, Dv), "z_in": (B, H, M2)}
    for name, x in (("fk", fk), ("v", v), *((("S_in", S_in), ("z_in", z_in)) if S_in is not None else ())):
        if tuple(x.shape) != want[name]:
            raise ValueError(f"{name} must be {list(want[name])} (fq [B, H, n, M] = {list(fq.shape)}, off={off}, "
                             f"Dv={Dv}, M2={M2}{' = M²' if non_negative else ''}), got {list(x.shape)}")


def chunk_core(fq, fk, v, S_in, z_in, *, off: int, lag: int, chunk_size: int, non_negative: bool,
               normalize: bool, eps: float, final_state: bool = True):
    r"""The causal chunked core of one block (see the module docstring for the formula).

    Parameters
    ----------
    fq : Tensor ``[B, H, n, M]``
        Query features.
    fk : Tensor ``[B, H, off + n, M]``
        Key features (zero for keys outside the far sums); key ``off + t`` is query ``t``'s token.
    v : Tensor ``[B, H, off + n, Dv]``
    S_in, z_in : Tensor ``[B, H, M2, Dv]``, ``[B, H, M2]``, or both None
        The far state of every key before ``fk``'s first (``None``: zero, neither allocated nor added).
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
    final_state : bool
        Form ``S_out, z_out`` (``False``: a caller that reads no final state; they are ``None`` and the key chunks
        only ``S_out`` would read get no per-chunk update).

    Returns
    -------
    ``(num or out [B, H, n, Dv], den [B, H, n], S_out [B, H, M2, Dv], z_out [B, H, M2])``; ``den`` is
    not differentiable when ``normalize``; ``S_out, z_out`` are ``None`` unless ``final_state``.

    Raises
    ------
    ValueError
        A tensor of the wrong rank, dtype or device, shapes that disagree (``fk``, ``v`` must hold ``off + n``
        keys; ``S_in [B, H, M2, Dv]``, ``z_in [B, H, M2]`` with ``M2 = M²`` when ``non_negative``; one of them
        ``None`` without the other), ``off`` not a multiple of ``chunk_size``, a negative ``off`` / ``lag`` /
        non-positive ``chunk_size``, or a ``final_state`` that is not a bool.
    """
    _check_core_args(fq, fk, v, S_in, z_in, off=off, lag=lag, chunk_size=chunk_size, non_negative=non_negative,
                     final_state=final_state)
    return _Core.apply(fq, fk, v, S_in, z_in, off, lag, chunk_size, non_negative, normalize, eps, final_state)
