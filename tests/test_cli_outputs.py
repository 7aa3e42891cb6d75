"""Every command's outputs: never onto an input (any spelling, symlink or hard link), refused before
the work starts; ``-`` is standard output; several outputs are written all-or-nothing; missing
parent directories are created; each file written is reported as ``wrote PATH``; one convention
for the shared options."""

import hashlib
import inspect
import json
import os
import re
import shutil
import sys

import pytest
import torch
from safetensors.torch import save_file

import sketchlab.plots
from sketchlab.cli import COMMANDS, build_parser, main


@pytest.fixture()
def dump(tmp_path):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 40, 4, generator=g), torch.randn(1, 2, 40, 4, generator=g)
    path = tmp_path / "in" / "qk.safetensors"
    path.parent.mkdir()
    save_file({"q": q, "k": k}, str(path))
    return path


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


# (command argv before the output option, the output option, the library function the command's work starts in)
COMMANDS_WITH_OUTPUTS = [
    (["verify", "{dump}", "--m", "4"], "--json", ("sketchlab.verify", "verify")),
    (["spectrum", "{dump}"], "--json", ("sketchlab.spectrum", "kernel_spectrum")),
    (["spectrum", "{dump}"], "--plot", ("sketchlab.spectrum", "kernel_spectrum")),
    (["advise", "{dump}", "--target", "0.3"], "--json", ("sketchlab.advise", "advise")),
    (["advise", "{dump}", "--target", "0.3"], "--markdown", ("sketchlab.advise", "advise")),
    (["advise", "{dump}", "--target", "0.3"], "--plot", ("sketchlab.advise", "advise")),
    (["compare", "{dump}", "--m", "4", "--methods", "optimal"], "--json", ("sketchlab.compare", "compare")),
    (["compare", "{dump}", "--m", "4", "--methods", "optimal"], "--markdown", ("sketchlab.compare", "compare")),
    (["fit", "{dump}", "--m", "4"], "--out", ("sketchlab.fit", "fit_sketch")),
]


def _spellings(dump, tmp_path):
    """Names of the input file that are not its own spelling: relative, with ``..``, a symlink, a hard link."""
    link = tmp_path / "link.safetensors"
    link.symlink_to(dump)
    hard = tmp_path / "hard.safetensors"
    os.link(dump, hard)
    return {
        "same": str(dump),
        "dotdot": str(dump.parent / ".." / dump.parent.name / dump.name),
        "symlink": str(link),
        "hardlink": str(hard),
        "relative": os.path.relpath(dump),
    }


@pytest.mark.parametrize("spelling", ["same", "dotdot", "symlink", "hardlink", "relative"])
@pytest.mark.parametrize("argv,option,work", COMMANDS_WITH_OUTPUTS, ids=lambda x: x if isinstance(x, str) else None)
def test_an_output_onto_the_input_is_refused_before_any_work(argv, option, work, spelling, dump, tmp_path, capsys,
                                                             monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the command started its work before refusing the output")

    monkeypatch.setattr(sys.modules[work[0]], work[1], no_work)
    before = _sha(dump)
    target = _spellings(dump, tmp_path)[spelling]
    rc = main([a.format(dump=dump) for a in argv] + [option, target, "--no-progress"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, captured.err
    assert option in lines[0] and target in lines[0] and "is the input" in lines[0], lines[0]
    assert _sha(dump) == before


def test_an_output_onto_a_part_of_an_npy_dump_is_refused(tmp_path, capsys):
    from sketchlab import save_qk

    g = torch.Generator().manual_seed(1)
    save_qk(tmp_path / "d.npy", torch.randn(1, 1, 30, 3, generator=g), torch.randn(1, 1, 30, 3, generator=g))
    part = tmp_path / "d.k.npy"
    before = _sha(part)
    rc = main(["spectrum", str(tmp_path / "d.npy"), "--json", str(part)])
    assert rc == 2 and "is the input" in capsys.readouterr().err and _sha(part) == before


@pytest.mark.parametrize("argv,option", [
    (["verify", "{dump}", "--m", "4", "--layers", "0", "--heads", "0"], "--json"),
    (["spectrum", "{dump}"], "--json"),
    (["advise", "{dump}", "--target", "0.3", "--heads", "0", "--max-m", "6"], "--json"),
    (["advise", "{dump}", "--target", "0.3", "--heads", "0", "--max-m", "6"], "--markdown"),
    (["compare", "{dump}", "--m", "4", "--methods", "optimal"], "--json"),
    (["compare", "{dump}", "--m", "4", "--methods", "optimal"], "--markdown"),
])
def test_dash_writes_to_stdout_and_nothing_else_goes_there(argv, option, dump, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main([a.format(dump=dump) for a in argv] + [option, "-", "--no-progress"])
    out = capsys.readouterr().out
    assert rc in (0, 1) and not (tmp_path / "-").exists()
    if option == "--json":
        assert isinstance(json.loads(out), dict)  # exactly the JSON: no table before or after it
    else:
        assert out.lstrip().startswith(("p =", "Target", "|", "**", "Advice", "Sketch")) or "|" in out.splitlines()[-1]
        with pytest.raises(json.JSONDecodeError):
            json.loads(out)


def test_dash_twice_or_for_a_plot_is_refused(dump, capsys):
    rc = main(["advise", str(dump), "--target", "0.3", "--json", "-", "--markdown", "-", "--no-progress"])
    assert rc == 2 and "only one output can go to standard output" in capsys.readouterr().err
    rc = main(["spectrum", str(dump), "--plot", "-"])
    assert rc == 2 and "--plot -: standard output is not supported" in capsys.readouterr().err


def test_outputs_are_all_or_nothing(dump, tmp_path, capsys, monkeypatch):
    js, md, png = tmp_path / "a.json", tmp_path / "new" / "a.md", tmp_path / "a.png"
    js.write_text("old\n")

    def broken_plot(result, path):
        raise OSError(f"{path}: disk full")

    monkeypatch.setattr(sketchlab.plots, "plot_advice", broken_plot)
    rc = main(["advise", str(dump), "--target", "0.3", "--heads", "0", "--max-m", "6", "--json", str(js),
               "--markdown", str(md), "--plot", str(png), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "disk full" in err
    assert js.read_text() == "old\n"  # the earlier output keeps its old content
    assert not md.exists() and not md.parent.exists()  # the directory made for it is removed again
    assert not png.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "in"]  # no temp files


def test_parents_are_created_and_every_file_is_reported(dump, tmp_path, capsys):
    js, md = tmp_path / "a" / "b" / "t.json", tmp_path / "c" / "t.md"
    rc = main(["compare", str(dump), "--m", "4", "--methods", "optimal", "--json", str(js), "--markdown", str(md),
               "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0 and json.loads(js.read_text())["config"]["m"] == 4 and md.read_text() == captured.out
    assert f"wrote {js}" in captured.err.splitlines() and f"wrote {md}" in captured.err.splitlines()
    theta = tmp_path / "x" / "y" / "theta.safetensors"
    rc = main(["fit", str(dump), "--m", "4", "--out", str(theta), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0 and theta.is_file() and captured.err.strip().splitlines() == [f"wrote {theta}"]
    png = tmp_path / "p" / "s.png"
    rc = main(["spectrum", str(dump), "--plot", str(png)])
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG" and f"wrote {png}" in capsys.readouterr().err


def test_an_output_whose_parent_is_a_file_is_refused(dump, capsys):
    rc = main(["spectrum", str(dump), "--json", str(dump / "x.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "is a file" in err and len(err.splitlines()) == 1


def test_spectrum_help_shows_a_single_percent_sign(capsys):
    with pytest.raises(SystemExit):
        main(["spectrum", "--help"])
    out = capsys.readouterr().out
    assert "99% of" in " ".join(out.split()) and "%%" not in out


@pytest.mark.parametrize("argv,match", [
    (["spectrum", "{dump}", "--sizes", "0"], r"--sizes: expected comma-separated integers >= 1, got 0"),
    (["spectrum", "{dump}", "--sizes", "8,-1"], r"--sizes: expected comma-separated integers >= 1, got -1"),
    (["verify", "{dump}", "--restarts", "1000000"], r"--restarts must be at most 1000 \(the work bound\)"),
    (["verify", "{dump}", "--columns", "0"], r"--columns: expected an integer >= 1"),
    (["advise", "{dump}", "--target", "0.1", "--max-m", "0"], r"--max-m: expected an integer >= 1"),
    (["compare", "{dump}", "--p", "0"], r"--p: expected an integer >= 1"),
    (["fit", "{dump}", "--m", "-3", "--out", "t.safetensors"], r"--m: expected an integer >= 1"),
    (["fit", "{dump}", "--device", "tpu", "--out", "t.safetensors"], r"--device: expected a device"),
    # the shared options are checked at parse time, one rule for every command
    (["fit", "{dump}", "--holdout", "1.5", "--out", "t.safetensors"],
     r"argument --holdout: expected a number in \[0, 1\), got '1.5'"),
    (["advise", "{dump}", "--target", "0.1", "--holdout", "nan"], r"argument --holdout: expected a number in \[0, 1\)"),
    (["compare", "{dump}", "--p", "5000"], r"argument --p: expected an integer in \[1, 1024\] .* got 5000"),
    (["verify", "{dump}", "--seed", "-1"], r"argument --seed: expected an integer seed in \[0, 2\*\*62\], got -1"),
    (["compare", "{dump}", "--seed", "x"], r"argument --seed: expected an integer seed in \[0, 2\*\*62\], got 'x'"),
])
def test_sizes_are_bounded_up_front(argv, match, dump, capsys):
    rc = main([a.format(dump=dump) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and re.search(match, err[0]), err


def test_shared_options_have_one_spelling_and_default():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    seen = {}
    for name in COMMANDS:
        for action in sub[name]._actions:
            if action.dest in ("p", "m", "seed", "scale", "holdout", "layers", "heads", "no_progress") and name not in (
                    "train", "capture"):
                seen.setdefault(action.dest, set()).add((action.default if not isinstance(action.default, list)
                                                         else tuple(action.default), action.type, action.help))
    assert {dest: len(v) for dest, v in seen.items()} == {dest: 1 for dest in seen}, seen
    assert next(iter(seen["p"]))[0] == 2 and next(iter(seen["m"]))[0] == 64
    linearize = {a.dest for a in sub["linearize"]._actions}
    assert {"p", "m", "seed", "holdout", "no_progress"} <= linearize  # linearize's own copies were merged
    for name in ("compare", "verify", "advise", "spectrum", "fit", "train", "linearize"):
        assert "no_progress" in {a.dest for a in sub[name]._actions}, name


@pytest.mark.parametrize("argv,desc", [
    (["spectrum", "{dump}"], "spectrum"),
    (["fit", "{dump}", "--m", "4", "--out", "{tmp}/t.safetensors"], "LLoPS fit"),
    (["compare", "{dump}", "--m", "4", "--methods", "optimal,psf"], "compare"),
    (["verify", "{dump}", "--m", "4", "--layers", "0", "--heads", "0"], "verify"),
    (["advise", "{dump}", "--target", "0.3", "--heads", "0", "--max-m", "5"], r"advise \(llops\)"),
    (["train", "--attention", "softmax", "--d-model", "8", "--n-heads", "2", "--n-layers", "1", "--seq-len", "8",
      "--num-pairs", "2", "--batch-size", "2", "--eval-sequences", "2", "--steps", "2", "--out", "{tmp}/run"], "mqar"),
])
def test_long_commands_show_a_progress_bar_on_stderr_unless_told_not_to(argv, desc, dump, tmp_path, capsys):
    argv = [a.format(dump=dump, tmp=tmp_path) for a in argv]
    assert main(argv) in (0, 1)
    captured = capsys.readouterr()
    assert re.search(rf"{desc}:\s+\d+%\|", captured.err), captured.err[-300:]
    assert not re.search(r"\d+%\|", captured.out)  # the bar never goes to stdout
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
    assert main(argv + ["--no-progress"]) in (0, 1)
    assert not re.search(r"\d+%\|", capsys.readouterr().err)


def test_fit_takes_an_npy_dump_by_its_name_and_records_its_metadata_hash(tmp_path, capsys):
    import hashlib

    from sketchlab import load_theta, save_qk

    g = torch.Generator().manual_seed(2)
    save_qk(tmp_path / "d.npy", torch.randn(1, 1, 30, 3, generator=g), torch.randn(1, 1, 30, 3, generator=g))
    out = tmp_path / "t.safetensors"
    assert main(["fit", str(tmp_path / "d.npy"), "--m", "4", "--out", str(out), "--no-progress"]) == 0
    meta_sha = hashlib.sha256((tmp_path / "d.meta.json").read_bytes()).hexdigest()  # it records each part's hash
    assert load_theta(out)[2]["source_sha256"] == meta_sha
    capsys.readouterr()
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "d.meta.json")  # a part of the dump under another name
    assert main(["fit", str(tmp_path / "d.npy"), "--m", "4", "--out", str(tmp_path / "link.safetensors")]) == 2
    assert "is the input" in capsys.readouterr().err and load_theta(out)[2]["source_sha256"] == meta_sha


def test_an_npy_dump_output_counts_with_all_its_parts(tmp_path):
    from sketchlab.cli._common import Outputs

    (tmp_path / "in.txt").write_text("x")
    os.link(tmp_path / "in.txt", tmp_path / "out.k.npy")  # a part of the output dump is the input
    with pytest.raises(ValueError, match=r"--out: output .*out.npy' is the input .*in.txt"):
        Outputs({"--out": str(tmp_path / "out.npy")}, inputs=[str(tmp_path / "in.txt")], dumps=("--out",))
    Outputs({"--out": str(tmp_path / "new" / "o.npy")}, inputs=[str(tmp_path / "in.txt")], dumps=("--out",))
    assert not (tmp_path / "new").exists()  # checking creates nothing


def test_parents_created_for_a_writer_and_removed_when_it_fails(tmp_path):
    """A command that writes its file itself gets the missing parents inside ``parents_created``; when the
    write fails there, the directories it created are removed (nothing left behind), existing ones kept."""
    from sketchlab.cli._common import Outputs

    (tmp_path / "keep").mkdir()
    outputs = Outputs({"--out": str(tmp_path / "keep" / "a" / "b" / "o.safetensors")})
    with pytest.raises(OSError, match="disk full"), outputs.parents_created():
        assert (tmp_path / "keep" / "a" / "b").is_dir()
        raise OSError("disk full")
    assert (tmp_path / "keep").is_dir() and not (tmp_path / "keep" / "a").exists()
    with outputs.parents_created():
        (tmp_path / "keep" / "a" / "b" / "o.safetensors").write_text("x")
    assert (tmp_path / "keep" / "a" / "b" / "o.safetensors").read_text() == "x"


def test_a_failing_fit_leaves_no_output_directory(dump, tmp_path, capsys, monkeypatch):
    """``fit`` creates the output's parents only to write the file, and removes them when that write fails."""
    import sketchlab.fit as fit_module

    def broken_save(self, path, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(fit_module.Fit, "save_theta", broken_save)
    out = tmp_path / "new" / "deeper" / "t.safetensors"
    assert main(["fit", str(dump), "--m", "4", "--out", str(out), "--no-progress"]) != 0
    assert "disk full" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_plot_must_be_png_and_matplotlib_present_before_any_work(dump, tmp_path, capsys, monkeypatch):
    """A plot is written as PNG: another suffix, or no matplotlib, is refused before the spectrum is
    computed (not after it, with the other outputs lost)."""
    import importlib.util

    import sketchlab.spectrum

    def no_work(*args, **kwargs):
        raise AssertionError("the spectrum must not be computed")

    monkeypatch.setattr(sketchlab.spectrum, "kernel_spectrum", no_work)
    rc = main(["spectrum", str(dump), "--plot", str(tmp_path / "fig.pdf"), "--json", str(tmp_path / "s.json")])
    assert rc == 2 and "give a path ending in .png" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    rc = main(["spectrum", str(dump), "--plot", str(tmp_path / "fig.png")])
    assert rc == 2 and "--plot needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists() and not (tmp_path / "fig.png").exists()


def test_check_run_dir_is_the_one_rule_of_train_and_linearize(tmp_path):
    """``check_run_dir``: absent or empty → nothing to check; foreign entries refused (at most four
    named); with ``recorded``, unrecorded settings refused and differing ones named (paths by real
    path); otherwise the sorted entries are returned for the command's own checks."""
    from sketchlab.cli import linearize as lin_cli
    from sketchlab.cli import train as train_cli
    from sketchlab.cli._common import check_run_dir

    out = tmp_path / "run"
    assert check_run_dir(out, command="train", known=("a",)) == []
    out.mkdir()
    assert check_run_dir(out, command="train", known=("a",), recorded=lambda d: None) == []  # empty: a new run
    for name in ("b", "a", "c", "d", "e", "f"):
        (out / name).write_text(name)
    with pytest.raises(ValueError, match=r"holds files that no sketchlab train run writes \(c, d, e, f\): this run"):
        check_run_dir(out, command="train", known=("a", "b"))
    with pytest.raises(ValueError, match=r"no sketchlab linearize run of this kind writes \(b, c, d, e, \.\.\.\)"):
        check_run_dir(out, command="linearize", kind=" of this kind", known=("a",))
    known = ("a", "b", "c", "d", "e", "f")
    assert check_run_dir(out, command="train", known=known) == ["a", "b", "c", "d", "e", "f"]
    with pytest.raises(ValueError, match=r"holds files of an unfinished linearize run \(a, b, c, d, e, f\) whose "
                                         r"settings are not recorded"):
        check_run_dir(out, command="linearize", known=known, recorded=lambda d: None)
    link = tmp_path / "link"
    link.symlink_to(out / "a")
    recorded = {"m": 4, "source": str(out / "a"), "seed": 0}
    same = {"m": 4, "source": str(link), "seed": 0, "new_option": 1}  # a path by another name; an unrecorded option
    assert check_run_dir(out, command="linearize", known=known, recorded=lambda d: recorded, wanted=same,
                         paths=("source",)) == list(known)
    with pytest.raises(ValueError, match=r"another linearize run \(--m 4 there, 8 here; --seed 0 there, 3 here\)"):
        check_run_dir(out, command="linearize", known=known, recorded=lambda d: recorded,
                      wanted={**same, "m": 8, "seed": 3}, paths=("source",))
    with pytest.raises(ValueError, match=r"--source .* there, .*link here"):  # not a path option: compared as text
        check_run_dir(out, command="linearize", known=known, recorded=lambda d: recorded, wanted=same)
    # both commands use it (no copy of the rule of their own)
    assert "check_run_dir(" in inspect.getsource(train_cli._check_run_dir)
    assert "check_run_dir(" in inspect.getsource(lin_cli._check_run_dir)


def test_every_option_of_every_command_says_what_it_does():
    """``--help`` describes each option: none without a help line (a missing one is an option a user
    can only guess at), and every numeric default it states is the parser's (train's --p/--m state the
    kernels' default; the parser keeps None there)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    bare, wrong_default = [], []
    for name in COMMANDS:
        for action in sub[name]._actions:
            if action.dest == "help":
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            if not (action.help or "").strip():
                bare.append(label)
            said = re.search(r"default ([-+0-9.e]+)\)$", action.help or "")  # a numeric default, stated last
            if said and action.default is not None and float(said.group(1)) != float(action.default):
                wrong_default.append(f"{label}: help says {said.group(1)}, default {action.default}")
    assert bare == [] and wrong_default == [], (bare, wrong_default)
