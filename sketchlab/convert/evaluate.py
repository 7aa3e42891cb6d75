"""The measures :func:`sketchlab.linearize` reports: next-token loss and perplexity (decoders),
sentence embeddings, their cosine and nearest-neighbour agreement with the teacher's (encoders), each
layer's attention-output error against the teacher's recording (:func:`attention_errors`), and each stage's
report entry beside window + sinks alone (:class:`StageMeasures`)."""

from __future__ import annotations

import contextlib
import math
import sys
import time

import torch
from torch import nn

from .._validation import check_positive_int
from .families import family_of

__all__ = ["FAR_OFF_LOGIT", "attention_errors", "embedding_agreement", "perplexity", "progress_bar",
           "sentence_embeddings", "token_nll"]

#: The gate logit that turns a hybrid's far part off: ``sigmoid(40) = 1`` in float32 and float64, so the
#: far part's weight ``1 − g`` is 0 (``far=False``, and the report's window + sinks alone).
FAR_OFF_LOGIT = 40.0


def _batches(n: int, batch_size: int):
    for start in range(0, n, batch_size):
        yield slice(start, min(n, start + batch_size))


@contextlib.contextmanager
def _evaluating(model: nn.Module, total: int, desc: str, progress: bool):
    """``model`` in eval mode and a progress bar over ``total`` sequences for the block, its mode restored."""
    was_training = model.training
    model.eval()
    try:
        with progress_bar(total, desc, progress, unit="seq") as bar:
            yield bar
    finally:
        model.train(was_training)


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
    with _evaluating(model, input_ids.shape[0], desc, progress) as bar:
        for part in _batches(input_ids.shape[0], batch_size):
            ids, mask = input_ids[part], attention_mask[part]
            logits = _logits(model, ids, mask)[:, :-1].double()  # [b, T-1, V]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [b, T-1]
            valid = mask[:, 1:].to(torch.bool) & mask[:, :-1].to(torch.bool)  # a real target read off a real position
            parts.append(nll.masked_fill(~valid, float("nan")))
            bar.update(ids.shape[0])
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
    with torch.no_grad(), _evaluating(model, input_ids.shape[0], desc, progress) as bar:
        for part in _batches(input_ids.shape[0], batch_size):
            mask = attention_mask[part].to(torch.float64)[..., None]
            h = _hidden(model, input_ids[part], attention_mask[part]).double()
            out.append((h * mask).sum(1) / mask.sum(1))
            bar.update(mask.shape[0])
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


def attention_errors(sketches, layers, attention_mask: torch.Tensor, index, *, batch_size: int = 4,
                     progress: bool = False, desc: str = "attention errors") -> list[float]:
    """Per layer ``‖o − o_teacher‖_F / ‖o_teacher‖_F`` over the valid tokens of sequences ``index``,
    each sketched attention given the teacher's q, k, v (``layers``: its
    :class:`~sketchlab.convert.teacher.LayerIO` records; ``progress``: a bar over the layers)."""
    errors = []
    idx = torch.arange(attention_mask.shape[0])[index]
    with torch.no_grad(), progress_bar(len(sketches), desc, progress, unit="layer") as bar:
        for sketch, io in zip(sketches, layers):
            num = den = 0.0
            for part in _batches(len(idx), batch_size):
                sel = idx[part]
                q, k, v = io.inputs(sel)
                valid = attention_mask[sel].to(torch.bool)
                o = sketch(q, k, v, scaling=io.scaling, key_padding_mask=None if bool(valid.all()) else valid)
                num += float(((o - io.out[sel]).double()[valid] ** 2).sum())
                den += float((io.out[sel].double()[valid] ** 2).sum())
            errors.append(math.sqrt(num / den) if den > 0 else float("nan"))
            bar.update()
    return errors


@contextlib.contextmanager
def far_off(sketches):
    """Every gate of ``sketches`` at :data:`FAR_OFF_LOGIT` inside the block (window + sinks alone),
    restored after it."""
    gated = [s for s in sketches if getattr(s, "gate", None) is not None]
    saved = [s.gate.detach().clone() for s in gated]
    with torch.no_grad():
        for s in gated:
            s.gate.fill_(FAR_OFF_LOGIT)
    try:
        yield
    finally:
        with torch.no_grad():
            for s, g in zip(gated, saved):
                s.gate.copy_(g)


class StageMeasures:
    """The held-out measures of :func:`sketchlab.linearize`'s stages (``ids, mask [N, T]``, the sequences
    ``held_idx``): each stage's metric (perplexity, or an encoder's mean embedding cosine and neighbour
    agreement to the teacher's) and, once :meth:`window_only` is set, window + sinks alone beside it."""

    def __init__(self, ids, mask, held_idx, *, encoder: bool, enabled: bool, batch_size: int, progress: bool):
        self.ids, self.mask, self.encoder, self.enabled = ids[held_idx], mask[held_idx], encoder, enabled
        self.options = {"batch_size": batch_size, "progress": progress}
        self.teacher_embeddings = self.floor = None

    def teacher(self, model) -> float | None:
        """The teacher's metric (an encoder's: its own embeddings, kept as every stage's reference)."""
        if self.encoder and self.enabled:
            self.teacher_embeddings = sentence_embeddings(model, self.ids, self.mask, desc="evaluate teacher",
                                                          **self.options)
        return self.measure(model, "teacher")[0]

    def measure(self, model, stage: str):
        """``(metric, neighbour agreement or None)`` of ``model`` on the held-out sequences (``None, None``
        when not ``enabled``)."""
        if not self.enabled:
            return None, None
        if self.encoder:
            got = embedding_agreement(model, self.teacher_embeddings, self.ids, self.mask, desc=f"evaluate {stage}",
                                      **self.options)
            return got["cosine"], got["nn_agreement"]
        return perplexity(model, self.ids, self.mask, desc=f"evaluate {stage}", **self.options), None

    def window_only(self, sketches, layer_error: list[float]) -> None:
        """Window + sinks alone beside every stage from now on: ``sketches`` with their gates at
        :data:`FAR_OFF_LOGIT` (the far part's weight 0: the floor it must beat), ``layer_error`` their
        attention-output errors so; its metric measured at the next stage, once per set of projections
        (set again after LoRA)."""
        self.floor = {"metric": None, "nn_agreement": None, "layer_error": layer_error, "sketches": sketches}

    def stage(self, name: str, t0: float, model, **details) -> dict:
        """A stage's report entry: its details, seconds since ``t0``, held-out metric and, with the floor,
        ``window_only_metric``, ``window_only_layer_error`` and ``far_helps`` (the metric beats it: lower
        for a perplexity, higher for an encoder's cosine)."""
        seconds = time.perf_counter() - t0
        metric, agreement = self.measure(model, name)
        entry = {"name": name, "seconds": seconds, **details, "metric": metric}
        if agreement is not None:
            entry["nn_agreement"] = agreement
        floor = self.floor
        if floor is None:
            return entry
        if floor["metric"] is None and metric is not None:
            with far_off(floor["sketches"]):
                floor["metric"], floor["nn_agreement"] = self.measure(model, f"{name}, window + sinks alone")
        entry.update(window_only_metric=floor["metric"], window_only_layer_error=floor["layer_error"])
        if floor["nn_agreement"] is not None:
            entry["window_only_nn_agreement"] = floor["nn_agreement"]
        if metric is not None and floor["metric"] is not None:
            entry["far_helps"] = bool(metric > floor["metric"] if self.encoder else metric < floor["metric"])
        return entry
