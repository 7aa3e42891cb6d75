"""Hand-made mutants of the kinds issue 21 found surviving, each against the tests meant to kill it.

For each row below, a temporary copy of ``sketchlab/`` and ``tests/`` gets one textual change (the
mutant); the named test files run against the copy (``-x``, one process); the mutant is *killed*
when they fail. Writes ``analysis/results/hand_mutants.md``: every mutant with its outcome, and the
kill rate with its 95% Wilson interval. This is a targeted sample (the mutants the last mutation
run left alive, plus the new checks of this round), not an unbiased estimate of a module's score:
``analysis/mutation.py`` (mutmut) gives that.

Usage (repository root)::

    .venv/bin/python analysis/hand_mutants.py
"""

from __future__ import annotations

import datetime
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "analysis" / "results" / "hand_mutants.md"

#: (area, file, original text, mutant text, test files, what the mutant does)
MUTANTS = [
    ("training", "sketchlab/tasks/train.py", "ramp = min(1.0, (s + 1) / warmup) if warmup else 1.0", "ramp = 1.0",
     ["tests/test_train_optimizer.py"], "learning-rate warm-up removed"),
    ("training", "sketchlab/tasks/model.py", "            if id(p) not in own:\n", "            if True:\n",
     ["tests/test_train_optimizer.py"], "weight decay applied to Θ"),
    ("training", "sketchlab/tasks/train.py", "        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)",
     "        pass", ["tests/test_train_optimizer.py"], "gradient clipping removed"),
    ("training", "sketchlab/tasks/checkpoint.py", "if t.is_floating_point() and not bool(torch.isfinite(t).all()):",
     "if False:", ["tests/test_bad_input_commands.py"], "checkpoint finiteness check removed"),
    ("verify", "sketchlab/verify.py", 'worst["theorem_3_1" if route == "svd" else "routes"]', 'worst["theorem_3_1"]',
     ["tests/test_verify.py"], "routes check never fed the qr route"),
    ("verify", "sketchlab/verify.py", "        if m >= rank:", "        if m > rank:", ["tests/test_verify.py"],
     "m == numerical rank treated as checkable"),
    ("verify", "sketchlab/verify.py", 'worst["theorem_3_4_identity"].add(abs(res.value - best) / best, 1e-8',
     'worst["theorem_3_4_identity"].add(0 * abs(res.value - best) / best, 1e-8', ["tests/test_verify.py"],
     "τ vs 2-norm check disabled"),
    ("advise", "sketchlab/advise.py", "c = min(max_m, max(lo, predicted, math.ceil(1.05 * c)))",
     "c = min(max_m, max(lo, math.ceil(1.05 * c)))", ["tests/test_advise.py"], "bracket ignores the prediction"),
    ("advise", "sketchlab/advise.py", "        mid = (lo + hi) // 2", "        mid = lo", ["tests/test_advise.py"],
     "bisection becomes a linear scan"),
    ("export", "sketchlab/export.py", "        return None", "        return value", ["tests/test_export.py"],
     "NaN kept in the JSON errors"),
    ("export", "sketchlab/export.py", "shape6 = (1,) * (2 - len(lead)) + lead", "shape6 = lead + (1,) * (2 - len(lead))",
     ["tests/test_export.py"], "a [H] Θ stored as [H, 1] (heads as layers)"),
    ("scaling", "sketchlab/scaling.py", "math.isfinite(scale) or scale <= 0", "math.isfinite(scale) or scale < 0",
     ["tests/test_scaling.py"], "scale = 0 accepted"),
    ("scaling", "sketchlab/scaling.py", "qᵀk → {factor * factor:.6g}·qᵀk", "qᵀk → {factor:.6g}·qᵀk",
     ["tests/test_scaling.py"], "describe_scale states the wrong effect"),
    ("spectrum", "sketchlab/spectrum.py", "return (self.singular_values[..., m:] ** 2).sum(-1)",
     "return (self.singular_values[..., m + 1:] ** 2).sum(-1)", ["tests/test_spectrum.py"], "KernelSpectrum.tail off by one"),
    ("spectrum", "sketchlab/spectrum.py", "return (captured >= need).to(torch.int64).argmax(-1) + 1",
     "return (captured > need).to(torch.int64).argmax(-1) + 2", ["tests/test_spectrum.py"], "energy_rank off by one"),
    ("LM", "sketchlab/llops/fit_lm.py", "damping / 3, torch.where", "damping / 2, torch.where",
     ["tests/test_llops_fits.py"], "LM damping decrease ÷2 instead of ÷3"),
    ("LM", "sketchlab/llops/fit_lm.py", "take & (gain >= 0.25), damping, damping * 2",
     "take & (gain >= 0.25), damping, damping", ["tests/test_llops_fits.py"], "LM damping never raised"),
    ("LM", "sketchlab/llops/fit_lm.py", "take = torch.isfinite(new) & (new < loss)", "take = torch.isfinite(new)",
     ["tests/test_llops_fits.py"], "LM step never rejected"),
    ("LM", "sketchlab/llops/fit_lm.py", "(gain > 0.75)", "(gain > 0.5)", ["tests/test_llops_fits.py"],
     "LM 'good step' threshold moved"),
    ("cli", "sketchlab/cli/_common.py", "clash = input_files.get(real) or input_ids.get(_identity(real))",
     "clash = input_files.get(real)", ["tests/test_cli_outputs.py"], "hard links to the input not refused"),
    ("cli", "sketchlab/cli/_common.py", "                    tmp = stack.enter_context(atomic_write(path))",
     "                    tmp = Path(path)", ["tests/test_cli_outputs.py"], "outputs written in place, not all-or-nothing"),
    ("cli", "sketchlab/cli/spectrum.py", 'description=HELP.replace("%%", "%")', "description=HELP",
     ["tests/test_cli_outputs.py"], "spectrum --help prints 99%%"),
    ("cli", "sketchlab/cli/train.py", "    if need > budget:", "    if False:", ["tests/test_bad_input_commands.py"],
     "train memory budget removed"),
    ("attention", "sketchlab/attention/functional.py",
     "    check_llops_kernel_range(q, k, theta_q, theta_k, non_negative=non_negative)",
     "    pass", ["tests/test_bad_input_values.py"], "Θ magnitude check removed"),
]


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return 0.0, 1.0
    phat = k / n
    centre = (phat + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def run_one(area, path, old, new, tests) -> tuple[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in ("sketchlab", "tests", "data"):
            shutil.copytree(ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
        target = work / path
        text = target.read_text()
        if old not in text:
            return "not applied (text not found)", 0.0
        target.write_text(text.replace(old, new, 1))
        env = {**os.environ, "PYTHONPATH": str(work), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "0", *tests],
                              cwd=work, env=env, capture_output=True, text=True, timeout=900)
        return ("killed" if proc.returncode != 0 else "SURVIVED"), time.perf_counter() - start


def main() -> int:
    from sketchlab.io import atomic_write

    rows, killed, checked = [], 0, 0
    for area, path, old, new, tests, what in MUTANTS:
        outcome, seconds = run_one(area, path, old, new, tests)
        print(f"{outcome:9s} {area:10s} {what} ({seconds:.0f} s)", flush=True)
        if outcome in ("killed", "SURVIVED"):
            checked += 1
            killed += outcome == "killed"
        rows.append(f"| {area} | {what} | `{path}` | {', '.join(t.split('/')[-1] for t in tests)} | {outcome} |")
    lo, hi = wilson(killed, checked)
    text = "\n".join([
        "# Hand-made mutants (issue 21's survivors and this round's checks)",
        "",
        f"Command: `.venv/bin/python analysis/hand_mutants.py` ({datetime.date.today().isoformat()}). Each mutant is one "
        "textual change in a temporary copy; the listed tests run against it (`pytest -x`, one process).",
        "A targeted sample, not an unbiased module score (that is `analysis/mutation.py`).",
        "",
        f"**{killed} of {checked} killed** (95% Wilson interval {lo:.3f}–{hi:.3f}).",
        "",
        "| area | mutant | file | tests | outcome |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ])
    with atomic_write(OUT) as tmp:
        tmp.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}: {killed}/{checked} killed, Wilson 95% {lo:.3f}-{hi:.3f}")
    return 0 if killed == checked else 1


if __name__ == "__main__":
    sys.exit(main())
