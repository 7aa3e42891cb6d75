"""Which normalisation trains LLoPS attention best on MQAR (issue 19's measurement, CPU-sized).

Arms, each a learnable LLoPS model on the same small MQAR task, budget and seeds (training from a
fresh random Θ with equal factors, so every arm starts from the same non-negative kernel):

* ``sum, signed`` — ``normalize="sum"`` on the raw map (today's toy-model default; a rank-1 map can
  be signed once its factors differ, and the denominator check counts the calls that meet a
  denominator <= 0 — but from the equal-factor start the gradients of the ``p`` factors of a
  feature are equal, so they stay equal and the kernel stays non-negative in training: the
  count is 0 and this arm measures the raw ``(θ·q)²(θ·k)²`` kernel with "sum");
* ``sum, self-tensored`` — ``non_negative=True`` (``φ ⊗ φ``, ``m = 8`` → 64 features, PSF's square);
* ``none`` — unnormalised linear attention;
* ``hybrid w=4 (shared denominator)`` — ``window=4`` exact softmax keys + the sketch, one denominator.

Writes ``analysis/results/normalization_mqar.md`` (final held-out accuracy, mean and range over
seeds, and how many steps raised the denominator warning). Usage::

    python analysis/normalization_mqar.py [--steps 200] [--seeds 0,1]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sketchlab.tasks.attention  # noqa: E402,F401  (registers the sketched kernels)
from sketchlab.attention import count_denominators  # noqa: E402
from sketchlab.io import atomic_write  # noqa: E402
from sketchlab.tasks import MQARConfig, TransformerConfig, TransformerLM, train_mqar  # noqa: E402

ARMS = {
    "sum, signed (m=64)": {"m": 64, "normalize": "sum"},
    "sum, self-tensored (m=8 → 64 features)": {"m": 8, "normalize": "sum", "non_negative": True},
    "none (m=64)": {"m": 64, "normalize": "none"},
    "hybrid w=4 softmax + sketch, shared denominator (m=64)": {"m": 64, "normalize": "sum", "window": 4},
}


def run(arm: dict, seed: int, steps: int) -> tuple[float, int, float]:
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=65, d_model=64, n_heads=4, n_layers=2, mlp_ratio=2, attention="llops",
                            short_conv=2, attention_options=dict(arm, backend="torch"))
    model = TransformerLM(cfg)
    task = MQARConfig(vocab_size=65, num_pairs=4, seq_len=32)
    t0 = time.perf_counter()
    with count_denominators() as counts:
        res = train_mqar(model, [(task, steps)], batch_size=16, lr=1e-2, warmup=30, seed=seed, eval_sequences=128,
                         progress=False)
    return res.heldout_accuracy, counts["calls"], time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    parser.add_argument("--out", default=str(ROOT / "analysis" / "results" / "normalization_mqar.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    t_all = time.perf_counter()
    for name, arm in ARMS.items():
        for seed in args.seeds:
            acc, bad, secs = run(arm, seed, args.steps)
            results.setdefault(name, []).append((acc, bad))
            print(f"{name:58s} seed {seed}: accuracy {acc:.3f}, denominator warnings {bad}, {secs:.0f} s", flush=True)
    wall = time.perf_counter() - t_all
    lines = [
        "# LLoPS normalisation on MQAR (issue 19)",
        "",
        "Command: `" + " ".join(["python", "analysis/normalization_mqar.py", *sys.argv[1:]]) + "`",
        "",
        f"MQAR with 4 key–value pairs, sequence length 32, vocabulary 65; 2-layer TransformerLM, d_model 64, "
        f"4 heads of 16, short conv 2, attention `llops` (p = 2, rank 1, random equal-factor Θ); AdamW lr 0.01, "
        f"30 warm-up steps then cosine, batch 16, {args.steps} steps; held-out accuracy on 128 sequences; seeds "
        f"{args.seeds}; 1 thread on a shared 2-core machine ({platform.machine()}, torch {torch.__version__}); "
        f"{wall / 60:.1f} min wall. \"warned steps\" counts training/eval calls that met a denominator <= 0.",
        "",
        "| normalisation | accuracy (mean) | min–max | warned calls (total) |",
        "|---|---:|---|---:|",
    ]
    for name, vals in results.items():
        accs = [a for a, _ in vals]
        lines.append(f"| {name} | {statistics.mean(accs):.3f} | {min(accs):.3f}–{max(accs):.3f} | "
                     f"{sum(b for _, b in vals)} |")
    best = max(results, key=lambda n: statistics.mean(a for a, _ in results[n]))
    lines += ["", f"Best mean accuracy: **{best}**. With {len(args.seeds)} seeds and 128 held-out sequences "
              "a difference below ~0.06 is within noise (see analysis/results/recall.md for the threshold).", ""]
    text = "\n".join(lines)
    with atomic_write(Path(args.out)) as tmp:
        tmp.write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
