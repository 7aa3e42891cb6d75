"""The measures :func:`sketchlab.linearize` reports: next-token loss and perplexity (decoders),
sentence embeddings, their cosine and nearest-neighbour agreement with the teacher's (encoders)."""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from .._validation import check_positive_int
from .families import family_of

__all__ = ["embedding_agreement", "perplexity", "progress_bar", "sentence_embeddings", "token_nll"]


def _batches(n: int, batch_size: int):
    for start in range(0, n, batch_size):
        yield slice(start, min(n, start + batch_size))


def progress_bar(total: int, desc: str, enabled: bool, *, unit: str = "it", leave: bool = False):
    """A tqdm bar on stderr (its elapsed time, rate and ETA), or a silent one when not ``enabled``: the
    bar every stage of :func:`sketchlab.linearize` shows (``progress=True``; ``sketchlab linearize``
    unless ``--no-progress``)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, unit=unit, leave=leave, file=sys.stderr,
                dynamic_ncols=True)


@torch.no_grad()
def token_nll(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
              batch_size: int = 4, progress: bool = False, desc: str = "evaluate") -> torch.Tensor:
    """Next-token negative log-likelihood of every position: where along the context a model loses.

    Parameters
    ----------
    model : a causal LM with a language-model head (transformers or the toy ``TransformerLM``)
    input_ids, attention_mask : [N, T] tensors (mask 1 = real token); each sequence on its own
    batch_size : int >= 1
        Sequences per forward pass.
    progress, desc : bool, str
        A progress bar over the sequences on stderr (:func:`progress_bar`), labelled ``desc``.

    Returns
    -------
    torch.Tensor [N, T − 1] float64
        ``nll[n, t] = −log p(input_ids[n, t+1] | input_ids[n, :t+1])`` (the logits in float64),
        NaN where the target ``t + 1`` or the position ``t`` that predicts it is padding (right
        padding; with left padding, the first real token, which no real token predicts).
        :func:`perplexity` is ``exp`` of its mean over the non-NaN entries.
    """
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids and attention_mask must be [N, T] of one shape with T >= 2, got "
                         f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
    batch_size = check_positive_int(batch_size, "batch_size")
    parts = []
    was_training = model.training
    model.eval()
    bar = progress_bar(input_ids.shape[0], desc, progress, unit="seq")
    try:
        for part in _batches(input_ids.shape[0], batch_size):
            ids, mask = input_ids[part], attention_mask[part]
            logits = _logits(model, ids, mask)[:, :-1].double()  # [b, T-1, V]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [b, T-1]
            valid = mask[:, 1:].to(torch.bool) & mask[:, :-1].to(torch.bool)  # a real target read off a real position
            parts.append(nll.masked_fill(~valid, float("nan")))
            bar.update(ids.shape[0])
    finally:
        bar.close()
        model.train(was_training)
    return torch.cat(parts)


def perplexity(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
               batch_size: int = 4, progress: bool = False, desc: str = "evaluate") -> float:
    """``exp`` of the mean next-token negative log-likelihood over the valid tokens of ``input_ids``
    (each sequence on its own; a causal LM with a language-model head): ``exp(nanmean(token_nll))``."""
    nll = token_nll(model, input_ids, attention_mask, batch_size=batch_size, progress=progress, desc=desc)
    valid = ~torch.isnan(nll)
    if not bool(valid.any()):
        raise ValueError("perplexity: no valid next-token target (every sequence has fewer than 2 real tokens)")
    return math.exp(float(nll[valid].sum()) / int(valid.sum()))


def _logits(model, ids, mask):
    if family_of(model) == "toy":
        return model(ids)
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def _hidden(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).last_hidden_state


@torch.no_grad()
def embedding_agreement(model: nn.Module, teacher_embeddings: torch.Tensor, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor, *, batch_size: int = 8, progress: bool = False,
                        desc: str = "evaluate") -> dict:
    """Mean-pooled sentence embeddings of an encoder against the teacher's ``[N, hidden]``.

    Returns ``{"cosine": mean cosine of each sentence's embedding to the teacher's, "nn_agreement":
    fraction of sentences whose nearest other sentence (by cosine) is the same under both}``.
    """
    emb = sentence_embeddings(model, input_ids, attention_mask, batch_size=batch_size, progress=progress, desc=desc)
    cos = torch.nn.functional.cosine_similarity(emb, teacher_embeddings, dim=-1)
    return {"cosine": float(cos.mean()), "nn_agreement": _nn_agreement(emb, teacher_embeddings)}


def sentence_embeddings(model, input_ids, attention_mask, *, batch_size: int = 8, progress: bool = False,
                        desc: str = "evaluate") -> torch.Tensor:
    """Mean of the final hidden states over each sentence's valid tokens ``[N, hidden]`` (float64)."""
    out = []
    was_training = model.training
    model.eval()
    bar = progress_bar(input_ids.shape[0], desc, progress, unit="seq")
    try:
        with torch.no_grad():
            for part in _batches(input_ids.shape[0], batch_size):
                mask = attention_mask[part].to(torch.float64)[..., None]
                h = _hidden(model, input_ids[part], attention_mask[part]).double()
                out.append((h * mask).sum(1) / mask.sum(1))
                bar.update(mask.shape[0])
    finally:
        bar.close()
        model.train(was_training)
    return torch.cat(out)


def _nn_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    def nearest(x):
        x = torch.nn.functional.normalize(x, dim=-1)
        sim = x @ x.T
        sim.fill_diagonal_(-math.inf)
        return sim.argmax(-1)

    if a.shape[0] < 2:
        return float("nan")
    return float((nearest(a) == nearest(b)).double().mean())
