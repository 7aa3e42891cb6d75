"""The demo runs its steps end to end on a small dump and writes every output; steps are pluggable."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from sketchlab import demo


def test_demo_end_to_end_on_a_small_dump(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    spec = torch.tensor([2.0, 1.2, 0.7, 0.4, 0.25, 0.15])
    q = torch.randn(1, 1, 48, 6, generator=g) * spec + 0.3
    k = torch.randn(1, 1, 48, 6, generator=g) * spec - 0.2
    path = tmp_path / "qk.safetensors"
    save_file({"q": q, "k": k, "v": torch.randn(1, 1, 48, 6, generator=g)}, str(path))
    out = tmp_path / "out"
    assert demo.main(["--dump", str(path), "--m", "6", "--target", "0.05", "--out", str(out),
                      "--methods", "optimal,llops,psf,based", "--holdout", "0.3"]) == 0
    text = capsys.readouterr().out
    for section in ("## 1. Theorem 3.1", "## 2. Every sketch", "## 3. The fitted sketch as attention", "## 4. Which m"):
        assert section in text
    assert "| Method | rel_mae | rel_fro | ×optimum | held-out rel_mae |" in text
    assert "m holding 99% of ‖A‖_F² per head (rows: layers):" in text
    wrote = [line for line in text.splitlines() if line.startswith("wrote ")]
    assert len(wrote) == 1
    listed = [Path(p) for p in wrote[0][len("wrote "):].rsplit(" (", 1)[0].split(", ")]
    assert all(p.is_file() for p in listed) and len(listed) >= 9, listed
    separators = [line for line in text.splitlines() if "---|" in line]
    assert len(separators) >= 3  # the comparison, attention and advice tables
    for line in separators:  # every table well-formed markdown: its separator row is |---|...|
        assert line.startswith("|---") and line.endswith("|") and set(line) <= set("|-: "), line
    for name in ("comparison.md", "comparison.json", "optimality.png", "spectrum.png", "attention.md", "theta.safetensors",
                 "advice.md", "advice.json", "advice.png"):
        assert (out / name).stat().st_size > 0, name
    config = json.loads((out / "comparison.json").read_text())["config"]
    assert config["scale"] == "sqrt-d" and config["holdout"] == 0.3  # --holdout reaches the comparison
    assert [s.__name__ for s in demo.STEPS] == ["step_spectrum", "step_compare", "step_attention", "step_advise"]
