"""Conversion with ``input_norm=True``: every converted layer's maps on layer-normalised q, k
(``InputNormed``), recorded in the saved options, passed on by ``linearize`` and ``sketchlab linearize
--input-norm``, its affine trained by attention transfer."""

from __future__ import annotations

import json

import pytest
import torch

from sketchlab.convert import convert_attention, converted_modules, linearize, load_linearized, save_linearized
from sketchlab.convert.scale import TiedLLoPSMap, tie_theta
from sketchlab.featuremaps import HedgehogMap, InputNormed, LLoPSMap, make_feature_map
from tests.test_convert_options import _ids, _llama


def _inner(fmap, kind):
    assert isinstance(fmap, InputNormed) and isinstance(fmap.inner, kind), type(fmap)
    return fmap.inner


def test_every_layer_wrapped_tied_llops_and_a_fitted_theta():
    plain = convert_attention(_llama(), attention="llops", p=2, m=6, window=4, sinks=1)
    normed = convert_attention(_llama(), attention="llops", p=2, m=6, window=4, sinks=1, input_norm=True)
    for a, b in zip(plain, normed):  # the same draw inside the wrapper, one wrapper per side
        assert torch.equal(_inner(b.map_q, TiedLLoPSMap).theta, a.map_q.theta)
        assert torch.equal(_inner(b.key_map, TiedLLoPSMap).theta, a.key_map.theta)
        assert b.map_q is not b.key_map and b.map_q.weight.dtype == torch.float64
    gen = torch.Generator().manual_seed(2)
    theta_q, theta_k = (torch.randn(2, 4, 1, 2, 8, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    tied = convert_attention(_llama(), attention="llops", p=2, m=6, theta=(theta_q, theta_k), input_norm=True)
    untied = convert_attention(_llama(), attention="llops", p=2, m=6, theta=(theta_q, theta_k), tied=False,
                               input_norm=True)
    for layer in range(2):
        torch.testing.assert_close(_inner(tied[layer].key_map, TiedLLoPSMap).theta, tie_theta(theta_k[layer]),
                                   atol=0, rtol=0)
        assert torch.equal(_inner(untied[layer].map_q, LLoPSMap).theta, theta_q[layer])
        assert torch.equal(untied[layer].map_q.weight, torch.ones(4, 8, dtype=torch.float64))
    model = _llama()
    convert_attention(model, attention="hedgehog", m=6, input_norm=True)
    assert model.config.sketchlab["input_norm"] is True
    _inner(converted_modules(model)[1].map_q, HedgehogMap)
    # a custom feature_map's one shared map gets one shared wrapper
    shared = convert_attention(_llama(), feature_map=lambda layer, h, d: make_feature_map("hedgehog", heads=h, head_dim=d,
                                                                                         m=4), input_norm=True)
    assert shared[0].map_q is shared[0].key_map
    other = _llama()
    convert_attention(other, attention="llops", m=6)
    assert other.config.sketchlab["input_norm"] is False and isinstance(converted_modules(other)[0].map_q,
                                                                        TiedLLoPSMap)
    with pytest.raises(TypeError, match="input_norm must be a bool, got 1"):
        convert_attention(_llama(), attention="llops", m=6, input_norm=1)


def test_save_load_round_trip_and_old_saves(tmp_path):
    model = _llama()
    convert_attention(model, attention="llops", p=2, m=6, window=3, sinks=1, input_norm=True)
    with torch.no_grad():  # trained values, not those a fresh conversion recreates
        for s in converted_modules(model):
            for t in (s.map_q.weight, s.key_map.bias, s.map_q.inner.theta, s.gate):
                t.add_(0.2 * torch.randn_like(t))
    ids = _ids(2, 12)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    save_linearized(model, tmp_path / "normed")
    assert json.loads((tmp_path / "normed" / "sketchlab_conversion.json").read_text())["input_norm"] is True
    fresh = load_linearized(tmp_path / "normed", _llama())
    _inner(converted_modules(fresh)[0].map_q, TiedLLoPSMap)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, want, atol=0, rtol=0)
    # loading onto a model converted without it names the option
    plain = _llama()
    convert_attention(plain, attention="llops", p=2, m=6, window=3, sinks=1)
    with pytest.raises(ValueError, match=r"input_norm=False \(saved True\)"):
        load_linearized(tmp_path / "normed", plain)
    # a save from before the option existed (no "input_norm" recorded) held plain maps
    save_linearized(plain, tmp_path / "old")
    for name in ("sketchlab_conversion.json", "config.json"):
        path = tmp_path / "old" / name
        data = json.loads(path.read_text())
        del (data["sketchlab"] if name == "config.json" else data)["input_norm"]
        path.write_text(json.dumps(data))
    assert isinstance(converted_modules(load_linearized(tmp_path / "old", _llama()))[0].map_q, TiedLLoPSMap)


def test_linearize_passes_it_on_and_transfer_trains_the_affine():
    model, report = linearize(_llama(), _ids(), attention="llops", p=2, m=6, window=4, sinks=1, seq_len=20,
                              holdout=0.34, fit=True, fit_tokens=40, fit_work=1e6, gate_init=0.0, transfer_steps=3,
                              input_norm=True, evaluate=False)
    assert report.settings["input_norm"] is True and model.config.sketchlab["input_norm"] is True
    for s in converted_modules(model):
        _inner(s.map_q, TiedLLoPSMap)
        assert not torch.equal(s.map_q.weight, torch.ones_like(s.map_q.weight))  # trained
        assert not torch.equal(s.key_map.bias, torch.zeros_like(s.key_map.bias))
    with pytest.raises(TypeError, match="input_norm must be True or False, got 'yes'"):
        linearize(_llama(), _ids(), m=6, seq_len=20, holdout=0.34, input_norm="yes", evaluate=False)


def test_cli_input_norm(tmp_path):
    from sketchlab.cli import main
    from tests.test_cli_linearize_lm import _model_dir, _text_file

    _model_dir(tmp_path / "m")
    _text_file(tmp_path / "t.txt", 300)
    out = tmp_path / "o"
    assert main(["linearize", "--model-dir", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"), "--m", "4",
                 "--window", "4", "--sinks", "1", "--seq-len", "32", "--transfer-steps", "1", "--no-fit",
                 "--gate-init", "0", "--input-norm", "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "linearize.json").read_text())
    assert summary["settings"]["input_norm"] is True and summary["cli"]["input_norm"] is True
    assert "input norm" in (out / "linearize.md").read_text()
    assert json.loads((out / "model" / "sketchlab_conversion.json").read_text())["input_norm"] is True
