"""The functional API: backend dispatch, exact polynomial and softmax attention, any fitted map as
attention (the op, linear_attention), and the argument checks (each error names the argument and the rule).

float64 comparisons use 1e-10 (see tests/test_attention_chunked.py for the reasoning).
"""

import pytest
import torch
from attention_calls import run_llops, run_llops_naive

import sketchlab as sl
from sketchlab.attention import (
    AttentionOptions,
    functional,
    linear_attention,
    poly_attention,
    poly_attention_naive,
    resolve_backend,
    softmax_attention,
    softmax_attention_naive,
)
from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.featuremaps import batch_features, make_feature_map
from sketchlab.featuremaps.heads import as_heads, from_heads
from sketchlab.llops import llops_maps

TOL64 = 1e-10


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _problem(B=2, T=19, H=2, D=4, Dv=3, t=1, p=2, M=5, seed=0):
    q, k, v = _rand(B, T, H, D, seed=seed), _rand(B, T, H, D, seed=seed + 1), _rand(B, T, H, Dv, seed=seed + 2)
    return q, k, v, _rand(H, t, p, D, M, seed=seed + 3), _rand(H, t, p, D, M, seed=seed + 4)


def test_auto_is_torch_on_cpu_and_torch_matches_reference():
    q, k, v, tq, tk = _problem(t=2, p=3)
    assert resolve_backend("auto", q.device) == "torch"
    for causal in (True, False):
        ref = run_llops(q, k, v, tq, tk, causal=causal, normalize="none", backend="reference")
        for backend in ("auto", "torch"):
            out = run_llops(q, k, v, tq, tk, causal=causal, normalize="none", backend=backend, chunk_size=4)
            assert torch.allclose(out, ref, atol=TOL64, rtol=0)
        assert torch.equal(ref, run_llops_naive(q, k, v, tq, tk, causal=causal, normalize="none"))


def test_triton_backend_without_triton_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(functional, "_triton_importable", lambda: False)
    q, k, v, tq, tk = _problem()
    with pytest.raises(ValueError, match="needs the triton package"):
        run_llops(q, k, v, tq, tk, backend="triton")
    assert resolve_backend("auto", torch.device("cuda")) == "torch"  # no triton: the torch path even on CUDA


def test_auto_sends_cuda_float64_to_torch_and_fp32_to_triton(monkeypatch):
    monkeypatch.setattr(functional, "_triton_importable", lambda: True)
    cuda = torch.device("cuda")  # resolve_backend only reads the device type: no CUDA needed
    assert resolve_backend("auto", cuda, torch.float64) == "torch"  # the kernel refuses float64
    assert resolve_backend("auto", cuda, torch.float32) == "triton"
    assert resolve_backend("auto", cuda, torch.bfloat16) == "triton"
    assert resolve_backend("auto", torch.device("cpu"), torch.float32) == "torch"


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_poly_attention_matches_reference(p, causal):
    q, k, v, _, _ = _problem(T=23)
    for normalize in ("none", "sum"):
        out = poly_attention(q, k, v, p, causal=causal, normalize=normalize, eps=0.5, block_size=5)
        ref = poly_attention_naive(q, k, v, p, causal=causal, normalize=normalize, eps=0.5)
        assert torch.allclose(out, ref, atol=TOL64, rtol=0)


def test_softmax_attention_matches_reference():
    q, k, v, _, _ = _problem()
    for causal in (True, False):
        assert torch.allclose(softmax_attention(q, k, v, causal=causal, scale=0.7),
                              softmax_attention_naive(q, k, v, causal=causal, scale=0.7), atol=TOL64, rtol=0)
    # a key-padding mask: right padding of row 0, left padding of row 1 (its first causal queries see no real
    # key: 0 on both paths)
    pad = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool)
    pad[0, -2:] = False
    pad[-1, :2] = False
    for causal in (True, False):
        got = softmax_attention(q, k, v, causal=causal, scale=0.7, key_padding_mask=pad)
        ref = softmax_attention_naive(q, k, v, causal=causal, scale=0.7, key_padding_mask=pad)
        assert torch.allclose(got, ref, atol=TOL64, rtol=0)
        assert not torch.allclose(got, softmax_attention(q, k, v, causal=causal, scale=0.7), atol=1e-3)
    ref = softmax_attention_naive(q, k, v, causal=True, key_padding_mask=pad)
    assert torch.equal(ref[-1, :2], torch.zeros_like(ref[-1, :2]))  # causal: the left pads see no real key
    assert not torch.equal(ref[-1, 2:3], torch.zeros_like(ref[-1, 2:3]))


def _last_rows_of_whole(T, S, **kw):
    """Causal attention of the last T of S positions (q [B, T, H, D], k, v [B, S, ...]) on both paths, and
    the whole sequence's last T rows (what they must equal: a KV-cache decoding step)."""
    q, k, v, _, _ = _problem(T=S)
    return (softmax_attention(q[:, S - T:], k, v, causal=True, **kw),
            softmax_attention_naive(q[:, S - T:], k, v, causal=True, **kw),
            softmax_attention_naive(q, k, v, causal=True, **kw)[:, S - T:])


@pytest.mark.parametrize("T", [1, 3, 19])
def test_softmax_attention_causal_queries_are_the_last_positions(T):
    """Causal with T <= S: the queries are the last T positions (a decoding step against its KV cache), fast
    against naive in float64, and both equal to the last T rows of the whole sequence's attention."""
    pad = torch.ones(2, 19, dtype=torch.bool)
    pad[1, :4] = False
    for kw in ({}, {"scale": 0.7, "key_padding_mask": pad}, {"window": 4}):
        fast, naive, whole = _last_rows_of_whole(T, 19, **kw)
        assert fast.shape == naive.shape == (2, T, 2, 3)
        torch.testing.assert_close(fast, naive, atol=TOL64, rtol=0)
        torch.testing.assert_close(naive, whole, atol=TOL64, rtol=0)
    if T < 19:  # the first queries, not the last, would see fewer keys
        q, k, v, _, _ = _problem()
        assert not torch.allclose(softmax_attention(q[:, :T], k, v), softmax_attention_naive(q, k, v)[:, -T:])


@pytest.mark.parametrize("window", [1, 3, 19, 40])
def test_softmax_attention_sliding_window(window):
    """window=w: query i sees the keys i-w < s <= i; fast against naive in float64, against a mask written
    here, and (w >= T) the plain causal attention."""
    q, k, v, _, _ = _problem()
    fast = softmax_attention(q, k, v, window=window, scale=0.7)
    naive = softmax_attention_naive(q, k, v, window=window, scale=0.7)
    torch.testing.assert_close(fast, naive, atol=TOL64, rtol=0)
    i = torch.arange(19)
    lag = i[:, None] - i[None, :]  # [T, S]
    allowed = (lag >= 0) & (lag < window)
    logits = torch.einsum("bthd,bshd->bhts", q, k) * 0.7
    want = torch.einsum("bhts,bshv->bthv", logits.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(naive, want, atol=TOL64, rtol=0)
    full = softmax_attention_naive(q, k, v, scale=0.7)
    assert torch.allclose(naive, full, atol=TOL64, rtol=0) == (window >= 19)
    if window == 1:  # each query sees itself only
        torch.testing.assert_close(fast, v, atol=TOL64, rtol=0)


def test_softmax_attention_grouped_query_core():
    """The trusted core reads H_kv key/value heads in place for H query heads (query head h reads h // (H/H_kv)),
    equal to the keys repeated (transformers' repeat_kv)."""
    from sketchlab.attention.softmax import _softmax_attention

    q, k, v = _rand(2, 7, 4, 4), _rand(2, 7, 2, 4, seed=1), _rand(2, 7, 2, 3, seed=2)
    rep = lambda x: x.repeat_interleave(2, 2)  # noqa: E731
    for kw in ({}, {"window": 2}, {"key_padding_mask": torch.tensor([[True] * 7, [False] * 2 + [True] * 5])}):
        torch.testing.assert_close(_softmax_attention(q[:, 4:], k, v, **kw),
                                   softmax_attention_naive(q[:, 4:], rep(k), rep(v), **kw), atol=TOL64, rtol=0)


@pytest.mark.parametrize("method", sorted(sl.available_sketches()))
def test_every_registered_sketch_runs_as_attention(method):
    """The maps of a per-head [H] fit (fit_sketch's) give attention through the op (linear_attention) as their
    own features do."""
    H, D, p, m = 2, 4, 2, 6
    fit_q, fit_k = _rand(H, 40, D, seed=60) * D**-0.25, _rand(H, 40, D, seed=61) * D**-0.25
    options = {"steps": 5} if method in ("mlp", "elementwise") else {}
    fit = sl.fit_sketch(method, fit_q, fit_k, p=p, m=m, **options)
    q, k, v = _rand(2, 13, H, D, seed=62) * D**-0.25, _rand(2, 13, H, D, seed=63) * D**-0.25, _rand(2, 13, H, 3, seed=64)
    with torch.no_grad():
        # head by head as the maps were fitted: x[H, T, D] per batch element (batch_features: the dump layout)
        fq = torch.stack([batch_features(fit.map_q, q[b].transpose(0, 1)) for b in range(2)]).transpose(1, 2)  # [B, T, H, M]
        fk = torch.stack([batch_features(fit.map_k, k[b].transpose(0, 1)) for b in range(2)]).transpose(1, 2)
        ref = feature_attention_naive(fq, fk, v.to(fq.dtype), normalize="none")
        # float64 features: round-off only (1e-10); float32 ones (TensorSketch's default): ~1e-6 relative
        tol = (TOL64 if fq.dtype == torch.float64 else 1e-5) * ref.abs().max().item()
        for backend in ("torch", "reference", "auto"):
            opts = AttentionOptions(normalize="none", backend=backend, chunk_size=4)
            out, _ = linear_attention(q, k, v, fit.map_q, fit.map_k, options=opts)
            assert out.shape == (2, 13, H, 3)
            assert torch.allclose(out.double(), ref.double(), atol=tol, rtol=0), (backend, (out.double() - ref).abs().max())


def test_llops_maps_go_through_the_fused_route():
    q, k, v, tq, tk = _problem(t=2)
    none = AttentionOptions(normalize="none")
    out, _ = linear_attention(q, k, v, *llops_maps(tq, tk), options=none)
    assert torch.allclose(out, run_llops_naive(q, k, v, tq, tk, normalize="none"), atol=TOL64, rtol=0)
    tied, _ = llops_maps(tq)  # one map for both sides
    out, _ = linear_attention(q, k, v, tied, options=none)
    assert torch.allclose(out, run_llops_naive(q, k, v, tq, tq, normalize="none"), atol=TOL64, rtol=0)
    with pytest.raises(ValueError, match=r"feature_map has heads=6, head_dim=4 but q has H=2"):
        linear_attention(q, k, v, llops_maps(tq[None].expand(3, -1, -1, -1, -1, -1))[0])
    with pytest.raises(ValueError, match="fuses only LLoPS"):
        linear_attention(q, k, v, make_feature_map("tensorsketch", heads=2, head_dim=4, p=2, m=5),
                         options=AttentionOptions(backend="triton"))
    with pytest.raises(TypeError, match="feature_map must be a sketchlab.featuremaps.FeatureMap"):
        linear_attention(q, k, v, "llops")


def test_auto_backend_runs_unfused_maps_on_the_torch_path(monkeypatch):
    """Where ``"auto"`` means the Triton kernel (CUDA), a map it does not fuse runs on the chunked torch
    path instead of failing; an explicit ``backend="triton"`` is still refused."""
    import sketchlab.attention.functional as functional

    q, k, v, _, _ = _problem(t=1)
    real = functional.resolve_backend
    monkeypatch.setattr(functional, "resolve_backend",
                        lambda backend, device, dtype=torch.float32: "triton" if backend == "auto" else real(backend, device))
    sketch = make_feature_map("tensorsketch", heads=q.shape[2], head_dim=q.shape[3], p=2, m=5)
    auto, _ = functional.linear_attention(q, k, v, sketch, options=sl.AttentionOptions(normalize="none"))
    assert torch.equal(auto, functional.linear_attention(q, k, v, sketch, options=sl.AttentionOptions(
        normalize="none", backend="torch"))[0])
    fmap = make_feature_map("hedgehog", heads=q.shape[2], head_dim=q.shape[3], m=6).double()
    auto, _ = functional.linear_attention(q, k, v, fmap)
    torch_only = sl.AttentionOptions(backend="torch")
    assert torch.equal(auto, functional.linear_attention(q, k, v, fmap, options=torch_only)[0])
    with pytest.raises(ValueError, match="fuses only LLoPS"):
        functional.linear_attention(q, k, v, fmap, options=sl.AttentionOptions(backend="triton"))


def test_gradients_reach_the_map_parameters():
    q, k, v, tq, tk = _problem()
    map_q, map_k = llops_maps(tq, tk)
    linear_attention(q, k, v, map_q, map_k, options=AttentionOptions(normalize="none"))[0].square().sum().backward()
    assert map_q.theta.grad is not None and map_q.theta.grad.abs().sum() > 0
    assert map_k.theta.grad is not None and map_k.theta.grad.abs().sum() > 0


def _bad_calls():
    q, k, v, tq, tk = _problem()
    meta = torch.empty(2, 19, 2, 4, dtype=torch.float64, device="meta")
    nan = tq.clone()
    nan[0, 0, 0, 0, 0] = float("nan")
    return [
        (lambda: run_llops(q, k[:, :7], v[:, :7], tq, tk), "T == S"),
        (lambda: run_llops(q, k, v[:, :5], tq, tk, causal=False), "token axis S"),
        (lambda: run_llops(q, k[:, :, :1], v[:, :, :1], tq, tk), "heads H"),
        (lambda: run_llops(q, k[..., :3], v, tq, tk), "share the last axis"),
        (lambda: run_llops(q.float(), k, v, tq, tk), "one dtype"),
        (lambda: run_llops(meta, k, v, tq, tk), "one device"),
        (lambda: run_llops(q, k, v, tq.to("meta"), tk), "device of q"),
        (lambda: run_llops(q, k, v, tq[0], tk[0]), "rank 5"),
        (lambda: run_llops(q, k, v, tq[:1], tk[:1]), "feature_map has heads=1, head_dim=4 but q has H=2"),
        (lambda: run_llops(q, k, v, tq[..., :3, :], tk[..., :3, :]), "head_dim=3 but q has H=2, D=4"),
        (lambda: run_llops(q, k, v, tq, tk[:, :, :1]), "same degree p"),
        (lambda: run_llops(q, k, v, tq, tk[..., :4]), "one kind with one number of features"),
        (lambda: run_llops(q, k, v, tq[:, :, :0], tk[:, :, :0]), ">= 1"),
        (lambda: run_llops(q, k, v, nan, tk), "theta_q must be finite"),
        (lambda: run_llops(q, k, v, tq, tk, backend="cuda"), "backend"),
        (lambda: run_llops(q, k, v, tq, tk, normalize=True), "normalize"),
        (lambda: run_llops(q, k, v, tq, tk, eps=float("inf")), "eps"),
        (lambda: run_llops(q, k, v, tq, tk, chunk_size=0), "chunk_size"),
        (lambda: run_llops(q.int(), k, v, tq, tk), "floating-point"),
        (lambda: poly_attention(q, k, v, 0), "degree"),
        (lambda: poly_attention(q, k, v, 2, block_size=0), "block_size"),
        (lambda: softmax_attention(q, k, v, scale=-1.0), "scale"),
        (lambda: softmax_attention(q, k[:, :5], v[:, :5]), "at most as many queries as keys"),
        (lambda: softmax_attention(q, k, v, window=-1), "window"),
        (lambda: softmax_attention(q, k, v, window=2, causal=False), "causal=True"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_input_names_the_argument_and_rule(index):
    call, match = _bad_calls()[index]
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("method", ["llops", "optimal"])
def test_batch_by_head_fit_runs_on_a_dump_layout(method):
    """An [L, H] fit on a dump's q[L, H, n, d]: its L·H heads are the op's heads (as_heads), each (layer, head) its
    own map, and from_heads gives back [L, H, n, Dv]."""
    L, H, D = 2, 2, 4
    q, k = _rand(L, H, 30, D, seed=70) * D**-0.25, _rand(L, H, 30, D, seed=71) * D**-0.25
    v = _rand(L, H, 30, 3, seed=72)
    fit = sl.fit_sketch(method, q, k, p=2, m=5)
    out, _ = linear_attention(as_heads(q, L * H), as_heads(k, L * H), as_heads(v, L * H), *fit.maps,
                              options=AttentionOptions(normalize="none"))  # [1, n, L·H, Dv]
    out = from_heads(out, (L, H))  # [L, H, n, Dv]
    with torch.no_grad():
        ref = feature_attention_naive(batch_features(fit.map_q, q).transpose(1, 2),
                                      batch_features(fit.map_k, k).transpose(1, 2), v.transpose(1, 2),
                                      normalize="none").transpose(1, 2)  # layer by layer: [L, n, H, ·]
    assert torch.allclose(out, ref, atol=TOL64 * ref.abs().max().item(), rtol=0)


def test_segments_attend_each_sequence_alone():
    q, k, v, tq, tk = _problem(T=20)
    maps = llops_maps(tq, tk)
    sketch = make_feature_map("tensorsketch", heads=2, head_dim=4, p=2, m=5, dtype=torch.float64)
    none = AttentionOptions(normalize="none")
    for fn in (lambda a, b, c, **kw: linear_attention(a, b, c, *maps, options=none, **kw)[0],
               lambda a, b, c, **kw: linear_attention(a, b, c, sketch, options=none, **kw)[0],
               lambda a, b, c, **kw: poly_attention(a, b, c, 2, **kw)):
        joined = fn(q, k, v, segments=[8, 12])
        apart = torch.cat([fn(q[:, :8], k[:, :8], v[:, :8]), fn(q[:, 8:], k[:, 8:], v[:, 8:])], 1)
        assert torch.allclose(joined, apart, atol=TOL64, rtol=0)
        assert not torch.allclose(joined, fn(q, k, v), atol=1e-3)
    with pytest.raises(ValueError, match="sum to"):
        poly_attention(q, k, v, 2, segments=[8, 8])


def test_shipped_dump_segments():
    from pathlib import Path

    from sketchlab.attention import dump_segments

    dump = sl.load_qk(Path(__file__).resolve().parents[1] / "data" / "mqar_softmax_qk.safetensors")
    assert dump_segments(dump) == [256, 256]
    dump.meta.pop("tokens")
    assert dump_segments(dump) is None


def test_poly_attention_gradients_match_reference():
    """Checkpointed blocks: the same gradients as autograd through the dense twin (float64, 1e-10)."""
    q, k, v, _, _ = _problem(T=13)
    grads = []
    for fn in (lambda a, b, c: poly_attention(a, b, c, 2, block_size=4), lambda a, b, c: poly_attention_naive(a, b, c, 2)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        grads.append(torch.autograd.grad(fn(*leaves).square().sum(), leaves))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=TOL64, rtol=1e-10)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_llops_attention_segments_never_cross_a_boundary(backend):
    q, k, v, tq, tk = _problem(T=19)
    out = run_llops(q, k, v, tq, tk, normalize="none", backend=backend, segments=[7, 12])
    first = run_llops(q[:, :7], k[:, :7], v[:, :7], tq, tk, normalize="none", backend="reference")
    second = run_llops(q[:, 7:], k[:, 7:], v[:, 7:], tq, tk, normalize="none", backend="reference")
    assert torch.allclose(out, torch.cat([first, second], 1), atol=TOL64, rtol=0)
    whole = run_llops(q, k, v, tq, tk, normalize="none", backend="reference")
    assert not torch.allclose(out[:, 7:], whole[:, 7:], atol=1e-3)  # the joined run differs after the boundary


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("window", [0, 2])
def test_features_that_overflow_are_refused_naming_them(backend, window):
    """A map's features of finite inputs can overflow (DPFP multiplies relu'd coordinates): the op refuses them,
    naming the side, on the chunked path and the float64 twin alike (the memory mechanisms check theirs too)."""
    from sketchlab.featuremaps.dpfp import DPFPMap

    q, k, v = (torch.randn(1, 6, 2, 4, generator=torch.Generator().manual_seed(i), dtype=torch.float64) + 2.0
               for i in range(3))
    fmap = DPFPMap(2, 4)
    options = AttentionOptions(backend=backend, window=window)
    out, _ = linear_attention(q, k, v, fmap, options=options)
    assert torch.isfinite(out).all()
    q[0, 2, 0] = 1e200  # finite in float64; its products with the other coordinates are not
    with pytest.raises(ValueError, match="phi_q must be finite"):
        linear_attention(q, k, v, fmap, options=options)


@pytest.mark.parametrize("memory", [{}, {"decay": 0.9}, {"window": 2, "cache": 1}])
def test_every_backend_reads_theta_in_the_dtype_of_q(memory):
    """An LLoPS map whose Θ has another dtype than q (a float32 map on bfloat16 activations) is read in q's dtype
    by every backend: the output has q's dtype with or without memory, and the reference twin equals the
    float64 call on the rounded Θ."""
    q, k, v = (torch.randn(1, 9, 2, 4, generator=torch.Generator().manual_seed(i)) * 0.5 for i in range(3))
    theta = torch.randn(2, 1, 1, 4, 3, generator=torch.Generator().manual_seed(9)).expand(-1, -1, 2, -1, -1) * 0.5
    fmap = sl.featuremaps.LLoPSMap(2, 4, theta=theta)  # float32
    options = AttentionOptions(chunk_size=4, **memory)
    low = [x.bfloat16() for x in (q, k, v)]
    out, _ = linear_attention(*low, fmap, options=options)
    assert out.dtype == torch.bfloat16
    ref, _ = linear_attention(*low, fmap, options=options.replace(backend="reference"))
    rounded = sl.featuremaps.LLoPSMap(2, 4, theta=theta.bfloat16().double(), dtype=torch.float64)
    want, _ = linear_attention(*(x.double() for x in low), rounded, options=options.replace(backend="reference"))
    assert torch.equal(ref, want)
