"""Table 3 of the LLoPS paper on our captured Q/K: every sketch next to the Theorem 3.1 optimum.

Runs :func:`sketchlab.compare.compare` on the shipped MQAR dump for p = 2 and p = 3, m = 64, on the
first, middle and last captured layers (the paper: layers 0, 8, 15), all heads, and writes

* ``analysis/results/table3.md``: both tables (rel_mae, optimality ratio, held-out versions, sizes),
  the median over heads of the per-head rel_mae ratios MLP÷LLoPS and PSF÷LLoPS next to the paper's
  (2.5× and 13×) and the targets (≥ 2 and ≥ 10), and the parameter counts;
* ``analysis/results/table3.png``: median optimality ratio per method (log scale), one bar per p.

Usage: ``python analysis/table3.py [--dump data/mqar_softmax_qk.safetensors] [--m 64]``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import sketchlab
from sketchlab.compare import compare

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("optimal", "llops", "mlp", "psf", "tensorsketch", "based")
#: The paper's Table 3 averages (relative mean absolute error).
PAPER = {2: {"psf": 0.293, "mlp": 0.054, "llops": 0.022}, 3: {"psf": 0.741, "mlp": 0.105, "llops": 0.038}}
TARGETS = {"mlp": 2.0, "psf": 10.0}


@dataclass(frozen=True)
class Config:
    dump: Path
    m: int
    degrees: tuple[int, ...]
    layers: tuple[int, ...] | None
    seed: int
    holdout: float
    scale: str
    out: Path
    threads: int


def _parse(argv) -> Config:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", type=Path, default=ROOT / "data" / "mqar_softmax_qk.safetensors")
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--degrees", default="2,3")
    ap.add_argument("--layers", default=None, help="comma-separated layer positions (default: first, middle, last)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--holdout", type=float, default=0.25)
    ap.add_argument("--scale", default="sqrt-d")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: these small batched fits are overhead-bound, and on a "
                    "shared 2-core machine 2 threads measured ~10x slower per MLP step than 1)")
    ap.add_argument("--out", type=Path, default=ROOT / "analysis" / "results" / "table3",
                    help="output path without extension (.md and .png are written)")
    a = ap.parse_args(argv)
    layers = None if a.layers is None else tuple(int(v) for v in a.layers.split(","))
    return Config(a.dump, a.m, tuple(int(v) for v in a.degrees.split(",")), layers, a.seed, a.holdout, a.scale, a.out,
                  a.threads)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _plot(tables: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / len(tables)
    for i, (p, table) in enumerate(tables.items()):
        ratios = [statistics.median(table.values(m, "optimality_ratio")) for m in table.methods]
        xs = [j + (i - (len(tables) - 1) / 2) * width for j in range(len(table.methods))]
        bars = ax.bar(xs, ratios, width, label=f"p = {p}")
        for x, r in zip(xs, ratios):
            ax.text(x, r * 1.08, f"{r:.3g}", ha="center", va="bottom", fontsize=7)
        methods = table.methods
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(methods)), methods)
    ax.set_ylabel("‖Â − A‖_F / √tail  (median over heads)")
    ax.set_title(f"Optimality ratio per sketch (1 = Theorem 3.1 optimum), m = {table.m}")
    ax.legend()
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv=None) -> int:
    cfg = _parse(argv)
    torch.set_num_threads(cfg.threads)
    from sketchlab.io import load_qk

    dump = load_qk(cfg.dump)
    n_layers = dump.q.shape[0]
    layers = cfg.layers or tuple(sorted({0, n_layers // 2, n_layers - 1}))
    tables, seconds = {}, {}
    for p in cfg.degrees:
        start = time.perf_counter()
        tables[p] = compare(dump, p=p, m=cfg.m, methods=METHODS, layers=layers, seed=cfg.seed,
                            holdout=cfg.holdout, scale=cfg.scale)
        seconds[p] = time.perf_counter() - start

    # PolySketchFormer without self-tensoring (r = m, signed kernel) for even p, as a second reference
    plain = {}
    for p in cfg.degrees:
        if p % 2 == 0:
            plain[p] = compare(dump, p=p, m=cfg.m, methods=["psf"], layers=layers, seed=cfg.seed,
                               holdout=cfg.holdout, scale=cfg.scale, options={"psf": {"non_negative": False}})

    # the MLP with 4x the Adam budget: how much of its gap to LLoPS is under-training?
    from sketchlab.sketches._train import DEFAULT_STEPS

    long_mlp = {p: compare(dump, p=p, m=cfg.m, methods=["mlp"], layers=layers, seed=cfg.seed, holdout=cfg.holdout,
                           scale=cfg.scale, options={"mlp": {"steps": 4 * DEFAULT_STEPS}}) for p in cfg.degrees}

    L, H, n, d = dump.q.shape
    lines = [
        "# Table 3: sketch error on captured Q/K, against the Theorem 3.1 optimum",
        "",
        f"Generated by `python analysis/table3.py` (sketchlab {sketchlab.__version__}, torch {torch.__version__}, "
        f"{platform.machine()}, {torch.get_num_threads()} threads). Dump `{cfg.dump.relative_to(ROOT) if cfg.dump.is_relative_to(ROOT) else cfg.dump}`: "
        f"q, k of shape [L={L}, H={H}, n={n}, d={d}]; metadata "
        + ", ".join(f"{key}: {dump.meta[key]}" for key in ("source", "captured", "scale", "heldout_accuracy")
                    if key in dump.meta) + ".",
        "",
        "Metric definitions (ours where the paper's appendix is unavailable): rel_mae = Σ|Â−A|/Σ|A|; "
        "optimality ratio = ‖Â−A‖_F/√(Σ_{i>m} σ_i(A)²). Fits use the fitting tokens; held-out rows use the "
        f"{cfg.holdout:g} of tokens left out (same split for every method). Cells are means over heads, "
        "like the paper's per-layer numbers; the ratios below are medians over (layer, head) of per-head ratios.",
        "",
        f"Held-out rows: each head's maps are fitted on {n - math.ceil(cfg.holdout * n)} tokens with m = {cfg.m} "
        "features and thousands of parameters, and measured on the rest; the gap between in-sample and "
        "held-out error is overfitting to this short dump, and is part of the result.",
        "",
    ]
    lines += ["## Headline ratios (rel_mae, median over heads of the per-head ratio)", "",
              "| p | MLP ÷ LLoPS | target | paper | PSF ÷ LLoPS | target | paper | MLP ÷ LLoPS held-out | PSF ÷ LLoPS held-out |",
              "|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for p, t in tables.items():
        mlp_r, psf_r = t.ratio("mlp", "llops"), t.ratio("psf", "llops")
        mlp_h, psf_h = t.ratio("mlp", "llops", "holdout_rel_mae"), t.ratio("psf", "llops", "holdout_rel_mae")
        paper_mlp = PAPER[p]["mlp"] / PAPER[p]["llops"] if p in PAPER else float("nan")
        paper_psf = PAPER[p]["psf"] / PAPER[p]["llops"] if p in PAPER else float("nan")
        ok_mlp, ok_psf = mlp_r >= TARGETS["mlp"], psf_r >= TARGETS["psf"]
        verdicts.append((p, ok_mlp, ok_psf))
        lines.append(
            f"| {p} | {mlp_r:.2f}× | ≥ {TARGETS['mlp']:g} {'(met)' if ok_mlp else '(NOT met)'} | {paper_mlp:.1f}× "
            f"| {psf_r:.1f}× | ≥ {TARGETS['psf']:g} {'(met)' if ok_psf else '(NOT met)'} | {paper_psf:.1f}× "
            f"| {mlp_h:.2f}× | {psf_h:.1f}× |"
        )
    lines += ["", "Paper ratios are ratios of the paper's Table 3 averages (e.g. 0.054/0.022 = 2.5 for p = 2).",
              "PSF is PolySketchFormer's sketch as that paper uses it: self-tensored (non-negative, r = ⌊√m⌋ = "
              f"{int(cfg.m ** 0.5)}) for even p, plain (r = m) for odd p.", ""]
    for p, t in long_mlp.items():
        llops = {(r.layer, r.head): (r.rel_mae, r.holdout_rel_mae) for r in tables[p].rows if r.method == "llops"}
        ratios = [r.rel_mae / llops[(r.layer, r.head)][0] for r in t.rows]
        held = [r.holdout_rel_mae / llops[(r.layer, r.head)][1] for r in t.rows]
        lines += [f"MLP with 4x the Adam budget ({4 * DEFAULT_STEPS} steps) at p = {p}: rel_mae "
                  f"{t.cell('mlp', 'rel_mae'):.4f} (mean over heads), MLP ÷ LLoPS = {statistics.median(ratios):.2f}× "
                  f"in-sample, {statistics.median(held):.2f}× held-out (medians over heads).", ""]
    for p, t in plain.items():
        llops = {(r.layer, r.head): r.rel_mae for r in tables[p].rows if r.method == "llops"}
        ratios = [r.rel_mae / llops[(r.layer, r.head)] for r in t.rows]
        lines += [f"Plain (signed, unbiased, r = m = {cfg.m}) PSF at p = {p}: rel_mae {t.cell('psf', 'rel_mae'):.4f} "
                  f"(mean over heads), PSF ÷ LLoPS = {statistics.median(ratios):.1f}× (median over heads).", ""]
    lines += ["## Parameter counts per head (both sides) and features", "",
              "| p | " + " | ".join(METHODS) + " |", "|---|" + "---|" * len(METHODS)]
    for p, t in tables.items():
        cells = [f"{t.values(m, 'num_parameters')[0]} ({t.values(m, 'num_features')[0]} f.)" for m in METHODS]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines += ["", "\"optimal\" stores W* on the symmetric exact features (C(d+p−1, p) × m per side); LLoPS is "
              "rank 1, untied (2·p·d·m); the MLP's hidden width is the smallest giving at least LLoPS's count; "
              "PSF/TensorSketch count their random entries/hashes; BASED its d × d' projection.", ""]
    for p, t in tables.items():
        lines += [f"## p = {p} (compare: {seconds[p]:.0f} s wall)", "", t.to_markdown()]
    out_md, out_png = cfg.out.with_suffix(".md"), cfg.out.with_suffix(".png")
    out_md.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(out_md, "\n".join(lines).encode())
    _plot(tables, out_png)
    print("\n".join(lines[:20]))
    print(f"wrote {out_md} and {out_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
