"""The fast paths of the attention input checks (sketchlab.attention._checks).

The finiteness test sums each tensor (one pass) and falls back to the exact ``isfinite`` scan
when the sum is not finite; the kernel-range test takes the largest token norm in float32 and
falls back to float64 outside ``[1e-15, 1e15]``. Both must answer exactly as the slow paths:
these tests put inputs on the edges (a finite tensor whose sum overflows, a non-finite entry,
norms whose squares underflow) and compare.
"""

import math

import pytest
import torch
from attention_calls import run_llops

from sketchlab.attention._checks import _all_finite, check_qkv
from sketchlab.numerics import _max_norm


def _qkv(scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 6, 2, 4, generator=g).to(dtype) * scale for _ in range(3)]


def test_a_finite_tensor_whose_sum_overflows_passes():
    q, k, v = _qkv()
    v[:] = 3e38  # finite in float32; their sum is not
    assert not _all_finite(q, k, v)  # the fast answer defers to the exact scan ...
    check_qkv(q, k, v, causal=True)  # ... which passes


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_a_non_finite_entry_is_named(bad, dtype):
    q, k, v = _qkv(dtype=dtype)
    k[0, 3, 1, 2] = bad
    assert not _all_finite(q, k, v)
    with pytest.raises(ValueError, match=r"^k must be finite: 1 non-finite value\(s\) of 48, the first at index \(0, 3, 1, 2\)"):
        check_qkv(q, k, v, causal=True)


@pytest.mark.parametrize("scale", [1.0, 1e-18, 1e-25, 1e17])
def test_max_norm_bounds_the_exact_norm(scale):
    """Never below the float64 norm, and within 1e-3 of it (float32 path) or equal (fallback)."""
    x = _qkv(scale)[0]
    exact = x.double().norm(dim=-1).amax(dim=(0, 1))
    top = torch.tensor(_max_norm(x, x.norm(dim=-1).amax(dim=(0, 1)).tolist()), dtype=torch.float64)
    assert (top >= exact).all() and (top <= exact * (1 + 2e-3)).all()


def test_underflow_is_still_refused_for_tiny_inputs():
    q, k, v = _qkv(1e-12)
    theta = torch.randn(2, 1, 2, 4, 3, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="underflow"):
        run_llops(q, k, v, theta, theta, backend="torch")


def _verdict(fn):
    """What a check says: ``"ok"``, ``"warn"`` or the start of its error message."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except ValueError as err:
            return str(err)[:40]
    return "warn" if any(issubclass(w.category, RuntimeWarning) for w in caught) else "ok"


def _range_problem(kind, dtype):
    """q, k ``[1, 16, H, D]`` and a base Θ ``[H, 1, 2, D, M]``: random (the bound is loose), or tight: one
    feature, both factors along q = k (φ = ⟨θ, x⟩², so the kernel equals its bound up to the float32 margin)."""
    g = torch.Generator().manual_seed(2)
    if kind == "random":
        q, k = (torch.randn(1, 16, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
        return q.to(dtype), k.to(dtype), torch.randn(2, 1, 2, 4, 3, generator=g, dtype=torch.float64)
    x = torch.zeros(1, 16, 1, 2, dtype=torch.float64)
    x[..., 0] = 1.0
    theta = torch.zeros(1, 1, 2, 2, 1, dtype=torch.float64)
    theta[..., 0, 0] = 1.0
    return x.to(dtype), x.to(dtype), theta


@pytest.mark.parametrize("kind", ["random", "tight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("non_negative", [False, True])
def test_kernel_range_bound_skips_only_what_the_exact_test_passes(kind, dtype, non_negative):
    """check_llops_kernel_range skips the exact overflow test when Θ's cached bounds and the two largest token
    norms prove it cannot fail: over Θ scales from underflow to overflow (a coarse sweep of 10^e, refined
    where the verdict changes, so the narrow warning band between "ok" and an error is met), its verdict
    is the exact test's at every scale, and every kind occurs. The tight problem puts the exact values
    at the bound: a bound that allowed more room than the dtype has would skip a warning or an error."""
    from sketchlab.numerics import _kernel_range_exact, check_llops_kernel_range

    q, k, base = _range_problem(kind, dtype)
    nq, nk = q.norm(dim=-1), k.norm(dim=-1)

    def verdicts(e):
        theta = (base * 10 ** e).to(dtype)
        fast = _verdict(lambda: check_llops_kernel_range(q, k, theta, theta, non_negative=non_negative))
        if "underflow" in fast:  # decided from the bound before either overflow test
            return fast, fast
        return fast, _verdict(lambda: _kernel_range_exact(q, k, theta, theta, nq, nk, non_negative=non_negative))

    info = torch.finfo(dtype)  # kernel values scale as θ⁴ (θ⁸ self-tensored): these bounds pass both edges
    coarse = torch.arange(math.log10(info.tiny) / 2 - 1, math.log10(info.max) / 3, 0.5).tolist()
    seen = [verdicts(e) for e in coarse]
    for (a, (fa, _)), (b, (fb, _)) in zip(zip(coarse, seen), zip(coarse[1:], seen[1:])):
        if fa != fb:
            seen += [verdicts(a + i * 0.01) for i in range(1, 50)]
    for fast, exact in seen:
        assert fast == exact, (fast, exact)
    kinds = {"underflow" if "underflow" in f else f if f in ("ok", "warn") else "error" for f, _ in seen}
    assert kinds == {"underflow", "ok", "warn", "error"}, kinds


def test_kernel_range_bounds_each_factor_not_only_their_product():
    """One factor ⟨θ₁, q⟩ ~ 1e39 overflows float32 while the kernel is ~1 (the other factor and the keys are
    tiny): the bound on the product alone would pass it; the factor bound sends it to the exact test."""
    from sketchlab.numerics import check_llops_kernel_range

    theta = torch.zeros(1, 1, 2, 2, 1)
    theta[0, 0, 0, 0, 0], theta[0, 0, 1, 0, 0] = 1e19, 1e-25
    q, k = torch.zeros(1, 3, 1, 2), torch.zeros(1, 3, 1, 2)
    q[..., 0], k[..., 0] = 1e20, 1e-14
    with pytest.raises(ValueError, match=r"theta_q with q overflows torch.float32: the features of the largest token"):
        check_llops_kernel_range(q, k, theta, theta)


def test_theta_made_in_inference_mode_is_checked_every_call():
    """An inference tensor has no in-place version to cache a verdict by: Θ's checks and its flat copy
    run every call instead of raising (issue 34); a non-finite Θ is still named."""
    with torch.inference_mode():
        th = torch.randn(2, 1, 2, 8, 4, generator=torch.Generator().manual_seed(0)) / 3
        x = torch.randn(1, 5, 2, 8, generator=torch.Generator().manual_seed(1))
        want = run_llops(x, x, x, th, th, backend="torch")
        assert torch.equal(run_llops(x, x, x, th, th, backend="torch"), want)
        bad = th.clone()
        bad[0, 0, 0, 0, 0] = float("nan")
        with pytest.raises(ValueError, match="theta_q must be finite"):
            run_llops(x, x, x, bad, th, backend="torch")
