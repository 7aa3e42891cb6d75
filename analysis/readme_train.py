"""The README's ``sketchlab train`` lines (and the ``torchrun ... train`` line), run exactly as written,
each in a fresh temporary directory: their final line (``... held-out accuracy X after N steps ...``),
wall time and CPU time, written to ``analysis/results/readme_train.md``, so the accuracy figures
the README quotes come from a results file.

The commands are read from README.md by ``tests/test_readme.py``'s parser (the same lines
``make readme-check`` runs); nothing is changed in them. CPU time is the children's user + system
time (``resource.getrusage``), all processes of the command together.

Usage::

    python analysis/readme_train.py                  # every train line
    python analysis/readme_train.py --nice 19        # at low priority on a shared machine
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = re.compile(r"^(sketchlab train|torchrun .* -m sketchlab\.cli -- train) ")
FINAL = re.compile(r"held-out accuracy (\S+) after (\d+) steps")


def readme_train_lines() -> list[str]:
    """The README's train commands, in order (``tests/test_readme.py``'s parser)."""
    spec = importlib.util.spec_from_file_location("_test_readme", ROOT / "tests" / "test_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [c for c in module.readme_commands() if TRAIN.match(c)]


def run(command: str, nice: int) -> dict:
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory(prefix="readme-train-") as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run(["nice", "-n", str(nice), "bash", "-c", command], cwd=tmp, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [line for line in proc.stdout.splitlines() if FINAL.search(line)]
    final = lines[-1].strip() if lines else None
    hit = FINAL.search(final) if final else None
    return {"command": command, "exit": proc.returncode, "wall": wall, "cpu": cpu, "final": final,
            "accuracy": float(hit.group(1)) if hit else None, "steps": int(hit.group(2)) if hit else None,
            "tail": proc.stdout[-2000:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nice", type=int, default=0, help="niceness of every command (0-19)")
    ap.add_argument("--out", type=Path, default=ROOT / "analysis" / "results" / "readme_train.md")
    args = ap.parse_args(argv)
    if not 0 <= args.nice <= 19:
        print(f"readme_train: --nice must be in [0, 19], got {args.nice}", file=sys.stderr)
        return 2
    commands = readme_train_lines()
    if not commands:
        print("readme_train: README.md has no `sketchlab train` line", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = []
    for c in commands:
        print(f"running: {c}", flush=True)
        results.append(run(c, args.nice))
        r = results[-1]
        print(f"  exit {r['exit']}, {r['wall']:.0f} s wall, {r['cpu']:.0f} s CPU: {r['final']}", flush=True)
    import torch

    import sketchlab

    L = ["# The README's `sketchlab train` lines, run as written", "",
         "`" + " ".join(["python analysis/readme_train.py", *(sys.argv[1:] if argv is None else argv)]) + "`",
         "", f"Started {started}; {platform.machine()}, torch {torch.__version__}, sketchlab {sketchlab.__version__}; "
         f"load average {load:.1f} at the start (a shared 2-core machine: wall times are upper bounds; CPU time "
         "is every process of the command together). Each command ran in a fresh temporary directory"
         + (f" at niceness {args.nice}" if args.nice else "") + ".", "",
         "| command | exit | held-out accuracy | steps | wall s | CPU s |", "|---|---|---|---|---|---|"]
    for r in results:
        acc = "–" if r["accuracy"] is None else f"{r['accuracy']:.4f}"
        L.append(f"| `{r['command']}` | {r['exit']} | {acc} | {r['steps'] or '–'} | {r['wall']:.0f} | {r['cpu']:.0f} |")
    L += ["", "Final lines as printed:", ""] + [f"- `{r['final']}`" for r in results] + [""]
    for r in results:
        if r["exit"] != 0:
            L += [f"Output tail of `{r['command']}`:", "", "```", r["tail"], "```", ""]
    from sketchlab.io import atomic_write

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(args.out) as tmp:
        Path(tmp).write_text("\n".join(L) + "\n")
    print("\n".join(L))
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
