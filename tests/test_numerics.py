"""Numbers that never mislead (issue 43): a kernel that underflows or overflows is refused as what it
is, by the one range check of :mod:`sketchlab.numerics`; a ratio whose denominator is round-off is
"undefined" everywhere (tables, JSON ``null`` with a reason, one warning); a requested row or column
that cannot exist is refused, never dropped in silence."""

import json
import re
import warnings

import pytest
import torch
from attention_calls import run_chunked, run_llops

import sketchlab as sl
from sketchlab.cli import main

B, T, H, D, M = 1, 16, 2, 8, 4


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, H, D, generator=g) for _ in range(3))


def _theta(scale, seed=1, shape=(H, 1, 2, D, M)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def _dump(path, factor=1.0, n=48, d=6, const_q=False):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(2))
    if const_q:
        q = torch.ones_like(q)
    sl.save_qk(path, q * factor, k * factor)
    return path


# ---------------------------------------------------------------------------------------------------------
# underflow: named as underflow, never as "signed features"


def test_a_kernel_that_underflows_below_the_cheap_bound_is_refused():
    """Θ × 1e-6, self-tensored, float32: the cheap bound on |φ_Q·φ_K|² (~1e-37) is above float32's smallest
    normal number, but every actual kernel value is below it (~1e-42): the exact test refuses, naming the
    tensors, the measured range and the remedies; before, the attention ran and warned of "signed features"."""
    q, k, v = _qkv()
    theta_q, theta_k = _theta(1e-6), _theta(1e-6, seed=2)
    with pytest.raises(ValueError, match=r"theta_q, theta_k with q, k underflow torch.float32: every kernel value "
                                         r"of head \d is at most \S+, below the smallest normal number 1.18e-38.*"
                                         r"scale.*float64"):
        run_llops(q, k, v, theta_q, theta_k, non_negative=True)


def test_zero_denominators_are_not_called_signed_features():
    """Non-negative features of one query row all 0 (or underflowed): its denominator is exactly 0. The
    warning says so and gives the remedies that help (a scale, float64), not self-tensoring."""
    q, k, v = _qkv()
    phi_q, phi_k = q.abs(), k.abs()  # non-negative features [B, T, H, D]
    phi_q[:, 3] = 0.0
    with pytest.warns(RuntimeWarning) as caught:
        run_chunked(phi_q, phi_k, v)
    text = " ".join(str(w.message) for w in caught)
    assert re.search(r"2 of 32 query rows have a normalising denominator <= 0: 2 exactly 0", text), text
    assert "underflow" in text and "float64" in text
    assert "signed features" not in text and "self-tensor" not in text


def test_a_theta_file_that_underflows_is_refused_at_the_first_forward(tmp_path):
    """A Θ export × 1e-5 loaded by LLoPSAttention.from_pretrained: every kernel value underflows float32
    (self-tensored, the default for a signed Θ). Before: an output of ~1e-35 with exit 0."""
    L, t, p, d, m = 1, 1, 2, 16, 64
    path = sl.save_theta(tmp_path / "theta.safetensors", _theta(1e-5 / 4, shape=(L, H, t, p, d, m)),
                         _theta(1e-5 / 4, seed=2, shape=(L, H, t, p, d, m)), p=p, m=m, t=t, d=d, method="llops",
                         scale="sqrt-d", source_sha256="0" * 64, errors={}, sketchlab_version=sl.__version__)
    block = sl.LLoPSAttention.from_pretrained(path)
    x = torch.randn(2, 32, H * d, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pytest.raises(ValueError, match=r"underflow torch.float32"):
        block(x)


def test_train_init_theta_that_underflows_is_refused(tmp_path, capsys):
    """`sketchlab train --init theta` with a Θ export × 1e-10: every kernel value underflows float32. Before:
    warnings of "signed features" (thousands of rows with a denominator <= 0) and exit 0 after training."""
    L, heads, t, p, d, m = 2, 4, 1, 2, 16, 64  # the toy model's defaults: 2 layers, 4 heads of 16
    path = sl.save_theta(tmp_path / "theta.safetensors", _theta(1e-10, shape=(L, heads, t, p, d, m)),
                         _theta(1e-10, shape=(L, heads, t, p, d, m)), p=p, m=m, t=t, d=d, method="llops",
                         scale="sqrt-d", source_sha256="0" * 64, errors={}, sketchlab_version=sl.__version__)
    rc = main(["train", "--task", "mqar", "--attention", "llops", "--init", "theta", str(path), "--steps", "2",
               "--out", str(tmp_path / "run"), "--no-progress", "--eval-every", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "underflow torch.float32" in err and "signed features" not in err, err


# ---------------------------------------------------------------------------------------------------------
# overflow: ‖A‖_F² beyond float64 while A is finite


def test_fit_refuses_a_kernel_whose_energy_overflows(tmp_path):
    """q, k × 1e75, p = 2: every (qᵀk)² is finite (~1e304) but ‖A‖_F² (~1e611) is not. Refused up front as
    that, with the measured value and the scale that helps (before: "the exact kernel overflows")."""
    dump = sl.load_qk(_dump(tmp_path / "big.safetensors", 1e75))
    q, k = dump.q, dump.k
    with pytest.raises(ValueError, match=r"q, k: ‖A‖_F² of the kernel \(qᵀk\)\^p with p=2 overflows float64 at "
                                         r"head \(0, 0\): it is 1e\d+, "
                                         r"beyond .* every error would be inf.*scale q and k down \(multiply them by "
                                         r"at most 1.2e-38"):
        sl.fit_sketch("optimal", q, k, p=2, m=4)


@pytest.mark.parametrize("argv", [["verify", "--m", "8"], ["compare", "--m", "8", "--methods", "optimal"],
                                  ["advise", "--target", "0.1"]])
def test_the_dump_tools_refuse_an_overflowing_energy(argv, tmp_path, capsys):
    """verify printed "FAIL ... worst nan" (a theorem failure that is an overflow), compare named the kernel,
    advise a stopped fit: each now refuses with exit 2 and one line naming ‖A‖_F² and the remedy."""
    path = _dump(tmp_path / "big.safetensors", 1e75)
    rc = main([argv[0], str(path), "--p", "2", "--scale", "none", "--no-progress", *argv[1:]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and re.search(r"‖A‖_F² .* overflow", err[-1]) and "scale" in err[-1], err


def test_the_spectrum_of_a_huge_but_finite_kernel_is_computed_by_scaling(tmp_path):
    """kernel_spectrum needs no squares of σ: at × 1e75 its σ are the × 1 ones times 1e300 and its floors equal."""
    ref = sl.kernel_spectrum(_dump(tmp_path / "one.safetensors"), p=2, scale="none")
    big = sl.kernel_spectrum(_dump(tmp_path / "big.safetensors", 1e75), p=2, scale="none")
    top = ref.singular_values[..., :21]  # the non-zero ones: rank ≤ D = 21
    torch.testing.assert_close(big.singular_values[..., :21], top * 1e300, rtol=1e-12, atol=0)
    torch.testing.assert_close(big.floor_curve(), ref.floor_curve(), rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------
# undefined ratios: one rule, shown as "undefined", null with a reason in JSON, one warning


def test_a_ratio_to_a_round_off_reference_is_undefined():
    """Constant q: the reference reproduces the held-out kernel to ~1e-15, so held-out ÷ reference
    divides by round-off (it read 2e15 for psf-random): NaN in the report, like a round-off tail."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(48, 6, generator=g, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = sl.fit_sketch("psf-random", torch.ones_like(k), k, p=2, m=4, holdout=0.25)
    assert bool(fit.report.holdout_vs_reference.isnan().all())


def test_compare_marks_undefined_ratios_once(tmp_path, capsys):
    """Constant q: every ratio of both methods is undefined. One warning for the whole call, naming both causes
    (before: one per method and ratio, seven in all); "undefined" in the tables; null with the reason in JSON
    (before: holdout_vs_reference 2e15 for psf-random)."""
    path = _dump(tmp_path / "const.safetensors", const_q=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sl.compare(path, p=2, m=4, methods=["optimal", "psf-random"], progress=False)
    notes = [str(w.message) for w in caught if "undefined" in str(w.message)]
    assert len(notes) == 1 and "tail" in notes[0] and "reference" in notes[0], notes
    rc = main(["compare", str(path), "--p", "2", "--m", "4", "--methods", "optimal,psf-random", "--no-progress",
               "--json", str(tmp_path / "c.json")])
    out, err = capsys.readouterr()
    assert rc == 0 and sum("warning" in line and "undefined" in line for line in err.splitlines()) == 1, err
    assert "| undefined |" in out and not re.search(r"\bnan\b", out)
    data = json.loads((tmp_path / "c.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    for row in data["rows"]:
        for key in ("optimality_ratio", "holdout_optimality_ratio", "holdout_vs_reference"):
            assert row[key] is None and "round-off" in row["undefined"][key], row


def test_advise_prints_no_nan_and_writes_strict_json(tmp_path, capsys):
    path = _dump(tmp_path / "const.safetensors", const_q=True)
    rc = main(["advise", str(path), "--p", "2", "--target", "0.1", "--no-progress", "--json",
               str(tmp_path / "a.json")])
    out = capsys.readouterr().out
    assert rc == 0 and not re.search(r"\bnan\b", out, re.IGNORECASE) and "| undefined |" in out
    data = json.loads((tmp_path / "a.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    head = data["heads"][0]
    assert head["practical_ratio"] is None and "round-off" in head["undefined"]["practical_ratio"]


def test_fit_command_prints_undefined_not_nan(tmp_path, capsys):
    path = _dump(tmp_path / "const.safetensors", const_q=True)
    rc = main(["fit", str(path), "--p", "2", "--m", "4", "--method", "llops", "--no-progress", "--out",
               str(tmp_path / "t.safetensors")])
    out = capsys.readouterr().out
    assert rc == 0 and "optimality_ratio=undefined" in out and not re.search(r"\bnan\b", out), out


# ---------------------------------------------------------------------------------------------------------
# a requested row or column that cannot exist


def test_spectrum_refuses_a_size_beyond_the_singular_values(tmp_path, capsys):
    path = _dump(tmp_path / "d.safetensors")  # 48 tokens: 48 singular values
    rc = main(["spectrum", str(path), "--p", "2", "--sizes", "8,64", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(r"--sizes: 64 exceeds the 48 singular values", err), err


def test_spectrum_markdown_refuses_an_explicit_size_and_notes_default_ones(tmp_path):
    spec = sl.kernel_spectrum(_dump(tmp_path / "d.safetensors"), p=2)
    with pytest.raises(ValueError, match=r"sizes: 64 exceeds the 48 singular values"):
        spec.to_markdown(sizes=[8, 64])
    assert "Size(s) 64, 128, 256 left out" in spec.to_markdown()  # the default sizes: kept out with a note
