r"""Recall measures of a causal language model: the passkey test and copy recall (DESIGN §7).

A converted model forgets what lies beyond its window when its far state cannot single a key out;
these two measures say how much. Both run on any causal transformers model of a supported family
(LLaMA-like, GPT-2), converted or not, and on sketchlab's toy :class:`~sketchlab.tasks.TransformerLM`.

* :func:`passkey_accuracy` — a five-digit key hidden at a given depth of repeated filler sentences,
  then the question; greedy decoding through the model's own decoding path (transformers'
  ``generate()``, which decodes a converted model from its :class:`~sketchlab.convert.cache.SketchStateCache`,
  or :func:`sketchlab.tasks.generate` for the toy model); a hit when the key's digits appear in the
  decoded continuation. The prompt is built by :func:`passkey_prompt`.
* :func:`copy_recall` — a held-out passage, ``gap`` tokens of other held-out text, the passage again:
  the mean next-token loss of each copy (:func:`sketchlab.convert.token_nll`). A model that recalls
  the first copy predicts the second far better; one that has forgotten it sees the second copy as new.

:func:`format_recall` prints both as markdown tables; ``sketchlab evaluate`` runs them on a saved model.

References
----------
Mohtashami & Jaggi, *Landmark Attention: Random-Access Infinite Context Length for Transformers*,
2023 (the passkey test and its filler); Olsson et al., *In-context Learning and Induction Heads*, 2022
(a repeated passage as the probe of induction).
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ._validation import check_positive_int, check_seed

__all__ = ["CopyRecall", "DEFAULT_FILLER", "PasskeyResult", "copy_recall", "format_recall", "passkey_accuracy",
           "passkey_prompt"]

#: The classic filler of the passkey test (Mohtashami & Jaggi, 2023), repeated sentence by sentence.
DEFAULT_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
#: The needle (``{key}``: the digits) and the question that ends every prompt.
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


# ------------------------------------------------------------------------------------------------
# checks (each public entry point runs them once)


def _check_model(model, where: str) -> tuple[str, int]:
    """``(family, vocabulary size)`` of a causal LM; ``ValueError`` naming the model otherwise."""
    from .hf.families import FAMILY_TABLE, family_of_type, supported_types
    from .tasks.model import TransformerLM

    if isinstance(model, TransformerLM):
        return "toy", int(model.config.vocab_size)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be a torch.nn.Module (a transformers causal LM or sketchlab's "
                        f"TransformerLM), got {type(model).__name__}")
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    family = family_of_type(model_type)
    name = f"{type(model).__name__} (model_type {model_type!r})"
    if family is None:
        raise ValueError(f"{where}: {name} is not a causal LM of a supported family; supported: sketchlab's "
                         f"TransformerLM and transformers causal LMs of type {supported_types(encoders=False)}")
    can_generate = getattr(model, "can_generate", None)
    causal = not FAMILY_TABLE[family].encoder or bool(getattr(cfg, "is_decoder", False))
    if not causal or getattr(cfg, "is_encoder_decoder", False) or not (callable(can_generate) and can_generate()):
        why = "an encoder (bidirectional attention)" if not causal else "no language-model head (it cannot generate)"
        raise ValueError(f"{where}: {name} is not a causal language model: {why}; load it with "
                         "AutoModelForCausalLM (a decoder of the LLaMA or GPT-2 family)")
    embeddings = model.get_input_embeddings()
    return family, int(embeddings.num_embeddings)


def _check_ids_in_vocab(ids: torch.Tensor, vocab: int, what: str) -> None:
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{what} holds the token id {bad}, outside the model's vocabulary [0, {vocab}) "
                         "(text tokenised for another model?)")


def _int_list(values, name: str, lo: int) -> tuple[int, ...]:
    """A non-empty sequence of distinct integers ``>= lo``, as a tuple."""
    if isinstance(values, (int, str)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of integers >= {lo}, got {values!r}")
    values = tuple(values)
    if not values:
        raise ValueError(f"{name} must hold at least one value")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} must be integers >= {lo}, got {v!r} ({type(v).__name__}) in {values}")
        if v < lo:
            raise ValueError(f"{name} must be integers >= {lo}, got {v} in {values}")
    checked = tuple(int(v) for v in values)
    if len(set(checked)) != len(checked):
        raise ValueError(f"{name} must be distinct, got {values}")
    return checked


def _depth_list(depths) -> tuple[float, ...]:
    if isinstance(depths, (int, float, str)) or not hasattr(depths, "__iter__"):
        raise TypeError(f"depths must be a sequence of numbers in [0, 1], got {depths!r}")
    depths = tuple(depths)
    if not depths:
        raise ValueError("depths must hold at least one value")
    out = []
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, numbers.Real) or not 0 <= d <= 1:
            raise ValueError(f"depths must be numbers in [0, 1] (0: the key first, 1: just before the question), "
                             f"got {d!r} in {depths}")
        out.append(float(d))
    if len(set(out)) != len(out):
        raise ValueError(f"depths must be distinct, got {depths}")
    return tuple(out)


# ------------------------------------------------------------------------------------------------
# tokenizers: a transformers tokenizer or a pair (encode, decode)


@dataclass(frozen=True)
class _Codec:
    """``encode(text) -> ids`` without special tokens, ``decode(ids) -> text``, and the special tokens a
    tokenizer puts before a text by default (``prefix``: a LLaMA BOS; none for GPT-2 or SmolLM2)."""

    encode: object
    decode: object
    prefix: tuple[int, ...]
    pad: int | None


def _codec(tokenizer) -> _Codec:
    if isinstance(tokenizer, (tuple, list)):
        if len(tokenizer) != 2 or not all(callable(f) for f in tokenizer):
            raise TypeError("tokenizer as a pair must be (encode, decode): two callables, encode(str) -> list of "
                            "token ids and decode(list of ids) -> str")
        enc, dec = tokenizer
        return _Codec(lambda s: [int(i) for i in enc(s)], dec, (), None)
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))
            and hasattr(tokenizer, "all_special_ids")):
        raise TypeError(f"tokenizer must be a transformers tokenizer or a pair (encode, decode) of callables, got "
                        f"{type(tokenizer).__name__}")
    full = list(tokenizer.encode(" x"))
    plain = list(tokenizer.encode(" x", add_special_tokens=False))
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain]
    prefix = tuple(full[: starts[0]]) if starts else ()
    return _Codec(lambda s: list(tokenizer.encode(s, add_special_tokens=False)),
                  lambda ids: tokenizer.decode(ids, skip_special_tokens=True), prefix,
                  getattr(tokenizer, "pad_token_id", None))


def _sentences(filler: str) -> list[str]:
    if not isinstance(filler, str) or not filler.strip():
        raise ValueError(f"filler must be a non-empty string of sentences, got {filler!r}")
    return [s for s in re.split(r"(?<=[.!?])\s+", filler.strip()) if s]


@dataclass(frozen=True)
class _Plan:
    """The pieces of a passkey prompt, tokenised: special prefix, the filler sentences (each with its
    leading space), the needle and the question."""

    prefix: tuple[int, ...]
    sentences: tuple[tuple[int, ...], ...]
    needle: tuple[int, ...]
    question: tuple[int, ...]

    @property
    def fixed(self) -> int:
        return len(self.prefix) + len(self.needle) + len(self.question)

    @property
    def minimum(self) -> int:
        """The shortest prompt: the fixed parts and one pass over the filler sentences."""
        return self.fixed + sum(len(s) for s in self.sentences)


def _plan(codec: _Codec, key: str, filler: str) -> _Plan:
    sentences = tuple(tuple(codec.encode(" " + s)) for s in _sentences(filler))
    if any(not s for s in sentences):
        raise ValueError("filler: a sentence encodes to no tokens")
    return _Plan(codec.prefix, sentences, tuple(codec.encode(" " + NEEDLE.format(key=key))),
                 tuple(codec.encode(" " + QUESTION)))


def _check_key(key) -> str:
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f"key must be a non-negative int or a string of digits, got {key!r}")
    text = str(key)
    if not text.isdigit() or not text.isascii():
        raise ValueError(f"key must be a non-negative int or a string of digits, got {key!r}")
    return text


def _build(plan: _Plan, length: int, depth: float) -> tuple[list[int], int]:
    """``(ids, needle start)`` of a checked ``length`` and ``depth`` (trusts its inputs but the length).

    The filler is the stream of sentences repeated, its *front* cut so that exactly ``F = length −
    fixed`` tokens remain (the first sentence may be partial, as a context cut from a longer text);
    the needle goes in at the sentence boundary nearest to ``depth · F`` (ties: the earlier one)."""
    F = length - plan.fixed
    if length < plan.minimum:
        raise ValueError(f"length={length} is too short for this passkey prompt: it needs at least {plan.minimum} "
                         f"tokens ({len(plan.prefix)} special, {len(plan.needle)} needle, {len(plan.question)} "
                         f"question and {plan.minimum - plan.fixed} of filler, one pass over its sentences)")
    # sentences from the end backwards until F tokens are covered, then the front cut
    pieces, total, i = [], 0, 0
    count = len(plan.sentences)
    while total < F:
        s = plan.sentences[(count - 1 - i) % count]
        pieces.append(s)
        total += len(s)
        i += 1
    pieces.reverse()
    cut = total - F  # tokens dropped from the first (partial) sentence
    filler, bounds = [], [0]
    for j, s in enumerate(pieces):
        filler.extend(s[cut:] if j == 0 else s)
        bounds.append(len(filler))  # [0, end of each sentence]; the last is F
    at = min(bounds, key=lambda b: (abs(b - depth * F), b))
    ids = [*plan.prefix, *filler[:at], *plan.needle, *filler[at:], *plan.question]
    return ids, len(plan.prefix) + at


def passkey_prompt(tokenizer, length: int, depth: float, key, *, filler: str = DEFAULT_FILLER) -> torch.Tensor:
    r"""The token ids of one passkey prompt: filler sentences, the key at ``depth``, the question.

    Parameters
    ----------
    tokenizer : transformers tokenizer or (encode, decode)
        Used as a plain language model's tokenizer: no chat template, even for a chat/instruct model
        (the prompt is text to continue). A transformers tokenizer's default special tokens *before*
        a text (a LLaMA BOS; SmolLM2 and GPT-2 add none) start the prompt. A pair of callables
        ``encode(str) -> list of ids``, ``decode(ids) -> str`` (e.g. bytes for the toy byte-level
        model) adds no special token.
    length : int
        The prompt's length in tokens, exactly: special prefix + filler + needle + question ==
        ``length``. At least the fixed parts and one pass over the filler's sentences (refused
        below it, naming the minimum).
    depth : float in [0, 1]
        Where the needle sits in the filler: it starts at the sentence boundary of the filler
        nearest to ``depth · F`` (``F`` filler tokens), so within half a filler sentence of the
        exact depth; 0 puts it first, 1 just before the question.
    key : int >= 0 or str of digits
        The pass key (:func:`passkey_accuracy` draws five digits).
    filler : str
        Sentences (split after ``.``, ``!``, ``?``) repeated to fill the prompt.

    Returns
    -------
    torch.Tensor [length] int64

    Notes
    -----
    The prompt reads ``<prefix> … filler … The pass key is NNNNN. Remember it. NNNNN is the pass key.
    … filler … What is the pass key? The pass key is``. Each sentence, the needle and the question are
    encoded on their own with a leading space and joined (for the byte-level BPE tokenizers of
    GPT-2/SmolLM2 the same tokens as encoding the whole text, whose pre-tokenizer splits before each
    space). The filler is the sentences repeated with its front cut to length, so the first sentence
    may be partial.
    """
    codec = _codec(tokenizer)
    length = check_positive_int(length, "length")
    depth = _depth_list((depth,))[0]
    plan = _plan(codec, _check_key(key), filler)
    return torch.tensor(_build(plan, length, depth)[0], dtype=torch.long)


# ------------------------------------------------------------------------------------------------
# passkey accuracy


@dataclass
class PasskeyResult:
    """Outcome of :func:`passkey_accuracy`.

    ``keys``, ``generated`` (the decoded continuations) and ``hits`` map ``(length, depth)`` to
    ``n`` entries, in draw order. ``rate[(length, depth)]`` is the hit rate of a cell, ``overall``
    that of every prompt.
    """

    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    n: int
    seed: int
    max_new_tokens: int
    keys: dict = field(default_factory=dict)
    generated: dict = field(default_factory=dict)
    hits: dict = field(default_factory=dict)

    @property
    def rate(self) -> dict:
        return {cell: sum(h) / len(h) for cell, h in self.hits.items()}

    @property
    def overall(self) -> float:
        every = [h for hits in self.hits.values() for h in hits]
        return sum(every) / len(every)

    def by_length(self, length: int) -> float:
        """The hit rate at ``length`` over every depth."""
        every = [h for d in self.depths for h in self.hits[length, d]]
        return sum(every) / len(every)

    def by_depth(self, depth: float) -> float:
        """The hit rate at ``depth`` over every length."""
        every = [h for n in self.lengths for h in self.hits[n, depth]]
        return sum(every) / len(every)

    def as_dict(self) -> dict:
        """JSON-ready: the settings, and per cell ``{"length", "depth", "keys", "generated", "hits", "rate"}``."""
        return {"lengths": list(self.lengths), "depths": list(self.depths), "n": self.n, "seed": self.seed,
                "max_new_tokens": self.max_new_tokens, "overall": self.overall,
                "cells": [{"length": n, "depth": d, "keys": self.keys[n, d], "generated": self.generated[n, d],
                           "hits": self.hits[n, d], "rate": self.rate[n, d]} for n in self.lengths for d in self.depths]}


def _continue(model, family: str, ids: torch.Tensor, max_new_tokens: int, pad: int | None) -> list[int]:
    """The greedy continuation (``max_new_tokens`` at most) of ``ids [T]`` through the model's own decoding."""
    if family == "toy":
        from .tasks.model import generate

        return generate(model, ids[None], max_new_tokens)[0, ids.numel():].tolist()
    from transformers import GenerationConfig

    own = model.generation_config
    eos = own.eos_token_id
    if pad is None:
        pad = own.pad_token_id if own.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=eos,
                              bos_token_id=own.bos_token_id, pad_token_id=0 if pad is None else pad)
    device = next(model.parameters()).device
    ids = ids.to(device)[None]  # [1, T]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, ids.shape[1]:].tolist()


def passkey_accuracy(model: nn.Module, tokenizer, lengths=(1024, 2048, 4096), depths=(0.1, 0.5, 0.9), n: int = 5, *,
                     seed: int = 0, max_new_tokens: int = 8, filler: str = DEFAULT_FILLER,
                     progress: bool = False) -> PasskeyResult:
    r"""Passkey retrieval: the share of prompts whose key the model repeats after the question.

    Parameters
    ----------
    model : nn.Module
        A transformers causal LM of a supported family (converted or not: a converted one decodes
        from its :class:`~sketchlab.convert.cache.SketchStateCache`) or sketchlab's
        :class:`~sketchlab.tasks.TransformerLM` (decoded by :func:`sketchlab.tasks.generate`, from its
        state when converted). Put in eval mode.
    tokenizer : transformers tokenizer or (encode, decode)
        As :func:`passkey_prompt` (no chat template: an instruct model is run as a plain LM).
    lengths : sequence of int
        Prompt lengths in tokens (exactly, :func:`passkey_prompt`), each at least the prompt's
        minimum (checked for every drawn key before the model runs).
    depths : sequence of float in [0, 1]
        Where the key sits in the filler.
    n : int >= 1
        Prompts per (length, depth), each with its own key.
    seed : int
        The keys: five-digit numbers in [10000, 99999] drawn in one call ``[len(lengths),
        len(depths), n]`` from a generator seeded with ``seed`` (same seed, same keys).
    max_new_tokens : int >= 1
        Greedy tokens decoded after the question (decoding stops early at the model's EOS).
    filler : str
        The filler sentences.
    progress : bool
        A tqdm bar over the prompts on stderr.

    Returns
    -------
    PasskeyResult
        A hit when the key's digits appear in the decoded continuation (a substring: ``" 12345."``
        and ``"12345 is"`` both hit; a wrong digit or an interrupted number does not).
    """
    family, vocab = _check_model(model, "passkey_accuracy")
    codec = _codec(tokenizer)
    lengths = _int_list(lengths, "lengths", 1)
    depths = _depth_list(depths)
    n = check_positive_int(n, "n")
    seed = check_seed(seed)
    max_new_tokens = check_positive_int(max_new_tokens, "max_new_tokens")
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(10000, 100000, (len(lengths), len(depths), n), generator=gen)  # [lengths, depths, n]
    prompts = {}
    for li, length in enumerate(lengths):  # every prompt built (and checked) before the model runs
        for di, depth in enumerate(depths):
            for i in range(n):
                key = str(int(keys[li, di, i]))
                ids = torch.tensor(_build(_plan(codec, key, filler), length, depth)[0], dtype=torch.long)
                _check_ids_in_vocab(ids, vocab, f"the passkey prompt (length {length}, tokenizer {type(tokenizer).__name__})")
                prompts[length, depth, i] = (key, ids)
    result = PasskeyResult(lengths, depths, n, seed, max_new_tokens)
    from tqdm.auto import tqdm

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for (length, depth, i), (key, ids) in tqdm(prompts.items(), desc="passkey", disable=not progress):
                text = codec.decode(_continue(model, family, ids, max_new_tokens, codec.pad))
                result.keys.setdefault((length, depth), []).append(key)
                result.generated.setdefault((length, depth), []).append(text)
                result.hits.setdefault((length, depth), []).append(key in text)
    finally:
        model.train(was_training)
    return result


# ------------------------------------------------------------------------------------------------
# copy recall


@dataclass
class CopyRecall:
    """Outcome of :func:`copy_recall`.

    ``first[gap]``, ``second[gap]``: mean NLL (nats/token) of the passage's tokens ``1 … P−1`` in the
    first and the second copy, over the ``n`` draws; ``first_draws``/``second_draws[gap]``: each
    draw's mean. ``starts``: each draw's passage start in ``input_ids`` (shared by every gap);
    ``gap_starts[gap]``: each draw's gap start.
    """

    gaps: tuple[int, ...]
    passage: int
    n: int
    seed: int
    starts: list = field(default_factory=list)
    gap_starts: dict = field(default_factory=dict)
    first: dict = field(default_factory=dict)
    second: dict = field(default_factory=dict)
    first_draws: dict = field(default_factory=dict)
    second_draws: dict = field(default_factory=dict)

    def gain(self, gap: int) -> float:
        """``first − second``: what recalling the first copy saves per token at ``gap``."""
        return self.first[gap] - self.second[gap]

    def as_dict(self) -> dict:
        return {"passage": self.passage, "n": self.n, "seed": self.seed, "starts": self.starts,
                "gaps": [{"gap": g, "first": self.first[g], "second": self.second[g], "gap_starts": self.gap_starts[g],
                          "first_draws": self.first_draws[g], "second_draws": self.second_draws[g]}
                         for g in self.gaps]}


def copy_recall(model: nn.Module, input_ids: torch.Tensor, gaps=(256, 1024, 2048), *, passage: int = 128, n: int = 4,
                seed: int = 0, batch_size: int = 4) -> CopyRecall:
    r"""Copy recall: the loss on a passage read once, and again after ``gap`` tokens of other text.

    Parameters
    ----------
    model : nn.Module
        A transformers causal LM of a supported family (converted or not) or the toy
        :class:`~sketchlab.tasks.TransformerLM`.
    input_ids : torch.Tensor [N] (integer)
        Held-out token ids, one stream (e.g. ``tokenize_texts(text, tokenizer, seq_len=...)``'s
        row); at least ``passage + max(gaps)`` of them, each inside the model's vocabulary.
    gaps : sequence of int >= 0
        Tokens between the two copies (0: the passage twice in a row).
    passage : int >= 2
        Tokens of the passage ``P``.
    n : int >= 1
        Draws (sequences) per gap.
    seed : int
        The draws' generator.
    batch_size : int >= 1
        Sequences per forward pass (:func:`sketchlab.convert.token_nll`).

    Returns
    -------
    CopyRecall

    Notes
    -----
    Draw ``i`` takes the passage ``x[a : a+P]`` with ``a`` uniform in ``[0, N − P − max(gaps)]`` (the
    same passages for every gap, so gaps compare on the same text) and, for each gap ``G``, the gap
    text ``x[b : b+G]`` with ``b`` uniform in ``[a + P, N − G]``: after the passage in the source,
    never overlapping it, so the second copy never follows the text that preceded it there. The
    sequence ``[x[a:a+P], x[b:b+G], x[a:a+P]]`` (``2P + G`` tokens, no special token) is scored by
    :func:`~sketchlab.convert.token_nll`, and each copy's loss is the mean over its tokens ``1 …
    P−1`` (targets ``j = 1 … P−1`` and ``j = P+G+1 … 2P+G−1``): the first token of each copy is left
    out of both, since nothing in the sequence can predict it. For a causal model the first copy's
    loss is the same at every gap.
    """
    from .convert.evaluate import token_nll

    _, vocab = _check_model(model, "copy_recall")
    passage = check_positive_int(passage, "passage")
    if passage < 2:
        raise ValueError(f"passage must be an integer >= 2 (its tokens 1 … passage−1 are scored), got {passage}")
    gaps = _int_list(gaps, "gaps", 0)
    n = check_positive_int(n, "n")
    seed = check_seed(seed)
    batch_size = check_positive_int(batch_size, "batch_size")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 1 or input_ids.dtype.is_floating_point \
            or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        shown = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a 1-D integer tensor of token ids, got {shown}")
    N, need = input_ids.numel(), passage + max(gaps)
    if N < need:
        raise ValueError(f"input_ids has {N} tokens; copy_recall needs at least passage + max(gaps) = {passage} + "
                         f"{max(gaps)} = {need} (the passage and, after it in the text, the longest gap)")
    _check_ids_in_vocab(input_ids, vocab, "input_ids")
    x = input_ids.long().cpu()
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, N - need + 1, (n,), generator=gen).tolist()
    result = CopyRecall(gaps, passage, n, seed, starts=starts)
    device = next(model.parameters()).device
    P = passage
    for G in gaps:
        b = [int(torch.randint(a + P, N - G + 1, (1,), generator=gen)) for a in starts]
        seqs = torch.stack([torch.cat([x[a:a + P], x[s:s + G], x[a:a + P]]) for a, s in zip(starts, b)])  # [n, 2P+G]
        nll = token_nll(model, seqs.to(device), torch.ones_like(seqs, device=device), batch_size=batch_size)
        # nll[:, t] scores target t + 1: the first copy's targets 1 … P−1, the second's P+G+1 … 2P+G−1
        first = nll[:, 0:P - 1].mean(1)  # [n]
        second = nll[:, P + G:2 * P + G - 1].mean(1)  # [n]
        result.gap_starts[G] = b
        result.first_draws[G], result.second_draws[G] = first.tolist(), second.tolist()
        result.first[G], result.second[G] = float(first.mean()), float(second.mean())
    return result


# ------------------------------------------------------------------------------------------------
# tables


def format_recall(passkey: PasskeyResult | None = None, copy: CopyRecall | None = None, *,
                  title: str | None = None) -> str:
    """Markdown tables of a :class:`PasskeyResult` (hit rate per length × depth, with the row, column
    and overall rates) and of a :class:`CopyRecall` (per gap: each copy's mean NLL and their difference)."""
    if passkey is None and copy is None:
        raise ValueError("format_recall: give a PasskeyResult, a CopyRecall or both")
    lines = [f"# {title}", ""] if title else []
    if passkey is not None:
        r = passkey
        lines += [f"Passkey retrieval: hit rate over {r.n} key(s) per cell (greedy, {r.max_new_tokens} new tokens; "
                  f"seed {r.seed}; a hit when the five digits appear in the continuation).", "",
                  "| length (tokens) | " + " | ".join(f"depth {d:g}" for d in r.depths) + " | all depths |",
                  "|---|" + "---|" * (len(r.depths) + 1)]
        for n in r.lengths:
            cells = [f"{r.rate[n, d]:.2f} ({sum(r.hits[n, d])}/{r.n})" for d in r.depths]
            lines.append(f"| {n} | " + " | ".join(cells) + f" | {r.by_length(n):.2f} |")
        lines.append("| all lengths | " + " | ".join(f"{r.by_depth(d):.2f}" for d in r.depths)
                     + f" | **{r.overall:.2f}** |")
        lines.append("")
    if copy is not None:
        c = copy
        lines += [f"Copy recall: mean NLL (nats/token) of a {c.passage}-token passage's tokens 2 … {c.passage}, read "
                  f"first and again after the gap; {c.n} draw(s), seed {c.seed}.", "",
                  "| gap (tokens) | first copy | second copy | first − second |", "|---|---|---|---|"]
        for g in c.gaps:
            lines.append(f"| {g} | {c.first[g]:.4f} | {c.second[g]:.4f} | {c.gain(g):.4f} |")
        lines.append("")
    return "\n".join(lines)
