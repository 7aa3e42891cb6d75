"""The chunked PyTorch path against the dense float64 reference, its gradients and fp32 accuracy.

float64 tolerance 1e-10 (absolute, on outputs of size O(1)-O(10)): chunked and dense compute the
same sums in a different order, which moves float64 results by ~1e-14 per term; with at most a
few hundred terms the difference stays below 1e-12, so 1e-10 only fails on a real error.
"""

import pytest
import torch
from attention_calls import run_chunked, run_llops, run_llops_naive

from sketchlab.attention import AttentionOptions, count_denominators, linear_attention
from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.featuremaps import HedgehogMap

TOL64 = 1e-10

#: fp32 chunked vs float64 reference: max |error| / max |reference| per normalisation. Measured
#: worst cases over T ∈ {17, 100, 1000}, D = 16, M = 20 (seeded): none 3e-7, sum 6e-7 (non-negative
#: maps), non_negative none 9e-7, sum 8e-7 — about 10 ulp of fp32 (1.2e-7) after sums of up to
#: 1000 terms; the bounds below leave ~10x margin.
FP32_TOL = {("none", False): 1e-5, ("sum", False): 1e-5, ("none", True): 1e-5, ("sum", True): 1e-5}


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("T", [1, 17, 64, 100])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("normalize", ["none", "sum"])
@pytest.mark.parametrize("non_negative", [False, True])
def test_feature_attention_matches_reference_float64(T, causal, normalize, non_negative):
    phi_q, phi_k, v = _rand(2, T, 3, 5, seed=1), _rand(2, T, 3, 5, seed=2), _rand(2, T, 3, 4, seed=3)
    if normalize == "sum" and not non_negative:
        phi_q, phi_k = phi_q.abs(), phi_k.abs()  # the sum normaliser needs non-negative scores
    ref = feature_attention_naive(phi_q, phi_k, v, causal=causal, normalize=normalize, non_negative=non_negative)
    # chunk 8 with 3 chunks per block: T = 100 has 5 blocks, the last one partial (padding) and
    # the state is carried across blocks; chunk 64 with the default block covers the one-block case
    for chunk, blocks in ((8, 3), (64, 16), (7, 1)):
        out = run_chunked(phi_q, phi_k, v, causal=causal, normalize=normalize, non_negative=non_negative,
                                chunk_size=chunk, block_chunks=blocks)
        assert out.shape == ref.shape and out.dtype == torch.float64
        assert torch.allclose(out, ref, atol=TOL64, rtol=0), (chunk, blocks, (out - ref).abs().max().item())


@pytest.mark.parametrize("T, S", [(30, 45), (45, 30), (3, 100), (100, 3)])
@pytest.mark.parametrize("masked", [False, True])
def test_non_causal_with_different_lengths(T, S, masked):
    # more queries than keys once lost the extra query rows (the query count was read from the keys)
    phi_q, phi_k, v = _rand(2, T, 2, 4, seed=4).abs(), _rand(2, S, 2, 4, seed=5).abs(), _rand(2, S, 2, 3, seed=6)
    mask = None
    if masked:  # a key-padding mask [B, S]: row 0 keeps every key, row 1 its first S // 2 + 1
        mask = torch.ones(2, S, dtype=torch.bool)
        mask[1, S // 2 + 1:] = False
    out = run_chunked(phi_q, phi_k, v, causal=False, chunk_size=8, block_chunks=2, key_padding_mask=mask)
    ref = feature_attention_naive(phi_q, phi_k, v, causal=False, key_padding_mask=mask)
    assert out.shape == ref.shape == (2, T, 2, 3)
    assert torch.allclose(out, ref, atol=TOL64, rtol=0), (out - ref).abs().max().item()


@pytest.mark.parametrize("causal", [True, False])
def test_signed_features_keep_the_denominators_sign(causal):
    """Signed features under normalize='sum': some denominators are negative and the output divides by them as they
    are (the twin's formula; the check is off). Relative tolerance: a denominator near 0 makes its row large, both
    paths divide the same sums (1e-9 of the row)."""
    phi_q, phi_k, v = _rand(2, 37, 2, 5, seed=40), _rand(2, 37, 2, 5, seed=41), _rand(2, 37, 2, 3, seed=42)
    kw = dict(causal=causal, normalize="sum", denominator_check="off")
    ref = feature_attention_naive(phi_q, phi_k, v, **kw)
    den = torch.einsum("bthm,bshm->bhts", phi_q, phi_k)
    den = (den.tril() if causal else den).sum(-1)
    assert (den < 0).any() and (den > 0).any()  # the test reaches both signs
    out = run_chunked(phi_q, phi_k, v, chunk_size=8, block_chunks=2, **kw)
    assert ((out - ref).abs() <= 1e-9 * ref.abs().amax(-1, keepdim=True)).all()


def test_count_denominators_counts_each_warned_call_and_its_rows():
    """The signed features above, warned by default: each call counts once with the rows its check found (the
    dense sums give the expected number), even under an "ignore" filter outside; other warnings are issued again."""
    import warnings

    phi_q, phi_k, v = _rand(2, 37, 2, 5, seed=40), _rand(2, 37, 2, 5, seed=41), _rand(2, 37, 2, 3, seed=42)
    bad = int((torch.einsum("bthm,bshm->bhts", phi_q, phi_k).tril().sum(-1) <= 0).sum())
    assert bad > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with count_denominators() as counts:
            for _ in range(3):  # the same place three times: every call counts, not once per place
                # one chunk a block: 5 blocks, whose counts the DenominatorCounter adds up
                run_chunked(phi_q, phi_k, v, causal=True, normalize="sum", chunk_size=8, block_chunks=1)
    assert counts == {"calls": 3, "rows": 3 * bad}
    with pytest.warns(UserWarning, match="something else"):
        with count_denominators() as counts:
            warnings.warn("something else", UserWarning)
    assert counts == {"calls": 0, "rows": 0}


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_llops_chunked_matches_reference_float64(p, t, causal):
    H, D, M = 2, 6, 5
    q, k, v = _rand(2, 37, H, D, seed=10), _rand(2, 37, H, D, seed=11), _rand(2, 37, H, 3, seed=12)
    theta_q, theta_k = _rand(H, t, p, D, M, seed=13) / D**0.5, _rand(H, t, p, D, M, seed=14) / D**0.5
    for normalize, non_negative in (("none", False), ("sum", True), ("none", True)):
        ref = run_llops_naive(q, k, v, theta_q, theta_k, causal=causal, normalize=normalize,
                                    non_negative=non_negative)
        out = run_llops(q, k, v, theta_q, theta_k, causal=causal, normalize=normalize,
                                      non_negative=non_negative, chunk_size=8, block_chunks=2)
        assert torch.allclose(out, ref, atol=TOL64, rtol=0), (normalize, non_negative)


@pytest.mark.parametrize("normalize, non_negative", sorted(FP32_TOL))
def test_fp32_tolerance_table(normalize, non_negative):
    H, D, M = 3, 16, 20
    q = _rand(2, 300, H, D, seed=20) * D**-0.25
    k = _rand(2, 300, H, D, seed=21) * D**-0.25
    v = _rand(2, 300, H, 8, seed=22)
    theta = _rand(H, 1, 1, D, M, seed=23) / D**0.5
    theta = torch.cat([theta, theta], 2)  # Θ_{r,1} = Θ_{r,2}: φ_i(x) = (θ_i·x)² ≥ 0, safe for "sum"
    ref = run_llops_naive(q, k, v, theta, theta, normalize=normalize, non_negative=non_negative)
    out = run_llops(q.float(), k.float(), v.float(), theta.float(), theta.float(),
                                  normalize=normalize, non_negative=non_negative)
    assert out.dtype == torch.float32
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < FP32_TOL[(normalize, non_negative)], err


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("normalize, non_negative", [("none", False), ("sum", True), ("none", True)])
def test_gradcheck_llops_chunked(causal, normalize, non_negative):
    """Gradients to q, k, v, Θ_Q, Θ_K by finite differences (float64; two chunks, the last partial)."""
    H, t, p, D, M = 2, 2, 2, 2, 2
    args = [_rand(1, 9, H, D, seed=30), _rand(1, 9, H, D, seed=31), _rand(1, 9, H, 2, seed=32),
            _rand(H, t, p, D, M, seed=33), _rand(H, t, p, D, M, seed=34)]
    args = [a.requires_grad_() for a in args]

    def f(q, k, v, tq, tk):
        return run_llops(q, k, v, tq, tk, causal=causal, normalize=normalize, non_negative=non_negative,
                                       eps=1.0, chunk_size=4, block_chunks=2)

    # fast_mode checks the Jacobian along random directions (any wrong gradient entry shows up with
    # probability 1); every entry is compared with autograd through the dense twin below
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_gradients_match_reference_gradients():
    """The same five gradients as autograd through the dense reference (float64, 1e-10)."""
    H, t, p, D, M = 2, 2, 3, 4, 3
    args = [_rand(2, 21, H, D, seed=40), _rand(2, 21, H, D, seed=41), _rand(2, 21, H, 3, seed=42),
            _rand(H, t, p, D, M, seed=43), _rand(H, t, p, D, M, seed=44)]
    grad_out = _rand(2, 21, H, 3, seed=45)
    grads = []
    for fn in (run_llops_naive, lambda *a, **kw: run_llops(*a, chunk_size=4, block_chunks=2, **kw)):
        leaves = [a.clone().requires_grad_() for a in args]
        out = fn(*leaves, normalize="sum", non_negative=True)
        grads.append(torch.autograd.grad(out, leaves, grad_out))
    for name, a, b in zip(("q", "k", "v", "theta_q", "theta_k"), *grads):
        assert torch.allclose(a, b, atol=TOL64, rtol=1e-10), name


def test_state_memory_is_budgeted():
    phi = _rand(1, 8, 1, 30, seed=50)
    with pytest.raises(ValueError, match="memory budget"):  # chunk_size < T: the chunked engine, with its state
        run_chunked(phi, phi, _rand(1, 8, 1, 4), non_negative=True, max_bytes=1000, chunk_size=4)


@pytest.mark.parametrize("kwargs, match", [
    ({"chunk_size": 0}, "chunk_size"),
    ({"block_chunks": 1.5}, "block_chunks"),
    ({"causal": "yes"}, "causal"),
    ({"non_negative": 1}, "non_negative"),
    ({"normalize": "softmax"}, "normalize"),
])
def test_the_chunked_paths_options_are_refused_by_their_rule(kwargs, match):
    """The chunked path reads its options as given: a bad one is refused where the options are built, naming it."""
    with pytest.raises((ValueError, TypeError), match=match):
        AttentionOptions(**kwargs)


@pytest.mark.parametrize("t, p", [(1, 1), (1, 2), (2, 3), (3, 2)])
def test_llops_feature_fn_matches_llops_features(t, p):
    """The one-matmul feature path == sketchlab.llops_features head by head (float64, 1e-12)."""
    import sketchlab as sl
    from sketchlab.llops.maps import llops_feature_fn

    x, theta = _rand(2, 3, 9, 5, seed=60), _rand(3, t, p, 5, 4, seed=61)  # x [B, H, n, D], Θ [H, t, p, D, M]
    out = llops_feature_fn(theta)(x)
    assert out.shape == (2, 3, 9, 4)
    for h in range(3):
        assert torch.allclose(out[:, h], sl.llops_features(x[:, h], theta[h]), atol=1e-12, rtol=0)


def test_stateless_call_forms_no_state(monkeypatch):
    """A call without initial_state or output_final_state makes no empty state, hands the first block no state
    (``S_in = None``) and asks the last block for none (``final_state=False``, ``S_out = None``); blocks in between
    still carry it. Output and gradients equal those of the same call returning its final state (the same sums less an
    added zero, up to the blocking of a GEMM with fewer zero columns: 1e-13 on O(1) float64 values)."""
    from sketchlab.attention import state
    from sketchlab.attention.ops.additive import chunk

    calls, real = [], chunk.chunk_core

    def spy(fq, fk, v, S_in, z_in, **kw):
        res = real(fq, fk, v, S_in, z_in, **kw)
        calls.append((S_in is None, kw.get("final_state", True), res[2] is None and res[3] is None))
        return res

    def no_empty_state(*args, **kw):
        raise AssertionError("a stateless call made an empty state")

    monkeypatch.setattr(chunk, "chunk_core", spy)
    base = [_rand(2, 20, 2, 3, seed=s).abs() for s in (60, 61)] + [_rand(2, 20, 2, 2, seed=62)]
    grad_out = _rand(2, 20, 2, 2, seed=63)
    res = []
    for stateful in (False, True):
        leaves = [x.clone().requires_grad_() for x in base]
        with monkeypatch.context() as m:
            if not stateful:
                m.setattr(state, "empty_state", no_empty_state)
            out = run_chunked(*leaves, chunk_size=4, block_chunks=2, output_final_state=stateful)
        out = out[0] if stateful else out
        res.append([out] + list(torch.autograd.grad(out, leaves, grad_out)))
    # three blocks each: (no state in, final state asked, none returned)
    assert calls[:3] == [(True, True, False), (False, True, False), (False, False, True)]
    assert calls[3:] == [(False, True, False)] * 3  # the stateful path: an empty state in, every state formed
    for name, a, b in zip(("out", "phi_q", "phi_k", "v"), *res):
        assert (a - b).abs().max() < 1e-13, name


@pytest.mark.parametrize("path", ["naive", "chunked", "llops-chunked"])
def test_non_causal_window_needs_as_many_queries_as_keys(path):
    """The non-causal window ``|i − j| < w`` pairs query i with key i: T != S is refused on every path
    (one rule, :func:`sketchlab.attention._checks.check_window_lengths`); the same call with T == S runs."""
    q, k, v = _rand(1, 6, 2, 4, seed=1), _rand(1, 9, 2, 4, seed=2), _rand(1, 9, 2, 3, seed=3)
    tq, tk = _rand(2, 1, 2, 4, 5, seed=4), _rand(2, 1, 2, 4, 5, seed=5)  # [H, t, p, D, M]
    window = dict(causal=False, window=3, sinks=1)

    def call(q, k, v):
        if path == "llops-chunked":
            return run_llops(q, k, v, tq, tk, non_negative=True, **window)
        if path == "chunked":  # the op on a map of its own (the chunked path)
            return linear_attention(q, k, v, HedgehogMap(2, 4, m=4, dtype=torch.float64), options=AttentionOptions(**window))[0]
        # naive: the op's float64 twin (the twin trusts its arguments: the op checks them)
        return linear_attention(q, k, v, HedgehogMap(2, 4, m=4, dtype=torch.float64),
                                options=AttentionOptions(backend="reference", **window))[0]

    with pytest.raises(ValueError, match=r"non-causal hybrid window \|i−j\| < w needs T == S, got T=6, S=9"):
        call(q, k, v)
    assert call(q[:, :6].clone(), k[:, :6], v[:, :6]).shape == (1, 6, 2, 3)
