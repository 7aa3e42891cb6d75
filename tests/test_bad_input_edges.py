"""Bad input at the edges of the toolkit commands (issue 35, classes 5 and 7): work that would run for
minutes or hours is estimated and refused before it starts, naming its cost and the way out; numbers
that are round-off or cannot be printed are said to be so, not printed as results.

Every CLI case runs against a directory of small dumps and checks that a refused run leaves it
byte-for-byte unchanged, prints one ``sketchlab: error:`` line and no traceback.
"""

import hashlib
import importlib
import math
import re
from pathlib import Path

import pytest
import torch

from sketchlab import save_qk
from sketchlab.cli import main


def _qk(n=24, d=8, H=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H, n, d, generator=g, dtype=torch.float64),
            torch.randn(1, H, n, d, generator=g, dtype=torch.float64))


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("edges")
    for d in (8, 16, 32, 64):
        save_qk(root / f"d{d}.safetensors", *_qk(d=d))
    return root


def _hashes(root: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.is_file()}


def _no_work(monkeypatch):
    """Make every heavy step fail the test: the multiset index, the fits, the HOPM searches."""
    import sketchlab.fit
    import sketchlab.polynomial
    import sketchlab.spectral

    def work(*args, **kwargs):
        raise AssertionError("the command started the work it should have refused")

    monkeypatch.setattr(sketchlab.polynomial, "_symmetric_index_cpu", work)
    monkeypatch.setattr(sketchlab.fit, "fit_sketch", work)
    monkeypatch.setattr(sketchlab.fit, "_fit_checked", work)
    monkeypatch.setattr(importlib.import_module("sketchlab.compare"), "_fit_checked", work)
    monkeypatch.setattr(importlib.import_module("sketchlab.advise"), "_fit_sketch", work)
    monkeypatch.setattr(sketchlab.spectral, "spectral_norm", work)
    monkeypatch.setattr(importlib.import_module("sketchlab.verify"), "spectral_norm", work)


def _exit_2(argv, dumps, capsys, match):
    before = _hashes(dumps)
    rc = main([*argv, "--no-progress"])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == 2, out.err
    assert len(lines) == 1 and lines[0].startswith("sketchlab: error: ") and "Traceback" not in out.err, out.err
    assert re.search(match, lines[0]), lines[0]
    assert _hashes(dumps) == before
    return lines[0]


# ------------------------------------------------------------------------------------------------
# class 7: hangs, estimated and refused before the work

ENUMERATION = r"C\(d\+p-1, p\) = 8\.88e\+05; enumerating them \(1\.78e\+07 index entries, ~[\d.]+ s\) is over the bound"

HANG_CASES = [
    # --p 20 at d = 8: 888 030 multisets enumerated in Python before the first fit (about a minute), then the fits
    (["compare", "d8.safetensors", "--p", "20", "--m", "4"], ENUMERATION + r".*lower p \(--p on the command line\)$"),
    (["compare", "d8.safetensors", "--p", "20", "--m", "4", "--methods", "psf"], ENUMERATION),
    (["advise", "d8.safetensors", "--p", "20", "--target", "0.1"], ENUMERATION + r".*lower p \(--p"),
    (["fit", "d8.safetensors", "--p", "20", "--m", "4", "--out", "t.safetensors"], ENUMERATION + r".*lower --p$"),
    (["verify", "d8.safetensors", "--p", "20", "--m", "4"], ENUMERATION),
    # --p 20 at d = 64: the LLoPS fit ran for minutes and only its report's reference was refused
    (["fit", "d64.safetensors", "--p", "20", "--m", "4", "--out", "t.safetensors"],
     r"fit at p=20, d=64: .*C\(d\+p-1, p\) = 8\.18e\+18; .*~[\d.e+]+ years\)"),
    (["compare", "d64.safetensors", "--p", "20", "--m", "4", "--methods", "llops"], r"compare at p=20, d=64: .*8\.18e\+18"),
    # verify --p 6 at d = 32: 2.3 million multisets, then HOPM on 32^6 = 1.07e9-entry tensors
    (["verify", "d32.safetensors", "--p", "6", "--m", "4"], r"verify at p=6, d=32: .*C\(d\+p-1, p\) = 2\.325e\+06"),
    # verify --p 6 at d = 16: few multisets, but HOPM searches on 16^6 = 1.7e7-entry tensors
    (["verify", "d16.safetensors", "--p", "6", "--m", "4"],
     r"verify at p=6, d=16: the Theorem 3\.4 checks' HOPM searches \(2 head\(s\) x 4 column\(s\) x 2 searches x 8 "
     r"starts x ~200 sweeps x 6 x 16\^6\) would take about 2\.58e\+12 multiply-adds \(~21\.5 min .*over the work "
     r"budget of 1e\+12.*--columns.*--restarts.*--heads"),
]


@pytest.mark.parametrize("argv,match", HANG_CASES, ids=[" ".join(c[0][:4]) for c in HANG_CASES])
def test_hangs_are_estimated_and_refused_before_the_work(argv, match, dumps, capsys, monkeypatch):
    monkeypatch.chdir(dumps)
    _no_work(monkeypatch)
    _exit_2(argv, dumps, capsys, match)
    assert not (dumps / "t.safetensors").exists()


def test_the_api_refuses_the_same_work(dumps, monkeypatch):
    """compare(), advise() and verify() (the entry points under the commands) estimate it too."""
    from sketchlab import compare
    from sketchlab.advise import advise
    from sketchlab.verify import verify

    _no_work(monkeypatch)
    q, k = _qk(d=8)
    with pytest.raises(ValueError, match=ENUMERATION + r".*lower p"):
        compare((q, k), p=20, m=4, methods=["psf"])
    with pytest.raises(ValueError, match=ENUMERATION):
        advise((q, k), p=20, target=0.1)
    with pytest.raises(ValueError, match=ENUMERATION):
        verify((q, k), p=20, m=4)
    with pytest.raises(ValueError, match=r"HOPM searches .* over the work budget"):
        verify(_qk(d=16), p=6, m=4)


def test_the_bounds_leave_the_usual_sizes_alone(dumps):
    """The estimates refuse only what would run for minutes: d = 64 at p <= 4 and the default verify pass."""
    from sketchlab._validation import MAX_SYMMETRIC_INDEX, check_symmetric_features, symmetric_feature_cost
    from sketchlab.verify import verify_cost

    assert symmetric_feature_cost(64, 4) == (766480, 4 * 766480)
    assert symmetric_feature_cost(8, 20)[1] > MAX_SYMMETRIC_INDEX > symmetric_feature_cost(8, 17)[1]
    assert check_symmetric_features(64, 4, 128, where="x", lower_p="lower p", fewer_rows="fewer") == 766480
    with pytest.raises(ValueError, match=r"x: the symmetric features of 2000 tokens \(2000 x 766480 float64\) would take "
                                         r"11\.4 GiB.*; lower p, or fewer, or raise max_bytes"):
        check_symmetric_features(64, 4, 2000, where="x", lower_p="lower p", fewer_rows="fewer")
    work, nbytes = verify_cost(heads=144, n=512, d=64, p=2, m=64, columns=4, restarts=4)
    assert work == 144 * 4 * 2 * 4 * 200 * 2 * 64**2 and nbytes == 4 * 64**2 * 4 * 8
    assert verify_cost(1, 10, 8, 3, 2, 4, 4) == (2 * 2 * 8 * 200 * 3 * 8**3, 4 * 8**3 * 2 * 8)  # c = min(columns, m)


# ------------------------------------------------------------------------------------------------
# class 5: silent garbage at the numeric edges


@pytest.mark.parametrize("factor,size", [(1e-300, r"1e-1197"), (1e-30, r"1e-117"), (0.0, r"0 \(an all-zero Θ\)")])
@pytest.mark.parametrize("method", ["direct", "adam"])
def test_an_init_theta_too_small_to_fit_from_is_refused_naming_its_scale(factor, size, method):
    """A good Θ × 1e-300 as the init: the direct fit returned an all-zero Θ (rel_fro 1) and Adam the same,
    reported converged; now refused naming the kernel's size, Θ's largest entry and the way out. A Θ a
    little smaller than the data (× 1e-3) still fits from its direction."""
    import copy

    from sketchlab import fit_sketch

    q, k = (t[0] * 8**-0.25 for t in _qk(d=8))
    good = fit_sketch("llops", q, k, p=2, m=4, holdout=0).maps  # (map_q, map_k): two LLoPSMap
    small = copy.deepcopy(good)
    with torch.no_grad():
        for fmap in small:
            fmap.theta.mul_(factor)
    with pytest.raises(ValueError, match=rf"init Θ is too small to fit from: its kernel φ\(q\)ᵀφ\(k\) is at most {size} "
                                         r"on these tokens \(head 0; Θ's largest entry .*below 1e-100.*rescale the init "
                                         r"Θ.*init='svd'"):
        fit_sketch("llops", q, k, p=2, m=4, holdout=0, init=small, method=method)
    fine = copy.deepcopy(good)
    with torch.no_grad():
        for fmap in fine:
            fmap.theta.mul_(1e-3)
    refit = fit_sketch("llops", q, k, p=2, m=4, holdout=0, init=fine)
    assert float(refit.report.rel_fro.max()) < 0.9


def test_spectrum_of_a_huge_dump_prints_its_floors(dumps, capsys):
    """q, k × 1e75 at p = 2: σ reaches 3e302 and σ² overflowed, so every floor printed "nan" and the 99%
    energy rank read 1, without a word. The floors and ranks are scale-invariant: the same as the dump's own."""
    from sketchlab.spectrum import kernel_spectrum

    q, k = _qk(d=8)
    base = kernel_spectrum((q, k), p=2, scale="none")
    huge = kernel_spectrum((q * 1e75, k * 1e75), p=2, scale="none")
    assert float(huge.singular_values[..., 0].min()) > 1e300
    torch.testing.assert_close(huge.floor_curve(), base.floor_curve(), rtol=1e-9, atol=1e-12)
    assert torch.equal(huge.energy_rank(0.99), base.energy_rank(0.99))
    assert torch.equal(huge.floor_m(0.3), base.floor_m(0.3))
    path = dumps / "huge75.safetensors"
    save_qk(path, q * 1e75, k * 1e75)
    try:
        assert main(["spectrum", str(path), "--p", "2", "--scale", "none", "--no-progress", "--sizes", "4,8"]) == 0
    finally:
        path.unlink()
    out = capsys.readouterr().out
    assert "nan" not in out.lower() and "3.78e-01" in out, out


def test_spectrum_refuses_sizes_beyond_the_singular_values(dumps, capsys, monkeypatch):
    """--sizes 100000 on 24 tokens was dropped from the table without a word; a requested size beyond the
    singular values is now refused, naming it and the limit (issue 43), while the default sizes beyond
    them are left out with a note."""
    monkeypatch.chdir(dumps)
    assert main(["spectrum", "d8.safetensors", "--p", "2", "--no-progress", "--sizes", "4,100000,30"]) == 2
    assert "--sizes: 100000 exceeds the 24 singular values of A on these 24 tokens" in capsys.readouterr().err
    assert main(["spectrum", "d8.safetensors", "--p", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"Size\(s\) 32, 64, 128, 256 left out: A has 24 singular values on these 24 tokens, so at "
                     r"m >= 24 the floor is 0", out), out
    assert "floor m=16" in out and "floor m=32" not in out


def test_held_out_ratios_to_a_round_off_reference_are_left_out_and_said_so():
    """A constant q with d = 4, p = 2 (10 symmetric features, 18 fitting tokens): the reference reproduces
    the held-out kernel to 1e-16, and "held-out ÷ reference" printed 5.8e16 for psf-random without a word."""
    import warnings

    from sketchlab import compare

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, 4, generator=g, dtype=torch.float64).expand(1, 2, 24, 4).contiguous()
    k = torch.randn(1, 2, 24, 4, generator=g, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = compare((q, k), p=2, m=1, methods=["optimal", "psf-random"], progress=False)
    assert table.roundoff_references() == {(0, 0), (0, 1)}
    assert all(math.isnan(r.holdout_vs_reference) for r in table.rows)  # undefined (issue 43; it read 5.8e16)
    assert all(row["holdout_vs_reference"] is None and "round-off" in row["undefined"]["holdout_vs_reference"]
               for row in table.to_dicts())
    text = table.to_markdown()
    summary = [line for line in text.splitlines() if line.startswith("| psf-random |")][0]
    assert summary.split(" | ")[5] == "undefined", summary
    assert "e+1" not in text and "held-out ÷ reference leaves out 2 of 2 head(s)" in text and "round-off" in text
    # an ordinary dump keeps its ratios and no note
    q2, k2 = _qk(d=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = compare((q2, k2), p=2, m=3, methods=["optimal"], progress=False)
    assert plain.roundoff_references() == set() and "leaves out" not in plain.to_markdown()
    assert "| optimal |" in plain.summary_markdown() and "| 1.0000 |" in plain.summary_markdown()


@pytest.mark.parametrize("argv", [
    ["train", "--task", "mqar", "--attention", "softmax", "--steps", "1", "--eval-sequences", "1000000000"],
])
def test_eval_sequences_that_would_run_for_hours_refused_up_front(argv, tmp_path, capsys, monkeypatch):
    """``--eval-sequences 1e9`` is refused within seconds, naming the cost and the flag, before any
    training step or evaluation (issue 35, class 7)."""
    import sketchlab.tasks.train as train_module
    from sketchlab.cli import main

    monkeypatch.setattr(train_module, "_component_accuracies",
                        lambda *a, **k: pytest.fail("an evaluation ran before the refusal"))
    code = main(argv + ["--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "multiply-adds" in err and "--eval-sequences" in err
