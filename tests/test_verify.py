"""verify(): every check passes on good data with values far below its tolerance, fails when the
library function it guards is broken, and says why when it cannot be made (m at or above the rank)."""

import dataclasses
import math
import pathlib
import sys

import pytest
import torch

import sketchlab
from sketchlab.featuremaps import to_llops
from sketchlab.featuremaps.to_llops import as_llops
from sketchlab.verify import CHECKS, verify

ROOT = pathlib.Path(__file__).resolve().parents[1]

verify_mod = sys.modules["sketchlab.verify"]  # the module (the attribute sketchlab.verify is the function)

F64 = torch.float64


def _qk(L=1, H=2, n=40, d=4, seed=0, rank=None):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(L, H, n, d, generator=g, dtype=F64), torch.randn(L, H, n, d, generator=g, dtype=F64)
    if rank is not None:  # tokens in a rank-dimensional subspace: A has rank <= C(rank+p-1, p)
        basis = torch.randn(d, rank, generator=g, dtype=F64)
        q, k = q[..., :rank] @ basis.T, k[..., :rank] @ basis.T
    return q, k


def _status(result):
    return {c.name: c.status for c in result.checks}


@pytest.fixture(scope="module")
def good():
    return verify(_qk(), p=2, m=5, progress=False)


def test_all_checks_pass_with_room(good):
    assert [c.name for c in good.checks] == list(CHECKS)
    assert good.passed and set(_status(good).values()) == {"PASS"}
    for c in good.checks:
        if c.name != "theorem_3_4_bound":  # round-off checks: a correct implementation is far below the bound
            assert c.value < 0.1 * c.tolerance, c
        else:  # a ratio error / certified bound, at most 1; the bound is not vacuous (ratio well above 0)
            assert 0.01 < c.value <= 1 + 1e-9, c
    text = good.to_text()
    assert "PASS   theorem_3_1" in text and "tolerance" in text and "7/7 PASS" in text
    assert "scale = sqrt-d (q, k × 0.7071 = d^-1/4, d = 4" in text


def test_p3_skips_psf_with_reason():
    res = verify(_qk(n=30, d=3), p=3, m=4, progress=False)
    special = next(c for c in res.checks if c.name == "special_cases")
    assert special.status == "PASS" and "PSF skipped: no exact LLoPS form at p=3" in special.detail
    assert res.passed


def test_m_above_rank_bound_cannot(good):
    # d = 4, p = 2: D = C(5, 2) = 10 symmetric features, so rank A <= 10 <= m
    for m in (10, 11):
        res = verify(_qk(), p=2, m=m, progress=False)
        st = _status(res)
        assert st["theorem_3_1"] == "CANNOT" and not res.passed
        assert st["psi_symmetric"] == "PASS"
        detail = next(c.detail for c in res.checks if c.name == "theorem_3_1")
        assert f"m={m} is not below the largest rank A can have, min(n=40, D=10) = 10" in detail


def test_m_at_numerical_rank_cannot():
    # tokens in a 2-dim subspace: A = (QKᵀ)^2 has rank C(3, 2) = 3; m = 4 leaves a round-off tail
    res = verify(_qk(rank=2), p=2, m=4, progress=False)
    c = next(c for c in res.checks if c.name == "theorem_3_1")
    assert c.status == "CANNOT" and "numerical rank 3" in c.detail and "tail is round-off" in c.detail
    assert verify(_qk(rank=2), p=2, m=2, progress=False).passed


def _one_short(q, k, p, m, **kw):
    opt = sketchlab.optimal_sketch(q, k, p, m, **kw)
    opt.map_q.w[..., -1] = 0  # the query map drops the m-th component: error² = tail + σ_m²
    return opt


def _skewed_features(x, p, symmetric=False):
    return sketchlab.poly_features(x, p, symmetric) * (1 + 1e-9 * symmetric)  # symmetric weights off by 1e-9


def _lower_tau(t, **kw):
    res = sketchlab.spectral_norm(t, **kw)
    res.value *= 1 - 1e-6  # a τ that is not the best rank-1 value
    return res


def _skewed_llops(fmap):
    llops = as_llops(fmap)
    llops.theta.data.mul_(1 + 1e-9)  # Θ off by 1e-9 relative
    return llops


@pytest.mark.parametrize("target,module,name,replacement", [
    ("theorem_3_1", verify_mod, "optimal_sketch", _one_short),
    ("psi_symmetric", verify_mod, "poly_features", _skewed_features),
    ("theorem_3_4_identity", verify_mod, "spectral_norm", _lower_tau),
    ("special_cases", to_llops, "as_llops", _skewed_llops),
])
def test_each_check_fails_on_a_broken_library(monkeypatch, target, module, name, replacement):
    monkeypatch.setattr(module, name, replacement)
    res = verify(_qk(H=1), p=2, m=5, progress=False)
    assert _status(res)[target] == "FAIL", res.to_text()
    assert not res.passed


@pytest.mark.parametrize("kwargs,err,match", [
    ({"p": 0}, ValueError, "p .* must be an integer >= 1"),
    ({"m": 0}, ValueError, "m .* must be an integer >= 1"),
    ({"columns": 0}, ValueError, "columns must be an integer >= 1"),
    ({"scale": "bogus"}, ValueError, "scale must be"),
    ({"layers": [3]}, ValueError, "layer 3 is out of range"),
    ({"seed": 1.5}, TypeError, "seed must be an int"),
])
def test_bad_input(kwargs, err, match):
    with pytest.raises(err, match=match):
        verify(_qk(), **{"p": 2, "m": 5, "progress": False, **kwargs})


def test_non_finite_input_is_rejected():
    q, k = _qk()
    q[0, 0, 3, 1] = math.nan
    with pytest.raises(ValueError, match="must be finite"):
        verify((q, k), p=2, m=5, progress=False)


def _qr_route_one_short(q, k, p, m, route="auto", **kw):
    """The svd route intact, the qr route dropping its m-th component (a routes disagreement only)."""
    opt = sketchlab.optimal_sketch(q, k, p, m, route=route, **kw)
    if route == "qr":
        opt.map_q.w[..., -1] = 0
    return opt


def _qr_route_wrong_values(q, k, p, m, route="auto", **kw):
    """The qr route's maps intact but its reported singular values off by 1e-6 relative."""
    opt = sketchlab.optimal_sketch(q, k, p, m, route=route, **kw)
    if route == "qr":
        opt = dataclasses.replace(opt, singular_values=opt.singular_values * (1 + 1e-6))
    return opt


def _second_singular_pair(t, **kw):
    """For p = 2: the second singular pair of the (symmetric) column matrix instead of the first. It
    satisfies ‖W − σ₂u₂u₂ᵀ‖² = ‖W‖² − σ₂² exactly, so only the τ check (against the 2-norm) sees it."""
    res = sketchlab.spectral_norm(t, **kw)
    w, vecs = torch.linalg.eigh(t)
    i = int(w.abs().argsort(descending=True)[1])
    res.value = float(w[i].abs())
    res.factors = [vecs[:, i], vecs[:, i] * torch.sign(w[i])]
    return res


@pytest.mark.parametrize("replacement,detail", [
    (_qr_route_one_short, "(qr)"),
    (_qr_route_wrong_values, "(singular values)"),
])
def test_the_routes_check_fails_when_only_the_qr_route_is_wrong(monkeypatch, replacement, detail):
    monkeypatch.setattr(verify_mod, "optimal_sketch", replacement)
    res = verify(_qk(H=1), p=2, m=5, progress=False)
    st = _status(res)
    assert st["routes"] == "FAIL" and st["theorem_3_1"] == "PASS", res.to_text()
    assert detail in next(c.where for c in res.checks if c.name == "routes")


def test_the_tau_check_fails_on_a_stationary_but_not_best_rank_one_term(monkeypatch):
    monkeypatch.setattr(verify_mod, "spectral_norm", _second_singular_pair)
    res = verify(_qk(H=1), p=2, m=5, columns=2, progress=False)
    c = next(c for c in res.checks if c.name == "theorem_3_4_identity")
    assert c.status == "FAIL" and "(τ vs 2-norm)" in c.where and c.value > 0.1, res.to_text()


def test_m_equal_to_the_numerical_rank_cannot():
    # tokens in a 2-dim subspace: rank A = C(3, 2) = 3 exactly; m = 3 leaves a round-off tail as m = 4 does
    res = verify(_qk(rank=2), p=2, m=3, progress=False)
    c = next(c for c in res.checks if c.name == "theorem_3_1")
    assert c.status == "CANNOT" and "m=3 ≥ numerical rank 3" in c.detail, res.to_text()


def test_p3_identity_passes_on_the_shipped_head_where_four_starts_disagreed():
    # Layer 2, head 0, column 2 of the shipped dump at p = 3: the best of the default 4 HOPM starts
    # was reached by one start only (the 2nd-best 15% lower), which failed the check although the
    # theorem holds. Starts now continue until a second one confirms the best value.
    path = ROOT / "data" / "mqar_softmax_qk.safetensors"
    res = verify(str(path), p=3, m=64, layers=[2], heads=[0], columns=3, progress=False)
    check = {c.name: c for c in res.checks}["theorem_3_4_identity"]
    assert check.status == "PASS", check


def test_an_unconfirmed_search_is_cannot_never_fail(monkeypatch):
    # A best value no second start reached says nothing about the theorem: CANNOT with the reason.
    module = verify_mod
    real = module.spectral_norm

    def one_start(t, **kw):
        res = real(t, **{**kw, "restarts": 2, "confirm": 1})
        res.values = torch.stack([res.values.max(), 0.5 * res.values.max()])  # the 2nd start found less
        res.agree = 1
        return res

    monkeypatch.setattr(module, "spectral_norm", one_start)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(40, 4, generator=gen, dtype=torch.float64), torch.randn(40, 4, generator=gen, dtype=torch.float64)
    res = verify((q, k), p=3, m=4, columns=2, progress=False)
    check = {c.name: c for c in res.checks}["theorem_3_4_identity"]
    assert check.status == "CANNOT" and "not confirmed" in check.detail and not res.passed
