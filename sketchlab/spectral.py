r"""Tensor spectral norms and rank-1 residuals: Theorem 3.4 as this toolkit states it.

The LLoPS paper's Theorem 3.4 expresses the residual of the low-rank approximation of the optimal
projector through tensor spectral norms. Its appendix (the exact statement and proof) is not
available to us: **the statement below is ours** (DESIGN.md §1), and every function here follows it.

For an order-``p`` tensor ``T``, :math:`\|T\|_\sigma = \max_{\|u_j\|=1}\langle T, u_1\otimes\dots\otimes u_p\rangle`.
The best rank-1 approximation satisfies

.. math:: \min_{\lambda, u}\|T - \lambda\, u_1\otimes\dots\otimes u_p\|_F^2 = \|T\|_F^2 - \|T\|_\sigma^2

(for fixed unit ``u`` the best ``λ`` is :math:`\langle T, \otimes u\rangle`, leaving
:math:`\|T\|_F^2 - \langle T, \otimes u\rangle^2`). Hence for a rank-1 LLoPS built from ``W*``,
:math:`\|W^* - \hat W\|_F^2 \ge \sum_i (\|W^*_i\|_F^2 - \tau_i^2)`, :math:`\tau_i = \|W^*_i\|_\sigma`, with
equality for the best rank-1 CP of every column; greedy rank-``t`` deflation leaves
:math:`\|W^*_i\|_F^2 - \sum_r \tau_{i,r}^2` exactly (each step removes :math:`\tau_{i,r}^2`). Per feature,
with :math:`R_i = W^*_i - \hat W_i`,

.. math:: |\hat\phi(x)_i - \phi^*(x)_i| = |\langle R_i, x^{\otimes p}\rangle| \le \|R_i\|_\sigma \|x\|^p,

which bounds the kernel error. Spectral norms are computed by the higher-order power method
(HOPM; De Lathauwer et al. 2000) with restarts, or its shifted symmetric variant (SS-HOPM; Kolda
& Mayo 2011) for symmetric tensors. HOPM finds local maxima: the result is a *lower* bound on
``‖T‖_σ``; the certificate reports how many restarts agree with the best value and an upper bound
(the smallest spectral norm of the unfoldings), so the user can judge it.

References
----------
Qin, Deng, Cong, Sun. *Learnable Low-Rank Polynomial Sketch for Effective Linear Attention*, 2026,
Theorem 3.4 (statement here is ours).
De Lathauwer, De Moor, Vandewalle. *On the best rank-1 and rank-(R1,...,RN) approximation of
higher-order tensors*, SIAM J. Matrix Anal. Appl., 2000.
Kolda, Mayo. *Shifted power method for computing tensor eigenpairs*, SIAM J. Matrix Anal. Appl., 2011.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass

import torch

from ._validation import as_float_tensor, check_degree, check_finite, check_positive_int

__all__ = [
    "Deflation",
    "FeatureBound",
    "Rank1Residuals",
    "SpectralNorm",
    "deflate",
    "feature_bound",
    "rank1_residuals",
    "spectral_norm",
]


@dataclass
class SpectralNorm:
    """Result of :func:`spectral_norm`.

    Attributes
    ----------
    value : float
        Best :math:`\\langle T, u_1\\otimes\\dots\\otimes u_p\\rangle` found (a lower bound on ``‖T‖_σ``).
    factors : list of float64 Tensor ``[d_j]``
        Unit vectors attaining ``value`` (all equal when ``symmetric``).
    values : float64 Tensor ``[starts]``
        The value each start converged to (``restarts`` of them, more when ``confirm`` asked for them).
    agree : int
        Restarts within ``agree_tol`` (relative) of ``value``: the certificate.
    upper_bound : float
        :math:`\\min_j \\|T_{(j)}\\|_2` over the mode-``j`` unfoldings, an upper bound on ``‖T‖_σ``.
    iterations : int
        Most iterations any restart used.
    """

    value: float
    factors: list
    values: torch.Tensor
    agree: int
    upper_bound: float
    iterations: int

    @property
    def certificate(self) -> dict:
        """``{"best", "agree", "restarts", "upper_bound"}``: how far to trust ``value``."""
        return {"best": self.value, "agree": self.agree, "restarts": len(self.values), "upper_bound": self.upper_bound}


def _contract_all_but(t: torch.Tensor, vectors: list, skip: int) -> torch.Tensor:
    """``T ×_{l≠skip} u_l``: the vector ``[d_skip]``."""
    p = t.ndim
    letters = string.ascii_letters[:p]
    operands = [t] + [vectors[l] for l in range(p) if l != skip]
    spec = letters + "," + ",".join(letters[l] for l in range(p) if l != skip) + "->" + letters[skip]
    return torch.einsum(spec, *operands)


def _value(t: torch.Tensor, vectors: list) -> torch.Tensor:
    return torch.dot(_contract_all_but(t, vectors, t.ndim - 1), vectors[-1])


def _unfold(t: torch.Tensor, mode: int) -> torch.Tensor:
    return t.movedim(mode, 0).reshape(t.shape[mode], -1)  # [d_mode, Π_{l≠mode} d_l]


def _check_tensor(t, name: str = "T") -> torch.Tensor:
    t = as_float_tensor(t, name).to(torch.float64)
    if t.ndim < 1 or t.numel() == 0:
        raise ValueError(f"{name} must be a non-empty tensor of order >= 1, got shape {tuple(t.shape)}")
    check_finite(t, name)
    return t


def _hopm(t, vectors, max_iter, tol):
    value = _value(t, vectors)
    for it in range(1, max_iter + 1):
        for j in range(t.ndim):
            v = _contract_all_but(t, vectors, j)
            norm = torch.linalg.vector_norm(v)
            if norm == 0:
                return vectors, torch.zeros((), dtype=t.dtype), it
            vectors[j] = v / norm
        new = _value(t, vectors)
        if abs(float(new - value)) <= tol * max(abs(float(new)), 1e-300):
            return vectors, new, it
        value = new
    return vectors, value, max_iter


def _ss_hopm(t, x, shift, max_iter, tol):
    """SS-HOPM for the largest ``λ = T x^p`` on the unit sphere (Kolda & Mayo, convex shift)."""
    p = t.ndim
    value = _value(t, [x] * p)
    for it in range(1, max_iter + 1):
        v = _contract_all_but(t, [x] * p, p - 1) + shift * x
        x = v / torch.linalg.vector_norm(v)
        new = _value(t, [x] * p)
        if abs(float(new - value)) <= tol * max(abs(float(new)), 1e-300):
            return x, new, it
        value = new
    return x, value, max_iter


def spectral_norm(
    T,
    *,
    restarts: int = 8,
    seed: int = 0,
    symmetric: bool = False,
    max_iter: int = 2000,
    tol: float = 1e-13,
    agree_tol: float = 1e-8,
    shift: float | None = None,
    confirm: int = 1,
    max_restarts: int = 64,
) -> SpectralNorm:
    r"""Tensor spectral norm :math:`\|T\|_\sigma = \max_{\|u_j\|=1}\langle T, u_1\otimes\dots\otimes u_p\rangle`.

    Parameters
    ----------
    T : Tensor ``[d_1, ..., d_p]``
        Any order ``p >= 1`` (``p = 1``: the vector norm; ``p = 2``: the matrix 2-norm).
    restarts : int
        Number of starts: the first from the leading left singular vectors of the unfoldings
        (HOSVD), the others Gaussian from ``seed``.
    seed : int
        Seeds the random starts (same seed, same result).
    symmetric : bool
        ``T`` must be symmetric (all ``d_j`` equal, invariant under index permutations, to
        ``1e-12`` relative); then SS-HOPM searches ``u_1 = … = u_p`` for the largest
        :math:`|T x^p|`, which equals ``‖T‖_σ`` for symmetric tensors (Banach 1938).
    max_iter, tol : int, float
        Per start: stop when the value changes by less than ``tol`` (relative).
    agree_tol : float
        Relative tolerance for counting agreeing restarts in the certificate.
    shift : float or None
        SS-HOPM shift ``α``; ``None`` takes ``(p-1)·‖T‖_F``, which exceeds the bound of Kolda &
        Mayo (2011) and makes every iteration monotone (slower convergence for larger ``α``).
    confirm : int
        Stop on the certificate: after the ``restarts`` starts, keep drawing random starts until
        ``confirm`` of them agree (``agree_tol``) on the best value, or ``max_restarts`` starts
        were made. ``1`` (default): exactly ``restarts`` starts. A best value that only one start
        reached may be a local maximum; ``confirm=2`` asks a second start to find it too.
    max_restarts : int
        Most starts ``confirm`` may use (at least ``restarts``).

    Returns
    -------
    SpectralNorm
        ``value`` (a lower bound on ``‖T‖_σ``, attained by ``factors``) and the certificate.

    Notes
    -----
    Each HOPM update :math:`u_j \leftarrow T\times_{l\ne j}u_l / \|\cdot\|` cannot decrease
    :math:`\langle T,\otimes u\rangle`; the limit is a local maximum. Restarts guard against poor ones.
    """
    t = _check_tensor(T)
    restarts = check_positive_int(restarts, "restarts")
    max_iter = check_positive_int(max_iter, "max_iter")
    confirm = check_positive_int(confirm, "confirm")
    max_restarts = max(restarts, check_positive_int(max_restarts, "max_restarts"))
    p = t.ndim
    fro = float(torch.linalg.vector_norm(t))
    upper = min(float(torch.linalg.matrix_norm(_unfold(t, j), ord=2)) for j in range(p)) if p > 1 else fro
    if p == 1 or fro == 0.0:
        unit = [t / fro if fro > 0 else torch.zeros_like(t)]
        if fro == 0.0:
            unit = [torch.nn.functional.normalize(torch.ones(n, dtype=torch.float64, device=t.device), dim=0)
                    for n in t.shape]
        return SpectralNorm(fro, unit, torch.full((restarts,), fro, dtype=torch.float64, device=t.device),
                            restarts, upper, 0)
    # Random starts come from a CPU generator (same seed, same starts on every device) and are then
    # moved to T's device, where all contractions run.
    generator = torch.Generator().manual_seed(seed)
    if symmetric:
        d = t.shape[0]
        if any(n != d for n in t.shape):
            raise ValueError(f"symmetric=True needs a cubical tensor (all sizes equal), got shape {tuple(t.shape)}")
        for j in range(1, p):
            perm = list(range(p))
            perm[0], perm[j] = perm[j], perm[0]
            if float(torch.linalg.vector_norm(t - t.permute(perm))) > 1e-12 * fro:
                raise ValueError(f"symmetric=True but T is not symmetric under swapping modes 0 and {j}")
        alpha = (p - 1) * fro if shift is None else float(shift)
        if not math.isfinite(alpha) or alpha < 0:
            raise ValueError(f"shift must be a finite number >= 0, got {shift!r}")
    best, best_factors, values, most = -math.inf, None, [], 0
    r = 0
    while r < restarts or (
        r < max_restarts and sum(v >= best - agree_tol * abs(best) for v in values) < confirm
    ):
        if r == 0:
            starts = [torch.linalg.svd(_unfold(t, j), full_matrices=False)[0][:, 0] for j in range(p)]
        else:
            starts = [
                torch.nn.functional.normalize(torch.randn(n, generator=generator, dtype=torch.float64), dim=0).to(t.device)
                for n in t.shape
            ]
        if symmetric:
            # even p: the extreme of T x^p may be negative, so search both T and -T; odd p: λ(-x) = -λ(x)
            candidates = []
            x0 = starts[0]
            if p % 2 == 1 and float(_value(t, [x0] * p)) < 0:
                x0 = -x0  # odd p: T(-x)^p = -T x^p; start on the positive side (-u is a fixed point too)
            for sign in ((1.0, -1.0) if p % 2 == 0 else (1.0,)):
                x, val, it = _ss_hopm(sign * t, x0, alpha, max_iter, tol)
                candidates.append((float(val), [x] * p, it, sign))
            val, vectors, it, sign = max(candidates, key=lambda c: c[0])
            if sign < 0:  # |λ| of T at x with λ < 0: flip one factor so that ⟨T, ⊗u⟩ = |λ|
                vectors = [-vectors[0]] + vectors[1:]
        else:
            vectors, val, it = _hopm(t, list(starts), max_iter, tol)
            val = float(val)
        values.append(val)
        most = max(most, it)
        if val > best:
            best, best_factors = val, vectors
        r += 1
    values_t = torch.tensor(values, dtype=torch.float64, device=t.device)
    agree = int((values_t >= best - agree_tol * abs(best)).sum())
    return SpectralNorm(best, best_factors, values_t, agree, upper, most)


@dataclass
class Rank1Residuals:
    """Per-column Theorem 3.4 quantities of a projector (see :func:`rank1_residuals`).

    All float64 ``[..., m]``: ``frobenius_sq`` = :math:`\\|W_i\\|_F^2`, ``tau`` = :math:`\\|W_i\\|_\\sigma`,
    ``residual`` = :math:`\\|W_i\\|_F^2 - \\tau_i^2` (the best rank-1 error), ``agree`` (int64) and
    ``upper_bound`` from each column's certificate.
    """

    frobenius_sq: torch.Tensor
    tau: torch.Tensor
    residual: torch.Tensor
    agree: torch.Tensor
    upper_bound: torch.Tensor

    @property
    def fraction(self) -> torch.Tensor:
        """:math:`\\sum_i \\text{residual}_i / \\sum_i \\|W_i\\|_F^2` per batch entry: 0 when every column is rank 1."""
        return self.residual.sum(-1) / self.frobenius_sq.sum(-1).clamp_min(torch.finfo(torch.float64).tiny)


def rank1_residuals(
    w, d: int, p: int, *, restarts: int = 8, seed: int = 0, symmetric: bool = False, **options
) -> Rank1Residuals:
    r"""For each column of ``w[..., d**p, m]``: :math:`\|W_i\|_F^2`, :math:`\tau_i = \|W_i\|_\sigma`, and
    the best rank-1 residual :math:`\|W_i\|_F^2 - \tau_i^2` (Theorem 3.4, our statement).

    Column ``i``, reshaped row-major to ``d × … × d``, is the tensor ``W_i``. ``symmetric`` selects
    SS-HOPM (use it for symmetric projectors such as :meth:`sketchlab.OptimalMap.projector`
    in the full basis). ``options`` go to :func:`spectral_norm`. Since HOPM gives a lower bound
    on ``τ_i``, ``residual`` is an upper bound on the true best rank-1 error (equal when the
    certificate is tight).
    """
    w = as_float_tensor(w, "w").to(torch.float64)
    d = check_positive_int(d, "d")
    p = check_degree(p)
    if w.ndim < 2 or w.shape[-2] != d**p:
        raise ValueError(f"w must have shape [..., d**p={d**p}, m] for d={d}, p={p}, got {tuple(w.shape)}")
    batch, m = w.shape[:-2], w.shape[-1]
    flat = w.reshape(-1, d**p, m)  # [B, d^p, m]
    # on w's device, so that fro_sq - tau**2 below (and any use with w) stays on one device
    tau = torch.zeros(flat.shape[0], m, dtype=torch.float64, device=w.device)
    agree = torch.zeros(flat.shape[0], m, dtype=torch.int64, device=w.device)
    upper = torch.zeros(flat.shape[0], m, dtype=torch.float64, device=w.device)
    for b in range(flat.shape[0]):
        for i in range(m):
            res = spectral_norm(flat[b, :, i].reshape((d,) * p), restarts=restarts, seed=seed, symmetric=symmetric, **options)
            tau[b, i], agree[b, i], upper[b, i] = res.value, res.agree, res.upper_bound
    fro_sq = (flat**2).sum(-2)  # [B, m]
    shape = (*batch, m)
    return Rank1Residuals(
        frobenius_sq=fro_sq.reshape(shape),
        tau=tau.reshape(shape),
        residual=(fro_sq - tau**2).clamp_min(0.0).reshape(shape),
        agree=agree.reshape(shape),
        upper_bound=upper.reshape(shape),
    )


@dataclass
class Deflation:
    """Greedy rank-``t`` deflation of a tensor (see :func:`deflate`).

    Attributes
    ----------
    values : float64 Tensor ``[t]``
        :math:`\\tau_r = \\|R_{r-1}\\|_\\sigma` found at step ``r`` (``R_0 = T``).
    factors : list of lists of float64 Tensor ``[d_j]``
        The unit factors of each step.
    approximation : float64 Tensor, shape of ``T``
        :math:`\\sum_r \\tau_r u_{r,1}\\otimes\\dots\\otimes u_{r,p}`.
    residual : float64 Tensor, shape of ``T``
        ``T - approximation``.
    residual_sq : float64 Tensor ``[t]``
        :math:`\\|R_r\\|_F^2` after each step; equals :math:`\\|T\\|_F^2 - \\sum_{s\\le r}\\tau_s^2` exactly.
    """

    values: torch.Tensor
    factors: list
    approximation: torch.Tensor
    residual: torch.Tensor
    residual_sq: torch.Tensor


def _outer(vectors: list) -> torch.Tensor:
    out = vectors[0]
    for v in vectors[1:]:
        out = out[..., None] * v
    return out


def deflate(T, rank: int, *, restarts: int = 8, seed: int = 0, symmetric: bool = False, **options) -> Deflation:
    r"""Greedy rank-``rank`` approximation: repeatedly subtract the best rank-1 term of the residual.

    Step ``r``: :math:`\tau_r, u_r = ` :func:`spectral_norm` of :math:`R_{r-1}`, then
    :math:`R_r = R_{r-1} - \tau_r\,u_{r,1}\otimes\dots\otimes u_{r,p}`. Because
    :math:`\tau_r = \langle R_{r-1}, \otimes u_r\rangle` and :math:`\|\otimes u_r\|_F = 1`,
    :math:`\|R_r\|_F^2 = \|R_{r-1}\|_F^2 - \tau_r^2` holds exactly, whatever local maximum HOPM
    returns. Greedy deflation is not the best rank-``t`` CP in general (for ``p >= 3``), but it is
    the decomposition DESIGN.md's Theorem 3.4 statement uses. ``symmetric`` keeps every term
    symmetric (SS-HOPM); the residual of a symmetric tensor then stays symmetric.
    """
    t = _check_tensor(T)
    rank = check_positive_int(rank, "rank")
    residual = t.clone()
    values, factors, residual_sq = [], [], []
    for r in range(rank):
        res = spectral_norm(residual, restarts=restarts, seed=seed + r, symmetric=symmetric, **options)
        term = res.value * _outer(res.factors) if t.ndim > 1 else res.value * res.factors[0]
        residual = residual - term
        values.append(res.value)
        factors.append(res.factors)
        residual_sq.append(float((residual**2).sum()))
    return Deflation(
        values=torch.tensor(values, dtype=torch.float64, device=t.device),
        factors=factors,
        approximation=t - residual,
        residual=residual,
        residual_sq=torch.tensor(residual_sq, dtype=torch.float64, device=t.device),
    )


@dataclass
class FeatureBound:
    """Per-feature errors and their Theorem 3.4 bounds (see :func:`feature_bound`).

    ``error`` and ``bound`` are float64 ``[n, m]``; ``sigma`` is :math:`\\|R_i\\|_\\sigma` ``[m]`` (HOPM
    value) and ``sigma_upper`` the certified upper bound ``[m]``; ``certified`` uses it in place
    of ``sigma``, so ``error <= certified`` holds whatever HOPM found.
    """

    error: torch.Tensor
    bound: torch.Tensor
    certified: torch.Tensor
    sigma: torch.Tensor
    sigma_upper: torch.Tensor


def feature_bound(residual, x, p: int, *, restarts: int = 8, seed: int = 0, symmetric: bool = False, **options) -> FeatureBound:
    r"""The per-feature bound :math:`|\hat\phi(x)_i - \phi^*(x)_i| \le \|R_i\|_\sigma \|x\|^p`.

    Parameters
    ----------
    residual : Tensor ``[d**p, m]``
        :math:`R = W^* - \hat W` in the full basis (e.g. ``map_q.projector()[h] - llops_projector(llops_q.theta)[h]`` of head ``h``
        of an optimal and an LLoPS query map).
    x : Tensor ``[n, d]``
    p : int
    restarts, seed, symmetric, options
        For :func:`spectral_norm` on each column.

    Returns
    -------
    FeatureBound
        ``error[a, i] = |ψ_p(x_a)ᵀ R_i| = |⟨R_i, x_a^{⊗p}⟩|`` and ``bound[a, i] = ‖R_i‖_σ ‖x_a‖^p``.

    Notes
    -----
    :math:`\langle R_i, x^{\otimes p}\rangle = \|x\|^p \langle R_i, \hat x^{\otimes p}\rangle` and
    :math:`\hat x^{\otimes p}` is a unit rank-1 tensor, hence the bound (Theorem 3.4, our statement).
    Summed over features it bounds the kernel error:
    :math:`|\hat\phi_Q(q)^\top\hat\phi_K(k) - \phi^*_Q(q)^\top\phi^*_K(k)| \le
    \sum_i |\hat\phi_{Q,i}(q)|\,\epsilon_{K,i}(k) + \epsilon_{Q,i}(q)\,|\phi^*_{K,i}(k)|`.
    """
    from .polynomial import poly_features

    residual = as_float_tensor(residual, "residual").to(torch.float64)
    x = as_float_tensor(x, "x").to(torch.float64)
    p = check_degree(p)
    if x.ndim != 2:
        raise ValueError(f"x must have shape [n, d], got {tuple(x.shape)}")
    d = x.shape[-1]
    if residual.ndim != 2 or residual.shape[0] != d**p:
        raise ValueError(f"residual must have shape [d**p={d**p}, m] for d={d}, p={p}, got {tuple(residual.shape)}")
    res = rank1_residuals(residual, d, p, restarts=restarts, seed=seed, symmetric=symmetric, **options)
    error = (poly_features(x, p) @ residual).abs()  # [n, m]
    scale = torch.linalg.vector_norm(x, dim=-1) ** p  # [n]
    return FeatureBound(
        error=error,
        bound=scale[:, None] * res.tau[None, :],
        certified=scale[:, None] * res.upper_bound[None, :],
        sigma=res.tau,
        sigma_upper=res.upper_bound,
    )
