"""What the figures draw: the data of every line and bar, the axis labels and titles (issue 21, mutation round 4).

Each figure is intercepted before it is written (``save_figure`` is replaced by a recorder that keeps
the figure open), and its artists are read back: the y-data of a curve must be the normalised singular
values (or floors, fits) computed here from the inputs, the bars the medians of the table, and the labels
the documented ones. A figure that draws the wrong data, a wrong panel layout or no labels fails.
"""

import math
import statistics

import pytest
import torch

import sketchlab.plots as plots
from sketchlab import compare
from sketchlab.advise import Advice, HeadAdvice
from sketchlab.spectrum import KernelSpectrum

F64 = torch.float64


@pytest.fixture
def drawn(monkeypatch, tmp_path):
    """Replace save_figure by a recorder: ``drawn`` lists the figures the plot functions finish."""
    figures = []

    def record(fig, path, *, dpi=120):
        figures.append(fig)
        return path

    monkeypatch.setattr(plots, "save_figure", record)
    yield figures
    plt = plots._pyplot()
    for fig in figures:
        plt.close(fig)


def _spectrum(s, *, layers=None, heads=None, p=2):
    s = torch.as_tensor(s, dtype=F64)
    return KernelSpectrum(singular_values=s, p=p, layers=layers or list(range(s.shape[0])),
                          heads=heads or list(range(s.shape[1])), scale="sqrt-d", scale_factor=0.5,
                          scale_description="q, k scaled by d^-1/4", source="unit test", n_tokens=s.shape[-1],
                          d=4, holdout=0.0, seed=0)


def _ydata(line):
    return [float(y) for y in line.get_ydata()]


def test_kernel_spectrum_of_one_layer_and_head_draws_its_normalised_values(drawn, tmp_path):
    """One (layer, head): a 1×1 grid (the panel is still addressed as axes[0][0]), the curve σ_i/σ_1,
    clamped at 1e-17 for a zero σ (log scale), and the documented labels and title."""
    s = [[[4.0, 2.0, 1.0, 0.0]]]  # [L=1, H=1, r=4]
    assert plots.plot_kernel_spectrum(_spectrum(s, layers=[3], heads=[5], p=3), tmp_path / "s.png") == tmp_path / "s.png"
    (fig,) = drawn
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 1
    ax = visible[0]
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [1, 2, 3, 4]
    assert _ydata(line) == [1.0, 0.5, 0.25, 1e-17]
    assert line.get_label() == "head 5"
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "i" and ax.get_ylabel() == "σ_i / σ_1"
    assert ax.get_title() == "layer 3"
    assert fig._suptitle.get_text() == "Singular values of A = (QKᵀ)^∘3, q, k scaled by d^-1/4"


def test_kernel_spectrum_draws_one_panel_per_layer_one_curve_per_head(drawn, tmp_path):
    g = torch.Generator().manual_seed(0)
    s = torch.rand(5, 2, 6, generator=g, dtype=F64).sort(-1, descending=True).values + 0.1  # [L=5, H=2, r=6]
    plots.plot_kernel_spectrum(_spectrum(s), tmp_path / "s.png")
    (fig,) = drawn
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(fig.axes) == 8 and len(visible) == 5  # a 2×4 grid, the last 3 panels hidden
    for a, ax in enumerate(visible):
        assert ax.get_title() == f"layer {a}"
        assert ax.get_ylabel() == "σ_i / σ_1"
        for b, line in enumerate(ax.get_lines()):
            assert _ydata(line) == pytest.approx((s[a, b] / s[a, b, 0]).tolist(), rel=1e-15)


def test_spectra_are_the_median_over_heads_of_the_normalised_values(drawn, tmp_path):
    """A curve with a head axis is reduced by the median over its heads (after normalising each head);
    one without is drawn as given. Head medians computed here by hand."""
    heads = torch.tensor([[2.0, 1.0, 0.5], [4.0, 1.0, 1.0], [1.0, 0.9, 0.1]], dtype=F64)  # [H=3, r=3]
    # normalised: [1, .5, .25], [1, .25, .25], [1, .9, .1] -> medians [1, .5, .25]
    plain = torch.tensor([3.0, 1.5, 0.0], dtype=F64)
    plots.plot_spectra({"layer 0": heads, "one head": plain}, 2, tmp_path / "sp.png", title="T")
    (fig,) = drawn
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert _ydata(lines["layer 0"]) == [1.0, 0.5, 0.25]
    assert _ydata(lines["one head"]) == [1.0, 0.5, 1e-17]
    assert list(lines["m = 2"].get_xdata()) == [2, 2]  # the vertical line at m
    assert ax.get_ylabel() == "σ_i(A) / σ_1(A)  (median over heads)" and ax.get_xlabel() == "i"
    assert ax.get_title() == "T" and ax.get_yscale() == "log"


def test_advice_panel_draws_the_floor_the_fits_the_target_and_the_sizes(drawn, tmp_path):
    """One head with fits: the floor curve √(Σ_{i>m}σ_i²)/‖A‖_F for m = 1 … top (top = the larger of 4 ×
    floor m and the largest fitted m, capped at max_m), the fitted rel_fro as dots, the target and the
    floor / practical m as lines — each checked against values computed here."""
    s = torch.tensor([[[3.0, 2.0, 1.0, 0.5, 0.25, 0.1, 0.05, 0.0]]], dtype=F64)  # [1, 1, 8]
    spec = _spectrum(s)
    fits = {2: {"rel_fro": 0.4}, 3: {"rel_fro": 0.2}, 6: {"rel_fro": 0.05}}
    head = HeadAdvice(layer=0, head=0, floor_m=1, practical_m=3, practical_rel_fro=0.2, practical_ratio=1.5,
                      fits=fits)
    advice = Advice(heads=[head], spectrum=spec, target=0.3, method="llops", p=2, max_m=7, holdout=0.0, seed=0,
                    seconds=0.0)
    plots.plot_advice(advice, tmp_path / "a.png")
    (fig,) = drawn
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 1
    ax = visible[0]
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    energy = (s[0, 0] ** 2).tolist()
    total = sum(energy)
    top = min(max(4 * 1, 6), 7)  # = 6
    floor = [max(math.sqrt(sum(energy[m:]) / total), 1e-17) for m in range(1, top + 1)]
    assert list(lines["Theorem 3.1 floor"].get_xdata()) == list(range(1, top + 1))
    assert _ydata(lines["Theorem 3.1 floor"]) == pytest.approx(floor, rel=1e-12)
    assert list(lines["llops fit"].get_xdata()) == [2, 3, 6] and _ydata(lines["llops fit"]) == [0.4, 0.2, 0.05]
    assert lines["llops fit"].get_color() == "tab:blue"
    rules = [line for line in ax.get_lines() if line.get_label().startswith("_")]
    assert sorted(tuple(line.get_ydata()) for line in rules if line.get_ydata()[0] == line.get_ydata()[1]) \
        == [(0.3, 0.3)]  # the target (horizontal)
    assert sorted(line.get_xdata()[0] for line in rules if line.get_xdata()[0] == line.get_xdata()[1]) == [1, 3]
    assert ax.get_xlabel() == "m" and ax.get_ylabel() == "rel_fro"
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_title() == "L0 H0: floor m 1, practical m 3"
    assert fig._suptitle.get_text() == "Floor and llops error vs m, target 0.3, p = 2"


def test_advice_floor_is_drawn_up_to_four_times_the_floor_m_without_fits(drawn, tmp_path):
    s = torch.tensor([[[3.0, 2.0, 1.0, 0.5, 0.25, 0.1, 0.05, 0.01, 0.0, 0.0]]], dtype=F64)  # r = 10
    head = HeadAdvice(layer=0, head=0, floor_m=2, practical_m=None, practical_rel_fro=None, practical_ratio=None)
    advice = Advice(heads=[head], spectrum=_spectrum(s), target=0.1, method="mlp", p=2, max_m=9, holdout=0.0,
                    seed=0, seconds=0.0)
    plots.plot_advice(advice, tmp_path / "a.png")
    ax = next(ax for ax in drawn[0].axes if ax.get_visible())
    (floor,) = [line for line in ax.get_lines() if line.get_label() == "Theorem 3.1 floor"]
    assert list(floor.get_xdata()) == list(range(1, 9))  # 4 × floor m = 8 ≤ max_m
    assert [line.get_label() for line in ax.get_lines()].count("mlp fit") == 0


def test_optimality_bars_are_the_median_ratio_of_each_method(drawn, tmp_path):
    """One bar per (degree, method) at the median optimality ratio over heads; the optimal sketch's bar
    is 1 (Theorem 3.1: it attains the floor), the log axis and the documented labels."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 24, 3, generator=g, dtype=F64)
    k = torch.randn(3, 24, 3, generator=g, dtype=F64)
    tables = {p: compare((q, k), p=p, m=4, methods=["optimal", "tensorsketch"], progress=False) for p in (2, 3)}
    plots.plot_optimality_ratios(tables, tmp_path / "o.png")
    (fig,) = drawn
    (ax,) = fig.axes
    groups = {c.get_label(): [bar.get_height() for bar in c] for c in ax.containers}
    assert list(groups) == ["p = 2", "p = 3"]
    for p, table in tables.items():
        expected = [statistics.median(table.values(m, "optimality_ratio")) for m in ("optimal", "tensorsketch")]
        assert groups[f"p = {p}"] == pytest.approx(expected, rel=1e-12)
        assert groups[f"p = {p}"][0] == pytest.approx(1.0, rel=1e-6)
        assert groups[f"p = {p}"][1] > 1.0
    assert [t.get_text() for t in ax.get_xticklabels()] == ["optimal", "tensorsketch"]
    assert ax.get_yscale() == "log"
    assert ax.get_ylabel() == "‖Â − A‖_F / √tail  (median over heads)"
    assert ax.get_title() == "Optimality ratio per sketch (1 = Theorem 3.1 optimum), m = 4"
