"""Where a batch ``[L, H]`` of problems meets a feature map's heads (:mod:`sketchlab.featuremaps.heads`): the
one flattening (row-major, layer ``l`` head ``j`` → head ``l·H + j``), and the metrics taking a map or a pair
of maps as they take the fitted sketch with the same Θ.

Tolerances: float64, 1e-12 (the same products in the same order up to reshapes; the twin sums per token).
"""

import pytest
import torch

from sketchlab import LLoPS, kernel_errors
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
def test_kernel_errors_of_maps_equal_those_of_the_sketch_with_the_same_theta(tied):
    theta_q, theta_k = _rand(L, H, 1, 2, D, M, seed=3), _rand(L, H, 1, 2, D, M, seed=4)
    sketch = LLoPS(theta_q) if tied else LLoPS(theta_q, theta_k)
    map_q = LLoPSMap(L * H, D, theta=theta_q.reshape(L * H, 1, 2, D, M))
    maps = map_q if tied else (map_q, LLoPSMap(L * H, D, theta=theta_k.reshape(L * H, 1, 2, D, M)))
    q, k = _rand(L, H, N, D, seed=5), _rand(L, H, N + 2, D, seed=6)
    want, got = kernel_errors(sketch, q, k, 2), kernel_errors(maps, q, k, 2)
    for key in ("sq_err", "sq_norm", "rel_fro", "rel_mae"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=0)
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
    # fit_sketch(method) on an [L, H] batch -> fit.feature_maps(): maps of L·H heads whose features, twin and
    # non_negative are the fitted sketch's, head l·H + j being layer l, head j.
    import warnings

    from sketchlab import fit_sketch
    from sketchlab.featuremaps import FeatureMap

    q, k = _rand(L, H, 24, D, seed=7) / 2, _rand(L, H, 24, D, seed=8) / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # undefined ratios and DPFP/identity sizes are not the point here
        fit = fit_sketch(method, q, k, p=2, m=6, seed=0, reference=False, **_QUICK.get(method, {}))
    map_q, map_k = fit.feature_maps()
    assert isinstance(map_q, FeatureMap) and isinstance(map_k, FeatureMap)
    assert (map_q.heads, map_q.head_dim, map_k.heads) == (L * H, D, L * H)
    fq, fk = pair_features((map_q, map_k), q, k)
    with torch.no_grad():
        want_q, want_k = fit.sketch.features_q(q).double(), fit.sketch.features_k(k).double()
    torch.testing.assert_close(fq, want_q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fk, want_k, rtol=1e-12, atol=1e-12)
    # the kernel sign, one name on both sides (Sketch.non_negative is FeatureMap.non_negative), claimed where it holds
    assert map_q.non_negative == map_k.non_negative == fit.sketch.non_negative == (method in _NON_NEGATIVE_AT_P2)
    if fit.sketch.non_negative:
        assert bool((fq @ fk.mT >= -1e-12).all())
    x = _rand(1, 5, L * H, D, seed=9)
    for side, fmap in (("q", map_q), ("k", map_k)):
        twin = fmap.features_naive(x)  # [1, 5, L·H, M]
        for l_ in range(L):
            for j in range(H):
                torch.testing.assert_close(twin[0, :, l_ * H + j], fit.sketch.features_naive(x[0, :, l_ * H + j], side, (l_, j)),
                                           rtol=1e-12, atol=1e-12)
