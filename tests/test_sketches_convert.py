"""as_llops: exact conversions of special cases to LLoPS Θ, clear errors for the others.

Tolerance: the LLoPS features multiply the same p inner products as the sketch (in another
order), so float64 features agree to a few ulps of the largest feature; we assert 1e-12
relative to it, as the issue asks.
"""

import pytest
import torch

from sketchlab.llops.module import LLoPS
from sketchlab.sketches import BasedSketch, ElementwiseSketch, MLPSketch, PolySketch, TensorSketch, as_llops

F64 = torch.float64


def _x(*lead, n=9, d=4, seed=0):
    return torch.randn(*lead, n, d, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _assert_same_features(sketch, ll, x):
    with torch.no_grad():
        for a, b in ((sketch.features_q(x), ll.features_q(x)), (sketch.features_k(x), ll.features_k(x))):
            assert a.shape == b.shape
            assert torch.allclose(a, b, rtol=0, atol=1e-12 * a.abs().max())


def _g(*shape, seed=1):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


CASES = {
    "elementwise tied p=3": lambda: ElementwiseSketch(_g(4, 6), 3),
    "elementwise untied p=2": lambda: ElementwiseSketch(_g(4, 6), 2, _g(4, 6, seed=2)),
    "expand full p=2": lambda: BasedSketch(_g(4, 3), 2, symmetric=False),
    "expand symmetric p=3": lambda: BasedSketch(_g(4, 3), 3, symmetric=True),
    "expand full p=3 batched": lambda: BasedSketch(_g(2, 3, 4, 2), 3),
    "psf plain p=1": lambda: PolySketch.draw(4, 1, 5, seed=0, dtype=F64),
    "psf plain p=2": lambda: PolySketch.draw(4, 2, 5, seed=0, dtype=F64),
    "psf non-negative p=2": lambda: PolySketch.draw(4, 2, 9, non_negative=True, seed=0, dtype=F64),
    "psf non-negative p=4": lambda: PolySketch.draw(4, 4, 16, non_negative=True, seed=0, dtype=F64),
    "psf non-negative p=4 batched": lambda: PolySketch.draw(4, 4, 9, non_negative=True, seed=0,
                                                            batch_shape=(2, 3), dtype=F64),
}


@pytest.mark.parametrize("name", list(CASES))
def test_exact_conversion(name):
    sketch = CASES[name]()
    ll = as_llops(sketch)
    assert isinstance(ll, LLoPS) and ll.rank == 1 and ll.degree == sketch.degree
    assert ll.num_features == sketch.num_features
    lead = sketch.proj.shape[:-2] if isinstance(sketch, BasedSketch) else ()
    if isinstance(sketch, PolySketch):
        lead = sketch.weights[0].shape[:-2]
    _assert_same_features(sketch, ll, _x(*lead))


@pytest.mark.parametrize("name", list(CASES))
def test_affine_conversion_of_a_homogeneous_sketch_adds_a_zero_constant_row(name):
    sketch = CASES[name]()
    plain, ll = as_llops(sketch), as_llops(sketch, affine=True)
    assert ll.theta_q.shape[:-2] == plain.theta_q.shape[:-2] and ll.theta_q.shape[-2:] == (5, sketch.num_features)
    for a, b in ((plain.theta_q, ll.theta_q), (plain.theta_k, ll.theta_k)):
        if a is None:
            assert b is None
            continue
        torch.testing.assert_close(b[..., :4, :], a, rtol=0, atol=0)
        assert not b[..., 4, :].any()


@pytest.mark.parametrize("symmetric", [False, True])
def test_based_taylor_is_llops_of_the_affine_input(symmetric):
    from sketchlab.llops import affine_input
    from sketchlab.sketches.based import taylor_features_naive

    proj = _g(2, 4, 3)  # two heads, d = 4, d' = 3
    sketch = BasedSketch(proj, 2, form="taylor", symmetric=symmetric)
    ll = as_llops(sketch, affine=True)
    assert ll.tied and ll.rank == 1 and ll.degree == 2 and ll.num_features == sketch.num_features
    assert ll.theta_q.shape == (2, 1, 2, 5, 1 + 3 + (6 if symmetric else 9))
    x = _x(2)
    got = ll.features_q(affine_input(x)).detach()
    for h in range(2):  # the float64 loop twin, per head
        want = taylor_features_naive(x[h], proj[h], symmetric)
        assert torch.allclose(got[h], want, rtol=0, atol=1e-12 * want.abs().max())
    # and the kernel is BASED's 1 + s + s²/2, s = uᵀu'/√d'
    u = x @ proj
    s = u @ u.mT / 3**0.5
    torch.testing.assert_close(got @ got.mT, 1 + s + s**2 / 2, rtol=1e-12, atol=1e-12)


def test_affine_input_appends_a_one():
    from sketchlab.llops import affine_input

    x = _x(2, n=3)
    out = affine_input(x)
    assert out.shape == (2, 3, 5) and out.dtype == F64
    torch.testing.assert_close(out[..., :4], x, rtol=0, atol=0)
    assert bool((out[..., 4] == 1).all())


def test_psf_degree4_theta_is_fixed_random_rank1():
    s = PolySketch.draw(4, 4, 16, non_negative=True, seed=3, dtype=F64)
    theta = as_llops(s).theta_q.detach()
    assert theta.shape == (1, 4, 4, 16)  # t = 1, p = 4, d = 4, m = r² = 16
    g1, g2 = s.weights
    # coordinate (a, b) = (1, 2) sits at column a·r + b = 6 and is ⟨G1_a/r, ·⟩⟨G2_a, ·⟩⟨G1_b, ·⟩⟨G2_b, ·⟩
    assert torch.equal(theta[0, :, :, 6], torch.stack([g1[:, 1] / 4, g2[:, 1], g1[:, 2], g2[:, 2]]))


@pytest.mark.parametrize("make,match", [
    (lambda: PolySketch.draw(3, 8, 16, non_negative=True, seed=0), "degree p=8 has no rank-1 LLoPS form"),
    (lambda: PolySketch.draw(3, 8, 16, seed=0), "plain recursive PolySketchFormer sketch of degree p=8"),
    (lambda: PolySketch.draw(3, 3, 16, seed=0), "degree p=3 has no rank-1"),
    (lambda: TensorSketch.draw(3, 2, 8, seed=0), "TensorSketch has no exact LLoPS form"),
    (lambda: MLPSketch.init_random(3, 2, 4, 5, seed=0), "not a polynomial map"),
    (lambda: BasedSketch(torch.randn(3, 2), 2, form="taylor"), r"inhomogeneous .* affine input \[x, 1\] \(as_llops\(sketch, affine=True\)\)"),
])
def test_not_expressible_raises(make, match):
    with pytest.raises(ValueError, match=match):
        as_llops(make())


def test_non_sketch_rejected_and_llops_passthrough():
    with pytest.raises(TypeError, match="as_llops takes a Sketch"):
        as_llops(torch.randn(3, 3))
    ll = LLoPS(torch.randn(1, 2, 3, 4))
    assert as_llops(ll) is ll
    with pytest.raises(TypeError, match=r"affine must be a bool, got 1"):
        as_llops(ll, affine=1)
