r"""The far state of a chunked causal block, shared by both causal cores (:func:`.chunk.chunk_core` and the
hybrid's :func:`.chunk_hybrid.hybrid_core`).

A block of ``n`` queries reads ``off + n`` keys (``off`` a multiple of the chunk size ``C``) and a carried
state ``S_in [B, H, M2, Dv]``, ``z_in [B, H, M2]``. Tensors are chunk-major ``[chunks, B, H, C, ·]`` so that a
shift by whole chunks is a slice, never a copy. For query chunk ``c`` (key chunk ``c + off/C`` holds the same
tokens) a key chunk ``L`` chunks back is either wholly far (``L·C − (C − 1) ≥ lag``: read from the prefix of
per-chunk states, one matmul by a 0/1 prefix matrix ``R``, which has a column of ones for ``S_in`` and a last
row that sums the key chunks wholly in ``S_out``), partly far (at most two such ``L``: ``C × C`` scores with a
fixed mask, the cores' own) or wholly near (not seen by the far part). The backward recomputes the per-chunk
states of the block from the saved inputs (``O(T·C)`` kept, not the ``(T/C)·M·Dv`` states): ``dS`` (and
``dS_out``) flows backwards by ``Rᵀ``.
"""

from __future__ import annotations

import functools

import torch

from ....polynomial import self_tensor

__all__ = ["chunk_geometry", "far_backward", "far_forward", "from_chunks", "normalized_grads", "to_chunks"]


@functools.lru_cache(maxsize=64)
def chunk_geometry(n: int, off: int, lag: int, C: int, device: torch.device, dtype: torch.dtype):
    """The geometry of one block of a chunked causal core: which key chunks are far for which query chunk.

    Parameters
    ----------
    n, off, lag, C : int
        The block's queries, the keys before them (a multiple of ``C``), the far lag and the chunk size.
    device, dtype
        Of the masks and of ``R``.

    Returns
    -------
    N, Wc, Ne : int
        Query chunks, key chunks before them, key chunks in all (``Wc + N``).
    lags : list of ``(L, c0, mask [C, C])``
        The partly-far lags ``L`` (in chunks), the first query chunk with such a key chunk and the far mask.
    R : Tensor ``[N + 1, 1 + Ne]``
        The 0/1 far matrix (see :func:`_far_state`).
    last : int
        The keys ``e < last`` enter ``S_out``.
    reach : int
        The query chunks' rows of ``R`` read key chunks ``< reach`` only (their other key columns are zero).
    """
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


def to_chunks(x: torch.Tensor, chunks: int, C: int) -> torch.Tensor:
    """Chunk-major, contiguous: ``x [B, H, L, F]`` → ``[chunks, B, H, C, F]``, zero-padded at the end.

    Parameters
    ----------
    x : Tensor ``[B, H, L, F]``
    chunks, C : int
        ``chunks · C >= L``.

    Returns
    -------
    Tensor ``[chunks, B, H, C, F]``
    """
    B, H, L, F = x.shape
    if chunks * C != L:
        x = torch.nn.functional.pad(x, (0, 0, 0, chunks * C - L))
    return x.view(B, H, chunks, C, F).permute(2, 0, 1, 3, 4).contiguous()  # [chunks, B, H, C, F]


def from_chunks(x: torch.Tensor, length: int) -> torch.Tensor:
    """The inverse of :func:`to_chunks`: chunk-major ``[N, B, H, C, ·]`` (or ``[N, B, H, C]``) → ``[B, H, length, ·]``.

    Parameters
    ----------
    x : Tensor ``[N, B, H, C, ·]`` or ``[N, B, H, C]``
    length : int
        The tokens kept (``<= N·C``).

    Returns
    -------
    Tensor ``[B, H, length, ·]`` (``[B, H, length]``)
    """
    x = x.movedim(0, 2)  # [B, H, N, C, ·]
    return x.flatten(2, 3)[:, :, :length]


def _lift(x: torch.Tensor, non_negative: bool) -> torch.Tensor:
    """The features the state holds: ``φ ⊗ φ`` ``[..., M²]`` when ``non_negative`` (the kernel ``(φ(q)·φ(k))²``), else
    ``φ`` itself."""
    return self_tensor(x) if non_negative else x


def _unlift(grad: torch.Tensor, phi: torch.Tensor, non_negative: bool) -> torch.Tensor:
    """Gradient through :func:`_lift`: ``grad [..., M²]`` → ``(G + Gᵀ) φ`` ``[..., M]`` (``grad`` itself when not
    ``non_negative``)."""
    if not non_negative:
        return grad
    M = phi.shape[-1]
    G = grad.unflatten(-1, (M, M))  # [..., M, M]
    return (G @ phi[..., None] + G.mT @ phi[..., None])[..., 0]


def normalized_grads(g_out, out, den, eps: float, N: int, C: int):
    """The gradients of ``num`` and ``den`` through ``out = num / (den + eps)``, chunk-major.

    Parameters
    ----------
    g_out : Tensor ``[B, H, n, Dv]`` or None (zero)
    out : Tensor ``[B, H, n, Dv]``
    den : Tensor ``[B, H, n]``
    eps : float
    N, C : int
        Chunks and chunk size (``N·C >= n``).

    Returns
    -------
    dnum : Tensor ``[N, B, H, C, Dv]``
        ``g_out / (den + eps)``.
    dden : Tensor ``[N, B, H, C]``
        ``−(g_out · out) / (den + eps)``.
    """
    r = 1.0 / (den + eps)  # [B, H, n]
    g_out = torch.zeros_like(out) if g_out is None else g_out
    return to_chunks(g_out * r[..., None], N, C), to_chunks((-(g_out * out).sum(-1) * r)[..., None], N, C)[..., 0]


def _far_state(R, lk, vc, S_in, z_in, used: int):
    r"""The far states read by the query chunks (and the final state) as one GEMM of the incoming state and the per-chunk
    updates: ``[P; S_out] = R·[S_in; upd]``, likewise ``z``.

    ``R [rows, 1 + Ne]`` is the far matrix of :func:`chunk_geometry` or its first ``N`` rows (no final state): column 0 is
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


def far_forward(R, N, last, reach, fqc, fkc, vc, S_in, z_in, *, non_negative: bool, final_state: bool):
    """Both cores' far part: the query chunks against the far state (the prefix GEMM of :func:`_far_state`).

    Parameters
    ----------
    R, N, last, reach
        Of :func:`chunk_geometry`.
    fqc : Tensor ``[N, B, H, C, M]``
    fkc : Tensor ``[Ne, B, H, C, M]``
        Raw features, chunk-major (lifted here: :func:`_lift`).
    vc : Tensor ``[Ne, B, H, C, Dv]``
    S_in, z_in : Tensor ``[B, H, M2, Dv]``, ``[B, H, M2]``, or None (zero)
    non_negative, final_state : bool

    Returns
    -------
    num : Tensor ``[N, B, H, C, Dv]``
        ``lq · P``.
    den : Tensor ``[N, B, H, C]``
        ``lq · zP``.
    S_out, z_out : Tensor ``[B, H, M2, Dv]``, ``[B, H, M2]``, or None (not ``final_state``)
        :func:`_forward_state`'s.
    """
    lq, lk = _lift(fqc, non_negative), _lift(fkc, non_negative)  # [N|Ne, B, H, C, M2]
    P, zP, S_out, z_out = _forward_state(R, N, last, reach, lk, vc, S_in, z_in, final_state)
    den = (zP[..., None, :] @ lq.mT)[..., 0, :]  # [N, B, H, C]  (as [1, M]·[M, C]: a GEMV is 7× slower)
    return lq @ P, den, S_out, z_out


def far_backward(R, N, last, reach, fqc, fkc, vc, S_in, z_in, dnum, dden, g_S, g_z, *, non_negative: bool,
                 need_in: bool, keep=None, need_g: bool = False):
    r"""The backward of both cores' far part (:func:`far_forward`'s, times ``keep``).

    The far states ``P, zP`` are recomputed; their gradients ``dP = lqᵀ·dnum``, ``dzP = ddenᵀ·lq`` are the rows of a
    GEMM by ``Rᵀ`` (:func:`_far_state_grads`) with ``g_S, g_z`` (zero for a ``None`` one) as row ``N`` when either is
    given. ``d/dg`` of ``(1 − g)·far`` is ``−Σ dP·P + dzP·zP`` per head.

    Parameters
    ----------
    R, N, last, reach, fqc, fkc, vc, S_in, z_in, non_negative
        As in :func:`far_forward`.
    dnum : Tensor ``[N, B, H, C, Dv]``
    dden : Tensor ``[N, B, H, C]``
    g_S, g_z : Tensor ``[B, H, M2, Dv]``, ``[B, H, M2]``, or None
        The final state's gradients.
    need_in : bool
        Return the incoming state's gradients.
    keep : Tensor ``[1, 1, H, 1, 1]`` or None
        The hybrid's ``1 − g`` scaling the query chunks' far part (None: 1).
    need_g : bool
        Return the far part's share of the gate's gradient.

    Returns
    -------
    dfq ``[N, B, H, C, M]``, dfk ``[Ne, B, H, C, M]``, dvc ``[Ne, B, H, C, Dv]``, dS_in, dz_in (None unless
    ``need_in``), dgh ``[H]`` (None unless ``need_g``).
    """
    lq, lk = _lift(fqc, non_negative), _lift(fkc, non_negative)
    P, zP, _, _ = _forward_state(R, N, last, reach, lk, vc, S_in, z_in, False)  # recomputed
    B, H, _, M2 = lq.shape[1:]
    Dv = dnum.shape[-1]
    rows = N + (g_S is not None or g_z is not None)  # row N: the final state's
    dP, dzP = lq.new_empty(rows, B, H, M2, Dv), lq.new_empty(rows, B, H, M2)
    torch.matmul(lq.mT, dnum, out=dP[:N])
    torch.matmul(dden[..., None, :], lq, out=dzP[:N, ..., None, :])  # (as [1, C]·[C, M]: a GEMV is slower)
    if rows > N:
        dP[N], dzP[N] = (0.0 if g_S is None else g_S), (0.0 if g_z is None else g_z)
    dlq = dnum @ P.mT + dden[..., None] * zP[..., None, :]  # [N, B, H, C, M2]
    dgh = -((dP[:N] * P).sum(dim=(0, 1, 3, 4)) + (dzP[:N] * zP).sum(dim=(0, 1, 3))) if need_g else None
    if keep is not None:  # the query chunks' rows (not the final state's) times 1 − g
        dP[:N].mul_(keep)
        dzP[:N].mul_(keep[..., 0])
        dlq.mul_(keep)
    dS_in, dz_in, dlk, dvc = _far_state_grads(R, dP, dzP, lk, vc, g_S, g_z, last, need_in)
    return _unlift(dlq, fqc, non_negative), _unlift(dlk, fkc, non_negative), dvc, dS_in, dz_in, dgh


def _far_state_grads(R, dP, dzP, lk, vc, g_S, g_z, last: int, need_in: bool):
    r"""The backward of :func:`_far_state` (and of :func:`_forward_state`'s last keys), shared by both cores: gradients
    of the incoming state and of the key chunks' features and values.

    The forward formed ``[P; S_out] = R·[S_in; upd]`` (``upd_e = lk_eᵀ v_e``, likewise ``z``), ``S_out`` plus the
    first ``last % C`` keys of key chunk ``last // C``: so ``dupd = R[:, 1:]ᵀ·[dP; g_S]`` (one GEMM), ``dS_in`` the
    sum of ``[dP; g_S]``'s rows (column 0 of ``R`` is ones; only when ``need_in``), ``dlk = v·dupdᵀ + dzc``, ``dv =
    lk·dupd``, and ``g_S`` on those last keys.

    Shapes: ``R [N + 1, 1 + Ne]``, ``dP [rows, B, H, M2, Dv]``, ``dzP [rows, B, H, M2]`` (:func:`far_backward`: row
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
