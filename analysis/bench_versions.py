"""Speed kept across a redesign: the same attention calls timed in two source trees, interleaved call by call.

Issue 40 moved every attention call behind one op (``sketchlab.linear_attention``); this script checks that
the move costs nothing measurable. Three persistent subprocesses each load one tree: the old tree, the new
tree, and the new tree again (the *null control*: two copies of one code, whose ratio shows what this machine
can resolve). Round after round, every case is asked of the three in a shuffled order, each answering with
the best of ``--reps`` calls by process CPU time, so a drift of the machine's load falls on all three alike.
Per case the table gives new ÷ old (and new′ ÷ new for the control) two ways: best over all rounds ÷ best
(the issue's "best of runs") and the median over rounds of each round's ratio; ≤ 1.05: kept. The cases:

* forward and forward + backward of causal LLoPS attention (B = 1, H = 2, D = Dv = 128, m = 128, p = 2,
  float32, one thread), pure and the hybrid (window 64 + 4 sinks), at T = 1024 … 8192; the old tree through
  its public ``llops_attention``, the new one through ``linear_attention`` on an ``LLoPSMap`` of the same Θ
  (what a user calls in each);
* one decoding step at a 32k-token context (the state made by one prefill call), pure and hybrid;
* the ATen operations one forward call and one decoding step run in each tree (a count that machine load
  does not change, beside the timings that it does).

Writes ``analysis/results/bench_versions.md``.

    .venv/bin/python analysis/bench_versions.py --old /path/to/old/checkout      # e.g. a worktree of acaf206
    .venv/bin/python analysis/bench_versions.py --old ... --quick                # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The child's code: builds every case in the tree first on sys.path, prints the ATen operation counts as one
#: JSON line, then answers each case name read from stdin with the best of REPS calls (seconds, one line).
CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
import sketchlab as sl
T_LIST, REPS, DECODE = json.loads(sys.argv[1])
new = hasattr(sl, "linear_attention")
H, D, M = 2, 128, 128
gen = torch.Generator().manual_seed(0)
theta = torch.randn(H, 1, 1, D, M, generator=gen).expand(-1, -1, 2, -1, -1).contiguous() / D**0.5
if new:
    from sketchlab.featuremaps import LLoPSMap
    fmap = LLoPSMap(H, D, theta=theta, learn=False)
def call(q, k, v, window, **kw):
    hybrid = dict(window=window, sinks=4 if window else 0)
    if new:
        options = sl.AttentionOptions(normalize="sum", non_negative=False, backend="torch", **hybrid)
        out, state = sl.linear_attention(q, k, v, fmap, options=options, **kw)
        return (out, state) if kw.get("output_final_state") else out
    return sl.llops_attention(q, k, v, theta, theta, normalize="sum", non_negative=False, backend="torch",
                              **hybrid, **kw)
def ops(fn):
    with torch.profiler.profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
def no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run
cases = {}
for T in T_LIST:
    q, k, v = (torch.randn(1, T, H, D, generator=gen) * D**-0.25 for _ in range(3))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    for window in (0, 64):
        name = f"{'hybrid' if window else 'pure'} T={T}"
        cases[f"fwd {name}"] = no_grad(lambda q=q, k=k, v=v, w=window: call(q, k, v, w))
        cases[f"fwd+bwd {name}"] = lambda leaves=leaves, w=window: call(*leaves, w).sum().backward()
if DECODE:
    L = DECODE
    q, k, v = (torch.randn(1, L, H, D, generator=gen) * D**-0.25 for _ in range(3))
    x = torch.randn(1, 1, H, D, generator=gen) * D**-0.25
    for window in (0, 64):
        with torch.no_grad():
            _, state = call(q, k, v, window, output_final_state=True)
        name = f"decode step {'hybrid' if window else 'pure'} L={L}"
        cases[name] = no_grad(lambda w=window, s=state: call(x, x, x, w, initial_state=s, output_final_state=True))
for fn in cases.values():  # warm every path once (one-time work, such as a cached check, is not counted)
    fn()
counts = {name: ops(fn) for name, fn in cases.items() if not name.startswith("fwd+bwd")}
print(json.dumps({"cases": list(cases), "ops": counts}), flush=True)
for line in sys.stdin:
    fn = cases[line.strip()]
    times = []
    for _ in range(REPS):
        t0 = time.process_time(); fn(); times.append(time.process_time() - t0)
    print(min(times), flush=True)
"""


class Tree:
    """One persistent child process timing the cases in one source tree."""

    def __init__(self, tree: str, config: list):
        env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(config)], env=env, cwd="/",
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        head = json.loads(self.proc.stdout.readline())
        self.cases, self.ops = head["cases"], head["ops"]

    def time(self, case: str) -> float:
        self.proc.stdin.write(case + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the old source tree (a checkout holding sketchlab/)")
    parser.add_argument("--new", default=str(ROOT), help="the new source tree (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="T = 256, 512, decode at 2048, 2 rounds of 2")
    parser.add_argument("--out", default=str(ROOT / "analysis" / "results" / "bench_versions.md"))
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.reps, config = 2, 2, [[256, 512], 2, 2048]
    else:
        config = [[1024, 2048, 4096, 8192], args.reps, 32768]
    started = time.time()
    load0 = os.getloadavg()
    trees = {"old": Tree(args.old, config), "new": Tree(args.new, config), "new′": Tree(args.new, config)}
    cases = trees["new"].cases
    times: dict[str, dict[str, list[float]]] = {side: {c: [] for c in cases} for side in trees}
    order = random.Random(0)
    for r in range(args.rounds):
        for case in cases:
            sides = list(trees)
            order.shuffle(sides)
            for side in sides:
                times[side][case].append(trees[side].time(case))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    ops = {side: tree.ops for side, tree in trees.items()}
    for tree in trees.values():
        tree.close()

    def ratio(a: str, b: str, case: str) -> float:  # median over rounds of a ÷ b, each round's pair
        return statistics.median(x / y for x, y in zip(times[a][case], times[b][case]))

    def best(a: str, b: str, case: str) -> float:  # best ÷ best over every round (the "best of runs")
        return min(times[a][case]) / min(times[b][case])

    rows = [(c, min(times["old"][c]), min(times["new"][c]), min(times["new′"][c]), best("new", "old", c),
             best("new′", "new", c), ratio("new", "old", c), ratio("new′", "new", c)) for c in cases]
    ops_cell = lambda side, name: str(ops[side][name]) if name in ops[side] else ""  # noqa: E731
    worst, worst_paired = max(r[4] for r in rows), max(r[6] for r in rows)
    raw = Path(args.out).with_suffix(".json")  # every round's time per process and case, for a second look
    null, null_paired = [r[5] for r in rows], [r[7] for r in rows]
    lines = ["# Speed kept: the attention calls in two source trees, interleaved call by call", "",
             f"Command: `.venv/bin/python analysis/bench_versions.py --old OLD --rounds {args.rounds} --reps {args.reps}"
             f"{' --quick' if args.quick else ''}` "
             f"(OLD: a checkout of the tree before the change; here `{args.old}`)", "",
             "B = 1, H = 2, D = Dv = 128, LLoPS m = 128 (p = 2, equal factors), float32, causal, one thread; the old "
             "tree through `llops_attention`, the new through `linear_attention` on an `LLoPSMap` of the same Θ. "
             "Three persistent processes (old, new, and new again: the null control) answer every case in a "
             f"shuffled order each round, each with the best of {args.reps} calls by process CPU time. The times and "
             f"`best` ratios: the best over all {args.rounds} rounds (the issue's measure, best of runs); `paired`: "
             "the median over rounds of each round's ratio (a second estimate, robust to drift). Wall time "
             f"{time.time() - started:.0f} s; load average before {load0[0]:.1f}, after {os.getloadavg()[0]:.1f} "
             "(a shared 2-core machine).", "",
             "`new′ ÷ new`: the same code in two processes, what this machine can resolve. `ATen ops`: the ATen "
             "operations one warm call runs in each tree (`torch.profiler`; forward and decode calls), a count no "
             "machine load changes.", "",
             "| call | old (s) | new (s) | new′ (s) | new ÷ old best | null best | new ÷ old paired | null paired | "
             "ATen ops old | ATen ops new |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {o:.5f} | {n:.5f} | {n2:.5f} | {b:.3f} | {bz:.3f} | {q:.3f} | {z:.3f} | "
              f"{ops_cell('old', name)} | {ops_cell('new', name)} |" for name, o, n, n2, b, bz, q, z in rows]
    lines += ["", f"Worst new ÷ old: **{worst:.3f}** best of runs, {worst_paired:.3f} paired (kept: ≤ 1.05); the null "
              f"control (one code, two processes) ranges {min(null):.3f}–{max(null):.3f} best of runs, "
              f"{min(null_paired):.3f}–{max(null_paired):.3f} paired."]
    lines += ["", f"Every round's time per process and case: `{raw.name}`."]
    text = "\n".join(lines) + "\n"
    sys.path.insert(0, str(ROOT))
    from sketchlab.io.atomic import write_text_atomic

    write_text_atomic(args.out, text)
    write_text_atomic(raw, json.dumps(times, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
