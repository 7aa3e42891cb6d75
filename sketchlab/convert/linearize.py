r"""``linearize``: a pretrained model's attention made sketched, in measured stages (LoLCATs' recipe).

Stages (DESIGN §6), each reported with each layer's attention-output error on held-out sequences:

0. **fit** (``attention="llops"`` only): Θ from the kernel fit on the model's own post-RoPE q, k
   (:func:`sketchlab.capture_qk` → ``fit_sketch("llops", q·D^{-1/4}, k·D^{-1/4})``: the kernel is a
   polynomial in ``qᵀk/√D``), the converted model starting from it;
1. **transfer** (LoLCATs stage 1, attention transfer): only the feature maps and gates train, each
   layer's sketched attention matched to the teacher's attention output on the same inputs (MSE).
   The inputs (post-RoPE q, k, v) and outputs of every teacher layer are recorded in one teacher
   pass, so layers train independently of each other, and can be spread over processes
   (:func:`attention_transfer`: ``processes=N``, or the ranks of ``torchrun``);
2. **lora** (optional, ``lora_steps > 0``): LoRA adapters (peft) on the attention projections,
   trained with the next-token loss (causal LMs) or the distance to the teacher's final hidden
   states (encoders), then merged into the weights.

The attention-output error of a layer is ``‖o − o_teacher‖_F / ‖o_teacher‖_F`` over the valid tokens
of the held-out sequences, with both attentions given the teacher's q, k, v.

References
----------
Zhang et al. *LoLCATs: On Low-Rank Linearizing of Large Language Models*, 2024.
"""

from __future__ import annotations

import copy
import ctypes
import datetime
import math
import numbers
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn

from .._validation import DEFAULT_MAX_BYTES, check_memory, check_nonnegative_int, check_positive_int
from ..capture import _check_against_model
from .convert import (_check_exact_layers, _check_memory, _make_maps, _options, _resolve_tied, check_layout,
                      check_map_memory, convert_attention, converted_modules)
from .evaluate import (_batches, _hidden, embedding_agreement, perplexity, progress_bar, sentence_embeddings,  # noqa: F401
                       token_nll)
from .families import FAMILY_TABLE, attention_sites, family_of
from .sketched import check_local_map
from .stages import check_teacher_finite, keep_better, named_divergence, snapshot

__all__ = ["DEFAULT_FIT_WORK", "FAR_OFF_LOGIT", "LayerIO", "LinearizeReport", "attention_errors", "attention_transfer",
           "embedding_agreement", "fit_theta", "linearize", "lora_finetune", "memory_plan", "perplexity",
           "sentence_embeddings", "teacher_attention", "tokenize_texts"]

_TEACHER_NAME = "sketchlab_teacher"
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
        H = self.q.shape[2]
        rep = H // self.k.shape[2]
        q = self.q[index]
        k = self.k[index].repeat_interleave(rep, dim=2)  # [n, T, H, D]
        v = self.v[index].repeat_interleave(rep, dim=2)
        return q, k, v


@dataclass
class LinearizeReport:
    """Outcome of :func:`linearize`.

    ``stages``: one entry per stage run — ``name``, ``seconds``, ``layer_error`` (per layer, held-out,
    after the stage), ``metric`` (held-out perplexity for causal LMs, mean cosine of final hidden
    states to the teacher's for encoders; ``None`` when not evaluated) and stage details
    (``losses``: the training curve). ``teacher_metric``: the teacher's value of the same metric.
    """

    settings: dict
    teacher_metric: float | None
    stages: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------------
# data


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
            if tokenizer is None:
                raise ValueError("texts are strings: pass the model's tokenizer")
            rows = [tokenizer(t)["input_ids"] for t in texts]
        elif all(isinstance(t, (list, tuple)) and all(isinstance(i, int) for i in t) for t in texts):
            rows = [list(t) for t in texts]
        else:
            raise ValueError("texts must all be strings or all be lists of token ids")
    total = sum(len(r) for r in rows)
    if not total:
        raise ValueError("texts hold no tokens (an empty or whitespace-only text, or empty token lists): give text to "
                         "train on")
    if any(i < 0 for r in rows for i in r):
        raise ValueError("texts: token ids must be >= 0, got a negative one")
    return split_sequences(rows, seq_len=seq_len, max_tokens=total if max_tokens is None else max_tokens)


def _sentences(texts, tokenizer, seq_len: int, max_tokens):
    """:func:`tokenize_texts` with ``sentences=True``."""
    if not _all_strings(texts):
        raise ValueError("sentences=True reads text: texts must be a string or a non-empty list of strings")
    if tokenizer is None:
        raise ValueError("texts are strings: pass the model's tokenizer")
    lines = [line.strip() for text in ([texts] if isinstance(texts, str) else texts) for line in text.splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        raise ValueError("texts hold no tokens (an empty or whitespace-only text, or empty token lists): give text to "
                         "train on")
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


# ------------------------------------------------------------------------------------------------
# the teacher's attention inputs and outputs


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
    records = {}

    def hook_for(i):
        def hook(module, args, output):
            records.setdefault(i, []).append(tuple(a.detach() for a in args[:3]) + (output.detach(),))
        return hook

    handles = [block.attention.attn.register_forward_hook(hook_for(i)) for i, block in enumerate(model.blocks)]
    try:
        with torch.no_grad():
            for part in _batches(input_ids.shape[0], batch_size):
                model(input_ids[part])
                bar.update(part.stop - part.start)
    finally:
        for h in handles:
            h.remove()
    D = model.config.head_dim
    return [LayerIO(*(torch.cat([p[j] for p in records[i]]) for j in range(4)), D ** -0.5) for i in sorted(records)]


def attention_errors(sketches, layers: list[LayerIO], attention_mask: torch.Tensor, index, *,
                     batch_size: int = 4, progress: bool = False, desc: str = "attention errors") -> list[float]:
    """Per layer ``‖o − o_teacher‖_F / ‖o_teacher‖_F`` over the valid tokens of sequences ``index``,
    each sketched attention given the teacher's q, k, v (``progress``: a bar over the layers)."""
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


# ------------------------------------------------------------------------------------------------
# stages


#: Default cap of the stage-0 Θ fit's effort: estimated multiply-adds per head
#: (``fit_llops_direct(work=)``, :func:`sketchlab.llops.target.iteration_flops` per iteration). On a
#: SmolLM2 head (d = 64, 1024 fitting tokens, p = 2, m = 64: 6.8e8 per iteration) it allows 5 of the
#: default preset's 38 iterations (its ALS sweeps), which keeps stage 0 to minutes for 270 heads
#: where the uncapped preset took ~53 s per layer (~27 min). Measured on one layer's 9 heads of that size
#: (random q, k; one thread of our loaded 2-core machine): 13.4 CPU s capped against 88 uncapped (×0.15,
#: so ~8 s a layer, ~4 min for SmolLM2's 30, at the issue's 53 s), the in-sample error 0.755 against
#: 0.737. ``fit_work=math.inf``: the preset's full schedule.
DEFAULT_FIT_WORK = 3.5e9


def _fit_plan(p, m, rank, D, n, fit_work, fit_options) -> dict:
    """The fit's iterations per head and multiply-adds: ``{"per_iteration", "iterations", "planned",
    "work"}`` (what the cap allows of the preset's schedule; the kernel route's estimate)."""
    from ..llops.fit_als import QUALITY
    from ..llops.target import iteration_flops

    options = dict(fit_options or {})
    preset = QUALITY.get(options.get("quality", "default"), QUALITY["default"])
    steps = options.get("steps", preset.steps)
    lm_steps = options.get("lm_steps", preset.lm_steps)
    interleave = options.get("interleave", preset.interleave)
    planned = steps + lm_steps + (interleave * -(-lm_steps // interleave) if interleave else 0)
    per = iteration_flops("kernel", n, n, D, p, m, rank)
    work = options.get("work", fit_work)
    iterations = planned if work >= planned * per else max(1, int(work // per))
    return {"per_iteration": per, "iterations": iterations, "planned": planned, "work": iterations * per}


def _check_fit_work(fit_work, fit_options) -> float:
    """``fit_work``: a number > 0 (``math.inf``: no cap) or ``None`` (:data:`DEFAULT_FIT_WORK`); not
    given together with ``fit_options["work"]`` (one cap, one place)."""
    if fit_options is not None and not isinstance(fit_options, dict):
        raise ValueError(f"fit_options must be a dict or None, got {type(fit_options).__name__}")
    if fit_work is None:
        return (fit_options or {}).get("work", DEFAULT_FIT_WORK)
    if isinstance(fit_work, bool) or not isinstance(fit_work, numbers.Real) or not fit_work > 0:
        raise ValueError(f"fit_work must be a number > 0 (multiply-adds per head; math.inf: no cap), got {fit_work!r}")
    if "work" in (fit_options or {}):
        raise ValueError(f"fit_work={fit_work!r} and fit_options['work']={fit_options['work']!r}: give the fit's cap "
                         "once")
    return float(fit_work)


def _fit_layers(layer_qk, count: int, skip, *, p, m, rank, seed, fit_work, fit_options, progress):
    """Θ per layer from ``layer_qk(i) -> (q, k) [H, n, D]`` (float64, ``"sqrt-d"``-scaled), layers in
    ``skip`` left zero; returns ``((theta_q, theta_k), rel_fro, seconds)``."""
    from ..fit import fit_sketch
    from ..sketches import as_llops

    options = {**dict(fit_options or {}), "work": fit_work}
    thetas_q, thetas_k, rel_fro, seconds = [None] * count, [None] * count, [None] * count, 0.0
    with progress_bar(count - len(skip), "stage 0: Θ fit", progress, unit="layer", leave=True) as bar:
        for layer in range(count):
            if layer in skip:
                continue
            q, k = layer_qk(layer)
            fit = fit_sketch("llops", q, k, p=p, m=m, rank=rank, seed=seed, reference=False, **options)
            llops = as_llops(fit.sketch)
            thetas_q[layer] = llops.theta_q.detach()  # [H, t, p, D, m]
            thetas_k[layer] = thetas_q[layer] if llops.theta_k is None else llops.theta_k.detach()
            report = fit.report.as_dict()
            rel = report.get("rel_fro")
            rel_fro[layer] = rel.tolist() if isinstance(rel, torch.Tensor) else rel
            seconds += float(report.get("seconds") or 0.0)
            bar.update()
    shape = next(t for t in thetas_q if t is not None)
    zeros = lambda: torch.zeros_like(shape)  # noqa: E731 (an exact layer: never read)
    theta_q = torch.stack([zeros() if t is None else t for t in thetas_q])  # [L, H, t, p, D, m]
    theta_k = torch.stack([zeros() if t is None else t for t in thetas_k])
    return (theta_q, theta_k), rel_fro, seconds


def _subset(n: int, fit_tokens, seed: int):
    """The fitting tokens' positions among ``n`` (sorted; ``None``: all of them)."""
    if fit_tokens and n > fit_tokens:  # a random subset, the same for q and k: the fit and its report
        # (in-sample errors and the tail bound, O(n²) per head) both see only these
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:fit_tokens].sort().values
    return None


def fit_theta(model, ids, mask, *, p, m, rank=1, fit_tokens=1024, seed=0, fit_options=None, fit_work=None,
              progress=False):
    """Stage 0: Θ ``[L, H, t, p, D, m]`` fitted to the teacher's post-RoPE kernel (``"sqrt-d"`` inputs)
    on the valid tokens of ``ids [N, T]``; returns ``((theta_q, theta_k), info)``.

    ``fit_tokens`` random tokens (the same positions for q and k) per head; one layer's heads are
    fitted together, layer by layer, so the fit report's dense ``H × n × n`` kernel (its
    Theorem 3.1 bound) never holds every layer at once (SmolLM2: 270 heads at 1024 tokens would
    ask 4.5 GB; one layer, 0.15 GB). ``fit_work``: the cap on each head's multiply-adds
    (:data:`DEFAULT_FIT_WORK`; ``fit_options["work"]`` alike); ``progress``: a bar over the layers.
    (:func:`linearize` fits from its teacher recording instead, with the same result, without this
    second teacher pass.)"""
    from ..capture import capture_qk

    fit_tokens = None if fit_tokens is None else check_nonnegative_int(fit_tokens, "fit_tokens")
    fit_work = _check_fit_work(fit_work, fit_options)
    dump = capture_qk(model, {"input_ids": ids, "attention_mask": mask}) if family_of(model) != "toy" \
        else capture_qk(model, ids)
    L, _, n, D = dump.q.shape
    keep = _subset(n, fit_tokens, seed)
    c = D ** -0.25

    def layer_qk(layer):
        q, k = dump.q[layer], dump.k[layer]  # [H, n, D] float32
        if keep is not None:
            q, k = q[:, keep], k[:, keep]
        return q.double() * c, k.double() * c

    theta, rel_fro, seconds = _fit_layers(layer_qk, L, set(), p=p, m=m, rank=rank, seed=seed, fit_work=fit_work,
                                          fit_options=fit_options, progress=progress)
    return theta, {"tokens": n, "fit_tokens": n if keep is None else len(keep), "rel_fro": rel_fro,
                   "seconds": seconds, "work": fit_work}


def _fit_recorded(layers: list[LayerIO], mask, index, skip, *, p, m, rank, fit_tokens, seed, fit_work, fit_options,
                  progress):
    """:func:`fit_theta` from the teacher recording (post-RoPE q, k of the sequences ``index``, GQA keys
    repeated, float32 then float64 as ``capture_qk`` gives them): the same Θ without a second teacher pass
    or a float64 copy of every token (only the fitting tokens are copied)."""
    valid = mask[index].to(torch.bool)  # [n_seq, T]
    n = int(valid.sum())
    keep = _subset(n, fit_tokens, seed)

    def layer_qk(layer):
        io = layers[layer]
        H, D = io.q.shape[2], io.q.shape[3]
        q, k = io.q[index][valid], io.k[index][valid]  # [n, H(_kv), D] in token order
        if keep is not None:
            q, k = q[keep], k[keep]
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        c = D ** -0.25
        return q.float().transpose(0, 1).double() * c, k.float().transpose(0, 1).double() * c

    theta, rel_fro, seconds = _fit_layers(layer_qk, len(layers), skip, p=p, m=m, rank=rank, seed=seed,
                                          fit_work=fit_work, fit_options=fit_options, progress=progress)
    return theta, {"tokens": n, "fit_tokens": n if keep is None else len(keep), "rel_fro": rel_fro,
                   "seconds": seconds, "work": fit_work}


def _check_processes(processes, layers: int | None = None) -> int:
    """``processes`` as an int in ``[1, layers]`` (``layers=None``: no upper bound), else a
    ``ValueError`` naming it (and ``layers``: refused, not clamped, since a process with no layer would
    only pay its start-up, and a silent clamp would report settings that did not run); ``> 1`` is refused
    inside an initialised ``torch.distributed`` group (which spreads the layers by itself) and where
    ``torch.distributed`` is not built in."""
    if isinstance(processes, bool) or not isinstance(processes, numbers.Integral) or processes < 1:
        raise ValueError(f"processes must be an integer >= 1 (the processes stage 1 spreads its layers over), "
                         f"got {processes!r}")
    if processes > 1:
        import torch.distributed as dist

        if not dist.is_available():
            raise ValueError(f"processes={processes}: this torch is built without torch.distributed, which the "
                             "spread needs: use processes=1")
        if dist.is_initialized():
            raise ValueError(f"processes={processes}: this process already belongs to a torch.distributed group "
                             "(torchrun?), over which attention transfer spreads the layers by itself: leave "
                             "processes=1")
        if layers is not None and processes > layers:
            raise ValueError(f"processes={processes} exceeds the {layers} layers to train (one layer per process "
                             f"at most: the others would train nothing): use processes <= {layers}")
    return int(processes)


def _check_group(group):
    """The group stage 1 spreads over: ``group`` itself (a ``ProcessGroup`` with a CPU backend, this
    process a member), or for ``None`` the default group when ``torch.distributed`` is initialised, else
    ``None`` (this process alone). A ``ValueError`` names any other value."""
    import torch.distributed as dist

    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group, what = dist.group.WORLD, "the default torch.distributed group"
    else:
        if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            raise ValueError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
        what = "group="
    if dist.get_rank(group) < 0:
        raise ValueError("attention_transfer: this process is not a member of group=")
    backend = str(dist.get_backend(group))
    if backend not in ("gloo", "mpi") and "cpu:" not in backend:
        raise ValueError(f"attention_transfer: {what} has backend {backend!r}, which cannot broadcast the CPU "
                         "tensors stage 1 trains; pass group=torch.distributed.new_group(backend=\"gloo\")")
    return group


def _layer_generator(seed: int, layer: int) -> torch.Generator:
    """Layer ``layer``'s batches: a generator seeded from ``(seed, layer)`` (numpy's ``SeedSequence``, so
    nearby seeds and layers give unrelated streams), the same whichever process trains the layer."""
    words = np.random.SeedSequence([seed % 2**64, layer]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(words[0]) | int(words[1]) << 32)


def _trained(sketch) -> list[torch.Tensor]:
    """The tensors stage 1 changes in one converted layer: its parameters that require grad."""
    return [p for p in sketch.parameters() if p.requires_grad]


def _transfer_layer(sketch, io: LayerIO, mask, train_idx, gen, *, steps, lr, map_lr, batch_size,
                    bar=None) -> list[float]:
    """Adam on one layer's maps and gate (:func:`attention_transfer`); returns its loss curve (``bar``:
    advanced by one per step)."""
    params = _trained(sketch)
    # the gate and the memory's few per-head scalars (decay, β: FarParams) at lr, the maps at map_lr
    small = {id(sketch.gate)} | ({id(x) for x in sketch.far.parameters()} if getattr(sketch, "far", None) is not None
                                 else set())
    gate = [p for p in params if id(p) in small]
    maps = [p for p in params if id(p) not in small]
    groups = ([{"params": gate, "lr": lr}] if gate else []) + \
        ([{"params": maps, "lr": lr if map_lr is None else map_lr}] if maps else [])
    opt = torch.optim.Adam(groups, lr=lr)
    curve = []
    for _ in range(steps):
        sel = train_idx[torch.randint(len(train_idx), (min(batch_size, len(train_idx)),), generator=gen)]
        q, k, v = io.inputs(sel)
        valid = mask[sel].to(torch.bool)
        last = [p.detach().clone() for p in params]
        try:
            o = sketch(q, k, v, scaling=io.scaling, key_padding_mask=None if bool(valid.all()) else valid)
        except ValueError as err:  # the features of the trained maps stopped being finite: diverged
            if "must be finite" not in str(err):
                raise
            o = None
        loss = None if o is None else ((o - io.out[sel]) ** 2)[valid].mean()
        if loss is None or not bool(torch.isfinite(loss)):  # diverged: stop this layer (linearize keeps its start)
            return curve + [float("nan")] * (steps - len(curve))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if not all(bool(torch.isfinite(p).all()) for p in params):
            with torch.no_grad():
                for p, before in zip(params, last):
                    p.copy_(before)
            return curve + [float("nan")] * (steps - len(curve))
        curve.append(float(loss.detach()))
        if bar is not None:
            bar.update()
    return curve


#: What :func:`_same_call` compares, in order: exactly, then to a relative 1e-6.
_SAME_EXACT = ("layers", "steps", "batch_size", "seed (high 32 bits)", "seed (low 32 bits)", "lr", "map_lr",
               "train_idx", "sum of train_idx", "valid tokens", "trained values")
_SAME_INEXACT = ("sum of the trained values", "sum of the teacher outputs")
_MESSAGE_BYTES = 600  # of a refusing rank's message, carried in the same gather


def _same_call(sketches, layers, mask, train_idx, group, problem=None, **options) -> None:
    """Refuse (on every rank alike, so none waits forever in a collective) a spread call that a rank
    refused by itself (``problem``: its error message, then re-raised there and named on the others), or
    whose ranks disagree on what they train: layer count, options, sequences, the maps' sizes and starting
    values, the teacher's outputs (float64 sums, compared to a relative 1e-6: the same recording on every
    rank agrees to round-off, another text or model differs at O(1)). One ``all_gather``."""
    import torch.distributed as dist

    if problem is None:
        seed = options["seed"] % 2**64  # what _layer_generator uses; two float64-exact halves
        exact = [len(sketches), options["steps"], options["batch_size"], seed >> 32, seed & 0xFFFFFFFF, options["lr"],
                 -1.0 if options["map_lr"] is None else options["map_lr"], len(train_idx),
                 float(train_idx.double().sum()), float(mask.double().sum()),
                 sum(p.numel() for s in sketches for p in _trained(s))]
        with torch.no_grad():
            inexact = [sum(float(p.double().sum()) for s in sketches for p in _trained(s)),
                       sum(float(io.out.sum(dtype=torch.float64)) for io in layers)]
        text = b""
    else:
        exact, inexact = [math.nan] * len(_SAME_EXACT), [math.nan] * len(_SAME_INEXACT)
        text = problem.encode()[:_MESSAGE_BYTES]
    message = torch.zeros(_MESSAGE_BYTES, dtype=torch.float64)
    message[:len(text)] = torch.tensor(list(text), dtype=torch.float64)
    mine = torch.cat([torch.tensor([float(problem is not None), len(text), *map(float, exact), *map(float, inexact)],
                                   dtype=torch.float64), message])
    world = dist.get_world_size(group)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    every = torch.stack(every)  # [ranks, 2 + items + message bytes]
    refused = [r for r in range(world) if every[r, 0] > 0]
    if problem is not None:
        raise ValueError(problem)
    if refused:
        r = refused[0]
        n = int(every[r, 1])
        said = bytes(int(b) for b in every[r, -_MESSAGE_BYTES:][:n]).decode(errors="replace")
        raise ValueError(f"attention_transfer over {world} processes: rank {r} refused its arguments ({said}); "
                         "every rank must call it with the same, valid arguments")
    values = every[:, 2:-_MESSAGE_BYTES]
    for j, name in enumerate([*_SAME_EXACT, *_SAME_INEXACT]):
        col = values[:, j]
        spread = float(col.max() - col.min())
        if (spread > 0) if j < len(_SAME_EXACT) else spread > 1e-6 * max(1.0, float(col.abs().max())):
            raise ValueError(f"attention_transfer over {len(col)} processes: the ranks disagree on {name} "
                             f"({', '.join(f'{float(x):.10g}' for x in col)} on ranks 0..{len(col) - 1}); "
                             "every rank must call it with the same sketches, recorded layers, mask, train_idx "
                             "and options")


def _share(sketches, losses, steps: int, group) -> list[list[float]]:
    """Every layer's trained parameters and loss curve broadcast from its owner (rank ``layer %
    world``) to the other ranks, in place; returns the curves, the same on every rank."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    curves = []
    with torch.no_grad():
        for layer, sketch in enumerate(sketches):
            src = dist.get_global_rank(group, layer % world)
            for p in _trained(sketch):
                buf = p.detach() if p.is_contiguous() else p.detach().contiguous()
                dist.broadcast(buf, src=src, group=group)
                if buf.data_ptr() != p.data_ptr():
                    p.copy_(buf)
            curve = torch.tensor(losses[layer] if layer % world == rank else [0.0] * steps, dtype=torch.float64)
            if steps:
                dist.broadcast(curve, src=src, group=group)
            curves.append(curve.tolist())
    return curves


def _train_own(sketches, layers, mask, train_idx, rank: int, world: int, *, steps, lr, map_lr, batch_size, seed,
               progress) -> list:
    """Stage 1 on the layers of rank ``rank`` of ``world`` (``rank, rank + world, …``); the other layers'
    curves ``None``."""
    losses = [None] * len(sketches)
    mine = range(rank, len(sketches), world)
    where = f" (process {rank} of {world})" if world > 1 else ""
    # one bar, this process's (rank 0's: its share runs beside the others', so its ETA is the stage's)
    with progress_bar(len(mine) * steps, f"stage 1: transfer{where}", progress and rank == 0, unit="step",
                      leave=True) as bar:
        for layer in mine:
            bar.set_postfix_str(f"layer {layer}")
            losses[layer] = curve = _transfer_layer(sketches[layer], layers[layer], mask, train_idx,
                                                    _layer_generator(seed, layer), steps=steps, lr=lr, map_lr=map_lr,
                                                    batch_size=batch_size, bar=bar)
            if progress:
                bar.write(f"transfer layer {layer}{where}: mse {curve[0]:.4g} -> {curve[-1]:.4g}" if curve
                          else f"transfer layer {layer}{where}: 0 steps", file=sys.stderr)
    return losses


def _transfer(sketches, layers, mask, train_idx, *, group, **options):
    """Stage 1 on this process's share of the layers (all of them without a group), then shared."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    losses = _train_own(sketches, layers, mask, train_idx, rank, world, **options)
    return _share(sketches, losses, options["steps"], group) if world > 1 else losses


#: How long a process of a ``processes=N`` spread waits for the others once it has trained its layers: a
#: worker waits in the group's rendezvous (and its store) for this process and the other workers to finish
#: theirs (balanced shares, so about one layer's training plus the difference in start-up); the broadcasts
#: that follow wait on nothing, every process having trained its share by then.
SPREAD_TIMEOUT = datetime.timedelta(hours=24)


def _end_with(parent: int) -> None:
    """Linux: this process gets SIGTERM when ``parent`` (its parent) ends, so a spawned worker never
    outlives a killed caller (``prctl(PR_SET_PDEATHSIG)``); elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before the call
        os._exit(1)


def _transfer_worker(index, port, world, threads, sketches, layers, mask, train_idx, options, parent):
    """Rank ``index + 1`` of a ``processes=N`` spread (:func:`attention_transfer`; run by
    ``torch.multiprocessing`` in a spawned process, ``layers`` in shared memory): trains its layers at
    once, alongside this process's parent, then says it is ready and joins the group for the broadcasts."""
    import torch.distributed as dist

    _end_with(parent)
    rank = index + 1
    torch.set_num_threads(threads)
    mine = copy.deepcopy(sketches)  # the layers are read in place; the sketches, which train, are our own
    losses = _train_own(mine, layers, mask, train_idx, rank, world, **options)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=SPREAD_TIMEOUT)
    store.set(f"ready/{rank}", "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=SPREAD_TIMEOUT)
    try:
        _share(mine, losses, options["steps"], dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _shared(layers, mask, train_idx) -> None:
    """The recording moved into shared memory (``/dev/shm`` on Linux) in place, once, before the workers
    are spawned; a ``RuntimeError`` naming ``/dev/shm``, the size needed and ``processes=1`` when it does
    not fit (a container's small ``/dev/shm``: Docker's default is 64 MiB)."""
    tensors = [mask, train_idx, *(t for io in layers for t in (io.q, io.k, io.v, io.out))]
    storages = {t.untyped_storage().data_ptr(): t for t in tensors if not t.is_shared()}
    need = sum(t.untyped_storage().nbytes() for t in storages.values())
    free = _shm_free()
    if free is not None and need > free:
        raise RuntimeError(_shm_message(need, f"{free / 2**20:.1f} MiB free"))
    try:
        for t in storages.values():
            t.share_memory_()
    except RuntimeError as err:
        raise RuntimeError(_shm_message(need, str(err).splitlines()[0] if str(err) else type(err).__name__)) from err


def _shm_free() -> int | None:
    """Bytes free in ``/dev/shm``, ``None`` where there is none to ask (not Linux)."""
    try:
        st = os.statvfs("/dev/shm")
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def _shm_message(need: int, why: str) -> str:
    return (f"attention_transfer, processes>1: the recorded layers ({need / 2**20:.1f} MiB) do not fit in shared "
            f"memory /dev/shm ({why}); give /dev/shm at least that much (Docker: --shm-size) or use processes=1")


def _stop(ctx, wait: float = 5.0) -> None:
    """The spawned workers ended: terminated if still running, joined (no zombies), killed if they do not
    end within ``wait`` seconds."""
    for proc in ctx.processes:
        if proc.is_alive():
            proc.terminate()
    for proc in ctx.processes:
        proc.join(wait)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _spawned(sketches, layers, mask, train_idx, processes: int, options: dict) -> list[list[float]]:
    """Stage 1 spread over this process (rank 0) and ``processes − 1`` spawned workers (gloo on
    localhost), all training at once; the trained parameters reach this process's ``sketches`` through
    the broadcasts once every process has trained its share."""
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    _shared(layers, mask, train_idx)
    store = dist.TCPStore("127.0.0.1", 0, processes, is_master=True, wait_for_workers=False, timeout=SPREAD_TIMEOUT)
    ctx = mp.start_processes(_transfer_worker, nprocs=processes - 1, join=False, start_method="spawn",
                             args=(store.port, processes, torch.get_num_threads(), copy.deepcopy(sketches),
                                   layers, mask, train_idx, options, os.getpid()))  # copies: ours stay put
    try:  # this process's layers train while the workers start and train theirs (the same call everywhere:
        # no _same_call); the group forms once every process has trained its share
        losses = _train_own(sketches, layers, mask, train_idx, 0, processes, **options)
        for rank in range(1, processes):  # every worker done training before the group
            while not store.check([f"ready/{rank}"]):
                ctx.join(timeout=0.05)  # raises ProcessException when a worker failed
                if ctx.processes[rank - 1].exitcode is not None and not store.check([f"ready/{rank}"]):
                    raise RuntimeError(f"attention_transfer, processes={processes}: spawned worker {rank} ended "
                                       f"(exit code {ctx.processes[rank - 1].exitcode}) before training its layers")
        dist.init_process_group("gloo", store=store, rank=0, world_size=processes, timeout=SPREAD_TIMEOUT)
        try:
            try:
                losses = _share(sketches, losses, options["steps"], dist.group.WORLD)
            except RuntimeError as err:  # gloo's error when a peer is gone: the worker's own error too, if any
                try:
                    ctx.join(timeout=10)
                except ProcessException as worker_err:
                    raise RuntimeError(f"attention_transfer, processes={processes}: {err}; a spawned worker "
                                       f"failed: {worker_err}") from err
                raise
            while not ctx.join():  # the workers leave the group first, then this process
                pass
        finally:
            dist.destroy_process_group()
    except ProcessException as err:  # a worker failed: its exception and traceback
        raise RuntimeError(f"attention_transfer, processes={processes}: a spawned worker failed: {err}") from None
    finally:
        _stop(ctx)
    return losses


def attention_transfer(sketches, layers: list[LayerIO], mask, train_idx, *, steps: int, lr: float = 1e-2,
                       map_lr: float | None = None, batch_size: int = 4, seed: int = 0, progress: bool = False,
                       processes: int = 1, group=None) -> list[list[float]]:
    r"""Stage 1: Adam on each layer's maps and gate, each layer given the teacher's q, k, v, independent of
    the others; the layers can be spread over processes.

    Parameters
    ----------
    sketches : list of SketchedAttention
        The converted layers (:func:`sketchlab.convert_attention`); trained in place.
    layers : list of LayerIO
        The teacher's recorded inputs and outputs of the same layers (:func:`teacher_attention`),
        ``q [N, T, H, D]``, ``k, v [N, T, H_kv, D]``, ``out [N, T, H, Dv]``.
    mask : Tensor [N, T]
        Valid tokens (1) of the recorded sequences.
    train_idx : Tensor [n] of int
        The sequences trained on.
    steps : int >= 0
        Adam steps per layer, each on ``batch_size`` sequences drawn with replacement from
        ``train_idx``; loss ``mean((o − o_teacher)²)`` over their valid tokens.
    lr : float >= 0
        The gate's learning rate.
    map_lr : float or None
        The feature maps' learning rate (``None``: ``lr``; ``0``: the maps stay fixed).
    batch_size : int >= 1
        Sequences per Adam step (``min(batch_size, len(train_idx))``).
    seed : int
        Layer ``i`` (its position in ``sketches``) draws its batches from its own generator seeded
        from ``(seed, i)`` (numpy's ``SeedSequence``), so a layer trains the same on whichever process
        trains it. (Before the spread, one generator served the layers in turn; the batches, and so
        the trained maps, differ from those of that version.)
    progress : bool
        A progress bar over the steps on stderr (this process's layers; rank 0 only) and each layer's first and last
        loss as it finishes (with the process that trained it).
    processes : int >= 1
        ``N > 1`` (at most one per layer): this process and ``N − 1`` workers it spawns
        (``torch.multiprocessing``) share the layers, layer ``i`` on process ``i % N``, all training at
        once: each worker, as soon as it has started, trains copies of its layers' sketches with this
        process's ``torch.get_num_threads()`` threads while this process trains its own; once every
        process is done, the trained values are broadcast to this process (gloo on localhost). The
        recorded ``layers``, ``mask`` and ``train_idx`` reach the workers through shared memory (moved
        there once, in place, not copied per worker). A worker's start-up (imports of torch, sketchlab,
        ``torch.optim``: 4.6 CPU seconds measured, ``analysis/results/transfer_spread.md``) delays its
        share: with a core per process the stage takes about ``T/N + c`` for ``T`` on one process and
        ``c`` the start-up, so it pays once ``T > c·N/(N − 1)``. Spawned workers import the caller's
        main module: a script calling this needs the usual ``if __name__ == "__main__":`` guard; the
        recording must fit in ``/dev/shm`` (a container's default can be 64 MiB: refused up front,
        naming the size; enlarge it, e.g. Docker's ``--shm-size``, or use ``processes=1``); on Linux the
        workers end with this process if it is killed. Refused inside an initialised
        ``torch.distributed`` group (use the group, below) and without ``torch.distributed``.
    group : torch.distributed ProcessGroup or None
        The processes to spread over, with a CPU backend (gloo; an NCCL group is refused: pass
        ``torch.distributed.new_group(backend="gloo")``). ``None``: the default group when
        ``torch.distributed`` is initialised (e.g. under ``torchrun --nproc-per-node N``), else this
        process alone. Over a group of ``W`` ranks every rank must call this with the same
        arguments (a collective call: checked up front in one ``all_gather``, every rank refusing
        alike a mismatch or an argument one rank refused by itself); rank ``r`` trains layers ``r,
        r + W, …``, then every layer's trained parameters and loss curve are broadcast from its rank
        to the others, so every rank ends with the same sketches and the same return value. A rank
        waits in the broadcasts for the slowest one: the group's timeout
        (``init_process_group(timeout=)``) must exceed that wait.

    Returns
    -------
    list of list of float
        Each layer's loss curve (``steps`` values), the same on every process.

    Notes
    -----
    Spread or not, each layer runs the same operations on the same data, and the broadcasts copy
    values exactly: with the same number of threads per process the result is bitwise that of one
    process (``tests/test_linearize_spread.py``). Only this stage is spread; :func:`linearize`'s
    teacher pass, fit, gate calibration, evaluation and LoRA run in the calling process.
    """
    group = _check_group(group)
    world = 1 if group is None else torch.distributed.get_world_size(group)
    try:  # with a group of several ranks, a refusal here reaches every rank (_same_call), none left waiting
        train_idx, options, processes = _checked(sketches, layers, mask, train_idx, steps=steps, lr=lr, map_lr=map_lr,
                                                 batch_size=batch_size, seed=seed, progress=progress,
                                                 processes=processes)
        if processes > 1 and group is not None:
            raise ValueError(f"processes={processes} spawns its own workers; with group= the layers spread over "
                             "that group: give one or the other")
    except ValueError as err:
        if world > 1:
            _same_call(sketches, layers, mask, train_idx, group, problem=str(err))
        raise
    if processes > 1:
        return _spawned(sketches, layers, mask, train_idx, processes, options)
    if world > 1:
        _same_call(sketches, layers, mask, train_idx, group, **options)
    return _transfer(sketches, layers, mask, train_idx, group=group, **options)


def _checked(sketches, layers, mask, train_idx, *, steps, lr, map_lr, batch_size, seed, progress, processes):
    """:func:`attention_transfer`'s arguments checked on this process: ``(train_idx as a tensor, the
    options, processes)``, else a ``ValueError`` naming the first bad one."""
    if map_lr is not None and not (isinstance(map_lr, (int, float)) and not isinstance(map_lr, bool)
                                   and 0 <= map_lr < float("inf")):
        raise ValueError(f"map_lr must be None or a finite number >= 0, got {map_lr!r}")
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 <= lr < float("inf")):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    steps = check_nonnegative_int(steps, "steps")
    batch_size = check_positive_int(batch_size, "batch_size")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    bad = next((type(io).__name__ for io in layers if not isinstance(io, LayerIO)), None)
    if bad is not None:
        raise ValueError(f"layers must be LayerIO records (teacher_attention), got an item of type {bad}")
    bad = next((type(s).__name__ for s in sketches if not isinstance(s, nn.Module)), None)
    if bad is not None:
        raise ValueError(f"sketches must be converted attention modules (convert_attention), got an item of type {bad}")
    if len(sketches) != len(layers):
        raise ValueError(f"attention transfer: {len(sketches)} sketches for {len(layers)} recorded layers; "
                         "give one recorded layer (LayerIO) per converted layer")
    processes = _check_processes(processes, len(sketches))
    if any(not _trained(s) for s in sketches):
        raise ValueError("attention transfer: the converted layers have no trainable parameters (learn=False?)")
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and all(
            tuple(io.out.shape[:2]) == tuple(mask.shape) for io in layers)):
        raise ValueError(f"mask must be a tensor [N, T] matching the recorded layers' sequences "
                         f"{[tuple(io.out.shape[:2]) for io in layers[:1]]}, got {getattr(mask, 'shape', mask)!r}")
    try:
        idx = torch.as_tensor(train_idx)
    except (TypeError, ValueError, RuntimeError):
        idx = None
    if idx is None or idx.dim() != 1 or idx.numel() == 0 or idx.is_floating_point() or idx.dtype == torch.bool \
            or idx.is_complex() or int(idx.min()) < 0 or int(idx.max()) >= mask.shape[0]:
        shown = idx.tolist() if idx is not None else train_idx
        raise ValueError(f"train_idx must be a non-empty list of integer sequence indices in [0, {mask.shape[0]}) "
                         f"(not a boolean mask), got {shown!r}")
    options = dict(steps=steps, lr=float(lr), map_lr=None if map_lr is None else float(map_lr),
                   batch_size=batch_size, seed=int(seed), progress=progress)
    return idx, options, processes


def lora_finetune(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, train_idx, *, steps: int, rank: int = 8,
                  lr: float = 1e-4, batch_size: int = 1, seed: int = 0, teacher_hidden: torch.Tensor | None = None,
                  progress: bool = False):
    r"""Stage 2: LoRA (peft) on the attention projections of ``model``, merged into the weights afterwards.

    AdamW (no weight decay) on adapters of rank ``rank`` (``lora_alpha = 2·rank``) over the query,
    key, value and output projections, ``steps`` steps on random batches of ``batch_size`` of the
    sequences ``train_idx`` of ``ids, mask [N, T]``; loss: the next-token cross-entropy (causal LMs),
    or with ``teacher_hidden [N, T, hidden]`` the mean squared distance of the final hidden states to
    the teacher's over the valid tokens (encoders). Works on converted models (the feature maps keep
    their ``requires_grad``) and on unconverted ones alike (the same adaptation of the teacher
    itself or of a window-only model: the control for what LoRA on the training text alone buys).

    Returns
    -------
    (model, losses)
        The merged model (no peft wrappers left) and the loss of every step.
    """
    steps = check_positive_int(steps, "steps")
    rank = check_positive_int(rank, "rank")
    batch_size = check_positive_int(batch_size, "batch_size")
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr < float("inf")):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    family = family_of(model)
    if not (isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor) and ids.dim() == 2
            and ids.shape == mask.shape):
        raise ValueError(f"ids and mask must be tensors of one shape [N, T], got "
                         f"{getattr(ids, 'shape', type(ids).__name__)} and {getattr(mask, 'shape', type(mask).__name__)}")
    train_idx = torch.as_tensor(train_idx)
    if train_idx.dim() != 1 or train_idx.numel() == 0 or train_idx.is_floating_point() \
            or int(train_idx.min()) < 0 or int(train_idx.max()) >= ids.shape[0]:
        raise ValueError(f"train_idx must be a non-empty list of sequence indices in [0, {ids.shape[0]}), "
                         f"got {train_idx.tolist()}")
    if (family != "toy" and FAMILY_TABLE[family].encoder) != (teacher_hidden is not None):
        raise ValueError("teacher_hidden [N, T, hidden] is the loss of an encoder (BERT family) and only of one: "
                         f"got {'none' if teacher_hidden is None else 'one'} for a {family} model")
    if teacher_hidden is not None and tuple(teacher_hidden.shape[:2]) != tuple(ids.shape):
        raise ValueError(f"teacher_hidden must be [N, T, hidden] with [N, T] = {list(ids.shape)}, got "
                         f"{list(teacher_hidden.shape)}")
    return _lora(model, family, ids, mask, train_idx, teacher_hidden, steps=steps,
                 rank=rank, lr=float(lr), batch_size=batch_size, seed=seed, progress=progress)


def _lora(model, family, ids, mask, train_idx, teacher_hidden, *, steps, rank, lr, batch_size, seed, progress):
    """Stage 2 (:func:`lora_finetune`, unchecked)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("the LoRA stage needs peft: pip install 'sketchlab[lm]'") from err
    if family == "toy":
        raise ValueError("the LoRA stage supports transformers models (peft); the toy model fine-tunes with "
                         "sketchlab.tasks.train_mqar")
    entry = FAMILY_TABLE[family]  # the family's LoRA targets, from the one table
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=entry.lora,
                        fan_in_fan_out=entry.lora_fan_in_fan_out)
    sketch_grad = {id(p): p.requires_grad for s in converted_modules(model, required=False) for p in s.parameters()}
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    curve = []
    peft_model.train()
    bar = progress_bar(steps, "stage 2: LoRA", progress, unit="step", leave=True)
    for step in range(steps):
        sel = train_idx[torch.randint(len(train_idx), (min(batch_size, len(train_idx)),), generator=gen)]
        b_ids, b_mask = ids[sel], mask[sel]
        if teacher_hidden is None:
            labels = b_ids.masked_fill(b_mask == 0, -100)
            loss = peft_model(input_ids=b_ids, attention_mask=b_mask, labels=labels, use_cache=False).loss
        else:
            h = peft_model(input_ids=b_ids, attention_mask=b_mask).last_hidden_state
            valid = b_mask.to(torch.bool)
            loss = ((h - teacher_hidden[sel]) ** 2)[valid].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        curve.append(float(loss.detach()))
        bar.set_postfix(loss=f"{curve[-1]:.4f}")
        bar.update()
    bar.close()
    peft_model.eval()
    merged = peft_model.merge_and_unload()
    for s in converted_modules(merged, required=False):
        for p in s.parameters():
            p.requires_grad_(sketch_grad.get(id(p), True))
    return merged, curve


def linearize(model: nn.Module, texts, *, tokenizer=None, attention: str = "llops", p: int = 2, m: int = 64,
              rank: int = 1, window: int = 64, sinks: int | None = None, local: str = "softmax", feature_map=None,
              normalize: str | None = None, gate_init: float | str | None = None, tied: bool | None = None,
              gate_sequences: int = 4, seq_len: int = 512, max_tokens: int | None = None, holdout: float = 0.25,
              fit: bool = True, fit_tokens: int = 1024, fit_options: dict | None = None, transfer_steps: int = 100,
              transfer_lr: float = 1e-2, lora_steps: int = 0, lora_rank: int = 8, lora_lr: float = 1e-4,
              batch_size: int = 4, evaluate: bool = True, seed: int = 0, progress: bool = False,
              processes: int = 1, max_bytes: int = DEFAULT_MAX_BYTES, cache: int = 0, decay=None,
              state: str = "additive", beta: str = "head", exact_layers=(), fit_work: float | None = None,
              far: bool = True):
    r"""Convert ``model``'s attention (:func:`sketchlab.convert_attention`) and train it in stages.

    Parameters
    ----------
    model : nn.Module
        The softmax teacher (a supported transformers model or sketchlab's toy model); converted
        in place (the LoRA stage merges its adapters into the weights).
    texts
        Training and held-out text: strings (with ``tokenizer``), token-id lists or a LongTensor
        ``[N, T]`` (:func:`tokenize_texts`), cut into ``seq_len``-token sequences, ``max_tokens`` in all.
        An encoder (BERT family) given strings reads one sentence — one non-blank line — per sequence,
        with its own special tokens and padding, truncated to ``seq_len`` (``tokenize_texts(...,
        sentences=True)``): its held-out measures are then per sentence.
    seq_len : int
        Tokens per sequence. Transfer at the longest context the model will run at: a hybrid's far
        part sees up to ``seq_len − window`` keys in training, and maps transferred on shorter
        sequences put too much mass on the far keys beyond that (SmolLM2, Hedgehog hybrid w = 64:
        transferred on 512-token sequences, perplexity 55.5 at 1024 and 94.5 at 2048; on 2048-token
        sequences, 48.4 and 47.8; ``analysis/results/linearize_lm_len512.md`` and ``linearize_lm.md``).
    holdout : float in (0, 1)
        Fraction of the sequences (the last ones) held out of training: every error and metric is
        measured on them.
    attention, p, m, rank, window, sinks, local, feature_map, normalize, tied
        The conversion (:func:`sketchlab.convert_attention`; ``sinks=None``: 4 with a window, 0
        for ``window=0``; ``tied=None``: LLoPS as the tied non-negative map on transformers
        models). ``window``, ``sinks``, ``local`` and ``normalize`` are checked before any work
        (an explicit ``sinks > 0`` with ``window=0`` is refused, and ``local="poly"`` with a map
        without a polynomial degree, such as Hedgehog: layer 0's map is built to ask it, calling
        ``feature_map`` once more); the report's settings record the resolved ``sinks``.
    cache, decay, state, beta, exact_layers
        Long-context memory and layers kept exact (:func:`sketchlab.convert_attention`, DESIGN §7),
        checked before any work; stage 1 trains the decay and β parameters with the gate (at
        ``transfer_lr``), and the exact layers are neither fitted nor trained.
    gate_init : float, "mass", "search" or None
        The hybrid's initial gate logits: a number for every head, or set per head from the
        teacher's attention on the first ``gate_sequences`` training sequences
        (:func:`sketchlab.convert.scale.calibrate_gates`): ``"mass"`` the far part's share of the
        hybrid's denominator matched to the teacher's softmax share beyond the window (with the
        softmax window: the far mass to the teacher's far mass), ``"search"`` the least-error logit among
        that plus the offsets :data:`~sketchlab.convert.scale.GATE_OFFSETS`. ``None`` (default):
        ``0`` for a Hedgehog hybrid (bounded softmax features, on the window's scale: an even split
        lets its far part learn, while a searched start leaves it ~1 % of the weight and transfer
        with the gate at ``lr`` moves it slowly — on SmolLM2 layers 3/15/27, 200 steps: mean error
        0.151 from gate 0, 0.213 from the search, 0.313 for window + sinks alone), ``"search"`` for
        every other hybrid (unshifted polynomial or exponential far parts, 10³–10⁶ times the
        window's mass at gate 0), nothing for pure linear attention (``window=0``, which has no
        gate; ``"mass"``/``"search"`` are refused there).
    gate_sequences : int >= 1
        Training sequences the gate calibration reads (dense ``O(T²)`` per head and sequence).
    fit : bool
        Stage 0 (``attention="llops"`` without ``feature_map``): Θ from the kernel fit on the
        teacher's post-RoPE q, k of the training sequences (read from the teacher recording;
        ``fit_tokens`` of them per head; ``fit_options`` go to ``fit_sketch``). Otherwise the maps
        start from their own initialisation.
    fit_work : float > 0 or None
        The stage-0 fit's effort: a cap on each head's estimated multiply-adds (``fit_llops_direct``'s
        ``work=``; the schedule is cut after ``max(1, ⌊fit_work / c⌋)`` iterations, ``c`` one
        iteration's cost). ``None``: :data:`DEFAULT_FIT_WORK` (about 5 ALS sweeps on a SmolLM2 head,
        stage 0 in minutes where the preset's full schedule took ~27); ``math.inf``: the full schedule.
        The plan (iterations per head) is printed up front with ``progress=True`` and recorded in the
        stage's ``fit``.
    far : bool
        ``False``: the far part off — every gate logit at :data:`FAR_OFF_LOGIT` (``sigmoid(40) = 1``:
        the far part's weight 0) and frozen, no fit, no transfer (the maps would have no effect):
        window + sinks (and a ``cache``) alone, the control a hybrid must beat; LoRA still runs.
        Needs a window; ``gate_init`` is then refused.
    transfer_steps, transfer_lr
        Stage 1: Adam steps per layer (``0``: skipped) and learning rate.
    processes : int >= 1
        Stage 1's layers spread over this process and ``processes − 1`` spawned workers
        (:func:`attention_transfer`: gloo on localhost, the teacher's recording shared, not copied; the
        same result as one process). Under ``torchrun`` (an initialised ``torch.distributed``
        group) leave it at 1: stage 1 spreads over the group's ranks by itself, each rank running
        the other stages in full. Only stage 1 is spread: the teacher pass, the fit, the gates,
        LoRA and every evaluation run in this process.
    lora_steps, lora_rank, lora_lr
        Stage 2 (``lora_steps > 0``): LoRA steps on the whole model, rank and learning rate.
    batch_size : int
        Sequences per step and per evaluation batch.
    evaluate : bool
        Measure the held-out metric (perplexity or embedding cosine) after each stage and for the teacher.
    seed : int
        The conversion's initialisation, the fit, and the training batches (stage 1: one generator per
        layer, seeded from ``(seed, layer)``).
    max_bytes : int
        Memory budget of the run, checked before any work against :func:`memory_plan`'s estimate (the
        model's parameters, the teacher's recorded attention — ``Σ_layers (2·H + 2·H_kv)·D`` values
        per token in the model's dtype — and the largest stage buffer: an evaluation batch's logits,
        the fit, the gates, a transfer or LoRA step): a ``ValueError`` names the sizes, the budget and
        the way out. The estimate is recorded in the report's settings (``memory_estimate``).
    progress : bool
        Up front, one line on stderr (the sequences, the memory estimate, the fit's plan); then a
        tqdm bar with its ETA on stderr for every stage: the teacher recording, the Θ fit (per
        layer), the gate calibration (per layer), transfer (steps, layer by layer), LoRA (steps) and
        each evaluation.

    Returns
    -------
    (model, LinearizeReport)
        The converted model (the same object unless LoRA merged it) and the stage-by-stage report.
        With a window (and ``far=True``) every stage also gives window + sinks alone on the same
        held-out sequences — the converted model with its far part's weight 0 (gates at
        :data:`FAR_OFF_LOGIT`), the floor the far part must beat: ``window_only_metric``,
        ``window_only_layer_error`` and ``far_helps`` (whether the stage's metric beats it); an
        encoder's stages add ``nn_agreement`` (nearest-neighbour agreement with the teacher's
        sentence embeddings) beside the mean cosine ``metric``.
    """
    family = family_of(model)
    window, sinks = check_layout(window, sinks, local, normalize)
    _, sites = attention_sites(model)
    exact = _check_exact_layers(exact_layers, len(sites), family)  # before any work, by the conversion's rules
    memory = _check_memory(cache, decay, state, beta, window, sinks, local, normalize,
                           causal=all(site.causal for site in sites))
    _check_far(far, window, gate_init)
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {progress!r}")
    check_teacher_finite(model)
    encoder = family != "toy" and FAMILY_TABLE[family].encoder
    sentences = encoder and _all_strings(texts)  # an encoder reads one sentence (line) per sequence
    ids, mask = tokenize_texts(texts, tokenizer, seq_len=seq_len, max_tokens=max_tokens, sentences=sentences)
    _check_against_model(getattr(model, "config", None), ids, mask, "linearize: texts", seq_len)
    if not (isinstance(holdout, float) and 0 < holdout < 1):
        raise ValueError(f"holdout must be a float in (0, 1), got {holdout!r}")
    N = ids.shape[0]
    n_held = max(1, int(round(holdout * N)))
    if n_held >= N:
        raise ValueError(f"holdout={holdout} of {N} sequence(s) leaves none to train on; give more text or lower seq_len")
    train_idx, held_idx = torch.arange(N - n_held), torch.arange(N - n_held, N)
    transfer_steps = check_nonnegative_int(transfer_steps, "transfer_steps")
    processes = _check_processes(processes)
    lora_steps = check_nonnegative_int(lora_steps, "lora_steps")
    batch_size = check_positive_int(batch_size, "batch_size")
    gate_sequences = check_positive_int(gate_sequences, "gate_sequences")
    if not far:
        gate_init = FAR_OFF_LOGIT
    if gate_init is None:
        gate_init = "search" if window and not (attention == "hedgehog" and feature_map is None) else 0.0
    if isinstance(gate_init, str):
        if gate_init not in ("mass", "search"):
            raise ValueError(f"gate_init must be a number, 'mass', 'search' or None, got {gate_init!r}")
        if not window:
            raise ValueError(f"gate_init={gate_init!r} sets the hybrid's gates: window=0 (pure linear attention) has none")
    elif isinstance(gate_init, bool) or not isinstance(gate_init, (int, float)) or not math.isfinite(gate_init):
        raise ValueError(f"gate_init must be a finite number, 'mass', 'search' or None, got {gate_init!r}")
    if fit_tokens is not None:
        fit_tokens = check_nonnegative_int(fit_tokens, "fit_tokens")
    fit_work = _check_fit_work(fit_work, fit_options)
    fitting = bool(fit) and far and attention == "llops" and feature_map is None
    # the map the conversion will use, checked before the teacher is recorded and Θ fitted
    tied = _resolve_tied(tied, attention, feature_map, p, family, has_theta=fitting)
    _check_processes(processes, len(sites))  # at most one process per layer, before any work
    if feature_map is None:
        check_map_memory(sites, attention, p=check_positive_int(p, "p"), m=check_positive_int(m, "m"),
                         rank=check_positive_int(rank, "rank"), max_bytes=max_bytes)
    with torch.random.fork_rng(devices=[]):  # layer 0's query map as convert_attention will make it
        probe = _make_maps(attention, feature_map, 0, sites[0].heads, sites[0].head_dim, p, m, rank, seed, tied)[0]
    check_local_map(probe, window=window, local=local)  # the layer's own rule, before the teacher is recorded
    train_tokens = int(mask[train_idx].sum())
    fit_plan = _fit_plan(p, m, rank, sites[0].head_dim, min(train_tokens, fit_tokens or train_tokens), fit_work,
                         fit_options) if fitting else None
    plan = memory_plan(model, sites, ids.shape, probe=probe, batch_size=batch_size, window=window, sinks=sinks,
                       cache=memory["cache"], fit_tokens=fit_plan and min(train_tokens, fit_tokens or train_tokens),
                       m=m, p=p, rank=rank, gate_sequences=gate_sequences if isinstance(gate_init, str) else 0,
                       transfer=bool(transfer_steps and far), lora=bool(lora_steps), encoder=encoder)
    total = plan["total"]
    if progress:  # up front: what the run will hold and do
        print(f"linearize: {N} sequence(s) of up to {ids.shape[1]} tokens ({int(mask.sum())} tokens, {n_held} held out); "
              f"memory estimate {total / 2**30:.3g} GiB ({_plan_words(plan)}) of the budget {max_bytes / 2**30:.3g} GiB"
              + (f"; stage 0 fits {(len(sites) - len(exact)) * sites[0].heads} heads, {fit_plan['iterations']} of "
                 f"{fit_plan['planned']} iterations each (~{fit_plan['work']:.2g} multiply-adds; fit_work="
                 f"{fit_work:.3g})" if fit_plan else ""), file=sys.stderr, flush=True)
    check_memory(total, max_bytes=max_bytes,
                 what=f"linearize on {N} sequence(s) of {ids.shape[1]} tokens ({_plan_words(plan)}; estimated)",
                 way_out="give less text (max_tokens=), a shorter seq_len or a smaller batch_size")
    settings = {"family": family, "attention": attention if feature_map is None else "custom", "p": p, "m": m,
                "rank": rank, "window": window, "sinks": sinks, "local": local, "normalize": normalize, "gate_init": gate_init,
                "tied": tied, "gate_sequences": gate_sequences, **memory, "exact_layers": sorted(exact), "far": far,
                "sequences": N, "held_out": n_held, "seq_len": int(ids.shape[1]), "tokens": int(mask.sum()),
                "sentences": sentences, "fit_work": fit_work if fitting else None,
                "transfer_steps": transfer_steps, "transfer_lr": transfer_lr, "processes": processes,
                "lora_steps": lora_steps,
                "lora_rank": lora_rank, "lora_lr": lora_lr, "batch_size": batch_size, "seed": seed,
                "memory_estimate": {k: v for k, v in plan.items()}, "max_bytes": max_bytes}

    def measure(current, stage):
        """The held-out metric (and, for an encoder, the neighbour agreement) of ``current``."""
        if not evaluate:
            return None, None
        desc = f"evaluate {stage}"
        if encoder:
            got = embedding_agreement(current, teacher_emb, ids[held_idx], mask[held_idx], batch_size=batch_size,
                                      progress=progress, desc=desc)
            return got["cosine"], got["nn_agreement"]
        return perplexity(current, ids[held_idx], mask[held_idx], batch_size=batch_size, progress=progress,
                          desc=desc), None

    teacher_emb = sentence_embeddings(model, ids[held_idx], mask[held_idx], batch_size=batch_size, progress=progress,
                                      desc="evaluate teacher") if encoder and evaluate else None
    teacher_metric = measure(model, "teacher")[0]
    layers = teacher_attention(model, ids, mask, batch_size=batch_size, progress=progress)
    teacher_hidden = None
    if encoder and lora_steps:
        with torch.no_grad():
            teacher_hidden = torch.cat([_hidden(model, ids[s], mask[s]) for s in _batches(N, batch_size)])
    report = LinearizeReport(settings=settings, teacher_metric=teacher_metric)

    theta, fit_info = None, None
    t0 = time.perf_counter()
    if fitting:
        theta, fit_info = _fit_recorded(layers, mask, train_idx, exact, p=p, m=m, rank=rank, fit_tokens=fit_tokens,
                                        seed=seed, fit_work=fit_work, fit_options=fit_options, progress=progress)
        fit_info["iterations"] = fit_plan["iterations"]
    sketches = convert_attention(model, attention=attention, p=p, m=m, rank=rank, window=window, sinks=sinks,
                                 local=local, feature_map=feature_map, theta=theta, normalize=normalize,
                                 gate_init=0.0 if isinstance(gate_init, str) else gate_init, tied=tied, seed=seed,
                                 max_bytes=max_bytes, exact_layers=sorted(exact), **memory)
    if not far:  # the gates stay where they are: the far part's weight 0 in every stage
        for sketch in sketches:
            sketch.gate.requires_grad_(False)
    layers = [io for i, io in enumerate(layers) if i not in exact]  # the converted layers' recordings
    gates, first = None, "fit" if theta is not None else "init"
    with named_divergence(first, model, "give another map (attention='hedgehog' is bounded) or a smaller p"):
        floor = _window_only(sketches, layers, mask, held_idx, batch_size, progress) if window and far else None
        if isinstance(gate_init, str):
            from .scale import calibrate_gates

            gates = []
            with progress_bar(len(sketches), f"gates ({gate_init})", progress, unit="layer", leave=True) as bar:
                for sketch, io in zip(sketches, layers):
                    gates += [g.tolist() for g in calibrate_gates([sketch], [io], mask, train_idx[:gate_sequences],
                                                                  how=gate_init)]
                    bar.update()
            _options(model)["gate_init"] = gate_init  # the conversion's record: the gates came from this, not 0
        errors = attention_errors(sketches, layers, mask, held_idx, batch_size=batch_size, progress=progress,
                                  desc=f"attention errors ({first})")
        report.stages.append(_stage(first, t0, measure, model, floor, higher=encoder, fit=fit_info, gates=gates, layer_error=errors))
    if transfer_steps and far:
        t0 = time.perf_counter()
        saved, way_out = snapshot(sketches), f"Lower transfer_lr (now {transfer_lr}) or transfer_steps."
        with named_divergence("transfer", model, way_out):
            losses = attention_transfer(sketches, layers, mask, train_idx, steps=transfer_steps, lr=transfer_lr,
                                        batch_size=batch_size, seed=seed, progress=progress, processes=processes)
            trained = attention_errors(sketches, layers, mask, held_idx, batch_size=batch_size, progress=progress,
                                       desc="attention errors (transfer)")
        errors, kept = keep_better("transfer", sketches, saved, report.stages[-1]["layer_error"], trained,
                                   way_out=way_out)
        report.stages.append(_stage("transfer", t0, measure, model, floor, higher=encoder, losses=[[c[0], c[-1]] for c in losses],
                                    kept_initial=kept, layer_error_trained=trained, layer_error=errors))
    if lora_steps:
        t0 = time.perf_counter()
        model, curve = _lora(model, family, ids, mask, train_idx, teacher_hidden, steps=lora_steps, rank=lora_rank,
                             lr=lora_lr, batch_size=batch_size, seed=seed, progress=progress)
        # the maps are unchanged by LoRA (it moves the projections): their error on the teacher's
        # q, k, v is the transfer stage's, so only the metric is new; the projections moved, so
        # window + sinks alone is measured again on them
        if floor is not None:
            floor = {"metric": None, "layer_error": floor["layer_error"], "model": model}
        report.stages.append(_stage("lora", t0, measure, model, floor, higher=encoder, losses=curve, layer_error=None))
    return model, report


#: The gate logit that turns a hybrid's far part off: ``sigmoid(40) = 1`` in float32 and float64, so the
#: far part's weight ``1 − g`` is 0 (``far=False``, and the report's window + sinks alone).
FAR_OFF_LOGIT = 40.0


def _check_far(far, window: int, gate_init) -> None:
    """``far``: a bool; ``far=False`` needs a window and no ``gate_init`` (it sets the gates itself)."""
    if not isinstance(far, bool):
        raise TypeError(f"far must be True or False, got {far!r}")
    if not far and not window:
        raise ValueError("far=False keeps window + sinks alone: window=0 (pure linear attention) has no window and "
                         "nothing would be left; pass window >= 1")
    if not far and gate_init is not None:
        raise ValueError(f"far=False sets every gate logit to {FAR_OFF_LOGIT} (the far part's weight 0): "
                         f"gate_init={gate_init!r} would not be used; leave it None")


def _all_strings(texts) -> bool:
    return isinstance(texts, str) or (isinstance(texts, (list, tuple)) and bool(texts)
                                      and all(isinstance(t, str) for t in texts))


class _FarOff:
    """Every gate of ``sketches`` at :data:`FAR_OFF_LOGIT` inside the block, restored after it."""

    def __init__(self, sketches):
        self.sketches = [s for s in sketches if getattr(s, "gate", None) is not None]

    def __enter__(self):
        self.saved = [s.gate.detach().clone() for s in self.sketches]
        with torch.no_grad():
            for s in self.sketches:
                s.gate.fill_(FAR_OFF_LOGIT)
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for s, g in zip(self.sketches, self.saved):
                s.gate.copy_(g)
        return False


def _window_only(sketches, layers, mask, held_idx, batch_size, progress) -> dict:
    """Window + sinks alone (the far part's weight 0) on the held-out sequences: each layer's
    attention-output error; the metric is measured per stage (:func:`_stage`)."""
    with _FarOff(sketches):
        errors = attention_errors(sketches, layers, mask, held_idx, batch_size=batch_size, progress=progress,
                                  desc="attention errors (window + sinks alone)")
    return {"metric": None, "layer_error": errors, "sketches": sketches}


def _stage(name, t0, measure, model, floor, *, higher: bool, **details) -> dict:
    """A stage's report entry: its details, held-out metric and, with a window, window + sinks alone
    (the floor its far part must beat: ``window_only_metric``, ``far_helps``; ``higher``: the metric is
    better higher, an encoder's cosine, not a perplexity)."""
    seconds = time.perf_counter() - t0
    metric, agreement = measure(model, name)
    entry = {"name": name, "seconds": seconds, **details, "metric": metric}
    if agreement is not None:
        entry["nn_agreement"] = agreement
    if floor is not None:
        if floor["metric"] is None and metric is not None:  # measured once per set of projections
            sketches = floor.get("sketches") or converted_modules(floor["model"])
            with _FarOff(sketches):
                floor["metric"], floor["nn_agreement"] = measure(model, f"{name}, window + sinks alone")
        entry["window_only_metric"] = floor["metric"]
        entry["window_only_layer_error"] = floor["layer_error"]
        if floor.get("nn_agreement") is not None:
            entry["window_only_nn_agreement"] = floor["nn_agreement"]
        if metric is not None and floor["metric"] is not None:
            # perplexity: lower is better; an encoder's cosine: higher
            entry["far_helps"] = bool(metric > floor["metric"] if higher else metric < floor["metric"])
    return entry


def memory_plan(model: nn.Module, sites, shape, *, probe=None, batch_size: int, window: int, sinks: int, cache: int,
                fit_tokens, m: int, p: int, rank: int, gate_sequences: int, transfer: bool, lora: bool,
                encoder: bool) -> dict:
    """What :func:`linearize` allocates on ``shape = [N, T]`` sequences, in bytes (an estimate, on the
    generous side): held for the whole run, the model's ``parameters`` and the teacher ``recording``
    (every layer's q, k, v and output, allocated once); then, one at a time, the largest of the
    stages' transient buffers — an ``evaluation`` batch (the logits in the model's dtype and in float64
    with their log-softmax; the dense attention scores), the stage-0 ``fit`` (the fitting tokens'
    float64 q, k, one layer's ``n × n`` kernels and features, the layer's training rows copied), the
    ``gates`` calibration (dense float64 scores of ``gate_sequences``), the ``attention errors``
    (float64 outputs and features of a batch), a ``transfer`` step (one layer's features, scores and
    their gradients on ``batch_size`` sequences) and a ``lora`` step (the whole model's activations kept
    for the backward pass). ``total`` = parameters + recording + the largest of them."""
    N, T = int(shape[0]), int(shape[1])
    b = min(batch_size, N)
    params = list(model.parameters())
    item = params[0].element_size()
    cfg = getattr(model, "config", None)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    hidden = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "d_model", 0) or 0)
    L = len(sites)
    H = max(s.heads for s in sites)
    D = max(s.head_dim for s in sites)
    feats = m
    if probe is not None:
        try:  # the map's feature count, from one zero token (a map that cannot take it: m)
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                feats = int(probe(torch.zeros(1, 1, sites[0].heads, sites[0].head_dim,
                                              dtype=next(probe.parameters(), torch.zeros(0)).dtype)).shape[-1])
        except (TypeError, ValueError, RuntimeError, IndexError):
            feats = m
    exact_keys = window + sinks + cache
    plan = {"parameters": sum(t.numel() * t.element_size() for t in params),
            "recording": sum((2 * s.heads + 2 * s.kv_heads) * s.head_dim for s in sites) * item * N * T}
    scores = b * H * T * T * item * 2  # the teacher's dense attention scores and weights of one layer
    plan["evaluation"] = scores + (b * T * hidden * 8 if encoder else b * T * vocab * (item + 16))
    if fit_tokens:
        n = int(fit_tokens)
        plan["fit"] = (2 * H * n * D * 8 + 3 * H * n * n * 8 + 4 * H * n * m * p * rank * 8
                       + 2 * (N * T) * H * D * item)
    if gate_sequences:
        plan["gates"] = 3 * min(gate_sequences, N) * H * T * T * 8
    plan["attention errors"] = b * T * H * (3 * D * 8 + 2 * feats * 8 + exact_keys * 8)
    if transfer:
        plan["transfer"] = 4 * b * T * H * (2 * feats + 3 * D + exact_keys + 2 * cache) * max(item, 4)
    if lora:
        per_layer = b * T * (16 * hidden + 2 * H * min(T, exact_keys + feats)) * item
        plan["lora"] = L * per_layer + 3 * b * T * max(vocab, hidden) * item + 3 * plan["parameters"] // 100
    transient = max((v for k, v in plan.items() if k not in ("parameters", "recording")), default=0)
    plan["total"] = plan["parameters"] + plan["recording"] + transient
    return plan


def _plan_words(plan: dict) -> str:
    """``parameters 0.5 GiB + recording 4.5 GiB + evaluation 2 GiB (the largest of the stages')``."""
    transient = {k: v for k, v in plan.items() if k not in ("parameters", "recording", "total")}
    big = max(transient, key=transient.get) if transient else None
    gib = lambda v: f"{v / 2**30:.3g} GiB"  # noqa: E731
    return (f"parameters {gib(plan['parameters'])} + teacher recording {gib(plan['recording'])}"
            + (f" + {big} {gib(transient[big])}, the largest of the stages' buffers" if big else ""))
