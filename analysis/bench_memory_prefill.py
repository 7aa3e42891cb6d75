"""Prefill with the sparse exact cache (DESIGN §7, issue 34): the memory fast path before and after its
rewrite, side by side in one run.

One attention layer of the converted SmolLM2-135M's shape (B = 1, H = 9, D = Dv = 64, a Hedgehog map
with m = 64 features, window 64 + 4 sinks + cache 188, ``rescore`` and ``chunk_size`` 64, float32),
one ``memory_attention`` call on T tokens, additive and delta-rule state:

* ``before`` — the fast path as of commit :data:`BASE` (``memory_fast.py`` and ``memory_schedule.py``
  read from git into temporary modules: the NumPy schedule stepping token by token, the exact part
  chunk by chunk);
* ``after`` — this checkout's.

Reported: seconds per call (best of ``--reps``; the two alternate, so both see the same load) by the
process's CPU time and by the wall clock, forward under ``no_grad`` and forward + backward (a scalar
loss of the output, gradients to q, k, v and the features), the schedule alone, and the ratios;
the checks that both take the same choices (every schedule output equal) and give the same output.
Writes ``analysis/results/memory_prefill.md``.

    .venv/bin/python analysis/bench_memory_prefill.py            # ~3 min on 1 CPU thread
    .venv/bin/python analysis/bench_memory_prefill.py --quick    # smoke run (T = 256)
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sketchlab.attention.memory as memory  # noqa: E402
from sketchlab.attention import (  # noqa: E402
    AttentionOptions,
    FarParams,
    memory_fast,  # noqa: E402
)
from sketchlab.featuremaps.hedgehog import HedgehogMap  # noqa: E402
from sketchlab.io import atomic_write  # noqa: E402

#: The commit before issue 34's rewrite of the schedule and the exact part.
BASE = "c37f5c5"


def load_base() -> tuple:
    """``(run, schedule)`` of the fast path at :data:`BASE`, as modules inside ``sketchlab.attention``
    (their relative imports resolve against this checkout's other modules)."""
    mods = {}
    for name, path in (("_base_memory_schedule", "memory_schedule.py"), ("_base_memory_fast", "memory_fast.py")):
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{BASE}:sketchlab/attention/{path}"], check=True,
                             capture_output=True, text=True).stdout
        src = src.replace("from .memory_schedule import schedule", "from ._base_memory_schedule import schedule")
        spec = importlib.util.spec_from_loader(f"sketchlab.attention.{name}", loader=None)
        mod = importlib.util.module_from_spec(spec)
        mod.__package__ = "sketchlab.attention"
        sys.modules[spec.name] = mod
        exec(compile(src, f"{BASE}:{path}", "exec"), mod.__dict__)
        mods[name] = mod
    return mods["_base_memory_fast"].run, mods["_base_memory_schedule"].schedule


def problem(T: int, H: int, D: int, m: int, seed: int = 0):
    """Hedgehog features of random q, k (scaled as a converted layer scales them), values; ``[1, T, H, ·]``."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, H, D, generator=gen) for _ in range(3))
    fmap = HedgehogMap(H, D, m=m, seed=seed)
    c = D ** -0.25
    with torch.no_grad():
        return [fmap.features(q * c), fmap.features(k * c), v, q * c, k * c]


def call(run, tensors, options, params, grad: bool) -> None:
    memory.run = run
    try:
        if grad:
            xs = [x.detach().requires_grad_(True) for x in tensors]
            memory.memory_attention(*xs, options=options, params=params).square().sum().backward()
        else:
            with torch.no_grad():
                memory.memory_attention(*tensors, options=options, params=params)
    finally:
        memory.run = memory_fast.run


def timed(fn) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - t0


def same_choices(base_run, base_schedule, tensors, options, params) -> tuple[bool, float]:
    """Both schedules on the same call (every output equal?) and the largest output difference."""
    got = {}
    for label, run, sched in (("before", base_run, base_schedule), ("after", memory_fast.run, memory_fast.schedule)):
        seen = []
        mod = sys.modules[run.__module__]
        keep = mod.schedule
        mod.schedule = lambda *a, _s=sched, **k: seen.append(_s(*a, **k)) or seen[-1]
        try:
            memory.run = run
            with torch.no_grad():
                out = memory.memory_attention(*tensors, options=options, params=params)
        finally:
            mod.schedule, memory.run = keep, memory_fast.run
        got[label] = (seen[0], out)
    (a, oa), (b, ob) = got["before"], got["after"]
    equal = all(torch.equal(x, y) for x, y in zip(a[:2], b[:2])) and len(a[2]) == len(b[2]) \
        and all(torch.equal(x, y) for x, y in zip(a[2], b[2])) and all(torch.equal(x, y) for x, y in zip(a[3:], b[3:]))
    return equal, float((oa - ob).abs().max())


def schedule_args(tensors, options, params):
    """The arguments the fast path hands its schedule on this call (captured once)."""
    seen = []
    keep = memory_fast.schedule
    memory_fast.schedule = lambda *a, **k: seen.append((a, k)) or keep(*a, **k)
    try:
        with torch.no_grad():
            memory.memory_attention(*tensors, options=options, params=params)
    finally:
        memory_fast.schedule = keep
    return seen[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--m", type=int, default=64, help="Hedgehog features")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--cache", type=int, default=188)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke run: T = 256, one rep")
    parser.add_argument("--out", default=str(ROOT / "analysis" / "results" / "memory_prefill.md"))
    args = parser.parse_args(argv)
    if args.quick:
        args.T, args.reps = [256], 1
    torch.set_num_threads(args.threads)
    out_md = Path(args.out)
    if not out_md.parent.is_dir():
        parser.error(f"output directory {out_md.parent} does not exist")
    base_run, base_schedule = load_base()
    H, D = args.heads, args.d
    load_before = os.getloadavg()
    rows, checks = [], []
    t_start = time.perf_counter()
    for state in ("additive", "delta"):
        options = AttentionOptions(window=args.window, sinks=args.sinks, cache=args.cache, state=state,
                                   normalize="sum", non_negative=True, backend="torch")
        params = FarParams(options, H, D)
        for T in args.T:
            tensors = problem(T, H, D, args.m)
            equal, diff = same_choices(base_run, base_schedule, tensors, options, params)
            checks.append((state, T, equal, diff))
            a, k = schedule_args(tensors, options, params)
            cases = {
                "schedule alone": (lambda a=a, k=k: base_schedule(*a, **k), lambda a=a, k=k: memory_fast.schedule(*a, **k)),
                "forward (no_grad)": (lambda t=tensors, o=options, p=params: call(base_run, t, o, p, False),
                                      lambda t=tensors, o=options, p=params: call(memory_fast.run, t, o, p, False)),
                "forward + backward": (lambda t=tensors, o=options, p=params: call(base_run, t, o, p, True),
                                       lambda t=tensors, o=options, p=params: call(memory_fast.run, t, o, p, True)),
            }
            for what, (before, after) in cases.items():
                best = {"before": [math.inf, math.inf], "after": [math.inf, math.inf]}
                for _ in range(args.reps):
                    for label, fn in (("before", before), ("after", after)):
                        cpu, wall = timed(fn)
                        best[label] = [min(best[label][0], cpu), min(best[label][1], wall)]
                rows.append((state, T, what, *best["before"], *best["after"]))
                r = rows[-1]
                print(f"{state:8s} T={T:5d} {what:20s} before {r[3]:7.3f} s  after {r[5]:7.3f} s  "
                      f"× {r[3] / r[5]:5.1f} (CPU time; wall × {r[4] / r[6]:5.1f})", flush=True)
    wall_all = time.perf_counter() - t_start
    load_after = os.getloadavg()
    lines = [
        "# Prefill with the sparse exact cache: the memory fast path before and after (CPU)", "",
        "Command: `" + " ".join([".venv/bin/python", "analysis/bench_memory_prefill.py", *sys.argv[1:]]) + "`", "",
        f"One `memory_attention` call: B = 1, H = {H}, D = Dv = {D}, Hedgehog m = {args.m} features of random q, k "
        f"(scaled by D^-1/4 as a converted layer does), window {args.window} + {args.sinks} sinks + cache "
        f"{args.cache}, rescore and chunk_size 64, normalize='sum', FarParams at their initial values, float32, "
        f"{args.threads} torch thread(s); torch {torch.__version__}, {platform.processor() or platform.machine()}; "
        f"best of {args.reps} alternating runs; wall time {wall_all:.0f} s. *before*: `memory_fast.py` and "
        f"`memory_schedule.py` at commit {BASE} (read from git); *after*: this checkout. Forward + backward: the "
        "gradient of the output's sum of squares to q, k, v and both features.", "",
        f"Machine load (1/5/15-min load average, {os.cpu_count()} CPUs): before "
        f"{'/'.join(f'{x:.1f}' for x in load_before)}, after {'/'.join(f'{x:.1f}' for x in load_after)}. "
        "A shared machine: other jobs slow both columns, so compare the ratios within one run (the CPU-time "
        "columns are the steadier).", "",
        "| state | T | call | before s (CPU) | after s (CPU) | × by CPU time | before s (wall) | after s (wall) | × by wall |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for state, T, what, bc, bw, ac, aw in rows:
        lines.append(f"| {state} | {T} | {what} | {bc:.3f} | {ac:.3f} | **{bc / ac:.1f}** | {bw:.3f} | {aw:.3f} | "
                     f"{bw / aw:.1f} |")
    lines += ["", "## Checks", ""]
    for state, T, equal, diff in checks:
        lines.append(f"- {state}, T = {T}: the schedules are {'identical' if equal else '**NOT identical**'} "
                     f"(event stream, cache intervals, every chunk's slots, the final slots and scores); "
                     f"outputs differ by at most {diff:.1e} (float32).")
    text = "\n".join(lines) + "\n"
    with atomic_write(out_md) as tmp:
        tmp.write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out_md}")
    return 0 if all(equal for _, _, equal, _ in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
