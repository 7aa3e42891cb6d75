"""The MQAR training step of paper_training.py's linear methods: where the parallel form and the folded LLoPS
projection save time, side by side in one run.

1. The attention call of one layer at the study's sizes (B = 64, one head, Dv = 64; M = 273: BASED's Taylor
   map, M = 256: LLoPS m = 256), forward + backward, T in {16, 32, 64} (the training mixture's lengths): the
   chunked core (``chunk_core`` with C = T, what the pure path ran for a one-chunk call before) against the
   parallel form (``parallel_core``, what it runs now).
2. The LLoPS feature projection ``x [B, H, n, D] @ Θ_flat [H, D, t·p·M]`` (p = 4, m = 256, D = 64), forward +
   backward: broadcast over B (before) against the tokens folded into one matmul per head (now).
3. One whole training step (forward, backward, AdamW) of the study's model per method and T, in a fresh process
   per library and round, the libraries in turns: this repository and, with ``--before DIR``, a copy of the
   repository before the change (``git archive e7da80a sketchlab analysis | tar -x -C DIR``: its own
   ``paper_training.py`` and ``sketchlab``, checked to be the one imported); the mixture's mean step weighs
   T = 16, 32, 64 as 5 : 1 : 3 (Zoology's mixture at a quarter of its lengths: (16, 1) ×5, (32, 2), (64, 4),
   (64, 8), (64, 16)). ``softmax-nope`` runs none of the changed code: its before / now ratio is the bias between
   the two processes, the yardstick for the others.

Process CPU time on one thread (the shared machine's wall time swings with its load), median of ``--rounds``
rounds, the two forms (or libraries) timed in turns in each. Writes ``analysis/results/parallel.md``.

Usage: ``python analysis/bench_parallel.py [--before DIR] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (16, 32, 64)
MIX = {16: 5, 32: 1, 64: 3}  # batches per 9 of the training mixture at each T
METHODS = ("softmax-nope", "based-nope", "llops-p4-m256-nope")

STEP = """
import json, sys, time, torch
sys.path.insert(0, {analysis!r})
import paper_training as pt
import sketchlab
torch.set_num_threads(1)
out = {{"sketchlab": sketchlab.__file__}}
for key in {methods!r}:
    model = pt.build_model(pt.methods(64)[key], 64, 512, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for T in {lengths!r}:
        g = torch.Generator().manual_seed(T)
        x, y = torch.randint(0, 512, (64, T), generator=g), torch.randint(0, 512, (64, T), generator=g)
        def step():
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(); loss.backward(); opt.step()
        step()
        times = []
        for _ in range({rounds}):
            t0 = time.process_time(); step(); times.append(time.process_time() - t0)
        out[f"{{key}} {{T}}"] = sorted(times)[len(times) // 2]
print(json.dumps(out))
"""


def cpu_time(fn, rounds: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def in_turns(fa, fb, rounds: int) -> tuple[float, float]:
    """Median CPU times of ``fa`` and ``fb`` over ``rounds`` rounds, one call of each per round (in turns:
    both see the same load)."""
    a, b = [], []
    for _ in range(rounds):
        a.append(cpu_time(fa, 1))
        b.append(cpu_time(fb, 1))
    return statistics.median(a), statistics.median(b)


def fwd_bwd(fn, *leaves):
    def run():
        xs = [x.detach().requires_grad_() for x in leaves]
        out = fn(*xs)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
    return run


def core_rows(rounds: int) -> list[str]:
    from sketchlab.attention.ops.additive.chunk import chunk_core
    from sketchlab.attention.ops.additive.parallel import parallel_core

    rows = ["| M | T | chunked core ms | parallel ms | chunked / parallel |", "|---|---|---|---|---|"]
    for M in (273, 256):
        for T in LENGTHS:
            g = torch.Generator().manual_seed(T)
            fq, fk = torch.rand(64, 1, T, M, generator=g), torch.rand(64, 1, T, M, generator=g)
            v = torch.randn(64, 1, T, 64, generator=g)
            S0, z0 = torch.zeros(64, 1, M, 64), torch.zeros(64, 1, M)
            chunk = fwd_bwd(lambda a, b, c: chunk_core(a, b, c, S0, z0, off=0, lag=0, chunk_size=T, non_negative=False,
                                                       normalize=True, eps=1e-6), fq, fk, v)
            par = fwd_bwd(lambda a, b, c: parallel_core(a, b, c, causal=True, non_negative=False, normalize=True,
                                                        eps=1e-6), fq, fk, v)
            a, b = in_turns(chunk, par, rounds)
            rows.append(f"| {M} | {T} | {1e3 * a:.2f} | {1e3 * b:.2f} | {a / b:.2f} |")
            print(rows[-1], flush=True)
    return rows


def projection_rows(rounds: int) -> list[str]:
    H, t, p, D, M = 1, 1, 4, 64, 256
    rows = ["| T | broadcast ms | folded ms | broadcast / folded |", "|---|---|---|---|"]
    for T in LENGTHS:
        g = torch.Generator().manual_seed(T)
        x, flat = torch.randn(64, H, T, D, generator=g), torch.randn(H, D, t * p * M, generator=g)
        broadcast = fwd_bwd(lambda a, w: a @ w, x, flat)  # [B, H, n, D] @ [H, D, tpM]: batched over B
        folded = fwd_bwd(lambda a, w: (a.transpose(0, 1).reshape(H, -1, D) @ w), x, flat)  # [H, B·n, D] @ [H, D, tpM]
        a, b = in_turns(broadcast, folded, rounds)
        rows.append(f"| {T} | {1e3 * a:.2f} | {1e3 * b:.2f} | {a / b:.2f} |")
        print(rows[-1], flush=True)
    return rows


def step_times(library: Path) -> dict:
    """One round in a fresh process whose ``sketchlab`` and ``paper_training`` are ``library``'s own
    (refused otherwise: a ``before`` that silently imported this repository would time it twice)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(library)}
    code = STEP.format(analysis=str(library / "analysis"), methods=METHODS, lengths=LENGTHS, rounds=1)
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=library, check=True, capture_output=True,
                         text=True)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    imported = Path(got.pop("sketchlab")).resolve()
    if not imported.is_relative_to(library.resolve()):
        raise RuntimeError(f"the step for {library} imported sketchlab from {imported}")
    return got


def step_rows(before: Path | None, rounds: int) -> list[str]:
    libs = {"now": ROOT} | ({"before": before} if before else {})
    runs = {name: [] for name in libs}
    for _ in range(rounds):  # the libraries in turns, one fresh process each per round
        for name, lib in libs.items():
            runs[name].append(step_times(lib))
    got = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    head = "| method | T | " + " | ".join(f"{n} s/step" for n in libs) + (" | before / now |" if before else " |")
    rows = [head, "|---|---|" + "---|" * len(libs) + ("---|" if before else "")]
    for key in METHODS:
        for T in (*LENGTHS, "mix"):
            if T == "mix":
                vals = {n: sum(MIX[x] * got[n][f"{key} {x}"] for x in LENGTHS) / sum(MIX.values()) for n in libs}
            else:
                vals = {n: got[n][f"{key} {T}"] for n in libs}
            row = f"| {key} | {T} | " + " | ".join(f"{vals[n]:.3f}" for n in libs) + " |"
            if before:
                row += f" {vals['before'] / vals['now']:.2f} |"
            rows.append(row)
            print(row, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, default=None, help="a copy of the repository before the change "
                    "(its sketchlab/ and analysis/: git archive COMMIT sketchlab analysis | tar -x -C DIR)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "analysis" / "results" / "parallel.md")
    args = ap.parse_args(argv)
    if args.before is not None and not ((args.before / "sketchlab").is_dir()
                                        and (args.before / "analysis" / "paper_training.py").is_file()):
        print(f"--before: {args.before} must hold sketchlab/ and analysis/paper_training.py "
              "(git archive COMMIT sketchlab analysis | tar -x -C DIR)", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"--rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    core = core_rows(args.rounds)
    proj = projection_rows(args.rounds)
    steps = step_rows(args.before, args.rounds)
    cmd = "python analysis/bench_parallel.py " + " ".join(sys.argv[1:] if argv is None else argv)
    L = ["# The MQAR training step: the parallel form and the folded LLoPS projection", "",
         f"Generated by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
         f"torch {torch.__version__}; one thread, process CPU time, median of {args.rounds} rounds (the two forms, "
         f"or the two libraries, timed in turns in each), on a shared 2-core machine; "
         f"{time.perf_counter() - t0:.0f} s in all.", "",
         "## 1. One attention call, forward + backward (B = 64, H = 1, Dv = 64, causal, normalised)", "",
         "The chunked core at C = T is what the pure path ran for a one-chunk call; the parallel form is what "
         "`linear_attention` (torch backend) runs now when T, S <= chunk_size, no window and "
         "no state (`sketchlab.attention.ops.additive.parallel.use_parallel`).", "", *core, "",
         "## 2. The LLoPS projection, forward + backward (p = 4, m = 256, D = 64: 1024 columns)", "", *proj, "",
         "## 3. One training step of the study's model (d_model 64, 2 layers, batch 64, NoPE)", "",
         "`mix`: the mean step of the training mixture (T = 16, 32, 64 weighted 5 : 1 : 3). `softmax-nope` runs none "
         "of the changed code: its before / now ratio is the bias between the two processes (read the others "
         "against it).", "", *steps, ""]
    from sketchlab.io import atomic_write

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(args.out) as tmp:
        Path(tmp).write_text("\n".join(L) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
