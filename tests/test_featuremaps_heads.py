"""Where a batch ``[L, H]`` of problems meets a feature map's heads (:mod:`sketchlab.featuremaps.heads`): the
one flattening (row-major, layer ``l`` head ``j`` → head ``l·H + j``), and the metrics taking a map or a pair
of maps as they take the fitted sketch with the same Θ.

Tolerances: float64, 1e-12 (the same products in the same order up to reshapes; the twin sums per token).
"""

import pytest
import torch

from sketchlab import LLoPS, kernel_errors
from sketchlab.featuremaps import LLoPSMap, make_feature_map
from sketchlab.featuremaps.heads import batch_features, pair_features

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
