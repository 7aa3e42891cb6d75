"""Default intra-op threads against one thread: the README tour and ``fit_sketch("llops")`` on one
head of d = 32, n = 16384 (p = 2, m = 64), each in a fresh process, side by side in one run.

"default" runs with the environment as it is (no ``OMP_NUM_THREADS``: torch takes one thread per
core, and the library's hot loops pick their own count, :mod:`sketchlab._threads`); "1 thread"
sets ``OMP_NUM_THREADS=1``. The two alternate, ``--repeat`` times each. The tour is the README's
``python`` block, run from the repository root as written. Writes ``analysis/results/threads.md``.

Usage: ``python analysis/bench_threads.py [--repeat 1] [--skip-tour]``
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FIT = """
import sys, torch
from bench_fit import standin_qk
import sketchlab as sl
q, k = standin_qk(shape=(1, 1, 16384, 32), seed=0)
q, k = q[0, 0] * 32**-0.25, k[0, 0] * 32**-0.25
fit = sl.fit_sketch("llops", q, k, p=2, m=64)
print(torch.get_num_threads(), float(fit.report.optimality_ratio))
"""


def tour() -> str:
    """The README's tour: its first ```python block."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def run(code: str, one_thread: bool, library: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = f"{library}{os.pathsep}{ROOT / 'analysis'}"
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--skip-tour", action="store_true")
    ap.add_argument("--library", default=str(ROOT), help="directory holding the sketchlab package to time "
                    "(e.g. a checkout of an earlier commit); default: this repository")
    ap.add_argument("--out", default=str(ROOT / "analysis/results/threads.md"))
    args = ap.parse_args()
    cases = ([("README tour", tour())] if not args.skip_tour else []) + [("fit_sketch(\"llops\"), d = 32, n = 16384", FIT)]
    load = tuple(round(x, 1) for x in os.getloadavg())
    rows = []
    for name, code in cases:
        times = {"default": [], "1 thread": []}
        for _ in range(args.repeat):
            times["default"].append(run(code, False, Path(args.library)))
            times["1 thread"].append(run(code, True, Path(args.library)))
        med = {key: statistics.median(v) for key, v in times.items()}
        rows.append(f"| {name} | {', '.join(f'{t:.1f}' for t in times['default'])} | "
                    f"{', '.join(f'{t:.1f}' for t in times['1 thread'])} | {med['default'] / med['1 thread']:.2f}× |")
        print(rows[-1], flush=True)
    cmd = "python analysis/bench_threads.py" + (f" --repeat {args.repeat}" if args.repeat != 1 else "") + \
        (" --skip-tour" if args.skip_tour else "") + (f" --library {args.library}" if args.library != str(ROOT) else "")
    text = "\n".join([
        "# Default threads against one intra-op thread\n",
        f"`{cmd}` — finished {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} cores, `os.getloadavg()` = {load} at the start (a shared machine: compare within a row); "
        f"sketchlab from `{args.library}`.\n",
        "Wall seconds of a fresh process each (imports included), alternating default / one thread.\n",
        "| workload | default s | 1 thread s | default ÷ 1 thread (medians) |",
        "|---|---|---|---|",
        *rows,
    ]) + "\n"
    print(text)
    from sketchlab.io import atomic_write

    with atomic_write(args.out) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
