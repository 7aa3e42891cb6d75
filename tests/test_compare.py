"""compare(): one row per (layer, head, method), Theorem 3.1 as the floor, table layout, errors.

The in-sample optimality ratio of the "optimal" method is 1 to float64 round-off (its error equals
the tail, see tests/test_optimal.py), and no other size-≤m sketch can go below it on the fitting
tokens: we assert ≥ 1 − 1e-9 (round-off of a float64 SVD tail, as in test_optimal.py).
"""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from sketchlab.compare import DEFAULT_METHODS, ComparisonTable, compare

F64 = torch.float64
METHODS = ["optimal", "psf", "tensorsketch", "based", "mlp", "elementwise"]
FAST = {"mlp": {"steps": 20}, "elementwise": {"steps": 20}}


def _qk(L=2, H=2, n=40, d=4, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, n, d, generator=g, dtype=dtype), torch.randn(L, H, n, d, generator=g, dtype=dtype)


@pytest.fixture(scope="module")
def table() -> ComparisonTable:
    return compare(_qk(), p=2, m=6, methods=METHODS, seed=0, holdout=0.25, options=FAST, progress=False)


def test_rows_and_floor(table):
    assert len(table.rows) == 2 * 2 * len(METHODS)
    assert {(r.layer, r.head, r.method) for r in table.rows} == {
        (l, h, m) for l in range(2) for h in range(2) for m in METHODS
    }
    for r in table.rows:
        assert r.optimality_ratio >= 1 - 1e-9, r
        assert r.holdout_rel_mae is not None
        if r.method == "optimal":
            assert abs(r.optimality_ratio - 1) < 1e-9
    assert table.values("psf", "num_features") == [4] * 4  # non-negative PSF at p = 2: r = ⌊√6⌋ = 2
    assert table.values("mlp", "num_parameters")[0] >= 2 * 2 * 4 * 6  # ≥ rank-1 untied LLoPS


def test_markdown_layout(table):
    md = table.to_markdown()
    assert "| Method | Layer 0 | Layer 1 | Avg |" in md
    assert "scale = sqrt-d (q, k × 0.7071 = d^-1/4, d = 4" in md and "p = 2, m = 6" in md  # the default scale
    # the summary's ×optimum column of the optimum is 1, held-out rel_mae is shown as a plain number
    assert "| Method | rel_mae | rel_fro | ×optimum | held-out rel_mae |" in md
    assert "| optimal |" in md.split("**Summary**")[1].split("**")[0]
    summary_optimal = [l for l in table.summary_markdown().splitlines() if l.startswith("| optimal |")][0]
    assert summary_optimal.split(" | ")[3] == "1.0000"
    assert "Optimality ratio on held-out" not in md
    for method in METHODS:
        assert f"| {method} |" in md
    # the Avg cell of the optimal row in the optimality-ratio table is exactly 1
    ratio_block = md.split("**×optimum: ‖Â−A‖_F / √tail")[1]
    assert "| optimal | 1.0000 | 1.0000 | 1.0000 |" in ratio_block
    assert table.cell("psf", "rel_mae") == pytest.approx(sum(table.values("psf")) / 4)
    assert table.to_markdown(stat="median") != md


def test_json_roundtrip(table):
    data = json.loads(table.to_json())
    assert data["config"]["p"] == 2 and data["config"]["scale"] == "sqrt-d" and data["config"]["holdout"] == 0.25
    assert len(data["rows"]) == len(table.rows)
    assert data["rows"][0].keys() >= {"layer", "head", "method", "rel_mae", "rel_fro", "optimality_ratio",
                                      "holdout_rel_mae", "num_features", "num_parameters", "fit_seconds"}


def test_ratio(table):
    per_head = sorted(a / b for a, b in zip(table.values("psf"), table.values("optimal")))
    assert table.ratio("psf", "optimal") == pytest.approx((per_head[1] + per_head[2]) / 2)


def test_scale_is_applied_and_recorded():
    q, k = _qk(L=1, H=1)
    methods = ["optimal", "psf", "based"]
    scaled = compare((q, k), p=2, m=5, methods=methods, scale="sqrt-d", progress=False)
    manual = compare((q * 4**-0.25, k * 4**-0.25), p=2, m=5, methods=methods, scale="none", progress=False)
    assert scaled.scale == "sqrt-d" and scaled.scale_factor == pytest.approx(4**-0.25)
    for a, b in zip(scaled.rows, manual.rows):
        assert a.rel_mae == pytest.approx(b.rel_mae, rel=1e-9)
    factor = compare((q, k), p=2, m=5, methods=["optimal"], scale=0.5, progress=False)
    assert factor.scale_factor == 0.5 and factor.scale == "0.5" and "scale = 0.5 (q, k × 0.5" in factor.to_markdown()
    # one default for every dump-level entry point: sqrt-d
    default = compare((q, k), p=2, m=5, methods=methods, progress=False)
    assert default.scale == "sqrt-d" and [r.rel_mae for r in default.rows] == [r.rel_mae for r in scaled.rows]
    none = compare((q, k), p=2, m=5, methods=["optimal"], scale="none", progress=False)
    assert none.scale_factor == 1.0 and "scale = none (q, k used as stored)" in none.to_markdown()


def test_selection_and_file_input(tmp_path):
    q, k = _qk(L=3, H=3, dtype=torch.float32)
    path = tmp_path / "dump.safetensors"
    save_file({"q": q, "k": k}, str(path))
    t = compare(str(path), p=2, m=5, methods=["optimal", "psf"], layers=[2, 0], heads=[1], progress=False)
    assert t.layers == [2, 0] and t.heads == [1] and t.source == str(path)
    assert {(r.layer, r.head) for r in t.rows} == {(2, 1), (0, 1)}
    assert compare((q[0, 0], k[0, 0]), p=2, m=5, methods=["optimal"], progress=False).layers == [0]
    # negative indices count from the end and are recorded as non-negative positions
    neg = compare((q, k), p=2, m=5, methods=["optimal"], layers=[-1], heads=-3, progress=False)
    assert neg.layers == [2] and neg.heads == [0]
    assert {(r.layer, r.head) for r in neg.rows} == {(2, 0)}
    same = compare((q, k), p=2, m=5, methods=["optimal"], layers=[2], heads=[0], progress=False)
    assert neg.values("optimal", "rel_fro") == same.values("optimal", "rel_fro")


def test_default_methods_run_with_llops():
    assert DEFAULT_METHODS == ("optimal", "llops", "mlp", "psf-random", "tensorsketch", "based-expand")
    t = compare(_qk(L=1, H=2, n=40, d=4), p=2, m=6, seed=1, progress=False,
                options={"mlp": {"steps": 10}, "llops": {"steps": 2}})
    assert t.methods == list(DEFAULT_METHODS) and len(t.rows) == 2 * len(DEFAULT_METHODS)
    assert all(r.optimality_ratio >= 1 - 1e-9 for r in t.rows)  # Theorem 3.1 floor, in-sample
    # LLoPS is rank 1 untied: 2·p·d·m parameters; the MLP has at least as many
    assert t.values("llops", "num_parameters")[0] == 2 * 2 * 4 * 6
    assert t.values("mlp", "num_parameters")[0] >= t.values("llops", "num_parameters")[0]


@pytest.mark.parametrize("kwargs,err,match", [
    ({"methods": ["optimal", "nope"]}, ValueError, "unknown method.*'nope'"),
    ({"methods": []}, ValueError, "at least one"),
    ({"methods": ["psf", "psf"]}, ValueError, "duplicates"),
    ({"p": 0}, ValueError, "p .* must be an integer >= 1"),
    ({"m": 0}, ValueError, "m .* must be an integer >= 1"),
    # n=40, holdout 0.25 -> 30 fitting tokens; C(6+1, 2) = 21 < 6^2: the limit is 21
    ({"m": 22}, ValueError, r"m=22 exceeds 21 = sketchlab\.optimal\.max_sketch_size\(n_fit=30, n_fit, d=6, p=2\)"),
    ({"m": 31, "p": 3}, ValueError, r"m=31 exceeds 30 = .*max_sketch_size\(n_fit=30, n_fit, d=6, p=3\)"),
    ({"layers": [2]}, ValueError,
     r"in-memory \(q, k\): layer 2 is out of range: the dump has 2 layers \(valid indices 0\.\.1, or -2\.\.-1"),
    ({"heads": [-2]}, ValueError, r"in-memory \(q, k\): head -2 is out of range: the dump has 1 heads"),
    # -2 is layer 0 of 2: the same layer twice would be fitted and tabulated twice
    ({"layers": [0, -2]}, ValueError, r"layers contain duplicates: \[0, -2\] selects position\(s\) \[0\]"),
    ({"layers": [0.5]}, ValueError, r"layers must be a list of integers"),
    ({"holdout": 1.0}, ValueError, "holdout must lie in"),
    ({"scale": "sqrt"}, ValueError, "scale must be"),
    ({"scale": -1.0}, ValueError, "scale must be"),
    ({"options": {"mlp": {}}}, ValueError, "options given for method"),
])
def test_bad_input(kwargs, err, match):
    args = {"p": 2, "m": 6, "methods": ["optimal", "psf"], "progress": False, **kwargs}
    with pytest.raises(err, match=match):
        compare(_qk(L=2, H=1, n=40, d=6), **args)


def test_bad_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        compare(str(tmp_path / "missing.safetensors"), p=2, m=4, methods=["psf"], progress=False)
    with pytest.raises(TypeError, match="dump_or_qk must be"):
        compare(42, p=2, m=4, methods=["psf"], progress=False)
    bad = _qk()[0]
    bad[0, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="must be finite"):
        compare((bad, bad), p=2, m=4, methods=["psf"], progress=False)


def test_heldout_ratio_undefined_when_heldout_rank_below_m():
    # 4 held-out tokens < m = 6: the held-out kernel has rank <= 4, its floor is 0, every ratio undefined (NaN)
    t = compare(_qk(L=1, H=1, n=16), p=2, m=6, methods=["optimal", "psf"], progress=False)
    assert all(math.isnan(r.holdout_optimality_ratio) for r in t.rows)
    assert "held-out optimality ratio" in t.to_markdown() and "| inf |" not in t.to_markdown()
    assert json.loads(t.to_json())["rows"][0]["holdout_optimality_ratio"] is None


def test_heldout_reference_column_when_fits_report_it(table):
    import dataclasses

    assert table.has_holdout_reference()  # fit_sketch reports the min-norm reference with every hold-out
    assert all(r.holdout_vs_reference > 0 for r in table.rows)
    without = dataclasses.replace(table, rows=[dataclasses.replace(r, holdout_vs_reference=None) for r in table.rows])
    assert not without.has_holdout_reference()
    assert "held-out ÷ reference" not in without.to_markdown() and "rel_mae only" in without.to_markdown()
    rows = [dataclasses.replace(r, holdout_vs_reference=1.0 if r.method == "optimal" else 2.0) for r in table.rows]
    with_ref = dataclasses.replace(table, rows=rows)
    md = with_ref.to_markdown()
    assert with_ref.has_holdout_reference() and "| held-out ÷ reference |" in md and "minimum-norm W*" in md
    optimal_row = [l for l in with_ref.summary_markdown().splitlines() if l.startswith("| optimal |")][0]
    assert optimal_row.split(" | ")[5] == "1.0000"


def test_errors_against_a_dense_twin(table):
    """Every row's in-sample rel_fro against the dense float64 floor: the optimal row equals
    √(Σ_{i>m} σ_i² / ‖A‖²) of A = (QKᵀ)^2 formed on the fitting tokens (q, k × d^-1/4), to round-off,
    and every row's rel_fro is its ×optimum times that floor (the two columns are one measurement)."""
    from sketchlab.fit import holdout_split

    q, k = _qk()
    fit, _ = holdout_split(40, 0.25, 0)
    factor = 4**-0.25
    for r in table.rows:
        a = ((q[r.layer, r.head, fit] * factor) @ (k[r.layer, r.head, fit] * factor).T) ** 2  # [30, 30]
        s = torch.linalg.svdvals(a)
        floor = float(((s[6:] ** 2).sum() / (s**2).sum()).sqrt())
        assert r.rel_fro == pytest.approx(r.optimality_ratio * floor, rel=1e-9), r
        if r.method == "optimal":
            assert r.rel_fro == pytest.approx(floor, rel=1e-9)


def test_overflow_check_counts_the_tokens_not_the_head_dim():
    """The pre-fit overflow bound is ``n · max|qᵀk|^p`` with ``n`` the tokens (the sums the fitters form),
    not ``d``. Here float32, ``d = 2``, ``n = 2000``, ``p = 2``, ``max|qᵀk| = 10^18.25``: ``n · 10^36.5`` ≈
    1e39.8 exceeds float32's 3.4e38 (refused, naming the 2000 tokens) while ``d · 10^36.5`` ≈ 1e36.8 would not."""
    n, d = 2000, 2
    q = torch.zeros(1, 1, n, d)
    q[..., 0] = 10 ** 9.125  # qᵀk = 10^18.25 for every pair
    with pytest.raises(ValueError, match=r"overflows torch.float32 at head \(0, 0\): .* 2000 tokens × "):
        compare((q, q.clone()), p=2, m=2, methods=["optimal"], scale="none", progress=False)
