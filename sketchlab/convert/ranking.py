r"""Which layers of a converted model to keep exact: :func:`rank_exact_layers` (DESIGN §7)."""

from __future__ import annotations

import torch
from torch import nn

from .evaluate import token_nll
from .exact import ExactAttention
from .sketched import SketchedAttention

__all__ = ["rank_exact_layers"]


def rank_exact_layers(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                      batch_size: int = 1) -> list[tuple[int, float]]:
    r"""Layers of a converted model ranked by what keeping each one exact gains on ``input_ids``.

    For each converted layer ``l``: the mean next-token loss (nats/token) of the model with ``l``
    made exact (the teacher's softmax attention, :class:`ExactAttention`) and every other layer as
    converted, against the model as converted; the gain is ``base − loss_l``. The model is restored
    after each trial. Cost: ``L + 1`` forward passes over ``input_ids``.

    Parameters
    ----------
    model : a converted transformers model (``convert_attention``)
    input_ids : LongTensor ``[N, T]``
        Held-back text (not the text the result will be judged on).
    attention_mask : LongTensor ``[N, T]`` or None
    batch_size : int >= 1

    Returns
    -------
    list of ``(layer, gain)``, largest gain first (ties: lower layer first).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a LongTensor [N, T], got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    sites = [m for m in model.modules() if isinstance(getattr(m, "sketch", None), SketchedAttention)]  # layer order
    if not sites:
        raise ValueError(f"{type(model).__name__} has no converted layer to rank")

    def mean_loss() -> float:
        return float(token_nll(model, input_ids, attention_mask, batch_size=batch_size).nanmean())

    base = mean_loss()
    gains = []
    for layer, holder in enumerate(sites):
        sketch = holder.sketch
        holder.sketch = ExactAttention(heads=sketch.heads, head_dim=sketch.head_dim, causal=sketch.causal)
        try:
            gains.append((layer, base - mean_loss()))
        finally:
            holder.sketch = sketch
    return sorted(gains, key=lambda item: (-item[1], item[0]))
