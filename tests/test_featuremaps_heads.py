"""Where a batch ``[L, H]`` of problems meets a feature map's heads (:mod:`sketchlab.featuremaps.heads`): the
one flattening (row-major, layer ``l`` head ``j`` → head ``l·H + j``), and the metrics taking a map or a pair
of maps as the pure features of the same Θ per ``[L, H]`` problem give them.

Tolerances: float64, 1e-12 (the same products in the same order up to reshapes; the twin sums per token).
"""

import pytest
import torch

from sketchlab import kernel_errors, llops_features, poly_kernel, rel_fro, rel_mae
from sketchlab.featuremaps import LLoPSMap, make_feature_map
from sketchlab.featuremaps.heads import as_heads, batch_features, from_heads, pair_features

L, H, N, D, M = 2, 3, 7, 4, 5


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_batch_features_maps_layer_l_head_j_with_head_l_times_h_plus_j():
    fmap = make_feature_map("llops", heads=L * H, head_dim=D, p=2, m=M, seed=1, dtype=torch.float64)
    x = _rand(L, H, N, D, seed=2)
    out = batch_features(fmap, x)
    assert out.shape == (L, H, N, M)
    for l_ in range(L):
        for j in range(H):
            twin = fmap._features_naive(x[l_, j], l_ * H + j)  # [N, M], that head's map written out
            torch.testing.assert_close(out[l_, j], twin, rtol=1e-12, atol=1e-12)
    flat = as_heads(x, L * H)  # the same rule for any [L, H] tensor, e.g. the attention op's input
    assert flat.shape == (1, N, L * H, D) and torch.equal(flat[0, :, H + 2], x[1, 2])
    assert torch.equal(from_heads(flat, (L, H)), x)
    # a batch before the heads: each problem of it mapped alike
    two = batch_features(fmap, torch.stack([x, 2 * x]))
    torch.testing.assert_close(two, torch.stack([out, batch_features(fmap, 2 * x)]), rtol=0, atol=0)


def test_batch_features_refuses_a_batch_that_is_not_whole_heads():
    fmap = make_feature_map("llops", heads=L * H, head_dim=D, p=2, m=M, seed=1, dtype=torch.float64)
    with pytest.raises(ValueError, match="whole number of the map's heads=6"):
        batch_features(fmap, _rand(4, N, D))
    with pytest.raises(ValueError, match="head_dim=4"):
        batch_features(fmap, _rand(L, H, N, D + 1))
    with pytest.raises(TypeError, match="a pair \\(map_q, map_k\\)"):
        pair_features((fmap,), _rand(L, H, N, D), _rand(L, H, N, D))


@pytest.mark.parametrize("tied", [True, False])
def test_kernel_errors_of_maps_are_those_of_the_same_theta_per_layer_and_head(tied):
    # Θ [L, H, ...] through the pure features (one Θ per problem, no flattening) against the maps of L·H heads
    theta_q, theta_k = _rand(L, H, 1, 2, D, M, seed=3), _rand(L, H, 1, 2, D, M, seed=4)
    theta_k = theta_q if tied else theta_k
    map_q = LLoPSMap(L * H, D, theta=theta_q.reshape(L * H, 1, 2, D, M))
    maps = map_q if tied else (map_q, LLoPSMap(L * H, D, theta=theta_k.reshape(L * H, 1, 2, D, M)))
    q, k = _rand(L, H, N, D, seed=5), _rand(L, H, N + 2, D, seed=6)
    approx, exact = llops_features(q, theta_q) @ llops_features(k, theta_k).mT, poly_kernel(q, k, 2)  # [L, H, N, N + 2]
    got = kernel_errors(maps, q, k, 2)
    torch.testing.assert_close(got["sq_err"], ((approx - exact) ** 2).sum((-2, -1)), rtol=1e-12, atol=0)
    torch.testing.assert_close(got["sq_norm"], (exact**2).sum((-2, -1)), rtol=1e-12, atol=0)
    torch.testing.assert_close(got["rel_fro"], rel_fro(approx, exact), rtol=1e-12, atol=0)
    torch.testing.assert_close(got["rel_mae"], rel_mae(approx, exact), rtol=1e-12, atol=0)
    assert not torch.allclose(got["rel_fro"][0], got["rel_fro"][1])  # the heads differ: the order is tested


def _every_method():
    from sketchlab import available_sketches
    from sketchlab.featuremaps import feature_map_names

    return sorted(set(available_sketches()) | set(feature_map_names()))


#: Trained methods: a few Adam steps are enough to compare the maps with the sketch they came from.
_QUICK = {"elementwise": {"steps": 3}, "mlp": {"steps": 3}, "hedgehog": {"steps": 3}, "psf-learned": {"steps": 3},
          "llops": {"method": "adam", "steps": 3}}


#: The methods whose kernel is provably >= 0 at p = 2 (even degree): self-tensored, squared or positive features.
_NON_NEGATIVE_AT_P2 = {"based-expand", "based-taylor", "dpfp", "elementwise", "exact-poly", "hedgehog", "psf-learned",
                       "psf-random"}


@pytest.mark.parametrize("method", _every_method())
def test_every_fit_is_a_pair_of_maps_over_the_flattened_heads(method):
    # fit_sketch(method) on an [L, H] batch -> fit.maps: maps of L·H heads, head l·H + j being layer l, head j:
    # the features the metrics take (pair_features) are each head's twin, fit.layer(l) holds layer l's maps,
    # the report's errors are those of the maps, and the kernel sign is claimed where it holds.
    import warnings

    from sketchlab import fit_sketch
    from sketchlab.featuremaps import FeatureMap

    q, k = _rand(L, H, 24, D, seed=7) / 2, _rand(L, H, 24, D, seed=8) / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # undefined ratios and DPFP/identity sizes are not the point here
        fit = fit_sketch(method, q, k, p=2, m=6, seed=0, reference=False, **_QUICK.get(method, {}))
    map_q, map_k = fit.maps
    assert isinstance(map_q, FeatureMap) and isinstance(map_k, FeatureMap)
    assert (map_q.heads, map_q.head_dim, map_k.heads) == (L * H, D, L * H) and fit.batch_shape == (L, H)
    assert map_q.num_features == map_k.num_features == fit.report.num_features
    fq, fk = pair_features((map_q, map_k), q, k)  # [L, H, 24, M]
    for side, fmap, x, f in (("q", map_q, q, fq), ("k", map_k, k, fk)):
        for l_ in range(L):
            for j in range(H):  # the twin, one head and one token at a time: head l·H + j is problem [l, j]
                torch.testing.assert_close(f[l_, j], fmap._features_naive(x[l_, j], l_ * H + j), rtol=1e-12, atol=1e-12,
                                           msg=f"{side} side, layer {l_} head {j}")
    for l_ in range(L):
        lq, lk = pair_features(fit.layer(l_), q[l_], k[l_])
        torch.testing.assert_close(lq, fq[l_], rtol=0, atol=0)
        torch.testing.assert_close(lk, fk[l_], rtol=0, atol=0)
    torch.testing.assert_close(kernel_errors(fit.maps, q, k, 2)["rel_fro"], fit.report.rel_fro, rtol=1e-12, atol=0)
    assert map_q.non_negative == map_k.non_negative == (method in _NON_NEGATIVE_AT_P2)
    if map_q.non_negative:
        assert bool((fq @ fk.mT >= -1e-12).all())


@pytest.mark.parametrize("name", sorted(__import__("sketchlab.featuremaps", fromlist=["x"]).feature_map_names()))
@pytest.mark.parametrize("input_norm", [False, True])
def test_select_heads_is_the_map_at_those_heads(name, input_norm):
    # A copy holding heads [4, 1] maps x exactly as the whole map maps it at heads 4 and 1 (fast path and twin),
    # and owns its tensors: a change to the copy leaves the original alone.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated names resolve to their new ones
        fmap = make_feature_map(name, heads=L * H, head_dim=D, p=2, m=16, seed=3, dtype=torch.float64,
                                input_norm=input_norm)
    with torch.no_grad():
        for t in fmap.parameters():  # every head different (an InputNormed affine starts equal on every head)
            t.add_(_rand(*t.shape, seed=t.numel()) * 0.1)
    pick = [4, 1]
    sel = fmap.select_heads(pick)
    assert (sel.heads, sel.head_dim, sel.num_features) == (2, D, fmap.num_features)
    full = _rand(2, 3, L * H, D, seed=11)
    x = full[:, :, pick]
    torch.testing.assert_close(sel.features(x), fmap.features(full)[:, :, pick], rtol=0, atol=0)
    torch.testing.assert_close(sel.features_naive(x), fmap.features_naive(full)[:, :, pick], rtol=1e-12, atol=1e-12)
    before = fmap.features(full).clone()
    with torch.no_grad():
        for t in sel.parameters():
            t.zero_()
    assert torch.equal(fmap.features(full), before)


def test_select_heads_refuses_heads_the_map_does_not_have():
    fmap = make_feature_map("llops", heads=3, head_dim=D, p=2, m=M, seed=1)
    for bad in ([], [0, 0], [3], [-1]):
        with pytest.raises(ValueError, match="distinct heads of this map's heads=3"):
            fmap.select_heads(bad)
    with pytest.raises(TypeError, match="sequence of head numbers"):
        fmap.select_heads(2)


def test_fit_layer_is_that_layers_heads():
    from sketchlab import fit_sketch

    q, k = _rand(L, H, 24, D, seed=7) / 2, _rand(L, H, 24, D, seed=8) / 2
    fit = fit_sketch("llops", q, k, p=2, m=6, seed=0, reference=False)
    map_q, map_k = fit.layer(1)
    assert map_q.heads == map_k.heads == H and not fit.tied and map_k is not map_q
    fq, fk = pair_features(fit.maps, q, k)
    lq, lk = pair_features((map_q, map_k), q[1], k[1])
    torch.testing.assert_close(lq, fq[1], rtol=0, atol=0)
    torch.testing.assert_close(lk, fk[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="no layer to select"):
        fit_sketch("llops", q[0, 0], k[0, 0], p=2, m=6, seed=0, reference=False).layer(0)


def test_select_heads_keeps_a_shared_module_whole_under_self_tensoring():
    # A user's module shared by every head (ModuleMap: per_head_parameters False) self-tensored: the wrapper adds no
    # parameters, so its heads share what its inner map's share: select_heads keeps the Linear whole, and the report
    # counts it once, not divided by the heads.
    from torch import nn

    from sketchlab.featuremaps import SelfTensored, as_feature_map
    from sketchlab.fit import _parameters_per_head

    torch.manual_seed(0)
    inner = as_feature_map(nn.Linear(D, 3).double(), heads=L * H, head_dim=D)
    fmap = SelfTensored(inner)
    assert fmap.per_head_parameters is False
    sel = fmap.select_heads([4, 1])
    assert sel.inner.module.weight.shape == (3, D)
    full = _rand(2, 3, L * H, D, seed=12)
    torch.testing.assert_close(sel.features(full[:, :, [4, 1]]), fmap.features(full)[:, :, [4, 1]], rtol=0, atol=0)
    assert _parameters_per_head(fmap, fmap) == 3 * D + 3


def test_fit_layer_out_of_range_names_the_fits_layers():
    from sketchlab import fit_sketch

    q, k = _rand(L, H, 24, D, seed=7) / 2, _rand(L, H, 24, D, seed=8) / 2
    fit = fit_sketch("psf-random", q, k, p=2, m=4, seed=0, reference=False)
    with pytest.raises(IndexError, match=r"layer 2 is out of range for this fit of batch shape \[2, 3\] \(2 layers\)"):
        fit.layer(2)


def test_a_fitter_whose_two_maps_differ_in_size_is_refused_by_name():
    from sketchlab.fit import _fitted_maps

    a = make_feature_map("tensorsketch", heads=2, head_dim=D, p=2, m=5, seed=0)
    b = make_feature_map("tensorsketch", heads=2, head_dim=D, p=2, m=6, seed=0)
    with pytest.raises(ValueError, match=r"fitter of 'mine' returned maps of 5 \(query\) and 6 \(key\) features"):
        _fitted_maps("mine", (a, b), (2,), D)
