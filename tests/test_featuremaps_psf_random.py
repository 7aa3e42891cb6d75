"""PolySketchFormer's random sketch (PSFRandomMap): fast path vs naive twin, tree shapes, unbiasedness, variance in m.

Tolerances. Fast vs naive (float64): each feature is a product of ≤ p inner products of length
≤ max(d, r) taken through ≤ log2(p)+1 levels; both routes round each sum at ~eps·(terms) relative,
so 1e-12 relative to the largest feature leaves a margin of >100x. Statistical checks use a fixed
seed and N independent draws (N heads); each bound is explained where it is asserted.
"""

import math

import pytest
import torch

from sketchlab import fit_sketch
from sketchlab.featuremaps import batch_features
from sketchlab.featuremaps.psf_random import PSFRandomMap, psf_features, psf_features_naive, psf_weight_shapes

F64 = torch.float64


def _one(x):
    """``x [n, d]`` as the input ``[1, n, 1, d]`` of a map of one head."""
    return x[None, :, None]


def _xy(d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=g, dtype=F64)
    y = x + 0.5 * torch.randn(d, generator=g, dtype=F64)  # correlated, so (xᵀy)^p is far from 0
    return x / x.norm(), y / y.norm()


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_fast_matches_naive(p):
    x = torch.randn(6, 3, dtype=F64, generator=torch.Generator().manual_seed(p))
    s = PSFRandomMap.draw(1, 3, p=p, m=5, seed=p, dtype=F64)
    fast, naive = s.features(_one(x))[0, :, 0], psf_features_naive(x, [w[0] for w in s.weights], p)
    assert torch.allclose(fast, naive, rtol=0, atol=1e-12 * naive.abs().max())
    assert torch.equal(s.features_naive(_one(x))[0, :, 0], naive)  # the map's twin


def test_batched_heads_are_independent_single_sketches():
    x = torch.randn(2, 3, 7, 4, dtype=F64, generator=torch.Generator().manual_seed(1))  # [L, H, n, d]
    s = PSFRandomMap.draw(6, 4, p=4, m=6, seed=3, dtype=F64)  # L·H = 6 heads, head l·H + h
    out = batch_features(s, x)
    assert out.shape == (2, 3, 7, 6)
    for l in range(2):
        for h in range(3):
            naive = psf_features_naive(x[l, h], [w[l * 3 + h] for w in s.weights], 4)
            assert torch.allclose(out[l, h], naive, rtol=0, atol=1e-12 * naive.abs().max())
    assert not torch.equal(s.weights[0][0], s.weights[0][1])  # independent draws per head


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_tree_shapes(p):
    shapes = psf_weight_shapes(5, p, 7)
    assert len(shapes) == 2 * (p - 1)  # p leaves -> p-1 internal nodes, two G's each
    assert all(s[1] == 7 and s[0] in (5, 7) for s in shapes)
    # exactly the matrices acting on leaves (x) are d x r: there are p of them
    assert sum(s[0] == 5 for s in shapes) == p


def test_non_negative_is_self_tensored_and_non_negative():
    s = PSFRandomMap.draw(1, 4, p=4, m=20, non_negative=True, seed=0, dtype=F64)
    assert s.r == 4 and s.num_features == 16 and s.non_negative  # r = floor(sqrt(20))
    x = torch.randn(9, 4, dtype=F64, generator=torch.Generator().manual_seed(2))
    inner = s.inner_features(_one(x))[0, :, 0]
    phi = s.features(_one(x))[0, :, 0]
    assert torch.allclose(phi, torch.einsum("na,nb->nab", inner, inner).reshape(9, 16), rtol=0, atol=0)
    kern = phi @ phi.flip(0).T
    assert torch.allclose(kern, (inner @ inner.flip(0).T) ** 2, rtol=1e-12, atol=0)
    assert bool((kern >= 0).all())
    with pytest.raises(ValueError, match="even degree"):
        PSFRandomMap.draw(1, 4, p=3, m=16, non_negative=True, seed=0)


def test_same_seed_same_sketch():
    a, b = PSFRandomMap.draw(1, 3, p=4, m=5, seed=7), PSFRandomMap.draw(1, 3, p=4, m=5, seed=7)
    c = PSFRandomMap.draw(1, 3, p=4, m=5, seed=8)
    assert all(torch.equal(u, v) for u, v in zip(a.weights, b.weights))
    assert not torch.equal(a.weights[0], c.weights[0])


def _estimates(p, r, n_draws, seed):
    x, y = _xy()
    s = PSFRandomMap.draw(n_draws, 4, p=p, m=r, seed=seed, dtype=F64)  # one independent draw per head
    fx = psf_features(x[None, None, :], s.weights, p)[:, 0]  # [N, r]
    fy = psf_features(y[None, None, :], s.weights, p)[:, 0]
    return (fx * fy).sum(-1), float(x @ y) ** p


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_unbiased(p):
    est, exact = _estimates(p, 8, 4000, seed=10 + p)
    # CLT: the mean of N=4000 i.i.d. estimates is within 5 standard errors of its expectation
    # except with probability < 1e-6 (the sample std is accurate to a few % at this N).
    stderr = est.std() / math.sqrt(est.numel())
    assert abs(float(est.mean()) - exact) < 5 * float(stderr), (float(est.mean()), exact, float(stderr))


@pytest.mark.parametrize("p", [2, 4])
def test_variance_shrinks_with_m(p):
    small, _ = _estimates(p, 4, 4000, seed=1)
    large, _ = _estimates(p, 64, 4000, seed=2)
    # Var⟨S(x),S(y)⟩ is an average of r i.i.d. products at the top level, so it scales like 1/r
    # (plus faster-decaying terms for p = 4): the exact ratio is >= 16 for p = 2. Sample variances
    # of N = 4000 draws are accurate to well within a factor 2, so require a factor 4.
    assert float(large.var()) < float(small.var()) / 4


def test_fit_sketch_psf():
    q = torch.randn(2, 30, 5, dtype=F64, generator=torch.Generator().manual_seed(0))  # D = 15 >= m
    k = torch.randn(2, 30, 5, dtype=F64, generator=torch.Generator().manual_seed(1))
    even = fit_sketch("psf-random", q, k, p=2, m=9, seed=0)
    assert even.tied and even.map_q.non_negative and even.map_q.num_features == 9 and even.report.info["r"] == 3
    assert even.report.num_parameters == 5 * 3  # one head's Gaussian entries: G [d, r]
    odd = fit_sketch("psf-random", q, k, p=3, m=9, seed=0)
    assert not odd.map_q.non_negative and odd.map_q.num_features == 9
    plain = fit_sketch("psf-random", q, k, p=2, m=9, seed=0, non_negative=False)
    assert plain.map_q.num_features == 9 and plain.map_q.weights[0].shape == (2, 5, 9)
    # data-independent: the sketch depends on the seed, not on the values of q and k
    again = fit_sketch("psf-random", q * 3, k - 1, p=2, m=9, seed=0)
    assert torch.equal(again.map_q.weights[0], even.map_q.weights[0])


def test_bad_weights_rejected():
    with pytest.raises(ValueError, match="weight matrices"):
        PSFRandomMap([torch.randn(1, 3, 4)], 2)
    with pytest.raises(ValueError, match=r"weights\[1\] must have shape"):
        PSFRandomMap([torch.randn(1, 3, 4), torch.randn(1, 3, 5)], 2)
    with pytest.raises(ValueError, match=r"weights must be tensors \[H, in, r\]"):
        PSFRandomMap([torch.randn(3, 4)], 1)


def test_psf_features_validates_weights():
    x = torch.randn(5, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="got an empty list"):  # was an IndexError
        psf_features(x, [], 2)
    with pytest.raises(TypeError, match="weights must be a list of tensors"):
        psf_features(x, torch.randn(4, 3), 1)
    with pytest.raises(ValueError, match="needs 2 weight matrices, got 1"):
        psf_features(x, [torch.randn(4, 3, dtype=F64)], 2)
    with pytest.raises(ValueError, match=r"weights\[0\] must have shape \[..., 4, 3\]"):  # d mismatch
        psf_features(x, [torch.randn(5, 3, dtype=F64)], 1)
    with pytest.raises(ValueError, match=r"x must have shape \[..., n, d\]"):
        psf_features(torch.ones(4, dtype=F64), [torch.randn(4, 3, dtype=F64)], 1)


def test_polysketch_rejects_non_list_weights():
    with pytest.raises(TypeError, match="weights must be a list of tensors .* got Tensor"):  # was "Boolean value of Tensor"
        PSFRandomMap(torch.randn(1, 4, 3), 1)
    with pytest.raises(ValueError, match="got an empty list"):
        PSFRandomMap([], 1)


@pytest.mark.parametrize("p", [2, 3])
def test_fit_psf_follows_the_input_device(p):
    # Weights are drawn on a CPU generator, then moved to q's device; "meta" (shapes only) stands in
    # for a GPU here: without the move the weights would stay on the CPU.
    from sketchlab.featuremaps.psf_random import _fit_psf

    q = torch.empty(2, 7, 5, device="meta")
    s = _fit_psf(q, q, p=p, m=9, seed=0).map_q
    assert {w.device.type for w in s.weights} == {"meta"}
    x = torch.empty(1, 7, 2, 5, device="meta")
    assert s.features(x).device.type == "meta" and s.features(x).shape == (1, 7, 2, 9)
    cpu = PSFRandomMap.draw(2, 5, p=p, m=9, non_negative=p % 2 == 0, seed=0, dtype=torch.float32)
    assert all(w.device.type == "cpu" and w.shape == v.shape for w, v in zip(cpu.weights, s.weights))


# ------------------------------------------------------------------------------------------------
# edge cases and messages


def test_one_dimensional_inputs_and_fit_info():
    s = PSFRandomMap.draw(1, 1, p=2, m=4, seed=0, dtype=torch.float64)
    x = torch.tensor([[2.0], [-1.0]], dtype=torch.float64)
    assert s.features(_one(x)).shape == (1, 2, 1, 4) and not hasattr(s, "fit_info")
    w = [t[0] for t in s.weights]
    torch.testing.assert_close(psf_features(x, w, 2), psf_features_naive(x, w, 2), rtol=1e-12, atol=0)


def test_draw_and_naive_messages():
    with pytest.raises(ValueError, match=r"^d must be an integer >= 1, got 0"):
        PSFRandomMap.draw(1, 0, p=2, m=4, seed=0)
    with pytest.raises(ValueError, match=r"^m \(the sketch size\) must be an integer >= 1, got 0"):
        PSFRandomMap.draw(1, 3, p=2, m=0, seed=0)
    with pytest.raises(ValueError, match=r"use a smaller degree p or sketch size m, or fewer heads at a time, or raise"):
        PSFRandomMap.draw(32, 64, p=1024, m=4096, seed=0)
    w = [t[0] for t in PSFRandomMap.draw(1, 3, p=2, m=4, seed=0, non_negative=False).weights]
    with pytest.raises(ValueError, match=r"psf_features_naive takes x\[n, d\], got shape \(1, 5, 3\)"):
        psf_features_naive(torch.ones(1, 5, 3), w, 2)
    with pytest.raises(TypeError, match=r"^x must have a real floating-point dtype"):
        psf_features_naive(torch.ones(5, 3, dtype=torch.int64), w, 2)


@pytest.mark.parametrize("p,non_negative,scale,what", [
    (1, False, 1e38, r"^PolySketch features of degree p=1 overflow torch.float32"),
    (2, False, 1e20, r"^PolySketch features of degree p=2 overflow torch.float32: .*‖x‖ = 1\.7\d*e\+20"),
    (2, True, 1e20, r"^PolySketch \(self-tensored s ⊗ s\) features of degree p=2 overflow"),
])
def test_overflow_names_the_sketch_degree_and_input_norm(p, non_negative, scale, what):
    # float32 overflows above 3.4e38: p = 1 with all-10 weights gives 3·10·1e38/√4 = 1.5e39; p = 2 a
    # product of two Gaussian projections (~1e40); the self-tensor s ⊗ s of a degree-1 s (~1e40).
    if p == 1:
        s = PSFRandomMap([torch.full((1, 3, 4), 10.0)], 1)
    else:
        s = PSFRandomMap.draw(1, 3, p=p, m=4, seed=0, non_negative=non_negative)
    with pytest.raises(FloatingPointError, match=what):
        s.features(torch.full((1, 2, 1, 3), scale))
