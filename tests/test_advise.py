"""advise() and kernel_spectrum(): the floor from one factorisation, agreement with compare() at the
advised sizes, the bisection's boundary, and input checks.

Agreement is exact up to round-off: advise fits one head with fit_sketch on the same fitting tokens
and seed as compare, so both report the same rel_fro; we allow 1e-9 relative (fits of one head
alone vs all heads of a layer batched differ only in float64 reduction order).
"""

import json
import math

import pytest
import torch

from sketchlab import compare, tail_bound
from sketchlab.advise import _practical_m, advise
from sketchlab.fit import holdout_split
from sketchlab.spectrum import kernel_singular_values, kernel_spectrum

F64 = torch.float64
TARGET = 0.01


def _qk(L=1, H=2, n=64, d=6, seed=0):
    """Anisotropic tokens with offsets, so that the kernel spectrum decays as on real Q/K."""
    g = torch.Generator().manual_seed(seed)
    spec = torch.tensor([2.0, 1.2, 0.7, 0.4, 0.25, 0.15], dtype=F64)[:d]
    q = torch.randn(L, H, n, d, generator=g, dtype=F64) * spec + 0.3
    k = torch.randn(L, H, n, d, generator=g, dtype=F64) * spec - 0.2
    return q, k


@pytest.fixture(scope="module")
def advice():
    return advise(_qk(), p=2, target=TARGET, progress=False)


def test_floor_m_agrees_with_compare_optimal(advice):
    for h in advice.heads:
        at = compare(_qk(), p=2, m=h.floor_m, methods=["optimal"], heads=[h.head], progress=False)
        assert at.values("optimal", "rel_fro")[0] <= TARGET
        below = compare(_qk(), p=2, m=h.floor_m - 1, methods=["optimal"], heads=[h.head], progress=False)
        assert below.values("optimal", "rel_fro")[0] > TARGET


def test_practical_m_agrees_with_compare(advice):
    assert any(h.practical_m > h.floor_m for h in advice.heads)  # the bisection is exercised
    for h in advice.heads:
        at = compare(_qk(), p=2, m=h.practical_m, methods=["llops"], heads=[h.head], progress=False)
        rel = at.values("llops", "rel_fro")[0]
        assert rel == pytest.approx(h.practical_rel_fro, rel=1e-9) and rel <= TARGET
        assert at.values("llops", "optimality_ratio")[0] == pytest.approx(h.practical_ratio, rel=1e-9)
        if h.practical_m > h.floor_m:  # below the floor m every sketch fails by Theorem 3.1
            below = compare(_qk(), p=2, m=h.practical_m - 1, methods=["llops"], heads=[h.head], progress=False)
            assert below.values("llops", "rel_fro")[0] > TARGET


def test_outputs(advice):
    md = advice.to_markdown()
    assert "| layer | head | floor m | practical m |" in md and "scale = sqrt-d" in md
    data = json.loads(advice.to_json())
    assert data["config"]["scale"] == "sqrt-d" and data["config"]["target"] == TARGET
    assert [h["floor_m"] for h in data["heads"]] == [h.floor_m for h in advice.heads]
    assert "floor m median" in advice.summary()


def test_method_that_never_meets_the_target():
    res = advise(_qk(H=1), p=2, target=0.05, method="psf", progress=False)
    h = res.heads[0]
    assert h.practical_m is None and h.practical_rel_fro is None and h.fits
    assert all(not f["passed"] for f in h.fits.values()) and max(h.fits) == res.max_m
    assert "not reached by psf up to m = 20" in res.summary()


def test_bisection_finds_the_boundary_with_few_fits():
    floor = torch.tensor([1.0] + [0.5**m for m in range(1, 65)], dtype=F64)  # floor[m], m = 0..64
    target = 1e-6
    floor_m = int((floor[1:] <= target).nonzero()[0]) + 1

    for growth in (lambda m: 1.0, lambda m: 1 + 0.1 * m, lambda m: 2.0 ** (m / 8)):
        calls = []

        def fit_at(m, growth=growth, calls=calls):
            calls.append(m)
            rel = float(floor[m]) * growth(m)
            return rel, rel <= target

        brute = next(m for m in range(floor_m, 65) if float(floor[m]) * growth(m) <= target)
        assert _practical_m(fit_at, floor, floor_m, 64, target) == brute
        assert len(calls) <= 8 and min(calls) == floor_m  # never fits below the floor m
    assert _practical_m(lambda m: (1.0, False), floor, floor_m, 64, target) is None


@pytest.mark.parametrize("n,d,p", [(30, 4, 2), (12, 4, 2), (20, 3, 3)])  # n > D (qr route) and n <= D (svd)
def test_spectrum_matches_tail_bound_for_every_m(n, d, p):
    q, k = _qk(L=1, H=2, n=n, d=d)
    s = kernel_singular_values(q, k, p)
    limit = min(n, math.comb(d + p - 1, p))
    for m in range(1, limit + 1):
        tail = (s[..., m:] ** 2).sum(-1)
        expected = tail_bound(q, k, p, m)
        # float64 round-off of Σσ² relative to ‖A‖_F²
        assert torch.allclose(tail, expected, rtol=0, atol=1e-10 * float((s**2).sum(-1).max())), m


def test_spectrum_uses_the_fitting_tokens_and_scale():
    q, k = _qk()
    spec = kernel_spectrum((q, k), p=2, holdout=0.25, seed=3, layers=[0], heads=[1])
    fit, _ = holdout_split(64, 0.25, 3)
    f = 6**-0.25
    expected = torch.linalg.svdvals(((q[0, 1, fit] * f) @ (k[0, 1, fit] * f).T) ** 2)
    assert torch.allclose(spec.singular_values[0, 0], expected, rtol=1e-10, atol=1e-12 * float(expected[0]))
    curve = spec.floor_curve()[0, 0]
    assert curve[0] == 1 and curve[-1] == 0 and bool((curve[1:] <= curve[:-1]).all())
    assert spec.scale == "sqrt-d" and spec.n_tokens == 48 and "| layer | head |" in spec.to_markdown()
    assert json.loads(spec.to_json())["config"]["scale_factor"] == pytest.approx(f)


@pytest.mark.parametrize("kwargs,err,match", [
    ({"target": 0.0}, ValueError, r"target .* must lie in \(0, 1\)"),
    ({"target": 1.5}, ValueError, r"target .* must lie in \(0, 1\)"),
    ({"method": "nope"}, ValueError, "unknown method 'nope'"),
    ({"max_m": 21}, ValueError, r"max_m must be an integer in 1\.\.20 \(below 21"),
    ({"holdout": 1.0}, ValueError, "holdout must lie in"),
    ({"scale": -2.0}, ValueError, "scale must be"),
    ({"heads": [5]}, ValueError, "head 5 is out of range"),
])
def test_bad_input(kwargs, err, match):
    with pytest.raises(err, match=match):
        advise(_qk(), **{"p": 2, "target": 0.05, "progress": False, **kwargs})


@pytest.mark.parametrize("ratio,answer,calls", [
    # floor(m) = 2^-m, target 1e-6, floor m = 20. A method r× the floor at every m: the first fit (m = 20)
    # measures r, the prediction jumps to the smallest m with r·2^-m ≤ 1e-6 (r = 3: 22; r = 100: 27),
    # which passes, and bisection between 21 and it confirms the boundary.
    (1.0, 20, [20]),
    (3.0, 22, [20, 22, 21]),
    (100.0, 27, [20, 27, 24, 26]),
])
def test_bracket_jumps_to_the_predicted_m(ratio, answer, calls):
    floor = torch.tensor([1.0] + [0.5**m for m in range(1, 65)], dtype=F64)
    made = []

    def fit_at(m):
        made.append(m)
        rel = float(floor[m]) * ratio
        return rel, rel <= 1e-6

    assert _practical_m(fit_at, floor, 20, 64, 1e-6) == answer
    assert made == calls


def test_one_size_below_the_rank_bound_is_advised_and_none_is_refused():
    """Two fitting tokens (n = 3, holdout 1): A has rank at most 2, so m = 1 is the one size below the
    bound and is advised (the floor's own size); one fitting token leaves none and is refused."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 3, 4, dtype=torch.float64), torch.randn(1, 1, 3, 4, dtype=torch.float64)
    head = advise((q, k), p=2, target=0.5).heads[0]
    assert head.floor_m == 1 and head.practical_m == 1 and list(head.fits) == [1]
    with pytest.raises(ValueError, match="the 1 fitting tokens leave no sketch size below the rank bound"):
        advise((q[:, :, :2], k[:, :, :2]), p=2, target=0.5)


def test_max_m_bounds_the_sizes_advised():
    """``max_m`` (an int in 1..limit) is accepted and caps every size fitted; outside the range it is refused."""
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 40, 4, dtype=torch.float64), torch.randn(1, 1, 40, 4, dtype=torch.float64)
    # the floor reaches target 0.3 at m = 4 here: max_m = 4 advises it, max_m = 3 fits nothing and says so
    assert advise((q, k), p=2, target=0.3, max_m=4).heads[0].practical_m == 4
    head = advise((q, k), p=2, target=0.3, max_m=3).heads[0]
    assert head.floor_m == 4 and head.practical_m is None and head.fits == {}
    with pytest.raises(ValueError, match=r"max_m must be an integer in 1\.\.9 .*got 10"):
        advise((q, k), p=2, target=0.5, max_m=10)  # limit = min(30 fitting tokens, C(5, 2) = 10) - 1 = 9
