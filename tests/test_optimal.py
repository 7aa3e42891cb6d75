"""Theorem 3.1: the optimal sketch attains the SVD tail, both routes agree, nothing beats it.

Tolerance for ``‖Â − A‖_F² = tail``: both sides are float64. The tail is a sum of squared
singular values, each accurate to ~eps·σ_1 (backward-stable SVD); the achieved error is computed
from features whose round-off is ~eps·κ·‖A‖ with κ the conditioning of the kept subspace. For the
well-conditioned random problems below this is ~1e-13 relative to the tail; the issue asks for
1e-9, which we assert.
"""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sketchlab import (
    OptimalMap,
    fit_sketch,
    max_sketch_size,
    num_poly_features,
    optimal_sketch,
    poly_features,
    poly_kernel,
    tail_bound,
)
from sketchlab.featuremaps import pair_features
from sketchlab.fit import _parameters_per_head

REL = 1e-9


def _qk(*lead, n_q=40, n_k=40, d=4, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, n_q, d, generator=gen, dtype=dtype)
    k = torch.randn(*lead, n_k, d, generator=gen, dtype=dtype)
    return q, k


def _kernel(opt, q, k):
    """``φ_Q(q) φ_K(k)ᵀ`` of an optimum's maps, ``[..., n_q, n_k]`` (the batch flattened into the maps' heads)."""
    fq, fk = pair_features(opt.maps, q, k)
    return fq @ fk.mT


def _sq_err(maps, q, k, p):
    return ((_kernel(maps, q, k) - poly_kernel(q, k, p)) ** 2).sum((-2, -1))


@pytest.mark.parametrize("route", ["svd", "qr"])
@pytest.mark.parametrize("p,m", [(1, 2), (2, 3), (2, 8), (3, 10)])
def test_error_equals_tail(route, p, m):
    q, k = _qk(n_q=30, n_k=25, d=4, seed=p * 10 + m)
    s = optimal_sketch(q, k, p, m, route=route)
    assert all(isinstance(f, OptimalMap) for f in s.maps) and s.map_q.heads == 1 and s.map_q.degree == p
    assert s.route == route
    err = _sq_err(s, q, k, p)
    assert torch.allclose(err, s.tail, rtol=REL, atol=0), (err, s.tail)
    # the tail is the sum of the discarded squared singular values of A
    sv = torch.linalg.svdvals(poly_kernel(q, k, p))
    assert torch.allclose(s.tail, (sv[m:] ** 2).sum(), rtol=REL, atol=0)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6)])
def test_routes_agree(p, m):
    q, k = _qk(n_q=60, n_k=50, d=3, seed=11)  # n > D: both routes are valid
    a, b = optimal_sketch(q, k, p, m, route="svd"), optimal_sketch(q, k, p, m, route="qr")
    assert optimal_sketch(q, k, p, m).route == "qr"  # auto picks QR when n > D
    sv_a, sv_b = a.singular_values, b.singular_values
    assert torch.allclose(sv_a, sv_b, rtol=1e-10, atol=1e-10 * sv_a[0])
    assert torch.allclose(a.tail, b.tail, rtol=REL, atol=0)
    # W* is unique up to signs of singular-vector pairs; the kernel it produces is unique (σ_m > σ_{m+1})
    assert torch.allclose(_kernel(a, q, k), _kernel(b, q, k), rtol=0, atol=1e-10 * sv_a[0])


def test_auto_route_is_svd_when_features_outnumber_tokens():
    q, k = _qk(n_q=8, n_k=8, d=4)
    assert optimal_sketch(q, k, 3, 4).route == "svd"  # D = C(6,3) = 20 > 8


def test_batched_equals_per_head():
    q, k = _qk(2, 3, n_q=20, n_k=20, d=3, seed=5)
    batched = optimal_sketch(q, k, 2, 4)
    assert batched.map_q.w.shape == (6, 6, 4) and batched.tail.shape == (2, 3)  # heads [L·H, D, m]
    for l in range(2):
        for h in range(3):
            single = optimal_sketch(q[l, h], k[l, h], 2, 4)
            assert torch.allclose(batched.tail[l, h], single.tail, rtol=1e-12, atol=0)
            assert torch.allclose(_kernel(batched, q, k)[l, h], _kernel(single, q[l, h], k[l, h]), rtol=0, atol=1e-10)
            assert torch.equal(batched.map_k.w[3 * l + h], batched.map_k.w.reshape(2, 3, 6, 4)[l, h])
    assert torch.allclose(tail_bound(q, k, 2, 4), batched.tail, rtol=1e-12, atol=0)


def test_projector_in_full_basis_gives_same_features():
    q, k = _qk(n_q=20, n_k=20, d=3, seed=8)
    s = optimal_sketch(q, k, 3, 5)
    assert s.map_k.symmetric and torch.equal(s.map_k.projector(symmetric=True), s.map_k.w)
    w_full = s.map_k.projector()[0]
    assert w_full.shape == (27, 5)
    assert torch.allclose(poly_features(k, 3) @ w_full, pair_features(s.maps, q, k)[1], rtol=0, atol=1e-12)


def test_float32_input_is_solved_in_float64():
    q, k = _qk(n_q=20, n_k=20, d=3, dtype=torch.float32)
    s = optimal_sketch(q, k, 2, 3)
    assert s.map_q.w.dtype == torch.float64
    assert torch.allclose(_sq_err(s, q.double(), k.double(), 2), s.tail, rtol=REL, atol=0)


@settings(max_examples=40, deadline=None)
@given(
    d=st.integers(1, 4),
    p=st.integers(1, 3),
    n=st.integers(2, 12),
    m_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
    perturb=st.booleans(),
)
def test_no_linear_sketch_beats_the_tail(d, p, n, m_frac, seed, perturb):
    """Random Gaussian projections of ψ_p (or small perturbations of W*) never go below the tail.

    Perturbed optima are the hard case: their error exceeds the tail only by O(ε²). We allow a
    round-off slack of 1e-10·‖A‖_F² (float64 error of a squared Frobenius norm of size ‖A‖²).
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(n, d, generator=gen, dtype=torch.float64)
    dim = num_poly_features(d, p, symmetric=p > 1 and d > 1)
    m = 1 + int(m_frac * (min(n, dim) - 1))
    best = optimal_sketch(q, k, p, m)
    a = poly_kernel(q, k, p)
    best_q, best_k = best.map_q.w[0], best.map_k.w[0]  # [D, m] of the one head
    if perturb:
        w_q = best_q + 1e-3 * torch.randn(best_q.shape, generator=gen, dtype=torch.float64)
        w_k = best_k + 1e-3 * torch.randn(best_k.shape, generator=gen, dtype=torch.float64)
    else:
        w_q = torch.randn(best_q.shape, generator=gen, dtype=torch.float64)
        w_k = torch.randn(best_k.shape, generator=gen, dtype=torch.float64)
    psi_q = poly_features(q, p, best.map_q.symmetric)
    psi_k = poly_features(k, p, best.map_q.symmetric)
    err = (((psi_q @ w_q) @ (psi_k @ w_k).T - a) ** 2).sum()
    assert err >= best.tail - 1e-10 * (a**2).sum()


def test_fit_sketch_optimal_reports_ratio_one():
    q, k = _qk(2, n_q=40, n_k=40, d=3, seed=9)
    fit = fit_sketch("optimal", q, k, p=2, m=4, holdout=0.25)
    r = fit.report
    assert torch.allclose(r.optimality_ratio, torch.ones(2, dtype=torch.float64), rtol=1e-9, atol=0)
    assert r.holdout_optimality_ratio.shape == (2,) and bool((r.holdout_optimality_ratio >= 1).all())
    assert r.num_features == 4 and r.num_parameters == 2 * 6 * 4 == _parameters_per_head(*fit.maps)
    assert fit.report.info == {} and not hasattr(fit.map_q, "fit_info")  # the report measures its own floor


@pytest.mark.parametrize(
    "args,kwargs,exc,pattern",
    [
        ((torch.ones(5), torch.ones(5, 3), 2, 2), {}, ValueError, r"q must have shape \[\.\.\., n, d\] \(rank >= 2\)"),
        ((torch.ones(5, 3), torch.ones(5, 4), 2, 2), {}, ValueError, r"feature dimension d.*q has d=3, k has d=4"),
        ((torch.ones(2, 5, 3), torch.ones(3, 5, 3), 2, 2), {}, ValueError, r"same leading \(batch\) shape"),
        ((torch.ones(5, 3), torch.ones(5, 3), 0, 2), {}, ValueError, r"p \(the polynomial degree\).*got 0"),
        ((torch.ones(5, 3), torch.ones(5, 3), 2, 0), {}, ValueError, r"m \(the sketch size\).*got 0"),
        ((torch.ones(5, 3), torch.ones(5, 3), 2, 6), {}, ValueError, r"at most min\(n_q, n_k, D\) = min\(5, 5, 6\) = 5.*m=6"),
        ((torch.ones(5, 3), torch.ones(5, 3), 2, 2), {"route": "eig"}, ValueError, r"route must be one of"),
        ((torch.ones(5, 3, dtype=torch.int32), torch.ones(5, 3), 2, 2), {}, TypeError, r"q must have a real floating-point dtype"),
        ((torch.ones(5, 3), torch.ones(0, 3), 2, 2), {}, ValueError, r"k must have n >= 1 tokens"),
    ],
)
def test_bad_input(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        optimal_sketch(*args, **kwargs)
    with pytest.raises(exc, match=pattern):
        tail_bound(*args, **kwargs)


def test_non_finite_input_names_count_and_first_index():
    q = torch.ones(4, 3)
    q[2, 1] = float("nan")
    q[3, 0] = float("inf")
    with pytest.raises(ValueError, match=r"q must be finite: 2 non-finite value\(s\) of 12, the first at index \(2, 1\)"):
        optimal_sketch(q, torch.ones(4, 3), 2, 2)


def test_fit_sketch_rejects_unknown_method_and_bad_holdout():
    q, k = _qk(n_q=10, n_k=10, d=2)
    with pytest.raises(ValueError, match=r"unknown sketch method 'nope'; available: .*optimal"):
        fit_sketch("nope", q, k, p=2, m=2)
    with pytest.raises(ValueError, match=r"holdout must lie in \[0, 1\), got 1.5"):
        fit_sketch("optimal", q, k, p=2, m=2, holdout=1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a valid call warns about nothing
        fit_sketch("optimal", q, k, p=2, m=2, holdout=0.2)
    # checked before any fitting: 10 - ceil(0.5·10) = 5 fitting tokens, D = 3 for d = 2, p = 2
    with pytest.raises(ValueError, match=r"below min\(fitting tokens, D\) = 3 for d=2, p=2.*got m=4"):
        fit_sketch("optimal", q, k, p=2, m=4, holdout=0.5)
    # m == the limit: the tail is exactly 0 and every ratio undefined, so it is rejected too
    with pytest.raises(ValueError, match=r"below min\(fitting tokens, D\) = 3 .*got m=3.*tail is 0"):
        fit_sketch("optimal", q, k, p=2, m=3)
    with pytest.raises(ValueError, match=r"unknown option\(s\) 'rout' for sketch method 'optimal'; it takes: choice, route"):
        fit_sketch("optimal", q, k, p=2, m=2, rout="qr")


def test_new_tokens_get_the_nystrom_extension():
    """n < D: φ*_Q(x)ᵀφ*_K(y) = κ(x, K) A_m⁺ κ(Q, y) for tokens x, y outside the fit (float64)."""
    q, k = _qk(n_q=12, n_k=12, d=4, seed=21)  # D = C(6, 3) = 20 > 12
    x, y = _qk(n_q=5, n_k=6, d=4, seed=22)
    s = optimal_sketch(q, k, 3, 5)
    u, sv, vh = torch.linalg.svd(poly_kernel(q, k, 3))
    a_m_pinv = vh[:5].T @ torch.diag(1 / sv[:5]) @ u[:, :5].T  # [n_k, n_q]
    expected = poly_kernel(x, k, 3) @ a_m_pinv @ poly_kernel(q, y, 3)
    assert torch.allclose(_kernel(s, x, y), expected, rtol=0, atol=1e-10 * expected.abs().max())


def test_full_column_rank_gives_the_pseudo_inverse_solution():
    """n > D: W* is unique, so it equals DESIGN.md's ψ(Q)⁺ U_m Σ_m^{1/2} (float64, well conditioned).

    Singular pairs are defined up to a joint sign flip of (u_i, v_i), which flips column i of both
    W*_Q and W*_K: the product W*_Q W*_Kᵀ is sign-free and is what we compare.
    """
    q, k = _qk(n_q=50, n_k=50, d=3, seed=23)  # D = 6 for p = 2
    s = optimal_sketch(q, k, 2, 4)
    u, sv, vh = torch.linalg.svd(poly_kernel(q, k, 2))
    w_q = torch.linalg.pinv(poly_features(q, 2, True)) @ (u[:, :4] * sv[:4].sqrt())
    w_k = torch.linalg.pinv(poly_features(k, 2, True)) @ (vh[:4].T * sv[:4].sqrt())
    expected = w_q @ w_k.T
    assert torch.allclose(s.map_q.w[0] @ s.map_k.w[0].T, expected, rtol=0, atol=1e-10 * expected.abs().max())


def test_rank_deficient_kernel_keeps_error_equal_to_tail():
    """m above rank A: the zero singular values are cut (no 1/√0), the error stays at the tail (0)."""
    q, k = _qk(n_q=10, n_k=10, d=3, seed=24)
    q = q[:, :1] * torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64)  # queries on one line
    a = poly_kernel(q, k, 2)  # rank 1, while D = 6
    s = optimal_sketch(q, k, 2, 3)
    assert bool(torch.isfinite(s.map_q.w).all() and torch.isfinite(s.map_k.w).all())
    assert ((_kernel(s, q, k) - a) ** 2).sum() <= 1e-24 * (a**2).sum()


def test_gram_route_equals_qr_route():
    # n > D: the Gram route (ψᵀψ summed in blocks, eigh) squares ψ's condition number (≲ 1e3 here),
    # so agreement is ~1e-16·cond² ≈ 1e-10 relative to ‖A‖²: we compare tails relative to ‖A‖² at 1e-9.
    from sketchlab.optimal import optimal_sketch, tail_bound

    q, k = _qk(n_q=60, n_k=50, d=3, seed=31)
    norm = (poly_kernel(q, k, 2) ** 2).sum((-2, -1))
    for m in (2, 4):
        qr, gram = tail_bound(q, k, 2, m, route="qr"), tail_bound(q, k, 2, m, route="gram")
        assert bool(((qr - gram).abs() <= 1e-9 * norm).all())
    opt = optimal_sketch(q, k, 2, 4, route="gram")
    err = ((_kernel(opt, q, k) - poly_kernel(q, k, 2)) ** 2).sum((-2, -1))
    assert bool(((err - opt.tail).abs() <= 1e-9 * norm).all())


@pytest.mark.parametrize("n,route", [(23, "auto"), (24, "gram")])
def test_fit_report_takes_the_gram_route_from_four_tokens_per_feature(n, route, monkeypatch):
    # d = 3, p = 2: D = 6, so 24 tokens are the threshold. Both routes give the same tail (to
    # 1e-9 ‖A‖², as test_gram_route_equals_qr_route); the report records the route it asked for.
    import sketchlab.optimal

    seen = []
    real = sketchlab.optimal._kernel_singular_values
    monkeypatch.setattr(sketchlab.optimal, "_kernel_singular_values",
                        lambda q, k, p, m, route, max_bytes: seen.append(route) or real(q, k, p, m, route, max_bytes))
    q, k = _qk(2, n_q=n, n_k=n, d=3, seed=12)
    fit = fit_sketch("optimal", q, k, p=2, m=3)
    assert seen == [route]
    norm = (poly_kernel(q, k, 2) ** 2).sum((-2, -1))
    assert bool(((fit.report.tail - tail_bound(q, k, 2, 3, route="qr")).abs() <= 1e-9 * norm).all())


def test_fit_report_reuses_the_compressed_fits_kernel_core(monkeypatch):
    # The compressed LLoPS fit already formed R_Q R_Kᵀ (A's singular values): the report takes the
    # floor from it and computes no singular values of its own; the tail equals tail_bound's to
    # round-off of the Gram route (1e-9 ‖A‖², as test_gram_route_equals_qr_route). The sketch keeps no copy.
    import sketchlab.optimal

    def forbidden(*args):
        raise AssertionError("the report recomputed A's singular values")

    q, k = _qk(2, n_q=40, n_k=40, d=3, seed=13)
    monkeypatch.setattr(sketchlab.optimal, "_kernel_singular_values", forbidden)
    fit = fit_sketch("llops", q, k, p=2, m=3, steps=2, lm_steps=1, route="compressed")
    monkeypatch.undo()
    assert fit.report.info["route"] == "compressed" and "kernel_core" not in fit.report.info
    assert not hasattr(fit.map_q, "fit_info")
    norm = (poly_kernel(q, k, 2) ** 2).sum((-2, -1))
    assert bool(((fit.report.tail - tail_bound(q, k, 2, 3, route="qr")).abs() <= 1e-9 * norm).all())
    with_tokens = fit_sketch("llops", q, k, p=2, m=3, steps=2, lm_steps=1, route="compressed", fit_tokens=30)
    assert bool(((with_tokens.report.tail - tail_bound(q, k, 2, 3, route="qr")).abs() <= 1e-9 * norm).all())


def test_min_norm_sketch():
    # n < D: same in-sample kernel as the Nyström optimum; W in the row space of ψ(Q) and of
    # minimum norm among the exact solutions (so no larger than the Nyström W).
    from sketchlab import min_norm_sketch

    q, k = _qk(n_q=12, n_k=12, d=4, seed=22)  # D = C(6, 3) = 20 > 12 for p = 3
    opt, mn = optimal_sketch(q, k, 3, 5), min_norm_sketch(q, k, 3, 5)
    a_opt, a_mn = _kernel(opt, q, k), _kernel(mn, q, k)
    assert torch.allclose(a_mn, a_opt, rtol=0, atol=1e-10 * float(a_opt.abs().max()))
    psi = poly_features(q.double(), 3, True)
    proj = torch.linalg.pinv(psi) @ psi  # projector onto the row space
    mn_q, opt_q = mn.map_q.w[0], opt.map_q.w[0]
    assert torch.allclose(proj @ mn_q, mn_q, atol=1e-9 * float(mn_q.abs().max()))
    assert bool((torch.linalg.matrix_norm(mn_q) <= torch.linalg.matrix_norm(opt_q) * (1 + 1e-12)).all())
    assert not torch.allclose(mn_q, opt_q)  # a different W: the Nyström one is not minimum-norm here
    assert mn.route == opt.route == "svd"  # n <= D: the automatic route is the SVD of A


def test_fit_sketch_optimal_choice_min_norm_is_the_min_norm_sketch():
    # fit_sketch("optimal", choice="min-norm") is min_norm_sketch (its W, not the Nyström one; n < D
    # so the two differ), and an unknown choice is refused
    from sketchlab import fit_sketch, min_norm_sketch

    q, k = _qk(n_q=12, n_k=12, d=4, seed=22)
    fit = fit_sketch("optimal", q, k, p=3, m=5, choice="min-norm", reference=False)
    mn = min_norm_sketch(q, k, 3, 5)
    assert torch.allclose(fit.map_q.w, mn.map_q.w, rtol=0, atol=1e-12 * float(mn.map_q.w.abs().max()))
    assert torch.allclose(fit.map_k.w, mn.map_k.w, rtol=0, atol=1e-12 * float(mn.map_k.w.abs().max()))
    with pytest.raises(ValueError, match="choice must be 'nystrom' or 'min-norm'"):
        fit_sketch("optimal", q, k, p=3, m=5, choice="svd", reference=False)


def test_m_above_the_rank_says_why_in_full():
    q, k = _qk(n_q=5, n_k=5, d=4, seed=0)
    with pytest.raises(ValueError, match=r"got m=6\. Beyond it the tail is 0 and the exact features are already optimal$"):
        optimal_sketch(q, k, 2, 6)


def test_each_route_checks_its_own_memory_before_work():
    # The SVD route holds A and its SVD, 2·n_q·n_k float64 (200 x 200: 640 000 bytes); the QR/Gram routes
    # hold three D x D factors (d = 2, p = 2: D = 3, 216 bytes). Under a 500 000-byte budget only the SVD
    # route is refused, up front, with the kernel's shape and the way out (A alone, 320 000 bytes, would fit:
    # the check counts its SVD too); the Gram route runs and attains the tail.
    q, k = _qk(n_q=200, n_k=200, d=2, seed=5)
    with pytest.raises(ValueError, match=r"the kernel A and its SVD \(1 x 200 x 200 float64\) would take .* over the "
                                         r"memory budget.*use route='gram'"):
        optimal_sketch(q, k, 2, 2, route="svd", max_bytes=500_000)
    with pytest.raises(ValueError, match=r"the kernel A and its SVD"):
        tail_bound(q, k, 2, 2, route="svd", max_bytes=500_000)
    s = optimal_sketch(q, k, 2, 2, route="gram", max_bytes=500_000)
    assert torch.allclose(_sq_err(s, q, k, 2), s.tail, rtol=REL, atol=0)
    # d = 8, p = 4: D = C(11, 4) = 330, three 330 x 330 float64 factors = 2 613 600 bytes
    q, k = _qk(n_q=400, n_k=400, d=8, seed=6)
    with pytest.raises(ValueError, match=r"the 330 x 330 factors of 1 head\(s\) \(float64\) would take .* over the "
                                         r"memory budget.*use a smaller d or p"):
        optimal_sketch(q, k, 4, 2, route="gram", max_bytes=2_000_000)


@pytest.mark.parametrize("args,name", [((0, 4, 2, 2), "n_q"), ((4, 0, 2, 2), "n_k"), ((4, 4, 0, 1), "d"),
                                       ((4, 4, -1, 3), "d"), ((4, 4, 2, 0), "p")])
def test_max_sketch_size_refuses_sizes_below_one(args, name):
    # d = 0 (or p = 0) has no polynomial features: the bound used to say 1 for d = 0, p = 1 and -1 for d = -1, p = 3
    with pytest.raises(ValueError, match=rf"{name}.* must be an integer >= 1, got"):
        max_sketch_size(*args)
    with pytest.raises(TypeError, match=r"d must be an integer >= 1, got 2.0"):
        max_sketch_size(4, 4, 2.0, 2)
    assert [max_sketch_size(9, 7, d, p) for d, p in ((1, 5), (2, 1), (2, 2), (3, 2), (5, 3))] == [1, 2, 3, 6, 7]


def test_optimal_map_naive_twin_and_select_heads():
    """The optimum's float64 twin (ψ written out) equals its fast features per head, and ``select_heads`` of
    one layer of an ``[L, H]`` optimum (``fit.layer``) is that layer's heads (its features)."""
    from sketchlab.featuremaps import batch_features
    from sketchlab.optimal import optimal_sketch

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 12, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 12, 4, generator=gen, dtype=torch.float64)
    opt = optimal_sketch(q, k, p=2, m=5)
    for fmap, x in zip(opt.maps, (q, k)):
        x_heads = x.reshape(6, 12, 4).transpose(0, 1)[None]  # [1, n, L·H, d]
        torch.testing.assert_close(fmap.features_naive(x_heads), fmap.features(x_heads), rtol=1e-12, atol=1e-12)
    one = opt.map_q.select_heads([3, 4, 5])  # layer 1
    torch.testing.assert_close(batch_features(one, q[1]), batch_features(opt.map_q, q)[1], rtol=0, atol=0)
    fit = fit_sketch("optimal", q, k, p=2, m=5)
    layer_q, layer_k = fit.layer(1)
    torch.testing.assert_close(batch_features(layer_k, k[1]), batch_features(opt.map_k, k)[1], rtol=0, atol=0)
    assert float((batch_features(opt.map_k.select_heads([0, 1, 2]), k[1]) - batch_features(opt.map_k, k)[1]).abs().max()) > 1e-6
