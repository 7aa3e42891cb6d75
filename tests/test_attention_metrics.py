"""metrics.causal_attention / attention_error: one implementation with the attention package, and
causal masks that never cross the sequences a dump joins (float64, 1e-12: same sums, same order)."""

import pytest
import torch

import sketchlab as sl
from sketchlab.attention.reference import kernel_attention_naive


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_causal_attention_is_the_attention_package_definition():
    kern, v = _rand(2, 9, 9, seed=1).abs(), _rand(2, 9, 3, seed=2)
    for normalize in ("sum", "none"):
        assert torch.equal(sl.causal_attention(kern, v, normalize=normalize),
                           kernel_attention_naive(kern, v, causal=True, normalize=normalize))


def test_segments_keep_each_sequence_alone():
    kern, v = _rand(9, 9, seed=3).abs(), _rand(9, 2, seed=4)
    out = sl.causal_attention(kern, v, segments=[4, 5])
    first = sl.causal_attention(kern[:4, :4], v[:4])
    second = sl.causal_attention(kern[4:, 4:], v[4:])
    assert torch.allclose(out, torch.cat([first, second]), atol=1e-12, rtol=0)
    assert not torch.allclose(out[4:], sl.causal_attention(kern, v)[4:], atol=1e-3)  # the mask matters


def test_attention_error_with_segments_and_normalisation():
    exact, v = _rand(2, 8, 8, seed=5).abs(), _rand(2, 8, 3, seed=6)
    approx = exact + 0.1 * _rand(2, 8, 8, seed=7)
    for normalize in ("sum", "none"):
        err = sl.attention_error(approx, exact, v, normalize=normalize, segments=4)
        o_hat = sl.causal_attention(approx, v, normalize=normalize, segments=[4, 4])
        o = sl.causal_attention(exact, v, normalize=normalize, segments=[4, 4])
        expected = torch.linalg.matrix_norm(o_hat - o) / torch.linalg.matrix_norm(o)
        assert torch.allclose(err, expected, atol=1e-12, rtol=0)
        assert err.shape == (2,) and bool((err > 0).all())
    with pytest.raises(ValueError, match="segments"):
        sl.attention_error(approx, exact, v, segments=3)
    with pytest.raises(ValueError, match="square"):
        sl.causal_attention(torch.ones(3, 4), torch.ones(4, 2))
