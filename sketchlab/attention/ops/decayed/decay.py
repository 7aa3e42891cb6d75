r"""The decayed state's forgetting, one value a step: :math:`\log\gamma_t` from the options and the far
parameters (fixed, per head, or from the token's value), shared by every form of the memory mechanisms
(naive, chunk, recurrent)."""

from __future__ import annotations

import math

import torch

__all__ = ["far_log_decay"]


def far_log_decay(call, v: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor | None:
    r"""The decay of each step, :math:`\log\gamma_t`, from the options and the far parameters.

    Parameters
    ----------
    call : namespace
        A checked memory call (:func:`sketchlab.attention.memory_state.check_memory_call`).
    v : Tensor ``[B, T, H, Dv]``
        The values (``decay="input"`` reads them).
    real : Tensor ``[B, T]`` bool or None
        Real tokens: a pad does not decay the state (0 there).

    Returns
    -------
    Tensor ``[B, T, H]`` or None (no decay)
    """
    o, f = call.o, call.far
    if o.decay is None or o.decay == 1.0:
        return None
    if o.decay == "head":
        lg = torch.nn.functional.logsigmoid(f["decay_bias"].to(v.dtype)).expand(v.shape[0], v.shape[1], -1)
    elif o.decay == "input":
        lg = torch.nn.functional.logsigmoid(f["decay_bias"].to(v.dtype) + (v * f["decay_weight"].to(v.dtype)).sum(-1))
    else:
        lg = torch.full(v.shape[:3], math.log(o.decay), dtype=v.dtype, device=v.device)
    return lg if real is None else torch.where(real[:, :, None], lg, lg.new_zeros(()))
