"""Attention error of every sketch on the shipped dump, as attention (not just as a kernel).

For each registered sketch, fitted to all 512 tokens of ``data/mqar_softmax_qk.safetensors``
(p = 2, m = 64, q and k scaled by d^-1/4), the causal attention output through the sketch
(:func:`sketchlab.attention.linear_attention` with the fit's pair of maps, the dump's ``[L, H]`` as ``L·H`` heads)
is compared with exact polynomial attention (:func:`sketchlab.poly_attention`) on the same tokens:
``‖O_sketch − O_exact‖_F / ‖O_exact‖_F`` per layer and head. The dump joins two 256-token
sequences (metadata ``tokens``); no query attends across them (``segments``). Two
normalisations: ``none`` (unnormalised, safe for signed maps) and ``sum`` (divided by the row
sums + 1e-6, only safe for non-negative maps); for ``sum`` the table also counts the rows whose
denominator is ≤ 0 (a signed map's failure mode).

    .venv/bin/python analysis/attention_error.py       # writes analysis/results/attention_error.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sketchlab as sl  # noqa: E402
from sketchlab.attention import AttentionOptions, dump_segments, linear_attention, poly_attention  # noqa: E402
from sketchlab.featuremaps.heads import as_heads, from_heads, pair_features  # noqa: E402
from sketchlab.io import atomic_write  # noqa: E402

METHODS = ("optimal", "llops", "mlp", "psf", "tensorsketch", "based", "elementwise")


def denominators(maps, q, k, segments):
    """Causal row sums Σ_{s≤t} φ_Q(q_t)·φ_K(k_s) within each segment: [L, H, n] (float64)."""
    fq, fk = pair_features(maps, q, k)  # [L, H, n, M], float64
    out, start = [], 0
    for length in segments:
        stop = start + length
        prefix = fk[..., start:stop, :].cumsum(-2)  # [L, H, len, M]
        out.append((fq[..., start:stop, :] * prefix).sum(-1))
        start = stop
    return torch.cat(out, -1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", default=str(ROOT / "data" / "mqar_softmax_qk.safetensors"))
    parser.add_argument("--p", type=int, default=2)
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "analysis" / "results" / "attention_error.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dump = sl.load_qk(args.dump)
    segments = dump_segments(dump)
    d = dump.q.shape[-1]
    factor = d**-0.25
    q, k, v = (dump.q * factor).double(), (dump.k * factor).double(), dump.v.double()  # [L, H, n, d]
    L, H, n, _ = q.shape
    as_att = lambda x: x.transpose(1, 2)  # [L, H, n, ·] -> [L, n, H, ·]: layers on the batch axis  # noqa: E731
    exact = {norm: poly_attention(as_att(q), as_att(k), as_att(v), args.p, normalize=norm, segments=segments)
             for norm in ("none", "sum")}
    results = {}
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        fit = sl.fit_sketch(method, q, k, p=args.p, m=args.m, seed=0)
        seconds = time.perf_counter() - t0
        errs = {}
        with torch.no_grad():
            for norm in ("none", "sum"):
                # signed maps are not self-tensored (non_negative=False): the error of the map as fitted
                options = AttentionOptions(normalize=norm, non_negative=False, backend="torch")
                out, _ = linear_attention(as_heads(q, L * H), as_heads(k, L * H), as_heads(v, L * H), *fit.maps,
                                          options=options, segments=segments)  # [1, n, L·H, Dv]
                diff = from_heads(out, (L, H)).double() - exact[norm].transpose(1, 2)  # [L, H, n, Dv]
                errs[norm] = torch.linalg.matrix_norm(diff) / torch.linalg.matrix_norm(exact[norm].transpose(1, 2))
        bad = int((denominators(fit.maps, q, k, segments) <= 0).sum())
        results[method] = (errs, bad, fit.report.rel_fro, seconds)
        print(f"{method:13s} none {errs['none'].mean():.4g}  sum {errs['sum'].mean():.4g}  "
              f"den<=0 rows {bad}/{L * H * n}  kernel rel_fro {fit.report.rel_fro.mean():.4g}  ({seconds:.1f} s)",
              flush=True)

    lines = [
        "# Attention error of each sketch on the shipped dump",
        "",
        "Command: `" + " ".join([".venv/bin/python", "analysis/attention_error.py", *sys.argv[1:]]) + "`",
        "",
        f"Dump `{Path(args.dump).name}`: L={L}, H={H}, n={n} (segments {segments}), d={d}; p={args.p}, "
        f"m={args.m}, q and k scaled by d^-1/4; every sketch fitted to all n tokens (seed 0, in-sample).",
        "Error = ‖O_sketch − O_exact‖_F / ‖O_exact‖_F of the causal attention output per (layer, head); "
        "O_exact is exact polynomial attention with the same normalisation and segments.",
        "",
        "| method | kernel rel_fro (mean) | attention error, normalize=none: mean | median | max "
        "| normalize=sum: mean | median | max | rows with Σ ≤ 0 (sum) | heads where optimal is lower (none / sum) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    opt = results.get("optimal")
    for method, (errs, bad, rel, _) in results.items():
        cells = []
        for norm in ("none", "sum"):
            e = errs[norm].flatten()
            cells += [f"{e.mean():.4g}", f"{e.median():.4g}", f"{e.max():.4g}"]
        if opt is not None and method != "optimal":
            wins = [int((opt[0][norm] < errs[norm]).sum()) for norm in ("none", "sum")]
            win = f"{wins[0]}/{L * H} / {wins[1]}/{L * H}"
        else:
            win = "—"
        lines.append(f"| {method} | {rel.mean():.4g} | " + " | ".join(cells) + f" | {bad}/{L * H * n} | {win} |")
    if opt is not None:
        lines += ["", "Mean attention error: optimal "
                  + ", ".join(f"{norm} {opt[0][norm].mean():.4g}" for norm in ("none", "sum"))
                  + "; best other sketch "
                  + ", ".join(f"{norm} {min(r[0][norm].mean().item() for m_, r in results.items() if m_ != 'optimal'):.4g}"
                              for norm in ("none", "sum")) + "."]
    lines.append("")
    text = "\n".join(lines)
    with atomic_write(Path(args.out)) as tmp:
        tmp.write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
