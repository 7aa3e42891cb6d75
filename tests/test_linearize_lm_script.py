"""analysis/linearize_lm.py's own logic: ``--resume`` reads back only a finished SmolLM2 part of the
same command's JSON, and a fixed map without a gate counts as having nothing to transfer."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

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


_PL = Path(__file__).resolve().parent.parent / "analysis" / "position_loss.py"
_pl_spec = importlib.util.spec_from_file_location("position_loss", _PL)
pl = importlib.util.module_from_spec(_pl_spec)
_pl_spec.loader.exec_module(pl)


def test_position_buckets_double_and_average_the_right_columns():
    assert pl.buckets_of(2048) == [(1, 64), (64, 128), (128, 256), (256, 512), (512, 1024), (1024, 2048)]
    assert pl.buckets_of(100) == [(1, 64), (64, 100)]
    # column t of token_nll predicts target position t + 1: value = the target position, NaN = padding
    nll = torch.arange(1, 100, dtype=torch.float64).repeat(2, 1)  # [2, 99]: targets 1..99
    nll[1, 80:] = float("nan")
    sums, counts = pl.bucket_sums(nll, pl.buckets_of(100))
    got = (sums.sum(0) / counts.sum(0)).tolist()
    assert got[0] == pytest.approx(sum(range(1, 64)) / 63)
    assert got[1] == pytest.approx((sum(range(64, 100)) + sum(range(64, 81))) / (36 + 17))


def test_closed_interval_is_a_bootstrap_over_paired_sequences():
    counts = torch.full((4, 2), 10.0)
    teacher = torch.full((4, 2), 30.0)  # mean loss 3 per token in every sequence and bucket
    window = torch.full((4, 2), 40.0)   # 4
    hybrid = torch.tensor([[35.0, 32.0]] * 4)  # closes 0.5 and 0.8 in every sequence: a point interval
    lo, hi = pl.closed_interval(hybrid, window, teacher, counts, draws=200)
    assert lo == pytest.approx([0.5, 0.8]) and hi == pytest.approx([0.5, 0.8])
    hybrid = torch.tensor([[31.0, 40.0], [39.0, 30.0], [35.0, 35.0], [35.0, 35.0]])  # closed per sequence vary
    lo, hi = pl.closed_interval(hybrid, window, teacher, counts, draws=2000)
    for a, z in zip(lo, hi):  # the point value 0.5 inside, the interval inside the per-sequence range [0, 1]
        assert 0.0 <= a < 0.5 < z <= 1.0
    with pytest.raises(ValueError, match="context must be >= 2"):
        pl.buckets_of(1)
    assert pl.buckets_of(32) == [(1, 32)]
