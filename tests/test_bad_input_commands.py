"""Bad and unusual input to the training and linearisation commands (``sketchlab train``,
``sketchlab linearize``): exit 2 with one line naming the file, the tensor or the option, before any
work, and every input file byte-for-byte unchanged; never a traceback, a NaN model with exit 0, or
a lost model."""

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sketchlab.cli import main

TINY = ["--attention", "softmax", "--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--seq-len", "16",
        "--num-pairs", "2", "--batch-size", "4", "--eval-sequences", "4", "--eval-every", "0", "--no-progress"]


def _tree_hashes(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished two-step ``train`` run (its checkpoints, final model, config, train.json)."""
    out = tmp_path_factory.mktemp("train") / "run"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0
    return out


def _one_line_exit_2(argv, capsys, root=None, match=None):
    """Run ``argv``; it must be refused (exit 2, one line, no traceback) before any work — no forward
    pass of a model (training, capture, evaluation) and no fit — with ``root`` left byte-for-byte."""
    from sketchlab.tasks.model import TransformerLM

    before = _tree_hashes(root) if root is not None else None
    work = []

    def forward(self, *args, **kwargs):
        work.append("a forward pass of the model")
        raise AssertionError("the command started its work before refusing the input")

    def fit(*args, **kwargs):
        work.append("a fit")
        raise AssertionError("the command started its work before refusing the input")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TransformerLM, "forward", forward)
        patch.setattr("sketchlab.fit.fit_sketch", fit)
        rc = main(argv)
    captured = capsys.readouterr()
    assert work == [], f"refused only after {work[0]}: {captured.err[-300:]}"
    lines = captured.err.strip().splitlines()
    assert rc == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("sketchlab: error: ") and "Traceback" not in captured.err, lines
    if match is not None:
        assert re.search(match, lines[0]), lines[0]
    if root is not None:
        assert _tree_hashes(root) == before, "a rejected run changed its inputs"
    return lines[0]


# ------------------------------------------------------------------------------------------------
# train: options, devices, memory


@pytest.mark.parametrize("extra,match", [
    (["--seq-len", "10000000"], r"need about .* GiB \(.*seq_len=10000000.*over the memory budget of .* GiB.*lower --seq-len"),
    (["--vocab-size", "100000000000"], r"need about .* GiB \(vocab_size=100000000000.*lower --seq-len, --batch-size, --vocab-size"),
    (["--batch-size", "100000000"], r"over the memory budget"),
    (["--device", "tpu"], r"argument --device: expected a device such as 'cpu', 'cuda' or 'cuda:0', got 'tpu'"),
    (["--device", "meta"], r"argument --device: expected a device of type 'cpu' or 'cuda', got 'meta'"),
    (["--init", "theta"], r"--init applies to --attention llops only"),
    (["--steps", "0"], r"argument --steps: expected an integer >= 1, got 0"),
    (["--seq-len", "-5"], r"argument --seq-len: expected an integer >= 1, got -5"),
    (["--warmup", "-1"], r"argument --warmup: expected an integer >= 0, got -1"),
    (["--clip", "inf"], r"argument --clip: expected a finite number > 0, got 'inf'"),
    (["--weight-decay", "-0.1"], r"argument --weight-decay: expected a finite number >= 0, got '-0.1'"),
    (["--threads", "0"], r"argument --threads: expected an integer >= 1, got 0"),
    (["--seed", "-1"], r"argument --seed: expected an integer seed in \[0, 2\*\*62\], got -1"),
    (["--seed", "18446744073709551615"], r"argument --seed: expected an integer seed in \[0, 2\*\*62\]"),
    (["--num-pairs", "1000"], r"vocab_size must be >= 2 \* num_pairs \+ 1"),
    (["--lr", "nan"], r"argument --lr: expected a finite number > 0, got 'nan'"),
])
def test_train_rejects_bad_options_before_any_work(extra, match, tmp_path, capsys, monkeypatch):
    import sketchlab.tasks

    def no_work(*args, **kwargs):
        raise AssertionError("training started before the bad option was refused")

    monkeypatch.setattr(sketchlab.tasks, "train_mqar", no_work)
    out = tmp_path / "deep" / "run"
    _one_line_exit_2(["train", *TINY, "--steps", "2", "--out", str(out), *extra], capsys, match=match)
    assert not out.exists()


def test_train_without_cuda_rejects_device_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _one_line_exit_2(["train", *TINY, "--out", str(tmp_path / "r"), "--device", "cuda"], capsys,
                     match=r"argument --device: device 'cuda': CUDA is not available on this machine")


def test_train_creates_parents_and_reports_each_file(tmp_path, capsys):
    out = tmp_path / "runs" / "a" / "b"
    assert main(["train", *TINY, "--steps", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    for name in ("model.safetensors", "config.json", "train.json"):
        assert f"wrote {out / name}" in err and (out / name).is_file()


# ------------------------------------------------------------------------------------------------
# train: outputs that are inputs, directories of something else


def _spell(kind: str, target: Path, tmp_path: Path) -> str:
    if kind == "same":
        return str(target)
    if kind == "dotdot":
        return str(target / ".." / target.name)
    link = tmp_path / f"link-{target.name}"
    link.symlink_to(target, target_is_directory=True)
    return str(link)


@pytest.mark.parametrize("kind", ["same", "dotdot", "symlink"])
def test_train_out_onto_init_from_is_refused(kind, run_dir, tmp_path, capsys):
    teacher = tmp_path / "teacher"
    shutil.copytree(run_dir, teacher)
    line = _one_line_exit_2(["train", *TINY, "--attention", "llops", "--m", "4", "--init-from", str(teacher),
                             "--out", _spell(kind, teacher, tmp_path)], capsys, root=teacher)
    assert "holds the input" in line and str(teacher) in line


def test_train_out_holding_the_theta_file_is_refused(tmp_path, capsys):
    from sketchlab import save_theta

    out = tmp_path / "out"
    out.mkdir()
    theta = torch.randn(1, 2, 1, 2, 8, 4) * 0.1
    save_theta(out / "theta.safetensors", theta, theta, p=2, m=4, t=1, d=8, method="llops", scale="none",
               source_sha256="0" * 64, errors={}, sketchlab_version="0")
    _one_line_exit_2(["train", *TINY, "--attention", "llops", "--m", "4", "--init", "theta",
                      str(out / "theta.safetensors"), "--out", str(out)], capsys, root=out,
                     match=r"--out: output directory .* holds the input .*theta.safetensors")


def test_train_out_holding_another_model_or_other_files_is_refused(run_dir, tmp_path, capsys):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("model.safetensors", "config.json"):
        shutil.copy(run_dir / name, model_dir / name)
    _one_line_exit_2(["train", *TINY, "--steps", "2", "--out", str(model_dir)], capsys, root=model_dir,
                     match=r"holds a model \(model.safetensors\) that no sketchlab train run wrote there")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine\n")
    _one_line_exit_2(["train", *TINY, "--steps", "2", "--out", str(other)], capsys, root=other,
                     match=r"holds files that no sketchlab train run writes \(notes.txt\)")
    _one_line_exit_2(["train", *TINY, "--steps", "2", "--out", str(other / "notes.txt")], capsys, root=other,
                     match=r"is a file, not a directory")


def test_train_rerun_with_other_settings_is_refused_and_same_settings_resume(run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    _one_line_exit_2(["train", *TINY, "--steps", "3", "--out", str(run)], capsys, root=run,
                     match=r"was written by another run configuration, so this run cannot resume from it \(stages: ")
    assert main(["train", *TINY, "--steps", "2", "--out", str(run)]) == 0
    assert "resumed from step 2" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# checkpoints: resumable state and model directories


def _latest(run: Path) -> Path:
    return sorted((run / "checkpoints").iterdir())[-1]


def _poison(path: Path, value=float("nan")) -> str:
    tensors = load_file(str(path))
    name = sorted(n for n, t in tensors.items() if t.is_floating_point())[0]
    tensors[name].view(-1)[0] = value
    save_file(tensors, str(path))
    return name


@pytest.mark.parametrize("damage,match", [
    ("nan_weights", r"checkpoint file .*model.safetensors: tensor {name} holds 1 non-finite value"),
    ("inf_moments", r"checkpoint file .*trainer.safetensors: tensor {name} holds 1 non-finite value"),
    ("truncated_weights", r"checkpoint file .*model.safetensors: unreadable safetensors file"),
    ("foreign_trainer", r"checkpoint file .*trainer.safetensors: tensor rng.data .* is missing"),
    ("foreign_weights", r"checkpoint file .*model.safetensors does not hold this model's weights: missing"),
    ("state_garbage", r"checkpoint .*: unreadable state.json"),
    ("state_without_losses", r"state.json: 'losses' must be a JSON list"),
])
def test_resume_from_a_damaged_checkpoint_is_refused(damage, match, run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    ck = _latest(run)
    name = ""
    if damage == "nan_weights":
        name = _poison(ck / "model.safetensors")
    elif damage == "inf_moments":
        name = _poison(ck / "trainer.safetensors", float("inf"))
    elif damage == "truncated_weights":
        data = (ck / "model.safetensors").read_bytes()
        (ck / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "foreign_trainer":
        save_file({"x": torch.zeros(3)}, str(ck / "trainer.safetensors"))
    elif damage == "foreign_weights":
        save_file({"q": torch.zeros(3)}, str(ck / "model.safetensors"))
    elif damage == "state_garbage":
        (ck / "state.json").write_bytes(b"\xff\x00not json")
    else:
        state = json.loads((ck / "state.json").read_text())
        del state["losses"]
        (ck / "state.json").write_text(json.dumps(state))
    before = (run / "model.safetensors").read_bytes()
    _one_line_exit_2(["train", *TINY, "--steps", "2", "--out", str(run)], capsys,
                     match=match.format(name=re.escape(name)))
    assert (run / "model.safetensors").read_bytes() == before  # the final model of the run is not replaced


@pytest.mark.parametrize("command", ["train", "linearize"])
@pytest.mark.parametrize("damage,match", [
    ("nan", r"checkpoint file .*model.safetensors: tensor .* holds 1 non-finite value"),
    ("truncated", r"checkpoint file .*model.safetensors: unreadable safetensors file"),
    ("foreign", r"checkpoint file .*model.safetensors does not hold this model's weights"),
    ("shape", r"checkpoint file .*model.safetensors: tensor .* has shape \(3,\), the model expects"),
    ("config", r"checkpoint .*config.json: not a sketchlab TransformerLM config"),
    ("missing", r"checkpoint .*: missing model.safetensors"),
])
def test_a_damaged_model_directory_is_refused(command, damage, match, tmp_path, capsys):
    teacher = tmp_path / "teacher"
    shutil.copytree(Path(__file__).parent.parent / "data" / "mqar_softmax", teacher)
    weights = teacher / "model.safetensors"
    if damage == "nan":
        _poison(weights)
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:5000])
    elif damage == "foreign":
        save_file({"q": torch.zeros(2)}, str(weights))
    elif damage == "shape":
        tensors = load_file(str(weights))
        tensors[sorted(tensors)[0]] = torch.zeros(3)
        save_file(tensors, str(weights))
    elif damage == "config":
        (teacher / "config.json").write_text("[1, 2]")
    else:
        os.remove(weights)
    if command == "train":
        argv = ["train", *TINY, "--d-model", "128", "--n-heads", "4", "--n-layers", "4", "--attention", "llops",
                "--m", "4", "--init-from", str(teacher), "--out", str(tmp_path / "out")]
    else:
        argv = ["linearize", str(teacher), "--p", "2", "--m", "4", "--steps", "0", "--out", str(tmp_path / "out"),
                "--no-progress"]
    _one_line_exit_2(argv, capsys, root=teacher, match=match)


def test_train_help_names_every_registered_attention(capsys):
    """``train --help`` lists the kernels a user can pick: every name of the toy model's registry."""
    from sketchlab.tasks.model import attention_registry

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps after a hyphen
    listed = help_text.split("attention kernel:")[1].split("(sketchlab.tasks registry)")[0]
    assert sorted(name.strip(" ,") for name in listed.replace(" or ", ", ").split(", ") if name.strip()) == \
        attention_registry()
