"""``make demo``: the main job on a shipped Q/K dump.

``python -m sketchlab.demo [--dump data/mqar_softmax_qk.safetensors] [--p 2] [--m 64] [--out out/demo]``

1. Theorem 3.1 on every head of the dump: for a sweep of sketch sizes the tail bound
   ``Σ_{i>m} σ_i²`` beside the squared error the optimal sketch achieves (equal to round-off);
2. the comparison of every sketch against that optimum on the early, middle and last layers
   (:func:`sketchlab.compare`, the paper's Table 3 layout);
3. writes ``OUT/comparison.md``, ``OUT/comparison.json``, ``OUT/optimality.png`` (optimality ratio
   per method) and ``OUT/spectrum.png`` (the singular values of ``A`` per layer, ``m`` marked).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .compare import DEFAULT_METHODS, compare, resolve_scale
from .io import atomic_write, load_qk
from .optimal import max_sketch_size, optimal_sketch
from .plots import plot_optimality_ratios, plot_spectra
from .polynomial import poly_kernel


def theorem31_rows(q: torch.Tensor, k: torch.Tensor, p: int, sizes: list[int]) -> tuple[list[dict], torch.Tensor]:
    """Check Theorem 3.1 for each ``m`` in ``sizes`` on every batch entry of ``q, k [..., n, d]``.

    Returns one row per ``m`` (median over heads of the tail and of the achieved squared error,
    both relative to ``‖A‖_F²``, and the largest relative gap between them) and the singular
    values of ``A`` ``[..., min(n_q, n_k)]``.
    """
    exact = poly_kernel(q.double(), k.double(), p)
    norm2 = (exact**2).sum((-2, -1))
    rows, singular_values = [], None
    for m in sizes:
        best = optimal_sketch(q, k, p, m)
        achieved = ((best.kernel(q, k) - exact) ** 2).sum((-2, -1))
        singular_values = best.singular_values
        rows.append({
            "m": m,
            "tail / ‖A‖²": float((best.tail / norm2).median()),
            "achieved / ‖A‖²": float((achieved / norm2).median()),
            "max rel. gap (achieved vs tail)": float((achieved / best.tail - 1).abs().max()),
        })
    return rows, singular_values


def markdown_table(rows: list[dict]) -> str:
    """Render rows of equal keys as a markdown table (floats in 4 significant digits)."""
    keys = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(row[key]) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sketchlab.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=Path, default=Path("data/mqar_softmax_qk.safetensors"))
    parser.add_argument("--p", type=int, default=2)
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--holdout", type=float, default=0.25)
    parser.add_argument("--out", type=Path, default=Path("out/demo"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # small batched fits: one thread is fastest (see analysis/results/table3.md)

    dump = load_qk(args.dump)
    L, H, n, d = dump.q.shape
    _, factor = resolve_scale("sqrt-d", d)
    q, k = dump.q * factor, dump.k * factor  # explicit scale: qᵀk becomes qᵀk/√d
    print(f"Dump {args.dump}: q, k of shape [L={L}, H={H}, n={n}, d={d}] ({dump.meta.get('source', 'no source')}).")
    print(f"Scale d^-1/4 = {factor:.4g} on q and k; degree p = {args.p}.\n")

    sizes = [s for s in (8, 16, 32, 64, 128) if s <= min(max_sketch_size(n, n, d, args.p), 2 * args.m)]
    rows, spectrum = theorem31_rows(q, k, args.p, sizes)
    print(f"## Theorem 3.1 on all {L * H} heads: the optimal sketch attains the tail bound (median over heads)\n")
    print(markdown_table(rows) + "\n")

    layers = sorted({0, L // 2, L - 1})
    table = compare(dump, p=args.p, m=args.m, methods=DEFAULT_METHODS, layers=layers, seed=args.seed,
                    holdout=args.holdout, scale="sqrt-d")
    print(f"## Every sketch against the optimum (layers {layers}, all heads)\n")
    text = table.to_markdown()
    print(text)

    args.out.mkdir(parents=True, exist_ok=True)
    with atomic_write(args.out / "comparison.md") as tmp:
        tmp.write_text(text, encoding="utf-8")
    with atomic_write(args.out / "comparison.json") as tmp:
        tmp.write_text(table.to_json() + "\n", encoding="utf-8")
    plot_optimality_ratios({args.p: table}, args.out / "optimality.png")
    plot_spectra({f"layer {layer}": spectrum[layer] for layer in layers}, args.m, args.out / "spectrum.png",
                 title=f"Spectrum of A = (QKᵀ/√d)^{args.p} on {args.dump.name}")
    print(f"wrote {', '.join(str(args.out / f) for f in ('comparison.md', 'comparison.json', 'optimality.png', 'spectrum.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
