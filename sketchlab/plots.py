"""Figures of the comparison and of the spectra it is measured against (matplotlib, Agg backend).

matplotlib is an optional dependency (extra ``plot``); it is imported when a figure is drawn.
Every figure is written atomically (:func:`sketchlab.io.atomic_write`).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from .io import atomic_write

__all__ = ["plot_advice", "plot_kernel_spectrum", "plot_optimality_ratios", "plot_spectra", "save_figure"]


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - the dev extra installs it
        raise ImportError("plots need matplotlib: pip install 'sketchlab[plot]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, *, dpi: int = 120) -> Path:
    """Write ``fig`` to ``path`` as a PNG, atomically (:func:`sketchlab.io.atomic_write`), and close it."""
    path = Path(path)
    try:
        with atomic_write(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format="png")
    finally:
        _pyplot().close(fig)
    return path


def _finish_grid(fig, axes, used: int, path) -> Path:
    """Hide the panels after the first ``used``, put the legend on the first, lay out and save."""
    n_cols = axes.shape[1]
    for j in range(used, axes.size):
        axes[j // n_cols][j % n_cols].set_visible(False)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    return save_figure(fig, path)


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
    return save_figure(fig, path)


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
    return save_figure(fig, path)


def _grid(plt, n_rows: int, n_cols: int, title: str):
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(2.6 * n_cols + 1, 2.2 * n_rows + 1), squeeze=False,
                             sharex=True, sharey=True)
    fig.suptitle(title, fontsize=9)
    return fig, axes


def plot_kernel_spectrum(spectrum, path) -> Path:
    r"""One panel per layer, one curve per head: :math:`\sigma_i(A)/\sigma_1(A)` vs ``i`` (log scale).

    ``spectrum`` is a :class:`sketchlab.spectrum.KernelSpectrum`; the PNG is written atomically.
    """
    plt = _pyplot()
    n_layers = len(spectrum.layers)
    n_cols = min(4, n_layers)
    fig, axes = _grid(plt, -(-n_layers // n_cols), n_cols,
                      f"Singular values of A = (QKᵀ)^∘{spectrum.p}, {spectrum.scale_description}")
    tiny = 1e-17
    for a, layer in enumerate(spectrum.layers):
        ax = axes[a // n_cols][a % n_cols]
        for b, head in enumerate(spectrum.heads):
            s = spectrum.singular_values[a, b]
            ax.plot(range(1, len(s) + 1), (s / s[0]).clamp_min(tiny).tolist(), lw=1, label=f"head {head}")
        ax.set_yscale("log")
        ax.set_title(f"layer {layer}", fontsize=8)
        ax.set_xlabel("i")
        ax.set_ylabel("σ_i / σ_1")
    return _finish_grid(fig, axes, n_layers, path)


def plot_advice(advice, path) -> Path:
    """One panel per (layer, head): the Theorem 3.1 relative floor vs ``m`` (line), the method's
    fitted rel_fro at each ``m`` it tried (dots), the target (dashed) and floor m / practical m.

    ``advice`` is a :class:`sketchlab.advise.Advice`; the PNG is written atomically.
    """
    plt = _pyplot()
    spec, n = advice.spectrum, len(advice.heads)
    n_cols = min(4, n)
    fig, axes = _grid(plt, -(-n // n_cols), n_cols,
                      f"Floor and {advice.method} error vs m, target {advice.target:g}, p = {advice.p}")
    curve = spec.floor_curve()
    for j, h in enumerate(advice.heads):
        ax = axes[j // n_cols][j % n_cols]
        a, b = spec.layers.index(h.layer), spec.heads.index(h.head)
        top = max([h.floor_m * 4, *(h.fits or {0: 0}).keys()])
        top = min(top, advice.max_m)
        ax.plot(range(1, top + 1), curve[a, b, 1:top + 1].clamp_min(1e-17).tolist(), color="black", lw=1,
                label="Theorem 3.1 floor")
        if h.fits:
            ms = sorted(h.fits)
            ax.plot(ms, [h.fits[m]["rel_fro"] for m in ms], "o", ms=3, color="tab:blue", label=f"{advice.method} fit")
        ax.axhline(advice.target, color="tab:red", lw=0.8, ls="--")
        ax.axvline(h.floor_m, color="gray", lw=0.8, ls=":")
        if h.practical_m is not None:
            ax.axvline(h.practical_m, color="tab:blue", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_xscale("log")
        ax.set_title(f"L{h.layer} H{h.head}: floor m {h.floor_m}, practical m {h.practical_m}", fontsize=7)
        ax.set_xlabel("m")
        ax.set_ylabel("rel_fro")
    return _finish_grid(fig, axes, n, path)
