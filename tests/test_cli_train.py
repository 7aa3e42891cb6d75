"""``sketchlab train --attention llops``: the defaults are the MQAR study's trainable form (LLoPS of the
affine input, self-tensored, p = 2, m = 16; ``analysis/results/mqar_nope3200.md``), each flag turns its
part off, ``--init based`` starts from BASED's own map, and a run written under other defaults resumes
with its own options."""

import json
import re

import pytest
from safetensors.torch import load_file

from sketchlab.cli import main

# head dimension D = 16 / 2 = 8
TINY = ["--attention", "llops", "--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--seq-len", "16",
        "--num-pairs", "2", "--batch-size", "4", "--eval-sequences", "4", "--eval-every", "0", "--no-progress"]


def _train(tmp_path, name, *extra, steps=2):
    out = tmp_path / name
    assert main(["train", *TINY, "--steps", str(steps), "--out", str(out), *extra]) == 0
    config = json.loads((out / "config.json").read_text())
    summary = json.loads((out / "train.json").read_text())
    theta = load_file(str(out / "model.safetensors"))["blocks.0.attention.attn.map_q.theta"]  # [H, t, p, D (+ 1), m]
    return config["config"]["attention_options"], summary["run_info"]["init"], tuple(theta.shape)


def _pick(options):
    return {k: options[k] for k in ("affine", "non_negative", "p", "m", "rank", "normalize")}


def test_llops_defaults_are_the_studys_affine_self_tensored_form(tmp_path):
    options, init, theta = _train(tmp_path, "default")
    assert _pick(options) == {"affine": True, "non_negative": True, "p": 2, "m": 16, "rank": 1, "normalize": "sum"}
    assert init == {"init": "random", "seed": 0}
    assert theta == (2, 1, 2, 8 + 1, 16)  # the constant coordinate's row: the affine input [x, 1]


def test_no_affine_gives_the_homogeneous_form_and_each_flag_turns_its_part_off(tmp_path):
    options, _, theta = _train(tmp_path, "homogeneous", "--no-affine")
    assert _pick(options) == {"affine": False, "non_negative": True, "p": 2, "m": 16, "rank": 1, "normalize": "sum"}
    assert theta == (2, 1, 2, 8, 16)
    options, _, theta = _train(tmp_path, "plain", "--no-affine", "--no-non-negative", "--m", "64")
    assert _pick(options) == {"affine": False, "non_negative": False, "p": 2, "m": 64, "rank": 1, "normalize": "sum"}
    options, _, _ = _train(tmp_path, "given", "--no-non-negative", "--p", "3", "--m", "5")
    assert _pick(options) == {"affine": True, "non_negative": False, "p": 3, "m": 5, "rank": 1, "normalize": "sum"}


def test_init_based_starts_from_based_expand_map_and_with_affine_from_its_taylor_map(tmp_path):
    # --init based: the homogeneous map BASED's expand form converts to (p 2, m 64 = 8², d' = 8 on D = 8)
    options, init, theta = _train(tmp_path, "based", "--init", "based")
    assert _pick(options) == {"affine": False, "non_negative": False, "p": 2, "m": 64, "rank": 1, "normalize": "sum"}
    assert init == {"init": "based", "dim": 8, "symmetric": False} and theta == (2, 1, 2, 8, 64)
    # --init based --affine: BASED's Taylor map 1 + s + s²/2 with `--attention based`'s d' = min(16, D) = 8
    options, init, theta = _train(tmp_path, "taylor", "--init", "based", "--affine")
    assert _pick(options) == {"affine": True, "non_negative": False, "p": 2, "m": 1 + 8 + 64, "rank": 1,
                              "normalize": "sum"}
    assert init == {"init": "based", "dim": 8, "symmetric": False, "form": "taylor"}
    # a given --m is kept (here the symmetric Taylor map on d' = 4: 1 + 4 + 10 features)
    options, init, _ = _train(tmp_path, "taylor15", "--init", "based", "--affine", "--m", "15")
    assert options["m"] == 15 and init == {"init": "based", "dim": 4, "symmetric": True, "form": "taylor"}


@pytest.mark.parametrize("extra,match", [
    (["--init", "based", "--affine", "--non-negative"],
     r"--init based with --affine is BASED's Taylor map .* --non-negative would square its kernel .*"
     r"add --no-non-negative, or --no-affine"),
    (["--non-negative", "--affine", "--init", "based", "--m", "73"], r"--init based with --affine .* --non-negative"),
    (["--attention", "psf", "--affine"], r"--affine/--no-affine apply to --attention llops only, got --attention psf"),
    (["--attention", "softmax", "--no-affine"], r"--affine/--no-affine apply to --attention llops only"),
])
def test_refused_combinations_name_the_flags_before_any_work(extra, match, tmp_path, capsys, monkeypatch):
    import sketchlab.tasks

    def no_work(*args, **kwargs):
        raise AssertionError("training started before the combination was refused")

    monkeypatch.setattr(sketchlab.tasks, "train_mqar", no_work)
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out), *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.search(match, lines[0]), lines
    assert not out.exists()


def test_a_run_written_under_the_former_defaults_resumes_with_its_own_options(tmp_path, capsys):
    """A run of the former llops defaults (homogeneous p 2, m 64; its checkpoint written before the
    ``affine`` option existed) is resumed by the same command line: the options it does not give are
    the run's, not today's defaults; an option given that differs is refused, naming the field."""
    out = tmp_path / "old"
    former = ["--no-affine", "--no-non-negative", "--m", "64"]
    assert main(["train", *TINY, *former, "--steps", "2", "--out", str(out)]) == 0
    for ck in (out / "checkpoints").iterdir():  # as the former version wrote it: no `affine` option at all
        state = json.loads((ck / "state.json").read_text())
        del state["identity"]["model"]["attention_options"]["affine"]
        (ck / "state.json").write_text(json.dumps(state))
    capsys.readouterr()
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0  # the former README line, as written
    captured = capsys.readouterr()
    assert "resumed from step 2" in captured.out
    assert re.search(r"holds a run of affine=false, non_negative=false, m=64: resuming it with those", captured.err)
    options = json.loads((out / "config.json").read_text())["config"]["attention_options"]
    assert _pick(options) == {"affine": False, "non_negative": False, "p": 2, "m": 64, "rank": 1, "normalize": "sum"}
    # an option given on the command line is the user's: a different one is refused, the field named
    assert main(["train", *TINY, "--affine", "--steps", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "was written by another run configuration" in err and '"affine": false' in err and '"affine": true' in err
    # a run of today's defaults resumes too, without the note
    _train(tmp_path, "new")
    assert main(["train", *TINY, "--steps", "2", "--out", str(tmp_path / "new")]) == 0
    captured = capsys.readouterr()
    assert "resumed from step 2" in captured.out and "holds a run of" not in captured.err


def test_a_resume_names_a_different_init_and_keeps_the_taylor_default_quiet(tmp_path, capsys):
    """The defaults follow ``--init``, so a resume with another ``--init`` than the run's is refused
    naming both (it once reported the Taylor/--non-negative clash of the filled-in defaults, flags
    the user never gave); a Taylor run (``--init based --affine``, m = 73 by default) resumed by the
    same command is not told it keeps a non-default m."""
    _train(tmp_path, "random")
    capsys.readouterr()
    assert main(["train", *TINY, "--init", "based", "--steps", "2", "--out", str(tmp_path / "random")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"holds a run started with --init random, not --init based", err[0]), err
    _train(tmp_path, "taylor", "--init", "based", "--affine")
    capsys.readouterr()
    assert main(["train", *TINY, "--init", "based", "--affine", "--steps", "2", "--out", str(tmp_path / "taylor")]) == 0
    captured = capsys.readouterr()
    assert "resumed from step 2" in captured.out and "holds a run of" not in captured.err


def test_qk_conv_flag_builds_the_convolution_and_saves_it(tmp_path):
    """``--qk-conv K`` (the attention's convolution of q and k; ``--short-conv`` is the block input's): the attention option, recorded in the config, its weights in the saved model (the
    affine llops kernel convolves its D + 1 inputs)."""
    options, _, _ = _train(tmp_path, "conv", "--qk-conv", "3")
    assert options["qk_conv"] == 3
    weights = load_file(str(tmp_path / "conv" / "model.safetensors"))
    conv = weights["blocks.0.attention.attn.far.conv_q"]
    assert conv.shape[-1] == 3 and conv.shape[-2] == weights["blocks.0.attention.attn.map_q.theta"].shape[-2]
    options, _, _ = _train(tmp_path, "plain")
    assert options["qk_conv"] == 0
    assert not any(".far.conv_" in name for name in load_file(str(tmp_path / "plain" / "model.safetensors")))
