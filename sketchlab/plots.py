"""Figures of the comparison and of the spectra it is measured against (matplotlib, Agg backend).

matplotlib is an optional dependency (extra ``plot``); it is imported when a figure is drawn.
Every figure is written atomically (:func:`sketchlab.io.atomic_write`).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from .io import atomic_write

__all__ = ["plot_optimality_ratios", "plot_spectra"]


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - the dev extra installs it
        raise ImportError("plots need matplotlib: pip install 'sketchlab[plot]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> Path:
    path = Path(path)
    with atomic_write(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    return path


def plot_optimality_ratios(tables: dict, path) -> Path:
    """Bar chart of the median optimality ratio per method (log scale), one bar group per degree.

    Parameters
    ----------
    tables : dict ``{p: ComparisonTable}``
        Results of :func:`sketchlab.compare` for each degree (same methods and ``m``).
    path : str or Path
        PNG written atomically.
    """
    if not tables:
        raise ValueError("tables must hold at least one ComparisonTable")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / len(tables)
    first = next(iter(tables.values()))
    for i, (p, table) in enumerate(tables.items()):
        ratios = [statistics.median(table.values(method, "optimality_ratio")) for method in first.methods]
        xs = [j + (i - (len(tables) - 1) / 2) * width for j in range(len(first.methods))]
        ax.bar(xs, ratios, width, label=f"p = {p}")
        for x, r in zip(xs, ratios):
            ax.text(x, r * 1.08, f"{r:.3g}", ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(first.methods)), first.methods)
    ax.set_ylabel("‖Â − A‖_F / √tail  (median over heads)")
    ax.set_title(f"Optimality ratio per sketch (1 = Theorem 3.1 optimum), m = {first.m}")
    ax.legend()
    fig.tight_layout()
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def plot_spectra(singular_values: dict, m: int, path, *, title: str = "") -> Path:
    r"""Normalised singular values :math:`\sigma_i(A)/\sigma_1(A)` per curve (log scale), ``m`` marked.

    Parameters
    ----------
    singular_values : dict ``{label: Tensor[..., r]}``
        Descending singular values; leading axes (heads) are reduced by their median.
    m : int
        Sketch size, drawn as a vertical line: the tail bound is the energy right of it.
    path : str or Path
        PNG written atomically.
    """
    if not singular_values:
        raise ValueError("singular_values must hold at least one curve")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, s in singular_values.items():
        s = torch.as_tensor(s, dtype=torch.float64)
        s = (s / s[..., :1]).reshape(-1, s.shape[-1]).median(dim=0).values  # [r], median over heads
        ax.plot(range(1, len(s) + 1), s.clamp_min(1e-17).tolist(), label=str(label))
    ax.axvline(m, color="black", lw=0.8, ls="--", label=f"m = {m}")
    ax.set_yscale("log")
    ax.set_xlabel("i")
    ax.set_ylabel("σ_i(A) / σ_1(A)  (median over heads)")
    ax.set_title(title or "Spectrum of the polynomial kernel A = (QKᵀ)^p")
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)
