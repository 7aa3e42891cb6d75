"""What it takes to recall beyond the window: a linearised SmolLM2 with a few layers kept exact.

``copy_loss.md`` (``position_loss.py --report copy``) places the hybrid's long-context deficit on
recall: at positions >= 1024 the targets whose bigram last occurred beyond the window are ~21 % of
the tokens but ~69 % of the transferred hybrid's excess loss over the teacher. A fixed-size state
recalls poorly (the MQAR limitation); hybrid architectures keep a few full-attention layers for
that. This script measures how few suffice here, without retraining anything:

1. Load the teacher and one stage-1 hybrid cached by ``linearize_lm.py --cache-dir`` (maps and
   gates of every layer, each transferred on the teacher's inputs, so layers are independent).
2. Score each layer on held-back *training-play* sequences (never the held-out plays): the mean
   next-token loss of the hybrid with that one layer made exact (the teacher's softmax attention),
   against the hybrid with none.
3. Keep the ``k`` best-scoring layers exact for each ``--k``, and measure held-out perplexity at
   each context, the fraction of the log-perplexity gap closed (window + sinks alone -> teacher) and
   the perplexity ratio between consecutive contexts beside the teacher's (issue 18's growth rule).

Writes ``analysis/results/exact_layers.md``::

    python analysis/exact_layers.py --hybrid psf:64:build/linearize_cache/<stem>.safetensors
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linearize_lm import RESULTS, closure, convert, held_out, load_transferred, log, positive_int, training_data  # noqa: E402
from position_loss import budget_of, hybrid_arg, transfer_budget  # noqa: E402

from sketchlab.attention import softmax_attention  # noqa: E402
from sketchlab.convert import perplexity, token_nll  # noqa: E402
from sketchlab.hf.pretrained import load_pretrained, smollm2_gguf  # noqa: E402
from sketchlab.io.atomic import atomic_write  # noqa: E402


def k_list(text: str) -> list[int]:
    """``--k``: comma-separated non-negative layer counts, increasing (``0`` = the hybrid as transferred)."""
    try:
        ks = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k must be comma-separated integers, got {text!r}") from None
    if any(k < 0 for k in ks) or ks != sorted(set(ks)):
        raise argparse.ArgumentTypeError(f"--k must be distinct non-negative integers in increasing order, "
                                         f"got {text!r}")
    return ks


def rank_layers(base: float, single: list[float]) -> list[int]:
    """Layers by the loss they remove when made exact alone (``base − single[l]``), largest first;
    ties keep layer order."""
    gains = [base - s for s in single]
    return sorted(range(len(single)), key=lambda layer: (-gains[layer], layer))


def softmax_forward(q, k, v, *, causal: bool, scaling: float | None = None, key_padding_mask=None,
                    initial_state=None, output_final_state: bool = False):
    """:func:`sketchlab.attention.softmax_attention` behind
    :class:`~sketchlab.convert.sketched.SketchedAttention`'s call signature: what a layer kept exact
    computes, the teacher's attention (the hybrid's ``window >= T`` is the same function, but its banded
    path holds ``T × (w + C)`` logits per block, over the memory budget at ``w = T = 2048``)."""
    if initial_state is not None or output_final_state:
        raise ValueError("an exact layer carries no recurrent state: measure it with full forward passes")
    return softmax_attention(q, k, v, causal=causal, scale=scaling, key_padding_mask=key_padding_mask)


def set_exact(sketches, layers) -> None:
    """Run ``layers`` (indices into ``sketches``) with exact softmax attention, every other layer with its
    own sketched attention."""
    for i, s in enumerate(sketches):
        if i in layers:
            s.forward = functools.partial(softmax_forward, causal=s.causal)
        else:
            s.__dict__.pop("forward", None)  # the class's forward again


def transfer_data(path: Path) -> tuple[int, int]:
    """The training sequences ``(length, count)`` a cached transfer's name records (``len2048x16``): the
    layers are scored on that run's held-back quarter, which its transfer never saw."""
    budget = transfer_budget(path)
    if budget is None:
        raise ValueError(f"{path}: the name records no training data (`_len<T>x<N>_steps<S>`, as linearize_lm.py "
                         "--cache-dir writes it), so the held-back sequences cannot be told apart")
    return budget[0], budget[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hybrid", type=hybrid_arg, required=True, metavar="MAP:M:FILE",
                    help="a stage-1 transfer cached by linearize_lm.py --cache-dir")
    ap.add_argument("--contexts", default="512,1024,2048")
    ap.add_argument("--eval-tokens", type=positive_int, default=4096, help="held-out tokens per context")
    ap.add_argument("--select-seqs", type=positive_int, default=2,
                    help="held-back training-play sequences (the transfer's own held-back quarter) scoring layers")
    ap.add_argument("--k", type=k_list, default=k_list("0,1,2,3,4"), help="numbers of exact layers measured")
    ap.add_argument("--window", type=positive_int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "exact_layers.md"))
    args = ap.parse_args()
    try:
        contexts = sorted({int(c) for c in args.contexts.split(",")})
    except ValueError:
        ap.error(f"--contexts must be comma-separated integers, got {args.contexts!r}")
    if contexts[0] < 2 or args.sinks < 0:
        ap.error(f"--contexts must be >= 2 and --sinks >= 0, got {args.contexts} and {args.sinks}")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    name, m, path = args.hybrid
    teacher, tok = load_pretrained(gguf=smollm2_gguf())
    n_layers = teacher.config.num_hidden_layers
    if args.k[-1] > n_layers:
        ap.error(f"--k asks for {args.k[-1]} exact layers; the model has {n_layers}")
    evals = {c: held_out(tok, c, args.eval_tokens) for c in contexts}
    select_len, train_seqs = transfer_data(path)
    ids, mask, _, held = training_data(Namespace(train_len=select_len, train_seqs=train_seqs), tok)
    if args.select_seqs > len(held):
        ap.error(f"--select-seqs {args.select_seqs}: the transfer held back only {len(held)} sequences")
    sel_ids, sel_mask = ids[held[: args.select_seqs]], mask[held[: args.select_seqs]]

    def ppl(model, label):
        t = time.perf_counter()
        row = {c: perplexity(model, *evals[c], batch_size=1) for c in contexts}
        log(f"{label}: " + ", ".join(f"ppl@{c} {v:.2f}" for c, v in row.items())
            + f" ({time.perf_counter() - t:.0f} s)")
        return row

    options = Namespace(gate_init="auto", m=m, sinks=args.sinks, untied=False)
    top = ppl(teacher, "teacher (softmax)")
    window_only = copy.deepcopy(teacher)
    convert(window_only, "hedgehog", Namespace(**{**vars(options), "m": 64}), args.window, gate_init=40.0)
    floor = ppl(window_only, f"window {args.window} + {args.sinks} sinks alone")
    del window_only
    model = teacher  # converted in place: the teacher's rows are measured
    sketches = convert(model, name, options, args.window)
    meta = load_transferred(sketches, path)

    def select_loss(layers) -> float:
        set_exact(sketches, layers)
        return float(token_nll(model, sel_ids, sel_mask, batch_size=1).nanmean())

    t = time.perf_counter()
    base = select_loss(set())
    single = [select_loss({layer}) for layer in range(n_layers)]
    order = rank_layers(base, single)
    log(f"layer scores ({time.perf_counter() - t:.0f} s): base {base:.4f}; best "
        + ", ".join(f"{layer}: {base - single[layer]:+.4f}" for layer in order[:6]))
    rows = []
    for k in args.k:
        layers = set(order[:k])
        set_exact(sketches, layers)
        rows.append((k, sorted(layers), ppl(model, f"{k} exact layer(s) {sorted(layers)}")))

    budget = budget_of(path)
    label = f"{name} hybrid w={args.window}+{args.sinks}, m = {m}, stage 1{' (' + budget + ')' if budget else ''}"
    lines = [
        "# A linearised SmolLM2 with a few layers kept exact: how much of the long-context recall they restore", "",
        f"Produced by `python analysis/exact_layers.py {' '.join(sys.argv[1:])}` "
        f"({(time.perf_counter() - t0) / 60:.1f} min, {args.threads} thread(s)). Hybrid: {label}, maps and gates "
        f"read from `{path}` (commit {(meta['commit'] or '?')[:7]}); no LoRA. A layer made exact runs the teacher's "
        "softmax attention (`sketchlab.attention.softmax_attention`: the hybrid with a window of the whole context is the same function); "
        "decoding, its state would grow with the context like a KV cache, the other layers' stays constant.", "",
        f"Layer scores: the mean next-token loss of {args.select_seqs} held-back training-play sequences of "
        f"{select_len} tokens (the transfer's held-back quarter, never transferred on; not the held-out plays) "
        "with one layer exact, against "
        f"{base:.4f} with none; layers ranked by that gain, the best `k` kept exact. Perplexity on the held-out "
        f"plays as in `linearize_lm.md` ({args.eval_tokens} tokens per context).", "",
        "| layer | " + " | ".join(str(layer) for layer in order) + " |",
        "|---|" + "---:|" * n_layers,
        "| loss removed (nats/token) | " + " | ".join(f"{base - single[layer]:.4f}" for layer in order) + " |", "",
        "| model | exact layers | " + " | ".join(f"ppl @ {c}" for c in contexts) + " | "
        + " | ".join(f"closed @ {c}" for c in contexts) + " | "
        + " | ".join(f"ratio {a}→{b}" for a, b in zip(contexts, contexts[1:])) + " |",
        "|---|---|" + "---:|" * (3 * len(contexts) - 1),
    ]

    def row(title, layers, ppls, closed=True):
        cells = [f"{ppls[c]:.2f}" for c in contexts]
        cells += [f"{closure(ppls[c], floor[c], top[c]):.2f}" if closed else "" for c in contexts]
        cells += [f"×{ppls[b] / ppls[a]:.3f}" for a, b in zip(contexts, contexts[1:])]
        return f"| {title} | {layers} | " + " | ".join(cells) + " |"

    lines += [row("teacher (softmax)", "all", top, closed=False),
              row(f"window {args.window} + {args.sinks} sinks alone", "none", floor, closed=False)]
    lines += [row(label + (f" + {k} exact" if k else ""), ", ".join(map(str, layers)) or "none", ppls)
              for k, layers, ppls in rows]
    lines += ["", "Growth rule (issue 18): a row's ratio between consecutive contexts no larger than the teacher's "
              "(perplexity falls with context at least as fast). " + "; ".join(
                  f"{k} exact: " + ", ".join(
                      f"{a}→{b} {'met' if ppls[b] / ppls[a] <= top[b] / top[a] else 'not met'}"
                      for a, b in zip(contexts, contexts[1:])) for k, _, ppls in rows) + "."]
    with atomic_write(args.out) as tmp:
        Path(tmp).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
