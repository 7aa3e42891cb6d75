"""The element-wise sketch (TiedLLoPSMap of rank 1): naive twin, fitting lowers the loss, one map or two.

Tolerances: fast vs naive in float64 differ by summation order only (≤ d terms per output), so 1e-12
relative to the largest feature is ample.
"""

import pytest
import torch

from sketchlab import fit_sketch
from sketchlab.featuremaps.elementwise import TiedLLoPSMap, elementwise_features_naive

F64 = torch.float64


def _qk(h=2, n=24, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h, n, d, generator=g), torch.randn(h, n, d, generator=g)


def test_elementwise_matches_naive_and_fits():
    theta = torch.randn(3, 5, dtype=F64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    s = TiedLLoPSMap(1, 3, theta[None, None], p=3, signed=True)  # one head, rank 1: (xΘ)^3
    with torch.no_grad():
        fast = s.features(x[None, :, None])[0, :, 0]
        assert torch.allclose(fast, elementwise_features_naive(x, theta[None], 3), rtol=1e-12, atol=0)
        assert torch.allclose(fast, (x @ theta) ** 3, rtol=1e-12, atol=0)
        assert torch.equal(s.features_naive(x[None, :, None])[0, :, 0], elementwise_features_naive(x, theta[None], 3))
    assert s.num_parameters == 15 and not s.non_negative  # odd p: signed
    q, k = _qk()
    fit = fit_sketch("elementwise", q, k, p=2, m=8, seed=0, steps=80, lr=2e-2)
    info = fit.report.info
    assert (info["rel_fro"] ** 2).mean() < 0.5 * (info["init_rel_fro"] ** 2).mean()  # same budget argument as the MLP
    assert fit.report.num_parameters == 2 * 4 * 8
    assert not fit.tied and fit.map_q.theta.shape == fit.map_k.theta.shape == (2, 1, 4, 8)
    assert fit.map_q.non_negative and fit.map_k.non_negative  # even p
    tied = fit_sketch("elementwise", q, k, p=2, m=8, seed=0, steps=3, tied=True)
    assert tied.tied and tied.report.num_parameters == 4 * 8


def test_validation():
    with pytest.raises(ValueError, match="theta must have shape"):
        TiedLLoPSMap(2, 3, torch.randn(2, 1, 4, 5), p=3, signed=True)
    with pytest.raises(ValueError, match="even degree"):
        TiedLLoPSMap(2, 3, torch.randn(2, 1, 3, 5), p=3)
    with pytest.raises(TypeError, match="tied must be a bool"):
        fit_sketch("elementwise", *_qk(), p=2, m=4, tied=1)


def test_elementwise_naive_requires_a_matrix():
    with pytest.raises(ValueError, match=r"x\[n, d\], got shape \(3,\)"):  # was an IndexError
        elementwise_features_naive(torch.ones(3, dtype=F64), torch.ones(1, 3, 2, dtype=F64), 2)
    with pytest.raises(ValueError, match=r"theta\[t, d, m\] with d = x.shape\[1\] = 3"):
        elementwise_features_naive(torch.ones(2, 3, dtype=F64), torch.ones(1, 4, 2, dtype=F64), 2)


def test_random_start_follows_the_input_device(monkeypatch):
    # The start is drawn on a CPU generator, then moved to q's device. "meta" (shapes only) stands
    # in for a GPU on this CPU-only machine; training needs values, so it is replaced by a no-op here
    # (the device of the start is decided before it).
    import sketchlab.featuremaps.elementwise as ew

    monkeypatch.setattr(ew, "train_kernel_sketch", lambda *args, **kwargs: {"steps": 0, "converged": True})
    q = torch.empty(2, 6, 4, device="meta")
    maps = ew._fit_elementwise(q, q, p=2, m=8, seed=0)
    x = torch.empty(1, 6, 2, 4, device="meta")
    for fmap in maps:
        assert {t.device.type for t in fmap.parameters()} == {"meta"}
        assert fmap.features(x).device.type == "meta" and fmap.features(x).shape == (1, 6, 2, 8)
