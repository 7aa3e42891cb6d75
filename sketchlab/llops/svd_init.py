r"""The "svd" start of the LLoPS fits: the leading terms of the multinomial expansion of the kernel
in the singular directions of ``QKᵀ`` (project-then-expand with data-chosen directions).

Its own module because both :func:`sketchlab.llops.llops_init` and the CP fit's aligned gauge
(:mod:`sketchlab.llops.fit_cp`) start from it, and ``llops_init`` also calls the CP fit.
"""

from __future__ import annotations

import itertools
import math

import torch

from .._validation import DEFAULT_MAX_BYTES, check_memory

__all__: list[str] = []


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
