"""The family behind one registry: every registered map against its float64 twin, options checked once,
deprecated names, and what every fit method returns is a pair of maps of the family (attention through it equals its
float64 twin).

Tolerances: float64 1e-10 (fast and naive forms differ only in summation order).
"""

import warnings

import pytest
import torch

import sketchlab as sl
from sketchlab.featuremaps import (
    FeatureMap,
    check_feature_map_options,
    feature_map_names,
    make_feature_map,
    register_feature_map,
)

TOL64 = 1e-10
H, D = 2, 4


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("name", feature_map_names())
def test_every_registered_map_matches_its_twin(name):
    fmap = make_feature_map(name, heads=H, head_dim=D, p=2, m=16, seed=1, dtype=torch.float64)
    assert isinstance(fmap, FeatureMap)
    x = _rand(2, 5, H, D, seed=2)
    fast, naive = fmap.features(x), fmap.features_naive(x)
    assert fast.shape == (2, 5, H, fmap.num_features) == naive.shape
    assert (fast - naive).abs().max() < TOL64
    if fmap.non_negative:  # the promise normalize="sum" relies on: every kernel value >= 0
        y = _rand(2, 5, H, D, seed=3)
        assert ((fmap.features(x)[:, :, None] * fmap.features(y)[:, None]).sum(-1) >= -TOL64).all()


def test_options_are_declared_and_checked_once():
    with pytest.raises(ValueError, match=r"feature map 'hedgehog': unknown option\(s\) \['hidden'\]; it takes"):
        make_feature_map("hedgehog", heads=H, head_dim=D, hidden=3)
    with pytest.raises(ValueError, match="feature map 'llops': m must be an integer >= 1, got 0"):
        make_feature_map("llops", heads=H, head_dim=D, m=0)
    with pytest.raises(TypeError, match="self_tensored must be a bool"):
        make_feature_map("llops", heads=H, head_dim=D, self_tensored=1)
    assert check_feature_map_options("psf-learned", {"m": 9})["hidden"] is None  # the declared default
    assert check_feature_map_options("psf-learned", {"m": 9})["p"] == 2
    with pytest.raises(ValueError, match="already registered"):
        register_feature_map("llops", lambda heads, head_dim, **_: None)
    with pytest.raises(ValueError, match="must be one of"):
        make_feature_map("cosformer", heads=H, head_dim=D)


@pytest.mark.parametrize("old, new", [("psf", "psf-learned"), ("taylor", "based-taylor"), ("exact", "exact-poly")])
def test_deprecated_names_warn_and_build_the_successor(old, new):
    with pytest.warns(DeprecationWarning, match=rf"'{old}' is deprecated, use '{new}'"):
        a = make_feature_map(old, heads=H, head_dim=D, p=2, m=16, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = make_feature_map(new, heads=H, head_dim=D, p=2, m=16, dtype=torch.float64)
    x = _rand(1, 3, H, D, seed=4)
    assert type(a) is type(b) and torch.equal(a.features(x), b.features(x))


@pytest.mark.parametrize("old, new", [("psf", "psf-random"), ("based", "based-expand")])
def test_deprecated_fit_methods_warn(old, new):
    q, k = _rand(H, 30, D, seed=5) * 0.5, _rand(H, 30, D, seed=6) * 0.5
    with pytest.warns(DeprecationWarning, match=rf"'{old}' is deprecated, use '{new}'"):
        a = sl.fit_sketch(old, q, k, p=2, m=4)
    b = sl.fit_sketch(new, q, k, p=2, m=4)
    assert torch.equal(a.report.rel_fro, b.report.rel_fro)
    assert old not in sl.fit.available_sketches() and new in sl.fit.available_sketches()


def _fitted(method, **kw):
    q, k = _rand(H, 40, D, seed=7) * 0.6, _rand(H, 40, D, seed=8) * 0.6
    return sl.fit_sketch(method, q, k, p=2, m=4, **kw)


@pytest.mark.parametrize("method, kw", [("mlp", {"steps": 5}), ("psf-random", {}), ("tensorsketch", {}),
                                        ("based-expand", {}), ("elementwise", {"steps": 5}), ("llops", {}),
                                        ("optimal", {})])
def test_a_fitted_map_runs_in_the_op(method, kw):
    map_q, map_k = _fitted(method, **kw).maps
    q, k, v = _rand(2, 11, H, D, seed=9), _rand(2, 11, H, D, seed=10), _rand(2, 11, H, 3, seed=11)
    opts = sl.AttentionOptions(normalize="sum", non_negative=False, window=3, sinks=1, denominator_check="off",
                               chunk_size=4)
    gate = _rand(H, seed=12)
    out, _ = sl.linear_attention(q, k, v, map_q, map_k, options=opts.replace(backend="torch"), gate=gate)
    twin, _ = sl.linear_attention(q, k, v, map_q, map_k, options=opts.replace(backend="reference"), gate=gate)
    assert (out - twin).abs().max() < TOL64  # through the map's own float64 twin
    # even p = 2: the self-tensored PSF, BASED's expand map and the element-wise powers are non-negative
    assert map_q.non_negative == map_k.non_negative == (method in ("psf-random", "based-expand", "elementwise")) \
        or method == "llops"


def test_a_random_maps_tensors_are_saved_and_follow_to():
    psf = make_feature_map("psf-random", heads=H, head_dim=D, m=9).double()
    assert all(w.dtype == torch.float64 for w in psf.weights) and "weights_0" in psf.state_dict()
