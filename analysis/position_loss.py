"""Where along the context a linearised SmolLM2 loses: next-token loss by position bucket.

Writes ``analysis/results/position_loss.md``. For held-out Shakespeare (the plays
``analysis/linearize_lm.py`` never trains on) cut into sequences of ``--context`` tokens, the mean
next-token loss (nats) of every position bucket for the teacher, for sliding-window softmax with
sinks alone, and for one or more transferred hybrids read from ``linearize_lm.py``'s
``--cache-dir`` (stage 1: the maps and gates that attention transfer trained). A hybrid whose
excess loss over the teacher grows with the position loses the far context that softmax uses; one
whose excess is flat loses it evenly (the local part). ``closed`` = the share of window + sinks'
excess over the teacher that the hybrid removes in that bucket.

    python analysis/position_loss.py --hybrid psf:64:build/linearize_cache/psf_..._.safetensors \\
        --hybrid psf:128:build/linearize_cache/psf_..._m128_....safetensors

Each ``--hybrid MAP:M:FILE`` converts a copy of the teacher with ``MAP`` at ``m = M`` (window and
sinks as given) exactly as ``linearize_lm.py`` does, then loads the cached transfer from ``FILE``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from linearize_lm import RESULTS, convert, held_out, load_transferred, log, positive_int  # noqa: E402

from sketchlab.convert import token_nll  # noqa: E402
from sketchlab.io.atomic import atomic_write  # noqa: E402
from sketchlab.convert.pretrained import load_pretrained, smollm2_gguf  # noqa: E402


def hybrid_arg(text: str) -> tuple[str, int, Path]:
    parts = text.split(":", 2)
    if len(parts) != 3 or not parts[1].isdigit() or int(parts[1]) < 1:
        raise argparse.ArgumentTypeError(f"--hybrid must be MAP:M:FILE with M a positive integer, got {text!r}")
    path = Path(parts[2])
    if not path.is_file() or not path.with_suffix(".json").is_file():
        raise argparse.ArgumentTypeError(f"--hybrid {text!r}: {path} or its .json is not a file "
                                         "(a transfer cached by analysis/linearize_lm.py --cache-dir)")
    return parts[0], int(parts[1]), path


def buckets_of(context: int) -> list[tuple[int, int]]:
    """Target positions ``[lo, hi)`` in doubling buckets: [1, 64), [64, 128), [128, 256), ..., up to ``context``."""
    if context < 2:
        raise ValueError(f"context must be >= 2 (a target needs a position before it), got {context}")
    edges = [1, min(64, context)]
    while edges[-1] < context:
        edges.append(min(2 * edges[-1], context))
    return list(zip(edges[:-1], edges[1:]))


def bucket_sums(nll: torch.Tensor, buckets) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence and bucket of target positions, the sum of ``nll`` [N, T − 1] over the valid
    (non-NaN) entries and their count: two ``[N, len(buckets)]`` float64 tensors."""
    sums, counts = [], []
    for lo, hi in buckets:
        part = nll[:, lo - 1 : hi - 1]  # column t predicts target position t + 1
        valid = ~torch.isnan(part)
        sums.append(torch.where(valid, part, 0.0).sum(1))
        counts.append(valid.sum(1).double())
    return torch.stack(sums, 1), torch.stack(counts, 1)


def closed_interval(hybrid, window, teacher, counts, *, draws: int = 2000, seed: int = 0):
    """95% bootstrap interval over sequences of ``closed = (window − hybrid) / (window − teacher)`` per
    bucket: the sequences (paired across models: the same tokens) drawn with replacement ``draws`` times.
    ``hybrid``, ``window``, ``teacher``: per-sequence bucket sums ``[N, K]``; ``counts`` ``[N, K]``.
    Returns two lists (2.5% and 97.5% quantiles); NaN where a draw's window excess is not positive."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, counts.shape[0], (draws, counts.shape[0]), generator=g)  # [draws, N]
    c = counts[idx].sum(1)  # [draws, K]
    h, w, t = (x[idx].sum(1) / c for x in (hybrid, window, teacher))
    closed = torch.where(w - t > 0, (w - h) / (w - t), float("nan"))
    q = torch.nanquantile(closed, torch.tensor([0.025, 0.975], dtype=closed.dtype), dim=0)
    return q[0].tolist(), q[1].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hybrid", type=hybrid_arg, action="append", required=True, metavar="MAP:M:FILE")
    ap.add_argument("--context", type=positive_int, default=2048)
    ap.add_argument("--eval-tokens", type=positive_int, default=8192, help="held-out tokens (sequences of --context)")
    ap.add_argument("--window", type=positive_int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "position_loss.md"))
    args = ap.parse_args()
    if args.context < 2 or args.eval_tokens < args.context or args.sinks < 0:
        ap.error(f"--context must be >= 2, --eval-tokens >= --context and --sinks >= 0, got {args.context}, "
                 f"{args.eval_tokens} and {args.sinks}")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    teacher, tok = load_pretrained(gguf=smollm2_gguf())
    ids, mask = held_out(tok, args.context, args.eval_tokens)
    buckets = buckets_of(args.context)
    rows = []  # (label, per-sequence bucket sums [N, K], mean loss over every valid position)
    counts = None  # valid positions per sequence and bucket [N, K]: the same for every model (the same tokens)

    def measure(label, model):
        nonlocal counts
        t = time.perf_counter()
        nll = token_nll(model, ids, mask, batch_size=1)
        sums, counts = bucket_sums(nll, buckets)
        rows.append((label, sums, float(nll[~torch.isnan(nll)].mean())))
        log(f"{label}: mean loss {rows[-1][2]:.4f} ({time.perf_counter() - t:.0f} s)")

    def options(m):  # what linearize_lm.convert reads of its arguments
        return Namespace(gate_init="auto", m=m, sinks=args.sinks, untied=False)

    measure("teacher (softmax)", teacher)
    window_only = copy.deepcopy(teacher)
    convert(window_only, "hedgehog", options(64), args.window, gate_init=40.0)  # sigmoid(40) = 1: far part weight 0
    measure(f"window {args.window} + {args.sinks} sinks alone", window_only)
    del window_only
    for name, m, path in args.hybrid:
        model = copy.deepcopy(teacher)
        sketches = convert(model, name, options(m), args.window)
        meta = load_transferred(sketches, path)
        measure(f"{name} hybrid w={args.window}+{args.sinks}, m = {m}, stage 1 (commit {(meta['commit'] or '?')[:7]})",
                model)
        del model

    means = [(sums.sum(0) / counts.sum(0)).tolist() for _, sums, _ in rows]  # per bucket, over every sequence
    teacher_b, window_b = means[0], means[1]
    head = "| model | " + " | ".join(f"{lo}–{hi - 1}" for lo, hi in buckets) + " | all |"
    lines = [
        "# Where along the context a linearised SmolLM2 loses",
        "",
        f"Produced by `python analysis/position_loss.py {' '.join(sys.argv[1:])}` "
        f"({(time.perf_counter() - t0) / 60:.1f} min, {args.threads} thread(s)). Held-out plays of "
        f"`analysis/linearize_lm.py`, {ids.shape[0]} sequences of {args.context} tokens ({int(mask.sum())} tokens); "
        "hybrids: the stage-1 (attention transfer) maps and gates cached by `linearize_lm.py --cache-dir`.",
        "",
        "Mean next-token loss (nats) by target position (columns: positions in the sequence):",
        "",
        head,
        "|---" * (len(buckets) + 2) + "|",
    ]
    lines += [f"| {label} | " + " | ".join(f"{v:.3f}" for v in b) + f" | {a:.3f} |"
              for (label, _, a), b in zip(rows, means)]
    lines += ["", "Excess over the teacher (nats; hybrid − teacher) and the share of window + sinks' excess the "
                  "hybrid removes, `closed = (window − hybrid) / (window − teacher)`, per bucket (in brackets: its 95% "
              f"bootstrap interval over the {ids.shape[0]} sequences, paired across models; few sequences, so wide):",
              "",
              head.replace(" | all |", " |"), "|---" * (len(buckets) + 1) + "|"]
    for (label, _, _), b in zip(rows[1:], means[1:]):
        lines.append(f"| {label}: excess | " + " | ".join(f"{x - t:+.3f}" for x, t in zip(b, teacher_b)) + " |")
    t_sums, w_sums = rows[0][1], rows[1][1]
    for (label, h_sums, _), b in zip(rows[2:], means[2:]):
        lo, hi = closed_interval(h_sums, w_sums, t_sums, counts)
        lines.append(f"| {label}: closed | " + " | ".join(
            f"{(w - x) / (w - t):.2f} [{a:.2f}, {z:.2f}]" if w - t > 1e-9 else "–"
            for x, w, t, a, z in zip(b, window_b, teacher_b, lo, hi)) + " |")
    with atomic_write(args.out) as tmp:
        Path(tmp).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
