r"""Decayed linear attention and the (gated) delta rule: recurrences over a state ``S [B, H, M, Dv]``.

The long-context memory of DESIGN §7 runs its far part as one of two recurrences over a stream of
``T`` events (layout ``[B, T, H, ·]``; a null event has ``φ = 0, v = 0, β = 0``):

*decayed linear attention* (the additive state, optionally forgetting)

.. math:: S_t = \gamma_t S_{t-1} + \phi(k_t) v_t^\top,\quad z_t = \gamma_t z_{t-1} + \phi(k_t),\quad
          \text{num}_t = S_t^\top \phi(q_t),\quad \text{den}_t = z_t\cdot\phi(q_t);

*the gated delta rule* (the state overwrites what it holds for a key instead of adding to it)

.. math:: S_t = \alpha_t S_{t-1} + \beta_t k_t (v_t - \alpha_t S_{t-1}^\top k_t)^\top,\qquad o_t = S_t^\top q_t,

with :math:`\gamma_t = e^{\text{log\_decay}_t}`, :math:`\alpha_t = e^{\text{log\_alpha}_t}` in ``(0, 1]``.
Each has a step-by-step float64 twin (``*_naive``, the definition) and a chunked PyTorch form
(``*_chunked``, differentiable by autograd) that is tested against it.

References
----------
S. Yang, B. Wang, Y. Shen, R. Panda, Y. Kim. *Gated Linear Attention Transformers with
Hardware-Efficient Training*, ICML 2024. — S. Yang, B. Wang, Y. Zhang, Y. Shen, Y. Kim.
*Parallelizing Linear Transformers with the Delta Rule over Sequence Length*, NeurIPS 2024. —
S. Yang, J. Kautz, A. Hatamizadeh. *Gated Delta Networks*, ICLR 2025.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._validation import as_float_tensor, check_finite, check_positive_int
from ._checks import check_qkv

__all__ = [
    "decayed_linear_naive",
    "delta_rule_naive",
]


# ----------------------------------------------------------------------------------------------- checks
def _check_tokens(x, like: torch.Tensor, name: str, *, low: float | None = None, high: float | None = None):
    """``x [B, T, H]`` (or None) with ``like``'s first three axes, finite, in ``[low, high]``."""
    if x is None:
        return None
    x = as_float_tensor(x, name)
    want = tuple(like.shape[:3])
    if tuple(x.shape) != want:
        raise ValueError(f"{name} must have shape [B, T, H] = {want} (from the token tensors), got {tuple(x.shape)}")
    check_finite(x.detach(), name)
    for bound, bad, rule in ((low, lambda t: t < low, f">= {low}"), (high, lambda t: t > high, f"<= {high}")):
        if bound is not None and bool(bad(x.detach()).any()):
            i = tuple(int(j) for j in bad(x.detach()).nonzero()[0])
            raise ValueError(f"{name} must be {rule} everywhere, got {x[i].item()!r} at index {i}")
    return x


def _check_state(x, shape: tuple, name: str):
    """An initial-state tensor of the given shape, finite."""
    x = as_float_tensor(x, name)
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    check_finite(x.detach(), name)
    return x


def _check_decayed(fq, fk, v, log_decay, initial_state):
    fq, fk, v = check_qkv(fq, fk, v, causal=True, names=("fq", "fk", "v"))
    log_decay = _check_tokens(log_decay, fk, "log_decay", high=0.0)
    B, _, H, M = fk.shape
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise TypeError(f"initial_state must be a pair (S [B, H, M, Dv], z [B, H, M]) or None, "
                            f"got {type(initial_state).__name__}")
        initial_state = (_check_state(initial_state[0], (B, H, M, v.shape[-1]), "initial_state[0] (S)"),
                         _check_state(initial_state[1], (B, H, M), "initial_state[1] (z)"))
    return fq, fk, v, log_decay, initial_state


def _check_delta(q, k, v, beta, log_alpha, initial_state):
    q, k, v = check_qkv(q, k, v, causal=True)
    if beta is None:
        raise TypeError("beta must be a tensor [B, T, H] with values in [0, 2], got None")
    beta = _check_tokens(beta, k, "beta", low=0.0, high=2.0)
    log_alpha = _check_tokens(log_alpha, k, "log_alpha", high=0.0)
    if initial_state is not None:
        B, _, H, M = k.shape
        initial_state = _check_state(initial_state, (B, H, M, v.shape[-1]), "initial_state (S)")
    return q, k, v, beta, log_alpha, initial_state


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 / float64 kept; half inputs are computed in float32."""
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


# ----------------------------------------------------------------------------------------------- naive twins
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
    fq, fk, v, log_decay, initial_state = _check_decayed(fq, fk, v, log_decay, initial_state)
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
            g = log_decay[:, t].to(f64).exp()  # [B, H]
            S, z = g[..., None, None] * S, g[..., None] * z
        S = S + fk[:, t, :, :, None] * v[:, t, :, None, :]  # [B, H, M, Dv]: φ(k_t) v_tᵀ
        z = z + fk[:, t]  # [B, H, M]
        nums.append(torch.einsum("bhm,bhmd->bhd", fq[:, t], S))  # [B, H, Dv]
        dens.append((fq[:, t] * z).sum(-1))  # [B, H]
    return torch.stack(nums, 1), torch.stack(dens, 1), (S, z)


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
    q, k, v, beta, log_alpha, S = _check_delta(q, k, v, beta, log_alpha, initial_state)
    f64 = torch.float64
    q, k, v, beta = q.to(f64), k.to(f64), v.to(f64), beta.to(f64)
    B, T, H, M = k.shape
    S = k.new_zeros(B, H, M, v.shape[-1]) if S is None else S.to(f64)
    outs = []
    for t in range(T):
        if log_alpha is not None:
            S = log_alpha[:, t].to(f64).exp()[..., None, None] * S
        kt = k[:, t]  # [B, H, M]
        err = v[:, t] - torch.einsum("bhm,bhmd->bhd", kt, S)  # [B, H, Dv]: v_t − Sᵀk_t
        S = S + beta[:, t, :, None, None] * kt[..., :, None] * err[..., None, :]  # [B, H, M, Dv]
        outs.append(torch.einsum("bhm,bhmd->bhd", q[:, t], S))  # [B, H, Dv]
    return torch.stack(outs, 1), S
