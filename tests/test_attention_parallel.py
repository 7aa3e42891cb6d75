"""The parallel (masked φ(Q)φ(K)ᵀ) form of the pure chunked path against the dense float64 twin, and its dispatch.

float64 tolerance 1e-10 (absolute, outputs and gradients of size O(1)-O(10)): the parallel form and the
twin sum the same at most 64 terms per row in a different order (~1e-14 each), so 1e-10 fails only on a
real error (a wrong mask, a dropped normaliser, a missing square).
"""

import pytest
import torch
from attention_calls import run_chunked, run_llops, run_llops_naive

import sketchlab.attention.ops.additive.chunk as chunk
from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.attention.ops.additive.parallel import use_parallel

TOL64 = 1e-10


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _grads(fn, leaves, grad_out):
    leaves = [x.clone().requires_grad_() for x in leaves]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, grad_out)


@pytest.mark.parametrize("T", [1, 13, 64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("normalize", ["none", "sum"])
@pytest.mark.parametrize("non_negative", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_parallel_matches_naive_forward_and_gradients(T, causal, normalize, non_negative, padded):
    """T <= chunk_size (64): the parallel form; output and the gradients of φ(q), φ(k), v == the twin's."""
    phi_q, phi_k, v = _rand(2, T, 3, 5, seed=1), _rand(2, T, 3, 5, seed=2), _rand(2, T, 3, 4, seed=3)
    if normalize == "sum" and not non_negative:
        phi_q, phi_k = phi_q.abs(), phi_k.abs()  # the sum normaliser needs non-negative scores
    mask = None
    if padded:
        mask = torch.ones(2, T, dtype=torch.bool)
        mask[0, T // 2:] = False  # the second half of sequence 0 padded (T = 1: its only token)
        mask[1, 0] = T == 1  # a padded first key of sequence 1 (its first causal query sees no key)
    kw = dict(causal=causal, normalize=normalize, non_negative=non_negative, key_padding_mask=mask,
              denominator_check="off")
    grad_out = _rand(2, T, 3, 4, seed=4)
    out, grads = _grads(lambda a, b, c: run_chunked(a, b, c, **kw), (phi_q, phi_k, v), grad_out)
    ref, ref_grads = _grads(lambda a, b, c: feature_attention_naive(a, b, c, **kw), (phi_q, phi_k, v), grad_out)
    assert out.dtype == torch.float64 and out.shape == ref.shape
    assert torch.allclose(out, ref, atol=TOL64, rtol=0), (out - ref).abs().max().item()
    for name, g, r in zip(("phi_q", "phi_k", "v"), grads, ref_grads):
        assert torch.allclose(g, r, atol=TOL64, rtol=0), (name, (g - r).abs().max().item())


def test_parallel_non_causal_with_different_lengths():
    phi_q, phi_k, v = _rand(1, 30, 2, 4, seed=5).abs(), _rand(1, 45, 2, 4, seed=6).abs(), _rand(1, 45, 2, 3, seed=7)
    out = run_chunked(phi_q, phi_k, v, causal=False)  # T, S <= 64: parallel
    assert torch.allclose(out, feature_attention_naive(phi_q, phi_k, v, causal=False), atol=TOL64, rtol=0)


@pytest.mark.parametrize("non_negative", [False, True])
def test_llops_segments_and_padding_through_the_parallel_form(non_negative):
    """The op on LLoPS maps with segments and a padding mask (every segment within one chunk): output and the
    gradients of q, k, v, Θ_Q, Θ_K == run_llops_naive's."""
    H, t, p, D, M, T = 2, 2, 2, 4, 3, 20
    args = [_rand(2, T, H, D, seed=10), _rand(2, T, H, D, seed=11), _rand(2, T, H, 3, seed=12),
            _rand(H, t, p, D, M, seed=13), _rand(H, t, p, D, M, seed=14)]
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, 15:] = False
    kw = dict(normalize="none", non_negative=non_negative, segments=[7, 13], key_padding_mask=mask)
    grad_out = _rand(2, T, H, 3, seed=15)
    out, grads = _grads(lambda *a: run_llops(*a, backend="torch", **kw), args, grad_out)
    ref, ref_grads = _grads(lambda *a: run_llops_naive(*a, **kw), args, grad_out)
    # unnormalised degree-4 kernels of N(0, 1) inputs reach 1e4-1e6: the tolerance is TOL64 relative to each
    # tensor's largest entry (round-off ~1e-16 of it per term)
    for name, g, r in zip(("out", "q", "k", "v", "theta_q", "theta_k"), (out, *grads), (ref, *ref_grads)):
        tol = TOL64 * max(1.0, r.abs().max().item())
        assert torch.allclose(g, r, atol=tol, rtol=0), (name, (g - r).abs().max().item(), tol)


def test_use_parallel_rule():
    assert use_parallel(64, 64, chunk_size=64, window=0, stateful=False)
    assert use_parallel(30, 45, chunk_size=64, window=0, stateful=False)
    assert not use_parallel(65, 65, chunk_size=64, window=0, stateful=False)  # two chunks: the engine
    assert not use_parallel(30, 65, chunk_size=64, window=0, stateful=False)
    assert not use_parallel(16, 16, chunk_size=64, window=4, stateful=False)  # the hybrid
    assert not use_parallel(16, 16, chunk_size=64, window=0, stateful=True)  # a state in or out


def test_dispatch_runs_the_form_the_rule_names(monkeypatch):
    """Which of the two forms runs: the parallel one exactly when the rule says so (each replaced by a
    function that raises, the other must still run)."""
    phi = _rand(1, 80, 1, 3, seed=20).abs()

    def boom(*a, **kw):
        raise RuntimeError("boom")

    with monkeypatch.context() as m:
        m.setattr(chunk, "parallel_core", boom)
        with pytest.raises(RuntimeError, match="boom"):
            run_chunked(phi[:, :64], phi[:, :64], phi[:, :64])
        run_chunked(phi, phi, phi)  # T = 80 > 64: the engine
        run_chunked(phi[:, :64], phi[:, :64], phi[:, :64], chunk_size=32)
        run_chunked(phi[:, :20], phi[:, :20], phi[:, :20], output_final_state=True)
        run_chunked(phi[:, :20], phi[:, :20], phi[:, :20], q=phi[:, :20], k=phi[:, :20], window=4)
    with monkeypatch.context() as m:
        m.setattr(chunk, "chunk_core", boom)
        run_chunked(phi[:, :64], phi[:, :64], phi[:, :64])
        with pytest.raises(RuntimeError, match="boom"):
            run_chunked(phi, phi, phi)


def test_parallel_denominator_check_sees_the_rows():
    """A signed map with normalize="sum" on the parallel path: a query row whose sum is <= 0 raises."""
    phi_q = torch.ones(1, 4, 1, 2, dtype=torch.float64)
    phi_k = torch.tensor([1.0, -1.0], dtype=torch.float64).expand(1, 4, 1, 2).contiguous()  # φ(q)·φ(k) = 0
    with pytest.raises(Exception, match="denominator"):
        run_chunked(phi_q, phi_k, phi_q, normalize="sum", denominator_check="raise")


def test_parallel_denominator_check_skips_padded_query_rows():
    """Left padding, causal: the first queries of sequence 0 are pads and see only pad keys (denominator 0):
    not counted; a real query whose denominator is <= 0 still raises."""
    phi = _rand(2, 8, 1, 3, seed=31).abs() + 0.1  # positive features: every real row's sum > 0
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, :3] = False
    kw = dict(causal=True, normalize="sum", key_padding_mask=mask, denominator_check="raise")
    out = run_chunked(phi, phi, phi, **kw)
    assert torch.allclose(out[:, 3:], feature_attention_naive(phi, phi, phi, **kw)[:, 3:], atol=TOL64, rtol=0)
    phi_k = phi.clone()
    phi_k[1, 0] = -phi_k[1, 0]  # sequence 1's first query sees only its own key: φ(q)·φ(k) < 0
    with pytest.raises(Exception, match="denominator"):
        run_chunked(phi, phi_k, phi, **kw)


def test_parallel_scores_are_budgeted():
    phi = _rand(2, 16, 1, 3, seed=30)
    with pytest.raises(ValueError, match="memory budget"):  # [2, 1, 16, 16] float64 = 4096 bytes
        run_chunked(phi, phi, phi, normalize="none", max_bytes=1000)
