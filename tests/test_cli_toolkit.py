"""The verify / advise / spectrum commands: outputs, exit codes (0 ok, 1 a check failed or could not
be made, 2 bad input such as a corrupt or non-finite dump) and the scale in every header."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from sketchlab.cli import COMMANDS, main


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    spec = torch.tensor([2.0, 1.2, 0.7, 0.4, 0.25, 0.15])
    q = torch.randn(2, 2, 48, 6, generator=g) * spec + 0.3
    k = torch.randn(2, 2, 48, 6, generator=g) * spec - 0.2
    path = tmp_path_factory.mktemp("dumps") / "qk.safetensors"
    save_file({"q": q, "k": k}, str(path))
    return str(path)


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert {"compare", "verify", "advise", "spectrum", "capture"} <= set(COMMANDS)
    for name in COMMANDS:  # a long name ("linearize") gets its help on the next line
        assert re.search(rf"^    {name}(\s|$)", out, re.M), name


def test_verify_passes_and_writes_json(dump, tmp_path, capsys):
    out = tmp_path / "v.json"
    rc = main(["verify", dump, "--p", "2", "--m", "5", "--layers", "1", "--json", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.count("PASS ") == 7 and "7/7 PASS" in text and "scale = sqrt-d" in text
    data = json.loads(out.read_text())
    assert data["passed"] is True and data["config"]["scale"] == "sqrt-d" and len(data["checks"]) == 7


def test_verify_m_above_rank_exits_1_and_says_why(dump, capsys):
    rc = main(["verify", dump, "--p", "2", "--m", "22", "--layers", "0", "--heads", "0", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 1
    assert "CANNOT theorem_3_1" in text and "is not below the largest rank A can have" in text


@pytest.mark.parametrize("kind", ["nan", "inf", "garbage", "truncated"])
def test_verify_bad_dump_exits_2(kind, dump, tmp_path, capsys):
    path = tmp_path / f"{kind}.safetensors"
    if kind in ("nan", "inf"):
        q = torch.randn(1, 1, 16, 4)
        q[0, 0, 5, 2] = float(kind)
        save_file({"q": q, "k": torch.randn(1, 1, 16, 4)}, str(path))
        match = "must be finite"
    elif kind == "garbage":
        path.write_bytes(b"not a safetensors file at all")
        match = str(path)
    else:
        path.write_bytes(open(dump, "rb").read()[:300])
        match = str(path)
    rc = main(["verify", str(path), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("sketchlab: error: ") and match in err[0]


def test_advise_writes_table_json_plot(dump, tmp_path, capsys):
    png, js, md = tmp_path / "a.png", tmp_path / "a.json", tmp_path / "a.md"
    rc = main(["advise", dump, "--p", "2", "--target", "0.05", "--layers", "0", "--heads", "1", "--plot", str(png),
               "--json", str(js), "--markdown", str(md), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0 and md.read_text() == text and "| 0 | 1 |" in text and "scale = sqrt-d" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    head = json.loads(js.read_text())["heads"][0]
    assert head["floor_m"] <= head["practical_m"]
    # the floor m against an independent spectrum of the same head, fitting tokens and scale
    from sketchlab import holdout_split, kernel_spectrum, load_qk

    dump_qk = load_qk(dump)
    fit, _ = holdout_split(48, 0.25, 0)
    spec = kernel_spectrum((dump_qk.q[:1, 1:2, fit], dump_qk.k[:1, 1:2, fit]), p=2)
    assert head["floor_m"] == int(spec.floor_m(0.05)[0, 0])


def test_spectrum_writes_table_json_plot(dump, tmp_path, capsys):
    png, js = tmp_path / "s.png", tmp_path / "s.json"
    rc = main(["spectrum", dump, "--p", "3", "--scale", "none", "--sizes", "4,8", "--plot", str(png), "--json", str(js)])
    text = capsys.readouterr().out
    assert rc == 0 and "scale = none" in text and "floor m=8" in text
    assert png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(js.read_text())
    assert len(data["singular_values"]) == 2 and len(data["singular_values"][0][0]) == 48
    # every value against the singular values of A = (QKᵀ)^∘3 formed densely (float64, scale none)
    from sketchlab import load_qk, poly_kernel

    dump_qk = load_qk(dump)
    dense = torch.linalg.svdvals(poly_kernel(dump_qk.q.double(), dump_qk.k.double(), 3))  # [L, H, 48]
    got = torch.tensor(data["singular_values"], dtype=torch.float64)
    assert torch.allclose(got, dense, rtol=0, atol=1e-10 * float(dense.max()))


@pytest.mark.parametrize("argv,match", [
    (["advise", "{dump}", "--p", "2"], "required: --target"),
    (["advise", "{dump}", "--p", "2", "--target", "2"], "target"),
    (["advise", "{dump}", "--p", "2", "--target", "0.1", "--method", "nope"], "unknown method"),
    (["advise", "{dump}", "--p", "2", "--target", "0.1", "--plot", "{dump}/x.png"], "cannot create the output directory"),
    (["spectrum", "{dump}", "--scale", "huge"], "--scale"),
    (["verify", "{dump}", "--m", "0"], "argument --m: expected an integer >= 1, got 0"),
    (["verify", "{dump}", "--layers", "9"], "layer 9 is out of range"),
])
def test_bad_usage_exits_2(argv, match, dump, capsys):
    import re

    rc = main([a.format(dump=dump) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and re.search(match, err[0]), err


def test_verify_scale_option_reaches_the_checks(dump, tmp_path, capsys):
    # --scale is passed on to verify(): the JSON records the factor q, k were multiplied by (0.5, not
    # the default d^-1/4 = 6^-1/4 ≈ 0.639 that a dropped option would give)
    out = tmp_path / "v.json"
    rc = main(["verify", dump, "--p", "2", "--m", "5", "--layers", "1", "--heads", "0", "--scale", "0.5",
               "--json", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    data = json.loads(out.read_text())
    assert data["config"]["scale_factor"] == 0.5 and "scale = 0.5" in text
