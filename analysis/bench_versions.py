"""Speed kept across a redesign: the same attention calls timed in two source trees, side by side.

Issue 40 moved every attention call behind one op (``sketchlab.linear_attention``); this script checks that
the move costs nothing measurable. Each round runs one subprocess per tree (alternating, so both see the
same machine load), each timing by process CPU time, best of ``--reps`` calls:

* forward and forward + backward of causal LLoPS attention (B = 1, H = 2, D = Dv = 128, m = 128, p = 2,
  float32, one thread), pure and the hybrid (window 64 + 4 sinks), at T = 1024 … 8192; the old tree through
  its public ``llops_attention``, the new one through ``linear_attention`` on an ``LLoPSMap`` of the same Θ
  (what a user calls in each);
* one decoding step at a 32k-token context (the state made by one prefill call), pure and hybrid;
* the ATen operations one forward call and one decoding step run in each tree (a count that machine load
  does not change, beside the timings that it does).

The best time over ``--rounds`` rounds per tree is kept; the table gives new ÷ old (≤ 1.05: kept). Writes
``analysis/results/bench_versions.md``.

    .venv/bin/python analysis/bench_versions.py --old /path/to/old/checkout      # e.g. a worktree of acaf206
    .venv/bin/python analysis/bench_versions.py --old ... --quick                # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The child's code: times every case in the tree first on sys.path and prints one JSON line.
CHILD = r'''
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
    # the ATen operations one call runs (a count that no machine load changes)
    with torch.profiler.profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
def best(fn):
    times = []
    for _ in range(REPS):
        t0 = time.process_time(); fn(); times.append(time.process_time() - t0)
    return min(times)
out = {}
for T in T_LIST:
    q, k, v = (torch.randn(1, T, H, D, generator=gen) * D**-0.25 for _ in range(3))
    for window in (0, 64):
        name = f"{'hybrid' if window else 'pure'} T={T}"
        with torch.no_grad():
            out[f"fwd {name}"] = best(lambda: call(q, k, v, window))
            out[f"ops:fwd {name}"] = ops(lambda: call(q, k, v, window))
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out[f"fwd+bwd {name}"] = best(lambda: call(*leaves, window).sum().backward())
if DECODE:
    L = DECODE
    q, k, v = (torch.randn(1, L, H, D, generator=gen) * D**-0.25 for _ in range(3))
    x = torch.randn(1, 1, H, D, generator=gen) * D**-0.25
    for window in (0, 64):
        with torch.no_grad():
            _, state = call(q, k, v, window, output_final_state=True)
            name = f"decode step {'hybrid' if window else 'pure'} L={L}"
            out[name] = best(lambda: call(x, x, x, window, initial_state=state, output_final_state=True))
            out["ops:" + name] = ops(lambda: call(x, x, x, window, initial_state=state, output_final_state=True))
print(json.dumps(out))
'''


def run_tree(tree: str, config: list) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(config)], env=env, cwd="/", check=True,
                         capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the old source tree (a checkout holding sketchlab/)")
    parser.add_argument("--new", default=str(ROOT), help="the new source tree (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="T = 256, 512, decode at 2048, 2 rounds of 2")
    parser.add_argument("--out", default=str(ROOT / "analysis" / "results" / "bench_versions.md"))
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.reps, config = 2, 2, [[256, 512], 2, 2048]
    else:
        config = [[1024, 2048, 4096, 8192], args.reps, 32768]
    started = time.time()
    load0 = os.getloadavg()
    best: dict[str, dict[str, float]] = {"old": {}, "new": {}}
    count: dict[str, dict[str, int]] = {"old": {}, "new": {}}  # ATen operations per call (the same every round)
    for r in range(args.rounds):
        for side, tree in (("old", args.old), ("new", args.new)) if r % 2 == 0 else (("new", args.new), ("old", args.old)):
            for name, t in run_tree(tree, config).items():
                if name.startswith("ops:"):
                    count[side][name[4:]] = t
                else:
                    best[side][name] = min(t, best[side].get(name, float("inf")))
            print(f"round {r + 1}/{args.rounds} {side} done", file=sys.stderr)
    rows = [(name, best["old"][name], best["new"][name]) for name in best["old"]]
    ops_cell = lambda side, name: str(count[side][name]) if name in count[side] else ""  # noqa: E731
    worst = max(n / o for _, o, n in rows)
    lines = ["# Speed kept: the attention calls in two source trees, side by side", "",
             f"Command: `.venv/bin/python analysis/bench_versions.py --old OLD --rounds {args.rounds} --reps {args.reps}"
             f"{' --quick' if args.quick else ''}` "
             f"(OLD: a checkout of the tree before the change; here `{args.old}`)", "",
             "B = 1, H = 2, D = Dv = 128, LLoPS m = 128 (p = 2, equal factors), float32, causal, one thread; the old "
             "tree through `llops_attention`, the new through `linear_attention` on an `LLoPSMap` of the same Θ; "
             f"each time the best of {args.reps} calls by process CPU time, then the best of {args.rounds} rounds "
             f"(the trees alternate). Wall time {time.time() - started:.0f} s; load average before "
             f"{load0[0]:.1f}, after {os.getloadavg()[0]:.1f} (a shared 2-core machine).", "",
             "`ATen ops`: the ATen operations one call runs in each tree (`torch.profiler`; forward and decode "
             "calls), a count no machine load changes.", "",
             "| call | old (s) | new (s) | new ÷ old | ATen ops old | ATen ops new |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {o:.5f} | {n:.5f} | {n / o:.3f} | {ops_cell('old', name)} | {ops_cell('new', name)} |"
              for name, o, n in rows]
    lines += ["", f"Worst ratio: **{worst:.3f}** (kept: ≤ 1.05)."]
    text = "\n".join(lines) + "\n"
    sys.path.insert(0, str(ROOT))
    from sketchlab.io.atomic import write_text_atomic

    write_text_atomic(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
