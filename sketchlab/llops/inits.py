r"""Starting points of the LLoPS fits (:func:`llops_init`): the multinomial "svd" init, Gaussian,
the CP of ``W*``, the exact forms of BASED / PolySketchFormer, or a given sketch."""

from __future__ import annotations

import itertools
import math

import torch

from .._validation import DEFAULT_MAX_BYTES, check_degree, check_memory, check_pair, check_positive_int
from .module import LLoPS

__all__ = ["INITS", "llops_init"]

#: Initialisations accepted by the fits (besides an :class:`LLoPS` instance or an object with ``as_llops()``).
INITS = ("svd", "random", "cp", "based", "psf")

#: The "svd" init ranks at least this many candidate terms per feature column.
_POOL = 16


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


def _init_svd(q, k, p, m, generator, max_bytes=DEFAULT_MAX_BYTES):
    r"""Rank-1 Θ from the leading terms of the expansion of ``(Σ_a s_a (u_aᵀq)(v_aᵀk))^p``.

    ``(qᵀk)^p = Σ_α c_α ∏_j s_{α_j} (u_{α_j}ᵀq) (v_{α_j}ᵀk)`` over multisets ``α`` (``c_α`` the
    multinomial coefficient): each term is a rank-1 LLoPS column. The ``m`` terms with the
    largest Frobenius norm on the data, :math:`c_\alpha\prod_j s_{\alpha_j}\,
    \|\prod_j Qu_{\alpha_j}\|\,\|\prod_j Kv_{\alpha_j}\|`, are kept (ranking by ``c_α ∏ s`` alone
    ignores how the data weights the products), the coefficient split evenly over the ``2p`` factors.
    Candidates: the multisets over the leading ``r'`` singular directions, ``r'`` the smallest with
    at least ``_POOL · m`` multisets (all ``r`` directions when there are fewer), so the work is
    ``O(n · _POOL · m)`` per head whatever ``p`` (the multiset count is checked against
    ``max_bytes`` before anything is enumerated). If there are fewer than ``m`` terms, the
    remaining columns get small Gaussian factors (``1e-3`` of the others' RMS) so that the fit can use them.
    """
    u, s, v = _svd_directions(q, k)
    B, d, r = u.shape
    n = max(q.shape[-2], k.shape[-2])
    r_used = r
    while r_used > 1 and math.comb(r_used - 1 + p - 1, p) >= _POOL * m:
        r_used -= 1  # the smallest r' whose multisets still number >= _POOL·m
    count = math.comb(r_used + p - 1, p)
    check_memory(
        count * (p + 2 + 2 * n) * 8 + 8 * B * count,
        what=f"the svd init's {count} candidate terms (p={p}, {r_used} directions, {n} tokens)",
        way_out="use a smaller p or m, or init='random'", max_bytes=max_bytes,
    )
    u, s, v = u[..., :r_used], s[..., :r_used], v[..., :r_used]
    r = r_used
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
    for b in range(B):  # one head at a time: the products are [n, C], C = C(r'+p-1, p)
        for proj in (q[b] @ u[b], k[b] @ v[b]):  # [n, r]
            prod = proj[:, combos[:, 0]]  # [n, C]
            for j in range(1, p):
                prod = prod * proj[:, combos[:, j]]
            energy[b] += prod.norm(dim=0).clamp_min(tiny).log()
    take = min(m, combos.shape[0])
    top = (score + energy).topk(take, dim=-1).indices  # [B, take] by ‖term of A‖_F
    chosen = combos[top]  # [B, take, p]
    scale = (score.gather(-1, top) / (2 * p)).exp()  # [B, take] per-factor share of c_α ∏ s
    check_memory(2 * B * p * d * m * 8, what=f"Θ [{B}, 1, {p}, {d}, {m}] float64 (two sides)",
                 way_out="use a smaller p, d or m", max_bytes=max_bytes)
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


def _init_random(q, k, sq_norm, rank, p, m, generator):
    """Gaussian Θ scaled so that ``φ_Q φ_Kᵀ`` has the root-mean-square size of ``A`` (``sq_norm = ‖A‖²``)."""
    B, _, d = q.shape
    x_rms = torch.cat([q, k], -2).pow(2).sum(-1).mean(-1).sqrt()  # [B]
    a_rms = (sq_norm / (q.shape[-2] * k.shape[-2])).sqrt()  # [B]
    sigma = (a_rms / math.sqrt(m * rank)).pow(1.0 / (2 * p)) / x_rms  # [B]
    shape = (B, rank, p, d, m)
    theta_q = torch.randn(shape, generator=generator, dtype=torch.float64).to(q.device) * sigma[:, None, None, None, None]
    theta_k = torch.randn(shape, generator=generator, dtype=torch.float64).to(q.device) * sigma[:, None, None, None, None]
    return theta_q, theta_k


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
    """The BASED (project-then-expand, PCA projection) or PolySketchFormer sketch of size ``<= m``.

    Imported here, at call time: :mod:`sketchlab.sketches` imports :class:`LLoPS` for ``as_llops``.
    """
    from ..fit import sketch_fitter

    return sketch_fitter(name)(q, k, p=p, m=m, seed=seed)


def llops_init(q, k, *, p: int, m: int, rank: int = 1, init="svd", seed: int = 0,
               max_bytes: int = DEFAULT_MAX_BYTES, **cp_options):
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
    max_bytes : int
        Memory budget of the init's big allocations (the svd init's candidate terms, Θ itself).
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
            theta_q, theta_k = _init_svd(q64, k64, p, m, generator, max_bytes)
        elif init == "random":
            from ..metrics import _kernel_sq_norm

            check_memory(2 * q64.shape[0] * rank * p * d * m * 8, what=f"Θ [{q64.shape[0]}, {rank}, {p}, {d}, {m}] float64 (two sides)",
                         way_out="use a smaller p, d or m", max_bytes=max_bytes)
            theta_q, theta_k = _init_random(q64, k64, _kernel_sq_norm(q64, k64, p, max_bytes), rank, p, m, generator)
        elif init == "cp":
            from .fit_cp import fit_llops_cp  # the CP fit starts from the svd init (aligned gauge)

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
            from ..sketches import as_llops  # at call time: sketchlab.sketches imports LLoPS

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
