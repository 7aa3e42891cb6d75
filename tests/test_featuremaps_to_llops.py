"""as_llops: exact conversions of the special-case maps to LLoPS maps, clear errors for the others.

Tolerance: the LLoPS features multiply the same p inner products as the map (in another
order), so float64 features agree to a few ulps of the largest feature; we assert 1e-12
relative to it, as the issue asks.
"""

import pytest
import torch

from sketchlab.featuremaps import FeatureMap, LLoPSMap, batch_features
from sketchlab.featuremaps.based import ExpandMap, TaylorMap
from sketchlab.featuremaps.elementwise import TiedLLoPSMap
from sketchlab.featuremaps.mlp import MLPMap
from sketchlab.featuremaps.psf_random import PSFRandomMap
from sketchlab.featuremaps.tensorsketch import TensorSketchMap
from sketchlab.featuremaps.to_llops import as_llops

F64 = torch.float64


def _x(*lead, n=9, d=4, seed=0):
    return torch.randn(*lead, n, d, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _pair(maps):
    """``(map_q, map_k)`` of one map (both sides) or a pair."""
    return (maps, maps) if isinstance(maps, FeatureMap) else maps


def _assert_same_features(maps, ll, x):
    with torch.no_grad():
        for fmap, lmap in zip(_pair(maps), _pair(ll)):
            a, b = batch_features(fmap, x), batch_features(lmap, x)
            assert a.shape == b.shape
            assert torch.allclose(a, b, rtol=0, atol=1e-12 * a.abs().max())


def _g(*shape, seed=1):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


CASES = {
    "elementwise tied p=3": lambda: TiedLLoPSMap(1, 4, _g(1, 1, 4, 6), p=3, signed=True),
    "elementwise untied p=2": lambda: (TiedLLoPSMap(1, 4, _g(1, 1, 4, 6), p=2),
                                       TiedLLoPSMap(1, 4, _g(1, 1, 4, 6, seed=2), p=2)),
    "expand full p=2": lambda: ExpandMap(1, 4, p=2, proj=_g(1, 4, 3), symmetric=False),
    "expand symmetric p=3": lambda: ExpandMap(1, 4, p=3, proj=_g(1, 4, 3), symmetric=True),
    "expand full p=3 batched": lambda: ExpandMap(6, 4, p=3, proj=_g(6, 4, 2), symmetric=False),
    "psf plain p=1": lambda: PSFRandomMap.draw(1, 4, p=1, m=5, seed=0, dtype=F64),
    "psf plain p=2": lambda: PSFRandomMap.draw(1, 4, p=2, m=5, seed=0, dtype=F64),
    "psf non-negative p=2": lambda: PSFRandomMap.draw(1, 4, p=2, m=9, non_negative=True, seed=0, dtype=F64),
    "psf non-negative p=4": lambda: PSFRandomMap.draw(1, 4, p=4, m=16, non_negative=True, seed=0, dtype=F64),
    "psf non-negative p=4 batched": lambda: PSFRandomMap.draw(6, 4, p=4, m=9, non_negative=True, seed=0, dtype=F64),
}


@pytest.mark.parametrize("name", list(CASES))
def test_exact_conversion(name):
    maps = CASES[name]()
    first = _pair(maps)[0]
    ll = as_llops(maps)
    assert isinstance(ll, LLoPSMap) == isinstance(maps, FeatureMap)  # one map for one map, a pair for a pair
    for lmap in _pair(ll):
        assert isinstance(lmap, LLoPSMap) and lmap.theta.shape[1] == 1 and lmap.degree == first.degree  # rank 1
        assert lmap.num_features == first.num_features and lmap.heads == first.heads
    _assert_same_features(maps, ll, _x(first.heads))


@pytest.mark.parametrize("name", list(CASES))
def test_affine_conversion_of_a_homogeneous_map_adds_a_zero_constant_row(name):
    maps = CASES[name]()
    plain, ll = as_llops(maps), as_llops(maps, affine=True)
    assert isinstance(ll, LLoPSMap) == isinstance(plain, LLoPSMap)  # tied stays tied
    for a, b in zip(_pair(plain), _pair(ll)):
        assert b.theta.shape[:-2] == a.theta.shape[:-2] and b.theta.shape[-2:] == (5, a.num_features)
        assert b.head_dim == 5
        torch.testing.assert_close(b.theta[..., :4, :], a.theta, rtol=0, atol=0)
        assert not b.theta[..., 4, :].any()


@pytest.mark.parametrize("symmetric", [False, True])
def test_based_taylor_is_llops_of_the_affine_input(symmetric):
    from sketchlab.featuremaps.based import taylor_features_naive
    from sketchlab.llops import affine_input

    proj = _g(2, 4, 3)  # two heads, d = 4, d' = 3
    fmap = TaylorMap(2, 4, proj=proj, symmetric=symmetric)
    ll = as_llops(fmap, affine=True)
    assert isinstance(ll, LLoPSMap) and ll.theta.shape[1] == 1 and ll.degree == 2
    assert ll.num_features == fmap.num_features
    assert ll.theta.shape == (2, 1, 2, 5, 1 + 3 + (6 if symmetric else 9))
    x = _x(2)
    got = batch_features(ll, affine_input(x)).detach()
    for h in range(2):  # the float64 loop twin, per head
        want = taylor_features_naive(x[h], proj[h], symmetric)
        assert torch.allclose(got[h], want, rtol=0, atol=1e-12 * want.abs().max())
    # and the kernel is BASED's 1 + s + s²/2, s = uᵀu'/√d'
    u = x @ proj
    s = u @ u.mT / 3**0.5
    torch.testing.assert_close(got @ got.mT, 1 + s + s**2 / 2, rtol=1e-12, atol=1e-12)


def test_affine_input_appends_a_one():
    from sketchlab.llops import affine_input

    x = _x(2, n=3)
    out = affine_input(x)
    assert out.shape == (2, 3, 5) and out.dtype == F64
    torch.testing.assert_close(out[..., :4], x, rtol=0, atol=0)
    assert bool((out[..., 4] == 1).all())


def test_psf_degree4_theta_is_fixed_random_rank1():
    s = PSFRandomMap.draw(1, 4, p=4, m=16, non_negative=True, seed=3, dtype=F64)
    theta = as_llops(s).theta.detach()[0]
    assert theta.shape == (1, 4, 4, 16)  # t = 1, p = 4, d = 4, m = r² = 16
    g1, g2 = (w[0] for w in s.weights)
    # coordinate (a, b) = (1, 2) sits at column a·r + b = 6 and is ⟨G1_a/r, ·⟩⟨G2_a, ·⟩⟨G1_b, ·⟩⟨G2_b, ·⟩
    assert torch.equal(theta[0, :, :, 6], torch.stack([g1[:, 1] / 4, g2[:, 1], g1[:, 2], g2[:, 2]]))


def test_elementwise_of_any_rank_converts():
    fmap = TiedLLoPSMap(3, 4, _g(3, 2, 4, 6), p=2)  # rank 2: each term's two factors equal
    ll = as_llops(fmap)
    assert ll.theta.shape == (3, 2, 2, 4, 6)
    _assert_same_features(fmap, ll, _x(3))


@pytest.mark.parametrize("make,match", [
    (lambda: PSFRandomMap.draw(1, 3, p=8, m=16, non_negative=True, seed=0), "degree p=8 has no rank-1 LLoPS form"),
    (lambda: PSFRandomMap.draw(1, 3, p=8, m=16, seed=0), "plain recursive PolySketchFormer sketch of degree p=8"),
    (lambda: PSFRandomMap.draw(1, 3, p=3, m=16, seed=0), "degree p=3 has no rank-1"),
    (lambda: TensorSketchMap.draw(1, 3, p=2, m=8, seed=0), "TensorSketch has no exact LLoPS form"),
    (lambda: MLPMap.init_random(1, 3, p=2, m=4, hidden=5, seed=0), "not a polynomial map"),
    (lambda: TaylorMap(1, 3, proj=torch.randn(1, 3, 2)), r"inhomogeneous .* affine input \[x, 1\] \(as_llops\(fmap, affine=True\)\)"),
    (lambda: make_hedgehog(), "no exact LLoPS conversion is known for HedgehogMap"),
])
def test_not_expressible_raises(make, match):
    with pytest.raises(ValueError, match=match):
        as_llops(make())


def make_hedgehog():
    from sketchlab.featuremaps import make_feature_map

    return make_feature_map("hedgehog", heads=1, head_dim=3, m=4)


def test_non_map_rejected_and_llops_passthrough():
    with pytest.raises(TypeError, match="as_llops takes a FeatureMap or a pair"):
        as_llops(torch.randn(3, 3))
    ll = LLoPSMap(1, 3, theta=torch.randn(1, 1, 2, 3, 4))
    assert as_llops(ll) is ll
    other = LLoPSMap(1, 3, theta=torch.randn(1, 1, 2, 3, 4))
    assert as_llops((ll, other)) == (ll, other)
    with pytest.raises(TypeError, match=r"affine must be a bool, got 1"):
        as_llops(ll, affine=1)
