"""The fit's own report against the optimum: ``fit_sketch("llops")`` with its report, the fit alone,
and ``optimal_sketch`` on the same heads, side by side in one run.

Cases: one head of the seeded stand-in (``bench_fit.standin_qk``) with d = 32, n = 16384, p = 2,
m = 64 (the compressed route), and every head of the shipped dump (16 heads, n = 512). Inputs are
scaled by d^-1/4 here. The report's time is the fit call's wall time minus the fit's own
(``report.seconds``); timed as CPU seconds of this process and wall seconds. ``--exact`` adds a row with the report forced exact
(``EXACT_REPORT_ENTRIES`` = ∞: rel_mae over every entry). Writes ``analysis/results/report.md``.

Usage: ``python analysis/bench_report.py [--threads 1] [--exact] [--out analysis/results/report.md]``
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fit import standin_qk  # noqa: E402

import sketchlab.fit  # noqa: E402
from sketchlab import fit_sketch, load_qk, optimal_sketch, sketch_fitter  # noqa: E402
from sketchlab.io import atomic_write  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _timed(fn):
    """``(wall s, CPU s of this process, result)``; CPU time is the steadier measure on a shared machine."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def _case(name, q, k, exact: bool) -> list[str]:
    d = q.shape[-1]
    q, k = q * d**-0.25, k * d**-0.25
    runs = {"optimal_sketch": _timed(lambda: optimal_sketch(q, k, 2, 64)),
            "fit alone (no report)": _timed(lambda: sketch_fitter("llops")(q, k, p=2, m=64, seed=0)),
            "fit_sketch (fit + report)": _timed(lambda: fit_sketch("llops", q, k, p=2, m=64))}
    if exact:
        saved = sketchlab.fit.EXACT_REPORT_ENTRIES
        sketchlab.fit.EXACT_REPORT_ENTRIES = math.inf
        try:
            runs["fit_sketch, report forced exact"] = _timed(lambda: fit_sketch("llops", q, k, p=2, m=64))
        finally:
            sketchlab.fit.EXACT_REPORT_ENTRIES = saved
    again = _timed(lambda: optimal_sketch(q, k, 2, 64))  # the optimum again: the lower of the two is the yardstick
    base_wall, base_cpu = min(runs["optimal_sketch"][0], again[0]), min(runs["optimal_sketch"][1], again[1])
    rows = []
    for label, (wall, cpu, out) in runs.items():
        extra = ""
        if label.startswith("fit_sketch"):
            rep = out.report
            extra = (f"rows {rep.info.get('rel_mae_rows', 'all')}: rel_mae {rep.rel_mae.median().item():.5f}"
                     + (f" (se {rep.info['rel_mae_se'].median().item():.5f})" if "rel_mae_se" in rep.info else "")
                     + f", ×optimum {rep.optimality_ratio.median().item():.4f}")
        rows.append(f"| {name} | {label} | {cpu:.2f} | {cpu / base_cpu:.2f}× | {wall:.2f} | {wall / base_wall:.2f}× | {extra} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--exact", action="store_true")
    ap.add_argument("--no-dump", action="store_true", help="only the stand-in head")
    ap.add_argument("--dump", default=str(ROOT / "data/mqar_softmax_qk.safetensors"))
    ap.add_argument("--out", default=str(ROOT / "analysis/results/report.md"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cmd = "python analysis/bench_report.py" + (f" --threads {args.threads}" if args.threads else "") + \
        (" --exact" if args.exact else "") + (" --no-dump" if args.no_dump else "")
    q, k = standin_qk(shape=(1, 1, 16384, 32), seed=0)
    dump = load_qk(args.dump)
    lines = [
        "# The fit's report: fit_sketch(\"llops\") with and without its report, against optimal_sketch\n",
        f"`{cmd}` — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"sketchlab from `{Path(sketchlab.__file__).parent}`, torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s) set, `os.getloadavg()` = "
        f"{tuple(round(x, 1) for x in __import__('os').getloadavg())} at the start (a shared machine: compare rows of this run).\n",
        "p = 2, m = 64, inputs × d^-1/4. Ratios against `optimal_sketch` on the same heads (the lower of a run "
        "before and one after the fits). CPU seconds of this process are the steadier measure on a loaded machine; "
        "wall seconds beside them. Medians over heads in the last column.\n",
        "| heads | call | CPU s | ÷ optimal (CPU) | wall s | ÷ optimal (wall) | report |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += _case("stand-in, 1 head, d = 32, n = 16384", q[0, 0], k[0, 0], args.exact)
    if not args.no_dump:
        lines += _case(f"`{Path(args.dump).name}`, {dump.q.shape[0] * dump.q.shape[1]} heads, n = {dump.q.shape[2]}",
                       dump.q.double(), dump.k.double(), args.exact)
    text = "\n".join(lines) + "\n"
    print(text)
    with atomic_write(args.out) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
