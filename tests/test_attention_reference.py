"""The naive float64 attention twins against hand-written loops and exact identities.

Tolerances: everything here is float64 arithmetic on O(1) numbers with at most a few hundred
terms per sum, so two formulas of the same quantity agree to ~1e-13; 1e-10 leaves three orders
of margin and still fails on any real error (which is O(1e-2) or larger).
"""

import math

import pytest
import torch
from attention_calls import run_chunked, run_llops_naive

import sketchlab as sl
from sketchlab.attention import (
    attention_mask,
    poly_attention_naive,
    softmax_attention_naive,
)
from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.attention.reference import kernel_attention_naive
from sketchlab.polynomial import self_tensor

TOL = 1e-10


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _loop_attention(phi_q, phi_k, v, causal, normalize, eps, segments=None):
    """Token-by-token sums, written out: out[b, t, h] = Σ_s a_ts v_s (/ (Σ_s a_ts + eps))."""
    B, T, H, _ = phi_q.shape
    S = phi_k.shape[1]
    seg = [0] * T if segments is None else [i for i, n in enumerate(segments) for _ in range(n)]
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                num = torch.zeros(v.shape[-1], dtype=torch.float64)
                den = 0.0
                for s in range(S):
                    if (causal and s > t) or (segments is not None and seg[s] != seg[t]):
                        continue
                    a = float(phi_q[b, t, h] @ phi_k[b, s, h])
                    num = num + a * v[b, s, h]
                    den += a
                out[b, t, h] = num / (den + eps) if normalize == "sum" else num
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("normalize", ["none", "sum"])
def test_feature_attention_naive_matches_loops(causal, normalize):
    phi_q, phi_k, v = _rand(2, 7, 2, 5, seed=1), _rand(2, 7, 2, 5, seed=2), _rand(2, 7, 2, 3, seed=3)
    phi_q, phi_k = phi_q.abs(), phi_k.abs()  # positive scores: the "sum" normaliser is well defined
    out = feature_attention_naive(phi_q, phi_k, v, causal=causal, normalize=normalize, eps=1e-3)
    expected = _loop_attention(phi_q, phi_k, v, causal, normalize, 1e-3)
    assert out.shape == (2, 7, 2, 3) and out.dtype == torch.float64
    assert torch.allclose(out, expected, atol=TOL, rtol=0)


def test_non_causal_with_more_keys():
    phi_q, phi_k, v = _rand(1, 3, 2, 4, seed=4).abs(), _rand(1, 6, 2, 4, seed=5).abs(), _rand(1, 6, 2, 2, seed=6)
    out = feature_attention_naive(phi_q, phi_k, v, causal=False, normalize="sum")
    assert torch.allclose(out, _loop_attention(phi_q, phi_k, v, False, "sum", 1e-6), atol=TOL, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_segments_never_cross(causal):
    """Joined sequences with segments == each sequence attended on its own."""
    phi_q, phi_k, v = _rand(1, 9, 2, 4, seed=7).abs(), _rand(1, 9, 2, 4, seed=8).abs(), _rand(1, 9, 2, 3, seed=9)
    segments = [4, 5]
    out = feature_attention_naive(phi_q, phi_k, v, causal=causal, segments=segments)
    first = feature_attention_naive(phi_q[:, :4], phi_k[:, :4], v[:, :4], causal=causal)
    second = feature_attention_naive(phi_q[:, 4:], phi_k[:, 4:], v[:, 4:], causal=causal)
    assert torch.allclose(out, torch.cat([first, second], 1), atol=TOL, rtol=0)
    assert torch.allclose(out, _loop_attention(phi_q, phi_k, v, causal, "sum", 1e-6, segments), atol=TOL, rtol=0)
    # an int is the length of equal segments
    assert torch.equal(attention_mask(6, 6, causal=True, segments=3), attention_mask(6, 6, causal=True, segments=[3, 3]))
    # the mask really differs from the unsegmented one (the test above is not vacuous)
    assert not torch.allclose(out, feature_attention_naive(phi_q, phi_k, v, causal=causal), atol=1e-3)


def test_self_tensor_kernel_is_the_square():
    phi_q, phi_k = _rand(5, 6, seed=10), _rand(4, 6, seed=11)
    st_q, st_k = self_tensor(phi_q), self_tensor(phi_k)
    assert st_q.shape == (5, 36)
    assert torch.allclose(st_q @ st_k.T, (phi_q @ phi_k.T) ** 2, atol=TOL, rtol=0)


def test_non_negative_attention_uses_squared_scores():
    phi_q, phi_k, v = _rand(2, 6, 2, 3, seed=12), _rand(2, 6, 2, 3, seed=13), _rand(2, 6, 2, 2, seed=14)
    out = feature_attention_naive(phi_q, phi_k, v, non_negative=True)
    scores = (phi_q.transpose(1, 2) @ phi_k.transpose(1, 2).mT) ** 2  # [B, H, T, S]
    expected = kernel_attention_naive(scores, v.transpose(1, 2)).transpose(1, 2)
    assert torch.allclose(out, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("normalize", ["none", "sum"])
def test_poly_attention_is_attention_through_exact_features(p, normalize):
    """(q·k)^p = ψ_p(q)·ψ_p(k): exact polynomial attention equals attention through ψ_p."""
    q, k, v = _rand(2, 8, 3, 4, seed=20), _rand(2, 8, 3, 4, seed=21), _rand(2, 8, 3, 5, seed=22)
    out = poly_attention_naive(q, k, v, p, normalize=normalize, eps=0.5)
    via_features = feature_attention_naive(sl.poly_features(q, p), sl.poly_features(k, p), v,
                                           normalize=normalize, eps=0.5)
    assert torch.allclose(out, via_features, atol=TOL, rtol=0)


def test_softmax_attention_naive_matches_sdpa():
    q, k, v = _rand(2, 9, 3, 8, seed=30), _rand(2, 9, 3, 8, seed=31), _rand(2, 9, 3, 4, seed=32)
    for causal in (True, False):
        out = softmax_attention_naive(q, k, v, causal=causal)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
        assert torch.allclose(out, sdpa, atol=TOL, rtol=0)
    first_row = softmax_attention_naive(q, k, v, scale=0.3)[:, 0]
    assert torch.allclose(first_row, v[:, 0], atol=TOL, rtol=0)  # causal: token 0 sees only itself


@pytest.mark.parametrize("non_negative", [False, True])
def test_the_reference_backend_is_the_twin_on_llops_features(non_negative):
    H, t, p, D, M = 2, 2, 2, 4, 3
    q, k, v = _rand(2, 6, H, D, seed=40), _rand(2, 6, H, D, seed=41), _rand(2, 6, H, 3, seed=42)
    theta_q, theta_k = _rand(H, t, p, D, M, seed=43), _rand(H, t, p, D, M, seed=44)
    out = run_llops_naive(q, k, v, theta_q, theta_k, normalize="none", non_negative=non_negative)
    # φ(x)_i = Σ_r Π_j <θ_{r,j,:,i}, x>, written with einsum per head
    proj_q = torch.einsum("bthd,hrjdm->bthrjm", q, theta_q).prod(-2).sum(-2)  # [B, T, H, M]
    proj_k = torch.einsum("bthd,hrjdm->bthrjm", k, theta_k).prod(-2).sum(-2)
    expected = _loop_attention(self_tensor(proj_q) if non_negative else proj_q,
                               self_tensor(proj_k) if non_negative else proj_k, v, True, "none", 0.0)
    assert torch.allclose(out, expected, atol=TOL, rtol=0)


def test_unnormalised_signed_scores_are_fine_but_sum_normaliser_is_not_guarded():
    """normalize='sum' with a signed map divides by Σa + eps, which may be ~0: documented, not hidden."""
    phi_q = torch.tensor([[[[1.0]], [[1.0]]]], dtype=torch.float64)  # [1, 2, 1, 1]
    phi_k = torch.tensor([[[[1.0]], [[-1.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[1.0]], [[3.0]]]], dtype=torch.float64)
    out = feature_attention_naive(phi_q, phi_k, v, normalize="sum", eps=1e-6)
    assert out[0, 1, 0, 0].abs() > 1e5  # (1 - 3) / (0 + 1e-6)
    out = feature_attention_naive(phi_q, phi_k, v, normalize="none")
    assert out[0, 1, 0, 0].item() == pytest.approx(-2.0)


@pytest.mark.parametrize("window", [0, 3])
def test_the_twin_reports_its_denominators_as_the_chunked_path_does(window):
    """The denominator report is behaviour, not validation: signed features give some rows a sum <= 0; the
    twin counts the rows the chunked path counts ('raise' names them, 'warn' warns, 'off' is silent)."""
    import re
    import warnings

    T = 12
    q, k, v = _rand(2, T, 2, 4, seed=21), _rand(2, T, 2, 4, seed=22), _rand(2, T, 2, 3, seed=23)
    fq, fk = _rand(2, T, 2, 6, seed=24), _rand(2, T, 2, 6, seed=25)  # signed: φ(q)·Σφ(k) < 0 on some rows
    kw = dict(q=q, k=k, chunk_size=4)
    if window:  # the far (linear) part alone in the hybrid
        kw.update(window=window, gate=torch.full((2,), -30.0, dtype=torch.float64))
    counts = []
    for backend in ("torch", "reference"):
        with pytest.raises(FloatingPointError, match=r"normalising denominator <= 0") as err:
            run_chunked(fq, fk, v, backend=backend, denominator_check="raise", **kw)
        counts.append(re.search(r"(\d+) of (\d+) query rows", str(err.value)).groups())
    assert counts[0] == counts[1] and int(counts[1][0]) > 0, counts
    with pytest.warns(RuntimeWarning, match=r"feature_attention_naive: \d+ of 48 query rows have a normalising"):
        run_chunked(fq, fk, v, backend="reference", denominator_check="warn", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_chunked(fq, fk, v, backend="reference", denominator_check="off", **kw)


def test_the_twin_does_not_count_padded_query_rows():
    """Left padding, causal: the first queries of sequence 0 are pads and see only pad keys (denominator 0):
    not counted; a real query whose denominator is <= 0 still raises."""
    phi = _rand(2, 8, 1, 3, seed=31).abs() + 0.1  # positive features: every real row's sum > 0
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, :3] = False
    kw = dict(normalize="sum", key_padding_mask=mask, denominator_check="raise")
    assert torch.isfinite(feature_attention_naive(phi, phi, phi, **kw)).all()
    phi_k = phi.clone()
    phi_k[1, 0] = -phi_k[1, 0]  # sequence 1's first query sees only its own key: φ(q)·φ(k) < 0
    with pytest.raises(FloatingPointError, match="2 of 16 query rows have a normalising denominator <= 0") as err:
        feature_attention_naive(phi, phi_k, phi, **kw)  # sequence 1's queries 0 and 1 (its key 0 dominates)
    assert "exactly 0" not in str(err.value)  # the three padded rows (sums exactly 0) are not counted


def _op(q, k, v, **options):
    """The op on an LLoPS map fitted to q's heads and width (``backend="reference"``: the float64 twin's call)."""
    H, D = q.shape[2], q.shape[-1]
    theta = _rand(H, 1, 2, D, 3, seed=50)
    return run_llops_naive(q, k, v, theta, theta, **options)


@pytest.mark.parametrize("call, match", [
    # the float64 twin trusts its arguments: the rules on them are the op's, checked once
    (lambda: _op(_rand(1, 3, 2, 4), _rand(1, 3, 2, 5), _rand(1, 3, 2, 2)), "share the last axis"),
    (lambda: _op(_rand(1, 3, 2, 4), _rand(1, 3, 3, 4), _rand(1, 3, 3, 2)), "heads H"),
    (lambda: _op(_rand(1, 3, 2, 4), _rand(1, 4, 2, 4), _rand(1, 4, 2, 2)), "T == S"),
    (lambda: _op(_rand(1, 3, 2, 4), _rand(1, 3, 2, 4), _rand(1, 4, 2, 2)), "token axis S"),
    (lambda: _op(_rand(3, 2, 4), _rand(3, 2, 4), _rand(3, 2, 2)), "rank 4"),
    (lambda: _op(_rand(1, 3, 2, 4), _rand(1, 3, 2, 4).float(), _rand(1, 3, 2, 2)), "one dtype"),
    (lambda: _op(_rand(1, 3, 2, 4), _rand(1, 3, 2, 4), _rand(1, 3, 2, 2), normalize="softmax"), "normalize"),
    (lambda: _op(_rand(1, 3, 2, 4), _rand(1, 3, 2, 4), _rand(1, 3, 2, 2), eps=-1.0), "eps"),
    (lambda: _op(_rand(1, 3, 2, 4), _rand(1, 3, 2, 4), _rand(1, 3, 2, 2), segments=[1, 1]), "sum to"),
    (lambda: _op(_rand(1, 4, 2, 4), _rand(1, 4, 2, 4), _rand(1, 4, 2, 2), segments=3), "divide"),
    (lambda: poly_attention_naive(_rand(1, 3, 2, 4), _rand(1, 3, 2, 4), _rand(1, 3, 2, 2), 0), "degree"),
    (lambda: run_llops_naive(_rand(1, 3, 2, 4), _rand(1, 3, 2, 4), _rand(1, 3, 2, 2),
                                   _rand(2, 1, 2, 4, 3), _rand(2, 1, 3, 4, 3)), "same degree p"),
    (lambda: run_llops_naive(_rand(1, 3, 2, 4), _rand(1, 3, 2, 4), _rand(1, 3, 2, 2),
                                   _rand(3, 1, 2, 4, 3), _rand(3, 1, 2, 4, 3)), "feature_map has heads=3, head_dim=4 but q has H=2"),
    (lambda: run_llops_naive(_rand(1, 3, 2, 4), _rand(1, 3, 2, 4), _rand(1, 3, 2, 2),
                                   _rand(2, 1, 2, 4, 3) * math.nan, _rand(2, 1, 2, 4, 3)), "theta_q must be finite"),
])
def test_bad_input_is_rejected_with_the_rule(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
