"""Decayed linear attention step by step in float64: the definition (:mod:`sketchlab.attention.ops.decayed`)."""

from __future__ import annotations

import torch

from ..._checks import check_decayed

__all__ = ["additive_write", "decay_step", "decayed_linear_naive"]


def decayed_linear_naive(fq, fk, v, log_decay=None, *, initial_state=None):
    r"""Decayed linear attention, step by step in float64: the definition.

    Parameters
    ----------
    fq, fk : Tensor ``[B, T, H, M]``
        Query and key features :math:`\phi(q_t)`, :math:`\phi(k_t)`.
    v : Tensor ``[B, T, H, Dv]``
    log_decay : Tensor ``[B, T, H]`` or None
        :math:`\log\gamma_t \le 0`, finite; applied *before* token ``t`` is added. None: no decay.
    initial_state : ``(S [B, H, M, Dv], z [B, H, M])`` or None
        The state after earlier tokens (None: zeros).

    Returns
    -------
    num : Tensor ``[B, T, H, Dv]`` float64
        :math:`S_t^\top\phi(q_t)`.
    den : Tensor ``[B, T, H]`` float64
        :math:`z_t\cdot\phi(q_t)` (the caller divides, with its own ``ε``).
    state : ``(S [B, H, M, Dv], z [B, H, M])`` float64
        After the last token.

    Notes
    -----
    For ``t = 0 … T−1``: :math:`S \leftarrow \gamma_t S + \phi(k_t) v_t^\top`,
    :math:`z \leftarrow \gamma_t z + \phi(k_t)`, then :math:`\text{num}_t = S^\top\phi(q_t)`,
    :math:`\text{den}_t = z\cdot\phi(q_t)`. Token ``t`` sees itself.
    """
    fq, fk, v, log_decay, initial_state = check_decayed(fq, fk, v, log_decay, initial_state)
    f64 = torch.float64
    fq, fk, v = fq.to(f64), fk.to(f64), v.to(f64)
    B, T, H, M = fk.shape
    if initial_state is None:
        S, z = fk.new_zeros(B, H, M, v.shape[-1]), fk.new_zeros(B, H, M)
    else:
        S, z = initial_state[0].to(f64), initial_state[1].to(f64)
    nums, dens = [], []
    for t in range(T):
        if log_decay is not None:
            S, z = decay_step(S, z, log_decay[:, t].to(f64).exp())
        S, z = additive_write(S, z, fk[:, t], v[:, t])
        nums.append(torch.einsum("bhm,bhmd->bhd", fq[:, t], S))  # [B, H, Dv]
        dens.append((fq[:, t] * z).sum(-1))  # [B, H]
    return torch.stack(nums, 1), torch.stack(dens, 1), (S, z)


def decay_step(S, z, gamma):
    r"""One step of decay: :math:`S \leftarrow \gamma S`, :math:`z \leftarrow \gamma z`.

    Parameters
    ----------
    S : Tensor ``[..., M, Dv]``
    z : Tensor ``[..., M]``
    gamma : Tensor ``[...]``
        :math:`\gamma \in (0, 1]`.

    Returns
    -------
    ``(S, z)``, decayed.
    """
    return gamma[..., None, None] * S, gamma[..., None] * z


def additive_write(S, z, phi, v):
    r"""A key enters the additive state: :math:`S \leftarrow S + \phi(k) v^\top`, :math:`z \leftarrow z + \phi(k)`.

    Parameters
    ----------
    S : Tensor ``[..., M, Dv]``
    z : Tensor ``[..., M]``
    phi : Tensor ``[..., M]``
        The key's features.
    v : Tensor ``[..., Dv]``

    Returns
    -------
    ``(S, z)`` with the key.
    """
    return S + phi[..., :, None] * v[..., None, :], z + phi
