"""The conversion options of the real-model path: LLoPS as the tied non-negative map by default
(``tied``), and the hybrid's gates set from the teacher's attention (``gate_init="mass"|"search"``)
in ``sketchlab.linearize`` and ``sketchlab linearize``."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from sketchlab.convert import convert_attention, converted_modules, linearize, load_linearized, save_linearized
from sketchlab.convert.linearize import teacher_attention
from sketchlab.convert.scale import GATE_OFFSETS, TiedLLoPSMap, calibrate_gates, far_mass_gate, tie_theta
from sketchlab.featuremaps import LLoPSMap
from tests.test_convert import perturb_maps
from tests.test_convert_linearize import _llama as _tiny_llama


def _llama(dtype=torch.float64):
    return _tiny_llama().to(dtype)  # the tiny GQA LLaMA of test_convert_linearize (sharpened q), in dtype


def _ids(n=6, T=20, seed=1):
    return torch.randint(1, 60, (n, T), generator=torch.Generator().manual_seed(seed))


def test_llops_conversion_is_tied_by_default_and_from_the_same_draw():
    tied = convert_attention(_llama(), attention="llops", p=2, m=6, window=4, sinks=1)
    untied = convert_attention(_llama(), attention="llops", p=2, m=6, window=4, sinks=1, tied=False)
    for a, b in zip(tied, untied):
        assert isinstance(a.map_q, TiedLLoPSMap) and isinstance(a.key_map, TiedLLoPSMap)
        assert isinstance(b.map_q, LLoPSMap)
        # the same seeded draw: the untied map's equal factors, one of them kept
        assert torch.equal(a.map_q.theta, b.map_q.theta[:, :, 0])
        assert torch.equal(a.key_map.theta, b.key_map.theta[:, :, 0])
        assert not torch.equal(a.map_q.theta, a.key_map.theta)
    model = _llama()
    convert_attention(model, attention="llops", p=2, m=6)
    assert model.config.sketchlab["tied"] is True
    other = _llama()
    convert_attention(other, attention="hedgehog", m=6)
    assert other.config.sketchlab["tied"] is False


def test_tied_conversion_ties_a_given_theta():
    gen = torch.Generator().manual_seed(2)
    theta_q = torch.randn(2, 4, 1, 2, 8, 6, generator=gen, dtype=torch.float64)  # [L, H, t, p, D, m], signed factors
    theta_k = torch.randn(2, 4, 1, 2, 8, 6, generator=gen, dtype=torch.float64)
    sketches = convert_attention(_llama(), attention="llops", p=2, m=6, theta=(theta_q, theta_k))
    for layer, s in enumerate(sketches):
        assert isinstance(s.map_q, TiedLLoPSMap)
        # float64 throughout: the same closed form on the same numbers
        torch.testing.assert_close(s.map_q.theta, tie_theta(theta_q[layer]), atol=0, rtol=0)
        torch.testing.assert_close(s.key_map.theta, tie_theta(theta_k[layer]), atol=0, rtol=0)
    untied = convert_attention(_llama(), attention="llops", p=2, m=6, theta=(theta_q, theta_k), tied=False)
    assert torch.equal(untied[1].map_q.theta, theta_q[1])
    # a given Θ of degree 4 cannot be tied: the default falls back to the untied map, tied=True refuses
    q4 = torch.randn(2, 4, 1, 4, 8, 6, generator=gen, dtype=torch.float64)
    assert isinstance(convert_attention(_llama(), attention="llops", p=4, m=6, theta=(q4, q4))[0].map_q, LLoPSMap)
    with pytest.raises(ValueError, match="tied=True with a fitted theta needs p=2"):
        convert_attention(_llama(), attention="llops", p=4, m=6, theta=(q4, q4), tied=True)
    # an even degree without Θ is tied: (x·θ)^4 >= 0
    s4 = convert_attention(_llama(), attention="llops", p=4, m=6, window=4, sinks=1)[0]
    assert isinstance(s4.map_q, TiedLLoPSMap) and s4.map_q.degree == 4


def test_tied_option_errors_and_toy_default():
    with pytest.raises(ValueError, match="tied=True .* attention='llops'"):
        convert_attention(_llama(), attention="hedgehog", m=6, tied=True)
    with pytest.raises(ValueError, match="even degree p"):
        convert_attention(_llama(), attention="llops", p=3, m=6, tied=True)
    with pytest.raises(TypeError, match="tied must be None or a bool"):
        convert_attention(_llama(), attention="llops", m=6, tied="yes")
    assert isinstance(convert_attention(_llama(), attention="llops", p=3, m=6)[0].map_q, LLoPSMap)  # odd p
    from sketchlab.tasks.model import TransformerConfig, TransformerLM

    toy = TransformerLM(TransformerConfig(vocab_size=60, d_model=32, n_heads=2, n_layers=2))
    assert isinstance(convert_attention(toy, attention="llops", m=6)[0].map_q, LLoPSMap)  # DESIGN §6 (1)


def test_tied_save_load_round_trip_and_old_saves(tmp_path):
    model = _llama()
    convert_attention(model, attention="llops", p=2, m=6, window=3, sinks=1)
    perturb_maps(model)
    ids = _ids(2, 12)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    save_linearized(model, tmp_path / "tied")
    fresh = load_linearized(tmp_path / "tied", _llama())
    assert isinstance(converted_modules(fresh)[0].map_q, TiedLLoPSMap)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, want, atol=0, rtol=0)
    # a directory saved before the option existed (no "tied" recorded) held the untied map
    old = _llama()
    convert_attention(old, attention="llops", p=2, m=6, window=3, sinks=1, tied=False)
    save_linearized(old, tmp_path / "old")
    import json

    path = tmp_path / "old" / "sketchlab_conversion.json"
    options = json.loads(path.read_text())
    del options["tied"]
    path.write_text(json.dumps(options))
    assert isinstance(converted_modules(load_linearized(tmp_path / "old", _llama()))[0].map_q, LLoPSMap)


def test_convert_attention_refuses_data_gates():
    with pytest.raises(ValueError, match="gate_init='search': convert_attention takes a number"):
        convert_attention(_llama(), attention="llops", m=6, gate_init="search")


@pytest.mark.parametrize("how", ["mass", "search"])
def test_linearize_gate_init_sets_gates_from_the_teacher(how):
    ids = _ids()
    model, report = linearize(_llama(), ids, attention="llops", p=2, m=6, window=4, sinks=1, seq_len=20, holdout=0.34,
                              fit=False, gate_init=how, gate_sequences=2, transfer_steps=0, evaluate=False)
    got = torch.stack([s.gate.detach() for s in converted_modules(model)])  # [L, H]
    # the same calibration by hand on a fresh conversion (same seed: the same maps), on the first
    # 2 of the 4 training sequences
    teacher = _llama()
    mask = torch.ones_like(ids)
    layers = teacher_attention(teacher, ids, mask)
    sketches = convert_attention(copy.deepcopy(teacher), attention="llops", p=2, m=6, window=4, sinks=1)
    want = torch.stack(calibrate_gates(sketches, layers, mask, torch.arange(2), how=how))
    torch.testing.assert_close(got, want.to(got.dtype), atol=0, rtol=0)
    assert float(got.abs().max()) > 0.1  # not the number gate_init 0
    assert report.stages[0]["gates"] == [g.tolist() for g in want]
    mass = torch.stack([far_mass_gate(s, io, mask, torch.arange(2)) for s, io in zip(sketches, layers)])
    if how == "mass":
        torch.testing.assert_close(want, mass, atol=0, rtol=0)
    else:  # each head's gate is one of mass + offsets
        offsets = want - mass
        assert all(any(abs(float(o) - c) < 1e-9 for c in GATE_OFFSETS) for o in offsets.flatten())


def test_linearize_gate_init_default_and_errors():
    ids = _ids()
    model, report = linearize(_llama(), ids, attention="taylor", m=10, window=4, sinks=1, seq_len=20, holdout=0.34,
                              transfer_steps=0, evaluate=False)
    assert report.settings["gate_init"] == "search" and report.stages[0]["gates"] is not None
    model, report = linearize(_llama(), ids, attention="hedgehog", m=6, window=4, sinks=1, seq_len=20, holdout=0.34,
                              transfer_steps=0, evaluate=False)  # bounded features: an even split
    assert report.settings["gate_init"] == 0.0 and report.stages[0]["gates"] is None
    assert all(not bool(s.gate.detach().any()) for s in converted_modules(model))
    model, report = linearize(_llama(), ids, attention="hedgehog", m=6, window=4, sinks=1, seq_len=20, holdout=0.34,
                              gate_init=1.5, transfer_steps=0, evaluate=False)
    assert all(torch.equal(s.gate.detach(), torch.full((4,), 1.5, dtype=torch.float64)) for s in converted_modules(model))
    model, report = linearize(_llama(), ids, attention="hedgehog", m=6, window=0, sinks=0, seq_len=20, holdout=0.34,
                              transfer_steps=0, evaluate=False)
    assert report.stages[0]["gates"] is None
    # sinks=None: none for pure linear attention (it used to default to 4 and fail after the teacher pass),
    # 4 with a window; the settings and the saved options record the resolved number
    for window, want in ((0, 0), (4, 4)):
        model, report = linearize(_llama(), ids, attention="hedgehog", m=6, window=window, seq_len=20, holdout=0.34,
                                  transfer_steps=0, evaluate=True)
        assert report.settings["sinks"] == want and model.config.sketchlab["sinks"] == want
        assert math.isfinite(report.stages[0]["metric"])  # the converted model runs
    with pytest.raises(ValueError, match="window=0 .* has none"):
        linearize(_llama(), ids, attention="hedgehog", m=6, window=0, sinks=0, seq_len=20, holdout=0.34,
                  gate_init="search", transfer_steps=0, evaluate=False)
    with pytest.raises(ValueError, match="gate_init must be a number, 'mass', 'search' or None"):
        linearize(_llama(), ids, attention="hedgehog", m=6, seq_len=20, holdout=0.34, gate_init="max", evaluate=False)
    with pytest.raises(ValueError, match="how must be 'mass' or 'search'"):
        calibrate_gates([], [], torch.ones(1, 2), [0], how="max")


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(tied=True, attention="hedgehog"), ValueError, r"tied=True makes the LLoPS map tied"),
    (dict(tied="yes"), TypeError, r"tied must be None or a bool, got 'yes'"),
    (dict(tied=True, p=3), ValueError, r"tied=True needs an even degree p"),
    (dict(gate_init=float("inf")), ValueError, r"gate_init must be a finite number, 'mass', 'search' or None, got inf"),
    (dict(fit_tokens=-1), ValueError, r"fit_tokens"),
    (dict(max_bytes=50_000), ValueError, r"linearize on 6 sequence\(s\) of 20 tokens \(parameters .* GiB \+ teacher "
     r"recording .* GiB \+ .*; estimated\) would take .* GiB, over the memory budget max_bytes"),
    (dict(window=0, sinks=2, gate_init=0.0), ValueError, r"sinks=2 with window=0: attention sinks are exact keys"),
    (dict(normalize="none"), ValueError, r"the hybrid \(window=4 > 0\) .* always normalised"),
    (dict(normalize="bogus"), ValueError, r"normalize must be one of \['none', 'sum'\], got 'bogus'"),
])
def test_linearize_refuses_bad_options_before_any_work(kwargs, err, match, monkeypatch):
    """Options the conversion checks are checked before the teacher's attention is recorded and Θ fitted."""
    import importlib

    lin = importlib.import_module("sketchlab.convert.linearize")  # the module (the package exports the function)

    def refuse(*args, **kw):
        raise AssertionError("linearize recorded the teacher before refusing its options")

    monkeypatch.setattr(lin, "teacher_attention", refuse)
    monkeypatch.setattr(lin, "fit_theta", refuse)
    with pytest.raises(err, match=match):
        linearize(_llama(), _ids(), **{"m": 6, "window": 4, "sinks": 1, "seq_len": 20, "holdout": 0.34,
                                        "evaluate": False, **kwargs})


def test_cli_gate_init_and_untied(tmp_path, capsys):
    import json

    from sketchlab.cli import main
    from tests.test_cli_linearize_lm import WORDS, _model_dir

    _model_dir(tmp_path / "m")
    gen = torch.Generator().manual_seed(0)
    text = " ".join(WORDS[1 + int(i)] for i in torch.randint(0, len(WORDS) - 1, (300,), generator=gen))
    (tmp_path / "t.txt").write_text(text)
    common = ["linearize", "--model-dir", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"), "--m", "4",
              "--window", "4", "--sinks", "1", "--seq-len", "32", "--transfer-steps", "0", "--no-fit", "--no-progress"]
    for extra, gate_init, tied in ((["--gate-init", "mass"], "mass", True), ([], "search", True),
                                   (["--attention", "hedgehog"], 0.0, False),
                                   (["--gate-init", "-1.5", "--untied"], -1.5, False)):
        out = tmp_path / f"o{len(extra)}{gate_init}"
        assert main(common + extra + ["--out", str(out)]) == 0
        summary = json.loads((out / "linearize.json").read_text())
        assert summary["settings"]["gate_init"] == gate_init and summary["settings"]["tied"] is tied  # the map used, not the option as given
        options = json.loads((out / "model" / "sketchlab_conversion.json").read_text())
        assert options["tied"] is tied
        gates = summary["stages"][0]["gates"]
        assert (gates is None) == (not isinstance(gate_init, str))
        if gates is not None:
            assert max(abs(g) for row in gates for g in row) > 0.1  # set from the teacher, not left at 0
    capsys.readouterr()
    for extra, message in ((["--gate-init", "search", "--window", "0"], "--window 0 (pure linear attention) has none"),
                           (["--untied", "--attention", "hedgehog"], "--untied is an LLoPS option"),
                           (["--window", "0", "--attention", "hedgehog"],
                            "--window 0, --sinks 1, --local softmax, --normalize (default): sinks=1 with window=0"),
                           (["--normalize", "none"], "--normalize none: the hybrid (window=4 > 0)"),
                           (["--gate-init", "nope"], "--gate-init")):
        try:
            rc = main(common + extra + ["--out", str(tmp_path / "bad")])
        except SystemExit as err:  # argparse's own refusals
            rc = err.code
        assert rc == 2 and message in capsys.readouterr().err
        assert not (tmp_path / "bad").exists()
    # --sinks left out: 0 with --window 0 (the run used to fail after the teacher pass), 4 with a window;
    # the summary, its cli identity and the saved options record the number, so --sinks 4 resumes that run
    nosinks = common[:common.index("--sinks")] + common[common.index("--sinks") + 2:]
    for window, want in (("0", 0), ("4", 4)):
        out = tmp_path / f"w{window}"
        assert main(nosinks + ["--attention", "hedgehog", "--window", window, "--out", str(out)]) == 0
        summary = json.loads((out / "linearize.json").read_text())
        assert summary["settings"]["sinks"] == summary["cli"]["sinks"] == want
        assert json.loads((out / "model" / "sketchlab_conversion.json").read_text())["sinks"] == want
    again = nosinks + ["--attention", "hedgehog", "--window", "4", "--out", str(tmp_path / "w4")]
    assert main(again + ["--sinks", "4"]) == 0
    capsys.readouterr()
    assert main(again + ["--sinks", "1"]) == 2 and "sinks" in capsys.readouterr().err


def test_fit_theta_layer_by_layer_shapes():
    from sketchlab.convert.linearize import fit_theta

    ids = _ids(4, 20)
    (tq, tk), info = fit_theta(_llama(), ids, torch.ones_like(ids), p=2, m=4, fit_tokens=48,
                               fit_options={"steps": 1, "lm_steps": 0})
    assert tq.shape == tk.shape == (2, 4, 1, 2, 8, 4)  # [L, H, t, p, D, m]
    assert info["fit_tokens"] == 48 and info["tokens"] == 80
    assert len(info["rel_fro"]) == 2 and len(info["rel_fro"][0]) == 4 and all(0 < r < 1 for r in info["rel_fro"][0])
    assert not torch.equal(tq[0], tq[1])  # each layer its own fit


def test_lora_finetune_on_teacher_and_converted():
    from sketchlab.convert.linearize import lora_finetune

    ids = _ids(4, 20)
    mask = torch.ones_like(ids)
    teacher = _llama(torch.float32)
    before = teacher.model.layers[0].self_attn.q_proj.weight.detach().clone()
    merged, curve = lora_finetune(teacher, ids, mask, torch.arange(3), steps=3, rank=2, lr=1e-2)
    assert len(curve) == 3 and not any("lora" in n for n, _ in merged.named_parameters())
    # B starts at 0: the first step moves it, the merged weight differs from the teacher's
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight.detach(), before)
    model = _llama(torch.float32)
    sketches = convert_attention(model, attention="hedgehog", m=4, window=4, sinks=1)
    maps = sketches[0].map_q.weight.detach().clone()  # HedgehogMap's [H, D, m/2]
    merged, _ = lora_finetune(model, ids, mask, torch.arange(3), steps=2, rank=2, lr=1e-2)
    assert len(converted_modules(merged)) == 2
    assert all(p.requires_grad for s in converted_modules(merged) for p in s.parameters())  # restored
    assert torch.equal(converted_modules(merged)[0].map_q.weight.detach(), maps)  # LoRA leaves the maps
    with pytest.raises(ValueError, match="steps"):
        lora_finetune(_llama(), ids, mask, torch.arange(3), steps=0)
    with pytest.raises(ValueError, match="lr must be"):
        lora_finetune(_llama(), ids, mask, torch.arange(3), steps=1, lr=0.0)
    model = _llama(torch.float32)
    for args, kwargs, match in (
            ((ids, mask, [7]), {}, r"train_idx must be a non-empty list of sequence indices in \[0, 4\), got \[7\]"),
            ((ids, mask, []), {}, r"train_idx must be a non-empty"),
            ((ids, mask[:, :5], [0]), {}, r"ids and mask must be tensors of one shape"),
            ((ids, mask, [0]), {"teacher_hidden": torch.zeros(4, 20, 32)}, r"teacher_hidden .* only of one: got one for a llama")):
        with pytest.raises(ValueError, match=match):
            lora_finetune(model, *args, steps=1, **kwargs)
    assert not any("lora" in n for n, _ in model.named_parameters())  # refused before peft touched the model
