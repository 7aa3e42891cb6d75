"""Passkey retrieval at longer contexts for rows of the memory study (issue 34's moonshot: 4096 tokens).

Builds the teacher and the training-free rows of ``analysis/memory_lm.py`` exactly as that study does
(its ``models``/``build``, the same options) and runs :func:`sketchlab.evaluate.passkey_accuracy` at
``--lengths``; writes ``analysis/results/memory_passkey.md``.

    python analysis/memory_passkey.py --rows teacher,cache --lengths 4096 --n 1
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linearize_lm import log  # noqa: E402
from memory_lm import RESULTS, build, models  # noqa: E402
from memory_lm import parse_args as study_args

from sketchlab.evaluate import passkey_accuracy  # noqa: E402
from sketchlab.hf.pretrained import load_pretrained, smollm2_gguf  # noqa: E402
from sketchlab.io.atomic import atomic_write  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="teacher,cache", help="rows of memory_lm.py (training-free ones)")
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    command = "python analysis/memory_passkey.py " + " ".join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    depths = tuple(float(x) for x in args.depths.split(","))
    study = study_args([])  # the study's defaults: map, m, window, sinks, cache
    specs = {s["name"]: s for s in models(study)}
    unknown = [r for r in args.rows.split(",") if r not in specs]
    if unknown:
        raise SystemExit(f"--rows: unknown row(s) {unknown}; rows: {sorted(specs)}")
    trained = [r for r in args.rows.split(",") if specs[r].get("transfer")]
    if trained:
        raise SystemExit(f"--rows: {trained} need stage-1 transfer; this script runs the training-free rows")
    teacher, tok = load_pretrained(gguf=smollm2_gguf())
    teacher.eval()
    lines = ["# Passkey retrieval at longer contexts (memory study rows)", "",
             f"Produced by `{command}` ({platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)). "
             f"Rows built as `analysis/memory_lm.py` builds them ({study.map} m = {study.m}, window {study.window} + "
             f"{study.sinks} sinks, cache {study.cache}); {args.n} prompt(s) per length × depth, keys drawn with seed 0.",
             "", "| model | " + " | ".join(f"{n}@{d}" for n in lengths for d in depths) + " | all | minutes |",
             "|---|" + "---:|" * (len(lengths) * len(depths) + 2)]
    for name in args.rows.split(","):
        spec = specs[name]
        t = time.perf_counter()
        model = teacher if spec["convert"] is None else build(teacher, spec, None, study)
        pk = passkey_accuracy(model, tok, lengths=lengths, depths=depths, n=args.n, seed=0)
        minutes = (time.perf_counter() - t) / 60
        log(f"{name}: {pk.rate} ({minutes:.1f} min); generated {pk.generated}")
        lines.append(f"| {spec.get('label', name)} | " + " | ".join(f"{pk.rate[(n, d)]:.2f}" for n in lengths
                                                                    for d in depths)
                     + f" | {pk.overall:.2f} | {minutes:.1f} |")
        with atomic_write(RESULTS / "memory_passkey.md") as tmp:
            tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
