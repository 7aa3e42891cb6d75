"""Exact polynomial features against the kernel and against their naive float64 twin.

Tolerances (float64, eps = 2.2e-16): a degree-p kernel value is a sum of ~d^p products of p
factors; with |x_i| ~ 1 the round-off of that sum is bounded by ~ p·d^p·eps·max|term|, far below
1e-12 relative for the sizes used here (d^p <= 4^5 = 1024). We assert 1e-12 relative to the
largest kernel entry.
"""

import math

import pytest
import torch

from sketchlab import (
    feature_gram_root,
    full_to_symmetric,
    num_poly_features,
    poly_features,
    poly_features_naive,
    poly_kernel,
    symmetric_index,
    symmetric_to_full,
)

RTOL64 = 1e-12


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _assert_close(actual, expected, rtol=RTOL64):
    scale = expected.abs().max().clamp_min(1e-300)
    err = (actual - expected).abs().max() / scale
    assert err <= rtol, f"relative max error {err:.3e} > {rtol:.1e}"


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("symmetric", [False, True])
def test_inner_products_equal_kernel(p, symmetric):
    x, y = _rand(6, 4, seed=1), _rand(5, 4, seed=2)
    gram = poly_features(x, p, symmetric) @ poly_features(y, p, symmetric).T
    _assert_close(gram, poly_kernel(x, y, p))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("symmetric", [False, True])
def test_fast_matches_naive_twin(p, symmetric):
    x = _rand(5, 3, seed=3)
    _assert_close(poly_features(x, p, symmetric), poly_features_naive(x, p, symmetric))


@pytest.mark.parametrize("d,p", [(1, 3), (3, 1), (4, 3), (7, 2)])
def test_feature_counts(d, p):
    x = _rand(2, d)
    assert poly_features(x, p).shape == (2, d**p)
    assert poly_features(x, p, symmetric=True).shape == (2, math.comb(d + p - 1, p))
    assert num_poly_features(d, p, True) == math.comb(d + p - 1, p)


def test_full_coordinates_are_row_major_tuples():
    x = _rand(3, 4, seed=4)
    psi = poly_features(x, 3).reshape(3, 4, 4, 4)  # [n, d, d, d]
    # exact: a product of three float64 numbers computed in the same order both ways
    assert torch.equal(psi[:, 1, 3, 2], x[:, 1] * x[:, 3] * x[:, 2])


def test_symmetric_weights_are_sqrt_multinomials():
    index, weight = symmetric_index(3, 4)
    for row, w in zip(index.tolist(), weight.tolist()):
        counts = [row.count(i) for i in set(row)]
        c = math.factorial(4) // math.prod(math.factorial(k) for k in counts)
        assert w == pytest.approx(math.sqrt(c), rel=1e-15)
    # Σ_α c_α = d^p: every tuple belongs to exactly one multiset
    assert (weight**2).sum().item() == pytest.approx(3**4, rel=1e-14)


def test_batched_leading_dims():
    x = _rand(2, 3, 5, 4, seed=5)
    out = poly_features(x, 2, symmetric=True)
    assert out.shape == (2, 3, 5, 10)
    _assert_close(out[1, 2], poly_features(x[1, 2], 2, symmetric=True))
    k = poly_kernel(x, x, 3)
    _assert_close(k[0, 1], poly_kernel(x[0, 1], x[0, 1], 3))


@pytest.mark.parametrize("p", [2, 3])
def test_symmetric_full_basis_maps(p):
    d, m = 4, 5
    x = _rand(7, d, seed=6)
    w_sym = _rand(num_poly_features(d, p, True), m, seed=7)
    w_full = symmetric_to_full(w_sym, d, p)
    _assert_close(poly_features(x, p) @ w_full, poly_features(x, p, True) @ w_sym)
    # the map is an isometry and full_to_symmetric inverts it
    assert torch.linalg.norm(w_full).item() == pytest.approx(torch.linalg.norm(w_sym).item(), rel=1e-13)
    _assert_close(full_to_symmetric(w_full, d, p), w_sym)
    # any full-basis W (not symmetric) maps to symmetric W with the same features
    w_any = _rand(d**p, m, seed=8)
    _assert_close(poly_features(x, p, True) @ full_to_symmetric(w_any, d, p), poly_features(x, p) @ w_any)


def test_memory_budget_error_names_size_budget_and_way_out():
    x = torch.zeros(100, 32)
    with pytest.raises(ValueError, match=r"GiB.*budget.*symmetric=True"):
        poly_features(x, 4, max_bytes=2**20)
    with pytest.raises(ValueError, match=r"smaller d or p"):
        poly_features(x, 4, symmetric=True, max_bytes=2**10)


@pytest.mark.parametrize(
    "call,exc,pattern",
    [
        (lambda: poly_features(torch.ones(3, 2), 0), ValueError, r"p \(the polynomial degree\).*got 0"),
        (lambda: poly_features(torch.ones(3, 2), 2.0), TypeError, r"integer"),
        (lambda: poly_features(torch.ones(3, 2, dtype=torch.int64), 2), TypeError, r"floating-point dtype.*int64"),
        (lambda: poly_features([1.0, 2.0], 2), TypeError, r"torch.Tensor or numpy array.*list"),
        (lambda: poly_features(torch.ones(3, 0), 2), ValueError, r"d >= 1"),
        (lambda: poly_kernel(torch.ones(3, 2), torch.ones(3, 4), 2), ValueError, r"share d"),
        (lambda: symmetric_to_full(torch.ones(5, 2), 3, 2), ValueError, r"C\(d\+p-1, p\)=6"),
    ],
)
def test_bad_input(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


# ------------------------------------------------------------------------------------------------
# error paths and dtype/budget details (each assert distinguishes a mutant that passed the suite)


def test_messages_name_the_argument_and_the_shapes():
    with pytest.raises(ValueError, match=r"^d must be an integer >= 1, got 0"):
        num_poly_features(0, 2)
    assert num_poly_features(3, 2) == 9 and num_poly_features(3, 2, True) == 6  # full is the default
    with pytest.raises(TypeError, match=r"^x must have a real floating-point dtype"):
        poly_features(torch.ones(2, 3, dtype=torch.int64), 2)
    with pytest.raises(TypeError, match=r"^x must have a real floating-point dtype"):
        poly_features_naive(torch.ones(2, 3, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"^x must be finite: 1 non-finite"):
        poly_features(torch.tensor([[1.0, float("nan")]]), 2)
    with pytest.raises(ValueError, match=r"q has 3, k has 4"):
        poly_kernel(torch.ones(5, 3), torch.ones(5, 4), 2)
    with pytest.raises(ValueError, match=r"broadcastable leading \(batch\) axes, got \(2,\) and \(3,\)"):
        poly_kernel(torch.ones(2, 5, 3), torch.ones(3, 5, 3), 2)
    with pytest.raises(ValueError, match=r"w must have shape \[\.\.\., d\*\*p=9, m\]"):
        full_to_symmetric(torch.ones(10, 2, dtype=torch.float64), 3, 2)


def test_kernel_budget_counts_the_broadcast_batch_and_meta_passes():
    q, k = torch.ones(2, 5, 3), torch.ones(5, 3)
    assert poly_kernel(q, k, 2, max_bytes=2 * 5 * 5 * 4).shape == (2, 5, 5)  # exactly the budget
    with pytest.raises(ValueError, match=r"shape \(2, 5, 5\)"):
        poly_kernel(q, k, 2, max_bytes=2 * 5 * 5 * 4 - 1)  # q's batch axis counts
    meta = torch.empty(4, 6, 3, device="meta")
    assert poly_kernel(meta, meta, 3).shape == (4, 6, 6)  # shapes only: nothing to check


def test_basis_maps_keep_the_dtype():
    w = torch.randn(6, 2, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    assert symmetric_to_full(w, 3, 2).dtype == torch.float32
    assert full_to_symmetric(symmetric_to_full(w, 3, 2), 3, 2).dtype == torch.float32


def test_symmetric_weights_beyond_the_dtype_are_reported():
    # p = 600, d = 2: the largest weight √C(600, 300) ≈ 1e90 exceeds float32 (3.4e38) but not float64.
    x = torch.full((1, 2), 0.01)
    with pytest.raises(FloatingPointError, match=r"multinomial weights √\(p!/∏α_i!\) reach 1e90, beyond torch.float32"):
        poly_features(x, 600, symmetric=True)
    assert poly_features(x.double(), 600, symmetric=True).shape == (1, 601)


def test_way_outs_and_names_in_messages():
    with pytest.raises(ValueError, match=r"; use smaller d or p, or fewer rows, or raise max_bytes"):
        poly_features(torch.ones(2, 3), 3, symmetric=True, max_bytes=8)  # no 'use symmetric=True' advice here
    with pytest.raises(ValueError, match=r"use symmetric=True \(10 features instead of 27\)"):
        poly_features(torch.ones(2, 3), 3, max_bytes=8)
    with pytest.raises(ValueError, match=r"; use fewer tokens or heads at a time, or raise max_bytes"):
        poly_kernel(torch.ones(5, 3), torch.ones(5, 3), 2, max_bytes=8)
    with pytest.raises(FloatingPointError, match=r"scale q and k down \(e\.g\. scale='sqrt-d' or a smaller factor, "
                                                  r"so that \|qᵀk\| stays near 1\), lower p, or use float64$"):
        poly_kernel(torch.full((2, 2), 1e3), torch.full((2, 2), 1e3), 20)
    with pytest.raises(FloatingPointError, match=r"lower p or use float64$"):
        poly_features(torch.full((1, 2), 0.01), 600, symmetric=True)
    for fn in (symmetric_to_full, full_to_symmetric):
        with pytest.raises(TypeError, match=r"^w must have a real floating-point dtype"):
            fn(torch.ones(9, 2, dtype=torch.int64), 3, 2)
    with pytest.raises(ValueError, match=r"^d must be an integer >= 1, got 0"):
        symmetric_index(0, 2)


@pytest.mark.parametrize("p,symmetric,rows", [(1, False, 3), (2, True, 6), (3, True, 10), (2, False, 6)])
def test_feature_gram_root_keeps_the_gram_matrix(p, symmetric, rows, monkeypatch):
    # RᵀR = ψᵀψ (ψ from the naive twin) for every head of a [2, 3] batch, summed over token blocks
    # of 7 (40 = 5·7 + 5). 40 tokens in general position in d = 3: with the symmetric basis (and
    # p = 1) G is positive definite, so R is its upper-triangular Cholesky factor; the full basis
    # of p = 2 repeats x_a x_b as x_b x_a (rank 6 of 9), so the eigendecomposition keeps 6 rows.
    # Backward error ~D·eps·‖G‖: 1e-11.
    x = _rand(2, 3, 40, 3, seed=4)
    dim = num_poly_features(3, p, symmetric)
    monkeypatch.setattr("sketchlab.polynomial._GRAM_BLOCK_BYTES", 7 * 8 * 6 * dim)  # 7 tokens × 6 heads × D × 8 bytes
    root = feature_gram_root(x, p, symmetric)
    assert root.shape == (2, 3, rows, dim) and torch.equal(root, root.triu()) is (rows == dim)
    for i in range(2):
        for j in range(3):
            psi = poly_features_naive(x[i, j], p, symmetric)
            _assert_close(root[i, j].mT @ root[i, j], psi.mT @ psi, 1e-11)


def test_feature_gram_root_drops_the_null_space_and_rejects_overflow():
    # Tokens in a 2-dimensional subspace of R^3: ψ_2 (symmetric, D = 6) has rank 3, so Cholesky's
    # pivots fall to round-off and the eigendecomposition keeps 3 rows with the same Gram matrix.
    x = _rand(50, 2, seed=5)
    x = torch.cat([x, x[:, :1] - x[:, 1:]], -1)
    root = feature_gram_root(x, 2, True)
    psi = poly_features_naive(x, 2, True)
    assert root.shape == (3, 6)
    _assert_close(root.mT @ root, psi.mT @ psi, 1e-11)
    with pytest.raises(FloatingPointError, match=r"ψ_2\(x\)ᵀψ_2\(x\) overflows float64 for 1 head\(s\) \(first flattened batch index 1\)"):
        feature_gram_root(torch.stack([x, x * 1e80]), 2, True)
    with pytest.raises(ValueError, match=r"Gram matrix of ψ_2.*over the memory budget.*fewer heads"):
        feature_gram_root(x, 2, True, max_bytes=100)
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., n, d\]"):
        feature_gram_root(x[0], 2)


def test_basis_maps_keep_the_device_of_w():
    # every tensor the maps build goes to w's device: on the "meta" device (shapes only, no data) a
    # helper tensor left on the CPU fails ("not on the expected device"), as it would on a GPU
    from sketchlab.polynomial import full_to_symmetric, symmetric_to_full

    for d, p in [(3, 2), (2, 3)]:
        full = torch.empty(4, d**p, 5, dtype=torch.float64, device="meta")
        sym = full_to_symmetric(full, d, p)
        assert sym.device.type == "meta" and sym.shape == (4, math.comb(d + p - 1, p), 5)
        back = symmetric_to_full(sym, d, p)
        assert back.device.type == "meta" and back.shape == full.shape
