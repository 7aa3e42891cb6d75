r"""LLoPS: the learnable low-rank polynomial sketch.

:math:`\Theta \in \mathbb R^{t \times p \times d \times m}` defines
:math:`\phi(x)_i = \sum_{r=1}^t \prod_{j=1}^p \langle \theta_{r,j,:,i}, x\rangle`, i.e.
:math:`\phi(X) = \sum_r \prod_j (X\Theta_{r,j})` (element-wise product over ``j``). This equals
:math:`\psi_p(x)^\top W` where column ``i`` of ``W``, reshaped to a ``d × … × d`` tensor, is the
rank-``t`` CP tensor :math:`\sum_r \theta_{r,1,:,i} \otimes \dots \otimes \theta_{r,p,:,i}`.

Fits (all registered as ``fit_sketch("llops", q, k, p=, m=, rank=, method=, init=, ...)``):

``method="direct"`` (default)
    minimises the kernel loss :func:`kernel_loss` ``‖φ_Q(Q)φ_K(K)ᵀ − A‖_F²`` over Θ by exact
    block coordinate descent (alternating least squares with one block per feature column,
    side and factor; see :func:`fit_llops_direct`).
``method="cp"``
    a CP decomposition (tensorly ``parafac``) of every column tensor of the Theorem 3.1 optimal
    projector ``W*`` (see :func:`fit_llops_cp`). ``W*`` is only defined up to an invertible
    ``m × m`` map ``G`` (``W*_Q G``, ``W*_K G^{-ᵀ}`` give the same kernel); the balanced SVD split
    of :func:`sketchlab.optimal_sketch` gives columns far from rank 1 (on the benchmark stand-in
    ~40 % of ‖W*‖_F² lies outside the best rank-1 terms; ``gauge="aligned"`` lowers it to ~27 %),
    and the CP minimises the Frobenius error of ``W``, not the kernel error on the data, so its
    kernel is poor either way (tens of times the optimum in ``analysis/results/fit.md``). The
    direct fit avoids both issues; ``init="cp"`` is offered, not recommended.
``method="adam"``
    plain gradient descent (``torch.optim.Adam``) on the same loss with a fixed step budget: the
    naive baseline the benchmark contrasts with.

References
----------
Qin, Deng, Cong, Sun. *Learnable Low-Rank Polynomial Sketch for Effective Linear Attention*, 2026, §3.2.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn
from tqdm import tqdm

from ._validation import as_float_tensor, check_degree, check_pair, check_positive_int
from .fit import register_sketch
from .objective import DEFAULT_LR, DEFAULT_STEPS, check_finite_loss, kernel_loss, train_kernel_sketch
from .sketch import Sketch

__all__ = [
    "GAUGES",
    "INITS",
    "METHODS",
    "LLoPS",
    "aligned_gauge",
    "fit_llops_adam",
    "fit_llops_cp",
    "fit_llops_direct",
    "llops_features",
    "llops_features_naive",
    "llops_init",
    "llops_projector",
    "llops_projector_naive",
    "projector_to_theta",
]

#: Initialisations accepted by the fits (besides an :class:`LLoPS` instance or an object with ``as_llops()``).
INITS = ("svd", "random", "cp", "based", "psf")


def _check_theta(theta, name: str = "theta") -> torch.Tensor:
    theta = as_float_tensor(theta, name)
    if theta.ndim < 4 or 0 in theta.shape[-4:]:
        raise ValueError(f"{name} must have shape [..., t, p, d, m] with every size >= 1, got {tuple(theta.shape)}")
    return theta


def llops_features(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    r"""LLoPS features :math:`\phi(X) = \sum_r \prod_j X\Theta_{r,j}`.

    Parameters
    ----------
    x : Tensor ``[..., n, d]``
    theta : Tensor ``[..., t, p, d, m]``
        Leading axes broadcast against those of ``x`` (e.g. ``[L, H]`` for one map per head).

    Returns
    -------
    Tensor ``[..., n, m]``. Cost ``O(n d m t p)``.
    """
    proj = x[..., None, None, :, :] @ theta  # [..., t, p, n, m] = ⟨θ_{r,j,:,i}, x⟩
    return proj.prod(dim=-3).sum(dim=-3)  # ∏ over j, then Σ over r


def llops_features_naive(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Float64 twin of :func:`llops_features` for ``x[n, d]``, ``theta[t, p, d, m]``: loops over r, j."""
    x = as_float_tensor(x, "x").to(torch.float64)
    theta = _check_theta(theta).to(torch.float64)
    if x.ndim != 2 or theta.ndim != 4 or x.shape[-1] != theta.shape[-2]:
        raise ValueError(f"llops_features_naive takes x[n, d] and theta[t, p, d, m], got {tuple(x.shape)}, {tuple(theta.shape)}")
    t, p, _, m = theta.shape
    out = torch.zeros(x.shape[0], m, dtype=torch.float64)
    for r in range(t):
        term = torch.ones(x.shape[0], m, dtype=torch.float64)
        for j in range(p):
            term = term * (x @ theta[r, j])  # [n, m]
        out = out + term
    return out


def llops_projector(theta: torch.Tensor) -> torch.Tensor:
    r"""The projector ``W`` with :math:`\phi(x) = \psi_p(x)^\top W`, in the full ``d**p`` basis.

    Parameters
    ----------
    theta : Tensor ``[..., t, p, d, m]``

    Returns
    -------
    Tensor ``[..., d**p, m]``; column ``i`` is
    :math:`\mathrm{vec}\big(\sum_r \theta_{r,1,:,i}\otimes\dots\otimes\theta_{r,p,:,i}\big)` in the
    row-major tuple order of :func:`sketchlab.poly_features`. Memory ``d**p · m`` per head: for
    small ``d`` (tests and theory).
    """
    theta = _check_theta(theta)
    *batch, t, p, d, m = theta.shape
    out = theta[..., 0, :, :]  # [..., t, d, m]
    for j in range(1, p):
        out = out[..., :, None, :] * theta[..., j, None, :, :]  # [..., t, d^j, d, m]
        out = out.reshape(*batch, t, d ** (j + 1), m)  # [..., t, d^(j+1), m]
    return out.sum(-3)  # Σ_r: [..., d^p, m]


def llops_projector_naive(theta: torch.Tensor) -> torch.Tensor:
    """Float64 twin of :func:`llops_projector` for ``theta[t, p, d, m]``: one loop per index tuple."""
    theta = _check_theta(theta).to(torch.float64)
    if theta.ndim != 4:
        raise ValueError(f"llops_projector_naive takes theta[t, p, d, m], got {tuple(theta.shape)}")
    t, p, d, m = theta.shape
    out = torch.zeros(d**p, m, dtype=torch.float64)
    for row, idx in enumerate(itertools.product(range(d), repeat=p)):
        for i in range(m):
            for r in range(t):
                value = 1.0
                for j, a in enumerate(idx):
                    value *= float(theta[r, j, a, i])
                out[row, i] += value
    return out


class LLoPS(nn.Module, Sketch):
    r"""LLoPS feature maps with parameters ``theta_q``, ``theta_k`` of shape ``[..., t, p, d, m]``.

    Parameters
    ----------
    theta_q : Tensor ``[..., t, p, d, m]``
        Query-side factors; leading axes (e.g. ``[L, H]``) hold one map per head.
    theta_k : Tensor or None
        Key-side factors, same shape; ``None`` ties the key map to the query map.

    Notes
    -----
    :meth:`projector` materialises ``W ∈ R^{d^p × m}`` (small ``d``; tests and theory) and
    :meth:`from_projector` builds Θ from a projector by a CP of each column. Fits:
    ``fit_sketch("llops", ...)`` (module docstring). The kernel is
    :math:`\hat A = \phi_Q(Q)\phi_K(K)^\top = \psi_p(Q) W_Q W_K^\top \psi_p(K)^\top`.
    """

    def __init__(self, theta_q: torch.Tensor, theta_k: torch.Tensor | None = None):
        super().__init__()
        theta_q = _check_theta(theta_q, "theta_q")
        self.theta_q = nn.Parameter(theta_q.detach().clone())
        if theta_k is None:
            self.theta_k = None
        else:
            theta_k = _check_theta(theta_k, "theta_k")
            if theta_k.shape != theta_q.shape:
                raise ValueError(
                    f"theta_k must have the shape of theta_q {tuple(theta_q.shape)}, got {tuple(theta_k.shape)}"
                )
            self.theta_k = nn.Parameter(theta_k.detach().clone())

    @property
    def tied(self) -> bool:
        """Whether the key map shares the query map's parameters."""
        return self.theta_k is None

    @property
    def rank(self) -> int:
        """CP rank ``t``."""
        return self.theta_q.shape[-4]

    @property
    def degree(self) -> int:
        return self.theta_q.shape[-3]

    @property
    def num_features(self) -> int:
        return self.theta_q.shape[-1]

    @property
    def num_parameters(self) -> int:
        per_side = self.theta_q[(0,) * (self.theta_q.ndim - 4)].numel()
        return per_side if self.tied else 2 * per_side

    def features_q(self, x: torch.Tensor) -> torch.Tensor:
        """:math:`\\phi_Q(x)`: ``x[..., n, d]`` → ``[..., n, m]``, in the dtype of ``theta_q``."""
        return llops_features(x.to(self.theta_q.dtype), self.theta_q)

    def features_k(self, x: torch.Tensor) -> torch.Tensor:
        """:math:`\\phi_K(x)`: ``x[..., n, d]`` → ``[..., n, m]`` (the query map when tied)."""
        theta = self.theta_q if self.theta_k is None else self.theta_k
        return llops_features(x.to(theta.dtype), theta)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The approximate kernel ``φ_Q(q) φ_K(k)ᵀ``, ``[..., n_q, n_k]``."""
        return self.kernel(q, k)

    def projector(self, side: str = "q") -> torch.Tensor:
        """The projector of one side (``"q"`` or ``"k"``), ``[..., d**p, m]`` (see :func:`llops_projector`).

        ``features_q(x) == poly_features(x, p) @ projector("q")`` to round-off.
        """
        if side not in ("q", "k"):
            raise ValueError(f"side must be 'q' or 'k', got {side!r}")
        theta = self.theta_q if side == "q" or self.theta_k is None else self.theta_k
        return llops_projector(theta.detach())

    @classmethod
    def from_projector(
        cls,
        w_q,
        w_k=None,
        rank: int = 1,
        *,
        p: int,
        seed: int = 0,
        n_iter_max: int = 200,
        tol: float = 1e-10,
    ) -> "LLoPS":
        r"""Rank-``rank`` LLoPS from projectors ``w[..., d**p, m]`` by a CP of each column tensor.

        Each column of ``w_q`` (and ``w_k``), reshaped to a ``d × … × d`` tensor, is decomposed by
        tensorly's ``parafac`` (see :func:`projector_to_theta`). ``w_k=None`` ties the key map to
        the query map. ``p`` is required: ``d**p`` alone does not determine ``d`` and ``p``.
        """
        theta_q = projector_to_theta(w_q, p, rank, seed=seed, n_iter_max=n_iter_max, tol=tol, name="w_q")
        theta_k = None
        if w_k is not None:
            theta_k = projector_to_theta(w_k, p, rank, seed=seed, n_iter_max=n_iter_max, tol=tol, name="w_k")
        return cls(theta_q, theta_k)


# ----------------------------------------------------------------------------------------------
# CP of projector columns
# ----------------------------------------------------------------------------------------------


def projector_to_theta(
    w, p: int, rank: int = 1, *, seed: int = 0, n_iter_max: int = 200, tol: float = 1e-10, name: str = "w"
) -> torch.Tensor:
    r"""Θ ``[..., rank, p, d, m]`` from a projector ``w[..., d**p, m]``: a CP of each column tensor.

    Column ``i`` of ``w`` is reshaped (row-major) to a ``d × … × d`` tensor and decomposed by
    ``tensorly.decomposition.parafac`` (rank ``rank``, SVD initialisation, inside
    ``tl.backend_context("pytorch")``), in float64. ``p == 1`` is exact: ``θ_{r,1,:,i} = w_i / rank``.

    Notes
    -----
    For ``rank = 1`` the best possible error is, per column, :math:`\|W_i\|_F^2 - \|W_i\|_\sigma^2`
    (Theorem 3.4 as stated in DESIGN.md; see :func:`sketchlab.spectral.rank1_residuals`).
    ``parafac`` is a local method: for ``p >= 3`` it may stop above that floor.
    """
    import tensorly as tl
    from tensorly.decomposition import parafac

    p = check_degree(p)
    rank = check_positive_int(rank, "rank")
    w = as_float_tensor(w, name)
    if w.ndim < 2:
        raise ValueError(f"{name} must have shape [..., d**p, m], got {tuple(w.shape)}")
    d = round(w.shape[-2] ** (1.0 / p))
    if d < 1 or d**p != w.shape[-2]:
        raise ValueError(f"{name} must have d**p rows for p={p}; {w.shape[-2]} is not a {p}-th power")
    *batch, _, m = w.shape
    flat = w.detach().to(torch.float64).reshape(-1, d**p, m)  # [B, d^p, m]
    theta = torch.zeros(flat.shape[0], rank, p, d, m, dtype=torch.float64, device=w.device)
    if p == 1:
        theta[:, :, 0] = flat[:, None] / rank
        return theta.reshape(*batch, rank, p, d, m).to(w.dtype)
    with tl.backend_context("pytorch"):
        for b in range(flat.shape[0]):
            for i in range(m):
                tensor = flat[b, :, i].reshape((d,) * p)  # [d, ..., d]
                if float(tensor.abs().max()) == 0.0:
                    continue  # the zero tensor: all factors zero
                cp = parafac(tensor, rank, n_iter_max=n_iter_max, tol=tol, init="svd", random_state=seed)
                weights, factors = cp
                for j in range(p):
                    fac = factors[j]  # [d, rank]
                    if j == 0:
                        fac = fac * weights[None, :]
                    theta[b, :, j, :, i] = fac.mT
    return theta.reshape(*batch, rank, p, d, m).to(w.dtype)


# ----------------------------------------------------------------------------------------------
# The loss
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# Initialisation
# ----------------------------------------------------------------------------------------------


def _svd_directions(q: torch.Tensor, k: torch.Tensor):
    """``u, s, v`` with ``Q Kᵀ = Q U diag(s) Vᵀ Kᵀ``: the singular directions of ``QKᵀ`` in ``R^d``.

    From thin QR factors ``Q = Q_1 R_1``, ``K = Q_2 R_2`` and the SVD ``R_1 R_2ᵀ = X S Yᵀ``:
    ``U = R_1⁺ X``, ``V = R_2⁺ Y``. Shapes ``[B, d, r]``, ``[B, r]``, ``[B, d, r]``, ``r = min(n_q, n_k, d)``.
    """
    _, r1 = torch.linalg.qr(q)  # [B, min(n_q, d), d]
    _, r2 = torch.linalg.qr(k)  # [B, min(n_k, d), d]
    x, s, yh = torch.linalg.svd(r1 @ r2.mT, full_matrices=False)
    u = torch.linalg.pinv(r1) @ x  # [B, d, r]
    v = torch.linalg.pinv(r2) @ yh.mT  # [B, d, r]
    return u, s, v


def _init_svd(q, k, p, m, generator):
    r"""Rank-1 Θ from the leading terms of the expansion of ``(Σ_a s_a (u_aᵀq)(v_aᵀk))^p``.

    ``(qᵀk)^p = Σ_α c_α ∏_j s_{α_j} (u_{α_j}ᵀq) (v_{α_j}ᵀk)`` over multisets ``α`` (``c_α`` the
    multinomial coefficient): each term is a rank-1 LLoPS column. The ``m`` terms with the
    largest Frobenius norm on the data, :math:`c_\alpha\prod_j s_{\alpha_j}\,
    \|\prod_j Qu_{\alpha_j}\|\,\|\prod_j Kv_{\alpha_j}\|`, are kept (ranking by ``c_α ∏ s`` alone
    ignores how the data weights the products), the coefficient split evenly over the ``2p`` factors. If there
    are fewer than ``m`` terms (``C(r+p-1, p) < m``), the remaining columns get small Gaussian
    factors (``1e-3`` of the others' RMS) so that the fit can use them.
    """
    u, s, v = _svd_directions(q, k)
    B, d, r = u.shape
    combos = torch.tensor(list(itertools.combinations_with_replacement(range(r), p)), device=q.device).reshape(-1, p)
    log_c = torch.tensor(
        [math.lgamma(p + 1) - sum(math.lgamma(len(list(g)) + 1) for _, g in itertools.groupby(row)) for row in combos.tolist()],
        dtype=torch.float64,
        device=q.device,
    )
    log_s = s.clamp_min(torch.finfo(torch.float64).tiny).log()  # [B, r]
    score = log_s[:, combos].sum(-1) + log_c  # [B, C] log(c_α ∏ s)
    tiny = torch.finfo(torch.float64).tiny
    energy = torch.zeros_like(score)  # [B, C] log(‖∏_j Q u_{α_j}‖ ‖∏_j K v_{α_j}‖)
    for b in range(B):  # one head at a time: the products are [n, C], C = C(r+p-1, p)
        for proj in (q[b] @ u[b], k[b] @ v[b]):  # [n, r]
            prod = proj[:, combos[:, 0]]  # [n, C]
            for j in range(1, p):
                prod = prod * proj[:, combos[:, j]]
            energy[b] += prod.norm(dim=0).clamp_min(tiny).log()
    take = min(m, combos.shape[0])
    top = (score + energy).topk(take, dim=-1).indices  # [B, take] by ‖term of A‖_F
    chosen = combos[top]  # [B, take, p]
    scale = (score.gather(-1, top) / (2 * p)).exp()  # [B, take] per-factor share of c_α ∏ s
    theta_q = torch.zeros(B, 1, p, d, m, dtype=torch.float64, device=q.device)
    theta_k = torch.zeros_like(theta_q)
    for j in range(p):
        idx = chosen[..., j][:, None, :].expand(B, d, take)  # [B, d, take]
        theta_q[:, 0, j, :, :take] = u.gather(-1, idx) * scale[:, None, :]
        theta_k[:, 0, j, :, :take] = v.gather(-1, idx) * scale[:, None, :]
    if take < m:
        for theta in (theta_q, theta_k):
            rms = theta[..., :take].pow(2).mean((1, 2, 3, 4)).sqrt()  # [B]
            noise = torch.randn(B, 1, p, d, m - take, generator=generator, dtype=torch.float64).to(q.device)
            theta[..., take:] = noise * (1e-3 * rms)[:, None, None, None, None]
    return theta_q, theta_k


def _init_random(q, k, a, rank, p, m, generator):
    """Gaussian Θ scaled so that ``φ_Q φ_Kᵀ`` has the root-mean-square size of ``A``."""
    B, _, d = q.shape
    x_rms = torch.cat([q, k], -2).pow(2).sum(-1).mean(-1).sqrt()  # [B]
    a_rms = a.pow(2).mean((-2, -1)).sqrt()  # [B]
    sigma = (a_rms / math.sqrt(m * rank)).pow(1.0 / (2 * p)) / x_rms  # [B]
    shape = (B, rank, p, d, m)
    theta_q = torch.randn(shape, generator=generator, dtype=torch.float64) * sigma[:, None, None, None, None]
    theta_k = torch.randn(shape, generator=generator, dtype=torch.float64) * sigma[:, None, None, None, None]
    return theta_q.to(q.device), theta_k.to(q.device)


def _pad(theta_q, theta_k, axis: int, size: int, generator, relative=1e-3):
    """Extend Θ ``[B, t, p, d, m]`` along ``axis`` (1: CP terms, 4: columns) to ``size`` with small
    Gaussian entries (``relative`` × each head's RMS), so a smaller special case can start a bigger fit."""
    have = theta_q.shape[axis]
    if have > size:
        what = "CP terms" if axis == 1 else "columns"
        raise ValueError(f"init has {have} {what}, more than the requested {size}")
    if have == size:
        return theta_q, theta_k
    out = []
    for theta in (theta_q, theta_k):
        rms = theta.pow(2).mean((1, 2, 3, 4)).sqrt().clamp_min(torch.finfo(torch.float64).tiny)  # [B]
        shape = list(theta.shape)
        shape[axis] = size - have
        extra = torch.randn(shape, generator=generator, dtype=torch.float64).to(theta.device)
        out.append(torch.cat([theta, extra * (relative * rms)[:, None, None, None, None]], axis))
    return out[0], out[1]


def _special_case(name, q, k, p, m, seed):
    """The BASED (project-then-expand, PCA projection) or PolySketchFormer sketch of size ``<= m``."""
    from .fit import sketch_fitter

    return sketch_fitter(name)(q, k, p=p, m=m, seed=seed)


def llops_init(q, k, *, p: int, m: int, rank: int = 1, init="svd", seed: int = 0, **cp_options):
    r"""Initial Θ for the fits: ``(theta_q, theta_k)``, float64 ``[..., rank, p, d, m]``.

    Parameters
    ----------
    q, k : Tensor ``[..., n, d]``
    p, m, rank : int
    init : {"svd", "random", "cp"} or LLoPS or object with ``as_llops()``
        ``"svd"``: the leading ``m`` terms of :math:`(\sum_a s_a (u_a^\top q)(v_a^\top k))^p`, the
        multinomial expansion of the kernel in the singular directions of :math:`QK^\top` (this is
        project-then-expand, BASED-style, with data-chosen directions and terms). ``"random"``:
        Gaussian, scaled to the size of ``A``. ``"cp"``: :func:`fit_llops_cp` (``cp_options`` go
        there). ``"based"``/``"psf"``: the BASED project-then-expand sketch (PCA projection) or
        the PolySketchFormer sketch fitted with budget ``m`` (``fit_sketch("based"/"psf", ...)``),
        converted exactly by :func:`sketchlab.sketches.as_llops` (which raises for the cases
        without a rank-1 form, e.g. PSF of degree 3). An :class:`LLoPS`, or any sketch
        :func:`sketchlab.sketches.as_llops` converts, with matching batch, ``p``, ``d``, at most
        ``m`` features and rank ``<= rank`` is used as is. Missing CP terms and columns are filled
        with small Gaussian ones (``1e-3`` of the factors' RMS) so that alternating least squares
        can move them.
    seed : int
        Seeds every random draw (same seed, same Θ).
    """
    q, k = check_pair(q, k)
    p = check_degree(p)
    m = check_positive_int(m, "m (the sketch size)")
    rank = check_positive_int(rank, "rank")
    batch, d = q.shape[:-2], q.shape[-1]
    q64 = q.to(torch.float64).reshape(-1, *q.shape[-2:])  # [B, n_q, d]
    k64 = k.to(torch.float64).reshape(-1, *k.shape[-2:])  # [B, n_k, d]
    generator = torch.Generator().manual_seed(seed)
    if isinstance(init, str):
        if init == "svd":
            theta_q, theta_k = _init_svd(q64, k64, p, m, generator)
        elif init == "random":
            a = (q64 @ k64.mT) ** p
            theta_q, theta_k = _init_random(q64, k64, a, rank, p, m, generator)
        elif init == "cp":
            sketch = fit_llops_cp(q, k, p=p, m=m, rank=rank, seed=seed, **cp_options)
            theta_q = sketch.theta_q.detach().to(torch.float64).reshape(-1, rank, p, d, m)
            theta_k = sketch.theta_k.detach().to(torch.float64).reshape(-1, rank, p, d, m)
        elif init in ("based", "psf"):
            return llops_init(q, k, p=p, m=m, rank=rank, init=_special_case(init, q, k, p, m, seed), seed=seed)
        else:
            raise ValueError(f"init must be one of {INITS}, an LLoPS, or a sketch with as_llops(); got {init!r}")
    else:
        if isinstance(init, LLoPS):
            sketch = init
        elif hasattr(init, "as_llops"):
            sketch = init.as_llops()
        else:
            from .sketches import as_llops  # lazy: sketchlab.sketches imports this module

            sketch = as_llops(init)
        if not isinstance(sketch, LLoPS):
            raise TypeError(f"init must be one of {INITS}, an LLoPS, or a sketch with as_llops(); got {type(init).__name__}")
        theta_q = sketch.theta_q.detach().to(torch.float64)
        theta_k = (sketch.theta_q if sketch.theta_k is None else sketch.theta_k).detach().to(torch.float64)
        want = (*batch, p, d, m)
        if theta_q.ndim == 4 and len(batch) > 0:  # one map shared by every head
            theta_q = theta_q.expand(*batch, *theta_q.shape)
            theta_k = theta_k.expand(*batch, *theta_k.shape)
        have = (*theta_q.shape[:-4], *theta_q.shape[-3:])
        if have[:-1] != want[:-1] or have[-1] > m:
            raise ValueError(
                f"init LLoPS must have batch, p, d = {want[:-1]} and at most m={m} features to initialise "
                f"this fit, got theta of shape {tuple(theta_q.shape)}"
            )
        theta_q = theta_q.reshape(-1, *theta_q.shape[-4:]).to(q.device)  # [B, t', p, d, m']
        theta_k = theta_k.reshape(-1, *theta_k.shape[-4:]).to(q.device)
        theta_q, theta_k = _pad(theta_q, theta_k, 4, m, generator)
    theta_q, theta_k = _pad(theta_q, theta_k, 1, rank, generator)
    shape = (*batch, rank, p, d, m)
    return theta_q.reshape(shape).contiguous(), theta_k.reshape(shape).contiguous()


# ----------------------------------------------------------------------------------------------
# Fits
# ----------------------------------------------------------------------------------------------


def _prepare(q, k, p, m, rank):
    q, k = check_pair(q, k)
    p = check_degree(p)
    m = check_positive_int(m, "m (the sketch size)")
    rank = check_positive_int(rank, "rank")
    out_dtype = torch.promote_types(q.dtype, torch.float32)
    batch = q.shape[:-2]
    q64 = q.to(torch.float64).reshape(-1, *q.shape[-2:])  # [B, n_q, d]
    k64 = k.to(torch.float64).reshape(-1, *k.shape[-2:])  # [B, n_k, d]
    return q, k, p, m, rank, out_dtype, batch, q64, k64


def _balance(theta_q: torch.Tensor, theta_k: torch.Tensor, fq: torch.Tensor, fk: torch.Tensor) -> None:
    """Rescale factors in place without changing the kernel: equal factor norms within each CP
    term, equal feature norms on the two sides of each column. ``theta[B, t, p, d, m]``, ``f[B, n, m]``."""
    tiny = torch.finfo(theta_q.dtype).tiny
    p = theta_q.shape[2]
    for theta in (theta_q, theta_k):
        norms = theta.norm(dim=-2).clamp_min(tiny)  # [B, t, p, m]
        geo = norms.log().mean(-2, keepdim=True).exp()  # [B, t, 1, m]
        theta.mul_((geo / norms)[..., None, :])
    ratio = (fk.norm(dim=-2).clamp_min(tiny) / fq.norm(dim=-2).clamp_min(tiny)) ** (0.5 / p)  # [B, m]
    theta_q.mul_(ratio[:, None, None, None, :])
    theta_k.div_(ratio[:, None, None, None, :])


#: Columns whose targets are formed by one matrix product in :func:`_als_side`.
_BLOCK = 8


def _normal_matrices(x: torch.Tensor, others: torch.Tensor, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""LU factors and pivots (``torch.linalg.lu_factor``) of the normal matrices of every column's
    factor update, ``[B, m, t·d, t·d]`` and ``[B, m, t·d]``.

    Column ``i``'s features are linear in its factor ``j``: :math:`Z_i\,\mathrm{vec}(\theta_{:,j,:,i})`
    with :math:`Z_i[n, (r, d)] = o_{r,n,i}\,x_{n,d}` (``others[B, t, n, m]``: the product of the
    column's other factors). :math:`Z_i^\top Z_i[(r,d),(s,e)] = \sum_n o_{r,n,i} o_{s,n,i} x_{n,d} x_{n,e}`
    for all ``i`` at once is one ``(t²·m) × n × d(d+1)/2`` matrix product per head (the products
    :math:`x_{n,d}x_{n,e}`, ``d <= e``, formed per head). A relative ridge
    (``ridge · mean diag``) keeps rank-deficient blocks solvable.
    """
    B, t, n, m = others.shape
    d = x.shape[-1]
    row, col = torch.triu_indices(d, d, device=x.device)  # the d(d+1)/2 products x_d x_e, d <= e
    out = torch.empty(B, t, t, m, d, d, dtype=x.dtype, device=x.device)
    for b in range(B):  # per head: [t·t·m, n] @ [n, d(d+1)/2]
        w = (others[b, :, None] * others[b, None, :]).transpose(-2, -1)  # [t, s, m, n]
        packed = w.reshape(-1, n) @ (x[b, :, row] * x[b, :, col])  # [t·s·m, d(d+1)/2]
        packed = packed.reshape(t, t, m, -1)
        out[b, :, :, :, row, col] = packed
        out[b, :, :, :, col, row] = packed
    out = out.permute(0, 3, 1, 4, 2, 5).reshape(B, m, t * d, t * d)  # [B, m, (t, d), (s, e)]
    eye = torch.eye(t * d, dtype=x.dtype, device=x.device)
    lam = ridge * out.diagonal(dim1=-2, dim2=-1).mean(-1) + torch.finfo(x.dtype).tiny  # [B, m]
    return torch.linalg.lu_factor(out + lam[..., None, None] * eye)  # LU: robust to round-off when singular


def _als_side(x, theta, f_self, f_other, cross, ridge):
    r"""Update factor ``j`` of every column in turn, for ``j = 1..p``, the other side fixed (in place).

    With :math:`\Phi_K` fixed the loss is :math:`\mathrm{tr}(\Phi_Q G\Phi_Q^\top) - 2\,\mathrm{tr}(\Phi_Q^\top T)`
    + const, :math:`G = \Phi_K^\top\Phi_K`, :math:`T = A\Phi_K` (``cross``). For column ``i`` with the
    other columns fixed it is :math:`G_{ii}\|\phi_i - t_i\|^2` + const with
    :math:`t_i = (T_i - \sum_{l\ne i}\phi_l G_{li}) / G_{ii}`, and :math:`\phi_i = Z_i\,\mathrm{vec}(\theta_{:,j,:,i})`
    is linear in factor ``j``: each block step is the exact least-squares solve
    :math:`Z_i^\top Z_i\,\theta = Z_i^\top t_i`. The normal matrices depend only on the column's
    *other* factors, so for one ``j`` they are formed for all columns at once
    (:func:`_normal_matrices`); the right-hand sides follow the columns in turn (Gauss–Seidel).
    ``x[B, n, d]``, ``theta[B, t, p, d, m]``, ``f_self[B, n, m]``, ``f_other[B, n', m]``, ``cross[B, n, m]``.
    """
    B, t, p, d, m = theta.shape
    tiny = torch.finfo(x.dtype).tiny
    gram = f_other.mT @ f_other  # [B, m, m]
    g_diag = gram.diagonal(dim1=-2, dim2=-1).clamp_min(tiny)  # [B, m]
    # column-major working copies: column i is a contiguous slice
    feats = f_self.mT.contiguous()  # [B, m, n]
    cross_t = cross.mT  # [B, m, n]
    proj = torch.einsum("bnd,btpdm->bpmtn", x, theta).contiguous()  # [B, p, m, t, n] = ⟨θ_{r,j,:,i}, x⟩
    theta_t = theta.permute(0, 2, 4, 1, 3).contiguous()  # [B, p, m, t, d]
    for j in range(p):
        others = torch.cat([proj[:, :j], proj[:, j + 1 :]], 1).prod(1)  # [B, m, t, n]
        lu, pivots = _normal_matrices(x, others.permute(0, 2, 3, 1), ridge)  # [B, m, t·d, t·d], [B, m, t·d]
        for lo in range(0, m, _BLOCK):  # T_i − Σ_l φ_l G_li for a block of columns: one matrix product
            hi = min(lo + _BLOCK, m)
            resid = cross_t[:, lo:hi] - gram[:, :, lo:hi].mT @ feats  # [B, c, n]
            start = feats[:, lo:hi].clone()  # [B, c, n]; the block's own changes are added back below
            for i in range(lo, hi):
                moved = gram[:, None, lo:hi, i] @ (feats[:, lo:hi] - start)  # [B, 1, n]
                target = (resid[:, i - lo] - moved[:, 0]) / g_diag[:, i, None] + feats[:, i]  # [B, n]
                rhs = (others[:, i] * target[:, None]) @ x  # [B, t, d]
                sol = torch.linalg.lu_solve(lu[:, i], pivots[:, i], rhs.reshape(B, t * d, 1)).reshape(B, t, d)
                theta_t[:, j, i] = sol
                proj[:, j, i] = sol @ x.mT  # [B, t, n]
                feats[:, i] = (others[:, i] * proj[:, j, i]).sum(1)
    theta.copy_(theta_t.permute(0, 3, 1, 4, 2))
    f_self.copy_(feats.mT)


def _als_sweep(q, k, a, theta_q, theta_k, fq, fk, ridge):
    r"""One sweep of exact block coordinate descent (in place): every query column, then every
    key column, each an exact least-squares step (:func:`_als_side`); then :func:`_balance`.

    The only ``O(n² m)`` work is the two products :math:`A\Phi_K` and :math:`A^\top\Phi_Q`.
    """
    _als_side(q, theta_q, fq, fk, a @ fk, ridge)
    _als_side(k, theta_k, fk, fq, a.mT @ fq, ridge)
    _balance(theta_q, theta_k, fq, fk)


def fit_llops_direct(
    q,
    k,
    *,
    p: int,
    m: int,
    rank: int = 1,
    init="svd",
    steps: int = 6,
    tol: float = 1e-4,
    ridge: float = 1e-12,
    extrapolate: bool = True,
    seed: int = 0,
    progress: bool = False,
    **cp_options,
) -> LLoPS:
    r"""Fit LLoPS to :math:`A = (QK^\top)^{\circ p}` by minimising :func:`kernel_loss` directly.

    Parameters
    ----------
    q : Tensor ``[..., n_q, d]``
    k : Tensor ``[..., n_k, d]``
        Leading axes (e.g. ``[L, H]``) are independent problems, fitted together (batched).
        Inputs are used as given (no rescaling); all arithmetic is float64.
    p, m, rank : int
        Degree, sketch size, CP rank ``t``.
    init : see :func:`llops_init` (default ``"svd"``).
    steps : int
        Budget: number of sweeps (see Notes for what one sweep does and costs). The default 6 keeps
        the 72-head stand-in of ``analysis/bench_fit.py`` (all tokens, 1 thread) within its time budget.
    tol : float
        Stop (``converged``) when a sweep lowers every head's loss by less than this fraction.
    ridge : float
        Relative Tikhonov term of each least-squares solve (``ridge · mean diag`` of its Gram
        matrix), for rank-deficient blocks.
    extrapolate : bool
        After each sweep try :math:`\Theta + \beta(\Theta - \Theta_{\text{prev}})` (the classic
        line-search acceleration of CP-ALS) and keep it, per head, only where it lowers the loss;
        ``β`` grows ×1.5 on success and halves on failure (within ``[1/8, 8]``). One extra loss
        evaluation per sweep.
    seed : int
        Seeds the initialisation; the sweeps are deterministic.
    progress : bool
        Show a tqdm bar over sweeps.

    Returns
    -------
    LLoPS
        Untied, ``theta[..., rank, p, d, m]`` in the input dtype (float32 at least), with
        ``fit_info = {"steps", "converged", "init", "init_rel_fro", "rel_fro_history"}``.

    Notes
    -----
    Exact block coordinate descent (alternating least squares), in three stages:

    1. *Initialisation* (:func:`llops_init`, default ``"svd"``: the leading ``m`` terms of the
       multinomial expansion of the kernel in the singular directions of :math:`QK^\top`; an SVD
       of a ``d × d`` core and ``O(n C)`` work to rank the ``C = \binom{r+p-1}{p}`` terms).
    2. *Sweeps.* The loss is linear least squares in any one factor :math:`\Theta_{r,j}` when all
       others are fixed, but a full factor has ``d·m`` unknowns coupled through
       :math:`\Phi_K^\top\Phi_K` (``(dm)²`` normal equations); the blocks here are one column
       ``i``, one side and one factor ``j`` (``t·d`` unknowns). A sweep updates the query side
       (the key side fixed, so :math:`A\Phi_K` is one ``n × n × m`` product), factor by factor and
       within a factor column by column, then the key side (:func:`_als_side`). The ``m`` normal
       matrices of one factor depend only on each column's other factors, so they are formed
       together, one ``(t²m) × n × d(d+1)/2`` product per head, and LU-factored in one
       batch; the right-hand sides follow the columns in turn (Gauss–Seidel), with the coupling
       :math:`\sum_l \phi_l G_{li}` formed for blocks of 8 columns by one product. Cost per sweep
       and head: two ``n² m`` products, ``2p`` products of ``t² m n d²/2`` and ``O(n m²)`` for
       the coupling, i.e. about three loss evaluations for ``t = 1``, ``d = 32``, ``m = 64``.
       Each block step is the exact minimiser, so the loss never increases (up to the ridge).
    3. *Extrapolation* (``extrapolate``): one extra loss evaluation per sweep; kept per head only
       where it lowers the loss.

    The best Θ seen (initialisation included) is returned per head. The loss is evaluated at the
    ``n`` level, ``O(n_q n_k m)``, which for ``n ≈ D`` is cheaper than the Gram-matrix form
    (``O(D² m)``). Measured against the Theorem 3.1 optimum in ``analysis/results/fit.md``
    (``analysis/bench_fit.py``).
    """
    q, k, p, m, rank, out_dtype, batch, q64, k64 = _prepare(q, k, p, m, rank)
    steps = check_positive_int(steps, "steps")
    a = (q64 @ k64.mT) ** p  # [B, n_q, n_k]
    check_finite_loss((a**2).sum((-2, -1)), 0, "LLoPS direct")
    theta_q, theta_k = llops_init(q, k, p=p, m=m, rank=rank, init=init, seed=seed, **cp_options)
    d = q.shape[-1]
    theta_q = theta_q.reshape(-1, rank, p, d, m).clone()  # [B, t, p, d, m]
    theta_k = theta_k.reshape(-1, rank, p, d, m).clone()
    norm_a = (a**2).sum((-2, -1)).clamp_min(torch.finfo(torch.float64).tiny)
    fq, fk = llops_features(q64, theta_q), llops_features(k64, theta_k)
    loss = kernel_loss(fq, fk, a)
    check_finite_loss(loss, 0, "LLoPS direct")
    init_rel = (loss / norm_a).sqrt()
    best_loss, best_q, best_k = loss.clone(), theta_q.clone(), theta_k.clone()
    history, converged, done = [float(init_rel.median())], False, 0
    bar = tqdm(range(steps), desc="LLoPS ALS", disable=not progress, leave=False)
    beta = torch.full_like(loss, 0.5)  # per-head extrapolation step
    for step in bar:
        prev_q, prev_k = theta_q.clone(), theta_k.clone()
        _als_sweep(q64, k64, a, theta_q, theta_k, fq, fk, ridge)
        fq, fk = llops_features(q64, theta_q), llops_features(k64, theta_k)  # recompute: no drift
        new = kernel_loss(fq, fk, a)
        check_finite_loss(new, step + 1, "LLoPS direct")
        if extrapolate:
            # Θ + β(Θ − Θ_prev), kept per head only where it lowers the loss (so still monotone)
            b = beta[:, None, None, None, None]
            cand_q, cand_k = theta_q + b * (theta_q - prev_q), theta_k + b * (theta_k - prev_k)
            cand_fq, cand_fk = llops_features(q64, cand_q), llops_features(k64, cand_k)
            cand = kernel_loss(cand_fq, cand_fk, a)
            take = torch.isfinite(cand) & (cand < new)
            theta_q[take], theta_k[take], fq[take], fk[take] = cand_q[take], cand_k[take], cand_fq[take], cand_fk[take]
            new = torch.where(take, cand, new)
            beta = torch.where(take, (beta * 1.5).clamp(max=8.0), (beta * 0.5).clamp(min=0.125))
        done = step + 1
        better = new < best_loss
        best_loss = torch.where(better, new, best_loss)
        best_q[better], best_k[better] = theta_q[better], theta_k[better]
        history.append(float((best_loss / norm_a).sqrt().median()))
        bar.set_postfix(rel_fro=history[-1])
        if bool(((loss - new) <= tol * loss).all()):
            converged = True
            break
        loss = new
    sketch = LLoPS(best_q.reshape(*batch, rank, p, d, m).to(out_dtype), best_k.reshape(*batch, rank, p, d, m).to(out_dtype))
    sketch.fit_info = {
        "steps": done,
        "converged": converged,
        "init": init if isinstance(init, str) else type(init).__name__,
        "init_rel_fro": init_rel.reshape(batch),
        "rel_fro_history": history,
    }
    return sketch


def fit_llops_adam(
    q,
    k,
    *,
    p: int,
    m: int,
    rank: int = 1,
    init="random",
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
    tol: float = 1e-4,
    seed: int = 0,
    progress: bool = False,
    **cp_options,
) -> LLoPS:
    r"""Fit LLoPS by ``torch.optim.Adam`` on :func:`kernel_loss` with a fixed step budget.

    The naive baseline: every head's loss is divided by :math:`\|A\|_F^2` and the sum is
    minimised for ``steps`` steps (learning rate ``lr``), in float64; the best Θ seen per head
    (initialisation included) is returned. ``converged`` means the summed loss moved by less
    than ``tol`` (relative) over the last 10 steps. Other arguments as :func:`fit_llops_direct`.
    """
    q, k, p, m, rank, out_dtype, batch, q64, k64 = _prepare(q, k, p, m, rank)
    theta_q, theta_k = llops_init(q, k, p=p, m=m, rank=rank, init=init, seed=seed, **cp_options)
    d = q.shape[-1]
    theta_q = theta_q.reshape(-1, rank, p, d, m).to(torch.float64).clone().requires_grad_(True)  # [B, t, p, d, m]
    theta_k = theta_k.reshape(-1, rank, p, d, m).to(torch.float64).clone().requires_grad_(True)  # [B, t, p, d, m]
    info = train_kernel_sketch(
        [theta_q, theta_k], lambda x, y: (llops_features(x, theta_q), llops_features(y, theta_k)), q64, k64, p,
        steps=steps, lr=lr, tol=tol, what="LLoPS Adam", progress=progress,
    )
    sketch = LLoPS(theta_q.detach().reshape(*batch, rank, p, d, m).to(out_dtype),
                   theta_k.detach().reshape(*batch, rank, p, d, m).to(out_dtype))
    sketch.fit_info = {
        **info,
        "init": init if isinstance(init, str) else type(init).__name__,
        "init_rel_fro": info["init_rel_fro"].reshape(batch),
        "rel_fro": info["rel_fro"].reshape(batch),
    }
    return sketch


GAUGES = ("balanced", "aligned")


def aligned_gauge(q, k, opt, *, seed: int = 0) -> torch.Tensor:
    r"""The ``m × m`` map ``G`` of the ``"aligned"`` gauge for an optimal sketch ``opt`` of ``(q, k)``.

    ``G = argmin ‖ψ_p(Q) W*_Q G − Φ_ref‖_F`` (least squares), with ``Φ_ref`` the query features of the
    ``"svd"`` initialisation (rank-1 columns by construction). ``W*_Q G`` and ``W*_K G^{-ᵀ}`` have
    the kernel of ``W*``; their columns are much closer to rank 1 than the balanced split's.
    ``q[..., n_q, d]``, ``k[..., n_k, d]``; returns float64 ``[..., m, m]``.
    """
    q, k = check_pair(q, k)
    batch = q.shape[:-2]
    q64 = q.to(torch.float64).reshape(-1, *q.shape[-2:])  # [B, n_q, d]
    k64 = k.to(torch.float64).reshape(-1, *k.shape[-2:])  # [B, n_k, d]
    p, m = opt.p, opt.num_features
    ref_q, _ = _init_svd(q64, k64, p, m, torch.Generator().manual_seed(seed))
    target = llops_features(q64, ref_q)  # [B, n_q, m]
    current = opt.features_q(q64).reshape(-1, q64.shape[-2], m)  # [B, n_q, m]
    return torch.linalg.lstsq(current, target).solution.reshape(*batch, m, m)


def fit_llops_cp(
    q,
    k,
    *,
    p: int,
    m: int,
    rank: int = 1,
    gauge: str = "balanced",
    seed: int = 0,
    n_iter_max: int = 200,
    tol: float = 1e-10,
    route: str = "auto",
) -> LLoPS:
    r"""LLoPS from a CP of every column tensor of the Theorem 3.1 optimal projector ``W*``.

    Parameters
    ----------
    q, k : Tensor ``[..., n, d]``
    p, m, rank : int
    gauge : {"balanced", "aligned"}
        ``W*`` is only defined up to an invertible ``G`` (``W*_Q G``, ``W*_K G^{-ᵀ}``).
        ``"balanced"``: the split :math:`\Sigma_m^{1/2}` on both sides that
        :func:`sketchlab.optimal_sketch` returns; its columns are generally far from rank 1 and
        the CP is poor. ``"aligned"``: ``G`` is the least-squares map taking the optimal query
        features :math:`\psi_p(Q)W^*_Q` to those of the ``"svd"`` initialisation of
        :func:`llops_init` (rank-1 columns by construction), so the columns of
        :math:`W^*_Q G` are close to rank 1; the kernel of ``W*`` is unchanged by ``G``.
    seed, n_iter_max, tol
        Passed to ``parafac`` (see :func:`projector_to_theta`).
    route : passed to :func:`sketchlab.optimal_sketch`.

    Returns
    -------
    LLoPS with ``fit_info = {"steps": 1, "converged": True, "gauge": gauge}``.

    Notes
    -----
    Cost: the optimal sketch (an SVD of ``A`` or of the QR core) and ``m`` parafac runs per head
    on ``d**p``-entry tensors, so this is for small ``d**p``. By Theorem 3.4 (as stated in
    DESIGN.md — the paper's appendix is unavailable to us) the projector error of a rank-1
    CP is at least :math:`\sum_i (\|W_i\|_F^2 - \|W_i\|_\sigma^2)`; measure it with
    :func:`sketchlab.spectral.rank1_residuals`.
    """
    from .optimal import optimal_sketch

    q, k, p, m, rank, out_dtype, batch, q64, k64 = _prepare(q, k, p, m, rank)
    if gauge not in GAUGES:
        raise ValueError(f"gauge must be one of {GAUGES}, got {gauge!r}")
    opt = optimal_sketch(q64, k64, p, m, route=route)
    w_q, w_k = opt.projector("q"), opt.projector("k")  # [B, d^p, m] full basis
    if gauge == "aligned":
        gmap = aligned_gauge(q64, k64, opt, seed=seed)  # [B, m, m]
        w_q = w_q @ gmap
        w_k = torch.linalg.solve(gmap, w_k.mT).mT  # W_K G^{-ᵀ}
    theta_q = projector_to_theta(w_q, p, rank, seed=seed, n_iter_max=n_iter_max, tol=tol, name="W*_Q")
    theta_k = projector_to_theta(w_k, p, rank, seed=seed, n_iter_max=n_iter_max, tol=tol, name="W*_K")
    d = q.shape[-1]
    sketch = LLoPS(theta_q.reshape(*batch, rank, p, d, m).to(out_dtype), theta_k.reshape(*batch, rank, p, d, m).to(out_dtype))
    sketch.fit_info = {"steps": 1, "converged": True, "gauge": gauge}
    return sketch


METHODS = ("direct", "cp", "adam")


@register_sketch("llops")
def _fit_llops(q, k, *, p: int, m: int, seed: int = 0, rank: int = 1, method: str = "direct", init=None, **options) -> LLoPS:
    """``fit_sketch("llops", q, k, p=, m=, rank=1, method="direct"|"cp"|"adam", init=..., **options)``.

    ``method="direct"`` → :func:`fit_llops_direct` (``init`` default ``"svd"``); ``"cp"`` →
    :func:`fit_llops_cp` (``init`` must be ``None``); ``"adam"`` → :func:`fit_llops_adam`
    (``init`` default ``"random"``). ``options`` (``steps``, ``tol``, ``progress``, ``gauge``, ...)
    go to the chosen function.
    """
    if method == "direct":
        return fit_llops_direct(q, k, p=p, m=m, rank=rank, init="svd" if init is None else init, seed=seed, **options)
    if method == "adam":
        return fit_llops_adam(q, k, p=p, m=m, rank=rank, init="random" if init is None else init, seed=seed, **options)
    if method == "cp":
        if init is not None:
            raise ValueError(f"method='cp' takes no init (it decomposes the optimal projector), got init={init!r}")
        return fit_llops_cp(q, k, p=p, m=m, rank=rank, seed=seed, **options)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
