"""The teacher's side of :func:`sketchlab.linearize`: the text it reads (:func:`tokenize_texts`) and every
attention layer's recorded inputs and output on it (:func:`teacher_attention`, one :class:`LayerIO` per
layer), which the later stages train and measure against."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .._validation import check_positive_int
from .evaluate import _batches, progress_bar
from .families import family_of

__all__ = ["LayerIO", "teacher_attention", "tokenize_texts"]

_TEACHER_NAME = "sketchlab_teacher"
_NO_TOKENS = "texts hold no tokens (an empty or whitespace-only text, or empty token lists): give text to train on"
_RECORDING: list[dict] = []


@dataclass
class LayerIO:
    """One attention layer's inputs and output in a teacher pass over ``N`` sequences of ``T`` tokens.

    ``q [N, T, H, D]``, ``k``, ``v [N, T, H_kv, D]`` (post-RoPE, GQA heads not repeated), ``out
    [N, T, H, Dv]`` (the teacher's attention output), ``scaling`` the module's logit scale.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    scaling: float

    def inputs(self, index) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v [n, T, H, D]`` of the sequences ``index``, k and v repeated to the q heads."""
        rep = self.q.shape[2] // self.k.shape[2]
        return self.q[index], self.k[index].repeat_interleave(rep, dim=2), self.v[index].repeat_interleave(rep, dim=2)


def tokenize_texts(texts, tokenizer=None, *, seq_len: int = 512, max_tokens: int | None = None,
                   sentences: bool = False):
    """``(input_ids [N, T], attention_mask [N, T])`` from texts or token ids, cut into ``seq_len`` pieces.

    ``texts``: a string, a list of strings (each tokenised by ``tokenizer``, no special tokens added
    beyond the tokenizer's defaults), a LongTensor ``[N, T]`` (taken as is, all tokens valid), or a
    list of token-id lists. Longer sequences are cut into ``seq_len``-token pieces
    (:func:`sketchlab.capture.split_sequences`), ``max_tokens`` in all (default: all).

    ``sentences=True`` (strings only; what :func:`linearize` does for an encoder): one sequence per
    sentence — each non-blank line of the text(s) — tokenised with the model's special tokens,
    truncated to ``seq_len`` tokens (never cut into pieces without them), right-padded with the
    tokenizer's pad token; sentences are kept in order until ``max_tokens`` tokens are taken.
    """
    from ..capture import split_sequences

    seq_len = check_positive_int(seq_len, "seq_len")
    if tokenizer is None and _all_strings(texts):
        raise ValueError("texts are strings: pass the model's tokenizer")
    if sentences:
        return _sentences(texts, tokenizer, seq_len, max_tokens)
    if isinstance(texts, torch.Tensor):
        if texts.ndim != 2 or texts.dtype != torch.long:
            raise ValueError(f"texts as a tensor must be a LongTensor [N, T] of token ids, got {texts.dtype} {tuple(texts.shape)}")
        rows = texts.tolist()
    else:
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, (list, tuple)) or not texts:
            raise ValueError("texts must be a string, a non-empty list of strings or token-id lists, or a LongTensor [N, T]")
        if all(isinstance(t, str) for t in texts):
            rows = [tokenizer(t)["input_ids"] for t in texts]
        elif all(isinstance(t, (list, tuple)) and all(isinstance(i, int) for i in t) for t in texts):
            rows = [list(t) for t in texts]
        else:
            raise ValueError("texts must all be strings or all be lists of token ids")
    total = sum(len(r) for r in rows)
    if not total:
        raise ValueError(_NO_TOKENS)
    if any(i < 0 for r in rows for i in r):
        raise ValueError("texts: token ids must be >= 0, got a negative one")
    return split_sequences(rows, seq_len=seq_len, max_tokens=total if max_tokens is None else max_tokens)


def _sentences(texts, tokenizer, seq_len: int, max_tokens):
    """:func:`tokenize_texts` with ``sentences=True``."""
    if not _all_strings(texts):
        raise ValueError("sentences=True reads text: texts must be a string or a non-empty list of strings")
    lines = [line.strip() for text in ([texts] if isinstance(texts, str) else texts) for line in text.splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        raise ValueError(_NO_TOKENS)
    budget = math.inf if max_tokens is None else check_positive_int(max_tokens, "max_tokens")
    rows = []
    for line in lines:
        row = tokenizer(line, truncation=True, max_length=seq_len)["input_ids"]
        if not row:
            continue
        if len(row) > budget:
            break
        rows.append(row)
        budget -= len(row)
    if not rows:
        raise ValueError(f"max_tokens={max_tokens} is less than the first sentence's {len(row)} tokens: raise it")
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids, mask


def _all_strings(texts) -> bool:
    """``texts`` is a string or a non-empty list of strings (what an encoder reads one sentence a line of)."""
    return isinstance(texts, str) or (isinstance(texts, (list, tuple)) and bool(texts)
                                      and all(isinstance(t, str) for t in texts))


def _record_teacher(module, query, key, value, attention_mask, *args, **kwargs):
    """Registered in transformers' ``AttentionInterface``: run the model's own attention and record
    its inputs and output (see :func:`teacher_attention`)."""
    from ..hf.interface import original_attention

    rec = _RECORDING[-1]
    out, weights = original_attention(module, rec["original"])(module, query, key, value, attention_mask, *args, **kwargs)
    parts = (query.detach().transpose(1, 2), key.detach().transpose(1, 2), value.detach().transpose(1, 2), out.detach())
    store = rec["layers"].get(module.layer_idx)
    if store is None:  # every sequence's rows, allocated once: no second copy of the recording (a cat at the end)
        store = rec["layers"][module.layer_idx] = [
            torch.empty((rec["N"],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device) for t in parts
        ] + [float(kwargs.get("scaling", module.scaling))]
    for buffer, t in zip(store, parts):
        buffer[rec["rows"]] = t
    return out, weights


def _teacher_mask(*args, **kwargs):
    from ..hf.interface import original_mask

    return original_mask(_RECORDING[-1]["original"])(*args, **kwargs)


@torch.no_grad()
def teacher_attention(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                      batch_size: int = 4, progress: bool = False) -> list[LayerIO]:
    """Every self-attention layer's inputs and output on ``input_ids [N, T]`` (a transformers model,
    through its attention interface, or sketchlab's toy model, through hooks on its kernels); each
    layer's tensors are allocated once and filled batch by batch (the recording's size, not twice it).
    ``progress``: a bar over the sequences on stderr."""
    from ..hf.interface import attention_implementation, register

    bar = progress_bar(input_ids.shape[0], "teacher recording", progress, unit="seq", leave=True)
    if family_of(model) == "toy":
        with bar:
            return _toy_teacher(model, input_ids, batch_size, bar)
    register(_TEACHER_NAME, _record_teacher, _teacher_mask)
    rec = {"original": model.config._attn_implementation, "layers": {}, "N": input_ids.shape[0]}
    _RECORDING.append(rec)
    was_training = model.training
    model.eval()
    try:
        with attention_implementation(model, _TEACHER_NAME), bar:
            for part in _batches(input_ids.shape[0], batch_size):
                rec["rows"] = part
                model(input_ids=input_ids[part], attention_mask=attention_mask[part], use_cache=False)
                bar.update(part.stop - part.start)
    finally:
        _RECORDING.pop()
        model.train(was_training)
    return [LayerIO(*rec["layers"][index]) for index in sorted(rec["layers"])]


def _toy_teacher(model, input_ids, batch_size, bar):
    """:func:`teacher_attention` of sketchlab's toy model: forward hooks on each block's attention kernel."""
    records = {}

    def hook_for(i):
        def hook(module, args, output):
            records.setdefault(i, []).append(tuple(a.detach() for a in args[:3]) + (output.detach(),))
        return hook

    handles = [block.attention.attn.register_forward_hook(hook_for(i)) for i, block in enumerate(model.blocks)]
    try:
        for part in _batches(input_ids.shape[0], batch_size):
            model(input_ids[part])
            bar.update(part.stop - part.start)
    finally:
        for h in handles:
            h.remove()
    D = model.config.head_dim
    return [LayerIO(*(torch.cat([p[j] for p in records[i]]) for j in range(4)), D ** -0.5) for i in sorted(records)]
