"""``make demo``: the main job end to end on a shipped Q/K dump.

``python -m sketchlab.demo [--dump data/mqar_softmax_qk.safetensors] [--p 2] [--m 64] [--out out/demo]``

The demo is a list of steps (:data:`STEPS`), each a function ``step(state) -> None`` that prints its
section and adds its results to the shared :class:`DemoState`:

1. :func:`step_spectrum` — the singular values of ``A = (QKᵀ/√d)^∘p`` on every head and Theorem 3.1
   on all of them at once: the optimal size-``m`` sketch attains the tail bound (to round-off);
2. :func:`step_compare` — every sketch (optimal, llops, mlp, psf, tensorsketch, based) against that
   optimum on the first, middle and last layers (:func:`sketchlab.compare`): the summary with its
   ×optimum column, the paper's Table 3 layout, held-out rel_mae;
3. :func:`step_attention` — LLoPS fitted on the compared layers (all tokens), its Θ exported
   (:meth:`sketchlab.Fit.save_theta`), loaded back by :meth:`sketchlab.LLoPSAttention.from_pretrained`
   and run as causal attention on the dump's own values (each joined sequence separately), next to
   exact polynomial attention: attention error beside kernel error, and the optimal sketch's;
4. :func:`step_advise` — :func:`sketchlab.advise` for a target error on one head of each compared
   layer: the smallest ``m`` the floor allows and the ``m`` LLoPS needs.

Outputs in ``OUT``: ``comparison.md``, ``comparison.json``, ``theta.safetensors`` (the Θ export), ``optimality.png`` (×optimum per
method), ``spectrum.png`` (σ_i/σ_1 per layer and head), ``advice.md``, ``advice.json``,
``advice.png`` (floor and LLoPS error vs m). Every input is scaled by the one rule
(:mod:`sketchlab.scaling`, ``sqrt-d``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._dumpsel import select_and_scale
from .advise import advise
from .attention import AttentionOptions, LLoPSAttention, dump_segments, linear_attention, poly_attention
from .compare import DEFAULT_METHODS, compare
from .featuremaps.heads import as_heads, from_heads, pair_features
from .fit import fit_sketch
from .io import load_qk
from .io.atomic import write_text_atomic
from .optimal import optimal_sketch
from .plots import plot_advice, plot_kernel_spectrum, plot_optimality_ratios
from .polynomial import poly_kernel
from .scaling import DEFAULT_SCALE
from .spectrum import spectrum_of_selection


@dataclass
class DemoState:
    """What the steps share: the configuration, the dump and every step's results (``results[name]``)."""

    dump: Path
    p: int
    m: int
    seed: int
    holdout: float
    target: float
    out: Path
    scale: str = DEFAULT_SCALE
    methods: tuple = DEFAULT_METHODS
    q: torch.Tensor | None = None  # [L, H, n, d], scaled
    k: torch.Tensor | None = None  # [L, H, n, d], scaled
    v: torch.Tensor | None = None  # [L, H, n, d_v] or None
    layers: list = field(default_factory=list)  # the layers compared (first, middle, last)
    table: object = None  # the ComparisonTable of step_compare
    results: dict = field(default_factory=dict)
    written: list = field(default_factory=list)


def _write(state: DemoState, name: str, text: str) -> None:
    write_text_atomic(state.out / name, text)
    state.written.append(state.out / name)


def step_spectrum(state: DemoState) -> None:
    """Spectrum of every head, and Theorem 3.1 (achieved error = √tail) on all heads at ``m``."""
    sel = select_and_scale(state.dump, scale=state.scale)
    state.q, state.k = sel.q, sel.k
    state.v = load_qk(state.dump).v
    L, H, n, d = sel.q.shape
    state.layers = sorted({0, L // 2, L - 1})
    print(f"Dump {state.dump}: q, k of shape [L={L}, H={H}, n={n}, d={d}]; {sel.scale_description}; p = {state.p}.\n")
    spectrum = spectrum_of_selection(sel, state.p, holdout=0.0, seed=state.seed)
    best = optimal_sketch(sel.q, sel.k, state.p, state.m)  # Optimum: its maps of the L·H heads, its tail
    exact = poly_kernel(sel.q.double(), sel.k.double(), state.p)
    fq, fk = pair_features(best.maps, sel.q, sel.k)  # [L, H, n, m] float64
    achieved = torch.linalg.matrix_norm(fq @ fk.mT - exact)  # [L, H]
    tail = best.tail  # [L, H]
    gap = ((achieved - tail.sqrt()).abs() / torch.linalg.matrix_norm(exact)).max()
    floor = tail.sqrt() / torch.linalg.matrix_norm(exact)
    print(f"## 1. Theorem 3.1 on all {L * H} heads at m = {state.m}\n")
    print(f"The optimal sketch's error equals √tail on every head: largest |‖Â−A‖_F − √tail| / ‖A‖_F = {gap:.1e} "
          f"(float64 round-off). Relative floor √tail/‖A‖_F: median {floor.median():.4f}, range "
          f"{floor.min():.4f}–{floor.max():.4f}; `sketchlab verify` runs every theorem check.\n")
    print("m holding 99% of ‖A‖_F² per head (rows: layers):", spectrum.energy_rank(0.99).tolist(), "\n")
    plot_kernel_spectrum(spectrum, state.out / "spectrum.png")
    state.written.append(state.out / "spectrum.png")
    state.results["theorem_3_1_gap"] = float(gap)


def step_compare(state: DemoState) -> None:
    """Every sketch against the optimum on the first, middle and last layers (all heads)."""
    table = compare(state.dump, p=state.p, m=state.m, methods=state.methods, layers=state.layers,
                    seed=state.seed, holdout=state.holdout, scale=state.scale)
    state.table = table
    print(f"## 2. Every sketch against the optimum (layers {state.layers}, all heads)\n")
    text = table.to_markdown()
    print(text)
    _write(state, "comparison.md", text)
    _write(state, "comparison.json", table.to_json() + "\n")
    plot_optimality_ratios({state.p: table}, state.out / "optimality.png")
    state.written.append(state.out / "optimality.png")


def step_attention(state: DemoState) -> None:
    """Fit LLoPS → export Θ → ``LLoPSAttention.from_pretrained`` → causal attention vs exact polynomial attention.

    Attention is unnormalised (``normalize="none"``): the rank-1 LLoPS and optimal maps are signed,
    so their row sums can be ≤ 0 and a divided output would measure the normaliser, not the sketch
    (DESIGN.md §1, attention with a sketch). The error is ``‖O_sketch − O_exact‖_F / ‖O_exact‖_F``
    per head, with ``O = (Â ⊙ M) V`` inside each sequence the dump joins (metadata ``tokens``).
    """
    dump = load_qk(state.dump)
    if dump.v is None:
        print("## 3. Attention — skipped: the dump has no v (values) to attend over.\n")
        return
    segments = dump_segments(dump)
    layers = torch.tensor(state.layers)
    q, k = state.q[layers].double(), state.k[layers].double()  # [L', H, n, d], already scaled
    v = dump.v[layers].double()  # [L', H, n, d_v]
    fit = fit_sketch("llops", q, k, p=state.p, m=state.m, seed=state.seed)
    optimum = fit_sketch("optimal", q, k, p=state.p, m=state.m, seed=state.seed)
    theta_file = state.out / "theta.safetensors"
    fit.save_theta(theta_file, dump=state.dump, scale=state.scale)
    state.written.append(theta_file)

    def tokens_first(x):  # [L', H, n, ·] -> [L', n, H, ·]: layers on the batch axis of [B, T, H, D]
        return x.transpose(1, 2)

    exact = poly_attention(tokens_first(q), tokens_first(k), tokens_first(v), state.p, normalize="none",
                           segments=segments)  # [L', n, H, d_v]
    with torch.no_grad():  # the [L', H] optimum as one pair of maps of L'·H heads, through the op
        heads = q.shape[0] * q.shape[1]
        best, _ = linear_attention(as_heads(q, heads), as_heads(k, heads), as_heads(v, heads), *optimum.maps,
                                   options=AttentionOptions(normalize="none"), segments=segments)  # [1, n, L'·H, d_v]
        best = tokens_first(from_heads(best, v.shape[:2]))  # [L', n, H, d_v]
    unscaled = dump.q[layers].double(), dump.k[layers].double()  # the block applies the file's scale itself
    rows = []
    for i, layer in enumerate(state.layers):
        block = LLoPSAttention.from_pretrained(theta_file, layer=i, normalize="none", dtype=torch.float64)
        with torch.no_grad():
            out = block.attend(tokens_first(unscaled[0][i:i + 1]), tokens_first(unscaled[1][i:i + 1]),
                               tokens_first(v[i:i + 1]), segments=segments)  # [1, n, H, d_v]
        norm = exact[i].norm(dim=(0, 2))  # [H]
        err = (out[0] - exact[i]).norm(dim=(0, 2)) / norm
        err_best = (best[i] - exact[i]).norm(dim=(0, 2)) / norm
        for h in range(q.shape[1]):
            rows.append((layer, h, float(fit.report.rel_fro[i, h]), float(err[h]), float(optimum.report.rel_fro[i, h]),
                         float(err_best[h])))
    lines = ["| layer | head | LLoPS kernel rel_fro | LLoPS attention error | optimum kernel rel_fro | "
             "optimum attention error |", "|---|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]:.4f} | {r[3]:.4f} | {r[4]:.4f} | {r[5]:.4f} |" for r in rows]
    print(f"## 3. The fitted sketch as attention (Θ → {theta_file} → LLoPSAttention, layers {state.layers})\n")
    print(f"Causal, unnormalised attention over the dump's values, each of the {len(segments or [1])} joined "
          "sequences on its own, against exact polynomial attention; error ‖O − O_exact‖_F / ‖O_exact‖_F.\n")
    text = "\n".join(lines) + "\n"
    print(text)
    _write(state, "attention.md", text)
    state.results["attention"] = rows


def step_advise(state: DemoState) -> None:
    """``advise`` for ``state.target`` on head 0 of each compared layer (LLoPS)."""
    result = advise(state.dump, p=state.p, target=state.target, method="llops", layers=state.layers, heads=[0],
                    scale=state.scale, holdout=state.holdout, seed=state.seed)
    print(f"## 4. Which m for rel_fro ≤ {state.target:g}? (`sketchlab advise`, head 0 of layers {state.layers})\n")
    text = result.to_markdown()
    print(text)
    _write(state, "advice.md", text)
    _write(state, "advice.json", result.to_json() + "\n")
    plot_advice(result, state.out / "advice.png")
    state.written.append(state.out / "advice.png")
    state.results["advice"] = result


#: The demo's steps in order.
STEPS = [step_spectrum, step_compare, step_attention, step_advise]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sketchlab.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=Path, default=Path("data/mqar_softmax_qk.safetensors"))
    parser.add_argument("--p", type=int, default=2)
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--holdout", type=float, default=0.25)
    parser.add_argument("--target", type=float, default=0.05, help="target rel_fro of the advise step")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="methods compared (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("out/demo"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # small batched fits: one thread is fastest (see analysis/results/table3.md)
    args.out.mkdir(parents=True, exist_ok=True)
    state = DemoState(dump=args.dump, p=args.p, m=args.m, seed=args.seed, holdout=args.holdout, target=args.target,
                      out=args.out, methods=tuple(v for v in args.methods.split(",") if v))
    start = time.perf_counter()
    for step in STEPS:
        step(state)
    print(f"wrote {', '.join(str(p) for p in state.written)} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
