"""analysis/linearize_lm.py's own logic: ``--resume`` reads back only a finished SmolLM2 part of the
same command's JSON, and a fixed map without a gate counts as having nothing to transfer."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from sketchlab import convert_attention
from tests.test_convert import _llama

_PATH = Path(__file__).resolve().parent.parent / "analysis" / "linearize_lm.py"
_spec = importlib.util.spec_from_file_location("linearize_lm", _PATH)
lm = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("linearize_lm", lm)
_spec.loader.exec_module(lm)


def _write(path, **fields):
    path.write_text(json.dumps({"cuts": "", **fields}))
    return path


def test_resume_reads_back_only_the_same_commands_finished_smollm2_part(tmp_path):
    part = {"contexts": [512, 1024], "rows": [{"name": "teacher", "role": "teacher", "ppl": {"512": 44.0, "1024": 39.0}}]}
    done = _write(tmp_path / "a.json", command="python x --m 64", smollm2=part, smollm2_seconds=12.5)
    got = lm.finished_smollm2(done, "python x --m 64")
    assert got["smollm2_seconds"] == 12.5 and got["smollm2"]["resumed"] is True
    assert got["smollm2"]["rows"][0]["ppl"] == {512: 44.0, 1024: 39.0}  # int contexts, as a fresh run keys them
    # stopped inside the SmolLM2 part (no smollm2_seconds): nothing is read back, the part reruns
    assert lm.finished_smollm2(_write(tmp_path / "b.json", command="python x --m 64", smollm2=part),
                               "python x --m 64") == {}
    # another command's JSON (other settings) is refused, naming it
    with pytest.raises(SystemExit, match=r"written by `python x --m 64`, not by this command"):
        lm.finished_smollm2(done, "python x --m 128")
    with pytest.raises(SystemExit, match="written by `None`"):  # a JSON from before the command was recorded
        lm.finished_smollm2(_write(tmp_path / "c.json", smollm2=part, smollm2_seconds=1.0), "python x --m 64")


def test_trainable_is_false_only_for_a_fixed_map_without_a_gate():
    pure_taylor = convert_attention(_llama(), attention="taylor", m=8, window=0, sinks=0)
    assert not lm.trainable(pure_taylor)
    assert lm.trainable(convert_attention(_llama(), attention="taylor", m=8, window=3, sinks=1))  # its gate
    assert lm.trainable(convert_attention(_llama(), attention="hedgehog", m=8, window=0, sinks=0))  # its maps


def test_input_norm_converts_through_the_library_option():
    from types import SimpleNamespace

    from sketchlab.featuremaps import InputNormed

    args = SimpleNamespace(m=8, sinks=1, gate_init="auto", untied=False, train_len=32, train_seqs=2, transfer_steps=1,
                           transfer_lr=1e-2, map_lr=None, transfer_batch=1, gate_seqs=1)
    plain, normed = (lm.convert(_llama(), "llops", args, 3, input_norm=flag) for flag in (False, True))
    assert not isinstance(plain[0].map_q, InputNormed)
    assert isinstance(normed[0].map_q, InputNormed) and isinstance(normed[1].key_map, InputNormed)
    # the transfer cache keeps the two apart
    assert lm.transfer_key("llops", 3, args, input_norm=True) == lm.transfer_key("llops", 3, args) + "_ln"
