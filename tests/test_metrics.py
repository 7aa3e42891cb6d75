"""Metrics against their definitions, written out with explicit loops (float64)."""

import math

import pytest
import torch

from sketchlab import attention_error, causal_attention, holdout_split, optimality_ratio, rel_fro, rel_mae
from sketchlab.numerics import ROUNDOFF


def _pair(seed=0):
    gen = torch.Generator().manual_seed(seed)
    exact = torch.randn(2, 3, 6, 5, generator=gen, dtype=torch.float64)
    return exact + 0.1 * torch.randn(2, 3, 6, 5, generator=gen, dtype=torch.float64), exact


def test_definitions_per_batch_entry():
    approx, exact = _pair()
    mae, fro = rel_mae(approx, exact), rel_fro(approx, exact)
    assert mae.shape == fro.shape == (2, 3)
    for l in range(2):
        for h in range(3):
            a, e = approx[l, h].flatten().tolist(), exact[l, h].flatten().tolist()
            num = sum(abs(x - y) for x, y in zip(a, e))
            den = sum(abs(y) for y in e)
            assert mae[l, h].item() == pytest.approx(num / den, rel=1e-13)
            fro_num = sum((x - y) ** 2 for x, y in zip(a, e)) ** 0.5
            fro_den = sum(y**2 for y in e) ** 0.5
            assert fro[l, h].item() == pytest.approx(fro_num / fro_den, rel=1e-13)


def test_optimality_ratio():
    approx, exact = _pair(1)
    tail = torch.full((2, 3), 0.25, dtype=torch.float64)
    ratio = optimality_ratio(approx, exact, tail)
    assert torch.allclose(ratio, torch.linalg.matrix_norm(approx - exact) / 0.5, rtol=1e-14, atol=0)
    # a zero tail, or one below round-off relative to ‖A‖², makes the ratio undefined: NaN, never 1e114
    assert math.isnan(optimality_ratio(exact[0, 0], exact[0, 0], 0.0).item())
    assert math.isnan(optimality_ratio(approx[0, 0], exact[0, 0], 0.0).item())
    norm = float((exact[0, 0] ** 2).sum())
    n = max(exact.shape[-2:])
    floor = (ROUNDOFF * n * torch.finfo(torch.float64).eps) ** 2 * norm
    assert math.isnan(optimality_ratio(approx[0, 0], exact[0, 0], 0.99 * floor).item())  # the constant-q case: tail 2.5e-256
    assert math.isfinite(optimality_ratio(approx[0, 0], exact[0, 0], 1.01 * floor).item())
    with pytest.raises(ValueError, match=r"tail must be non-negative \(not NaN\) with the batch shape \(2, 3\), got shape \(3,\)"):
        optimality_ratio(approx, exact, torch.ones(3))


def test_causal_attention_matches_loop():
    gen = torch.Generator().manual_seed(2)
    kern = torch.rand(5, 5, generator=gen, dtype=torch.float64)
    v = torch.randn(5, 2, generator=gen, dtype=torch.float64)
    out = causal_attention(kern, v, eps=1e-3)
    for i in range(5):
        num = sum(kern[i, j] * v[j] for j in range(i + 1))
        den = sum(kern[i, j] for j in range(i + 1)) + 1e-3
        assert torch.allclose(out[i], num / den, rtol=1e-14, atol=0)
    assert attention_error(kern, kern, v).item() == 0.0
    # a non-uniform perturbation: the error equals ‖O(Â) − O(A)‖_F / ‖O(A)‖_F written out by hand
    approx = kern * torch.linspace(0.5, 1.5, 5, dtype=torch.float64)[None, :]
    out_hat = torch.stack([sum(approx[i, j] * v[j] for j in range(i + 1)) / (sum(approx[i, : i + 1]) + 1e-6)
                           for i in range(5)])
    out = torch.stack([sum(kern[i, j] * v[j] for j in range(i + 1)) / (sum(kern[i, : i + 1]) + 1e-6) for i in range(5)])
    expected = torch.linalg.norm(out_hat - out) / torch.linalg.norm(out)
    assert attention_error(approx, kern, v).item() == pytest.approx(expected.item(), rel=1e-12)
    assert expected.item() > 1e-3  # the perturbation is not a rescaling the normaliser cancels


def test_shape_and_value_errors():
    with pytest.raises(ValueError, match=r"same shape"):
        rel_mae(torch.ones(3, 3), torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"kernel must be \[\.\.\., n, n\]"):
        causal_attention(torch.ones(3, 4), torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"kernel must be \[\.\.\., n, n\]"):
        causal_attention(torch.ones(3), torch.ones(3))
    exact = torch.ones(2, 3, 3)
    exact[1] = 0
    with pytest.raises(ValueError, match=r"exact must not be all zeros.*1 zero.*batch index \(1,\)"):
        rel_fro(torch.ones(2, 3, 3), exact)
    with pytest.raises(ValueError, match=r"tail must be non-negative \(not NaN\).*minimum nan"):
        optimality_ratio(torch.ones(3, 3), 2 * torch.ones(3, 3), float("nan"))


def test_holdout_split_is_a_seeded_partition():
    fit, held = holdout_split(20, 0.25, seed=3)
    assert len(held) == 5 and len(fit) == 15
    assert sorted(fit.tolist() + held.tolist()) == list(range(20))
    again = holdout_split(20, 0.25, seed=3)
    assert torch.equal(fit, again[0]) and torch.equal(held, again[1])
    assert not torch.equal(held, holdout_split(20, 0.25, seed=4)[1])
    assert len(holdout_split(20, 0.0, seed=0)[1]) == 0


# ------------------------------------------------------------------------------------------------
# details that a mutation run found unchecked: names in messages, eps, batch axes, dtypes


def test_metric_messages_name_the_argument():
    a = torch.ones(3, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"^approx must have a real floating-point dtype"):
        rel_fro(torch.ones(3, 3, dtype=torch.int64), a)
    with pytest.raises(TypeError, match=r"^exact must have a real floating-point dtype"):
        rel_fro(a, torch.ones(3, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"^v must have a real floating-point dtype"):
        causal_attention(a, torch.ones(3, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"got shape \(0,\) with minimum None"):
        optimality_ratio(a, a, torch.tensor([]))


def test_causal_attention_eps_batches_and_dtypes():
    # the normaliser's row sums are 1e-3, so eps = 1e-6 changes the output by 1e-3 relative
    kernel = torch.full((2, 5, 3, 3), 1e-3 / 3, dtype=torch.float64)
    v = torch.arange(90, dtype=torch.float64).reshape(2, 5, 3, 3)
    masked = kernel.tril()
    want = (masked @ v) / (masked.sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(causal_attention(kernel, v), want, rtol=1e-14, atol=0)  # 4-D batch, default eps
    torch.testing.assert_close(causal_attention(kernel[0], v[0]), want[0], rtol=1e-14, atol=0)  # 3-D batch
    out32 = causal_attention(kernel[0, 0], v[0, 0].float())  # float32 v is compared in float64
    assert out32.dtype == torch.float64
    torch.testing.assert_close(out32, want[0, 0], rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=r"kernel must be \[\.\.\., n, n\]"):
        causal_attention(torch.ones(3, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"kernel must be \[\.\.\., n, n\]"):
        causal_attention(torch.ones(2, 3, 4, dtype=torch.float64), torch.ones(2, 4, 1, dtype=torch.float64))
    # the same eps on both sides: identical kernels give zero error whatever eps is
    assert float(attention_error(kernel[0, 0], kernel[0, 0], v[0, 0], eps=0.5)) == 0.0


def test_optimality_ratio_keeps_a_python_tail_in_float64():
    a = torch.eye(3, dtype=torch.float64)
    approx = a * 2  # error ‖A‖_F = √3
    ratio = optimality_ratio(approx, a, 1 / 3)  # float32 would round 1/3 at 3e-8
    assert abs(float(ratio) - 3.0) <= 1e-15 * 3
def test_kernel_errors_in_row_blocks_equal_the_dense_form():
    # Row blocks (forced tiny by max_bytes: one query row per block) against the dense metrics:
    # the same sums in another order, so equal to ~1e-15; we allow 1e-10 (the criterion).
    from sketchlab import LLoPSMap, kernel_errors, llops_features, poly_kernel
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 17, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 23, 4, generator=gen, dtype=torch.float64)
    theta_q, theta_k = (torch.randn(2, 3, 1, 2, 4, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    maps = tuple(LLoPSMap(6, 4, theta=t.reshape(6, 1, 2, 4, 5)) for t in (theta_q, theta_k))  # layer l, head j: l·3 + j
    approx, exact = llops_features(q, theta_q) @ llops_features(k, theta_k).mT, poly_kernel(q, k, 2)
    for budget in (2**30, 4 * 2 * 3 * 23 * 8):  # default, and exactly one row per block
        err = kernel_errors(maps, q, k, 2, max_bytes=budget)
        assert torch.allclose(err["rel_fro"], rel_fro(approx, exact), rtol=1e-10, atol=0)
        assert torch.allclose(err["rel_mae"], rel_mae(approx, exact), rtol=1e-10, atol=0)
        assert torch.allclose(err["sq_norm"], (exact**2).sum((-2, -1)), rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match="one kernel row block"):
        kernel_errors(maps, q, k, 2, max_bytes=100)
    zero = q.clone()
    zero[1, 2] = 0.0
    with pytest.raises(ValueError, match=r"all zeros for 1 head\(s\), the first at batch index \(1, 2\)"):
        kernel_errors(maps, zero, k, 2)
@pytest.mark.parametrize("n,d,p", [(300, 2, 2), (20, 3, 3)])
def test_kernel_sq_norm_routes(n, d, p):
    # (300, 2, 2) takes the degree-2p moment route (32·(n_q+n_k)·C(5,4) < n²d), (20, 3, 3) the row
    # blocks; both must equal Σ A² (cancellation-free sums of positive terms in the dense form;
    # the moment route's signed sums lose ≲ 1e-13 relative here): 1e-10.
    from sketchlab import kernel_sq_norm, poly_kernel
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, n, d, generator=gen, dtype=torch.float64) + 0.5
    k = torch.randn(2, n, d, generator=gen, dtype=torch.float64)
    dense = (poly_kernel(q, k, p) ** 2).sum((-2, -1))
    assert torch.allclose(kernel_sq_norm(q, k, p), dense, rtol=1e-10, atol=0)
    assert torch.allclose(kernel_sq_norm(q, k, p, max_bytes=4096), dense, rtol=1e-10, atol=0)  # other route/blocks


def test_holdout_split_names_an_out_of_range_seed():
    with pytest.raises(ValueError, match=r"seed must lie in \[-2\*\*63, 2\*\*64 - 1\].*got 18446744073709551616"):
        holdout_split(10, 0.2, seed=2**64)
    with pytest.raises(TypeError, match="seed must be an int"):
        holdout_split(10, 0.2, seed=1.5)
