"""The options object at the one op (issue 33 and 40, DESIGN §7): the gate through ``params`` is the gate
given, bad options and params are refused, memory options route to ``memory_attention`` (its twin with
``backend="reference"``), and each option's rule is the one of ``AttentionOptions``.

Tolerances: equal paths are compared with ``torch.equal`` (one computation, two ways to ask for it);
a route against a direct call of the memory functions on the same features likewise (same calls).
"""

import pytest
import torch
from attention_calls import run_llops

import sketchlab as sl
from sketchlab.attention import AttentionOptions, FarParams, MemoryState, linear_attention
from sketchlab.attention.memory import memory_attention, memory_attention_naive
from sketchlab.featuremaps import HedgehogMap, LLoPSMap
from sketchlab.llops import llops_features
from sketchlab.polynomial import self_tensor

B, T, H, D = 2, 21, 2, 4


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _qkv(seed=0):
    return _rand(B, T, H, D, seed=seed) * 0.7, _rand(B, T, H, D, seed=seed + 1) * 0.7, _rand(B, T, H, D, seed=seed + 2)


def _theta(seed=5, equal=True):
    base = _rand(H, 1, 1, D, 6, seed=seed) / 2
    return base.expand(-1, -1, 2, -1, -1).clone() if equal else _rand(H, 2, 2, D, 6, seed=seed) / 2


def _params(options, seed=0):
    p = FarParams(options, H, D).double()
    with torch.no_grad():
        for i, (_, x) in enumerate(sorted(p.named_parameters())):
            x.copy_(_rand(*x.shape, seed=100 + seed + i) * 0.7)
    return p


HYBRID = dict(window=5, sinks=2, local="softmax", local_scale=0.8, eps=1e-5, chunk_size=8)


def _op(fmap, fmap_k=None):
    """The op on ``fmap`` (and ``fmap_k``), returning ``o`` alone unless ``output_final_state``."""

    def call(q, k, v, *, options=None, output_final_state=False, **call_keywords):
        out, state = linear_attention(q, k, v, fmap, fmap_k, options=options, output_final_state=output_final_state,
                                      **call_keywords)
        return (out, state) if output_final_state else out

    return call


def _callers():
    """name → (call(q, k, v, **kw): the op, on LLoPS maps of a raw Θ (``llops``) or on maps, the features its
    memory route must see (fq, fk; ``delta=True``: under the
    delta state), degree)."""
    theta = _theta()
    tq, tk = _theta(7, equal=False), _theta(8, equal=False)
    hedgehog = HedgehogMap(H, D, m=4, seed=0, dtype=torch.float64)
    lmap = LLoPSMap(H, D, theta=tq)
    lmap_k = LLoPSMap(H, D, theta=tk)
    feats = lambda x, t: llops_features(x.transpose(1, 2), t).transpose(1, 2)  # noqa: E731
    return {
        "llops": (lambda q, k, v, **kw: run_llops(q, k, v, theta, theta, **kw),
                  lambda q, k, delta=False: (feats(q, theta), feats(k, theta)), 2),
        # a signed map: self-tensored under a denominator, as it is under the delta state (none)
        "op_llops": (_op(lmap),
                             lambda q, k, delta=False: tuple(x if delta else self_tensor(x)
                                                             for x in (feats(q, tq), feats(k, tq))), 2),
        "op_hedgehog": (_op(hedgehog),
                                lambda q, k, delta=False: (hedgehog.features(q), hedgehog.features(k)), None),
        # an untied pair of signed maps: self-tensored under a denominator as one map is
        "op_llops_pair": (_op(lmap, lmap_k),
                          lambda q, k, delta=False: tuple(x if delta else self_tensor(x)
                                                          for x in (feats(q, tq), feats(k, tk))), 2),
    }


CALLERS = list(_callers())


@pytest.mark.parametrize("name", CALLERS)
def test_the_gate_in_params_is_the_gate_given(name):
    """A non-memory call may carry its gate in ``params``: the same call as ``gate=params.gate``."""
    call = _callers()[name][0]
    q, k, v = _qkv()
    options = AttentionOptions(**HYBRID)
    params = FarParams(options, H, D).double()
    with torch.no_grad():
        params.gate.copy_(_rand(H, seed=9))
    out, state = call(q, k, v, options=options, params=params, output_final_state=True)
    ref, s_ref = call(q, k, v, options=options, gate=params.gate, output_final_state=True)
    assert torch.equal(out, ref) and torch.equal(state.S, s_ref.S)
    assert not torch.equal(out, call(q, k, v, options=options))  # the gate matters (g = 1/2 without it)


@pytest.mark.parametrize("name", CALLERS)
def test_bad_options_and_params_are_refused(name):
    call = _callers()[name][0]
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="options must be an AttentionOptions"):
        call(q, k, v, options=dict(window=2))
    with pytest.raises(TypeError, match="params must be a FarParams"):
        call(q, k, v, params=torch.zeros(H))
    with pytest.raises(ValueError, match="params.decay_bias is set but the options have no memory"):
        call(q, k, v, options=AttentionOptions(window=2), params=FarParams(AttentionOptions(window=2, decay="head"), H, D))
    params = FarParams(AttentionOptions(window=2), H, D).double()
    with pytest.raises(ValueError, match="gate= and params.gate are both set"):
        call(q, k, v, options=AttentionOptions(window=2), params=params, gate=torch.zeros(H, dtype=torch.float64))


MEMORY = {
    "cache": dict(window=4, sinks=1, cache=3),
    "decay_input": dict(window=4, sinks=1, decay="input"),
    "delta": dict(window=4, state="delta", beta="input"),
    "delta_cache": dict(window=4, sinks=1, state="delta", cache=2, decay="head"),
    "pure_decay": dict(decay=0.9),
}


@pytest.mark.parametrize("name", CALLERS)
@pytest.mark.parametrize("mechanism", MEMORY)
def test_memory_options_run_memory_attention(name, mechanism):
    """The route: the map's features (self-tensored when the call says so) into memory_attention with
    the same options, params, gate and state; the state a MemoryState."""
    call, features, degree = _callers()[name]
    q, k, v = _qkv(seed=3)
    opts = AttentionOptions(chunk_size=8, **MEMORY[mechanism])
    params = _params(opts)
    gate = _rand(H, seed=11) if opts.window else None
    if gate is not None:
        params.gate = None
    out, state = call(q, k, v, options=opts, params=params, gate=gate, output_final_state=True)
    fq, fk = features(q, k, delta=opts.state == "delta")
    ref, ref_state = memory_attention(fq, fk, v, q, k, options=opts, params=params, gate=gate, degree=degree,
                                      output_final_state=True)
    assert isinstance(state, MemoryState)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    assert torch.allclose(state.S, ref_state.S, atol=1e-12, rtol=0)
    assert torch.equal(state.pos_cache, ref_state.pos_cache)
    # continued from its state: the second half of a split equals the whole's
    whole = call(q, k, v, options=opts, params=params, gate=gate)
    _, s1 = call(q[:, :8], k[:, :8], v[:, :8], options=opts, params=params, gate=gate, output_final_state=True)
    second = call(q[:, 8:], k[:, 8:], v[:, 8:], options=opts, params=params, gate=gate, initial_state=s1)
    assert torch.allclose(second, whole[:, 8:], atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", CALLERS)
def test_memory_reference_backend_is_the_naive_twin(name):
    call, features, degree = _callers()[name]
    q, k, v = _qkv(seed=4)
    opts = AttentionOptions(window=4, sinks=1, cache=2, decay="head", backend="reference")
    params = _params(opts)
    out = call(q, k, v, options=opts, params=params)
    fq, fk = features(q, k)
    ref = memory_attention_naive(fq, fk, v, q, k, options=opts, params=params, degree=degree)
    assert out.dtype == torch.float64
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)


def test_memory_refuses_the_fused_kernel_and_decay_one_is_not_memory():
    q, k, v = _qkv()
    theta = _theta()
    with pytest.raises(ValueError, match="have no fused kernel"):
        run_llops(q, k, v, theta, theta, options=AttentionOptions(window=2, cache=2, backend="triton"))
    # decay=1.0 is no decay: today's hybrid, bit for bit, and its AttentionState
    ref, s_ref = run_llops(q, k, v, theta, theta, window=4, sinks=1, output_final_state=True)
    out, s_out = run_llops(q, k, v, theta, theta, options=AttentionOptions(window=4, sinks=1, decay=1.0),
                                 output_final_state=True)
    assert torch.equal(out, ref) and type(s_out) is type(s_ref) and not isinstance(s_out, MemoryState)


def test_non_negative_none_lets_the_map_decide():
    """llops: a Θ that can be signed is self-tensored under options.non_negative=None (as
    linear_attention and LLoPSAttention decide); equal factors are not."""
    q, k, v = _qkv()
    signed, safe = _theta(7, equal=False), _theta()
    for theta, lifted in ((signed, True), (safe, False)):
        out = run_llops(q, k, v, theta, theta, options=AttentionOptions(non_negative=None))
        assert torch.equal(out, run_llops(q, k, v, theta, theta, non_negative=lifted))


# ------------------------------------------------------------------ one rule per option, one message
def _message(fn):
    with pytest.raises((ValueError, TypeError)) as err:
        fn()
    return str(err.value)


def test_the_checks_are_the_options_rules():
    from sketchlab.attention import _checks

    for fn, name, value in ((_checks.check_normalize, "normalize", "max"), (_checks.check_eps, "eps", -2.0),
                            (_checks.check_denominator_check, "denominator_check", "loud"),
                            (_checks.check_backend_name, "backend", "gpu")):
        assert _message(lambda: fn(value)) == _message(lambda: AttentionOptions(**{name: value}))
    for kw in (dict(window=0, sinks=2), dict(window=3, normalize="none"), dict(local="relu"),
               dict(local_scale=0.0), dict(window=-1)):
        hybrid = dict(window=0, sinks=0, local="softmax", local_scale=None, normalize="sum")
        hybrid.update(kw)
        normalize = hybrid.pop("normalize")
        got = _message(lambda: _checks.check_hybrid(*hybrid.values(), None, normalize=normalize, heads=1, dim=4,
                                                    like=torch.zeros(1)))
        assert got == _message(lambda: AttentionOptions(**kw))


def test_exports():
    """The public attention API: the one op, the exact attentions (with their float64 twins), the block, the
    options and the state types; the entry points the op replaced are not public (issue 40)."""
    import sketchlab.attention as sa

    for name in ("AttentionOptions", "FarParams", "MemoryState", "AttentionState", "LLoPSAttention",
                 "linear_attention", "softmax_attention", "poly_attention"):
        assert getattr(sl, name) is getattr(sa, name)
        assert name in sl.__all__ and name in sa.__all__
    for gone in ("featuremap_attention", "llops_attention", "sketch_attention", "feature_attention",
                 "llops_attention_chunked", "memory_attention", "memory_attention_naive", "llops_attention_naive",
                 "feature_attention_naive", "kernel_attention_naive", "self_tensor", "llops_is_non_negative"):
        assert gone not in sa.__all__ and gone not in sl.__all__ and not hasattr(sl, gone), gone
    # the keyword entry points the op replaced exist nowhere: not in the modules that held them, not as a module
    import importlib.util

    from sketchlab.attention import _entry, functional, reference

    for gone in ("llops_attention", "feature_attention", "llops_attention_chunked", "llops_attention_naive",
                 "call_options", "keyword_defaults"):
        assert not any(hasattr(m, gone) for m in (sa, functional, reference, _entry)), gone
    assert importlib.util.find_spec("sketchlab.attention.chunked") is None


def test_kernel_range_bound_is_cached_per_theta_version():
    """The Θ part of the kernel-range check is cached per tensor (a decoding loop passes one Θ every
    token) and recomputed after an in-place change: a Θ scaled in place into underflow is refused."""
    q, k, v = _qkv()
    theta = _theta()
    run_llops(q, k, v, theta, theta)
    with torch.no_grad():
        theta.mul_(1e-90)  # features (θ·x)² ~ 1e-180 each: every kernel value underflows float64
    with pytest.raises(ValueError, match="underflow"):
        run_llops(q, k, v, theta, theta)
