"""The call path of one ``compare(dump)``: which sketchlab modules and functions it runs through, and
how often it enters the shared validation helpers (``sketchlab._validation``).

Measured with ``sys.setprofile`` (every Python-level call; C functions are not counted). A call is a
*step* when it enters a sketchlab function from another sketchlab function (or from this script);
the distinct (module, function) pairs are the functions visited. Validation entries are the calls
into ``sketchlab/_validation.py`` made from outside it (a helper calling another helper counts once).

Usage: ``python analysis/call_path.py [--methods optimal] [--out analysis/results/call_path.md]``.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

import sketchlab as sl
from sketchlab.io import atomic_write

ROOT = pathlib.Path(sl.__file__).resolve().parent
VALIDATION = str(ROOT / "_validation.py")


def _module(filename: str) -> str | None:
    if filename.startswith("<"):
        return None
    try:
        rel = pathlib.Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    parts = ["sketchlab", *rel.with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def trace(fn):
    """Run ``fn()`` under a profiler; returns (calls, validation) counters."""
    calls: collections.Counter = collections.Counter()        # (module, qualname) -> calls
    validation: collections.Counter = collections.Counter()   # (helper, caller) -> calls
    cache: dict = {}

    def prof(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        mod = cache.get(code.co_filename, 0)
        if mod == 0:
            mod = cache[code.co_filename] = _module(code.co_filename)
        if mod is None or code.co_name in ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>"):
            return
        calls[(mod, code.co_qualname)] += 1
        if code.co_filename == VALIDATION:
            caller = frame.f_back
            if caller is not None and caller.f_code.co_filename != VALIDATION:
                cmod = _module(caller.f_code.co_filename) or "?"
                validation[(code.co_name, f"{cmod}.{caller.f_code.co_qualname}")] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls, validation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", default="data/mqar_softmax_qk.safetensors")
    ap.add_argument("--methods", default="optimal", help="comma-separated (default: optimal, the shortest path)")
    ap.add_argument("--layers", default="0")
    ap.add_argument("--p", type=int, default=2)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the table to this .md file (atomically)")
    args = ap.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    dump = sl.load_qk(args.dump)
    calls, validation = trace(lambda: sl.compare(dump, p=args.p, m=args.m, methods=args.methods, layers=layers,
                                                 progress=False))
    modules = sorted({mod for mod, _ in calls})
    lines = [
        "# The call path of one compare(dump)\n",
        f"`python analysis/call_path.py --methods {args.methods} --layers {args.layers}` on `{args.dump}` "
        f"(p = {args.p}, m = {args.m}; the dump loaded before the trace; sketchlab from `{ROOT}`).\n",
        f"- sketchlab modules entered: {len(modules)} ({', '.join(modules)})",
        f"- distinct sketchlab functions visited: {len(calls)}; calls into them: {sum(calls.values())}",
        f"- entries into the shared validation helpers (sketchlab._validation): {sum(validation.values())}, of which "
        f"input checks {sum(n for (h, _), n in validation.items() if h != 'check_memory')} and memory-budget checks "
        f"before an allocation (check_memory) {sum(n for (h, _), n in validation.items() if h == 'check_memory')}\n",
        "| helper | called from | calls |", "|---|---|---|",
    ]
    lines += [f"| {h} | {c} | {n} |" for (h, c), n in sorted(validation.items(), key=lambda kv: (-kv[1], kv[0]))]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with atomic_write(args.out) as tmp:
            pathlib.Path(tmp).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
