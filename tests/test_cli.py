"""The sketchlab CLI: compare writes its outputs atomically; bad input is one line, exit 2."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from sketchlab.cli import main


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 32, 4, generator=g), torch.randn(2, 2, 32, 4, generator=g)
    path = tmp_path_factory.mktemp("dumps") / "qk.safetensors"
    save_file({"q": q, "k": k}, str(path))
    return str(path)


def test_compare_writes_outputs(dump, tmp_path, capsys):
    out_json, out_md = tmp_path / "t.json", tmp_path / "t.md"
    rc = main(["compare", dump, "--p", "2", "--m", "5", "--methods", "optimal,psf,tensorsketch,based",
               "--layers", "1", "--heads", "0,1", "--json", str(out_json), "--markdown", str(out_md),
               "--no-progress"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| Method | Layer 1 | Avg |" in stdout
    assert out_md.read_text() == stdout
    data = json.loads(out_json.read_text())
    assert data["config"]["scale"] == "sqrt-d" and data["config"]["layers"] == [1]
    assert len(data["rows"]) == 2 * 4
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # no temp files left


@pytest.mark.parametrize("argv,match", [
    (["compare", "{dump}", "--p", "2", "--m", "5", "--methods", "optimal,bogus"], "unknown method"),
    (["compare", "{dump}", "--p", "0", "--m", "5", "--methods", "psf"], "argument --p: expected an integer >= 1, got 0"),
    (["compare", "{dump}", "--p", "two", "--m", "5"], "argument --p: expected an integer >= 1, got 'two'"),
    (["compare", "{dump}", "--p", "2", "--m", "500", "--methods", "psf"], "m=500 exceeds"),
    (["compare", "{dump}", "--p", "2", "--m", "5", "--methods", "psf", "--layers", "7"], "layer 7 is out of range"),
    (["compare", "{dump}", "--p", "2", "--m", "5", "--methods", "psf", "--layers", "a,b"], "comma-separated integers"),
    (["compare", "{dump}", "--p", "2", "--m", "5", "--methods", "psf", "--scale", "big"], "--scale"),
    (["compare", "{missing}", "--p", "2", "--m", "5", "--methods", "psf"], "does not exist"),
    (["compare", "{garbage}", "--p", "2", "--m", "5", "--methods", "psf"], "garbage.safetensors"),
    (["compare", "{dump}", "--p", "2", "--m", "5", "--methods", "psf", "--json", "{dump}/dir/x.json"],
     "cannot create the output directory"),
    (["compare", "{dump}", "--p", "2", "--m", "5", "--methods", "psf", "--json", "{dump}"], "is the input"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_bad_input_is_one_line_exit_2(argv, match, dump, tmp_path, capsys):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"this is not a safetensors file")
    argv = [a.format(dump=dump, missing=str(tmp_path / "missing.safetensors"), garbage=str(garbage)) for a in argv]
    rc = main(argv + ["--no-progress"] if argv and argv[0] == "compare" else argv)
    captured = capsys.readouterr()
    assert rc == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sketchlab: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert re.search(match, lines[0]), lines[0]


def test_device_arg_checks_the_cuda_index_against_the_device_count(monkeypatch):
    # as on a machine with one GPU: cuda and cuda:0 are accepted, cuda:1 is not (indices start at 0)
    import argparse

    from sketchlab.cli._common import device_arg

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_arg("cuda") == torch.device("cuda") and device_arg("cuda:0") == torch.device("cuda:0")
    with pytest.raises(argparse.ArgumentTypeError, match=r"device 'cuda:1': this machine has 1 CUDA device\(s\)"):
        device_arg("cuda:1")


def test_a_diverged_fit_exits_1_with_its_message_on_one_line(monkeypatch, capsys):
    # FloatingPointError (a fit that went non-finite) is not bad input: exit 1, not 2, and the
    # error's own text on one line, no traceback
    import sketchlab.cli.spectrum

    def diverge(args):
        raise FloatingPointError("LLoPS direct fit stopped: the kernel loss is non-finite\nat step 3")

    monkeypatch.setattr(sketchlab.cli.spectrum, "run", diverge)
    rc = main(["spectrum", "whatever.safetensors"])
    err = capsys.readouterr().err
    assert rc == 1 and err == "sketchlab: error: LLoPS direct fit stopped: the kernel loss is non-finite at step 3\n"


def test_python_dash_m_sketchlab_is_the_console_script():
    """``python -m sketchlab`` runs the same parser as ``sketchlab`` (its usage, its exit code 2 on bad input)."""
    import subprocess
    import sys

    help_ = subprocess.run([sys.executable, "-m", "sketchlab", "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "usage: sketchlab" in help_.stdout and "linearize" in help_.stdout
    bad = subprocess.run([sys.executable, "-m", "sketchlab", "frobnicate"], capture_output=True, text=True)
    assert bad.returncode == 2 and "frobnicate" in bad.stderr
