"""The recurrent state: a sequence split anywhere, the state passed on, equals the whole sequence.

float64 tolerance 1e-10: the split and the whole call add the same terms in another order
(round-off ~1e-15 per term on O(1) outputs).
"""

import pytest
import torch
from attention_calls import run_chunked, run_llops

from sketchlab.attention import AttentionState, LLoPSAttention
from sketchlab.attention.ops.additive.naive import feature_attention_naive

TOL64 = 1e-10


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _theta(H=2, D=4, M=5, seed=0):
    return (_rand(H, 1, 1, D, M, seed=seed) / 2).expand(H, 1, 2, D, M).clone()  # equal factors, p = 2: non-negative


HYBRIDS = [dict(), dict(window=5, sinks=2, gate=None), dict(window=3, local="poly"), dict(window=40)]


def _split_run(fn, T, cuts, **kw):
    outs, state = [], None
    bounds = [0, *cuts, T]
    for a, b in zip(bounds[:-1], bounds[1:]):
        out, state = fn(a, b, initial_state=state, output_final_state=True, **kw)
        assert isinstance(state, AttentionState) and state.offset == b
        outs.append(out)
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("hybrid", range(len(HYBRIDS)))
@pytest.mark.parametrize("non_negative", [False, True])
def test_llops_split_anywhere_equals_whole(backend, hybrid, non_negative):
    T = 21
    q, k, v = _rand(2, T, 2, 4, seed=1), _rand(2, T, 2, 4, seed=2), _rand(2, T, 2, 3, seed=3)
    theta = _theta(seed=4)
    kw = dict(HYBRIDS[hybrid], non_negative=non_negative, backend=backend, chunk_size=4)
    if "gate" in kw:
        kw["gate"] = _rand(2, seed=5)
    whole, whole_state = run_llops(q, k, v, theta, theta, output_final_state=True, **kw)

    def fn(a, b, **extra):
        return run_llops(q[:, a:b], k[:, a:b], v[:, a:b], theta, theta, **kw, **extra)

    for cuts in ([1], [7, 8, 9], [3, 11, 20], list(range(1, T))):
        split, state = _split_run(fn, T, cuts)
        assert (split - whole).abs().max() < TOL64, cuts
        assert (state.S - whole_state.S).abs().max() < TOL64 and (state.z - whole_state.z).abs().max() < TOL64
        assert torch.equal(state.k_window, whole_state.k_window) and torch.equal(state.k_sink, whole_state.k_sink)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("hybrid", range(len(HYBRIDS)))
@pytest.mark.parametrize("T", [1, 3])
def test_a_continued_call_without_output_final_state_returns_only_the_output(backend, hybrid, T):
    """``initial_state`` given, ``output_final_state=False``: the output alone (a tensor), the same as the
    stateful call's; T = 1 is the one-token decoding branch."""
    q, k, v = _rand(1, 9 + T, 2, 4, seed=21), _rand(1, 9 + T, 2, 4, seed=22), _rand(1, 9 + T, 2, 3, seed=23)
    theta = _theta(seed=24)
    kw = dict(HYBRIDS[hybrid], backend=backend, chunk_size=4)
    _, state = run_llops(q[:, :9], k[:, :9], v[:, :9], theta, theta, output_final_state=True, **kw)
    rest = (q[:, 9:], k[:, 9:], v[:, 9:], theta, theta)
    expected, _ = run_llops(*rest, initial_state=state, output_final_state=True, **kw)
    out = run_llops(*rest, initial_state=state, **kw)
    assert isinstance(out, torch.Tensor) and torch.equal(out, expected)


@pytest.mark.parametrize("hybrid", range(len(HYBRIDS)))
def test_generic_features_split_with_padding_and_across_backends(hybrid):
    """Generic (given) features with a key-padding mask: torch and reference states are interchangeable."""
    T = 19
    q, k, v = _rand(1, T, 2, 4, seed=11), _rand(1, T, 2, 4, seed=12), _rand(1, T, 2, 3, seed=13)
    fq, fk = _rand(1, T, 2, 6, seed=14).abs(), _rand(1, T, 2, 6, seed=15).abs()
    mask = torch.rand(1, T, generator=torch.Generator().manual_seed(16)) > 0.3
    kw = dict(HYBRIDS[hybrid], q=q, k=k, degree=2)
    whole = feature_attention_naive(fq, fk, v, key_padding_mask=mask, **kw)
    outs, state = [], None
    for i, (a, b) in enumerate(((0, 6), (6, 7), (7, 15), (15, T))):
        fn = run_chunked if i % 2 else feature_attention_naive  # alternate backends
        extra = {"chunk_size": 3} if i % 2 else {}
        sub = dict(kw, q=q[:, a:b], k=k[:, a:b])
        out, state = fn(fq[:, a:b], fk[:, a:b], v[:, a:b], key_padding_mask=mask[:, a:b], initial_state=state,
                        output_final_state=True, **sub, **extra)
        outs.append(out)
    assert (torch.cat(outs, 1) - whole).abs().max() < TOL64


def test_state_size_is_constant_past_the_window():
    q, k, v = _rand(1, 64, 2, 4, seed=21), _rand(1, 64, 2, 4, seed=22), _rand(1, 64, 2, 3, seed=23)
    theta = _theta(seed=24)
    sizes = []
    state = None
    for a in range(0, 64, 8):
        _, state = run_llops(q[:, a:a + 8], k[:, a:a + 8], v[:, a:a + 8], theta, theta, window=8, sinks=2,
                                   initial_state=state, output_final_state=True, backend="torch")
        sizes.append(state.nbytes)
    assert len(set(sizes)) == 1 and state.k_window.shape[2] == 8 and state.k_sink.shape[2] == 2


@pytest.mark.parametrize("window", [0, 8, 6])  # pure; w % C == 0 (the chunk boundary case) and not
def test_carried_state_owns_only_its_own_storage(window):
    """The returned S, z are their own tensors, not views into the block's [chunks + 1, ...] prefix buffer
    (a view would keep that whole buffer alive for as long as the state is held)."""
    q, k, v = _rand(1, 64, 2, 4, seed=31), _rand(1, 64, 2, 4, seed=32), _rand(1, 64, 2, 3, seed=33)
    theta = _theta(seed=34)
    _, state = run_llops(q, k, v, theta, theta, window=window, sinks=2 if window else 0,
                               chunk_size=8, output_final_state=True, backend="torch")
    for name in ("S", "z"):
        t = getattr(state, name)
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_state_checks(backend):
    """The op's state rules on the torch and reference backends (the float64 twin trusts its arguments: the op checks them)."""
    q, k, v = _rand(1, 8, 2, 4), _rand(1, 8, 2, 4), _rand(1, 8, 2, 3)
    theta = _theta()
    _, state = run_llops(q, k, v, theta, theta, window=4, output_final_state=True, backend=backend)
    with pytest.raises(ValueError, match="k_window must have shape"):
        run_llops(q, k, v, theta, theta, window=6, initial_state=state, backend=backend)
    with pytest.raises(TypeError, match="AttentionState"):
        run_llops(q, k, v, theta, theta, initial_state=(state.S, state.z), backend=backend)
    with pytest.raises(ValueError, match="causal=True"):
        run_llops(q, k, v, theta, theta, causal=False, output_final_state=True, backend=backend)
    with pytest.raises(ValueError, match="segments cannot be combined"):
        run_llops(q, k, v, theta, theta, segments=[4, 4], output_final_state=True, backend=backend)


@pytest.mark.parametrize("window", [0, 3])
def test_module_step_loop_equals_forward(window):
    block = LLoPSAttention(16, 2, m=6, window=window, sinks=1 if window else 0, dtype=torch.float64, seed=3,
                           backend="torch", chunk_size=4)
    with torch.no_grad():
        block.gate.fill_(0.7) if block.gate is not None else None
    x = _rand(2, 11, 16, seed=31)
    whole = block(x)
    state, outs = None, []
    for t in range(11):
        y, state = block.step(x[:, t], state)
        outs.append(y)
    assert (torch.stack(outs, 1) - whole).abs().max() < TOL64
    # a prefill then steps: the same
    y0, state = block(x[:, :6], output_final_state=True)
    ys = [block.step(x[:, t], state) for t in range(6, 7)]
    assert (torch.cat([y0, ys[0][0][:, None]], 1) - whole[:, :7]).abs().max() < TOL64


def _greedy_by_full_passes(model, prompt, n):
    tokens = prompt
    with torch.no_grad():
        for _ in range(n):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], 1)
    return tokens


@pytest.mark.parametrize("attention, options", [
    ("llops", {"window": 4, "sinks": 1, "backend": "torch"}),
    ("llops", {"backend": "torch"}),
    # affine, self-tensored: the perturbed weights below leave the kernel >= 0 (a signed one would compare
    # unbounded rows)
    ("llops", {"p": 2, "m": 4, "affine": True, "non_negative": True, "window": 3, "sinks": 1, "backend": "torch"}),
    ("softmax", {}),
    ("poly", {}),
    ("based", {"window": 3, "local": "poly"}),
    ("psf", {"m": 16, "window": 2}),
])
def test_generate_equals_greedy_full_forward(attention, options):
    from sketchlab.tasks import TransformerConfig, TransformerLM, generate

    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=2, mlp_ratio=2, attention=attention,
                            short_conv=2, attention_options=options)
    model = TransformerLM(cfg).double()
    for p in model.parameters():  # larger weights than the init, so the argmax is decided by the context
        with torch.no_grad():
            p.add_(torch.randn_like(p) * 0.3)
    prompt = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    out = generate(model, prompt, 12)
    assert out.shape == (2, 17) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, _greedy_by_full_passes(model, prompt, 12))
    # the logits themselves, step by step, equal the full forward pass
    with torch.no_grad():
        full = model(out)
        logits, cache = model.forward_step(out[:, :9])
        steps = [logits] + [model.forward_step(out[:, t:t + 1], cache)[0] for t in range(9, 10)]
    assert (torch.cat(steps, 1) - full[:, :10]).abs().max() < 1e-10


def test_linear_attention_decoding_memory_is_constant_in_context():
    from sketchlab.tasks import TransformerConfig, TransformerLM
    from sketchlab.tasks.model import cache_nbytes

    cfg = TransformerConfig(vocab_size=7, d_model=16, n_heads=2, n_layers=1, attention="llops", short_conv=2,
                            attention_options={"window": 4, "sinks": 2, "m": 8, "backend": "torch"})
    model = TransformerLM(cfg)
    sizes = []
    with torch.no_grad():
        _, cache = model.forward_step(torch.zeros(1, 6, dtype=torch.long))
        for t in range(20):
            _, cache = model.forward_step(torch.zeros(1, 1, dtype=torch.long), cache)
            sizes.append(cache_nbytes(cache))
    assert len(set(sizes)) == 1 and sizes[0] > 0


def test_state_to_and_detach_keep_the_masks_bool():
    q, k, v = _rand(1, 6, 2, 4, seed=41), _rand(1, 6, 2, 4, seed=42), _rand(1, 6, 2, 3, seed=43)
    theta = _theta(seed=44)
    mask = torch.tensor([[True, True, False, True, True, True]])
    _, state = run_llops(q, k, v, theta, theta, window=3, sinks=1, key_padding_mask=mask,
                               output_final_state=True, backend="torch")
    half = state.to(torch.float32).detach()
    assert half.S.dtype == torch.float32 and half.mask_window.dtype == torch.bool
    assert torch.equal(half.mask_window, mask[:, -3:]) and torch.equal(half.mask_sink, mask[:, :1])
    assert half.nbytes < state.nbytes and half.offset == 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_keep_the_state_in_float32(dtype):
    """bf16/fp16 on the torch path: sums and state in float32, output in the input dtype. Error
    bound: the inputs' own rounding (bf16 ~4e-3, fp16 ~5e-4 relative) through O(1) weights; 2e-2 / 5e-3."""
    q, k, v = _rand(1, 40, 2, 8, seed=51), _rand(1, 40, 2, 8, seed=52), _rand(1, 40, 2, 3, seed=53)
    theta = _theta(D=8, seed=54)
    low = [x.to(dtype) for x in (q, k, v, theta)]
    ref = run_llops(*(x.double() for x in low[:3]), low[3].double(), low[3].double(), window=5, sinks=2,
                          backend="reference")
    out, state = run_llops(*low[:3], low[3], low[3], window=5, sinks=2, backend="torch", chunk_size=8,
                                 output_final_state=True)
    assert out.dtype == dtype and state.S.dtype == torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    assert (out.double() - ref).abs().max() / ref.abs().max() < tol


def test_a_state_mask_on_another_device_is_refused():
    """The state's padding masks must live with the inputs, like its tensors (a meta tensor stands in
    for another device on a CPU-only machine)."""
    import dataclasses

    q, k, v = _rand(1, 8, 2, 4, seed=1), _rand(1, 8, 2, 4, seed=2), _rand(1, 8, 2, 3, seed=3)
    mask = torch.ones(1, 8, dtype=torch.bool)
    mask[0, 6] = False
    theta = _theta()
    _, state = run_llops(q, k, v, theta, theta, window=3, sinks=1, key_padding_mask=mask, backend="torch",
                               output_final_state=True)
    assert state.mask_window is not None
    moved = dataclasses.replace(state, mask_window=state.mask_window.to("meta"))
    with pytest.raises(ValueError, match="initial_state.mask_window is on meta"):
        run_llops(q[:, :2], k[:, :2], v[:, :2], theta, theta, window=3, sinks=1, backend="torch",
                        initial_state=moved)


@pytest.mark.parametrize("window", [0, 3])
def test_a_state_of_another_dtype_continues_cast_to_the_calls(window):
    # the torch path computes in its inputs' dtype (float32 for half inputs): a float64 state from
    # backend "reference", or one kept in bfloat16 to save memory, is cast to it (both once failed
    # with raw dtype errors). Float32 against float32: 1e-5 is ~100 ulp after sums of 12 terms; the
    # bfloat16 state carries 3 significant digits, so 3e-2 on outputs of size O(1).
    q, k, v = (_rand(1, 12, 2, 4, seed=s) for s in (1, 2, 3))
    th = _theta()
    kw = dict(window=window, sinks=1 if window else 0)
    f32 = [x.float() for x in (q, k, v)]
    whole = run_llops(*f32, th.float(), th.float(), backend="torch", **kw)
    _, st64 = run_llops(q[:, :7], k[:, :7], v[:, :7], th, th, backend="reference", output_final_state=True, **kw)
    assert st64.S.dtype == torch.float64
    for st, tol in ((st64, 1e-5), (st64.to(torch.bfloat16), 3e-2)):
        for T in (1, 5):  # one-token decoding and a chunked call
            out = run_llops(*(x[:, 7:7 + T] for x in f32), th.float(), th.float(), backend="torch",
                                  initial_state=st, **kw)
            assert out.dtype == torch.float32
            assert (out - whole[:, 7:7 + T]).abs().max() < tol, (T, (out - whole[:, 7:7 + T]).abs().max().item())
