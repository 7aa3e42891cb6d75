r"""The decayed state's part of the lean decoding step (:class:`sketchlab.attention.recurrent.RecurrentStep`, its
torch twin; the compiled step does the same in :mod:`sketchlab.attention.ops.fused_recurrent`): the decay of each
lane laid out once per parameter version, and a token's :math:`\gamma` from it. The state is multiplied by
:math:`\gamma` before a key enters, :math:`S_t = \gamma_t S_{t-1} + \dots` (:mod:`sketchlab.attention.ops.decayed`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["lane_decay", "token_gamma"]


def lane_decay(decay, far: dict, rows, lanes: int, dtype: torch.dtype, device):
    r"""The decay of every lane (``B·H`` of them), derived once per parameter version.

    Parameters
    ----------
    decay : None, float, "head" or "input"
        ``AttentionOptions.decay``.
    far : dict
        The checked far parameters (:func:`sketchlab.attention.memory_state.check_far_params`): ``decay_bias
        [H]``, ``decay_weight [H, Dv]``.
    rows : callable
        ``[H, ·] → [B·H, ·]`` in the step's dtype (each head's value repeated over the batch).
    lanes : int
    dtype, device

    Returns
    -------
    None (no decay), ``log γ [B·H, 1, 1]`` (a fixed or per-head decay: :math:`\log\sigma(b)`), or
    ``("input", b [B·H, 1, 1], w [B·H, Dv, 1])`` (:math:`\gamma_t = \sigma(b + v_t^\top w)`).
    """
    if decay is None or decay == 1.0:
        return None
    if decay == "head":
        return torch.nn.functional.logsigmoid(rows(far["decay_bias"])).view(-1, 1, 1)
    if decay == "input":
        return "input", rows(far["decay_bias"]).view(-1, 1, 1), rows(far["decay_weight"])[..., None]
    return torch.full((lanes, 1, 1), math.log(decay), dtype=dtype, device=device)


def token_gamma(decay, v: torch.Tensor) -> torch.Tensor | None:
    r"""``γ [B·H, 1, 1]`` of the token with value ``v [B·H, 1, Dv]`` from :func:`lane_decay`'s ``decay`` (None: no
    decay), as :math:`e^{\log\sigma(\cdot)}`."""
    if decay is None:
        return None
    if isinstance(decay, tuple):
        _, bias, weight = decay
        return torch.nn.functional.logsigmoid(torch.baddbmm(bias, v, weight)).exp_()
    return decay.exp()
