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

import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .._validation import DEFAULT_MAX_BYTES
from .convert import _options, convert_attention, converted_modules
from .evaluate import (FAR_OFF_LOGIT, StageMeasures, _batches, _hidden, attention_errors, embedding_agreement,
                       far_off, perplexity, progress_bar, sentence_embeddings, token_nll)
from .lora import _lora, lora_finetune
from .plan import memory_plan, prepare
from .stages import keep_better, named_divergence, snapshot
from .teacher import LayerIO, teacher_attention, tokenize_texts
from .theta import DEFAULT_FIT_WORK, _fit_recorded, fit_theta
from .transfer import attention_transfer

__all__ = ["DEFAULT_FIT_WORK", "FAR_OFF_LOGIT", "LayerIO", "LinearizeReport", "attention_errors", "attention_transfer",
           "embedding_agreement", "fit_theta", "linearize", "lora_finetune", "memory_plan", "perplexity",
           "sentence_embeddings", "teacher_attention", "token_nll", "tokenize_texts"]


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
        hybrid's denominator matched to the teacher's softmax share beyond the window, ``"search"`` the
        least-error logit among that plus :data:`~sketchlab.convert.scale.GATE_OFFSETS`. ``None``
        (default): ``0`` for a Hedgehog hybrid (bounded features on the window's scale: an even split
        lets its far part learn, DESIGN §6), ``"search"`` for every other hybrid, nothing for pure
        linear attention (``window=0`` has no gate; ``"mass"``/``"search"`` are refused there).
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
        (:func:`attention_transfer`; the same result as one process). Under ``torchrun`` leave it at 1:
        stage 1 spreads over the group's ranks by itself. The other stages run in this process.
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
    r = prepare(model, texts, {k: v for k, v in locals().items() if k not in ("model", "texts")})
    measures = StageMeasures(r.ids, r.mask, r.held_idx, encoder=r.encoder, enabled=evaluate, batch_size=r.batch_size,
                             progress=r.progress)
    report = LinearizeReport(settings=r.settings, teacher_metric=measures.teacher(model))
    layers = teacher_attention(model, r.ids, r.mask, batch_size=r.batch_size, progress=r.progress)
    teacher_hidden = None
    if r.encoder and r.lora_steps:
        with torch.no_grad():
            teacher_hidden = torch.cat([_hidden(model, r.ids[s], r.mask[s]) for s in _batches(len(r.ids), r.batch_size)])

    t0, theta, fit_info, gates = time.perf_counter(), None, None, None
    if r.fitting:
        theta, fit_info = _fit_recorded(layers, r.mask, r.train_idx, r.exact, p=r.p, m=r.m, rank=r.rank,
                                        fit_tokens=r.fit_tokens, seed=r.seed, fit_work=r.fit_work,
                                        fit_options=r.fit_options, progress=r.progress)
        fit_info["iterations"] = r.fit_plan["iterations"]
    sketches = convert_attention(model, attention=r.attention, p=r.p, m=r.m, rank=r.rank, window=r.window, sinks=r.sinks,
                                 local=r.local, feature_map=r.feature_map, theta=theta, normalize=r.normalize,
                                 gate_init=0.0 if isinstance(r.gate_init, str) else r.gate_init, tied=r.tied,
                                 seed=r.seed, max_bytes=r.max_bytes, exact_layers=sorted(r.exact), **r.memory)
    if not r.far:  # the gates stay where they are: the far part's weight 0 in every stage
        for sketch in sketches:
            sketch.gate.requires_grad_(False)
    layers = [io for i, io in enumerate(layers) if i not in r.exact]  # the converted layers' recordings

    def errors(stage):
        return attention_errors(sketches, layers, r.mask, r.held_idx, batch_size=r.batch_size, progress=r.progress,
                                desc=f"attention errors ({stage})")

    first = "fit" if theta is not None else "init"
    with named_divergence(first, model, "give another map (attention='hedgehog' is bounded) or a smaller p"):
        if r.window and r.far:
            with far_off(sketches):
                measures.window_only(sketches, errors("window + sinks alone"))
        if isinstance(r.gate_init, str):
            gates = _calibrate_gates(model, sketches, layers, r)
        report.stages.append(measures.stage(first, t0, model, fit=fit_info, gates=gates, layer_error=errors(first)))
    if r.transfer_steps and r.far:
        t0 = time.perf_counter()
        saved, way_out = snapshot(sketches), f"Lower transfer_lr (now {r.transfer_lr}) or transfer_steps."
        with named_divergence("transfer", model, way_out):
            losses = attention_transfer(sketches, layers, r.mask, r.train_idx, steps=r.transfer_steps,
                                        lr=r.transfer_lr, batch_size=r.batch_size, seed=r.seed, progress=r.progress,
                                        processes=r.processes)
            trained = errors("transfer")
        kept_errors, kept = keep_better("transfer", sketches, saved, report.stages[-1]["layer_error"], trained,
                                        way_out=way_out)
        report.stages.append(measures.stage("transfer", t0, model, losses=[[c[0], c[-1]] for c in losses],
                                            kept_initial=kept, layer_error_trained=trained, layer_error=kept_errors))
    if r.lora_steps:
        t0 = time.perf_counter()
        model, curve = _lora(model, r.family, r.ids, r.mask, r.train_idx, teacher_hidden, steps=r.lora_steps,
                             rank=r.lora_rank, lr=r.lora_lr, batch_size=r.batch_size, seed=r.seed, progress=r.progress)
        # the maps are unchanged by LoRA (it moves the projections): their error on the teacher's q, k, v is the
        # transfer stage's, so only the metric is new; window + sinks alone is measured again on the new projections
        if measures.floor is not None:
            measures.window_only(converted_modules(model), measures.floor["layer_error"])
        report.stages.append(measures.stage("lora", t0, model, losses=curve, layer_error=None))
    return model, report


def _calibrate_gates(model, sketches, layers, r) -> list:
    """Each layer's gate logits from the teacher's attention on the first ``gate_sequences`` training
    sequences (:func:`sketchlab.convert.scale.calibrate_gates`, ``how=gate_init``), recorded in the conversion."""
    from .scale import calibrate_gates

    gates = []
    with progress_bar(len(sketches), f"gates ({r.gate_init})", r.progress, unit="layer", leave=True) as bar:
        for sketch, io in zip(sketches, layers):
            gates += [g.tolist() for g in calibrate_gates([sketch], [io], r.mask, r.train_idx[:r.gate_sequences],
                                                          how=r.gate_init)]
            bar.update()
    _options(model)["gate_init"] = r.gate_init  # the conversion's record: the gates came from this, not 0
    return gates
