"""The sliding-window hybrid (exact local keys + sketched far keys, one denominator).

Tolerances: float64 1e-10 absolute on outputs of size O(1) — the chunked path and the dense twin
sum the same terms in another order (~1e-15 relative per term, a few hundred terms). fp32 vs the
float64 twin 1e-4 relative to the largest output: ~1e-7 per term over sums of <= 100 terms, plus
the exp of fp32 logits (relative error ~1e-6); 1e-4 leaves a wide margin but fails on any wrong mask.
"""

import itertools
import math

import pytest
import torch
from attention_calls import run_chunked, run_llops, run_llops_naive

from sketchlab.attention import (
    softmax_attention_naive,
)
from sketchlab.attention.ops.additive.naive import feature_attention_naive

TOL64 = 1e-10
TOL32 = 1e-4


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _inputs(B=2, T=23, H=2, D=4, M=5, seed=0):
    q, k, v = _rand(B, T, H, D, seed=seed), _rand(B, T, H, D, seed=seed + 1), _rand(B, T, H, 3, seed=seed + 2)
    fq, fk = _rand(B, T, H, M, seed=seed + 3).abs(), _rand(B, T, H, M, seed=seed + 4).abs()
    return q, k, v, fq, fk


def test_naive_twin_matches_a_scalar_loop():
    """The dense twin against the formula written out key by key (B = H = 1, w = 2, one sink, a gate)."""
    T, w, sinks, s = 7, 2, 1, 0.7
    q, k, v, fq, fk = _inputs(1, T, 1, 3, 4, seed=5)
    gate = torch.tensor([0.3], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True, True, True, True]])
    g = 1 / (1 + math.exp(-0.3))
    for local in ("softmax", "poly"):
        out = feature_attention_naive(fq, fk, v, q=q, k=k, window=w, sinks=sinks, local=local, local_scale=s,
                                      degree=2, gate=gate, key_padding_mask=mask, eps=1e-3)
        for i in range(T):
            loc = [j for j in range(i + 1) if mask[0, j] and (i - j < w or j < sinks)]
            far = [j for j in range(i + 1) if mask[0, j] and j not in loc]
            logit = {j: s * float(q[0, i, 0] @ k[0, j, 0]) for j in loc}
            c = max(logit.values()) if loc else 0.0
            a = {j: (math.exp(logit[j] - c) if local == "softmax" else logit[j] ** 2) for j in loc}
            num = sum(g * a[j] * v[0, j, 0] for j in loc) + sum((1 - g) * float(fq[0, i, 0] @ fk[0, j, 0]) * v[0, j, 0] for j in far)
            den = sum(g * a[j] for j in loc) + sum((1 - g) * float(fq[0, i, 0] @ fk[0, j, 0]) for j in far) + 1e-3
            assert torch.allclose(out[0, i, 0], num / den, atol=1e-12, rtol=0), (local, i)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("local", ["softmax", "poly"])
@pytest.mark.parametrize("window", [1, 7, 8, 40])  # 8 = the chunk size, 40 > T
def test_chunked_matches_naive_float64(causal, local, window):
    q, k, v, fq, fk = _inputs(seed=window)
    gate = _rand(2, seed=9)
    mask = torch.rand(2, 23, generator=torch.Generator().manual_seed(3)) > 0.25
    for sinks, key_mask, non_negative in itertools.product((0, 3), (None, mask), (False, True)):
        kw = dict(q=q, k=k, causal=causal, window=window, sinks=sinks, local=local, degree=2, gate=gate,
                  key_padding_mask=key_mask, non_negative=non_negative)
        ref = feature_attention_naive(fq, fk, v, **kw)
        for chunk, blocks in ((8, 1), (5, 3)):  # several blocks carry the state; 5 does not divide 23
            out = run_chunked(fq, fk, v, chunk_size=chunk, block_chunks=blocks, **kw)
            err = (out - ref).abs().max().item()
            assert err < TOL64, (sinks, key_mask is None, non_negative, chunk, err)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("local", ["softmax", "poly"])
def test_llops_hybrid_fp32_and_backends(causal, local):
    """LLoPS hybrid: the torch backend in fp32 and float64 against the reference twin (Θ of rank 2, signed)."""
    q, k, v, _, _ = _inputs(B=1, T=30, H=2, D=4, seed=11)
    theta_q = _rand(2, 1, 2, 4, 6, seed=12) / 2
    theta_k = theta_q.clone()  # equal factors per feature below: a non-negative map, so "sum" is safe
    theta_q[:, :, 1] = theta_q[:, :, 0]
    theta_k[:, :, 1] = theta_k[:, :, 0]
    gate = _rand(2, seed=13)
    kw = dict(causal=causal, window=7, sinks=2, local=local, gate=gate)
    ref = run_llops(q, k, v, theta_q, theta_k, backend="reference", **kw)
    out = run_llops(q, k, v, theta_q, theta_k, backend="torch", chunk_size=8, **kw)
    assert (out - ref).abs().max() < TOL64
    out32 = run_llops(*(x.float() for x in (q, k, v, theta_q, theta_k)), backend="torch", chunk_size=8,
                            causal=causal, window=7, sinks=2, local=local, gate=gate.float())
    assert out32.dtype == torch.float32
    assert (out32.double() - ref).abs().max() / ref.abs().max() < TOL32


@pytest.mark.parametrize("causal", [True, False])
def test_window_at_least_T_is_softmax(causal):
    q, k, v, fq, fk = _inputs(T=20, seed=21)
    ref = softmax_attention_naive(q, k, v, causal=causal)
    for window in (20, 1000):
        out = run_chunked(fq, fk, v, q=q, k=k, causal=causal, window=window, eps=0.0, chunk_size=8,
                                gate=_rand(2, seed=1))
        assert (out - ref).abs().max() < TOL64, window


def test_a_short_call_is_budgeted_for_its_own_chunks_not_a_whole_block():
    # T = 23 in chunks of 8 fills 24 of a block's 8 * 16 = 128 query rows: the band costs
    # 2·2·24·(4 + 8)·(4 + 5 + 3 + 2)·8 B = 129 KiB, a whole block 688 KiB. A 300 kB budget must admit
    # the call (it was refused: the MQAR hybrids at batch 64 asked for 7.9 GiB) and still refuse T = 200.
    q, k, v, fq, fk = _inputs(seed=31)
    kw = dict(window=4, sinks=1, chunk_size=8, block_chunks=16, max_bytes=300_000)
    out = run_chunked(fq, fk, v, q=q, k=k, **kw)
    assert (out - feature_attention_naive(fq, fk, v, q=q, k=k, window=4, sinks=1)).abs().max() < TOL64
    q, k, v, fq, fk = _inputs(T=200, seed=31)
    with pytest.raises(ValueError, match="128 queries"):
        run_chunked(fq, fk, v, q=q, k=k, **kw)


def test_a_window_longer_than_the_sequence_is_budgeted_for_the_keys_there_are():
    # window 10⁶ on T = 23 is the attention of window 23; its band holds 23 + 8 keys per query row,
    # 2·2·24·31·14·8 B = 333 KB (under 400 kB), where window + chunk keys would ask for 10.7 GB
    q, k, v, fq, fk = _inputs(seed=31)
    kw = dict(sinks=1, chunk_size=8, block_chunks=16, max_bytes=400_000)
    out = run_chunked(fq, fk, v, q=q, k=k, window=10**6, **kw)
    assert torch.equal(out, run_chunked(fq, fk, v, q=q, k=k, window=23, **kw))


def test_window_zero_is_pure_linear_attention():
    """window=0 ignores the gate and equals the plain normalised linear attention of the dense formula."""
    q, k, v, fq, fk = _inputs(seed=31)
    theta = _rand(2, 1, 1, 4, 5, seed=32).expand(2, 1, 2, 4, 5).clone()  # equal factors: non-negative
    pure = run_llops_naive(q, k, v, theta, theta)
    for backend in ("torch", "reference"):
        out = run_llops(q, k, v, theta, theta, window=0, gate=_rand(2, seed=3), backend=backend)
        assert (out - pure).abs().max() < TOL64
    scores = torch.einsum("bthm,bshm->bhts", fq, fk).tril()  # [B, H, T, S]
    literal = torch.einsum("bhts,bshd->bthd", scores, v) / (scores.sum(-1).transpose(1, 2)[..., None] + 1e-6)
    assert (run_chunked(fq, fk, v, window=0, chunk_size=8) - literal).abs().max() < TOL64


def test_segments_restart_positions():
    """With segments each sequence has its own window and sinks: the joined call equals separate calls."""
    q, k, v, fq, fk = _inputs(T=20, seed=41)
    kw = dict(window=3, sinks=2, gate=_rand(2, seed=2))
    theta = _rand(2, 1, 1, 4, 5, seed=42).expand(2, 1, 2, 4, 5).clone()
    joined = run_llops(q, k, v, theta, theta, segments=[8, 12], backend="torch", **kw)
    parts = [run_llops(q[:, a:b], k[:, a:b], v[:, a:b], theta, theta, backend="reference", **kw)
             for a, b in ((0, 8), (8, 20))]
    assert (joined - torch.cat(parts, 1)).abs().max() < TOL64


def test_key_padding_mask_drops_the_padded_keys():
    """A padded key changes nothing: the masked call equals the call on the sequence with it removed
    (non-causal, so the positions of the remaining keys only matter through the window)."""
    q, k, v, fq, fk = _inputs(B=1, T=12, seed=51)
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, -3:] = False  # right padding: positions of the real tokens unchanged
    kw = dict(q=q, k=k, window=4, sinks=1, chunk_size=4)
    out = run_chunked(fq, fk, v, key_padding_mask=mask, **kw)
    cut = run_chunked(fq[:, :9], fk[:, :9], v[:, :9], q=q[:, :9], k=k[:, :9], window=4, sinks=1, chunk_size=4)
    assert (out[:, :9] - cut).abs().max() < TOL64
    v2 = v.clone()
    v2[:, -3:] = 1e6  # what a padded value holds never reaches a real query
    out2 = run_chunked(fq, fk, v2, key_padding_mask=mask, causal=False, **kw)
    assert (out2 - run_chunked(fq, fk, v, key_padding_mask=mask, causal=False, **kw))[:, :9].abs().max() < TOL64


def test_gradcheck_torch_path_with_gate():
    q, k, v, _, _ = _inputs(B=1, T=7, H=1, D=2, seed=61)
    theta = (_rand(1, 1, 1, 2, 3, seed=62) / 2).expand(1, 1, 2, 2, 3).clone().requires_grad_()
    gate = _rand(1, seed=63).requires_grad_()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    for local in ("softmax", "poly"):
        def f(q, k, v, theta, gate):
            return run_llops(q, k, v, theta, theta, window=2, sinks=1, local=local, gate=gate,
                                           chunk_size=3, block_chunks=1)
        assert torch.autograd.gradcheck(f, (q, k, v, theta, gate))


def test_gradients_match_the_naive_twin_including_through_c():
    """The softmax local part depends on c_i (far terms are not shifted): the chunked path's
    gradients equal autograd through the dense twin's max, to float64 round-off."""
    q, k, v, fq, fk = _inputs(T=17, seed=71)
    gate = _rand(2, seed=72)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, fq, fk, gate)]
    grads = []
    for fn, extra in ((feature_attention_naive, {}), (run_chunked, {"chunk_size": 4})):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        out = fn(xs[3], xs[4], xs[2], q=xs[0], k=xs[1], window=5, sinks=2, gate=xs[5], **extra)
        out.square().sum().backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert (a - b).abs().max() < 1e-9


def test_bad_options_are_rejected():
    q, k, v, fq, fk = _inputs(T=8)
    theta = _rand(2, 1, 2, 4, 5)
    with pytest.raises(ValueError, match="always normalised"):
        run_llops(q, k, v, theta, theta, window=4, normalize="none")
    with pytest.raises(ValueError, match="needs window >= 1"):
        run_llops(q, k, v, theta, theta, sinks=2)
    with pytest.raises(ValueError, match="local must be one of"):
        run_llops(q, k, v, theta, theta, window=2, local="linear")
    with pytest.raises(ValueError, match=r"gate must have shape \[H\]"):
        run_llops(q, k, v, theta, theta, window=2, gate=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="key_padding_mask must be a bool"):
        run_llops(q, k, v, theta, theta, key_padding_mask=torch.ones(2, 8))
    with pytest.raises(ValueError, match="local_scale"):
        run_llops(q, k, v, theta, theta, window=2, local_scale=-1.0)


def test_the_hybrid_for_a_generic_map():
    from sketchlab.attention import AttentionOptions, linear_attention
    from sketchlab.featuremaps import TaylorMap

    q, k, v, _, _ = _inputs(T=15, seed=81)
    fmap = TaylorMap(2, 4, proj=torch.eye(4, 3, dtype=torch.float64).expand(2, 4, 3), dtype=torch.float64)
    kw = dict(window=4, sinks=1, local="poly")
    gate = _rand(2, seed=82)
    out, _ = linear_attention(q, k, v, fmap, options=AttentionOptions(backend="torch", chunk_size=4, **kw), gate=gate)
    ref, _ = linear_attention(q, k, v, fmap, options=AttentionOptions(backend="reference", **kw), gate=gate)
    assert (out - ref).abs().max() < TOL64
    fq, fk = fmap.features(q), fmap.features(k)
    assert (ref - feature_attention_naive(fq, fk, v, q=q, k=k, degree=2, gate=gate, **kw)).abs().max() < TOL64


def test_triton_hybrid_matches_torch_and_shares_the_state():
    """backend='triton' (the Triton hybrid kernel; the interpreter on CPU) equals the
    torch path (fp32: 1e-5 absolute on O(1) outputs, ~10 ulp of the sums) and the two backends'
    states are interchangeable."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=g) for _ in range(3))
    theta = (torch.randn(2, 1, 1, 16, 16, generator=g) / 4).expand(-1, -1, 2, -1, -1).contiguous()
    gate = torch.randn(2, generator=g)
    for kw in (dict(window=5, sinks=2, gate=gate), dict(window=5, local="poly")):
        a = run_llops(q, k, v, theta, theta, backend="torch", **kw)
        b = run_llops(q, k, v, theta, theta, backend="triton", **kw)
        assert (a - b).abs().max() < 1e-5, kw
    a, state_torch = run_llops(q[:, :9], k[:, :9], v[:, :9], theta, theta, backend="torch", window=5, sinks=2,
                                     output_final_state=True)
    b, state_triton = run_llops(q[:, :9], k[:, :9], v[:, :9], theta, theta, backend="triton", window=5, sinks=2,
                                      output_final_state=True)
    rest = [x[:, 9:] for x in (q, k, v)]
    whole = run_llops(q, k, v, theta, theta, backend="torch", window=5, sinks=2)[:, 9:]
    for state, backend in ((state_triton, "torch"), (state_torch, "triton")):
        out = run_llops(*rest, theta, theta, backend=backend, window=5, sinks=2, initial_state=state)
        assert (out - whole).abs().max() < 1e-5, backend
