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

from sketchlab.attention import llops_attention
from sketchlab.attention._checks import _all_finite, _max_norm, check_qkv


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
        llops_attention(q, k, v, theta, theta, backend="torch")
