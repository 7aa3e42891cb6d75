"""Bad and unusual input to ``sketchlab linearize`` (toy CHECKPOINT and real-model paths) and
``sketchlab capture``: refused before any work with exit 2 and one line naming the option, the
paths, the size, the budget and the way out; inputs never overwritten; other runs' directories
refused; parents created and every file reported as ``wrote PATH``."""

import functools
import hashlib
import importlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from sketchlab.cli import main

TEACHER = Path(__file__).parent.parent / "data" / "mqar_softmax"


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture()
def no_work(monkeypatch):
    """The library functions where the commands' work starts: any call fails the test."""
    import sketchlab.capture
    import sketchlab.convert.mqar
    import sketchlab.hf.pretrained

    def refuse(*args, **kwargs):
        raise AssertionError("the command started its work before refusing the input")

    # functools.wraps: the stub shows the real signature, whose keywords sketchlab.linearize checks
    monkeypatch.setattr(sketchlab.convert.mqar, "linearize_checkpoint",
                        functools.wraps(sketchlab.convert.mqar.linearize_checkpoint)(refuse))
    monkeypatch.setattr(sketchlab.hf.pretrained, "load_pretrained", refuse)
    monkeypatch.setattr(sketchlab.capture, "capture_pretrained", refuse)


def _exit_2(argv, capsys, match):
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("sketchlab: error: "), err
    assert re.search(match, err[0]), err[0]
    return err[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random GPT-2 with a word-level tokenizer, and a text file."""
    from tests.test_cli_linearize_lm import _model_dir, _text_file

    root = tmp_path_factory.mktemp("lm")
    _model_dir(root / "m")
    _text_file(root / "t.txt", 200)
    return root


# ------------------------------------------------------------------------------------------------
# options: typed and range-checked at parse time


@pytest.mark.parametrize("extra,match", [
    (["--lr", "-1"], r"argument --lr: expected a finite number > 0, got '-1'"),
    (["--lr", "nan"], r"argument --lr: expected a finite number > 0"),
    (["--capture-sequences", "0"], r"argument --capture-sequences: expected an integer >= 1, got 0"),
    (["--steps", "-1"], r"argument --steps: expected an integer >= 0, got -1"),
    (["--batch-size", "0"], r"argument --batch-size: expected an integer >= 1"),
    (["--warmup", "-3"], r"argument --warmup: expected an integer >= 0"),
    (["--transfer", "-0.5"], r"argument --transfer: expected a finite number >= 0"),
    (["--eval-sequences", "0"], r"argument --eval-sequences: expected an integer >= 1"),
    (["--eval-every", "-1"], r"argument --eval-every: expected an integer >= 0"),
    (["--seed", "-1"], r"argument --seed: expected an integer seed in \[0, 2\*\*62\]"),
    (["--seed", str(2**70)], r"argument --seed: expected an integer seed"),
    (["--threads", "0"], r"argument --threads: expected an integer >= 1"),
    (["--holdout", "1.5"], r"argument --holdout: expected a number in \[0, 1\)"),
    (["--holdout", "nan"], r"argument --holdout: expected a number in \[0, 1\)"),
    (["--gate-init", "inf"], r"argument --gate-init: expected 'mass', 'search' or a finite number, got 'inf'"),
    (["--gate-init", "nope"], r"argument --gate-init: expected 'mass', 'search' or a finite number, got 'nope'"),
    (["--transfer-lr", "0"], r"argument --transfer-lr: expected a finite number > 0"),
    (["--lora-lr=-1e-4"], r"argument --lora-lr: expected a finite number > 0"),
    (["--p", "0"], r"argument --p: expected an integer >= 1"),
    (["--p", "5000"], r"argument --p: expected an integer in \[1, 1024\]"),
    (["--rank", "0"], r"argument --rank: expected an integer >= 1"),
])
def test_linearize_options_are_checked_at_parse_time(extra, match, tmp_path, capsys, no_work):
    out = tmp_path / "out"
    _exit_2(["linearize", str(TEACHER), "--steps", "0", "--out", str(out), *extra], capsys, match)
    assert not out.exists()


@pytest.mark.parametrize("extra,match", [
    (["--capture-sequences", "100000"],
     r"the captured q, k, v and their float64 copies need about \d+ GiB \(capture_sequences=100000 of 256 tokens.*"
     r"over the memory budget of .* GiB .*lower --capture-sequences"),
    (["--batch-size", "1000000"], r"one fine-tuning batch need about .* GiB .*batch_size=1000000.*lower .*--batch-size"),
    (["--p", "20"], r"the LLoPS fit needs about .* multiply-adds \(16 heads, one iteration .* at p=20, m=64.*over the "
                    r"work budget of 5e\+11: lower --p, --m, --rank or --capture-sequences"),
    # --non-negative fits Θ of half the degree: the fit's work is that of p/2 = 20
    (["--p", "40", "--non-negative"], r"the LLoPS fit needs about .* one iteration .* at p=20, m=64"),
    (["--p", "20", "--m", "512", "--rank", "8"], r"the LLoPS fit's partials and normal matrices need about .* GiB"),
    (["--capture-sequences", "64"], r"the LLoPS fit needs about .* multiply-adds .*12288 fitting tokens"),
])
def test_linearize_sizes_are_bounded_up_front(extra, match, tmp_path, capsys, no_work):
    out = tmp_path / "out"
    _exit_2(["linearize", str(TEACHER), "--steps", "0", "--out", str(out), *extra], capsys, match)
    assert not out.exists()


def test_the_default_toy_run_is_within_the_budgets(tmp_path, capsys, monkeypatch):
    """The budgets refuse only what is over them: the defaults reach the library."""
    import sketchlab.convert.mqar

    reached = []

    def stop(*args, **kwargs):
        reached.append({**kwargs, "parent_made": (tmp_path / "a").is_dir(), "out_made": (tmp_path / "a" / "b").exists()})
        raise ValueError("stop here")

    monkeypatch.setattr(sketchlab.convert.mqar, "linearize_checkpoint",
                        functools.wraps(sketchlab.convert.mqar.linearize_checkpoint)(stop))
    _exit_2(["linearize", str(TEACHER), "--out", str(tmp_path / "a" / "b")], capsys, r"stop here")
    assert reached and reached[0]["p"] == 2
    # the parent is created before the work, --out itself is left to the library (which builds it
    # aside and moves it in at the end), and a failed run removes the parent it created
    assert reached[0]["parent_made"] and not reached[0]["out_made"] and not (tmp_path / "a").exists()


# ------------------------------------------------------------------------------------------------
# outputs onto inputs, other runs' directories


def _spell(kind: str, target: Path, tmp_path: Path) -> str:
    if kind == "same":
        return str(target)
    if kind == "dotdot":
        return str(target.parent / ".." / target.parent.name / target.name)
    if kind == "relative":
        return os.path.relpath(target)
    link = tmp_path / f"link-{target.name}"
    link.symlink_to(target, target_is_directory=target.is_dir())
    return str(link)


@pytest.mark.parametrize("kind", ["same", "dotdot", "relative", "symlink"])
def test_linearize_out_onto_the_teacher_is_refused(kind, tmp_path, capsys, no_work):
    teacher = tmp_path / "teacher"
    shutil.copytree(TEACHER, teacher)
    before = _tree(teacher)
    target = _spell(kind, teacher, tmp_path)
    line = _exit_2(["linearize", str(teacher), "--steps", "0", "--out", target], capsys, r"--out: output directory")
    assert target in line and str(teacher) in line and "holds the input" in line
    assert _tree(teacher) == before


@pytest.mark.parametrize("which", ["model-dir", "text", "gguf"])
@pytest.mark.parametrize("kind", ["same", "dotdot", "symlink"])
def test_linearize_out_onto_a_real_model_input_is_refused(which, kind, model_dir, tmp_path, capsys, no_work):
    work = tmp_path / "w"
    shutil.copytree(model_dir, work)
    gguf = work / "in" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF not really")
    source = ["--gguf", str(gguf)] if which == "gguf" else ["--model-dir", str(work / "m")]
    target = {"model-dir": work / "m", "text": work / "t.txt", "gguf": gguf}[which]
    out = _spell(kind, target if which != "gguf" else gguf.parent, tmp_path)
    before = _tree(work)
    line = _exit_2(["linearize", *source, "--text", str(work / "t.txt"), "--out", out], capsys,
                   r"--out: output directory .* (holds|is) the input")
    assert out in line and str(target) in line
    assert _tree(work) == before


@pytest.fixture(scope="module")
def finished_toy_run(tmp_path_factory):
    """A finished toy run (small: m=4, 1 capture sequence, no fine-tuning, 8 evaluation sequences)."""
    out = tmp_path_factory.mktemp("toy") / "run"
    assert main(["linearize", str(TEACHER), "--m", "4", "--capture-sequences", "1", "--steps", "0",
                 "--eval-sequences", "8", "--out", str(out), "--no-progress"]) == 0
    return out


def test_linearize_creates_parents_and_reports_every_file(finished_toy_run, tmp_path, capsys):
    out = tmp_path / "x" / "y" / "run"
    assert main(["linearize", str(TEACHER), "--m", "4", "--capture-sequences", "1", "--steps", "0",
                 "--eval-sequences", "8", "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    for name in ("capture.safetensors", "theta.safetensors", "model/model.safetensors", "model/config.json",
                 "linearize.json", "linearize.md"):
        assert f"wrote {out / name}" in err and (out / name).is_file(), name


def test_linearize_rerun_with_other_settings_is_refused(finished_toy_run, tmp_path, capsys, no_work):
    run = tmp_path / "run"
    shutil.copytree(finished_toy_run, run)
    before = _tree(run)
    _exit_2(["linearize", str(TEACHER), "--m", "8", "--capture-sequences", "1", "--steps", "0", "--eval-sequences",
             "8", "--out", str(run)], capsys,
            r"--out '.*run' holds the output of another linearize run \(--m 4 there, 8 here\)")
    _exit_2(["linearize", str(TEACHER), "--m", "4", "--capture-sequences", "1", "--steps", "0", "--eval-sequences",
             "8", "--seed", "3", "--out", str(run)], capsys, r"--seed 0 there, 3 here")
    assert _tree(run) == before


def test_linearize_rerun_with_the_same_settings_reaches_the_work(finished_toy_run, tmp_path, capsys, monkeypatch):
    import sketchlab.convert.mqar

    run = tmp_path / "run"
    shutil.copytree(finished_toy_run, run)
    monkeypatch.setattr(sketchlab.convert.mqar, "linearize_checkpoint",
                        functools.wraps(sketchlab.convert.mqar.linearize_checkpoint)(
                            lambda *a, **k: (_ for _ in ()).throw(ValueError("reached"))))
    _exit_2(["linearize", str(TEACHER), "--m", "4", "--capture-sequences", "1", "--steps", "0", "--eval-sequences",
             "8", "--out", os.path.relpath(run)], capsys, r"reached")


def test_linearize_out_holding_other_files_or_an_unfinished_run_is_refused(finished_toy_run, tmp_path, capsys,
                                                                          no_work):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine\n")
    _exit_2(["linearize", str(TEACHER), "--steps", "0", "--out", str(other)], capsys,
            r"holds files that no sketchlab linearize run of this kind writes \(notes.txt\)")
    assert (other / "notes.txt").read_text() == "mine\n"
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(finished_toy_run / "capture.safetensors", unfinished)
    _exit_2(["linearize", str(TEACHER), "--steps", "0", "--out", str(unfinished)], capsys,
            r"holds files of an unfinished linearize run \(capture.safetensors\) whose settings are not recorded")
    _exit_2(["linearize", str(TEACHER), "--steps", "0", "--out", str(other / "notes.txt")], capsys,
            r"is a file, not a directory")


def test_linearize_real_model_reports_files_and_refuses_another_run(model_dir, tmp_path, capsys):
    out = tmp_path / "a" / "lin"
    argv = ["linearize", "--model-dir", str(model_dir / "m"), "--text", str(model_dir / "t.txt"), "--attention",
            "hedgehog", "--m", "4", "--window", "4", "--sinks", "1", "--seq-len", "32", "--transfer-steps", "1",
            "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    for name in ("linearize.json", "linearize.md"):
        assert f"wrote {out / name}" in err
    assert any(line.startswith(f"wrote {out / 'model'}/") for line in err)
    before = _tree(out)
    _exit_2(argv + ["--m", "8"], capsys,
            r"holds the output of another linearize run \(--m 4 there, 8 here\)")
    assert _tree(out) == before


# ------------------------------------------------------------------------------------------------
# all-or-nothing: a run failing at its last file leaves --out as it was


TOY_SMALL = ["--m", "4", "--capture-sequences", "1", "--eval-sequences", "8", "--no-progress"]


def _fail_at_the_last_file(monkeypatch, module, writer: str):
    """Make ``module.<writer>`` fail like a full disk when it writes ``linearize.md`` (a run's last file)."""
    real = getattr(module, writer)

    def write(path, text):
        if str(path).endswith("linearize.md"):
            raise OSError(28, "No space left on device", str(path))
        return real(path, text)

    monkeypatch.setattr(module, writer, write)


def _fails(argv, capsys, match):
    """A run that failed after its work: exit 2, its last stderr line the error (warnings of the
    work may precede it), no traceback."""
    rc = main(argv)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("sketchlab: error: ") and "Traceback" not in err, err[-500:]
    assert re.search(match, last), last


def test_toy_linearize_failing_at_the_last_file_leaves_no_out(tmp_path, capsys, monkeypatch):
    linearize_module = importlib.import_module("sketchlab.convert.mqar")

    _fail_at_the_last_file(monkeypatch, linearize_module, "_write_text")
    out = tmp_path / "a" / "run"
    _fails(["linearize", str(TEACHER), *TOY_SMALL, "--steps", "0", "--out", str(out)], capsys,
            r"No space left on device")
    assert list(tmp_path.iterdir()) == []  # no --out, no parent it created, no staging directory


def test_toy_linearize_failing_at_the_last_file_keeps_the_previous_run(finished_toy_run, tmp_path, capsys,
                                                                      monkeypatch):
    linearize_module = importlib.import_module("sketchlab.convert.mqar")

    run = tmp_path / "run"
    shutil.copytree(finished_toy_run, run)
    before = _tree(run)
    _fail_at_the_last_file(monkeypatch, linearize_module, "_write_text")
    _fails(["linearize", str(TEACHER), *TOY_SMALL, "--steps", "0", "--out", str(run)], capsys,
            r"No space left on device")
    assert _tree(run) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_toy_linearize_interrupted_after_fine_tuning_keeps_only_its_checkpoints_and_resumes(tmp_path, capsys,
                                                                                          monkeypatch):
    """The fine-tuning checkpoints are the one thing a failed toy run leaves in --out: the same command
    then resumes from them (the run identity names Θ's final path, never the staging directory's)."""
    linearize_module = importlib.import_module("sketchlab.convert.mqar")

    out = tmp_path / "run"
    argv = ["linearize", str(TEACHER), *TOY_SMALL, "--steps", "2", "--batch-size", "2", "--out", str(out)]
    with monkeypatch.context() as patch:
        _fail_at_the_last_file(patch, linearize_module, "_write_text")
        _fails(argv, capsys, r"No space left on device")
    assert [p.name for p in out.iterdir()] == ["finetune"] and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert main(argv) == 0
    assert "after 2 steps" in capsys.readouterr().out
    summary = json.loads((out / "linearize.json").read_text())
    assert summary["settings"]["init"]["file"] == str(out / "theta.safetensors")


def test_real_model_linearize_failing_at_the_last_file_leaves_out_as_it_was(model_dir, tmp_path, capsys,
                                                                           monkeypatch):
    import sketchlab.cli.linearize

    argv = ["linearize", "--model-dir", str(model_dir / "m"), "--text", str(model_dir / "t.txt"), "--attention",
            "hedgehog", "--m", "4", "--window", "4", "--sinks", "1", "--seq-len", "32", "--transfer-steps", "1",
            "--no-progress"]
    run = tmp_path / "run"
    assert main([*argv, "--out", str(run)]) == 0
    assert "Writing model shards" not in capsys.readouterr().err  # --no-progress reaches transformers' save too
    before = _tree(run)
    _fail_at_the_last_file(monkeypatch, sketchlab.cli.linearize, "write_text_atomic")
    _fails([*argv, "--out", str(run)], capsys, r"No space left on device")  # the same run again: replaced, or kept
    assert _tree(run) == before
    _fails([*argv, "--out", str(tmp_path / "new" / "run")], capsys, r"No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize("path", ["toy", "pretrained"])
def test_linearize_into_a_directory_whose_parent_is_read_only_is_refused_before_work(path, model_dir, tmp_path,
                                                                                    capsys, monkeypatch, no_work):
    """The run is built beside --out (in its parent) and moved in at the end: a parent that cannot be
    written is refused before the work (the real-model path would otherwise train, then fail)."""
    import sketchlab.cli._common as common

    out = tmp_path / "ro" / "run"
    out.mkdir(parents=True)  # --out itself exists and is writable
    real_access = os.access
    monkeypatch.setattr(common.os, "access",
                        lambda p, mode: False if os.path.realpath(p) == str(tmp_path / "ro") else real_access(p, mode))
    source = [str(TEACHER)] if path == "toy" else ["--model-dir", str(model_dir / "m"), "--text",
                                                   str(model_dir / "t.txt")]
    _exit_2(["linearize", *source, "--out", str(out)], capsys,
            r"--out: directory '.*ro' is not writable: the run's files are built beside '.*run' and moved into it")


# ------------------------------------------------------------------------------------------------
# capture


@pytest.mark.parametrize("which", ["text", "config", "weights"])
@pytest.mark.parametrize("kind", ["same", "dotdot", "symlink"])
def test_capture_out_onto_an_input_is_refused(which, kind, model_dir, tmp_path, capsys, no_work):
    work = tmp_path / "w"
    shutil.copytree(model_dir, work)
    target = {"text": work / "t.txt", "config": work / "m" / "config.json",
              "weights": work / "m" / "model.safetensors"}[which]
    out = _spell(kind, target, tmp_path)
    before = _tree(work)
    line = _exit_2(["capture", "--model-dir", str(work / "m"), "--text", str(work / "t.txt"), "--out", out], capsys,
                   r"--out: output .* is the input")
    assert out in line and str(target) in line
    assert _tree(work) == before


def test_capture_size_is_bounded_up_front(model_dir, capsys, no_work, tmp_path):
    _exit_2(["capture", "--model-dir", str(model_dir / "m"), "--text", str(model_dir / "t.txt"), "--max-tokens",
             str(10**12), "--out", str(tmp_path / "d.safetensors")], capsys,
            r"capture: q, k, v of 1000000000000 tokens \(L=2, H=2, d=8, float32\) need about .* GiB, over the memory "
            r"budget of .* GiB .*lower --max-tokens")
    _exit_2(["capture", "--model-dir", str(model_dir / "m"), "--text", str(model_dir / "t.txt"), "--max-tokens", "0",
             "--out", str(tmp_path / "d.safetensors")], capsys, r"--max-tokens: expected an integer >= 1")


@pytest.mark.parametrize("suffix", ["safetensors", "npy"])
def test_capture_creates_parents_reports_files_and_shows_a_bar(suffix, model_dir, tmp_path, capsys):
    out = tmp_path / "a" / "b" / f"d.{suffix}"
    argv = ["capture", "--model-dir", str(model_dir / "m"), "--text", str(model_dir / "t.txt"), "--max-tokens", "40",
            "--out", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    from sketchlab.io import dump_files

    files = dump_files(out)
    assert files and all(f"wrote {f}" in captured.err.splitlines() for f in files)
    assert re.search(r"capture:\s+\d+%\|", captured.err) and not re.search(r"\d+%\|", captured.out)
    assert main(argv + ["--no-progress"]) == 0
    assert not re.search(r"\d+%\|", capsys.readouterr().err)


@pytest.mark.parametrize("extra,path", [
    (["--attention", "hedgehog"], "toy"), (["--no-fit"], "toy"), (["--window", "8", "--sinks", "0"], "toy"),
    (["--input-norm"], "toy"),
    (["--steps", "3"], "pretrained"), (["--non-negative"], "pretrained"), (["--lr", "0.1"], "pretrained"),
])
def test_an_option_of_the_other_path_is_refused_not_ignored(extra, path, tmp_path, capsys, no_work):
    """Each path reads its own options: the toy CHECKPOINT path refuses the real-model options (it used to
    train LLoPS silently under --attention hedgehog) and the other way round, before any work."""
    out = tmp_path / "out"
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat.\n" * 4, encoding="utf-8")
    source = [str(TEACHER)] if path == "toy" else ["--model-dir", str(tmp_path), "--text", str(text)]
    names = ", ".join(a for a in extra if a.startswith("--"))
    _exit_2(["linearize", *source, *extra, "--out", str(out)], capsys, re.escape(names) + ": not read by the path of")
    assert not out.exists()
