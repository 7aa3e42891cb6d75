"""The (gated) delta rule step by step in float64: the definition (:mod:`sketchlab.attention.ops.delta`)."""

from __future__ import annotations

import torch

from ..._checks import check_delta

__all__ = ["delta_rule_naive", "delta_write"]


def delta_rule_naive(q, k, v, beta, log_alpha=None, *, initial_state=None):
    r"""The (gated) delta rule, step by step in float64: the definition.

    Parameters
    ----------
    q, k : Tensor ``[B, T, H, M]``
        Queries and keys, L2-normalised by the caller (not normalised here).
    v : Tensor ``[B, T, H, Dv]``
    beta : Tensor ``[B, T, H]``
        Write strengths :math:`\beta_t \in [0, 2]`; ``β = 0`` is a null step (the state only decays).
    log_alpha : Tensor ``[B, T, H]`` or None
        :math:`\log\alpha_t \le 0`, finite (the gate of the gated delta rule). None: no decay.
    initial_state : Tensor ``S [B, H, M, Dv]`` or None
        The state after earlier tokens (None: zeros).

    Returns
    -------
    o : Tensor ``[B, T, H, Dv]`` float64
        :math:`S_t^\top q_t`.
    S : Tensor ``[B, H, M, Dv]`` float64
        After the last token.

    Notes
    -----
    For ``t = 0 … T−1``: :math:`S \leftarrow \alpha_t S`, then
    :math:`S \leftarrow S + \beta_t k_t (v_t - S^\top k_t)^\top` (with a unit key and ``β = 1`` the
    state's readout of ``k_t`` becomes exactly ``v_t``), then :math:`o_t = S^\top q_t`.
    ``S`` is key-dim × value-dim (flash-linear-attention's orientation).
    """
    q, k, v, beta, log_alpha, S = check_delta(q, k, v, beta, log_alpha, initial_state)
    f64 = torch.float64
    q, k, v, beta = q.to(f64), k.to(f64), v.to(f64), beta.to(f64)
    B, T, H, M = k.shape
    S = k.new_zeros(B, H, M, v.shape[-1]) if S is None else S.to(f64)
    outs = []
    for t in range(T):
        if log_alpha is not None:
            S = log_alpha[:, t].to(f64).exp()[..., None, None] * S
        S = delta_write(S, k[:, t], v[:, t], beta[:, t])  # [B, H, M, Dv]
        outs.append(torch.einsum("bhm,bhmd->bhd", q[:, t], S))  # [B, H, Dv]
    return torch.stack(outs, 1), S


def delta_write(S, k, v, beta):
    r"""A key enters the delta rule's state: :math:`S \leftarrow S + \beta\, k (v - S^\top k)^\top`.

    Parameters
    ----------
    S : Tensor ``[..., M, Dv]``
    k : Tensor ``[..., M]``
        The key, L2-normalised by the caller.
    v : Tensor ``[..., Dv]``
    beta : Tensor ``[...]``
        The write strength (``0``: the state unchanged).

    Returns
    -------
    Tensor ``[..., M, Dv]``
    """
    err = v - (k[..., None, :] @ S)[..., 0, :]  # [..., Dv]: v − Sᵀk
    return S + beta[..., None, None] * k[..., :, None] * err[..., None, :]
