"""Why DeltaNet-style identity features + delta rule score chance on the study harness (issue 41, item 1).

``mqar_delta.md`` (a record, its script retired for ``sketchlab frontier``; the ``paper_training.py --quick`` harness) has the identity map with
``state="delta"`` at 0.018 after 800 steps, while ``sketchlab train``'s own MQAR task (issue 41's setting) trains
it to 0.96-0.99. The two settings differ in seven places; this script starts from the harness and changes one
at a time to ``sketchlab train``'s value (and then all of them), on one core, one seed, so that each row's gap to
the first row is the effect of that one setting.

Every run is :func:`sketchlab.tasks.train_mqar` on a 2-layer, d_model 64, one-head :class:`TransformerLM` with
``attention="identity", state="delta"`` (the harness's model builder, its optimiser and schedule). The score is
held-out accuracy on the run's own training distribution (the mixture's mean over its components, as
``train_mqar`` reports it), read every 200 steps.

Usage::

    python analysis/delta_diagnosis.py              # runs what is missing in --work, then writes the report
    python analysis/delta_diagnosis.py --report-only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: The harness's setting (mqar_delta.md's: paper_training's QUICK scale, key identity-delta-nope).
HARNESS = {"task": "zoology-mixture", "rope": False, "short_conv": 3, "weight_decay": 0.1, "kernel_lr": 1.0,
           "warmup": 40, "beta": "head", "lr": 3e-3}
#: sketchlab train's value of each (issue 41: vocab 256, 16 pairs, 128 tokens, defaults otherwise).
TRAIN_CLI = {"task": "compact-256-16-128", "rope": True, "short_conv": 2, "weight_decay": 0.0, "kernel_lr": 0.1,
             "warmup": 30, "beta": "input", "lr": 3e-3}


#: The harness's training mixture (Zoology's at a quarter of its lengths).
QUARTER = ((16, 1), (32, 2), (64, 4), (64, 8), (64, 16))
#: The tasks, taking the harness's apart: layout (Zoology's random non-query tokens, or the filler 0),
#: lengths (the mixture, or sketchlab train's one (T, P) = (128, 16)) and vocabulary.
TASKS = {
    "zoology-mixture": lambda: _mixture(512, True),  # the harness
    "compact-256-16-128": lambda: _config(256, 16, 128, "compact", True),  # sketchlab train's
    "zoology-mixture-quiet": lambda: _mixture(512, False),  # the harness, non-queries the filler 0
    "zoology-256-16-128": lambda: _config(256, 16, 128, "zoology", True),  # sketchlab train's lengths, Zoology's layout
    "zoology-256-16-128-quiet": lambda: _config(256, 16, 128, "zoology", False),
}


def _mixture(vocab: int, noise: bool):
    from sketchlab.tasks import zoology_mixture

    return zoology_mixture(vocab, pairs=QUARTER, random_non_queries=noise)


def _config(vocab: int, pairs: int, seq_len: int, layout: str, noise: bool):
    from sketchlab.tasks import MQARConfig

    return MQARConfig(vocab, pairs, seq_len, layout=layout, **({} if layout == "compact" else
                                                                 {"random_non_queries": noise}))


def variants() -> dict[str, dict]:
    """Name -> setting: the harness, the harness with one setting of ``sketchlab train``, ``sketchlab train``'s,
    then the harness on each task of :data:`TASKS` (which part of the task matters)."""
    out = {"harness": dict(HARNESS)}
    for key, value in TRAIN_CLI.items():
        if HARNESS[key] != value:
            out[f"harness, {key}={value}"] = {**HARNESS, key: value}
    out["sketchlab train (all seven)"] = dict(TRAIN_CLI)
    for task in TASKS:
        out.setdefault(f"harness, task={task}", {**HARNESS, "task": task})
    out["sketchlab train, task=zoology-256-16-128"] = {**TRAIN_CLI, "task": "zoology-256-16-128"}
    return out


def run(name: str, setting: dict, steps: int, seed: int, work: Path) -> dict:
    """One training run of ``setting`` (cached as ``work/<slug>.json``)."""
    import torch

    from sketchlab.tasks import TransformerConfig, TransformerLM
    from sketchlab.tasks.train import train_mqar

    slug = "_".join(f"{k}-{setting[k]}" for k in sorted(setting)) + f"_n{steps}_s{seed}"
    path = work / f"{slug}.json"
    if path.is_file():
        return json.loads(path.read_text())
    torch.set_num_threads(1)
    task = TASKS[setting["task"]]()
    torch.manual_seed(seed)
    model = TransformerLM(TransformerConfig(
        vocab_size=task.vocab_size, d_model=64, n_heads=1, n_layers=2, mlp_ratio=2, short_conv=setting["short_conv"],
        attention="identity", attention_options={"state": "delta", "beta": setting["beta"]},
        rope_base=10000.0 if setting["rope"] else None))
    t0 = time.perf_counter()
    result = train_mqar(model, [(task, steps)], batch_size=64, lr=setting["lr"], weight_decay=setting["weight_decay"],
                        kernel_lr=setting["kernel_lr"], warmup=setting["warmup"], clip=1.0, seed=seed,
                        eval_sequences=128, eval_every=200, progress=False)
    out = {"name": name, "setting": setting, "steps": steps, "seed": seed, "seconds": time.perf_counter() - t0,
           "curve": [[e["step"], e["heldout_accuracy"]] for e in result.evals],
           "accuracy": result.heldout_accuracy}
    from sketchlab.io import atomic_write

    work.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        Path(tmp).write_text(json.dumps(out, indent=1) + "\n")
    return out


def report(runs: list[dict], command: str) -> str:
    base = next((r["accuracy"] for r in runs if r["name"] == "harness"), float("nan"))
    steps = sorted({s for r in runs for s, _ in r["curve"]})
    lines = ["# Why the delta rule did not learn on the study harness (issue 41)", "",
             (f"Generated by `{command}`; one seed, one thread per run, {sum(r['seconds'] for r in runs) / 60:.1f} "
             "min of training in all. Model: 2 layers, d_model 64, one head, mlp ratio 2, identity features with "
             "the delta rule (q, k L2-normalised inside the rule), batch 64, AdamW, clip 1, warm-up then cosine. "
             "Accuracy: held-out, on the run's own training distribution."), "",
             "| setting | " + " | ".join(f"step {s}" for s in steps) + " | final − harness | s |",
             "|---|" + "---|" * len(steps) + "---|---|"]
    for r in runs:
        curve = dict(r["curve"])
        lines.append(f"| {r['name']} | " + " | ".join(f"{curve[s]:.3f}" if s in curve else "" for s in steps)
                     + f" | {r['accuracy'] - base:+.3f} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="variant names separated by ';' (default: all)")
    ap.add_argument("--work", type=Path, default=ROOT / "analysis" / "results" / "delta_diagnosis_runs")
    ap.add_argument("--out", type=Path, default=ROOT / "analysis" / "results" / "delta_diagnosis.md")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    wanted = [n for n in args.only.split(";") if n] or list(variants())
    runs = []
    for name in wanted:
        setting = variants()[name]
        if args.report_only:
            slug = "_".join(f"{k}-{setting[k]}" for k in sorted(setting)) + f"_n{args.steps}_s{args.seed}"
            if not (args.work / f"{slug}.json").is_file():
                continue
        runs.append(run(name, setting, args.steps, args.seed, args.work))
        print(f"{name}: {runs[-1]['accuracy']:.3f} ({runs[-1]['seconds']:.0f} s)", flush=True)
    text = report(runs, "python analysis/delta_diagnosis.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    from sketchlab.io import atomic_write

    with atomic_write(args.out) as tmp:
        Path(tmp).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
