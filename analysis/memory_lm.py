"""Long-context memory on a converted SmolLM2: perplexity and its growth, passkey, copy recall, state bytes.

One command (DESIGN §7, issue 34's study). For each model below, on held-out text only:

* perplexity at each ``--contexts`` length on the held-out plays (the text of the conversion's
  training kind) and on the Python language reference (``pydoc_data.topics``, prose and code
  documentation that ships with Python: text of *another kind*), and the growth ratio between
  consecutive contexts beside the teacher's;
* passkey accuracy by length × depth (:func:`sketchlab.evaluate.passkey_accuracy`, greedy decoding
  through ``generate()``, so through each model's own decoding state);
* copy recall by gap (:func:`sketchlab.evaluate.copy_recall`: the second copy's NLL beside the first's
  and the teacher's) on the held-out plays;
* the decoding state's bytes per layer at 32k tokens (measured after a prefill that fills window and
  cache; constant beyond it, a KV cache grows linearly: extrapolated from its per-token bytes).

Models: the teacher; window + sinks alone (the far part's weight 0); the sparse exact cache with the
far part off (training-free); the cache with the far state on; each mechanism with stage-1 transfer
(``--transfer-steps``, on the training plays); and the same with ``--exact`` layers kept exact
(growing memory). Every row's options are in the table. Finished rows are kept in
``analysis/results/memory_lm.json`` and not redone (``--redo NAME`` to redo one), so the study can be
run in parts; ``--render`` rewrites the report from the JSON alone.

    python analysis/memory_lm.py                       # every model (hours on 2 CPU cores)
    python analysis/memory_lm.py --only teacher,window,cache
    python analysis/memory_lm.py --render
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linearize_lm import HELDOUT_PLAYS, TRAIN_PLAYS, log, play_text  # noqa: E402

from sketchlab.convert import convert_attention, lora_finetune, perplexity  # noqa: E402
from sketchlab.convert.cache import SketchStateCache  # noqa: E402
from sketchlab.convert.linearize import attention_transfer, teacher_attention, tokenize_texts  # noqa: E402
from sketchlab.evaluate import copy_recall, passkey_accuracy  # noqa: E402
from sketchlab.hf.pretrained import load_pretrained, smollm2_gguf  # noqa: E402
from sketchlab.io.atomic import atomic_write  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
JSON = RESULTS / "memory_lm.json"
#: Far part off: sigmoid(40) == 1 in float32, the far keys' weight exactly 0.
GATE_OFF = 40.0


def docs_text(part: str) -> str:
    """The Python language reference (``pydoc_data.topics``, shipped with Python), topics in sorted
    order: ``"train"`` the first two thirds, ``"heldout"`` the last third (never trained on)."""
    import pydoc_data.topics as topics

    names = sorted(topics.topics)
    cut = 2 * len(names) // 3
    chosen = names[:cut] if part == "train" else names[cut:]
    return "\n\n".join(topics.topics[n] for n in chosen)


def models(args) -> list[dict]:
    """The study's rows: a name, the conversion options and the training each gets."""
    base = {"attention": args.map, "m": args.m, "window": args.window, "sinks": args.sinks}
    cache = args.cache
    rows = [
        {"name": "teacher", "convert": None},
        {"name": "window", "label": f"window {args.window} + {args.sinks} sinks alone", "convert": base,
         "gate": GATE_OFF},
        {"name": "cache", "label": f"+ cache {cache}, far part off (no training)",
         "convert": {**base, "cache": cache}, "gate": GATE_OFF},
        {"name": "cache-far", "label": f"+ cache {cache}, far {args.map} state (no training)",
         "convert": {**base, "cache": cache}, "gate": 0.0},
        {"name": "hybrid", "label": f"{args.map} hybrid, transferred", "convert": base, "gate": 0.0,
         "transfer": True},
        {"name": "decay", "label": f"{args.map} hybrid + input decay, transferred",
         "convert": {**base, "decay": "input"}, "gate": 0.0, "transfer": True},
        {"name": "delta", "label": f"{args.map} delta-rule state, transferred",
         "convert": {**base, "state": "delta"}, "gate": 0.0, "transfer": True},
        {"name": "cache-delta", "label": f"+ cache {cache}, {args.map} delta-rule state, transferred",
         "convert": {**base, "state": "delta", "cache": cache}, "gate": 0.0, "transfer": True},
        {"name": "cache-hybrid", "label": f"+ cache {cache}, {args.map} hybrid, transferred",
         "convert": {**base, "cache": cache}, "gate": 0.0, "transfer": True},
        {"name": "cache-decay", "label": f"+ cache {cache}, {args.map} hybrid + input decay, transferred",
         "convert": {**base, "cache": cache, "decay": "input"}, "gate": 0.0, "transfer": True},
        {"name": "cache-decay-lora", "label": f"+ cache {cache}, {args.map} hybrid + input decay, transferred + "
         f"LoRA {args.lora_steps} steps", "convert": {**base, "cache": cache, "decay": "input"}, "gate": 0.0,
         "transfer": True, "lora": True},
    ]
    if args.train_len != 1024:  # a transfer at another length is another row, beside the 1024-token one
        rows = [{**r, "name": f"{r['name']}/{args.train_len}", "label": r["label"] + f" on {args.train_len}-token text"}
                if r.get("transfer") else r for r in rows]
    if args.exact:
        exact = [int(x) for x in args.exact.split(",")]
        for r in list(rows[2:]):
            rows.append({**r, "name": r["name"] + "+exact", "label": r["label"] + f" + exact layers {exact}",
                         "convert": {**r["convert"], "exact_layers": exact}})
    return rows


def state_bytes(model, tokens: int = 600) -> dict:
    """Decoding state per layer after ``tokens`` tokens and at 32k: flat states as measured, a KV
    cache (exact layers, the teacher) extrapolated from its bytes per token."""
    from transformers import DynamicCache

    ids = torch.randint(100, 20000, (1, tokens), generator=torch.Generator().manual_seed(0))
    converted = getattr(model.config, "sketchlab", None) is not None
    cache = SketchStateCache(model.config.num_hidden_layers) if converted else DynamicCache()
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    per_layer = []
    for layer in cache.layers:
        if converted:
            state = layer.state
            grows = hasattr(state, "mask") and hasattr(state, "k")  # an exact layer's KVState
            nbytes = state.nbytes
        else:
            grows, nbytes = True, layer.keys.numel() * layer.keys.element_size() * 2
        per_layer.append(nbytes * 32768 / tokens if grows else nbytes)
    return {"mean_32k": sum(per_layer) / len(per_layer), "max_32k": max(per_layer), "layers": per_layer}


def measure(model, tok, evals, copy_ids, args) -> dict:
    row = {}
    t = time.perf_counter()
    row["ppl"] = {kind: {str(c): perplexity(model, ids, mask, batch_size=1) for c, (ids, mask) in by_ctx.items()}
                  for kind, by_ctx in evals.items()}
    log(f"  perplexity {row['ppl']} ({time.perf_counter() - t:.0f} s)")
    t = time.perf_counter()
    pk = passkey_accuracy(model, tok, lengths=args.passkey_lengths, depths=args.depths, n=args.n, seed=0)
    row["passkey"] = {f"{length}@{depth}": rate for (length, depth), rate in pk.rate.items()}
    row["passkey_overall"] = pk.overall
    row["passkey_by_length"] = {str(length): sum(pk.rate[(length, d)] for d in args.depths) / len(args.depths)
                                for length in args.passkey_lengths}
    log(f"  passkey {row['passkey_by_length']} ({time.perf_counter() - t:.0f} s)")
    t = time.perf_counter()
    cr = copy_recall(model, copy_ids, gaps=args.gaps, passage=128, n=args.copy_n, seed=0, batch_size=1)
    row["copy"] = {str(g): {"first": cr.first[g], "second": cr.second[g]} for g in args.gaps}
    log(f"  copy {row['copy']} ({time.perf_counter() - t:.0f} s)")
    row["state"] = state_bytes(model)
    return row


def build(teacher, spec, recorded, lora_text, args):
    model = copy.deepcopy(teacher)
    sketches = convert_attention(model, **spec["convert"], gate_init=spec.get("gate", 0.0))
    if spec.get("transfer"):
        ids, mask, train_idx, layers = recorded()
        keep = [i for i in range(len(layers)) if i not in set(spec["convert"].get("exact_layers", []))]
        t = time.perf_counter()
        attention_transfer(sketches, [layers[i] for i in keep], mask, train_idx, steps=args.transfer_steps,
                           lr=args.transfer_lr, batch_size=1)
        log(f"  transfer {args.transfer_steps} steps x {len(sketches)} layers in {time.perf_counter() - t:.0f} s")
    if spec.get("lora"):
        ids, mask = lora_text()
        t = time.perf_counter()
        model, losses = lora_finetune(model, ids, mask, torch.arange(ids.shape[0]), steps=args.lora_steps,
                                      lr=args.lora_lr, batch_size=1)
        log(f"  LoRA {args.lora_steps} steps in {time.perf_counter() - t:.0f} s (loss {losses[0]:.3f} -> {losses[-1]:.3f})")
    return model


def _commands(data: dict) -> list[str]:
    """The commands that made the rows, in row order (rows from before rows kept theirs: the meta's one)."""
    made = [row.get("command", data["meta"].get("command")) for row in data["rows"].values()]
    return [c for i, c in enumerate(made) if c and c not in made[:i]]


def render(data: dict) -> str:
    meta = data["meta"]
    rows = data["rows"]
    ctxs = meta["contexts"]
    lines = ["# Long-context memory on a converted SmolLM2-135M", "",
             f"Produced by `{'`, `'.join(_commands(data))}` ({meta['platform']}); rows finished at different times are kept in "
             "`memory_lm.json` and rendered together. Held-out text only: perplexity on the held-out plays "
             f"({', '.join(HELDOUT_PLAYS)}) and on the last third of the Python language reference "
             "(`pydoc_data.topics`, text of another kind than the plays the transfer sees); passkey by "
             "`sketchlab.evaluate.passkey_accuracy` (greedy, through `generate()`), copy recall by "
             "`sketchlab.evaluate.copy_recall` (128-token passages of the held-out plays).", "",
             f"Settings: {meta['settings']}", ""]
    head = ["model", "exact keys/layer"] + [f"plays ppl@{c}" for c in ctxs] + [f"×{ctxs[i]}→{ctxs[i + 1]}"
                                                                               for i in range(len(ctxs) - 1)]
    head += [f"docs ppl@{c}" for c in ctxs] + [f"passkey@{n}" for n in meta["passkey_lengths"]]
    head += [f"copy 2nd@{g} (1st)" for g in meta["gaps"]] + ["state KiB/layer @32k (max)"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        p, d = r["ppl"]["plays"], r["ppl"]["docs"]
        cells = [r["label"], str(r["exact_keys"])]
        cells += [f"{p[str(c)]:.2f}" for c in ctxs]
        cells += [f"×{p[str(ctxs[i + 1])] / p[str(ctxs[i])]:.3f}" for i in range(len(ctxs) - 1)]
        cells += [f"{d[str(c)]:.2f}" for c in ctxs]
        cells += [f"{r['passkey_by_length'][str(n)]:.2f}" for n in meta["passkey_lengths"]]
        cells += [f"{r['copy'][str(g)]['second']:.2f} ({r['copy'][str(g)]['first']:.2f})" for g in meta["gaps"]]
        cells.append(f"{r['state']['mean_32k'] / 1024:.0f} ({r['state']['max_32k'] / 1024:.0f})")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Passkey by length × depth:", "", "| model | " + " | ".join(
        f"{n}@{dp}" for n in meta["passkey_lengths"] for dp in meta["depths"]) + " |",
        "|---|" + "---:|" * (len(meta["passkey_lengths"]) * len(meta["depths"]))]
    for r in rows.values():
        lines.append(f"| {r['label']} | " + " | ".join(f"{r['passkey'][f'{n}@{dp}']:.2f}"
                                                        for n in meta["passkey_lengths"] for dp in meta["depths"]) + " |")
    lines += ["", data.get("reading", "")]
    return "\n".join(lines).rstrip() + "\n"


def plot(data: dict, path: Path) -> None:
    """Perplexity against context (held-out plays, dashed: the Python reference) and the second copy's
    NLL against the gap, one line per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sketchlab.plots import save_figure

    meta, rows = data["meta"], data["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 6.5))
    colors = plt.get_cmap("tab20").colors
    ruined = 100.0  # rows above this perplexity (an untrained far state) are named in the legend, off the axes
    for i, r in enumerate(rows.values()):
        ctx, color = meta["contexts"], colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20]
        plays = [r["ppl"]["plays"][str(c)] for c in ctx]
        label = r["label"] + (f" (off the axes: plays {plays[0]:.0f}+)" if max(plays) > ruined else "")
        a.plot(ctx, plays, marker="o", label=label, color=color)
        a.plot(ctx, [r["ppl"]["docs"][str(c)] for c in ctx], marker="s", ls="--", color=color)
        b.plot(meta["gaps"], [r["copy"][str(g)]["second"] for g in meta["gaps"]], marker="o", color=color)
    a.set(xlabel="context (tokens)", ylabel="perplexity", yscale="log", ylim=(8, 70),
          title="held-out perplexity (solid: plays, dashed: Python reference)")
    b.set(xlabel="gap (tokens)", ylabel="NLL of the second copy (nats/token)", title="copy recall")
    fig.legend(*a.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.subplots_adjust(bottom=0.33)
    save_figure(fig, path)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated row names (default: every row)")
    ap.add_argument("--redo", default="", help="comma-separated row names to recompute")
    ap.add_argument("--render", action="store_true", help="rewrite the report from the JSON only")
    ap.add_argument("--restate", action="store_true",
                    help="recompute every stored row's decoding-state bytes (a shape, not a trained value: the "
                         "conversion alone), then render")
    ap.add_argument("--map", default="hedgehog")
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--cache", type=int, default=188, help="cached far keys (window + sinks + cache = 256)")
    ap.add_argument("--exact", default="", help="layers kept exact in the +exact rows (e.g. 18,20)")
    ap.add_argument("--contexts", default="1024,2048")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--passkey-lengths", default="1024,2048")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--n", type=int, default=2, help="passkey prompts per length × depth")
    ap.add_argument("--gaps", default="256,1024")
    ap.add_argument("--copy-n", type=int, default=2)
    ap.add_argument("--train-seqs", type=int, default=4, help="transfer: sequences of the training plays")
    ap.add_argument("--train-len", type=int, default=1024)
    ap.add_argument("--transfer-steps", type=int, default=60)
    ap.add_argument("--transfer-lr", type=float, default=1e-2)
    ap.add_argument("--lora-steps", type=int, default=30, help="LoRA steps of the +lora rows")
    ap.add_argument("--lora-lr", type=float, default=1e-3)
    ap.add_argument("--lora-len", type=int, default=2048, help="LoRA: tokens per training sequence")
    ap.add_argument("--lora-seqs", type=int, default=8, help="LoRA: sequences of the training plays")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.passkey_lengths = tuple(int(x) for x in args.passkey_lengths.split(","))
    args.depths = tuple(float(x) for x in args.depths.split(","))
    args.gaps = tuple(int(x) for x in args.gaps.split(","))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python analysis/memory_lm.py " + " ".join(sys.argv[1:] if argv is None else argv)
    data = json.loads(JSON.read_text()) if JSON.is_file() else {"rows": {}}
    if args.restate:
        teacher, _ = load_pretrained(gguf=smollm2_gguf())
        for name, row in data["rows"].items():
            model = teacher if not row["options"] else copy.deepcopy(teacher)
            if row["options"]:
                convert_attention(model, **row["options"])
            row["state"] = state_bytes(model)
            log(f"{name}: state {row['state']['mean_32k'] / 1024:.0f} KiB/layer (max {row['state']['max_32k'] / 1024:.0f})")
        with atomic_write(JSON) as tmp:
            tmp.write_text(json.dumps(data, indent=1) + "\n")
    elif not args.render:
        torch.set_num_threads(args.threads)
        teacher, tok = load_pretrained(gguf=smollm2_gguf())
        teacher.eval()
        evals = {"plays": {}, "docs": {}}
        plays = "\n".join(play_text(p) for p in HELDOUT_PLAYS)
        docs = docs_text("heldout")
        for c in args.contexts:
            evals["plays"][c] = tokenize_texts(plays, tok, seq_len=c, max_tokens=args.eval_tokens)
            evals["docs"][c] = tokenize_texts(docs, tok, seq_len=c, max_tokens=args.eval_tokens)
        copy_ids = torch.tensor(tok(plays)["input_ids"][-(max(args.gaps) * 4 + 4096):])  # the plays' end
        cached = {}

        def recorded():
            if not cached:
                text = "\n".join(play_text(p) for p in TRAIN_PLAYS)
                ids, mask = tokenize_texts(text, tok, seq_len=args.train_len,
                                           max_tokens=args.train_seqs * args.train_len)
                t = time.perf_counter()
                cached["v"] = (ids, mask, torch.arange(ids.shape[0]), teacher_attention(teacher, ids, mask, batch_size=1))
                log(f"teacher attention recorded on {int(mask.sum())} tokens in {time.perf_counter() - t:.0f} s")
            return cached["v"]

        def lora_text():  # the LoRA stage's sequences of the training plays
            text = "\n".join(play_text(p) for p in TRAIN_PLAYS)
            return tokenize_texts(text, tok, seq_len=args.lora_len, max_tokens=args.lora_seqs * args.lora_len)

        only = None if args.only is None else set(args.only.split(","))
        redo = set(filter(None, args.redo.split(",")))
        data["meta"] = {"command": command, "contexts": args.contexts, "passkey_lengths": list(args.passkey_lengths),
                        "depths": list(args.depths), "gaps": list(args.gaps),
                        "platform": f"{platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)",
                        "settings": f"map {args.map} m = {args.m}, window {args.window} + {args.sinks} sinks, "
                                    f"cache {args.cache}; passkey n = {args.n} per cell; copy n = {args.copy_n}; "
                                    f"transfer {args.transfer_steps} steps per layer on {args.train_seqs} × "
                                    f"{args.train_len} tokens of the training plays ({', '.join(TRAIN_PLAYS)}), "
                                    f"lr {args.transfer_lr}; perplexity on {args.eval_tokens} tokens per context",
                        **data.get("meta", {})}  # the first run's words stay (each row keeps its command and transfer)
        for spec in models(args):
            name = spec["name"]
            if (only is not None and name not in only) or (name in data["rows"] and name not in redo):
                continue
            log(f"{name}: building")
            t = time.perf_counter()
            model = teacher if spec["convert"] is None else build(teacher, spec, recorded, lora_text, args)
            row = measure(model, tok, evals, copy_ids, args)
            conv = spec["convert"] or {}
            row["label"] = spec.get("label", name)
            row["exact_keys"] = ("all" if spec["convert"] is None else
                                 conv["window"] + conv["sinks"] + conv.get("cache", 0))
            row["options"] = conv
            row["minutes"] = (time.perf_counter() - t) / 60
            row["command"] = command
            if spec.get("transfer"):
                row["transfer"] = (f"{args.transfer_steps} steps per layer on {args.train_seqs} × {args.train_len} "
                                   f"tokens, lr {args.transfer_lr}")
            if spec.get("lora"):
                row["lora"] = (f"{args.lora_steps} steps (rank 8, lr {args.lora_lr}) on {args.lora_seqs} × "
                               f"{args.lora_len} tokens of the training plays")
            if JSON.is_file():  # rows another invocation finished meanwhile (the study may run in parts at once)
                data["rows"] = {**json.loads(JSON.read_text())["rows"], **data["rows"]}
            data["rows"][name] = row
            with atomic_write(JSON) as tmp:
                tmp.write_text(json.dumps(data, indent=1) + "\n")
            log(f"{name}: done in {row['minutes']:.1f} min")
    with atomic_write(RESULTS / "memory_lm.md") as tmp:
        tmp.write_text(render(data), encoding="utf-8")
    plot(data, RESULTS / "memory_lm.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
