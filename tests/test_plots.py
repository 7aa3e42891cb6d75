"""Figures are written atomically, through one helper (:func:`sketchlab.plots.save_figure`)."""

import re
from pathlib import Path

import pytest

import sketchlab.plots
from sketchlab.plots import save_figure

ROOT = Path(__file__).resolve().parent.parent
#: Files that may call ``savefig`` themselves: the helper alone.
SAVEFIG_ALLOWED = {"sketchlab/plots.py"}


def _figure():
    plt = sketchlab.plots._pyplot()
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    return plt, fig


def test_save_figure_writes_a_png_and_closes_the_figure(tmp_path):
    plt, fig = _figure()
    path = save_figure(fig, tmp_path / "f.png", dpi=50)
    assert path == tmp_path / "f.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number)
    assert [p.name for p in tmp_path.iterdir()] == ["f.png"]


def test_save_figure_failing_mid_write_keeps_the_old_file(tmp_path, monkeypatch):
    """A savefig that dies half-way (full disk, a bad glyph) leaves the previous figure and no temporary."""
    plt, fig = _figure()
    path = tmp_path / "f.png"
    path.write_bytes(b"the previous figure")

    def broken_savefig(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(fig), "savefig", broken_savefig)
    with pytest.raises(OSError, match="No space left"):
        save_figure(fig, path)
    assert path.read_bytes() == b"the previous figure" and [p.name for p in tmp_path.iterdir()] == ["f.png"]
    assert not plt.fignum_exists(fig.number)  # closed on failure too


def test_every_figure_goes_through_save_figure():
    """No script or module writes a figure with its own ``savefig`` (a direct one is not atomic: a
    crash mid-write leaves a truncated PNG in analysis/results)."""
    direct = []
    for path in sorted([*ROOT.glob("analysis/*.py"), *ROOT.glob("sketchlab/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel in SAVEFIG_ALLOWED:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\.savefig\(", line):
                direct.append(f"{rel}:{number}: {line.strip()}")
    assert direct == [], "write figures with sketchlab.plots.save_figure:\n" + "\n".join(direct)
