"""``sketchlab linearize --cache/--decay/--state/--beta/--exact-layers``: passed to ``linearize()``,
recorded in ``linearize.json`` / ``linearize.md``, saved and reloaded (tiny random GPT-2, nothing
downloaded)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from sketchlab.cli import main
from sketchlab.convert import load_linearized
from tests.test_cli_linearize_lm import WORDS, _model_dir, _text_file


@pytest.mark.parametrize("flags,memory", [
    (["--cache", "2", "--decay", "head", "--exact-layers", "1"],
     {"cache": 2, "decay": "head", "state": "additive", "beta": "head", "exact_layers": [1]}),
    (["--decay", "0.9", "--state", "delta", "--beta", "input"],
     {"cache": 0, "decay": 0.9, "state": "delta", "beta": "input", "exact_layers": []}),
])
def test_cli_memory_flags_reach_linearize_and_the_saved_model(flags, memory, tmp_path, capsys):
    _model_dir(tmp_path / "m")
    _text_file(tmp_path / "t.txt", 300)
    out = tmp_path / "lin"
    rc = main(["linearize", "--model-dir", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"),
               "--attention", "hedgehog", "--m", "4", "--window", "4", "--sinks", "1", "--seq-len", "24",
               "--transfer-steps", "2", "--gate-init", "0", "--out", str(out), "--no-progress", *flags])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((out / "linearize.json").read_text())
    assert {key: summary["settings"][key] for key in memory} == memory
    assert {key: summary["cli"][key] for key in memory} == memory
    md = (out / "linearize.md").read_text()
    assert f"Long-context memory: cache {memory['cache']}, decay {memory['decay']}" in md
    assert ("exact layers: 1." if memory["exact_layers"] else "exact layers: none.") in md
    model = load_linearized(out / "model", transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "m"))
    assert {key: model.config.sketchlab[key] for key in memory} == memory
    again = load_linearized(out / "model", transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "m"))
    ids = torch.randint(1, len(WORDS), (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, again(ids).logits, rtol=0, atol=0)
    # the same command again: the same run, recognised (not "another run")
    rc = main(["linearize", "--model-dir", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"),
               "--attention", "hedgehog", "--m", "4", "--window", "4", "--sinks", "1", "--seq-len", "24",
               "--transfer-steps", "2", "--gate-init", "0", "--out", str(out), "--no-progress", *flags])
    assert rc == 0, capsys.readouterr().err
    # another memory setting there is another run
    rc = main(["linearize", "--model-dir", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"),
               "--attention", "hedgehog", "--m", "4", "--window", "4", "--sinks", "1", "--seq-len", "24",
               "--transfer-steps", "2", "--gate-init", "0", "--out", str(out), "--no-progress", "--cache", "7"])
    assert rc == 2 and "--cache" in capsys.readouterr().err
