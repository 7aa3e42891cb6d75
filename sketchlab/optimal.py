r"""Theorem 3.1 of the LLoPS paper: the optimal size-``m`` sketch and its tail bound.

For a fixed ``m``, over all maps :math:`\phi_Q, \phi_K : \mathbb R^d \to \mathbb R^m`,

.. math:: \min \|\phi_Q(Q)\phi_K(K)^\top - A\|_F^2 = \sum_{i>m} \sigma_i(A)^2,
          \qquad A = (QK^\top)^{\circ p},

since the product has rank at most ``m`` (Eckart–Young). The minimum is attained by linear
projections of the exact features, :math:`\phi^*_Q(x) = \psi_p(x)^\top W^*_Q` and
:math:`\phi^*_K(x) = \psi_p(x)^\top W^*_K` with, for :math:`A = U\Sigma V^\top`, any ``W*`` with
:math:`\psi_p(Q) W^*_Q = U_m \Sigma_m^{1/2}` and :math:`\psi_p(K) W^*_K = V_m \Sigma_m^{1/2}` (the
DESIGN's :math:`W^*_Q = \psi_p(Q)^+ U_m \Sigma_m^{1/2}` is one of them).

Which ``W*`` we return. Since :math:`A V_m = U_m \Sigma_m` and :math:`A = \psi_p(Q)\psi_p(K)^\top`,

.. math:: W^*_Q = \psi_p(K)^\top V_m \Sigma_m^{-1/2}, \qquad W^*_K = \psi_p(Q)^\top U_m \Sigma_m^{-1/2}

satisfy those equations exactly and need no pseudo-inverse. When ``ψ_p(Q)`` has full column rank
(``n > D`` and generic data) ``W*`` is unique and this *is* the pseudo-inverse solution. When
``n < D`` it is not unique, and this choice gives new tokens the Nyström extension
:math:`\phi^*_Q(x) = \kappa(x, K)\, V_m \Sigma_m^{-1/2}` with :math:`\kappa(x, K) = (x^\top K^\top)^{p}`,
so :math:`\phi^*_Q(x)^\top\phi^*_K(y) = \kappa(x, K)\, A_m^+\, \kappa(Q, y)`: the classical
rank-``m`` out-of-sample kernel approximation.

Two routes compute it:

``"svd"``
    the ``n_q × n_k`` SVD of ``A``;
``"qr"``
    thin QR factors :math:`\psi_p(Q) = Q_Q R_Q`, :math:`\psi_p(K) = Q_K R_K`, so that
    :math:`A = Q_Q (R_Q R_K^\top) Q_K^\top` and only the small core
    :math:`R_Q R_K^\top = U^c \Sigma V^{c\top}` is decomposed; then
    :math:`W^*_Q = R_K^\top V^c_m \Sigma_m^{-1/2}`. Cheaper when ``n`` exceeds the feature
    dimension ``D``.

``"gram"``
    the moment matrices :math:`M = \psi_p^\top\psi_p` (``D × D``, summed over token blocks, so
    memory is independent of ``n``) and a square root :math:`R^\top R = M` (Cholesky, or the
    eigendecomposition when ``M`` is singular: :func:`~sketchlab.polynomial.feature_gram_root`)
    stand in for the QR factors; the rest as ``"qr"``. Squares the condition number of ψ
    (singular values of ``A`` below ``~1e-8 σ_1`` lose accuracy), so it is taken only when the
    features do not fit the memory budget.

``"auto"`` takes ``"qr"`` when ``max(n_q, n_k) > D`` (``"gram"`` when ψ would exceed ``max_bytes / 4``). The features are the symmetric ones whenever
they are fewer (every ``p >= 2`` with ``d >= 2``); :meth:`OptimalMap.projector` returns the
projector in the full ``d**p`` basis. All arithmetic is float64.

The optimum is a pair of feature maps of the family, :class:`OptimalMap` ``(map_q, map_k)``: one head per problem
of the batch (``[L, H]`` flattened row-major), :math:`\phi(x) = \psi_p(x)^\top W` with ``W`` a float64 buffer
``[H, D, m]`` per side; :func:`optimal_sketch` and :func:`min_norm_sketch` return it as an :class:`Optimum`, the
maps beside the singular values of ``A``, the tail and the route (as ``fit_sketch`` returns a
:class:`~sketchlab.Fit`, the maps beside the report).

References
----------
Qin, Deng, Cong, Sun. *Learnable Low-Rank Polynomial Sketch for Effective Linear Attention*, 2026,
Theorem 3.1.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ._threads import hot_loop_threads
from ._validation import check_degree, check_memory, check_pair, check_positive_int
from .featuremaps.base import FeatureMap, _init_heads
from .numerics import check_float64_finite, check_poly_kernel_range
from .polynomial import (
    DEFAULT_MAX_BYTES,
    _feature_gram_root,
    _poly_features,
    _poly_kernel,
    poly_features,
    symmetric_to_full,
)

__all__ = ["OptimalMap", "Optimum", "max_sketch_size", "min_norm_sketch", "optimal_sketch", "tail_bound"]

_ROUTES = ("auto", "svd", "qr", "gram")

#: :func:`sketchlab.numerics.check_float64_finite` naming this module's results.
_finite = functools.partial(check_float64_finite, where="optimal sketch")


class OptimalMap(FeatureMap):
    r"""One side of the Theorem 3.1 optimum per head: :math:`\phi(x) = \psi_p(x)^\top W`.

    Parameters
    ----------
    w : Tensor ``[H, D, m]``
        The projector of each head (a float64 buffer, one per head: ``per_head_parameters``), acting on the exact
        features :math:`\psi_p` (the symmetric ones, ``D = C(d+p-1, p)``, when ``symmetric``; else ``D = d**p``).
    p, head_dim : int
        Degree and ``d``.
    symmetric : bool

    Notes
    -----
    Features are float64 (``W``'s dtype promoted with the input's). :meth:`projector` gives ``W`` in the full
    ``d**p`` basis (:func:`~sketchlab.polynomial.symmetric_to_full`).
    """

    def __init__(self, w: torch.Tensor, *, p: int, head_dim: int, symmetric: bool):
        super().__init__()
        _init_heads(self, w.shape[0], head_dim)
        self.p, self.symmetric = check_degree(p), bool(symmetric)
        self.register_buffer("w", w.detach().to(torch.float64).clone())  # [H, D, m]

    @property
    def num_features(self) -> int:
        return self.w.shape[-1]

    @property
    def degree(self) -> int:
        return self.p

    def _features(self, x):
        psi = poly_features(x.to(torch.promote_types(x.dtype, self.w.dtype)), self.p, self.symmetric)  # [B, T, H, D]
        return torch.einsum("bthe,hem->bthm", psi, self.w.to(psi.dtype))

    def _features_naive(self, x, head):
        from .polynomial import poly_features_naive

        return poly_features_naive(x, self.p, self.symmetric) @ self.w[head]

    def projector(self, *, symmetric: bool = False) -> torch.Tensor:
        """``W`` ``[H, d**p, m]`` in the full basis, or as stored ``[H, D, m]`` with ``symmetric`` (then it must be
        stored so). In the full basis it is the symmetric, minimum-norm projector with the same features."""
        if symmetric == self.symmetric:
            return self.w
        if symmetric:
            raise ValueError("this map was computed in the full basis (p == 1 or d == 1): no symmetric form is stored")
        return symmetric_to_full(self.w, self.head_dim, self.p)


@dataclass(frozen=True)
class Optimum:
    r"""The Theorem 3.1 optimum of a batch of problems ``[...]`` (:func:`optimal_sketch`, :func:`min_norm_sketch`).

    Attributes
    ----------
    map_q, map_k : OptimalMap
        The optimal maps, ``prod(...)`` heads (the batch flattened row-major, as a fit's maps).
    singular_values : Tensor ``[..., min(n_q, n_k)]``
        All of ``A``'s, float64, descending (zeros beyond its rank on the QR and Gram routes).
    tail : Tensor ``[...]``
        :math:`\sum_{i>m}\sigma_i(A)^2`, float64: the floor no size-``m`` sketch beats on this data, and
        :math:`\|\phi^*_Q(Q)\phi^*_K(K)^\top - A\|_F^2` to float64 round-off.
    route : str
        The route that computed it (``"svd"``, ``"qr"`` or ``"gram"``).
    """

    map_q: OptimalMap
    map_k: OptimalMap
    singular_values: torch.Tensor
    tail: torch.Tensor
    route: str

    @property
    def maps(self) -> tuple[OptimalMap, OptimalMap]:
        """``(map_q, map_k)``."""
        return self.map_q, self.map_k


def _optimum(w_q, w_k, s, tail, p, d, symmetric, route) -> Optimum:
    """The :class:`Optimum` of projectors ``w [..., D, m]`` (the batch flattened into heads) and the spectrum."""
    map_q, map_k = (OptimalMap(w.reshape(-1, *w.shape[-2:]), p=p, head_dim=d, symmetric=symmetric) for w in (w_q, w_k))
    return Optimum(map_q, map_k, s, tail, route)


def _feature_dim(d: int, p: int) -> tuple[int, bool]:
    """``(D, symmetric)``: the exact feature count ``min(d**p, C(d+p-1, p))`` and whether it is the
    symmetric one (every ``p >= 2`` with ``d >= 2``). Never evaluates ``d**p`` for large ``p``."""
    if p == 1 or d == 1:
        return d**p if d > 1 else 1, False
    return math.comb(d + p - 1, p), True


def max_sketch_size(n_q: int, n_k: int, d: int, p: int) -> int:
    """The largest rank ``A = (QKᵀ)^{∘p}`` can have: ``min(n_q, n_k, D)``, ``D`` the exact feature count.

    ``D = min(d**p, C(d+p-1, p))`` (the symmetric features whenever fewer). Sketch sizes at or above
    it have a zero tail: the exact features are already optimal there. Every argument is an integer
    ``>= 1`` (``p`` at most :data:`~sketchlab._validation.MAX_DEGREE`), else ``TypeError``/``ValueError``.
    """
    n_q, n_k, d = (check_positive_int(v, name) for v, name in ((n_q, "n_q"), (n_k, "n_k"), (d, "d")))
    return min(n_q, n_k, _feature_dim(d, check_degree(p))[0])


def _work(q: torch.Tensor, k: torch.Tensor, p: int) -> float:
    """Multiply-adds of the optimum's factorisation, ``~(n_q + n_k)·D²`` per head (for the thread count)."""
    dim = _feature_dim(q.shape[-1], p)[0]
    return math.prod(q.shape[:-2]) * min((q.shape[-2] + k.shape[-2]) * dim * dim, q.shape[-2] * k.shape[-2] * min(q.shape[-2], k.shape[-2]))


def _check_inputs(q, k, p, m, route, max_bytes):
    """The public entry points' checks; returns :func:`_plan`'s ``(q, k, p, m, d, symmetric, route)``."""
    q, k = check_pair(q, k)
    p = check_degree(p)
    check_poly_kernel_range(q, k, p, max_bytes=max_bytes)
    m = check_positive_int(m, "m (the sketch size)")
    if route not in _ROUTES:
        raise ValueError(f"route must be one of {_ROUTES}, got {route!r}")
    d = q.shape[-1]
    dim, _ = _feature_dim(d, p)
    n_q, n_k = q.shape[-2], k.shape[-2]
    limit = max_sketch_size(n_q, n_k, d, p)
    if m > limit:
        raise ValueError(
            f"m (the sketch size) must be at most min(n_q, n_k, D) = min({n_q}, {n_k}, {dim}) = {limit}, "
            f"the largest rank A = (QKᵀ)^p can have; got m={m}. Beyond it the tail is 0 and the "
            "exact features are already optimal"
        )
    return _plan(q, k, p, m, route, max_bytes)


def _plan(q, k, p, m, route, max_bytes):
    """The route and the memory checks for inputs already checked (:func:`_check_inputs`, or
    :func:`sketchlab.fit_sketch`): finite real floating ``q[..., n_q, d]``, ``k[..., n_k, d]``,
    ints ``p >= 1`` and ``1 <= m <= max_sketch_size``, a known ``route``. Trusts them.

    Returns ``(q, k, p, m, d, symmetric, route)`` with ``q, k`` in float64 and ``route`` resolved.
    """
    d = q.shape[-1]
    dim, symmetric = _feature_dim(d, p)
    n_q, n_k = q.shape[-2], k.shape[-2]
    batch = math.prod(q.shape[:-2])
    if route == "auto":
        if max(n_q, n_k) <= dim:
            route = "svd"
        else:
            route = "qr" if batch * (n_q + n_k) * dim * 8 <= max_bytes // 4 else "gram"
    if route == "svd":
        check_memory(2 * batch * n_q * n_k * 8, what=f"the kernel A and its SVD ({batch} x {n_q} x {n_k} float64)",
                     way_out="use route='gram' (memory independent of n) or fewer tokens", max_bytes=max_bytes)
    else:
        check_memory(3 * batch * dim * dim * 8, what=f"the {dim} x {dim} factors of {batch} head(s) (float64)",
                     way_out="use a smaller d or p", max_bytes=max_bytes)
    return q.to(torch.float64), k.to(torch.float64), p, m, d, symmetric, route


def _factor(q, k, p, symmetric, route, max_bytes, *, vectors: bool):
    r"""Singular values of A (padded to ``min(n_q, n_k)``) and, if ``vectors``, ``(B_Q, U, B_K, V)``.

    ``B_Q``, ``B_K`` are :math:`\psi_p(Q)^\top`, :math:`\psi_p(K)^\top` (SVD route) or
    :math:`R_Q^\top`, :math:`R_K^\top` (QR and Gram routes), so that ``W*_K = B_Q U_m Σ_m^{-1/2}`` and
    ``W*_Q = B_K V_m Σ_m^{-1/2}``.
    """
    if route == "svd" and not vectors:
        return torch.linalg.svdvals(_finite(_poly_kernel(q, k, p, max_bytes), "the kernel (QKᵀ)^p", p)), None
    n = min(q.shape[-2], k.shape[-2])
    if route == "gram":
        r_q = _feature_gram_root(q, p, symmetric, max_bytes)  # [..., N_q, D]
        r_k = _feature_gram_root(k, p, symmetric, max_bytes)  # (raises itself when ψᵀψ overflows)
    else:
        psi_q = _finite(_poly_features(q, p, symmetric, max_bytes), "ψ_p(Q)", p)  # [..., n_q, D]
        psi_k = _finite(_poly_features(k, p, symmetric, max_bytes), "ψ_p(K)", p)  # [..., n_k, D]
        if route == "svd":
            kernel = _finite(_poly_kernel(q, k, p, max_bytes), "the kernel (QKᵀ)^p", p)
            u, s, vh = torch.linalg.svd(kernel, full_matrices=False)  # A = U diag(s) Vh
            return s, (psi_q.mT, u, psi_k.mT, vh.mT)  # ψ_Qᵀ [..., D, n_q], ψ_Kᵀ [..., D, n_k]
        _, r_q = torch.linalg.qr(psi_q)  # ψ_Q = Q_Q R_Q, R_Q [..., r_q, D]
        _, r_k = torch.linalg.qr(psi_k)  # ψ_K = Q_K R_K, R_K [..., r_k, D]
    core = _finite(r_q @ r_k.mT, "the core R_Q R_Kᵀ of (QKᵀ)^p", p)  # [..., r_q, r_k]; A = Q_Q core Q_Kᵀ
    if not vectors:
        return _pad(torch.linalg.svdvals(core), n), None
    u, s, vh = torch.linalg.svd(core, full_matrices=False)
    # ψ_Qᵀ (Q_Q U_c) = R_Qᵀ U_c: the same formula as the SVD route, without forming Q_Q or Q_K
    return _pad(s, n), (r_q.mT, u, r_k.mT, vh.mT)


def _pad(s: torch.Tensor, n: int) -> torch.Tensor:
    """Append the zero singular values of A beyond those of the core: ``[..., r]`` → ``[..., n]``."""
    return torch.nn.functional.pad(s, (0, max(0, n - s.shape[-1])))[..., :n]


def optimal_sketch(q, k, p: int, m: int, *, route: str = "auto",
                   max_bytes: int = DEFAULT_MAX_BYTES) -> Optimum:
    r"""The optimal size-``m`` sketch of :math:`A = (QK^\top)^{\circ p}` (Theorem 3.1).

    Parameters
    ----------
    q : Tensor ``[..., n_q, d]``
    k : Tensor ``[..., n_k, d]``
        Same leading (batch) shape as ``q``; each batch entry is solved independently.
    p : int
        Degree, ``>= 1``.
    m : int
        Sketch size, ``1 <= m <= min(n_q, n_k, D)``; larger ``m`` is rejected with ``ValueError``
        (the tail is already 0 there).
    route : {"auto", "svd", "qr", "gram"}
        See the module docstring; all give the same sketch to round-off.
    max_bytes : int
        Memory budget for each big allocation (``ψ_p``, ``A``, the ``D × D`` factors).

    Returns
    -------
    Optimum
        ``.maps``: the pair ``(map_q, map_k)`` of :class:`OptimalMap` of ``prod(...)`` heads (the batch flattened
        row-major), with :math:`\|\phi^*_Q(Q)\phi^*_K(K)^\top - A\|_F^2 = ` ``.tail`` to float64 round-off;
        ``.singular_values`` (all of ``A``'s) and ``.route``.

    Notes
    -----
    ``W*`` is unique only up to an invertible ``m × m`` map ``G`` (``W_Q G``, ``W_K G^{-ᵀ}``), and
    up to the null space of :math:`\psi_p(Q)` when ``n < D``; this function returns the balanced
    split (:math:`\phi^*_Q(Q) = U_m\Sigma_m^{1/2}`, :math:`\phi^*_K(K) = V_m\Sigma_m^{1/2}`) and the
    Nyström choice described in the module docstring.
    """
    checked = _check_inputs(q, k, p, m, route, max_bytes)
    with hot_loop_threads(_work(*checked[:3])):
        return _optimal_sketch(*checked, max_bytes)


def _optimal_sketch(q, k, p, m, d, symmetric, route, max_bytes) -> Optimum:
    """:func:`optimal_sketch` on :func:`_plan`'s output (checked float64 inputs, resolved route); trusts it."""
    s, (b_q, u, b_k, v) = _factor(q, k, p, symmetric, route, max_bytes, vectors=True)
    s_m = s[..., :m]
    # Σ_m^{-1/2}, with singular values at round-off level (rank A < m) treated as 0: their
    # components of A are 0 to working precision and contribute nothing to the optimum.
    cutoff = s[..., :1] * max(q.shape[-2], k.shape[-2]) * torch.finfo(s.dtype).eps
    inv_root = torch.where(s_m > cutoff, s_m.clamp_min(torch.finfo(s.dtype).tiny).rsqrt(), torch.zeros_like(s_m))
    w_q = b_k @ (v[..., :m] * inv_root[..., None, :])  # [..., D, m] = ψ_Kᵀ V_m Σ_m^{-1/2}
    w_k = b_q @ (u[..., :m] * inv_root[..., None, :])  # [..., D, m] = ψ_Qᵀ U_m Σ_m^{-1/2}
    tail = (s[..., m:] ** 2).sum(-1)
    return _optimum(w_q, w_k, s, tail, p, d, symmetric, route)


def tail_bound(q, k, p: int, m: int, *, route: str = "auto", max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    r"""The Theorem 3.1 floor :math:`\sum_{i>m}\sigma_i(A)^2` for :math:`A = (QK^\top)^{\circ p}`.

    Same arguments and rules as :func:`optimal_sketch`; returns float64 ``[...]`` (batch shape).
    Computes singular values only.
    """
    checked = _check_inputs(q, k, p, m, route, max_bytes)
    with hot_loop_threads(_work(*checked[:3])):
        return _tail_bound(*checked, max_bytes)


def _tail_bound(q, k, p, m, d, symmetric, route, max_bytes) -> torch.Tensor:
    """:func:`tail_bound` on :func:`_plan`'s output (checked float64 inputs, resolved route); trusts it."""
    s, _ = _factor(q, k, p, symmetric, route, max_bytes, vectors=False)
    return (s[..., m:] ** 2).sum(-1)


def _kernel_singular_values(q, k, p: int, m: int, route: str, max_bytes: int) -> torch.Tensor:
    """All singular values of ``A`` (``[..., min(n_q, n_k)]``, descending) for checked inputs, as
    :func:`tail_bound` computes them (its floor is ``(s[..., m:]**2).sum(-1)``, ``‖A‖_F² = (s**2).sum(-1)``).
    ``m`` only steers the route; trusts its inputs (:func:`_plan`)."""
    q, k, p, m, d, symmetric, route = _plan(q, k, p, m, route, max_bytes)
    return _factor(q, k, p, symmetric, route, max_bytes, vectors=False)[0]


def min_norm_sketch(q, k, p: int, m: int, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Optimum:
    r"""The Theorem 3.1 optimum with the **minimum-norm** projectors :math:`W_Q = \psi_p(Q)^+ U_m\Sigma_m^{1/2}`.

    Same kernel as :func:`optimal_sketch` on ``(q, k)``; different features for *new* tokens when
    ``n < D`` (then ``W*`` is not unique and :func:`optimal_sketch` returns the Nyström choice).
    Computed as :math:`\psi_p(Q)^+\,(\psi_p(Q)W^*_Q)`, i.e. ``W*`` projected onto the row space
    of ``ψ_p(Q)``, only when ``n < D`` — with ``n >= D`` and ψ of full column rank both choices
    coincide. The pseudo-inverse goes through a thin QR :math:`\psi^\top = Q_\psi R` and the SVD of the
    small ``n×n`` factor, :math:`R^\top = U S V^\top`, so :math:`\psi^+ = (Q_\psi V) S^+ U^\top` with
    ``torch.linalg.pinv``'s default cut-off (singular values below ``max(n, D) · eps · σ_1`` dropped)
    at a fraction of its cost (no SVD of the ``n×D`` matrix). This is the held-out reference of
    :func:`sketchlab.fit_sketch` (``holdout_reference_rel_fro``). ``q[..., n_q, d]``, ``k[..., n_k, d]``; returns
    the pair of :class:`OptimalMap` as :func:`optimal_sketch` does.
    """
    checked = _check_inputs(q, k, p, m, "auto", max_bytes)
    with hot_loop_threads(_work(*checked[:3])):
        return _min_norm_sketch(*checked, max_bytes)


def _min_norm_sketch(q, k, p, m, d, symmetric, route, max_bytes) -> Optimum:
    """:func:`min_norm_sketch` on :func:`_plan`'s output (checked float64 inputs); trusts it."""
    opt = _optimal_sketch(q, k, p, m, d, symmetric, route, max_bytes)
    batch = q.shape[:-2]
    w = {}
    for side, x, fmap in (("q", q, opt.map_q), ("k", k, opt.map_k)):
        weights = fmap.w.reshape(*batch, *fmap.w.shape[-2:])  # [..., D, m]
        x = x.to(torch.float64)
        if x.shape[-2] >= weights.shape[-2]:
            w[side] = weights
            continue
        psi = _poly_features(x, p, symmetric, max_bytes)  # [..., n, D]
        basis, r = torch.linalg.qr(psi.mT)  # ψᵀ = basis·r: [..., D, n], [..., n, n]
        u, sv, vh = torch.linalg.svd(r.mT)  # ψ = u·diag(sv)·(basis·vhᵀ)ᵀ, singular values of ψ
        cut = max(psi.shape[-2:]) * torch.finfo(torch.float64).eps * sv[..., :1]  # pinv's default rtol
        inv = torch.where(sv > cut, 1 / sv, torch.zeros_like(sv))  # [..., n]
        coef = inv[..., :, None] * (u.mT @ (psi @ weights))  # [..., n, m]: S⁺ Uᵀ ψ W*
        w[side] = basis @ (vh.mT @ coef)  # [..., D, m]: ψ⁺ ψ W*
    return _optimum(w["q"], w["k"], opt.singular_values, opt.tail, p, d, symmetric, opt.route)


def _fit_optimal(q, k, *, p: int, m: int, seed: int = 0, route: str = "auto",
                 choice: str = "nystrom") -> tuple[OptimalMap, OptimalMap]:
    """``fit_sketch("optimal", ...)``: deterministic; ``seed`` is accepted and unused. ``choice``
    ``"nystrom"`` (:func:`optimal_sketch`) or ``"min-norm"`` (:func:`min_norm_sketch`): the optimum's maps (the
    report measures the floor itself).

    Trusts ``q, k, p, m`` as :func:`sketchlab.fit_sketch` checked them; checks its own options."""
    if route not in _ROUTES:
        raise ValueError(f"route must be one of {_ROUTES}, got {route!r}")
    if choice == "nystrom":
        return _optimal_sketch(*_plan(q, k, p, m, route, DEFAULT_MAX_BYTES), DEFAULT_MAX_BYTES).maps
    if choice == "min-norm":
        return _min_norm_sketch(*_plan(q, k, p, m, "auto", DEFAULT_MAX_BYTES), DEFAULT_MAX_BYTES).maps
    raise ValueError(f"choice must be 'nystrom' or 'min-norm', got {choice!r}")
