"""MLP ("NN") maps: naive twins, parameter budget, fitting lowers the loss.

Tolerances: fast vs naive in float64 differ by summation order only (≤ d + h terms per output),
so 1e-12 relative to the largest feature is ample.
"""

import pytest
import torch

from sketchlab import fit_sketch
from sketchlab.featuremaps.mlp import MLPMap, default_hidden, mlp_features_naive

F64 = torch.float64


def _qk(h=2, n=24, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h, n, d, generator=g), torch.randn(h, n, d, generator=g)


@pytest.mark.parametrize("activation", ["gelu", "relu", "tanh"])
def test_mlp_matches_naive_per_head(activation):
    gen = torch.Generator().manual_seed(0)
    maps = {side: MLPMap.init_random(2, 3, p=2, m=5, hidden=4, generator=gen, dtype=F64, activation=activation)
            for side in ("q", "k")}
    with torch.no_grad():  # non-zero biases so they are exercised
        maps["q"].b1.normal_(generator=torch.Generator().manual_seed(1))
        maps["k"].b2.normal_(generator=torch.Generator().manual_seed(2))
    x = torch.randn(1, 6, 2, 3, dtype=F64, generator=torch.Generator().manual_seed(3))  # [B, T, H, D]
    for side, fmap in maps.items():
        with torch.no_grad():
            out, twin = fmap.features(x), fmap.features_naive(x)
        for h in range(2):
            w = [getattr(fmap, n)[h].detach() for n in ("w1", "b1", "w2", "b2")]
            naive = mlp_features_naive(x[0, :, h], *w, activation)
            assert torch.allclose(out[0, :, h], naive, rtol=0, atol=1e-12 * naive.abs().max())
            assert torch.equal(twin[0, :, h], naive)


@pytest.mark.parametrize("d,p,m", [(32, 2, 64), (32, 3, 64), (8, 2, 16), (4, 4, 3)])
def test_default_hidden_is_smallest_width_matching_llops(d, p, m):
    h = default_hidden(d, p, m)
    count = lambda width: 2 * (d * width + width + width * m + m)  # noqa: E731
    assert count(h) >= 2 * p * d * m  # at least the rank-1 untied LLoPS parameter count
    assert h == 1 or count(h - 1) < 2 * p * d * m
    assert 2 * MLPMap.init_random(1, d, p=p, m=m, hidden=h, seed=0).num_parameters == count(h)  # both sides


def test_mlp_fit_lowers_loss_and_is_at_least_llops_sized():
    q, k = _qk()
    fit = fit_sketch("mlp", q, k, p=2, m=8, seed=0, steps=80, lr=2e-2)
    info = fit.report.info
    assert fit.report.steps == 80
    # the random start has relative squared error ~1 or more; 80 Adam steps on 2x24 tokens reach far
    # below half of it (observed 1.04 -> 0.32); the assert only requires the fit to have done real work.
    assert (info["rel_fro"] ** 2).mean() < 0.5 * (info["init_rel_fro"] ** 2).mean()
    assert fit.report.num_parameters >= 2 * 2 * 4 * 8
    # the trainer's per-head error is the one fit_sketch measures (float32 features: 1e-5)
    torch.testing.assert_close(info["rel_fro"].double(), fit.report.rel_fro, rtol=1e-5, atol=0)
    assert not fit.tied and fit.map_q.w1.shape == fit.map_k.w1.shape == (2, 4, info["hidden"])


def test_validation():
    with pytest.raises(ValueError, match="activation must be one of"):
        MLPMap.init_random(1, 3, p=2, m=4, hidden=5, seed=0, activation="swish")
    with pytest.raises(ValueError, match=r"lr must be a finite number > 0, got -1.0"):
        fit_sketch("mlp", *_qk(), p=2, m=4, lr=-1.0)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        fit_sketch("mlp", *_qk(), p=2, m=4, steps=0)


def test_random_start_follows_the_input_device(monkeypatch):
    # The start is drawn on a CPU generator, then moved to q's device. "meta" (shapes only) stands
    # in for a GPU on this CPU-only machine; training needs values, so it is replaced by a no-op here
    # (the device of the start is decided before it).
    import sketchlab.featuremaps.mlp as mlp

    monkeypatch.setattr(mlp, "train_kernel_sketch", lambda *args, **kwargs: {"steps": 0, "converged": True})
    q = torch.empty(2, 6, 4, device="meta")
    s = mlp._fit_mlp(q, q, p=2, m=8, seed=0)
    x = torch.empty(1, 6, 2, 4, device="meta")
    for fmap in s:
        assert {t.device.type for t in fmap.parameters()} == {"meta"}
        assert fmap.features(x).device.type == "meta" and fmap.features(x).shape == (1, 6, 2, 8)


def test_mlp_sketch_reports_the_degree_it_was_fitted_for():
    """``degree`` is the ``p`` the sketch approximates (the fitted target), for p = 2 and p = 3."""
    for p in (2, 3):
        fit = fit_sketch("mlp", *_qk(), p=p, m=4, steps=2)
        assert fit.map_q.degree == fit.map_k.degree == p
