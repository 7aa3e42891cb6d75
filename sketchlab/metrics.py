r"""Error metrics between an approximate and an exact kernel matrix.

The error of the attention *output* (:func:`sketchlab.attention.errors.attention_error`) lives in
the attention package, above the sketches: this module imports nothing but the polynomial
features and the feature-map interface (:mod:`sketchlab.featuremaps.heads`, a primitive), so every
layer of the library can use it.

All functions reduce over the last two axes and keep leading (batch) axes, so ``[L, H, n, n]``
inputs give ``[L, H]`` results. Inputs are compared in float64.
"""

from __future__ import annotations

import math

import torch

from ._validation import DEFAULT_MAX_BYTES, as_float_tensor, check_degree, check_memory, check_pair
from .featuremaps.heads import pair_features
from .numerics import is_roundoff
from .polynomial import _poly_features

__all__ = [
    "check_approx_exact",
    "kernel_errors",
    "kernel_sq_norm",
    "optimality_ratio",
    "ratio_to_tail",
    "rel_fro",
    "rel_mae",
]


def check_approx_exact(approx, exact) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair a relative error compares: two float64 tensors of one shape ``[..., n_q, n_k]``, ``exact`` no
    all-zero matrix (its relative errors would be undefined).

    Parameters
    ----------
    approx, exact : array_like ``[..., n_q, n_k]``

    Returns
    -------
    ``(approx, exact)`` as float64 tensors.
    """
    approx = as_float_tensor(approx, "approx").to(torch.float64)
    exact = as_float_tensor(exact, "exact").to(torch.float64)
    if approx.shape != exact.shape or approx.ndim < 2:
        raise ValueError(
            f"approx and exact must have the same shape [..., n_q, n_k], got "
            f"{tuple(approx.shape)} and {tuple(exact.shape)}"
        )
    zero = exact.abs().amax((-2, -1)) == 0  # [...]
    if bool(zero.any()):
        first = tuple(int(i) for i in zero.nonzero()[0]) if zero.ndim else ()
        raise ValueError(
            f"exact must not be all zeros (relative errors are undefined): {int(zero.sum())} zero "
            f"matrix/matrices in the batch, the first at batch index {first}"
        )
    return approx, exact


def rel_mae(approx, exact) -> torch.Tensor:
    r"""Relative mean absolute error :math:`\sum|\hat A - A| / \sum |A|`.

    This is *our* definition of the LLoPS paper's "relative mean absolute error" (the paper's
    appendix, which defines it exactly, is not available to us): the ratio of the mean absolute
    error to the mean absolute kernel value, over all ``n_q × n_k`` entries.
    """
    approx, exact = check_approx_exact(approx, exact)
    return (approx - exact).abs().sum((-2, -1)) / exact.abs().sum((-2, -1))


def rel_fro(approx, exact) -> torch.Tensor:
    r"""Relative Frobenius error :math:`\|\hat A - A\|_F / \|A\|_F`."""
    approx, exact = check_approx_exact(approx, exact)
    return torch.linalg.matrix_norm(approx - exact) / torch.linalg.matrix_norm(exact)


def ratio_to_tail(sq_err, tail, sq_norm, n: int) -> torch.Tensor:
    r"""Optimality ratio :math:`\sqrt{\text{sq\_err} / \text{tail}}` with the round-off rule.

    Parameters
    ----------
    sq_err : Tensor ``[...]``
        :math:`\|\hat A - A\|_F^2`.
    tail : Tensor ``[...]``
        The Theorem 3.1 floor :math:`\sum_{i>m}\sigma_i(A)^2`.
    sq_norm : Tensor ``[...]``
        :math:`\|A\|_F^2`.
    n : int
        ``max(n_q, n_k)``.

    Returns
    -------
    float64 Tensor ``[...]``. **NaN means undefined**: ``√tail`` is round-off by the one rule of
    :func:`sketchlab.numerics.is_roundoff` (at most ``ROUNDOFF · n · eps · ‖A‖_F``: a size-``m``
    sketch can be exact, ``m >= rank A``), so the ratio would divide round-off by round-off (a tail
    of 2.5e-256 once gave 7e114). Otherwise ``sqrt(sq_err / tail)``; ``>= 1`` on the data the tail is of.
    """
    sq_err = torch.as_tensor(sq_err, dtype=torch.float64)
    tail = torch.as_tensor(tail, dtype=torch.float64, device=sq_err.device)
    sq_norm = torch.as_tensor(sq_norm, dtype=torch.float64, device=sq_err.device)
    return torch.where(is_roundoff(tail.sqrt(), sq_norm.sqrt(), n), torch.full_like(sq_err, math.nan),
                       (sq_err / tail.clamp_min(torch.finfo(torch.float64).tiny)).sqrt())


def optimality_ratio(approx, exact, tail) -> torch.Tensor:
    r"""Error against the Theorem 3.1 floor: :math:`\|\hat A - A\|_F / \sqrt{\mathrm{tail}}`.

    ``tail`` is :math:`\sum_{i>m}\sigma_i(A)^2` (see :func:`sketchlab.tail_bound`), shaped like the
    batch axes. A ratio of 1 is optimal; no size-``m`` sketch goes below 1 on the data it is
    measured on. Where the tail is zero to round-off (``m >= rank A``, see :func:`ratio_to_tail`)
    the ratio is undefined and returned as NaN.
    """
    approx, exact = check_approx_exact(approx, exact)
    tail = torch.as_tensor(tail, dtype=torch.float64, device=approx.device)
    if tail.shape != approx.shape[:-2] or not bool((tail >= 0).all()):  # also rejects NaN
        raise ValueError(
            f"tail must be non-negative (not NaN) with the batch shape {tuple(approx.shape[:-2])}, "
            f"got shape {tuple(tail.shape)} with minimum {tail.min().item() if tail.numel() else None}"
        )
    sq_err = torch.linalg.matrix_norm(approx - exact) ** 2
    return ratio_to_tail(sq_err, tail, (exact**2).sum((-2, -1)), max(exact.shape[-2:]))


def kernel_sq_norm(q, k, p: int, *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    r""":math:`\|A\|_F^2` for :math:`A = (QK^\top)^{\circ p}` without forming ``A``.

    ``q[..., n_q, d]``, ``k[..., n_k, d]`` → float64 ``[...]``. Two routes, the cheaper taken:
    the degree-``2p`` moments :math:`\|A\|_F^2 = \langle\sum_i\psi_{2p}(q_i), \sum_j\psi_{2p}(k_j)\rangle`
    (symmetric features, ``C(d+2p-1, 2p)`` of them, summed over tokens in blocks: cost
    ``(n_q + n_k) C`` gathers), or row blocks of ``A`` (cost ``n_q n_k d`` in matrix products, taken
    unless the moments need 32 times fewer operations). Memory stays within ``max_bytes``.
    """
    q, k = check_pair(q, k)
    return _kernel_sq_norm(q, k, check_degree(p), max_bytes)


def _kernel_sq_norm(q: torch.Tensor, k: torch.Tensor, p: int, max_bytes: int) -> torch.Tensor:
    """:func:`kernel_sq_norm` without the input checks (for callers that validated already)."""
    q, k = q.to(torch.float64), k.to(torch.float64)
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    batch = math.prod(q.shape[:-2])
    moments = math.comb(d + 2 * p - 1, 2 * p)
    # the moment route gathers, the row blocks multiply matrices (~30x faster per flop here): prefer
    # the moments only when they need far fewer operations
    if 32 * (n_q + n_k) * moments < n_q * n_k * d and batch * moments * 8 * 4 <= max_bytes:
        def summed(x):
            rows = max(1, min(64 * 2**20, max_bytes // 4) // max(1, batch * moments * 8))  # tokens per block
            out = torch.zeros(*x.shape[:-2], moments, dtype=torch.float64, device=x.device)
            for lo in range(0, x.shape[-2], rows):
                out += _poly_features(x[..., lo : lo + rows, :], 2 * p, True, max_bytes).sum(-2)
            return out

        return (summed(q) * summed(k)).sum(-1)
    out = torch.zeros(q.shape[:-2], dtype=torch.float64, device=q.device)
    for sl in _row_blocks(batch, n_q, n_k, max_bytes):
        out += ((q[..., sl, :] @ k.mT) ** p).pow(2).sum((-2, -1))
    return out


#: Bytes of the row blocks of :func:`kernel_errors` (all copies): small enough that a block stays in
#: cache between the passes over it (the products, the power, the differences, the sums).
_ROW_BLOCK_BYTES = 32 * 2**20


def _row_blocks(batch: int, n_q: int, n_k: int, max_bytes: int, copies: int = 4):
    """Slices of query rows whose ``[batch, rows, n_k]`` float64 blocks (``copies`` live at once) fit in
    ``min(max_bytes, _ROW_BLOCK_BYTES)``."""
    limit = min(max_bytes, _ROW_BLOCK_BYTES)
    rows = limit // max(1, copies * batch * n_k * 8)
    if rows < 1:
        check_memory(copies * batch * n_k * 8, what=f"one kernel row block ({batch} x 1 x {n_k} float64, {copies} copies)",
                     way_out="use fewer key tokens or fewer heads at a time", max_bytes=max_bytes)
        rows = 1
    for lo in range(0, n_q, rows):
        yield slice(lo, min(n_q, lo + rows))


def kernel_errors(maps, q, k, p: int, *, max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    r"""Errors of the kernel of ``maps`` against :math:`A = (QK^\top)^{\circ p}`, in query-row blocks (never ``n × n``).

    Parameters
    ----------
    maps : FeatureMap or pair ``(map_q, map_k)`` of FeatureMaps
        One map for both sides, or a query and a key map (e.g. ``fit.maps``) of ``H`` heads, ``H`` the product
        of the trailing batch axes of ``q`` (layer ``l``, head ``j`` of ``[L, H']`` is head ``l·H' + j``:
        :func:`sketchlab.featuremaps.heads.pair_features`). The features
        :math:`\Phi_Q = \phi_Q(Q)`, :math:`\Phi_K = \phi_K(K)` (``[..., n, M]``, float64) are evaluated once, then
        :math:`\hat A = \Phi_Q\Phi_K^\top` and ``A`` are formed one block of query rows at a time.
    q : Tensor ``[..., n_q, d]``
    k : Tensor ``[..., n_k, d]``
    p : int
    max_bytes : int
        Budget of one block (also capped at 256 MiB).

    Returns
    -------
    dict of float64 Tensors ``[...]``: ``sq_err`` :math:`\|\hat A - A\|_F^2`, ``sq_norm``
    :math:`\|A\|_F^2`, ``rel_fro``, ``rel_mae`` (:func:`rel_fro`, :func:`rel_mae` of the dense form,
    to round-off). Raises ``ValueError`` (as :func:`rel_mae`) when ``A`` is all zeros.
    """
    q, k = check_pair(q, k)
    p = check_degree(p)
    from ._threads import hot_loop_threads

    with hot_loop_threads(math.prod(q.shape[:-2]) * q.shape[-2] * k.shape[-2] * q.shape[-1]):
        fq, fk = pair_features(maps, q, k)
        return _kernel_errors(fq, fk, q, k, p, max_bytes)


def _kernel_errors(fq: torch.Tensor, fk: torch.Tensor, q: torch.Tensor, k: torch.Tensor, p: int,
                   max_bytes: int) -> dict:
    """:func:`kernel_errors` from the features ``fq[..., n_q, m]``, ``fk[..., n_k, m]`` of checked
    ``q``, ``k`` (:func:`~sketchlab.featuremaps.heads.pair_features`); trusts its inputs."""
    q64, k64 = q.to(torch.float64), k.to(torch.float64)
    batch = q.shape[:-2]
    sq_err = torch.zeros(batch, dtype=torch.float64, device=q.device)
    sq_norm, abs_err, abs_a = torch.zeros_like(sq_err), torch.zeros_like(sq_err), torch.zeros_like(sq_err)
    for sl in _row_blocks(math.prod(batch), q.shape[-2], k.shape[-2], max_bytes):
        exact = (q64[..., sl, :] @ k64.mT).pow_(p)  # [..., rows, n_k]; in place: few passes over the block
        diff = (fq[..., sl, :] @ fk.mT).sub_(exact)
        sq_err += torch.linalg.vector_norm(diff, 2, dim=(-2, -1)) ** 2
        abs_err += torch.linalg.vector_norm(diff, 1, dim=(-2, -1))
        sq_norm += torch.linalg.vector_norm(exact, 2, dim=(-2, -1)) ** 2
        abs_a += torch.linalg.vector_norm(exact, 1, dim=(-2, -1))
    zero = abs_a == 0
    if bool(zero.any()):
        first = tuple(int(i) for i in zero.nonzero()[0]) if zero.ndim else ()
        raise ValueError(
            f"the exact kernel (QKᵀ)^p is all zeros for {int(zero.sum())} head(s), the first at batch index "
            f"{first} (q or k is zero there): relative errors are undefined"
        )
    return {"sq_err": sq_err, "sq_norm": sq_norm, "rel_fro": (sq_err / sq_norm).sqrt(), "rel_mae": abs_err / abs_a}


def _gram_sq_err(fq: torch.Tensor, fk: torch.Tensor, q: torch.Tensor, k: torch.Tensor, p: int, sq_norm: torch.Tensor,
                *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    r""":math:`\|\hat A - A\|_F^2` without the ``n_q × n_k`` products, from Gram matrices.

    .. math:: \|\hat A - A\|_F^2 = \langle\Phi_Q^\top\Phi_Q, \Phi_K^\top\Phi_K\rangle
              - 2\,\langle\Phi_Q^\top\psi_p(Q), \Phi_K^\top\psi_p(K)\rangle + \|A\|_F^2,

    since :math:`\langle\hat A, A\rangle = \sum_{ij}\phi_Q(q_i)^\top\phi_K(k_j)\,\psi_p(q_i)^\top\psi_p(k_j)`.
    ``ψ_p`` is the symmetric form (``D = C(d+p-1, p)`` columns), formed in token blocks under
    ``max_bytes``; cost ``(n_q + n_k)·m·(m + D)`` multiply-adds against ``n_q·n_k·(d + m)`` for the
    row blocks of :func:`kernel_errors`.

    Parameters
    ----------
    fq, fk : float64 Tensor ``[..., n_q, m]``, ``[..., n_k, m]``
        The maps' features (:func:`~sketchlab.featuremaps.heads.pair_features`).
    q, k : Tensor ``[..., n_q, d]``, ``[..., n_k, d]``
        Checked (finite, real floating); trusted.
    p : int
    sq_norm : float64 Tensor ``[...]``
        :math:`\|A\|_F^2` (e.g. the sum of all squared singular values, which the floor has).

    Returns
    -------
    float64 Tensor ``[...]``, clamped at 0. The three terms are each accurate to about
    ``1e-13`` of :math:`\|A\|_F^2`, so the result is accurate to about ``1e-13 · ‖A‖² / sq_err``
    relative: callers needing it below ``~1e-6 ‖A‖²`` take the row blocks instead.
    """
    d = q.shape[-1]
    symmetric = p > 1 and d > 1
    dim = math.comb(d + p - 1, p) if symmetric else d**p
    batch = math.prod(q.shape[:-2])
    rows = max(1, min(64 * 2**20, max_bytes // 4) // max(1, batch * dim * 8))  # tokens per block of ψ

    def moments(x, f):  # Φᵀψ_p(X), [..., m, D], summed over token blocks
        out = torch.zeros(*f.shape[:-2], f.shape[-1], dim, dtype=torch.float64, device=f.device)
        for lo in range(0, x.shape[-2], rows):
            psi = _poly_features(x[..., lo : lo + rows, :].to(torch.float64), p, symmetric, max_bytes)  # [..., b, D]
            out += f[..., lo : lo + rows, :].mT @ psi
        return out

    sq_approx = ((fq.mT @ fq) * (fk.mT @ fk)).sum((-2, -1))  # ‖Â‖² = ⟨Φ_QᵀΦ_Q, Φ_KᵀΦ_K⟩
    cross = (moments(q, fq) * moments(k, fk)).sum((-2, -1))  # ⟨Â, A⟩
    return (sq_approx - 2 * cross + sq_norm).clamp_min(0)


def _sampled_rel_mae(fq: torch.Tensor, fk: torch.Tensor, q: torch.Tensor, k: torch.Tensor, p: int, rows: torch.Tensor,
                    *, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``rel_mae`` estimated on the query rows ``rows`` (all keys), and its standard error.

    With :math:`a_i = \sum_j |\hat A_{ij} - A_{ij}|` and :math:`b_i = \sum_j |A_{ij}|` on a simple
    random sample ``S`` of ``r`` of the ``n_q`` query rows (drawn without replacement by the
    caller), the ratio estimator :math:`\hat R = \sum_S a_i / \sum_S b_i` of
    :math:`\sum_i a_i / \sum_i b_i` has the standard error (Cochran, *Sampling Techniques*, §6.3)

    .. math:: \mathrm{se} = \frac{1}{\bar b}\sqrt{\frac{1 - r/n_q}{r}\,
              \frac{\sum_S (a_i - \hat R b_i)^2}{r - 1}}.

    ``fq``, ``fk`` are the features of all of ``q``, ``k`` (:func:`~sketchlab.featuremaps.heads.pair_features`); inputs are
    trusted (checked by the caller). Returns float64 ``(estimate, se)``, each ``[...]``; with every
    row sampled the estimate is :func:`rel_mae` exactly and ``se`` is 0.
    """
    n_q = q.shape[-2]
    r = rows.numel()
    q64, k64 = q[..., rows, :].to(torch.float64), k.to(torch.float64)
    fs = fq[..., rows, :]
    batch = q.shape[:-2]
    a = torch.empty(*batch, r, dtype=torch.float64, device=q.device)
    b = torch.empty_like(a)
    for sl in _row_blocks(math.prod(batch), r, k.shape[-2], max_bytes, copies=2):
        exact = (q64[..., sl, :] @ k64.mT).pow_(p)  # [..., rows, n_k]
        b[..., sl] = exact.abs().sum(-1)
        a[..., sl] = (fs[..., sl, :] @ fk.mT).sub_(exact).abs_().sum(-1)
    estimate = a.sum(-1) / b.sum(-1)
    if r < 2 or r == n_q:
        return estimate, torch.zeros_like(estimate)
    resid = a - estimate[..., None] * b  # [..., r]
    se = ((1 - r / n_q) / r * resid.pow(2).sum(-1) / (r - 1)).sqrt() / b.mean(-1)
    return estimate, se
