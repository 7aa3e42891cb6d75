"""Pieces shared by the LLoPS fits: argument preparation, the scale gauge, option checks."""

from __future__ import annotations

import torch

from .._validation import check_degree, check_pair, check_positive_int

__all__: list[str] = []


def prepare(q, k, p, m, rank):
    """Validate and flatten: ``q[..., n_q, d]`` → float64 ``[B, n_q, d]`` (same for ``k``)."""
    q, k = check_pair(q, k)
    p = check_degree(p)
    m = check_positive_int(m, "m (the sketch size)")
    rank = check_positive_int(rank, "rank")
    out_dtype = torch.promote_types(q.dtype, torch.float32)
    batch = q.shape[:-2]
    q64 = q.to(torch.float64).reshape(-1, *q.shape[-2:])  # [B, n_q, d]
    k64 = k.to(torch.float64).reshape(-1, *k.shape[-2:])  # [B, n_k, d]
    return q, k, p, m, rank, out_dtype, batch, q64, k64


def balance(theta_q: torch.Tensor, theta_k: torch.Tensor, fq: torch.Tensor, fk: torch.Tensor) -> None:
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
