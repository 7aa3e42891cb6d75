"""Package-level contracts: exports, and every registered method's fit is a pair of feature maps that honours the
FeatureMap interface."""

import math

import pytest
import torch

import sketchlab as sl


def _expected_parameters(method, report, p, d, m):
    """Stored numbers per head, both sides, written out per method (d = 4, m = 9 below)."""
    if method == "optimal":
        return 2 * math.comb(d + p - 1, p) * m  # W*_Q, W*_K on the symmetric features
    if method == "llops":
        return 2 * p * d * m  # rank 1, untied Θ_Q, Θ_K
    if method == "elementwise":
        return 2 * d * m  # untied Θ_Q, Θ_K of shape d × m
    if method == "mlp":
        h = report.info["hidden"]
        return 2 * (d * h + h + h * m + m)  # two layers with biases, per side
    if method == "psf-random":
        # p = 2: self-tensored degree-1 sketch, r = ⌊√9⌋ = 3, one d × r matrix;
        # p = 3: plain recursive sketch, r = m = 9: (2 → d×r, d×r), top (r×r, d×r)
        return {2: d * 3, 3: 3 * d * m + m * m}[p]
    if method == "tensorsketch":
        return 2 * p * d  # a hash and a sign per input coordinate and level
    if method == "based-expand":
        # the d × d' projection, d' the largest with C(d' + p − 1, p) <= 9 symmetric features (3 at p = 2, 2 at p = 3)
        return d * {2: 3, 3: 2}[p]
    if method == "based-taylor":
        return d * 2  # d' = 2: 1 + d' + d'² = 7 <= 9 features (full form)
    raise AssertionError(f"no expected parameter count written for {method!r}")


def test_all_exports_exist():
    assert sorted(set(sl.__all__)) == sorted(sl.__all__)
    assert [name for name in sl.__all__ if not hasattr(sl, name)] == []


def test_every_documented_method_is_registered():
    assert set(sl.DEFAULT_METHODS) <= set(sl.available_sketches())
    assert {"elementwise", "llops", "optimal"} <= set(sl.available_sketches())


@pytest.mark.parametrize("method, p", [(method, p) for method in sorted(sl.available_sketches()) for p in (2, 3)
                                       if not (method == "based-taylor" and p != 2)])  # Taylor: degree 2 only
def test_registered_sketch_follows_the_interface(method, p):
    """Batched [L=2, H=2] fit: a pair of maps of 4 heads; shapes, degree, sizes, and the features the metrics take
    (batch_features, head l·2 + h) equal to the float64 twin head by head."""
    from sketchlab.featuremaps.heads import as_heads, batch_features

    gen = torch.Generator().manual_seed(p)
    q = torch.randn(2, 2, 48, 4, generator=gen, dtype=torch.float64) * 4**-0.25
    k = torch.randn(2, 2, 48, 4, generator=gen, dtype=torch.float64) * 4**-0.25
    m = 9
    options = {"steps": 5} if method in ("mlp",) else {}
    fit = sl.fit_sketch(method, q, k, p=p, m=m, seed=0, holdout=0.25, **options)
    map_q, map_k = fit.maps
    assert isinstance(map_q, sl.FeatureMap) and isinstance(map_k, sl.FeatureMap)
    assert map_q.degree == map_k.degree == p
    assert (map_q.heads, map_q.head_dim) == (map_k.heads, map_k.head_dim) == (4, 4)
    assert map_q.num_features == map_k.num_features == fit.report.num_features <= m  # BASED rounds its size down
    assert fit.report.num_parameters == _expected_parameters(method, fit.report, p, 4, m)
    with torch.no_grad():
        for fmap, x in ((map_q, q), (map_k, k)):
            fast = batch_features(fmap, x)
            assert fast.shape == (2, 2, 48, fmap.num_features)
            twin = fmap.features_naive(as_heads(x, 4))  # [1, 48, 4, M]
            for l in range(2):
                for h in range(2):
                    # float64 inputs, the same products in another order: round-off ~1e-15 relative
                    torch.testing.assert_close(fast[l, h].double(), twin[0, :, l * 2 + h], rtol=1e-12, atol=1e-14)
    rep = fit.report
    assert rep.rel_fro.shape == (2, 2) and rep.holdout_rel_fro.shape == (2, 2)
    # Theorem 3.1: no sketch of size <= m beats the optimum of size m on its fitting tokens
    # (1e-9 slack: float64 round-off of the ratio, see tests/test_optimal.py)
    assert bool((rep.optimality_ratio >= 1 - 1e-9).all()), rep.optimality_ratio
