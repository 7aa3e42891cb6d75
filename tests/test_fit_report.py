"""The fit report beyond EXACT_REPORT_ENTRIES: ``rel_fro`` from Gram matrices (an exact identity,
float64) and ``rel_mae`` from a random sample of query rows (a ratio estimator, tested statistically)."""

import pytest
import torch

import sketchlab.fit
from sketchlab import fit_sketch, kernel_errors, poly_kernel
from sketchlab.featuremaps.heads import pair_features
from sketchlab.metrics import _gram_sq_err, _sampled_rel_mae


def _qk(n, d=4, heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, n, d, generator=gen, dtype=torch.float64) * d**-0.25
    k = torch.randn(heads, n, d, generator=gen, dtype=torch.float64) * d**-0.25 + 0.3
    return q, k


def _maps(q, k, m=5):
    return fit_sketch("llops", q, k, p=2, m=m, steps=2, lm_steps=0).maps


def test_gram_sq_err_is_the_row_block_error():
    # ‖Â − A‖² = ‖Â‖² − 2⟨Â, A⟩ + ‖A‖², each term a sum of ~n² products of O(1) entries: float64
    # round-off ~1e-13 of ‖A‖²; the error here is ~1e-2 ‖A‖², so 1e-9 relative is a wide margin.
    q, k = _qk(60)
    maps = _maps(q, k)
    exact = kernel_errors(maps, q, k, 2)
    fq, fk = pair_features(maps, q, k)
    got = _gram_sq_err(fq, fk, q, k, 2, exact["sq_norm"])
    assert bool((exact["sq_err"] > 1e-4 * exact["sq_norm"]).all())  # not the trivial regime
    torch.testing.assert_close(got, exact["sq_err"], rtol=1e-9, atol=0)


def test_sampled_rel_mae_with_every_row_is_exact():
    q, k = _qk(50)
    maps = _maps(q, k)
    fq, fk = pair_features(maps, q, k)
    est, se = _sampled_rel_mae(fq, fk, q, k, 2, torch.arange(50))
    torch.testing.assert_close(est, kernel_errors(maps, q, k, 2)["rel_mae"], rtol=1e-12, atol=0)
    assert bool((se == 0).all())


def test_sampled_rel_mae_is_unbiased_to_its_standard_error():
    # 300 independent samples of r = 300 of 400 rows: if the estimator is (nearly) unbiased and the
    # standard error right, z = (estimate − exact)/se is ~N(0, 1). Checked: |mean z| < 0.3 (the mean
    # of 300 N(0,1) has sd 0.058; the ratio estimator's O(1/r) bias adds ~0.1), and the share within
    # 2 se in [0.85, 0.99] (0.954 expected; binomial sd 0.012). A wrong se fails one of them: without
    # the finite-population factor √(1 − r/n) = 0.5 here, |z| < 2 nearly always (share > 0.99).
    q, k = _qk(400, heads=1, seed=3)
    maps = _maps(q, k, m=4)
    fq, fk = pair_features(maps, q, k)
    exact = kernel_errors(maps, q, k, 2)["rel_mae"]
    gen = torch.Generator().manual_seed(0)
    z = []
    for _ in range(300):
        rows = torch.randperm(400, generator=gen)[:300].sort().values
        est, se = _sampled_rel_mae(fq, fk, q, k, 2, rows)
        z.append(float((est - exact) / se))
    z = torch.tensor(z)
    assert abs(float(z.mean())) < 0.3
    assert 0.85 <= float((z.abs() < 2).double().mean()) <= 0.99


def test_fit_report_beyond_the_exact_budget(monkeypatch):
    # 225 × 225 fitting and 75 × 75 held-out tokens > the lowered budget of 60²: rel_fro and the
    # ratio exact (Gram identity, to 1e-9); rel_mae within 4 standard errors of the exact value (16
    # and 48 rows sampled: a t-statistic with >= 15 degrees of freedom exceeds 4 with probability
    # ~1e-3, and the seed is fixed); the rows and the se recorded, held-out ones prefixed.
    monkeypatch.setattr(sketchlab.fit, "EXACT_REPORT_ENTRIES", 60 * 60)
    q, k = _qk(300, seed=5)
    fit = fit_sketch("llops", q, k, p=2, m=5, steps=2, lm_steps=0, holdout=0.25)
    info = fit.report.info
    assert info["rel_mae_rows"] == 60 * 60 // 225 and info["holdout_rel_mae_rows"] == 60 * 60 // 75
    fit_idx, held_idx = sketchlab.fit.holdout_split(300, 0.25, 0)
    for prefix, idx, rel_fro, rel_mae in (("", fit_idx, fit.report.rel_fro, fit.report.rel_mae),
                                          ("holdout_", held_idx, fit.report.holdout_rel_fro, fit.report.holdout_rel_mae)):
        exact = kernel_errors(fit.maps, q[:, idx], k[:, idx], 2)
        torch.testing.assert_close(rel_fro, exact["rel_fro"], rtol=1e-9, atol=0)
        se = info[f"{prefix}rel_mae_se"]
        assert bool((se > 0).all())
        assert bool(((rel_mae - exact["rel_mae"]).abs() <= 4 * se).all())
        assert not torch.equal(rel_mae, exact["rel_mae"])  # really sampled
    again = fit_sketch("llops", q, k, p=2, m=5, steps=2, lm_steps=0, holdout=0.25)  # same seed: same sample
    assert torch.equal(again.report.rel_mae, fit.report.rel_mae)


def test_near_exact_sketch_falls_back_to_the_row_blocks(monkeypatch):
    # When sq_err < _GRAM_ERR_FLOOR · ‖A‖² the Gram identity would cancel away its digits, and the
    # report takes every error from the row blocks; the floor is raised to 1 here to force that path.
    monkeypatch.setattr(sketchlab.fit, "EXACT_REPORT_ENTRIES", 20 * 20)
    monkeypatch.setattr(sketchlab.fit, "_GRAM_ERR_FLOOR", 1.0)  # force the fallback
    q, k = _qk(60, seed=6)
    fit = fit_sketch("optimal", q, k, p=2, m=9)
    exact = kernel_errors(fit.maps, q, k, 2)
    torch.testing.assert_close(fit.report.rel_fro, exact["rel_fro"], rtol=1e-9, atol=0)
    torch.testing.assert_close(fit.report.rel_mae, exact["rel_mae"], rtol=1e-12, atol=0)  # the rows were formed anyway
    assert "rel_mae_rows" not in fit.report.info


@pytest.mark.parametrize("entries", [40 * 40, 2**26])
def test_exact_and_factored_reports_agree_on_the_ratio(entries, monkeypatch):
    monkeypatch.setattr(sketchlab.fit, "EXACT_REPORT_ENTRIES", entries)
    q, k = _qk(90, seed=7)
    fit = fit_sketch("llops", q, k, p=2, m=5, steps=2, lm_steps=0)
    a = poly_kernel(q, k, 2)
    fq, fk = pair_features(fit.maps, q, k)
    err = ((fq @ fk.mT - a) ** 2).sum((-2, -1))
    torch.testing.assert_close(fit.report.optimality_ratio, (err / fit.report.tail).sqrt(), rtol=1e-8, atol=0)


def test_report_as_dict_holds_every_field_as_plain_json():
    """``FitReport.as_dict`` keeps every field's value (tensors as nested lists, the rest as they are) and
    is JSON-serialisable: compared field by field with the report itself."""
    import dataclasses
    import json

    torch.manual_seed(0)
    q, k = torch.randn(2, 40, 3, dtype=torch.float64), torch.randn(2, 40, 3, dtype=torch.float64)
    report = fit_sketch("optimal", q, k, p=2, m=4).report
    out = report.as_dict()
    for f in dataclasses.fields(report):
        value = getattr(report, f.name)
        want = value.tolist() if isinstance(value, torch.Tensor) else value
        if f.name == "info":
            want = {key: (v.tolist() if isinstance(v, torch.Tensor) else v) for key, v in value.items()}
        assert out[f.name] == want, f.name
    assert isinstance(out["rel_fro"], list) and len(out["rel_fro"]) == 2 and out["method"] == "optimal"
    json.dumps(out)


_STEPS = {"llops": {"steps": 2, "lm_steps": 1}, "elementwise": {"steps": 2}, "mlp": {"steps": 2}}


@pytest.mark.parametrize("name", sketchlab.fit.available_sketches())
def test_a_fitter_s_account_lives_on_what_it_returns_not_on_its_maps(name):
    # FittedMaps.info is the one home of a fit's account: no map (nor a sub-module of one) carries it, and
    # fit_sketch's report takes steps, converged and the method's entries from it (kernel_core left out).
    from sketchlab.featuremaps import FeatureMap, FittedMaps

    q = torch.randn(2, 24, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.7
    k = torch.randn(2, 24, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 0.7
    options = _STEPS.get(name, {})
    result = sketchlab.fit.sketch_fitter(name)(q, k, p=2, m=3, seed=0, **options)
    maps = result if isinstance(result, tuple) else (result,)
    assert all(isinstance(f, FeatureMap) for f in maps)
    assert not any(hasattr(sub, "fit_info") for f in maps for sub in f.modules())
    fit = fit_sketch(name, q, k, p=2, m=3, seed=0, **options)
    assert not any(hasattr(sub, "fit_info") for f in fit.maps for sub in f.modules())
    if name == "optimal":  # the optimum says nothing of itself: the report measures its floor
        assert not isinstance(result, FittedMaps) and fit.report.info == {}
        return
    assert isinstance(result, FittedMaps) and result.map_q is result[0] and result.map_k is result[1]
    assert result.tied == (name in ("based-expand", "based-taylor", "psf-random", "tensorsketch"))
    assert fit.tied == result.tied
    info = {key: v for key, v in result.info.items() if key not in ("steps", "converged", "kernel_core")}
    assert fit.report.steps == result.info["steps"] and fit.report.converged == result.info["converged"]
    assert set(info) <= set(fit.report.info) and "kernel_core" not in fit.report.info
    for key, value in info.items():
        got = fit.report.info[key]
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, key


def test_a_fitter_that_leaves_fit_info_on_its_map_is_refused():
    """The contract before FittedMaps (the account as ``map_q.fit_info``) is refused with the way out, not ignored;
    the same account returned as FittedMaps reaches the report."""
    from sketchlab.featuremaps import FittedMaps, LLoPSMap, registry

    q = torch.randn(1, 12, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def fresh(p, m, seed):
        return LLoPSMap(1, 3, p=p, m=m, seed=seed, dtype=torch.float64)

    def old_contract(q, k, *, p, m, seed=0):
        fmap = fresh(p, m, seed)
        fmap.fit_info = {"steps": 1}
        return fmap

    def new_contract(q, k, *, p, m, seed=0):
        return FittedMaps(fresh(p, m, seed), info={"steps": 4, "converged": True})

    sketchlab.fit.register_sketch("test-old-contract")(old_contract)
    sketchlab.fit.register_sketch("test-new-contract")(new_contract)
    try:
        with pytest.raises(TypeError, match=r"left fit_info on a map; a fitter returns its account as FittedMaps"):
            fit_sketch("test-old-contract", q, q, p=2, m=3)
        assert fit_sketch("test-new-contract", q, q, p=2, m=3).report.steps == 4
    finally:
        registry._REGISTRY.pop("test-old-contract")
        registry._REGISTRY.pop("test-new-contract")
