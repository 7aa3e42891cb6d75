"""TensorSketch: identical to scikit-learn's PolynomialCountSketch for the same hashes, naive twin,
unbiasedness and variance in m.

Tolerances: both implementations compute the same CountSketches (sums of ≤ d signed terms) and the
same FFT-domain product in float64; FFT round-off is ~eps·log(m)·‖input‖, so 1e-12 relative to the
largest feature is ample. Statistical bounds are explained where asserted.
"""

import math

import numpy as np
import pytest
import torch
from sklearn.kernel_approximation import PolynomialCountSketch

from sketchlab import fit_sketch
from sketchlab.featuremaps.tensorsketch import (
    TensorSketchMap,
    count_sketch_matrix,
    tensorsketch_features,
    tensorsketch_features_naive,
)

F64 = torch.float64


@pytest.mark.parametrize("p,m", [(1, 5), (2, 7), (3, 8), (4, 16)])
def test_identical_to_sklearn(p, m):
    rng = np.random.default_rng(p)
    x = rng.standard_normal((6, 4))
    ref = PolynomialCountSketch(gamma=1.0, coef0=0, degree=p, n_components=m, random_state=p).fit(x)
    ours = TensorSketchMap(torch.from_numpy(ref.indexHash_)[None], torch.from_numpy(ref.bitHash_)[None], m, dtype=F64)
    want = torch.from_numpy(ref.transform(x))
    got = ours.features(torch.from_numpy(x)[None, :, None])[0, :, 0]  # one head: x [1, n, 1, d]
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * want.abs().max())


@pytest.mark.parametrize("p", [1, 2, 3])
def test_fast_matches_naive(p):
    x = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(p))
    s = TensorSketchMap.draw(2, 3, p=p, m=6, seed=p, dtype=F64)
    for h in range(2):
        naive = tensorsketch_features_naive(x, s.index_hash[h], s.sign_hash[h], 6)
        assert torch.allclose(s.features(x[None, :, None].expand(1, 5, 2, 3))[0, :, h], naive, rtol=0,
                              atol=1e-12 * naive.abs().max())
        assert torch.equal(s.features_naive(x[None, :, None].expand(1, 5, 2, 3))[0, :, h], naive)  # the map's twin


def _estimates(p, m, n_draws, seed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, generator=g, dtype=F64)
    y = x + 0.5 * torch.randn(5, generator=g, dtype=F64)
    x, y = x / x.norm(), y / y.norm()
    s = TensorSketchMap.draw(n_draws, 5, p=p, m=m, seed=seed, dtype=F64)  # one independent draw per head
    fx = s.features(x.expand(1, 1, n_draws, 5))[0, 0]  # [N, m]
    fy = s.features(y.expand(1, 1, n_draws, 5))[0, 0]
    return (fx * fy).sum(-1), float(x @ y) ** p


@pytest.mark.parametrize("p", [1, 2, 3])
def test_unbiased(p):
    est, exact = _estimates(p, 8, 4000, seed=p)
    # CLT with N = 4000 draws: |mean − (xᵀy)^p| < 5 standard errors except with probability < 1e-6.
    stderr = est.std() / math.sqrt(est.numel())
    assert abs(float(est.mean()) - exact) < 5 * float(stderr), (float(est.mean()), exact, float(stderr))


@pytest.mark.parametrize("p", [2, 3])
def test_variance_shrinks_with_m(p):
    small, _ = _estimates(p, 4, 4000, seed=1)
    large, _ = _estimates(p, 64, 4000, seed=2)
    # Var is (Σ over colliding index-tuple pairs)/m: it scales like 1/m, a ratio ~16 between m = 4
    # and m = 64; sample variances at N = 4000 are accurate well within 2x, so require 4x.
    assert float(large.var()) < float(small.var()) / 4


def test_fit_and_validation():
    q = torch.randn(3, 20, 4, generator=torch.Generator().manual_seed(0))
    fit = fit_sketch("tensorsketch", q, q.flip(-2), p=2, m=8, seed=5)
    assert fit.tied and fit.map_q.index_hash.shape == (3, 2, 4) and fit.map_q.num_features == 8
    assert fit.report.num_parameters == 2 * 2 * 4
    with pytest.raises(ValueError, match=r"index_hash values must lie in \[0, m\)"):
        TensorSketchMap(torch.tensor([[[0, 9]]]), torch.tensor([[[1, -1]]]), 4)
    with pytest.raises(ValueError, match="sign_hash values must be"):
        TensorSketchMap(torch.tensor([[[0, 1]]]), torch.tensor([[[1, 0]]]), 4)
    with pytest.raises(ValueError, match=r"must have shape \[H, p, D\]"):
        TensorSketchMap(torch.tensor([[0, 1]]), torch.tensor([[1, 1]]), 4)


def test_features_validate_the_matrices_against_x():
    mats = count_sketch_matrix(torch.tensor([[0, 1, 2], [2, 1, 0]]), torch.ones(2, 3, dtype=torch.long), 4, F64)
    x = torch.ones(5, 3, dtype=F64)
    assert tensorsketch_features(x, mats).shape == (5, 4)
    with pytest.raises(ValueError, match=r"d = matrices.shape\[-2\] = 3 .* got x of shape \(5, 4\)"):  # was a bmm RuntimeError
        tensorsketch_features(torch.ones(5, 4, dtype=F64), mats)
    with pytest.raises(ValueError, match=r"x must have shape \[..., n, d\]"):
        tensorsketch_features(torch.ones(3, dtype=F64), mats)
    with pytest.raises(ValueError, match=r"matrices must have shape \[..., p, d, m\]"):
        tensorsketch_features(x, mats[0])


def test_fit_follows_the_input_device():
    # Hashes are drawn on a CPU generator, validated, then moved to q's device; "meta" (shapes
    # only) stands in for a GPU here: without the move they would stay on the CPU.
    from sketchlab.featuremaps.tensorsketch import _fit_tensorsketch

    q = torch.empty(3, 6, 4, device="meta")
    s = _fit_tensorsketch(q, q, p=2, m=8, seed=5).map_q
    assert s.index_hash.device.type == s.sign_hash.device.type == s.matrices.device.type == "meta"
    x = torch.empty(1, 6, 3, 4, device="meta")
    assert s.features(x).device.type == "meta" and s.features(x).shape == (1, 6, 3, 8)
    cpu = TensorSketchMap.draw(3, 4, p=2, m=8, seed=5)
    assert cpu.matrices.device.type == "cpu"


def test_countsketch_budget_counts_bytes_per_element():
    """The dense ``[32, 32, p=1000, d=128, m]`` float32 matrices take 32·32·1000·128 hashes × m=10⁵ × 4 bytes
    = 48 828 GiB: refused before any allocation, with that size in the message."""
    with pytest.raises(ValueError, match=r"dense CountSketch matrices \(131072000 hashes x m=100000, torch.float32\) "
                                         r"would take 4.88e\+04 GiB"):
        TensorSketchMap.draw(32 * 32, 128, p=1000, m=100_000, seed=0)
