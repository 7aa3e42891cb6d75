"""``InputNormed``: any map on per-head layer-normalised input (the registry's ``input_norm=True``).

Tolerances: float64 1e-10 (fast and naive forms differ only in summation order).
"""

import pytest
import torch

from sketchlab.featuremaps import InputNormed, LLoPSMap, SelfTensored, make_feature_map

TOL64 = 1e-10
H, D = 2, 5


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _normed(name="llops", **options):
    fmap = make_feature_map(name, heads=H, head_dim=D, p=2, m=16, seed=1, dtype=torch.float64, input_norm=True,
                            **options)
    with torch.no_grad():  # an affine away from its start (1, 0), different per head
        for wrapper in (x for x in fmap.modules() if isinstance(x, InputNormed)):
            wrapper.weight.copy_(1 + 0.5 * _rand(H, D, seed=7))
            wrapper.bias.copy_(0.3 * _rand(H, D, seed=8))
    return fmap


@pytest.mark.parametrize("name", ["llops", "elementwise", "hedgehog", "based-taylor", "psf-learned", "exact-poly"])
def test_fast_equals_naive_and_is_the_inner_map_of_the_normalised_input(name):
    fmap = _normed(name)
    x = 3 * _rand(2, 6, H, D, seed=2) + 1  # neither zero-mean nor unit-variance
    fast, naive = fmap.features(x), fmap.features_naive(x)
    assert fast.shape == naive.shape == (2, 6, H, fmap.num_features)
    assert (fast - naive).abs().max() < TOL64
    wrapper = next(w for w in fmap.modules() if isinstance(w, InputNormed))
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    y = (x - mean) / torch.sqrt(var + 1e-5) * wrapper.weight + wrapper.bias  # [B, T, H, D]
    torch.testing.assert_close(wrapper.features(x), wrapper.inner.features(y), atol=TOL64, rtol=0)
    # the wrapped map's sizes and promises are the inner map's
    assert (wrapper.num_features, wrapper.degree, wrapper.non_negative) == \
        (wrapper.inner.num_features, wrapper.inner.degree, wrapper.inner.non_negative)
    # a scaled input gives the same features (the map sees the normalised input only), up to eps
    torch.testing.assert_close(fmap.features(1e3 * x), fmap.features(1e3 * x * 1.5), atol=1e-9, rtol=1e-9)


def test_affine_starts_at_one_and_zero_and_trains():
    fmap = make_feature_map("elementwise", heads=H, head_dim=D, m=4, input_norm=True)
    assert isinstance(fmap, InputNormed) and fmap.eps == 1e-5
    assert fmap.weight.shape == fmap.bias.shape == (H, D) and fmap.weight.dtype == torch.float32
    assert torch.equal(fmap.weight, torch.ones(H, D)) and torch.equal(fmap.bias, torch.zeros(H, D))
    fmap.features(_rand(1, 4, H, D, seed=3).float()).square().sum().backward()
    for p in (fmap.weight, fmap.bias, fmap.inner.theta):
        assert p.grad is not None and bool(p.grad.abs().sum() > 0)
    assert {n for n, _ in fmap.named_parameters()} == {"weight", "bias", "inner.theta"}


def test_registry_option_wraps_inside_self_tensoring():
    plain = make_feature_map("llops", heads=H, head_dim=D, m=4)
    assert isinstance(plain, LLoPSMap)  # the default: no wrapper
    assert isinstance(make_feature_map("llops", heads=H, head_dim=D, m=4, input_norm=True).inner, LLoPSMap)
    st = make_feature_map("hedgehog", heads=H, head_dim=D, m=6, input_norm=True, self_tensored=True)
    assert isinstance(st, SelfTensored) and isinstance(st.inner, InputNormed) and st.num_features == 36
    psf = make_feature_map("psf-learned", heads=H, head_dim=D, m=9, input_norm=True)
    assert isinstance(psf, SelfTensored) and isinstance(psf.inner, InputNormed) and psf.non_negative
    x = _rand(1, 3, H, D, seed=4)
    fmap = _normed("hedgehog", self_tensored=True)
    assert (fmap.features(x) - fmap.features_naive(x)).abs().max() < TOL64


def test_bad_values_refused():
    with pytest.raises(TypeError, match="feature map 'llops': input_norm must be a bool, got 1"):
        make_feature_map("llops", heads=H, head_dim=D, input_norm=1)
    with pytest.raises(TypeError, match="InputNormed wraps a FeatureMap, got Linear"):
        InputNormed(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"x must have layout \[B, T, H=2, D=5\]"):
        make_feature_map("llops", heads=H, head_dim=D, input_norm=True).features(torch.zeros(1, 3, H, 4))
