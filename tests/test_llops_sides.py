"""The sides of a direct fit (tokens, tensor rows) and the compressed route: every method of
:class:`Tensors` on the tokens' own rank-1 tensors equals :class:`Tokens`; compressed rows keep the
Gram matrix, the loss and the fit's iterates. Float64; tolerances explained where used.
"""

import math

import pytest
import torch

from sketchlab import poly_features, poly_kernel
from sketchlab.llops import fit_llops_direct, llops_features
from sketchlab.llops.fit_als import _als_side
from sketchlab.llops.sides import Tensors, Tokens, _pairs, _token_normal, compress_side, token_normal_naive
from sketchlab.llops.target import KernelTarget, fit_problem


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _data(batch=2, n=30, d=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, d, generator=gen, dtype=torch.float64) + 0.3
    k = torch.randn(batch, n, d, generator=gen, dtype=torch.float64) - 0.2
    return q, k


def _outer_rows(x, p):
    """``x[B, n, d]`` → the rank-1 tensors ``x_n^{⊗p}``, ``[B, n, d**p]`` (the full features)."""
    return poly_features(x, p)


def _theta(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("t,p", [(1, 1), (1, 2), (2, 2), (2, 3)])
def test_tensor_rows_of_the_tokens_equal_the_tokens(t, p):
    # Tensors(x^{⊗p}) is the same side as Tokens(x): features, partials (through jvp / vjp, whose
    # parts differ in form), normal matrices of every factor, ALS block data. Both exact: 1e-12.
    x, _ = _data(n=9)
    d, m = 3, 4
    theta = _theta((2, t, p, d, m), 1)
    tokens, rows = Tokens(x), Tensors(_outer_rows(x, p), d, p)
    assert _rel(rows.features(theta), llops_features(x, theta)) < 1e-12
    (f_tok, o_tok), (f_row, o_row) = tokens.partials(theta), rows.partials(theta)
    assert _rel(f_row, f_tok) < 1e-12
    v, u = _theta(theta.shape, 2), _theta((2, 9, m), 3)
    assert _rel(rows.jvp(o_row, v), tokens.jvp(o_tok, v)) < 1e-12
    assert _rel(rows.vjp(o_row, u), tokens.vjp(o_tok, u)) < 1e-12
    assert _rel(rows.blocks(o_row), tokens.blocks(o_tok)) < 1e-12
    for j in range(p):
        a, b = tokens.factor(theta, j), rows.factor(theta, j)
        assert _rel(b.normal(), a.normal()) < 1e-12
        target, sol = _theta((2, 9), 4 + j), _theta((2, t, d), 6 + j)
        assert _rel(b.rhs(1, target), a.rhs(1, target)) < 1e-12
        assert _rel(b.column(2, sol), a.column(2, sol)) < 1e-12


@pytest.mark.parametrize("t", [1, 2])
def test_token_normal_matches_naive(t, monkeypatch):
    # The packed upper-triangle product (pairs given, or formed in token blocks: here blocks of 3
    # tokens, 11 = 3 + 3 + 3 + 2) against Z_iᵀZ_i formed explicitly.
    x, _ = _data(n=11, d=4)
    others = _theta((2, t, 11, 5), 9)
    slow = token_normal_naive(x, others)
    monkeypatch.setattr("sketchlab.llops.sides._BLOCK_BYTES", 3 * 8 * 10)  # 3 tokens × 10 pairs × 8 bytes
    assert _rel(_token_normal(x, others), slow) < 1e-13
    assert _rel(_token_normal(x, others, _pairs(x)), slow) < 1e-13
    assert _rel(Tokens(x, max_bytes=1).factor(_theta((2, t, 2, 4, 5), 3), 0).normal(),
                Tokens(x).factor(_theta((2, t, 2, 4, 5), 3), 0).normal()) < 1e-13  # uncached pairs


@pytest.mark.parametrize("p,d", [(1, 3), (2, 3), (3, 2), (2, 1)])
def test_compressed_rows_keep_the_gram_matrix(p, d, monkeypatch):
    # RᵀR = ΨᵀΨ in the symmetric basis, and the full-basis rows have the same Gram as the tokens'
    # x^{⊗p}; Cholesky's backward error is ~D·eps·‖G‖: 1e-11 relative. 40 tokens in general
    # position: G is positive definite, so R is its (upper triangular) Cholesky factor. G is
    # summed over token blocks of 7 (40 = 5·7 + 5) in column blocks above its diagonal.
    x, _ = _data(n=40, d=d)
    dim = math.comb(d + p - 1, p)
    monkeypatch.setattr("sketchlab.polynomial._GRAM_BLOCK_BYTES", 7 * 8 * 2 * dim)  # 7 tokens × 2 heads × D × 8 bytes
    side, rows = compress_side(x, p)
    assert rows.shape[-2:] == (dim, dim) and side.rows == dim
    assert torch.equal(rows, rows.triu())
    psi = poly_features(x, p, symmetric=p > 1 and d > 1)
    assert _rel(rows.mT @ rows, psi.mT @ psi) < 1e-11
    full = _outer_rows(x, p)
    assert _rel(side.tensors.mT @ side.tensors, full.mT @ full) < 1e-11


def test_compressed_rows_drop_the_null_space():
    # Tokens in a 2-dimensional subspace of R^3: ψ_2 has rank 3 of D = 6, so Cholesky's pivots
    # fall to round-off and the eigendecomposition keeps 3 rows, with the same Gram matrix.
    x, _ = _data(n=50, d=2)
    x = torch.cat([x, x[..., :1] - x[..., 1:]], -1)  # third coordinate dependent
    side, rows = compress_side(x, 2)
    assert side.rows == 3
    psi = poly_features(x, 2, symmetric=True)
    assert _rel(rows.mT @ rows, psi.mT @ psi) < 1e-11


def test_compressed_target_gives_the_loss_and_products():
    # Loss of any features pair on the compressed rows = the loss on all tokens (same Θ): the
    # problems are equal (Ψ = U R with orthonormal U). Round-off: the eigendecomposition, 1e-10.
    q, k = _data(n=60, d=3)
    side_q, side_k, target = fit_problem(q, k, 2, 4, 1, route="compressed")
    assert target.route == "compressed" and side_q.rows == 6
    dense = KernelTarget(q, k, 2, 4, route="kernel")
    assert _rel(target.sq_norm, dense.sq_norm) < 1e-10
    tq, tk = _theta((2, 1, 2, 3, 4), 5), _theta((2, 1, 2, 3, 4), 6)
    small = target.loss(side_q.features(tq), side_k.features(tk))
    full = dense.loss(llops_features(q, tq), llops_features(k, tk))
    assert _rel(small, full) < 1e-10
    # the Gram matrices of the features (what ALS and LM use) agree too
    fq = side_q.features(tq)
    assert _rel(fq.mT @ fq, llops_features(q, tq).mT @ llops_features(q, tq)) < 1e-10


def test_als_side_on_compressed_rows_equals_tokens():
    # One ALS half-sweep on the compressed rows gives the same Θ as on the tokens: the updates only
    # see sums over rows of bilinear forms in ψ. Normal equations of condition ≲ 1e4: 1e-8.
    q, k = _data(n=60, d=3, seed=3)
    theta_q, theta_k = _theta((2, 1, 2, 3, 4), 1), _theta((2, 1, 2, 3, 4), 2)
    results = []
    for route in ("kernel", "compressed"):
        side_q, side_k, target = fit_problem(q, k, 2, 4, 1, route=route)
        fq, fk = side_q.features(theta_q), side_k.features(theta_k)
        theta = theta_q.clone()
        _als_side(side_q, theta, fq, fk, target.cross(fk), 1e-12)
        results.append(theta)
    assert _rel(results[1], results[0]) < 1e-8
    assert _rel(results[0], theta_q) > 1e-2  # it moved


def test_auto_route_compresses_when_n_is_far_above_d():
    q, k = _data(batch=1, n=2000, d=4)  # D = 10 ≪ n: compressed
    assert fit_problem(q, k, 2, 4, 1)[2].route == "compressed"
    q, k = _data(batch=1, n=30, d=6)  # p = 3: D = 56 > n, tokens
    assert fit_problem(q, k, 3, 4, 1)[2].route == "kernel"
    with pytest.raises(ValueError, match=r"compressed rows of 1 head.*GiB, over the memory budget.*route='kernel'"):
        fit_problem(q, k, 2, 4, 1, route="compressed", max_bytes=1000)


def test_compressed_fit_reaches_the_token_fit():
    # The whole direct fit (init, ALS with extrapolation, LM) on compressed rows against the kernel
    # route on 300 tokens: the same iterates up to round-off amplified over the steps; 1e-6.
    q, k = _data(batch=2, n=300, d=3, seed=4)
    a = fit_llops_direct(q, k, p=2, m=4, steps=3, lm_steps=2, route="kernel", tol=0.0)
    b = fit_llops_direct(q, k, p=2, m=4, steps=3, lm_steps=2, route="compressed", tol=0.0)
    assert b.info["route"] == "compressed"
    err_a = ((llops_features(q, a[0].theta) @ llops_features(k, a[1].theta).mT - poly_kernel(q, k, 2)) ** 2).sum((-2, -1))
    err_b = ((llops_features(q, b[0].theta) @ llops_features(k, b[1].theta).mT - poly_kernel(q, k, 2)) ** 2).sum((-2, -1))
    assert _rel(err_b, err_a) < 1e-6


def test_token_pairs_are_cached_only_within_a_quarter_of_the_budget():
    # the cached products x_{n,d} x_{n,e} (d <= e) are kept exactly when their bytes fit max_bytes // 4
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    need = _pairs(x).numel() * x.element_size()  # 2·5·6 products of 8 bytes = 480
    assert need == 480
    cached = Tokens(x, max_bytes=4 * need)
    assert cached.pairs is not None and torch.equal(cached.pairs, _pairs(x))
    assert Tokens(x, max_bytes=4 * need - 1).pairs is None
