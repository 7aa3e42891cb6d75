"""The family behind one registry: every registered map against its float64 twin, options checked once,
deprecated names, and a fit's maps as members of the family (attention through them in the op equals the
formula on their features).

Tolerances: float64 1e-10 (fast and naive forms differ only in summation order).
"""

import warnings

import pytest
import torch

import sketchlab as sl
from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.featuremaps import (
    FeatureMap,
    FeatureMapSketch,
    SketchMap,
    check_feature_map_options,
    feature_map_names,
    make_feature_map,
    register_feature_map,
    sketch_feature_maps,
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
def test_a_fits_maps_run_in_the_op(method, kw):
    map_q, map_k = _fitted(method, **kw).maps
    q, k, v = _rand(2, 11, H, D, seed=9), _rand(2, 11, H, D, seed=10), _rand(2, 11, H, 3, seed=11)
    opts = sl.AttentionOptions(normalize="sum", non_negative=False, window=3, sinks=1, denominator_check="off",
                               chunk_size=4)
    gate = _rand(H, seed=12)
    out, _ = sl.linear_attention(q, k, v, map_q, map_k, options=opts.replace(backend="torch"), gate=gate)
    with torch.no_grad():
        fq, fk = map_q.features(q).double(), map_k.features(k).double()
    ref = feature_attention_naive(fq, fk, v, q=q, k=k, normalize="sum", window=3, sinks=1, gate=gate,
                                  denominator_check="off")
    assert (out - ref).abs().max() < TOL64
    twin, _ = sl.linear_attention(q, k, v, map_q, map_k, options=opts.replace(backend="reference"), gate=gate)
    assert (out - twin).abs().max() < TOL64  # through the maps' own float64 twin


def test_sketch_map_of_one_layer_trains_and_moves():
    torch.manual_seed(0)
    sketch = sl.MLPSketch.init_random(D, 2, 5, 6, seed=1, batch_shape=(3, H), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"batch shape \[3, 2\]; a feature map of heads=2 needs \[\] or a batch of 2 maps"):
        SketchMap(sketch, heads=H, head_dim=D)
    map_q, map_k = sketch_feature_maps(sketch, heads=H, head_dim=D, layer=1)
    x = _rand(1, 4, H, D, seed=13)
    want = sketch.features_q(x.transpose(1, 2))[1].transpose(0, 1)  # layer 1, [4, H, M]
    assert (map_q.features(x)[0] - want).abs().max() < TOL64
    assert map_k.sketch is not map_q.sketch  # the key side over its own copy: each module saved once
    map_q.features(x).sum().backward()
    assert map_q.sketch.w1_q.grad is not None
    psf = make_feature_map("psf-random", heads=H, head_dim=D, m=9).double()  # a plain sketch's tensors follow .to
    assert all(w.dtype == torch.float64 for w in psf.sketch.weights) and "weights_0" in psf.state_dict()


def test_feature_map_sketch_is_a_sketch_of_any_batch():
    fmap = make_feature_map("hedgehog", heads=6, head_dim=D, m=6, dtype=torch.float64)
    sketch = FeatureMapSketch(fmap, p=2, batch_shape=(3, H))
    x = _rand(3, H, 5, D, seed=14)
    out = sketch.features_q(x)
    assert out.shape == (3, H, 5, 6)
    assert (out[2, 1] - sketch.features_naive(x[2, 1], "q", (2, 1))).abs().max() < TOL64
    assert (out[2, 1] - fmap.features(x.reshape(6, 5, D).transpose(0, 1)[None])[0, :, 5]).abs().max() < TOL64


def test_feature_map_sketch_select_is_that_part_of_the_batch():
    """select(l) of an [L, H] sketch of a registered map: layer l's features (fast and twin), parameters shared,
    and it runs as one layer's maps through sketch_feature_maps(..., layer=l)."""
    fmap = make_feature_map("hedgehog", heads=6, head_dim=D, m=6, dtype=torch.float64)
    sketch = FeatureMapSketch(fmap, p=2, batch_shape=(3, H))
    x = _rand(3, H, 5, D, seed=15)
    layer = sketch.select(1)
    assert layer.batch_shape == (H,)
    assert (layer.features_q(x[1]) - sketch.features_q(x)[1]).abs().max() < TOL64
    assert (layer.features_naive(x[1, 0], "k", (0,)) - sketch.features_k(x)[1, 0]).abs().max() < TOL64
    one = sketch.select((2, 1))
    assert one.batch_shape == () and (one.features_q(x[2, 1]) - sketch.features_q(x)[2, 1]).abs().max() < TOL64
    assert layer.map_q.inner.weight is fmap.weight  # shared, not copied
    map_q, _ = sketch_feature_maps(sketch, heads=H, head_dim=D, layer=1)
    xb = _rand(1, 5, H, D, seed=16)
    assert (map_q.features(xb)[0].transpose(0, 1) - sketch.features_q(xb[0].transpose(0, 1)[None].expand(3, H, 5, D))[1]
            ).abs().max() < TOL64
    with pytest.raises(ValueError, match="batch shape \\[\\]"):
        FeatureMapSketch(make_feature_map("hedgehog", heads=1, head_dim=D, m=6), p=2).select(0)
