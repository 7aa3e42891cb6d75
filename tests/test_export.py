"""Θ export in one call (sl.export_theta / Fit.save_theta / `sketchlab fit`) and the round trip
into LLoPSAttention.from_pretrained.

Round-trip tolerance: the file stores Θ in the fit's dtype (float64 here) and the block computes in
float64, so the loaded block and the sketch's own features agree to round-off (1e-10 relative).
"""

import json

import pytest
import torch

import sketchlab as sl
from sketchlab.attention import LLoPSAttention
from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.cli import main
from sketchlab.export import file_sha256, fit_llops_maps
from sketchlab.scaling import resolve_scale


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.fixture
def dump_file(tmp_path):
    """A small [L=2, H=2, n=48, d=4] float64 dump on disk."""
    path = tmp_path / "qk.safetensors"
    sl.save_qk(path, _rand(2, 2, 48, 4, seed=1), _rand(2, 2, 48, 4, seed=2), _rand(2, 2, 48, 4, seed=3),
               meta={"source": "test"})
    return path


def _fit(dump_file, method="llops", scale="sqrt-d", **options):
    dump = sl.load_qk(dump_file)
    factor = resolve_scale(scale, dump.q.shape[-1])
    return dump, sl.fit_sketch(method, dump.q * factor, dump.k * factor, p=2, m=6, holdout=0.25, **options), factor


def test_save_theta_fills_every_field_and_round_trips(dump_file, tmp_path):
    dump, fit, factor = _fit(dump_file, rank=2)
    out = fit.save_theta(tmp_path / "theta.safetensors", dump=dump, scale="sqrt-d")
    theta_q, theta_k, meta = sl.load_theta(out)
    assert theta_q.shape == (2, 2, 2, 2, 4, 6)  # [L, H, t, p, d, m]
    assert torch.equal(theta_q.reshape(4, 2, 2, 4, 6), fit.map_q.theta.detach())  # the maps' L·H heads
    assert torch.equal(theta_k.reshape(4, 2, 2, 4, 6), fit.map_k.theta.detach())
    assert (meta["p"], meta["m"], meta["t"], meta["d"]) == (2, 6, 2, 4)
    assert meta["method"] == "llops" and meta["scale"] == "sqrt-d"
    assert meta["source_sha256"] == file_sha256(dump_file)
    assert meta["sketchlab_version"] == sl.__version__
    assert torch.equal(torch.tensor(meta["errors"]["rel_fro"], dtype=torch.float64), fit.report.rel_fro)
    assert torch.equal(torch.tensor(meta["errors"]["holdout_rel_fro"], dtype=torch.float64), fit.report.holdout_rel_fro)

    # the loaded block == attention computed directly from the fit's maps of that layer (fit.layer), layer by layer
    x_q, x_k, v = _rand(2, 20, 2, 4, seed=10), _rand(2, 20, 2, 4, seed=11), _rand(2, 20, 2, 3, seed=12)
    for layer in (0, 1):
        block = LLoPSAttention.from_pretrained(out, layer=layer, normalize="none")
        assert block.qk_scale == pytest.approx(factor)
        got = block.attend(x_q, x_k, v)
        with torch.no_grad():
            # head h of layer `layer` applies the fit's map of head layer·H + h to q·factor
            map_q, map_k = fit.layer(layer)
            fq, fk = map_q.features(x_q * factor), map_k.features(x_k * factor)  # [B, T, H, M]
        ref = feature_attention_naive(fq, fk, v, normalize="none")
        assert torch.allclose(got, ref, atol=1e-10 * ref.abs().max().item(), rtol=0), layer


def test_export_theta_is_the_same_call(dump_file, tmp_path):
    dump, fit, _ = _fit(dump_file)
    a = sl.export_theta(fit, tmp_path / "a.safetensors", dump=dump_file, scale="sqrt-d")
    b = fit.save_theta(tmp_path / "b.safetensors", dump=dump, scale="sqrt-d")
    assert a.read_bytes() == b.read_bytes()


def test_special_cases_export_through_as_llops(dump_file, tmp_path):
    dump, fit, _ = _fit(dump_file, method="elementwise", steps=3)
    out = fit.save_theta(tmp_path / "e.safetensors", dump=dump, scale="sqrt-d")
    assert sl.load_theta(out)[2]["method"] == "elementwise"


def test_export_errors(dump_file, tmp_path):
    dump, fit, _ = _fit(dump_file)
    with pytest.raises(ValueError, match="scale is not recorded"):
        fit.save_theta(tmp_path / "t.safetensors", dump=dump)
    with pytest.raises(ValueError, match=r"^path: output .*is the input .*the same file"):  # names the argument
        fit.save_theta(dump_file, dump=dump, scale="none")
    with pytest.raises(TypeError, match="path of the Q/K dump"):
        fit.save_theta(tmp_path / "t.safetensors", dump=(dump.q, dump.k), scale="none")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fit.save_theta(tmp_path / "t.safetensors", dump=tmp_path / "missing.safetensors", scale="none")
    ts = sl.fit_sketch("tensorsketch", dump.q, dump.k, p=2, m=6)
    with pytest.raises(ValueError, match="cannot be exported"):
        ts.save_theta(tmp_path / "t.safetensors", dump=dump, scale="none")


def test_cli_fit_writes_a_loadable_export(dump_file, tmp_path, capsys):
    out = tmp_path / "theta.safetensors"
    code = main(["fit", str(dump_file), "--method", "llops", "--p", "2", "--m", "6", "--out", str(out),
                 "--layers", "1", "--heads", "0", "--scale", "sqrt-d", "--seed", "3", "--holdout", "0.25"])
    assert code == 0
    theta_q, _, meta = sl.load_theta(out)
    assert theta_q.shape == (1, 1, 1, 2, 4, 6) and meta["scale"] == "sqrt-d"
    assert meta["source_sha256"] == file_sha256(dump_file)
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == f"wrote {out}" and "optimality_ratio=" in captured.out
    block = LLoPSAttention.from_pretrained(out)
    assert block(torch.randn(2, 9, 4, dtype=torch.float64)).shape == (2, 9, 4)


@pytest.mark.parametrize("extra, message", [
    (["--out", "{dump}"], "the same file"),
    (["--out", "{dump}/nowhere/theta.safetensors"], "cannot create the output directory"),
    (["--out", "{tmp}/theta.pt"], ".safetensors"),
    (["--out", "{tmp}/theta.safetensors", "--method", "mlp"], "invalid choice"),
    (["--out", "{tmp}/theta.safetensors", "--m", "0"], "m"),
    (["--out", "{tmp}/theta.safetensors", "--device", "meta"], "of type 'cpu' or 'cuda'"),
    (["--out", "{tmp}/theta.safetensors", "--device", "banana"], "expected a device"),
    (["--out", "{tmp}/theta.safetensors", "--fit-tokens", "0"], "integer >= 1"),
    (["--out", "{tmp}/theta.safetensors", "--method", "psf", "--quality", "high"], "--method llops only"),
    (["--out", "{tmp}/theta.safetensors", "--method", "psf", "--work", "1e9"], "--work applies to --method llops only"),
    (["--out", "{tmp}/theta.safetensors", "--work", "0"], "expected a number > 0 or 'inf', got '0'"),
    (["--out", "{tmp}/theta.safetensors", "--work", "lots"], "expected a number > 0 or 'inf', got 'lots'"),
])
def test_cli_fit_bad_usage_exits_2_before_fitting(dump_file, tmp_path, capsys, extra, message):
    before = dump_file.read_bytes()
    args = [a.format(dump=dump_file, tmp=tmp_path) for a in extra]
    argv = ["fit", str(dump_file), "--p", "2"] + ([] if "--m" in args else ["--m", "6"]) + args
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("sketchlab: error:") and message in err
    assert dump_file.read_bytes() == before
    assert not (tmp_path / "theta.safetensors").exists()


def test_cli_fit_options_reach_the_fit(dump_file, tmp_path, capsys):
    # --fit-tokens, --quality and --device are passed on: the export's recorded fit says so.
    out = tmp_path / "theta.safetensors"
    code = main(["fit", str(dump_file), "--p", "2", "--m", "6", "--out", str(out), "--layers", "0", "--heads", "1",
                 "--holdout", "0", "--fit-tokens", "7", "--quality", "high", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    errors = sl.load_theta(out)[2]["errors"]
    assert errors["fit_tokens"] == 7, errors
    # --work 1: below one iteration's cost, so the fit runs one ALS sweep and says it was capped
    assert main(["fit", str(dump_file), "--p", "2", "--m", "6", "--out", str(out), "--work", "1"]) == 0
    errors = sl.load_theta(out)[2]["errors"]
    assert errors["steps"] == 1 and errors["info"]["capped"] is True, errors
    if not torch.cuda.is_available():
        assert main(["fit", str(dump_file), "--p", "2", "--m", "6", "--out", str(out), "--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_fit_command_is_listed():
    from sketchlab.cli import COMMANDS

    assert "fit" in COMMANDS
    assert json.dumps(COMMANDS)


def test_scale_none_is_recorded_and_applied_as_one(dump_file, tmp_path):
    dump, fit, factor = _fit(dump_file, scale="none")
    assert factor == 1.0
    out = fit.save_theta(tmp_path / "n.safetensors", dump=dump, scale="none")
    assert sl.load_theta(out)[2]["scale"] == "none"
    block = LLoPSAttention.from_pretrained(out, layer=1, normalize="none")
    assert block.qk_scale == 1.0
    x_q, x_k, v = _rand(1, 9, 2, 4, seed=20), _rand(1, 9, 2, 4, seed=21), _rand(1, 9, 2, 3, seed=22)
    with torch.no_grad():  # layer 1's maps on the unscaled inputs: a wrong factor changes the kernel by factor^4
        map_q, map_k = fit.layer(1)
        fq, fk = map_q.features(x_q), map_k.features(x_k)
    ref = feature_attention_naive(fq, fk, v, normalize="none")
    assert torch.allclose(block.attend(x_q, x_k, v), ref, atol=1e-10 * ref.abs().max().item(), rtol=0)


def test_a_per_head_theta_is_stored_as_one_layer(dump_file, tmp_path):
    dump = sl.load_qk(dump_file)
    q, k = dump.q[1] * 4**-0.25, dump.k[1] * 4**-0.25  # one layer: [H=2, n, d], Θ [H, t, p, d, m]
    fit = sl.fit_sketch("llops", q, k, p=2, m=6)
    out = fit.save_theta(tmp_path / "h.safetensors", dump=dump, scale="sqrt-d")
    theta_q, theta_k, _ = sl.load_theta(out)
    assert theta_q.shape == (1, 2, 1, 2, 4, 6)  # [L=1, H, t, p, d, m]: H kept as heads, not as layers
    assert torch.equal(theta_q[0], fit.map_q.theta.detach()) and torch.equal(theta_k[0], fit.map_k.theta.detach())


def test_non_finite_report_values_become_json_null(dump_file, tmp_path):
    dump, fit, _ = _fit(dump_file)
    fit.report.holdout_optimality_ratio = torch.tensor([[float("nan"), 1.5], [float("inf"), 2.0]], dtype=torch.float64)
    out = fit.save_theta(tmp_path / "t.safetensors", dump=dump, scale="sqrt-d")
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        text = f.metadata()["errors"]
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    assert json.loads(text)["holdout_optimality_ratio"] == [[None, 1.5], [None, 2.0]]
    assert sl.load_theta(out)[2]["errors"]["holdout_optimality_ratio"] == [[None, 1.5], [None, 2.0]]


def test_a_shared_theta_is_exported_for_both_sides(dump_file, tmp_path):
    """A fit with one LLoPS map for both sides (PolySketch's exact form is tied) is written once (``theta_q`` alone,
    metadata ``tied``) and loads with Θ_K = Θ_Q, each equal to that map's own Θ; the block it loads is the block
    of the same Θ written twice (the format of every file written before ``tied``)."""
    dump, fit, _ = _fit(dump_file, method="psf-random")
    map_q, map_k = fit_llops_maps(fit)
    assert map_k is map_q
    path = fit.save_theta(tmp_path / "s.safetensors", dump=dump, scale="sqrt-d")
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert list(f.keys()) == ["theta_q"] and f.metadata()["tied"] == "true"  # Θ stored once
    theta_q, theta_k, meta = sl.load_theta(path)
    assert meta["method"] == "psf-random" and meta["tied"] is True
    assert theta_k is theta_q
    assert torch.equal(theta_q.reshape(map_q.theta.shape), map_q.theta.detach())
    meta.pop("tied")
    twice = sl.save_theta(tmp_path / "twice.safetensors", theta_q, theta_q.clone(), **meta)  # both copies, untied
    assert sl.load_theta(twice)[2]["tied"] is False and twice.stat().st_size > path.stat().st_size
    x = _rand(1, 9, 8, seed=30)
    for layer in (0, 1):
        blocks = [LLoPSAttention.from_pretrained(p, layer=layer, dtype=torch.float64, window=3, sinks=1)
                  for p in (path, twice)]
        with torch.no_grad():
            assert torch.equal(blocks[0](x), blocks[1](x))


def test_a_tied_theta_written_by_acaf206_loads_with_its_outputs(tmp_path):
    """acaf206 (issue 40's start) wrote a tied fit's Θ twice (tests/data/saved_theta_tied/make_saves.py): it loads
    today (untied, equal copies) with the block output that code computed, and re-exported tied (stored once) it
    gives the same output."""
    from pathlib import Path

    old = Path(__file__).parent / "data" / "saved_theta_tied"
    expected = json.loads((old / "theta_expected.json").read_text())
    theta_q, theta_k, meta = sl.load_theta(old / "theta.safetensors")
    assert meta["tied"] is False and theta_k is not theta_q and torch.equal(theta_k, theta_q)
    meta.pop("tied")
    tied = sl.save_theta(tmp_path / "tied.safetensors", theta_q, theta_q, **meta)
    assert sl.load_theta(tied)[2]["tied"] is True
    x = torch.tensor(expected["x"], dtype=torch.float64)
    for path in (old / "theta.safetensors", tied):
        block = LLoPSAttention.from_pretrained(path, layer=0, dtype=torch.float64, **expected["block"])
        with torch.no_grad():
            y = block(x)
        assert torch.allclose(y, torch.tensor(expected["y"], dtype=torch.float64), rtol=0, atol=1e-12), path


def test_source_hash_of_an_npy_dump_with_and_without_its_meta(tmp_path):
    """``source_sha256`` of a ``NAME.npy`` dump: the SHA-256 of ``NAME.meta.json`` (which records every
    part's hash); without it, the SHA-256 of the parts' digests in sorted path order, computed here
    independently with hashlib."""
    import hashlib

    q = _rand(1, 2, 48, 4, seed=5)
    dump = tmp_path / "qk.npy"
    sl.save_qk(dump, q, _rand(1, 2, 48, 4, seed=6), _rand(1, 2, 48, 4, seed=7), meta={"source": "test"})
    fit = sl.fit_sketch("llops", q[0], q[0], p=2, m=6)
    out = fit.save_theta(tmp_path / "a.safetensors", dump=dump, scale="none")
    assert sl.load_theta(out)[2]["source_sha256"] == file_sha256(tmp_path / "qk.meta.json")
    (tmp_path / "qk.meta.json").unlink()
    want = hashlib.sha256()
    for part in sorted(tmp_path.glob("qk.*.npy")):
        want.update(hashlib.sha256(part.read_bytes()).digest())
    out = fit.save_theta(tmp_path / "b.safetensors", dump=dump, scale="none")
    assert sl.load_theta(out)[2]["source_sha256"] == want.hexdigest()
