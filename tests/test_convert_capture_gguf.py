"""``capture --gguf`` / ``capture_pretrained(gguf=)``: the source checks (a real GGUF is exercised by
analysis runs on SmolLM2; no tiny GGUF is built here)."""

from __future__ import annotations

import pytest

from sketchlab.capture import capture_pretrained
from sketchlab.cli import main


def _rc(argv):
    try:
        return main(argv)
    except SystemExit as err:  # argparse's own refusals
        return err.code


def test_capture_gguf_refusals(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("some text")
    assert _rc(["capture", "--gguf", str(tmp_path / "none.gguf"), "--text", str(tmp_path / "t.txt"),
                "--out", str(tmp_path / "d.safetensors"), "--no-progress"]) == 2
    assert "--gguf" in capsys.readouterr().err and not (tmp_path / "d.safetensors").exists()
    assert _rc(["capture", "--gguf", "a.gguf", "--model-dir", str(tmp_path), "--text", str(tmp_path / "t.txt"),
                "--out", str(tmp_path / "d.safetensors")]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert _rc(["capture", "--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "d.safetensors")]) == 2
    assert "one of the arguments --model-dir --gguf is required" in capsys.readouterr().err
    with pytest.raises(ValueError, match="exactly one of model_dir .* or gguf"):
        capture_pretrained(tmp_path, gguf=tmp_path / "x.gguf", text=tmp_path / "t.txt")
    with pytest.raises(ValueError, match="exactly one of model_dir .* or gguf"):
        capture_pretrained(text=tmp_path / "t.txt")
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        capture_pretrained(gguf=tmp_path / "x.gguf", text=tmp_path / "t.txt")
