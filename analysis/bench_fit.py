"""Fit LLoPS to every head of a Q/K dump and compare each fit with the Theorem 3.1 optimum.

Usage::

    .venv/bin/python analysis/bench_fit.py --dump data/mqar_softmax_qk.safetensors --threads 1 \
        [--dump standin] [--high] [--skip-p3] [--scale-case d,n,m,p,t,fit_tokens[,route] ...]

``--dump`` is repeatable (``standin`` names the seeded ``[6, 12, 512, 32]`` stand-in, :func:`standin_qk`).
Inputs are scaled by ``d^-1/4`` here, explicitly (``--no-scale`` to skip), so ``qᵀk`` becomes
``qᵀk/√d``. Per data set, side by side in one run, on all tokens: ALS only,
the previous default (ALS then LM), the default fit (ALS sweeps interleaved with Levenberg–Marquardt
steps), ``quality="high"`` (``--high``), rank 2, p = 3 (and its ``"high"``); then a
held-out run with the min-norm held-out reference. ``--scale-case`` adds one-head rows (fit time,
×optimum, iterations run, peak memory of a fresh process with ``--scale-threads`` threads, default 2;
``route`` forces one of :data:`sketchlab.llops.target.ROUTES`, default ``auto``). Writes ``analysis/results/fit.md``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from sketchlab import fit_sketch
from sketchlab.io import atomic_write
from sketchlab.llops import QUALITY

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Config:
    dump: list
    out: Path
    holdout: float
    seed: int
    scale: bool
    skip_p3: bool
    high: bool
    scale_cases: list


def standin_qk(shape=(6, 12, 512, 32), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded stand-in for a real Q/K dump, float32 ``[L, H, n, d]`` (unscaled).

    Per head and side: a random orthonormal basis ``U``, token coordinates ``z ~ N(0, diag(s²))``
    with a decaying spectrum ``s_j = 3 e^{-j/3} + 0.15`` (a few large directions, effective rank
    ≈ 6, a noise floor), plus a per-head mean ``μ ~ N(0, 0.8² I)`` shared by all tokens:
    ``x = z Uᵀ + μ``. Real attention Q/K share these traits (low effective rank, non-zero mean,
    a few dominant directions); isotropic Gaussians do not.
    """
    L, H, n, d = shape
    gen = torch.Generator().manual_seed(seed)
    spectrum = 3.0 * torch.exp(-torch.arange(d, dtype=torch.float64) / 3.0) + 0.15
    out = []
    for _ in range(2):  # q, then k
        basis = torch.linalg.qr(torch.randn(L, H, d, d, generator=gen, dtype=torch.float64))[0]  # [L, H, d, d]
        z = torch.randn(L, H, n, d, generator=gen, dtype=torch.float64) * spectrum  # [L, H, n, d]
        mean = 0.8 * torch.randn(L, H, 1, d, generator=gen, dtype=torch.float64)  # [L, H, 1, d]
        out.append((z @ basis.mT + mean).float())
    return out[0], out[1]


def _stats(x: torch.Tensor | None) -> tuple[str, str]:
    if x is None:
        return "–", "–"
    x = x.flatten()
    return f"{x.median().item():.3f}", f"{x.max().item():.3f}"


def _row(label, heads, rep, sub=None, seconds=None):
    idx = slice(None) if sub is None else sub
    ins = rep.optimality_ratio.flatten()[idx]
    held = None if rep.holdout_optimality_ratio is None else rep.holdout_optimality_ratio.flatten()[idx]
    med, worst = _stats(ins)
    hmed, hworst = _stats(held)
    rel = rep.rel_fro.flatten()[idx].median().item()
    secs = rep.seconds if seconds is None else seconds
    return (f"| {label} | {heads} | {med} | {worst} | {hmed} | {hworst} | {rel:.4f} | {rep.steps} | "
            f"{'yes' if rep.converged else 'no'} | {secs:.1f} |")


HEADER = ("| fit | heads | in-sample median | in-sample worst | held-out median | held-out worst | "
          "median rel_fro | steps | converged | wall s |\n|---|---|---|---|---|---|---|---|---|---|")


def bench(name: str, cfg: Config) -> list[str]:
    """Quality of the fits on one data set (``"standin"`` or a dump path); returns the markdown section.

    All-token rows (holdout 0) are the criterion rows: ×optimum median / worst over heads and the
    wall time of the whole batch of heads. A held-out run adds the min-norm reference.
    """
    if name == "standin":
        q, k = standin_qk(seed=cfg.seed)
        source = "stand-in `standin_qk(shape=(6, 12, 512, 32), seed=%d)` (see its docstring)" % cfg.seed
    else:
        from sketchlab.io import load_qk

        dump = load_qk(name)
        q, k = dump.q, dump.k
        meta = {key: dump.meta[key] for key in ("source", "scale", "captured", "layout") if key in dump.meta}
        source = f"`{name}` (metadata: {meta})"
    L, H, n, d = q.shape
    if cfg.scale:
        q, k = q * d**-0.25, k * d**-0.25  # explicit: qᵀk → qᵀk/√d
    heads = L * H
    m = 64
    holdout = cfg.holdout if cfg.holdout * n > m + 1 else math.ceil(20 * (m + 1) / n) / 20
    lines = [
        f"## Data: {name}",
        "",
        f"{source}; shape [L, H, n, d] = {list(q.shape)}, dtype {q.dtype}; "
        f"{'scaled by d^-1/4 in the script' if cfg.scale else 'not rescaled'}.",
        "",
        HEADER,
    ]

    def run(label, p, rank, hold=0.0, **opts):
        fit = fit_sketch("llops", q, k, p=p, m=m, rank=rank, seed=cfg.seed, holdout=hold, **opts)
        row = _row(label, heads, fit.report)
        print(row, flush=True)
        lines.append(row)
        return fit

    run("p=2, t=1, ALS only (6 sweeps)", 2, 1, lm_steps=0)
    run("p=2, t=1, 6 ALS sweeps then 6 LM steps (the previous default)", 2, 1, lm_steps=6, interleave=0)
    run("p=2, t=1, default", 2, 1)
    if cfg.high:
        run("p=2, t=1, quality='high'", 2, 1, quality="high")
    run("p=2, t=2, default", 2, 2)
    if not cfg.skip_p3:
        run("p=3, t=1, default", 3, 1)
        if cfg.high:
            run("p=3, t=1, quality='high'", 3, 1, quality="high")
    held = run(f"p=2, t=1, default, {holdout:.0%} held out", 2, 1, hold=holdout)
    opt = fit_sketch("optimal", q, k, p=2, m=m, seed=cfg.seed, holdout=holdout, reference=False)
    lines.append(_row(f"Theorem 3.1 optimum (Nyström W*), {holdout:.0%} held out", heads, opt.report))
    ref = held.report.holdout_reference_rel_fro.flatten()
    lines += [
        "",
        f"Held-out reference (min-norm W* of the fitting tokens, `sketchlab.min_norm_sketch`): median held-out "
        f"rel_fro {ref.median():.4f}; the LLoPS fit's held-out rel_fro ÷ reference: median "
        f"{held.report.holdout_vs_reference.median():.3f}, worst {held.report.holdout_vs_reference.max():.3f}; "
        f"the Nyström optimum's: median {(opt.report.holdout_rel_fro.flatten() / ref).median():.3f}.",
        "",
    ]
    return lines


SCALE_SCRIPT = r"""
import json, resource, sys, time, torch
d, n, m, p, t, fit_tokens, threads = (int(a) for a in sys.argv[1:8])
route = sys.argv[8]
torch.set_num_threads(threads)
from sketchlab import fit_sketch
gen = torch.Generator().manual_seed(0)
spec = 3.0 * torch.exp(-torch.arange(d, dtype=torch.float64) / 3.0) + 0.15
def side():
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) * spec + 0.8 * torch.randn(1, d, generator=gen, dtype=torch.float64)
    return (x * d ** -0.25).float()
q, k = side(), side()
start = time.perf_counter()
fit = fit_sketch("llops", q, k, p=p, m=m, rank=t, fit_tokens=fit_tokens or None, route=route)
info = fit.report.info
print(json.dumps({"seconds": fit.report.seconds, "total": time.perf_counter() - start, "ratio": float(fit.report.optimality_ratio),
                  "route": info["route"], "iterations": fit.report.steps, "capped": info["capped"],
                  "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def scale_case(text: str) -> tuple:
    """``"d,n,m,p,t,fit_tokens[,route]"`` → ``(d, n, m, p, t, fit_tokens, route)``."""
    from sketchlab.llops.target import ROUTES

    parts = text.split(",")
    if len(parts) not in (6, 7) or (len(parts) == 7 and parts[6] not in ROUTES) or not all(v.isdigit() for v in parts[:6]):
        raise SystemExit(f"--scale-case must be d,n,m,p,t,fit_tokens[,route] (integers >= 0; route in {ROUTES}), got {text!r}")
    return (*(int(v) for v in parts[:6]), parts[6] if len(parts) == 7 else "auto")


def scale_rows(cases, threads: int) -> list[str]:
    """One head per case ``(d, n, m, p, t, fit_tokens, route)``, each in a fresh process with ``threads``
    threads (peak memory = its max RSS, report included): fit seconds, fit + report seconds, ×optimum
    on all tokens, route, iterations (and whether the preset's work cap cut them), peak memory."""
    import json
    import subprocess

    lines = [f"## Scale: one head, p, m, t as given, seeded stand-in tokens, {threads} thread(s)", "",
             "fit s = `FitReport.seconds` (the fit: init, route set-up, sweeps); total s adds the report (errors on all "
             "tokens in row blocks, the Theorem 3.1 optimum). Peak memory = the fresh process's max RSS, report included.",
             "",
             "| d | n | m | p | t | fit_tokens | fit s | total s | ×optimum (all tokens) | route | iterations | peak memory GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        d, n, m, p, t, sub, route = case
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"}
        out = subprocess.run([sys.executable, "-c", SCALE_SCRIPT, *map(str, case[:6]), str(threads), route], capture_output=True,
                             text=True, env=env)
        if out.returncode != 0:
            row = f"| {d} | {n} | {m} | {p} | {t} | {sub or 'all'} | failed: {out.stderr.strip().splitlines()[-1][:120]} | | | {route} | | |"
        else:
            r = json.loads(out.stdout.strip().splitlines()[-1])
            row = (f"| {d} | {n} | {m} | {p} | {t} | {sub or 'all'} | {r['seconds']:.1f} | {r['total']:.1f} | {r['ratio']:.3f} | "
                   f"{r['route']} | {r['iterations']}{' (capped)' if r['capped'] else ''} | {r['peak_gb']:.2f} |")
        print(row, flush=True)
        lines.append(row)
    return lines + [""]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", action="append", default=None,
                        help="Q/K dump [L, H, n, d] (sketchlab.io.load_qk), or 'standin'; repeatable; default: standin")
    parser.add_argument("--out", type=Path, default=ROOT / "analysis" / "results" / "fit.md")
    parser.add_argument("--holdout", type=float, default=0.2,
                        help="held-out fraction (raised to the next 5%% above (m+1)/n when too few tokens remain)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--no-scale", action="store_true", help="do not scale inputs by d^-1/4")
    parser.add_argument("--skip-p3", action="store_true")
    parser.add_argument("--high", action="store_true", help="also run quality='high' (minutes)")
    parser.add_argument("--scale-case", action="append", default=None, metavar="d,n,m,p,t,fit_tokens[,route]",
                        help="one-head scale case (fit_tokens 0 = all; route default auto); repeatable; default: none")
    parser.add_argument("--scale-threads", type=int, default=2, help="threads of each scale case (default 2: the target machine's cores)")
    a = parser.parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    cases = [scale_case(c) for c in (a.scale_case or [])]
    cfg = Config(a.dump if a.dump is not None else ["standin"], a.out, a.holdout, a.seed, not a.no_scale, a.skip_p3,
                 a.high, cases)
    default = QUALITY["default"]
    lines = [
        "# LLoPS fits against the Theorem 3.1 optimum",
        "",
        f"Generated by `analysis/bench_fit.py {' '.join(sys.argv[1:] if argv is None else argv)}` on "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; {platform.machine()}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} thread(s) (shared, noisy 2-core machine: compare rows of "
        "one run, not runs).",
        "",
        "Ratios are `rel_fro ÷ optimum` = ‖Â−A‖_F/√tail (FitReport.optimality_ratio); 1 is optimal. "
        f"default = `fit_sketch(\"llops\", ...)` with its defaults: the svd init, {default.steps} ALS sweeps "
        f"(with extrapolation), then {default.lm_steps} Levenberg–Marquardt steps of {default.cg_iters} CG "
        f"iterations with {default.interleave} ALS sweeps before every {default.interleave} of them, cut where "
        f"the estimated multiply-adds per head would pass {default.work:.1e} (binds only on the large scale cases); "
        f"quality='high' = ({', '.join(f'{v:g}' for v in QUALITY['high'])}) (sweeps, LM steps, CG iterations, interleave, work). Wall time "
        "is the whole batch of heads. All fitting in float64.",
        "",
    ]
    for name in cfg.dump:
        lines += bench(name, cfg)
    if cfg.scale_cases:
        lines += scale_rows(cfg.scale_cases, a.scale_threads)
    text = "\n".join(lines) + "\n"
    print(text)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(cfg.out) as tmp:
        tmp.write_text(text, encoding="utf-8")
    print(f"wrote {cfg.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
