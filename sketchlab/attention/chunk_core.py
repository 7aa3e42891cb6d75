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

Inside, tensors are chunk-major ``[chunks, B, H, C, ·]`` so that a shift by whole chunks is a
slice, never a copy. For query chunk ``c`` (key chunk ``c + off/C`` holds the same tokens) a key
chunk ``L`` chunks back is either wholly far (``L·C − (C − 1) ≥ lag``: read from the prefix of
per-chunk states, one matmul by a 0/1 prefix matrix, which has a column of ones for ``S_in`` and
a last row that sums the key chunks wholly in ``S_out``), partly far (at most two such ``L``:
``C × C`` scores with a fixed mask) or wholly near (not seen here). The backward pass keeps the
masked ``C × C`` scores and recomputes the per-chunk states of the block from the saved inputs
(``O(T·C)`` kept, not the ``(T/C)·M·Dv`` states): ``dS`` (and ``dS_out``) flows backwards by the
transposed prefix matrix. Its float64 twin is
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
    """Chunk counts, the partly-far lags with their ``[C, C]`` masks, the far matrix ``R [N + 1, 1 + Ne]`` (see
    :func:`_far_state`), the keys that enter ``S_out`` and ``reach``: the query chunks' rows of ``R`` read key chunks
    ``< reach`` only (their other key columns are zero)."""
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
    last = max(0, off + n - lag)  # keys e < last enter S_out
    c = torch.arange(N + 1, device=device)[:, None]
    e = torch.arange(Ne, device=device)[None, :]
    R = torch.ones(N + 1, 1 + Ne, device=device, dtype=dtype)  # column 0: S_in enters every row
    R[:N, 1:] = (e <= Wc + c[:N] - full).to(dtype)  # [N, Ne]  key chunk e wholly far for query chunk c
    R[N, 1:] = (e[0] < last // C).to(dtype)  # [Ne]  key chunk e wholly in S_out
    reach = min(Ne, max(0, Wc + N - full))  # key chunk Wc + N − 1 − full is the last any query chunk reads whole
    return N, Wc, Ne, lags, R, last, reach


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


def _far_state(R, lk, vc, S_in, z_in, used: int):
    r"""The far states read by the query chunks (and the final state) as one GEMM of the incoming state and the per-chunk
    updates: ``[P; S_out] = R·[S_in; upd]``, likewise ``z``.

    ``R [rows, 1 + Ne]`` is the far matrix of :func:`_geometry` or its first ``N`` rows (no final state): column 0 is
    ones (``S_in`` enters every row), column ``1 + e`` key chunk ``e``; row ``c < N`` marks the key chunks wholly far
    for query chunk ``c`` (the prefix matrix), row ``N`` those wholly in ``S_out`` (its other keys, the first
    ``last % C`` of chunk ``last // C``, are :func:`_forward_state`'s). The updates ``upd = lkᵀ·v``
    ``[used, B, H, M2, Dv]`` and ``zc = Σ lk`` ``[used, B, H, M2]`` are formed for the first ``used`` key chunks only
    (at least those ``R`` reads). ``S_in, z_in``: ``[B, H, M2, Dv]``, ``[B, H, M2]`` or ``None`` (a zero state: column 0
    left out). Returns ``P [rows, B, H, M2, Dv]``, ``zP [rows, B, H, M2]``.
    """
    _, B, H, _, M2 = lk.shape
    Dv = vc.shape[-1]
    rows = R.shape[0]
    upd, zc = lk.new_empty(1 + used, B, H, M2, Dv), lk.new_empty(1 + used, B, H, M2)  # [S_in; upd], [z_in; zc]
    torch.matmul(lk[:used].mT, vc[:used], out=upd[1:])  # per-chunk Σ φ(k)ᵀ v
    torch.sum(lk[:used], 3, out=zc[1:])  # per-chunk Σ φ(k)
    first = 1
    if S_in is not None:
        upd[0], zc[0], first = S_in, z_in, 0
    P = (R[:, first:1 + used] @ upd[first:].flatten(1)).view(rows, B, H, M2, Dv)
    zP = (R[:, first:1 + used] @ zc[first:].flatten(1)).view(rows, B, H, M2)
    return P, zP


def _forward_state(R, N, last, reach, lk, vc, S_in, z_in, final_state: bool):
    """Both cores' forward far state: ``P [N, B, H, M2, Dv]``, ``zP [N, B, H, M2]`` and, with ``final_state``, ``S_out
    [B, H, M2, Dv]``, ``z_out [B, H, M2]`` (else ``None``): the whole key chunks of ``S_out`` are row ``N`` of
    :func:`_far_state`'s GEMM, the first ``last % C`` keys of key chunk ``last // C`` are added here."""
    if not final_state:
        P, zP = _far_state(R[:N], lk, vc, S_in, z_in, reach)
        return P, zP, None, None
    full, rem = divmod(last, lk.shape[3])
    P_all, zP_all = _far_state(R, lk, vc, S_in, z_in, max(reach, full))  # [N + 1, B, H, M2, (Dv)]
    # S_out, z_out copied out: views would keep the whole [N + 1, ...] buffer alive in the carried state
    S_out, z_out = P_all[N].clone(), zP_all[N].clone()
    if rem:
        S_out += lk[full, :, :, :rem].mT @ vc[full, :, :, :rem]
        z_out += lk[full, :, :, :rem].sum(2)
    return P_all[:N], zP_all[:N], S_out, z_out


def _far_grad_rows(lq, dnum, dden, g_S, g_z):
    """The gradients of the forward's far-state GEMM's rows: ``dP = lqᵀ·dnum`` ``[rows, B, H, M2, Dv]`` and ``dzP =
    ddenᵀ·lq`` ``[rows, B, H, M2]`` for the query chunks (rows ``0..N−1``) and, when either is given, ``g_S, g_z``
    (zero for a ``None`` one) as row ``N`` (``rows = N + 1``). Shapes: ``lq [N, B, H, C, M2]``, ``dnum [N, B, H, C,
    Dv]``, ``dden [N, B, H, C]``."""
    N, B, H, _, M2 = lq.shape
    Dv = dnum.shape[-1]
    rows = N + (g_S is not None or g_z is not None)
    dP, dzP = lq.new_empty(rows, B, H, M2, Dv), lq.new_empty(rows, B, H, M2)
    torch.matmul(lq.mT, dnum, out=dP[:N])
    torch.matmul(dden[..., None, :], lq, out=dzP[:N, ..., None, :])  # (as [1, C]·[C, M]: a GEMV is slower)
    if rows > N:
        dP[N], dzP[N] = (0.0 if g_S is None else g_S), (0.0 if g_z is None else g_z)
    return dP, dzP


def _far_state_grads(R, dP, dzP, lk, vc, g_S, g_z, last: int, need_in: bool):
    r"""The backward of :func:`_far_state` (and of :func:`_forward_state`'s last keys), shared by both cores: gradients
    of the incoming state and of the key chunks' features and values.

    The forward formed ``[P; S_out] = R·[S_in; upd]`` (``upd_e = lk_eᵀ v_e``, likewise ``z``), ``S_out`` plus the
    first ``last % C`` keys of key chunk ``last // C``: so ``dupd = R[:, 1:]ᵀ·[dP; g_S]`` (one GEMM), ``dS_in`` the
    sum of ``[dP; g_S]``'s rows (column 0 of ``R`` is ones; only when ``need_in``), ``dlk = v·dupdᵀ + dzc``, ``dv =
    lk·dupd``, and ``g_S`` on those last keys.

    Shapes: ``R [N + 1, 1 + Ne]``, ``dP [rows, B, H, M2, Dv]``, ``dzP [rows, B, H, M2]`` (:func:`_far_grad_rows`: row
    ``N`` the final state's, when there is one), ``lk [Ne, B, H, C, M2]``, ``vc [Ne, B, H, C, Dv]``, ``g_S [B, H, M2,
    Dv]`` / ``g_z [B, H, M2]`` or ``None``; ``last`` the keys that entered the state. Returns ``dS_in, dz_in`` (``None``
    unless ``need_in``), ``dlk [Ne, B, H, C, M2], dvc [Ne, B, H, C, Dv]``.
    """
    Ne, B, H, C, M2 = lk.shape
    Dv = vc.shape[-1]
    Rt = R[:dP.shape[0], 1:].T  # [Ne, rows]  (the key chunks' columns of R)
    dupd = (Rt @ dP.flatten(1)).view(Ne, B, H, M2, Dv)  # Σ over the rows that read key chunk e
    dzc = (Rt @ dzP.flatten(1)).view(Ne, B, H, M2)
    # S_in entered every row (R's column 0 is ones): its gradient is the sum of the rows'
    dS_in, dz_in = (dP.sum(0), dzP.sum(0)) if need_in else (None, None)
    dlk = vc @ dupd.mT + dzc[..., None, :]  # [Ne, B, H, C, M2]
    dvc = lk @ dupd  # [Ne, B, H, C, Dv]
    full, rem = divmod(last, C)
    if rem and g_S is not None:
        dlk[full, :, :, :rem] += vc[full, :, :, :rem] @ g_S.mT
        dvc[full, :, :, :rem] += lk[full, :, :, :rem] @ g_S
    if rem and g_z is not None:
        dlk[full, :, :, :rem] += g_z[:, :, None, :]
    return dS_in, dz_in, dlk, dvc


class _Core(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fq, fk, v, S_in, z_in, off, lag, C, non_negative, normalize, eps, final_state):
        B, H, n, _ = fq.shape
        N, Wc, Ne, lags, R, last, reach = _geometry(n, off, lag, C, fq.device, fq.dtype)
        fqc, fkc, vc = _chunks(fq, N, C), _chunks(fk, Ne, C), _chunks(v, Ne, C)
        lift = self_tensor if non_negative else (lambda f: f)
        lq, lk = lift(fqc), lift(fkc)  # [N|Ne, B, H, C, M2]
        # S_out, z_out: one more row of the far states' GEMM (not formed when the caller reads no final state)
        P, zP, S_out, z_out = _forward_state(R, N, last, reach, lk, vc, S_in, z_in, final_state)
        num = lq @ P  # [N, B, H, C, Dv]
        den = (zP[..., None, :] @ lq.mT)[..., 0, :]  # [N, B, H, C]  (as [1, M]·[M, C]: a GEMV is slower)
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
        B, H, n, M = fq.shape
        Dv = v.shape[-1]
        N, Wc, Ne, lags, R, last, reach = _geometry(n, off, lag, C, fq.device, fq.dtype)
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
        P, zP = _far_state(R[:N], lk, vc, S_in, z_in, reach)  # recomputed
        dP, dzP = _far_grad_rows(lq, dnum, dden, g_S, g_z)  # [N (+ 1), B, H, M2, (Dv)]: row N the final state's
        dlq = dnum @ P.mT + dden[..., None] * zP[..., None, :]  # [N, B, H, C, M2]
        # the incoming state's gradient only when it has one (S_in None: a zero state, not a tensor)
        need_in = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        dS_in, dz_in, dlk, dvc = _far_state_grads(R, dP, dzP, lk, vc, g_S, g_z, last, need_in)
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
    a = lead
    for x in pieces:
        L = x.shape[2]
        for c, r0, r1, i in _row_pieces(chunks, C, a, a + L):
            if r1 is None:  # whole chunks c : r0
                dst, src = out[c:r0], x[:, :, i:i + (r0 - c) * C].unflatten(2, (r0 - c, C)).permute(2, 0, 1, 3, 4)
            else:
                dst, src = out[c, :, :, r0:r1], x[:, :, i:i + r1 - r0]
            dst.copy_(src)
        a += L
    return out


def _rows(xc: torch.Tensor, a: int, length: int) -> torch.Tensor:
    """Token rows ``[a, a + length)`` of chunk-major ``xc [chunks, B, H, C, F]`` → ``[B, H, length, F]`` (a copy of
    the chunks they span)."""
    C = xc.shape[3]
    c0, c1 = a // C, -(-(a + length) // C)
    return _unchunk(xc[c0:c1], a - c0 * C + length)[:, :, a - c0 * C:]


def _add_rows(xc: torch.Tensor, a: int, x: torch.Tensor) -> None:
    """``xc``'s token rows ``[a, a + L)`` += ``x [B, H, L, F]`` in place (chunk-major ``xc``)."""
    C = xc.shape[3]
    for c, r0, r1, i in _row_pieces(xc.shape[0], C, a, a + x.shape[2]):
        if r1 is None:
            xc[c:r0] += x[:, :, i:i + (r0 - c) * C].unflatten(2, (r0 - c, C)).permute(2, 0, 1, 3, 4)
        else:
            xc[c, :, :, r0:r1] += x[:, :, i:i + r1 - r0]


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
        N, Wc, Ne, _, R, last, reach = _geometry(n, off, w, C, like.device, like.dtype)
        n_loc = min(-(-(w + C - 1) // C), Wc + 1)  # key chunks back with a local key (further: padding)
        lead = off - Lw
        loc_m, (empty, empty_at), loc_bias, far_m = _hybrid_masks(C, w, n_loc, like.device, like.dtype)
        kks = [slice(Wc - L, Wc - L + N) for L in range(n_loc)]
        # key chunks up to `bad` hold a key that is neither local nor far (padding, sink, front zeros): the query
        # chunks below `part` read one of them and take the data masks; the others the lag masks alone
        okc, loc_ok, part, bad = None, None, 0, -1
        if not bool(key_ok.all()):
            okb = _chunks(key_ok[:, None, :, None], Ne, C)[:, :, 0, :, 0]  # [Ne, B, C]
            bad = int((~okb).flatten(1).any(1).nonzero().max())
            part = min(N, max(0, bad - Wc + n_loc))
            loc_ok = torch.stack([okb[kk][:part] for kk in kks])[:, :, :, None, None, :] & loc_m[:, None, None, None]
            # [n_loc, part, B, 1, C, C]
            okc = okb[:bad + 1, :, None, :, None].to(like.dtype)  # [bad + 1, B, 1, C, 1]: zero their far features
        # the far lags are those with a far key, L·C + C − 1 >= w
        far_lags = [L for L in range(n_loc) if L * C + C - 1 >= w]
        sok = _chunks(sink_ok.expand(B, 1, n, -1), N, C).mT  # [N, B, 1, Ls, C]
        sinks_ok = bool(sink_ok.all())
        return dict(N=N, Wc=Wc, Ne=Ne, n_loc=n_loc, lead=lead, kks=kks, loc_m=loc_m, loc_ok=loc_ok, part=part,
                    bad=bad, okc=okc, empty=empty, empty_at=empty_at, loc_bias=loc_bias, far_m=far_m, far_lags=far_lags,
                    R=R, reach=reach, last=last, sok=sok, sinks_ok=sinks_ok,
                    lift=self_tensor if opts[2] else (lambda f: f))

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
        fqc, qc = _chunks(fq, N, C), _chunks(q, N, C)
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
        lq, lk = st["lift"](fqc), st["lift"](fkc)
        # num and den divided by 1 − g (the far part unscaled, the local one times γ = g/(1 − g), ε by 1 − g)
        # unless some g is 1: then times g and 1 − g as written
        fold = bool((g < 1).all())
        gb = g[None, None, :, None, None]  # [1, 1, H, 1, 1]
        g0 = gb[..., 0]
        loc_w = gb / (1 - gb) if fold else gb  # the local weights' factor
        # far state: per-chunk sums of the key chunks read only (the last ones, still in the window at the block's end,
        # are read by the next block as its held window), prefix by the 0/1 matrix; S_out one more row of the same GEMM
        P, zP, S_out, z_out = _forward_state(st["R"], N, st["last"], st["reach"], lk, vc, S_in, z_in, True)
        num = lq @ P  # [N, B, H, C, Dv]
        den = (zP[..., None, :] @ lq.mT)[..., 0, :]  # [N, B, H, C]  (as [1, M]·[M, C]: a GEMV is 7× slower)
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
        den = _unchunk(den, n)
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
        qc = _chunks(q, N, C)
        vc, kc = _join_chunks((v_w, v), lead, Ne, C), _join_chunks((k_w, k), lead, Ne, C)
        lq, lk = st["lift"](fqc), st["lift"](fkc)
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
        r = 1.0 / (den + eps)  # [B, H, n]
        g_out = out.new_zeros(B, H, n, Dv) if g_out is None else g_out
        dnum = _chunks(g_out * r[..., None], N, C)  # [N, B, H, C, Dv]
        dden = _chunks((-(g_out * out).sum(-1) * r)[..., None], N, C)[..., 0]  # [N, B, H, C]
        # far state
        P, zP = _far_state(st["R"][:N], lk, vc, S_in, z_in, st["reach"])
        dP, dzP = _far_grad_rows(lq, dnum, dden, g_S, g_z)  # [N (+ 1), B, H, M2, (Dv)]: row N the final state's
        dP0, dzP0 = dP[:N], dzP[:N]  # the query chunks' (before the factor 1 − g)
        # d/dg of (1 − g)·far, per head [H] (the gate's gradient only when asked)
        dgh = -((dP0 * P).sum(dim=(0, 1, 3, 4)) + (dzP0 * zP).sum(dim=(0, 1, 3))) if need_g else None
        dP0.mul_(1 - gb)
        dzP0.mul_(1 - g0)
        dlq = (dnum @ P.mT + dden[..., None] * zP[..., None, :]).mul_(1 - gb)  # [N, B, H, C, M2]
        need_in = ctx.needs_input_grad[10] or ctx.needs_input_grad[11]  # the incoming state's gradient when it has one
        dS_in, dz_in, dlk, dvc = _far_state_grads(st["R"], dP, dzP, lk, vc, g_S, g_z, st["last"], need_in)
        dfq, dfk = (_unlift(dlq, fqc), _unlift(dlk, fkc)) if non_negative else (dlq, dlk)
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
                _add_rows(dx, off + n - gw.shape[2], gw)
            grads.append((_rows(dx, lead, Lw) if Lw else None, _unchunk(dx[Wc:], n)))
        (dfk_w, dfk_n), (dv_w, dv_n), (dk_w, dk_n) = grads
        return (_unchunk(dfq, n), dfk_n, dv_n, _unchunk(dqc, n), dk_n, dfk_w, dv_w, dk_w,
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
