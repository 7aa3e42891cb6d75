r"""Zoology's MQAR protocol on :class:`~sketchlab.tasks.TransformerLM`: logits at the query positions only,
and held-out accuracy per test configuration ("slice").

With Zoology's vocabulary of 8192 tokens, the output head over every position of a batch
(``B·T·8192`` logits; 0.5 GB at ``B = 64, T = 256``) dominates a CPU step, although the loss and
the accuracy read only the ``P`` query positions of each sequence. :class:`QueryLogits` runs the
model's body on all positions and its head on the query positions only: the same logits as
``model(tokens)[mask]`` (tested to round-off), at a ``T/P``-times smaller head cost.

References
----------
Arora et al. *Zoology: Measuring and Improving Recall in Efficient Language Models*, ICLR 2024.
"""

from __future__ import annotations

import torch
from torch import nn

from .model import TransformerLM
from .mqar import HELDOUT_OFFSET, IGNORE_INDEX, MQARConfig, mqar_batch

__all__ = ["QueryLogits", "evaluate_slices"]



class QueryLogits(nn.Module):
    """``(tokens [B, T], mask bool [B, T]) -> logits [N, vocab]`` at the ``N`` positions where ``mask``.

    Equals ``model(tokens)[mask]``: the embedding, the blocks and the final norm on every position,
    the head on the selected rows. A thin wrapper (no weights of its own), so DistributedDataParallel
    can wrap it in place of the model.
    """

    def __init__(self, model: TransformerLM):
        super().__init__()
        if not isinstance(model, TransformerLM):
            raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
        self.model = model

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = self.model
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != tokens.shape:
            raise ValueError(f"mask must be a bool tensor of the tokens' shape {tuple(tokens.shape)}, got "
                             f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")
        if tokens.ndim != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a LongTensor [B, T], got {tokens.dtype} {tuple(tokens.shape)}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= m.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {m.config.vocab_size}), got range "
                             f"[{int(tokens.min())}, {int(tokens.max())}]")
        x = m.embed(tokens)  # [B, T, d]
        for block in m.blocks:
            x = block(x)
        return m.head(m.ln_f(x[mask]))  # [N, d] -> [N, vocab]


@torch.no_grad()
def evaluate_slices(model: TransformerLM, tasks, *, num_sequences: int = 256, seed: int = 0,
                    batch_size: int = 64) -> list[dict]:
    """Held-out accuracy on each configuration of ``tasks`` (Zoology's slices by ``(T, P)``).

    Each configuration draws ``num_sequences`` sequences from its own stream, seeded
    ``seed + 1_000_003 + i`` for the ``i``-th configuration (disjoint from the training stream
    ``seed``). Returns one ``{"seq_len", "num_pairs", "accuracy", "queries"}`` per configuration;
    accuracy is correct / total over its query positions. The model's mode is restored.
    """
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    tasks = tuple(tasks)
    if not tasks or not all(isinstance(t, MQARConfig) for t in tasks):
        raise TypeError(f"tasks must be a non-empty sequence of MQARConfig, got {tasks!r}")
    head = QueryLogits(model)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    try:
        for i, task in enumerate(tasks):
            gen = torch.Generator().manual_seed(seed + HELDOUT_OFFSET + i)
            correct = total = 0
            for start in range(0, num_sequences, batch_size):
                inputs, targets = mqar_batch(task, min(batch_size, num_sequences - start), generator=gen)
                mask = targets != IGNORE_INDEX
                pred = head(inputs.to(device), mask.to(device)).argmax(-1).cpu()  # [N]
                correct += int((pred == targets[mask]).sum())
                total += int(mask.sum())
            out.append({"seq_len": task.seq_len, "num_pairs": task.num_pairs, "accuracy": correct / total,
                        "queries": total})
    finally:
        model.train(was_training)
    return out
