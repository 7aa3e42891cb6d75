r"""``linearize``: a softmax model's attention made sketched, in measured stages (LoLCATs' recipe).

:func:`linearize` is the one entry point; it routes by family: a model (:class:`torch.nn.Module`) to
:func:`linearize_model`, below; a toy MQAR checkpoint (a path) to
:func:`sketchlab.convert.mqar.linearize_checkpoint`. Each family takes its own keywords: a keyword the
family does not take is refused, named, never ignored.

:func:`linearize_model` is the orchestrator: everything checked up front (:func:`_prepare`, the memory by :func:`memory_plan`),
:mod:`.teacher` records every teacher layer's inputs and output once, then the stages (DESIGN §6), each reported with each layer's attention-output
error on held-out sequences (:mod:`.evaluate`):

0. **fit** (:mod:`.theta`, ``attention="llops"`` only): Θ from the kernel fit on the teacher's post-RoPE
   q, k (``fit_sketch("llops", q·D^{-1/4}, k·D^{-1/4})``), the converted model starting from it;
1. **transfer** (:mod:`.transfer`, LoLCATs stage 1): only the feature maps and gates train, each layer's
   sketched attention matched to the teacher's output on the same inputs (MSE), layers independent,
   so they can be spread over processes (:mod:`.spread`);
2. **lora** (:mod:`.lora`, ``lora_steps > 0``): LoRA adapters (peft) on the attention projections,
   trained with the next-token loss (causal LMs) or the distance to the teacher's final hidden
   states (encoders), then merged into the weights.

The attention-output error of a layer is ``‖o − o_teacher‖_F / ‖o_teacher‖_F`` over the valid tokens
of the held-out sequences, with both attentions given the teacher's q, k, v.

References
----------
Zhang et al. *LoLCATs: On Low-Rank Linearizing of Large Language Models*, 2024.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from .._validation import DEFAULT_MAX_BYTES, check_memory, check_nonnegative_int, check_positive_int
from ..capture import _check_against_model
from .convert import (
    _check_exact_layers,
    _check_memory,
    _make_maps,
    _options,
    _resolve_tied,
    check_layout,
    check_map_memory,
    convert_attention,
    converted_modules,
)
from .evaluate import (
    FAR_OFF_LOGIT,
    StageMeasures,
    _batches,
    _hidden,
    attention_errors,
    embedding_agreement,
    far_off,
    perplexity,
    progress_bar,
    sentence_embeddings,
    token_nll,
)
from .families import FAMILY_TABLE, attention_sites, family_of
from .lora import _lora, check_lora_model, lora_finetune
from .sketched import check_local_map
from .spread import _check_processes
from .stages import check_teacher_finite, keep_better, named_divergence, snapshot
from .teacher import LayerIO, _all_strings, teacher_attention, tokenize_texts
from .theta import DEFAULT_FIT_WORK, _check_fit_work, _fit_plan, _fit_recorded, fit_theta
from .transfer import attention_transfer

__all__ = ["DEFAULT_FIT_WORK", "FAR_OFF_LOGIT", "LayerIO", "LinearizeReport", "attention_errors", "attention_transfer",
           "embedding_agreement", "fit_theta", "linearize", "linearize_model", "lora_finetune", "memory_plan", "perplexity",
           "sentence_embeddings", "teacher_attention", "token_nll", "tokenize_texts"]


@dataclass
class LinearizeReport:
    """Outcome of :func:`linearize_model`.

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


def linearize(model, texts=None, **options):
    r"""Linearise a softmax model: its attention made sketched, fitted and trained, by the model's family.

    Two families, each with its own stages and keywords:

    * a model (:class:`torch.nn.Module`: a supported transformers model or sketchlab's toy
      :class:`~sketchlab.tasks.TransformerLM`) and ``texts``: :func:`linearize_model`, the model converted
      in place (:func:`sketchlab.convert_attention`) and trained in stages (Θ fit, attention transfer, LoRA);
    * a toy MQAR checkpoint (a ``str`` or :class:`os.PathLike` path to a softmax ``TransformerLM`` directory
      that records its MQAR task) and no ``texts``: :func:`~sketchlab.convert.mqar.linearize_checkpoint`, a
      native ``llops`` model with fitted Θ fine-tuned on its task, its files written under ``out``.

    Parameters
    ----------
    model : nn.Module, or str or os.PathLike
        The softmax teacher, or the path of a toy MQAR checkpoint.
    texts : optional
        The model family's training and held-out text (required there; :func:`linearize_model`). The
        checkpoint family draws its own task's sequences: ``texts`` must be ``None``.
    **options
        The family's keywords: :func:`linearize_model`'s or
        :func:`~sketchlab.convert.mqar.linearize_checkpoint`'s. A keyword the family does not take is
        refused (``TypeError`` naming it and the family's keywords) before any work.

    Returns
    -------
    (model, LinearizeReport) or CheckpointReport
        The family's result: :func:`linearize_model`'s, or
        :func:`~sketchlab.convert.mqar.linearize_checkpoint`'s.
    """
    if isinstance(model, (str, os.PathLike)):
        from .mqar import linearize_checkpoint

        family = f"the toy MQAR checkpoint family (model={os.fspath(model)!r}, a path)"
        if texts is not None:
            raise TypeError(f"linearize: {family} draws its own task's sequences; texts must be None, got "
                            f"{type(texts).__name__}")
        _check_keywords(linearize_checkpoint, options, family)
        return linearize_checkpoint(model, **options)
    family = f"the model family (model: {type(model).__name__})"
    if texts is None:
        raise TypeError(f"linearize: {family} trains on texts: pass them (strings with tokenizer=, token-id lists "
                        "or a LongTensor [N, T]); a toy MQAR checkpoint is given by its path")
    _check_keywords(linearize_model, options, family)
    return linearize_model(model, texts, **options)


def _check_keywords(fn, options: dict, family: str) -> None:
    """Refuse (``TypeError``) the keywords of ``options`` that ``fn``, ``family``'s linearisation, does not
    take (its keyword-only parameters), naming them and the ones it takes."""
    params = inspect.signature(fn).parameters.values()
    takes = [param.name for param in params if param.kind is param.KEYWORD_ONLY]
    unknown = [name for name in options if name not in takes]
    if unknown:
        raise TypeError(f"linearize: {', '.join(unknown)}: not a keyword of {family}; it takes {', '.join(takes)}")


def linearize_model(model: nn.Module, texts, *, tokenizer=None, attention: str = "llops", p: int = 2, m: int = 64,
                    rank: int = 1, window: int = 64, sinks: int | None = None, local: str = "softmax",
                    feature_map=None, normalize: str | None = None, gate_init: float | str | None = None,
                    tied: bool | None = None, input_norm: bool = False, gate_sequences: int = 4, seq_len: int = 512,
                    max_tokens: int | None = None, holdout: float = 0.25, fit: bool = True, fit_tokens: int = 1024,
                    fit_options: dict | None = None, transfer_steps: int = 100, transfer_lr: float = 1e-2,
                    lora_steps: int = 0, lora_rank: int = 8, lora_lr: float = 1e-4, batch_size: int = 4,
                    evaluate: bool = True, seed: int = 0, progress: bool = False, processes: int = 1,
                    max_bytes: int = DEFAULT_MAX_BYTES, cache: int = 0, decay=None, state: str = "additive",
                    beta: str = "head", exact_layers=(), fit_work: float | None = None, far: bool = True, qk_conv: int = 0):
    r"""Convert ``model``'s attention (:func:`sketchlab.convert_attention`) and train it in stages.

    Parameters
    ----------
    model : nn.Module
        The softmax teacher (a supported transformers model or sketchlab's toy model); converted
        in place (the LoRA stage merges its adapters into the weights).
    texts
        Training and held-out text: strings (with ``tokenizer``), token-id lists or a LongTensor
        ``[N, T]`` (:func:`tokenize_texts`), cut into ``seq_len``-token sequences, ``max_tokens`` in all;
        an encoder (BERT family) given strings reads one sentence (non-blank line) per sequence.
    seq_len : int
        Tokens per sequence. Transfer at the longest context the model will run at: a hybrid's far
        part sees up to ``seq_len − window`` keys in training, and maps transferred on shorter
        sequences put too much mass on the far keys beyond that (DESIGN §6, ``linearize_lm_len512.md``).
    holdout : float in (0, 1)
        Fraction of the sequences (the last ones) held out of training: every error and metric is
        measured on them.
    attention, p, m, rank, window, sinks, local, feature_map, normalize, tied, input_norm
        The conversion (:func:`sketchlab.convert_attention`; ``sinks=None``: 4 with a window, 0
        for ``window=0``; ``tied=None``: LLoPS as the tied non-negative map on transformers
        models; ``input_norm``: the maps on layer-normalised q, k, the affine trained in stage 1), checked by its rules before any work (``local="poly"`` asks layer 0's map, built
        once more, for a polynomial degree); the report's settings record the resolved ``sinks``.
    cache, decay, state, beta, exact_layers
        Long-context memory and layers kept exact (:func:`sketchlab.convert_attention`, DESIGN §7),
        checked before any work; stage 1 trains the decay and β parameters with the gate (at
        ``transfer_lr``), and the exact layers are neither fitted nor trained.
    qk_conv : int
        The short causal convolution on q and k (:func:`sketchlab.convert_attention`), started as the
        identity; stage 1 trains its weights with the maps.
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
        ``work=``: ``max(1, ⌊fit_work / c⌋)`` iterations of cost ``c``). ``None``: :data:`DEFAULT_FIT_WORK`
        (stage 0 in minutes on SmolLM2); ``math.inf``: the full schedule. The plan (iterations per head)
        is printed up front with ``progress=True`` and recorded in the stage's ``fit``.
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
        parameters, the teacher recording and the largest stage buffer): a ``ValueError`` names the
        sizes, the budget and the way out. The report's settings record it (``memory_estimate``).
    progress : bool
        Up front, one line on stderr (the sequences, the memory estimate, the fit's plan); then a
        tqdm bar with its ETA on stderr for the recording, every stage and each evaluation.

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
    r = _prepare(model, texts, {k: v for k, v in locals().items() if k not in ("model", "texts")})
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
                                 input_norm=r.input_norm, seed=r.seed, max_bytes=r.max_bytes, exact_layers=sorted(r.exact), **r.memory)
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


# ------------------------------------------------------------------------------------------------
# what linearize settles before any work


#: The report's ``settings``: :func:`sketchlab.linearize`'s arguments as resolved (``sinks``, ``gate_init``,
#: ``tied``, ``fit_work``, ...), then what the run read and planned; the one list of them.
SETTINGS = ("family", "attention", "p", "m", "rank", "window", "sinks", "local", "normalize", "gate_init", "tied",
            "input_norm", "gate_sequences", "cache", "decay", "state", "beta", "qk_conv", "exact_layers", "far",
            "sequences", "held_out",
            "seq_len", "tokens", "sentences", "fit_work", "transfer_steps", "transfer_lr", "processes", "lora_steps",
            "lora_rank", "lora_lr", "batch_size", "seed", "memory_estimate", "max_bytes")


def _prepare(model: nn.Module, texts, run: dict) -> SimpleNamespace:
    """What :func:`linearize_model` settles before any work: ``run`` (its keyword arguments) checked (by the
    conversion's own rules where it has them) and resolved, with what the stages read added: ``family``,
    ``sites``, ``exact`` (a set), ``memory`` (the conversion's memory options), ``encoder``, ``sentences``,
    ``ids``, ``mask``, ``train_idx``, ``held_idx``, ``fitting``, ``fit_plan``, ``settings``; a refusal names
    the argument, the rule and the value."""
    r = dict(run)
    r["family"] = family = family_of(model)
    for name in ("transfer_steps", "lora_steps"):
        r[name] = check_nonnegative_int(r[name], name)
    check_lora_model(family, r["lora_steps"], "lora_steps")  # stage 2's rule, not after stages 0 and 1
    r["window"], r["sinks"] = check_layout(r["window"], r["sinks"], r["local"], r["normalize"])
    sites = r["sites"] = attention_sites(model)[1]
    r["exact"] = _check_exact_layers(r["exact_layers"], len(sites), family)  # before any work, by the conversion's rules
    r["memory"] = _check_memory(r["cache"], r["decay"], r["state"], r["beta"], r["window"], r["sinks"], r["local"],
                                r["normalize"], causal=all(site.causal for site in sites), qk_conv=r["qk_conv"])
    _check_far(r["far"], r["window"], r["gate_init"])
    for flag in ("progress", "input_norm"):
        if not isinstance(r[flag], bool):
            raise TypeError(f"{flag} must be True or False, got {r[flag]!r}")
    check_teacher_finite(model)
    r["encoder"] = encoder = family != "toy" and FAMILY_TABLE[family].encoder
    r["sentences"] = encoder and _all_strings(texts)  # an encoder reads one sentence (line) per sequence
    ids, mask = r["ids"], r["mask"] = tokenize_texts(texts, r["tokenizer"], seq_len=r["seq_len"],
                                                     max_tokens=r["max_tokens"], sentences=r["sentences"])
    _check_against_model(getattr(model, "config", None), ids, mask, "linearize: texts", r["seq_len"])
    holdout = r["holdout"]
    if not (isinstance(holdout, float) and 0 < holdout < 1):
        raise ValueError(f"holdout must be a float in (0, 1), got {holdout!r}")
    N = ids.shape[0]
    n_held = max(1, int(round(holdout * N)))
    if n_held >= N:
        raise ValueError(f"holdout={holdout} of {N} sequence(s) leaves none to train on; give more text or lower seq_len")
    r["train_idx"], r["held_idx"] = torch.arange(N - n_held), torch.arange(N - n_held, N)
    for name in ("batch_size", "gate_sequences"):
        r[name] = check_positive_int(r[name], name)
    r["processes"] = _check_processes(r["processes"], len(sites))  # at most one process per layer
    r["gate_init"] = _check_gate_init(r)
    if r["fit_tokens"] is not None:
        r["fit_tokens"] = check_nonnegative_int(r["fit_tokens"], "fit_tokens")
    r["fit_work"] = _check_fit_work(r["fit_work"], r["fit_options"])
    r["fitting"] = bool(r["fit"]) and r["far"] and r["attention"] == "llops" and r["feature_map"] is None
    # the map the conversion will use, checked before the teacher is recorded and Θ fitted
    r["tied"] = _resolve_tied(r["tied"], r["attention"], r["feature_map"], r["p"], family, has_theta=r["fitting"])
    if r["feature_map"] is None:
        check_map_memory(sites, r["attention"], p=check_positive_int(r["p"], "p"), m=check_positive_int(r["m"], "m"),
                         rank=check_positive_int(r["rank"], "rank"), max_bytes=r["max_bytes"])
    with torch.random.fork_rng(devices=[]):  # layer 0's query map as convert_attention will make it
        probe = _make_maps(r["attention"], r["feature_map"], 0, sites[0].heads, sites[0].head_dim, r["p"], r["m"],
                           r["rank"], r["seed"], r["tied"], r["input_norm"])[0]
    check_local_map(probe, window=r["window"], local=r["local"])  # the layer's own rule, before the teacher is recorded
    train_tokens = int(mask[r["train_idx"]].sum())
    fit_tokens = min(train_tokens, r["fit_tokens"] or train_tokens)
    r["fit_plan"] = _fit_plan(r["p"], r["m"], r["rank"], sites[0].head_dim, fit_tokens, r["fit_work"],
                              r["fit_options"]) if r["fitting"] else None
    plan = memory_plan(model, sites, ids.shape, probe=probe, batch_size=r["batch_size"], window=r["window"],
                       sinks=r["sinks"], cache=r["memory"]["cache"], fit_tokens=r["fit_plan"] and fit_tokens, m=r["m"],
                       p=r["p"], rank=r["rank"],
                       gate_sequences=r["gate_sequences"] if isinstance(r["gate_init"], str) else 0,
                       transfer=bool(r["transfer_steps"] and r["far"]), lora=bool(r["lora_steps"]), encoder=encoder)
    _announce(r, plan, n_held)
    shown = {**r, **r["memory"], "attention": r["attention"] if r["feature_map"] is None else "custom",
             "sequences": N, "held_out": n_held, "seq_len": int(ids.shape[1]), "tokens": int(mask.sum()),
             "exact_layers": sorted(r["exact"]), "fit_work": r["fit_work"] if r["fitting"] else None,
             "memory_estimate": plan}
    r["settings"] = {name: shown[name] for name in SETTINGS}
    return SimpleNamespace(**r)


def _announce(r: dict, plan: dict, n_held: int) -> None:
    """The run up front on stderr (``progress``: its sequences, memory estimate and fit plan), then its
    memory estimate against the budget (a ``ValueError`` naming the sizes and the way out)."""
    ids, mask, fit_plan = r["ids"], r["mask"], r["fit_plan"]
    N, T = ids.shape
    if r["progress"]:
        heads = (len(r["sites"]) - len(r["exact"])) * r["sites"][0].heads
        print(f"linearize: {N} sequence(s) of up to {T} tokens ({int(mask.sum())} tokens, {n_held} held out); "
              f"memory estimate {plan['total'] / 2**30:.3g} GiB ({_plan_words(plan)}) of the budget "
              f"{r['max_bytes'] / 2**30:.3g} GiB"
              + (f"; stage 0 fits {heads} heads, {fit_plan['iterations']} of {fit_plan['planned']} iterations each "
                 f"(~{fit_plan['work']:.2g} multiply-adds; fit_work={r['fit_work']:.3g})" if fit_plan else ""),
              file=sys.stderr, flush=True)
    check_memory(plan["total"], max_bytes=r["max_bytes"],
                 what=f"linearize on {N} sequence(s) of {T} tokens ({_plan_words(plan)}; estimated)",
                 way_out="give less text (max_tokens=), a shorter seq_len or a smaller batch_size")


def _check_gate_init(r: dict):
    """The resolved ``gate_init``: :data:`FAR_OFF_LOGIT` with ``far=False``; for ``None``, ``0`` for a
    Hedgehog hybrid or pure linear attention, ``"search"`` for any other hybrid; else checked."""
    gate_init, window = r["gate_init"], r["window"]
    if not r["far"]:
        return FAR_OFF_LOGIT
    if gate_init is None:
        return "search" if window and not (r["attention"] == "hedgehog" and r["feature_map"] is None) else 0.0
    if isinstance(gate_init, str):
        if gate_init not in ("mass", "search"):
            raise ValueError(f"gate_init must be a number, 'mass', 'search' or None, got {gate_init!r}")
        if not window:
            raise ValueError(f"gate_init={gate_init!r} sets the hybrid's gates: window=0 (pure linear attention) has none")
    elif isinstance(gate_init, bool) or not isinstance(gate_init, (int, float)) or not math.isfinite(gate_init):
        raise ValueError(f"gate_init must be a finite number, 'mass', 'search' or None, got {gate_init!r}")
    return gate_init


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



def memory_plan(model: nn.Module, sites, shape, *, probe=None, batch_size: int, window: int, sinks: int, cache: int,
                fit_tokens, m: int, p: int, rank: int, gate_sequences: int, transfer: bool, lora: bool,
                encoder: bool) -> dict:
    """What :func:`linearize_model` allocates on ``shape = [N, T]`` sequences, in bytes (an estimate, on the
    generous side): the model's ``parameters`` and the teacher ``recording`` (every layer's q, k, v and
    output) for the whole run, then the largest of the stages' transient buffers: an ``evaluation``
    batch (logits in the model's dtype and float64, dense scores), the stage-0 ``fit`` (float64 q, k,
    one layer's ``n × n`` kernels and features), the ``gates`` calibration (dense float64 scores), the
    ``attention errors``, a ``transfer`` step (one layer's features, scores and gradients) and a
    ``lora`` step (the whole model's activations). ``total`` = parameters + recording + the largest."""
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
