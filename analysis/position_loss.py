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

``--report copy`` writes ``analysis/results/copy_loss.md`` instead: the same losses split by what
each target's n-gram (``--order``, default 2: the bigram an induction head copies) offers earlier
in the sequence (:func:`copy_classes`: a copy the window or a sink sees, a copy only beyond the
window, a prefix seen beyond the window with another continuation, nothing), for all targets and
for those at positions >= 512 and >= 1024: mean loss per class, the share of the teacher's gain over
window + sinks and of each hybrid's excess over the teacher that falls in each class (95% bootstrap
intervals over the sequences), and ``closed`` per class. A hybrid whose deficit is recall (the
MQAR limitation of a fixed-size state) loses most on far copies.

Each ``--hybrid MAP:M:FILE`` converts a copy of the teacher with ``MAP`` at ``m = M`` (window and
sinks as given) exactly as ``linearize_lm.py`` does, then loads the cached transfer from ``FILE``.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from linearize_lm import RESULTS, convert, held_out, load_transferred, log, positive_int  # noqa: E402

from sketchlab._validation import check_nonnegative_int, check_positive_int  # noqa: E402
from sketchlab.convert import token_nll  # noqa: E402
from sketchlab.hf.pretrained import load_pretrained, smollm2_gguf  # noqa: E402
from sketchlab.io.atomic import atomic_write  # noqa: E402


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


COPY_CLASSES = ("near copy", "far copy", "far prefix", "new")


def copy_classes(ids: torch.Tensor, window: int, sinks: int, *, order: int = 2,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """What the context offers each next-token target to copy, and whether the hybrid's exact part sees it.

    Target ``t`` (``1 <= t < T``) is predicted by the query at ``i = t − 1``, whose exact (local)
    keys in the hybrid are ``V(t) = {j : t − window <= j <= t − 1} ∪ {j : j < sinks}`` (§6: local
    ``i − w < j <= i`` plus the sinks); every other ``j < t`` is a far key, seen only through the
    sketch. An *occurrence* of the target's n-gram is a key position ``j`` with ``order − 1 <= j <= t − 1``
    and ``ids[j − order + 1 : j + 1] == ids[t − order + 1 : t + 1]`` (``order = 2``: the bigram
    ``(x_{t−1}, x_t)``; ``j`` is the position of the token to copy, the key an induction head attends
    to). Classes, by their index in :data:`COPY_CLASSES`:

    0. ``near copy``: an occurrence lies in ``V(t)`` (the window or a sink sees it exactly);
    1. ``far copy``: occurrences exist, all far (``sinks <= j < t − window``);
    2. ``far prefix``: no occurrence, but the prefix ``ids[t − order + 1 : t]`` ended a far key's
       prefix (``ids[j − order + 1 : j] ==`` it, ``sinks <= j < t − window``) followed by another token;
    3. ``new``: neither (the n-gram is new and its prefix, if seen at all, only within ``V(t)``;
       also every target ``t < order − 1``, which has no full n-gram).

    Parameters
    ----------
    ids : [N, T] integer tensor, T >= 2; each row its own sequence
    window : int >= 0
        The hybrid's local window ``w`` (0: no local part, every key outside the sinks is far).
    sinks : int >= 0
        Positions ``j < sinks`` always seen exactly.
    order : int >= 2
        n-gram length matched (2: the bigram of the previous and the target token).
    mask : [N, T] (bool or 0/1), optional
        1 = a real token. An n-gram with a padding position never matches and is never matched.

    Returns
    -------
    torch.Tensor [N, T − 1] int64
        Column ``t − 1`` holds target ``t``'s class (aligned with :func:`sketchlab.convert.token_nll`);
        −1 where the target or the position predicting it is padding (``token_nll``'s NaN).
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 2 or ids.is_floating_point() \
            or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an [N, T] integer tensor with T >= 2, got "
                         f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}"
                         f"{' ' + str(ids.dtype) if isinstance(ids, torch.Tensor) else ''}")
    window = check_nonnegative_int(window, "window")
    sinks = check_nonnegative_int(sinks, "sinks")
    order = check_positive_int(order, "order")
    if order < 2:
        raise ValueError(f"order must be >= 2 (a prefix and a target), got {order}")
    if mask is None:
        real = torch.ones(ids.shape, dtype=torch.bool)
    else:
        if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
            raise ValueError(f"mask must be a tensor of ids' shape {tuple(ids.shape)}, got "
                             f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("mask must hold only 0/1 (or bool): 1 = a real token")
        real = mask.to(torch.bool).cpu()
    out = torch.full((ids.shape[0], ids.shape[1] - 1), -1, dtype=torch.int64)
    for n, (row, ok) in enumerate(zip(ids.cpu().tolist(), real.tolist())):
        grams: dict[tuple, list] = {}   # n-gram -> [an occurrence j < sinks?, its last occurrence j]
        prefixes: dict[tuple, int] = {}  # (order − 1)-gram -> first key j >= sinks whose prefix it is
        for t in range(1, len(row)):
            full = t >= order - 1 and all(ok[t - order + 1 : t + 1])
            if ok[t] and ok[t - 1]:
                cls = 3
                if full:
                    gram, far_end = tuple(row[t - order + 1 : t + 1]), t - window  # far: sinks <= j < far_end
                    seen = grams.get(gram)
                    if seen is not None:
                        cls = 0 if seen[0] or seen[1] >= far_end else 1
                    elif prefixes.get(gram[:-1], far_end) < far_end:
                        cls = 2
                out[n, t - 1] = cls
            if full:  # t becomes an occurrence (and a prefix's key) for the targets after it
                gram = tuple(row[t - order + 1 : t + 1])
                seen = grams.setdefault(gram, [False, t])
                seen[0], seen[1] = seen[0] or t < sinks, t
                if t >= sinks:
                    prefixes.setdefault(gram[:-1], t)
    return out


def class_sums(nll: torch.Tensor, classes: torch.Tensor, start: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence and copy class, the sum of ``nll`` [N, T − 1] over the targets at positions
    ``t >= start`` whose class (``classes`` [N, T − 1], from :func:`copy_classes`) is not −1 and whose
    loss is not NaN, and their count: two ``[N, len(COPY_CLASSES)]`` float64 tensors."""
    if nll.shape != classes.shape:
        raise ValueError(f"nll and classes must have one shape, got {tuple(nll.shape)} and {tuple(classes.shape)}")
    start = check_positive_int(start, "start")
    keep = (classes >= 0) & ~torch.isnan(nll)
    keep[:, : start - 1] = False  # column c predicts target c + 1
    onehot = (classes.clamp(min=0).unsqueeze(-1) == torch.arange(len(COPY_CLASSES))) & keep.unsqueeze(-1)  # [N, T-1, C]
    return (torch.where(onehot, nll.double().unsqueeze(-1), 0.0).sum(1), onehot.sum(1).double())


def share_interval(diff: torch.Tensor, *, draws: int = 2000, seed: int = 0):
    """The share of a summed loss difference that falls in each class, with a 95% bootstrap interval.

    ``diff`` [N, C]: per sequence and class, the sum over its targets of one model's loss minus
    another's (e.g. hybrid − teacher). ``share_c = Σ_n diff[n, c] / Σ_{n, c} diff[n, c]``; the
    interval redraws the sequences with replacement ``draws`` times (paired: the same tokens in both
    models). Returns ``(share, lo, hi)``, three lists of length C; NaN where a (re)drawn total is not positive."""
    total = diff.sum()
    share = (diff.sum(0) / total if total > 0 else torch.full((diff.shape[1],), float("nan"), dtype=diff.dtype))
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, diff.shape[0], (draws, diff.shape[0]), generator=g)  # [draws, N]
    d = diff[idx].sum(1)  # [draws, C]
    tot = d.sum(1, keepdim=True)
    shares = torch.where(tot > 0, d / tot, float("nan"))
    q = torch.nanquantile(shares, torch.tensor([0.025, 0.975], dtype=shares.dtype), dim=0)
    return share.tolist(), q[0].tolist(), q[1].tolist()


def transfer_budget(path: Path) -> tuple[int, int, int] | None:
    """``(sequence length, sequences, steps)`` a cache file's name records (``len2048x16_steps400``), or ``None``."""
    found = re.search(r"len(\d+)x(\d+)_steps(\d+)", path.name)
    return (int(found[1]), int(found[2]), int(found[3])) if found else None


def budget_of(path: Path) -> str:
    """The transfer budget a cache file's name records (``len2048x16_steps400`` -> ``2048×16, 400 steps``), or ''."""
    budget = transfer_budget(path)
    return f"{budget[0]}×{budget[1]}, {budget[2]} steps" if budget else ""


def position_report(rows, buckets, n_seq: int) -> list[str]:
    """The loss-by-position tables (markdown lines) of ``rows`` = [(label, nll [N, T − 1])], teacher and
    window + sinks first, hybrids after."""
    sums = [bucket_sums(nll, buckets) for _, nll in rows]
    counts = sums[0][1]  # valid positions per sequence and bucket: the same for every model (the same tokens)
    means = [(s.sum(0) / counts.sum(0)).tolist() for s, _ in sums]  # per bucket, over every sequence
    teacher_b, window_b = means[0], means[1]
    head = "| model | " + " | ".join(f"{lo}–{hi - 1}" for lo, hi in buckets) + " | all |"
    lines = ["Mean next-token loss (nats) by target position (columns: positions in the sequence):", "",
             head, "|---" * (len(buckets) + 2) + "|"]
    lines += [f"| {label} | " + " | ".join(f"{v:.3f}" for v in b) + f" | {float(nll.nanmean()):.3f} |"
              for (label, nll), b in zip(rows, means)]
    lines += ["", "Excess over the teacher (nats; hybrid − teacher) and the share of window + sinks' excess the "
                  "hybrid removes, `closed = (window − hybrid) / (window − teacher)`, per bucket (in brackets: its 95% "
              f"bootstrap interval over the {n_seq} sequences, paired across models; few sequences, so wide):",
              "",
              head.replace(" | all |", " |"), "|---" * (len(buckets) + 1) + "|"]
    for (label, _), b in zip(rows[1:], means[1:]):
        lines.append(f"| {label}: excess | " + " | ".join(f"{x - t:+.3f}" for x, t in zip(b, teacher_b)) + " |")
    t_sums, w_sums = sums[0][0], sums[1][0]
    for (label, _), (h_sums, _), b in zip(rows[2:], sums[2:], means[2:]):
        lo, hi = closed_interval(h_sums, w_sums, t_sums, counts)
        lines.append(f"| {label}: closed | " + " | ".join(
            f"{(w - x) / (w - t):.2f} [{a:.2f}, {z:.2f}]" if w - t > 1e-9 else "–"
            for x, w, t, a, z in zip(b, window_b, teacher_b, lo, hi)) + " |")
    return lines


COPY_RULE = (
    "Each target t (predicted by the query at t − 1) is classed by what its n-gram x[t−n+1..t] (n = 2: the bigram "
    "(x[t−1], x[t]), what an induction head copies) offers in the same sequence before it (`copy_classes`; j = the "
    "position of the earlier n-gram's last token, the key an induction head reads): **near copy**: it occurred "
    "ending at a key the hybrid sees exactly (the window, t − {w} ≤ j ≤ t − 1, or a sink, j < {s}); **far copy**: it "
    "occurred, only at far keys ({s} ≤ j < t − {w}), which only the sketch carries; **far prefix**: it never "
    "occurred, but its prefix x[t−n+1..t−1] did, at a far key, followed by another token; **new**: neither (new "
    "n-gram, prefix unseen or seen only in the window). `share` rows: the part of a summed loss difference that falls "
    "in each class (the teacher's gain = window + sinks − teacher; a hybrid's excess = hybrid − teacher; the `all` "
    "column: that difference per token); `closed = (window − hybrid) / (window − teacher)` within the class (– where "
    "the teacher's gain there is not reliably positive: its share interval reaches 0, so the ratio has no meaning). "
    "Brackets: 95% bootstrap intervals over the sequences (paired across models: the same tokens).")


def _ci(point, lo, hi, fmt="{:.2f}") -> str:
    return "–" if point != point else f"{fmt.format(point)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def copy_report(rows, classes, starts, n_seq: int) -> list[str]:
    """One markdown table per start position of the loss by copy class (:func:`copy_classes`) of
    ``rows`` = [(label, nll [N, T − 1])], teacher and window + sinks first, hybrids after."""
    lines = []
    names = list(COPY_CLASSES)
    for start in starts:
        sums = [class_sums(nll, classes, start) for _, nll in rows]
        counts = sums[0][1]  # [N, C]: the same tokens for every model
        n = counts.sum(0)
        total = float(n.sum())
        lines += [f"Targets at positions t ≥ {start} ({int(total)} tokens):", "",
                  "| | " + " | ".join(names) + " | all |", "|---" * (len(names) + 2) + "|",
                  "| tokens (share) | " + " | ".join(f"{int(c)} ({c / total:.1%})" for c in n.tolist())
                  + f" | {int(total)} |"]
        for (label, _), (s, _) in zip(rows, sums):
            lines.append(f"| mean loss: {label} | " + " | ".join(
                f"{x:.3f}" if c > 0 else "–" for x, c in zip((s.sum(0) / n).tolist(), n.tolist()))
                + f" | {float(s.sum() / total):.3f} |")
        t_sums, w_sums = sums[0][0], sums[1][0]
        gain = w_sums - t_sums  # [N, C]: the teacher's gain over window + sinks
        present = (n > 0).tolist()  # a class without tokens has no share ("–")
        share, lo, hi = share_interval(gain)
        gains = [p and g > 0 for p, g in zip(present, lo)]  # classes where the teacher reliably gains: closed defined
        lines.append(f"| share of the teacher's gain over {rows[1][0]} | "
                     + " | ".join(_ci(*x) if p else "–" for x, p in zip(zip(share, lo, hi), present))
                     + f" | {float(gain.sum() / total):+.3f} nats/token |")
        for (label, _), (h_sums, _) in zip(rows[2:], sums[2:]):
            excess = h_sums - t_sums
            share, lo, hi = share_interval(excess)
            lines.append(f"| share of {label}'s excess over the teacher | "
                         + " | ".join(_ci(*x) if p else "–" for x, p in zip(zip(share, lo, hi), present))
                         + f" | {float(excess.sum() / total):+.3f} nats/token |")
            a, z = closed_interval(h_sums, w_sums, t_sums, counts)
            all_lo, all_hi = closed_interval(h_sums.sum(1, keepdim=True), w_sums.sum(1, keepdim=True),
                                             t_sums.sum(1, keepdim=True), counts.sum(1, keepdim=True))
            point = [(w - h) / (w - t) if ok else float("nan")
                     for h, w, t, ok in zip(h_sums.sum(0).tolist(), w_sums.sum(0).tolist(), t_sums.sum(0).tolist(),
                                            gains)]
            overall = float((w_sums - h_sums).sum() / gain.sum()) if float(gain.sum()) > 0 else float("nan")
            lines.append(f"| {label}: closed | " + " | ".join(_ci(*x) for x in zip(point, a, z))
                         + f" | {_ci(overall, all_lo[0], all_hi[0])} |")
        lines.append("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hybrid", type=hybrid_arg, action="append", required=True, metavar="MAP:M:FILE")
    ap.add_argument("--context", type=positive_int, default=2048)
    ap.add_argument("--eval-tokens", type=positive_int, default=8192, help="held-out tokens (sequences of --context)")
    ap.add_argument("--window", type=positive_int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--report", choices=("position", "copy"), default="position",
                    help="position: loss by position bucket (default out position_loss.md); copy: loss by copy class "
                         "of each target (copy_classes; default out copy_loss.md)")
    ap.add_argument("--order", type=int, nargs="+", default=None, metavar="N",
                    help="--report copy: the n-gram lengths matched, one section each (default 2: the bigram)")
    ap.add_argument("--out", default=None, help="the report (default analysis/results/<report>_loss.md)")
    args = ap.parse_args()
    if args.order is not None and args.report != "copy":
        ap.error("--order applies only to --report copy")
    args.order = args.order or [2]
    if args.context < 2 or args.eval_tokens < args.context or args.sinks < 0 or min(args.order) < 2:
        ap.error(f"--context must be >= 2, --eval-tokens >= --context, --sinks >= 0 and every --order >= 2, got "
                 f"{args.context}, {args.eval_tokens}, {args.sinks} and {args.order}")
    out = args.out or str(RESULTS / f"{args.report}_loss.md")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    teacher, tok = load_pretrained(gguf=smollm2_gguf())
    ids, mask = held_out(tok, args.context, args.eval_tokens)
    rows = []  # (label, token_nll [N, T − 1])

    def measure(label, model):
        t = time.perf_counter()
        rows.append((label, token_nll(model, ids, mask, batch_size=1)))
        log(f"{label}: mean loss {float(rows[-1][1].nanmean()):.4f} ({time.perf_counter() - t:.0f} s)")

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
        budget = budget_of(path)
        measure(f"{name} hybrid w={args.window}+{args.sinks}, m = {m}, stage 1{' (' + budget + ')' if budget else ''} "
                f"(commit {(meta['commit'] or '?')[:7]})", model)
        del model

    data = (f"Held-out plays of `analysis/linearize_lm.py`, {ids.shape[0]} sequences of {args.context} tokens "
            f"({int(mask.sum())} tokens); hybrids: the stage-1 (attention transfer) maps and gates cached by "
            "`linearize_lm.py --cache-dir`.")
    ran = (f"Produced by `python analysis/position_loss.py {' '.join(sys.argv[1:])}` "
           f"({(time.perf_counter() - t0) / 60:.1f} min, {args.threads} thread(s)). ")
    if args.report == "position":
        lines = ["# Where along the context a linearised SmolLM2 loses", "", ran + data, "",
                 *position_report(rows, buckets_of(args.context), ids.shape[0])]
    else:
        lines = ["# What the far context gives: a linearised SmolLM2's loss by copy class", "", ran + data, "",
                 COPY_RULE.format(w=args.window, s=args.sinks), ""]
        starts = [s for s in (1, 512, 1024) if s < args.context]
        for order in args.order:
            lines += [f"## n-gram length {order}" + (" (the bigram of the previous and the target token)"
                                                      if order == 2 else ""), ""]
            lines += copy_report(rows, copy_classes(ids, args.window, args.sinks, order=order, mask=mask),
                                 starts, ids.shape[0])
    with atomic_write(out) as tmp:
        Path(tmp).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
