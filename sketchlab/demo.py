"""``make demo``: the main job on a Q/K dump, printed as tables.

Run as ``python -m sketchlab.demo [DUMP]``. For now it checks Theorem 3.1 on every head: for a
sweep of sketch sizes ``m`` it prints the tail bound ``Σ_{i>m} σ_i²`` beside the squared error the
optimal sketch achieves (they must agree to round-off).
"""

from __future__ import annotations

import argparse
import sys

import torch

from .optimal import optimal_sketch
from .polynomial import poly_kernel


def theorem31_rows(q: torch.Tensor, k: torch.Tensor, p: int, sizes: list[int]) -> list[dict]:
    """One row per ``m``: median over heads of the tail, the achieved error and their worst ratio.

    ``q, k`` are ``[..., n, d]`` (already scaled); errors are relative to ``‖A‖_F²`` per head.
    """
    exact = poly_kernel(q.double(), k.double(), p)
    norm2 = (exact**2).sum((-2, -1))
    rows = []
    for m in sizes:
        best = optimal_sketch(q, k, p, m)
        achieved = ((best.kernel(q, k) - exact) ** 2).sum((-2, -1))
        rows.append({
            "m": m,
            "tail/‖A‖²": float((best.tail / norm2).median()),
            "achieved/‖A‖²": float((achieved / norm2).median()),
            "max rel. gap achieved vs tail": float((achieved / best.tail - 1).abs().max()),
        })
    return rows


def markdown_table(rows: list[dict]) -> str:
    """Render rows of equal keys as a markdown table (floats in 4 significant digits)."""
    keys = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(row[key]) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


def _seeded_dump(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2, 4, 256, 16]`` Gaussian Q/K with a decaying spectrum (per-coordinate scales 1/√i)."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.arange(1, 17, dtype=torch.float64).rsqrt()
    q = torch.randn(2, 4, 256, 16, generator=gen, dtype=torch.float64) * scales
    k = torch.randn(2, 4, 256, 16, generator=gen, dtype=torch.float64) * scales
    return q, k


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sketchlab.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    q, k = _seeded_dump(args.seed)
    d = q.shape[-1]
    q, k = q * d**-0.25, k * d**-0.25  # explicit scale: qᵀk becomes qᵀk/√d
    print(f"Theorem 3.1 on a seeded Q/K dump {tuple(q.shape)}, p={args.p}, scale d^-1/4 (median over heads):")
    print(markdown_table(theorem31_rows(q, k, args.p, [4, 16, 32, 64, 128])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
