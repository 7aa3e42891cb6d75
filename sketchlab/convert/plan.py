"""What :func:`sketchlab.linearize` settles before any work: every argument checked (by the conversion's own
rules where it has them) and resolved, the text tokenised and split, the memory it will take
(:func:`memory_plan`) against its budget, and the settings the report records."""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import torch
from torch import nn

from .._validation import check_memory, check_nonnegative_int, check_positive_int
from ..capture import _check_against_model
from .convert import _check_exact_layers, _check_memory, _make_maps, _resolve_tied, check_layout, check_map_memory
from .evaluate import FAR_OFF_LOGIT
from .families import FAMILY_TABLE, attention_sites, family_of
from .sketched import check_local_map
from .spread import _check_processes
from .stages import check_teacher_finite
from .teacher import _all_strings, tokenize_texts
from .theta import _check_fit_work, _fit_plan

__all__ = ["memory_plan"]

#: The report's ``settings``: :func:`sketchlab.linearize`'s arguments as resolved (``sinks``, ``gate_init``,
#: ``tied``, ``fit_work``, ...), then what the run read and planned; the one list of them.
SETTINGS = ("family", "attention", "p", "m", "rank", "window", "sinks", "local", "normalize", "gate_init", "tied",
            "gate_sequences", "cache", "decay", "state", "beta", "exact_layers", "far", "sequences", "held_out",
            "seq_len", "tokens", "sentences", "fit_work", "transfer_steps", "transfer_lr", "processes", "lora_steps",
            "lora_rank", "lora_lr", "batch_size", "seed", "memory_estimate", "max_bytes")


def prepare(model: nn.Module, texts, run: dict) -> SimpleNamespace:
    """``run`` (:func:`sketchlab.linearize`'s keyword arguments) checked and resolved, with what the stages
    read added: ``family``, ``sites``, ``exact`` (a set), ``memory`` (the conversion's memory options),
    ``encoder``, ``sentences``, ``ids``, ``mask``, ``train_idx``, ``held_idx``, ``fitting``, ``fit_plan``,
    ``settings``; refused (naming the argument, the rule and the value) before any work."""
    r = dict(run)
    r["family"] = family = family_of(model)
    r["window"], r["sinks"] = check_layout(r["window"], r["sinks"], r["local"], r["normalize"])
    sites = r["sites"] = attention_sites(model)[1]
    r["exact"] = _check_exact_layers(r["exact_layers"], len(sites), family)  # before any work, by the conversion's rules
    r["memory"] = _check_memory(r["cache"], r["decay"], r["state"], r["beta"], r["window"], r["sinks"], r["local"],
                                r["normalize"], causal=all(site.causal for site in sites))
    _check_far(r["far"], r["window"], r["gate_init"])
    if not isinstance(r["progress"], bool):
        raise TypeError(f"progress must be True or False, got {r['progress']!r}")
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
    for name in ("transfer_steps", "lora_steps"):
        r[name] = check_nonnegative_int(r[name], name)
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
                           r["rank"], r["seed"], r["tied"])[0]
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
