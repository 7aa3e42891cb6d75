"""Long-context memory (DESIGN §7): the fast path against its float64 twin, against today's hybrid
and softmax attention, split and step against the whole, gradients, a hand-computed cache, refusals.

Tolerances (float64): 1e-10. The fast path and the twin add the same O(1) terms in another order
(chunked sums, the WY form of the delta rule: round-off ~1e-15 per term, observed <= 2e-14).
Schedules are discrete choices; on these random problems the scores of competing keys differ far
above round-off, which ``test_choices_stable`` checks for the gradcheck problems.
"""

import math

import pytest
import torch

from sketchlab.attention import softmax_attention_naive
from sketchlab.attention.memory import (
    MemoryState,
    empty_memory_state,
    memory_attention,
    memory_attention_naive,
)
from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.attention.ops.delta.beta import unit
from sketchlab.attention.ops.delta.naive import delta_rule_naive
from sketchlab.attention.ops.hybrid import local_far_masks
from sketchlab.attention.options import AttentionOptions, FarParams

TOL64 = 1e-10
B, H, D, DV = 2, 2, 4, 3
FLOATS = ("S", "z", "k_window", "v_window", "phi_window", "k_sink", "v_sink", "k_cache", "v_cache", "phi_cache",
          "score_cache")
EXACT = ("mask_window", "mask_sink", "cached", "pos_cache")


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _problem(T, M, seed=0, dtype=torch.float64):
    """Features ``φ = x²`` (non-negative: a safe normaliser), raw q, k, values."""
    fq, fk = _rand(B, T, H, M, seed=seed).square(), _rand(B, T, H, M, seed=seed + 1).square()
    q, k, v = _rand(B, T, H, D, seed=seed + 2), _rand(B, T, H, D, seed=seed + 3), _rand(B, T, H, DV, seed=seed + 4)
    return [x.to(dtype) for x in (fq, fk, v, q, k)]


def _params(options, seed=0):
    p = FarParams(options, H, DV).double()
    with torch.no_grad():
        for i, (_, x) in enumerate(sorted(p.named_parameters())):
            x.copy_(_rand(*x.shape, seed=100 + seed + i) * 0.7)
    return p


def _mask(T):
    """Left pads in row 0, pads between tokens in row 1."""
    m = torch.ones(B, T, dtype=torch.bool)
    m[0, :3] = False
    m[1, 9] = m[1, 17] = m[1, 18] = False
    return m


def _assert_states(a, b, tol=TOL64):
    assert a.offset == b.offset
    for name in FLOATS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape, name
        assert (x.double() - y.double()).abs().max().item() <= tol if x.numel() else True, name
    for name in EXACT:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


MECHANISMS = {
    "cache": dict(cache=3),
    "cache1_rescore5": dict(cache=1, rescore=5),
    "cache_all": dict(cache=45),
    "decay_fixed": dict(decay=0.9),
    "decay_head": dict(decay="head"),
    "decay_input": dict(decay="input"),
    "delta_head": dict(state="delta"),
    "delta_input": dict(state="delta", beta="input"),
    "delta_cache_decay": dict(state="delta", beta="input", cache=3, decay="input", rescore=4),
    "cache_decay": dict(cache=2, decay="head", rescore=7),
    "cache_poly": dict(cache=3, local="poly"),
}


@pytest.mark.parametrize("name", MECHANISMS)
@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("padded", [False, True])
def test_fast_equals_naive(name, sinks, padded):
    T, M = 37, 3 + len(name) % 7
    window = 1 if "rescore" in name else 4
    options = AttentionOptions(window=window, sinks=sinks, chunk_size=8, **MECHANISMS[name])
    fq, fk, v, q, k = _problem(T, M, seed=len(name))
    kw = dict(options=options, params=_params(options), degree=2, key_padding_mask=_mask(T) if padded else None,
              output_final_state=True)
    want, want_state = memory_attention_naive(fq, fk, v, q, k, **kw)
    got, got_state = memory_attention(fq, fk, v, q, k, **kw)
    assert (got - want).abs().max().item() <= TOL64
    _assert_states(got_state, want_state)
    if options.cache:  # the cache was used: it filled, and (with room for fewer keys than left) evicted
        assert bool(want_state.cached.any())


@pytest.mark.parametrize("window, sinks, local", [(1, 0, "softmax"), (4, 2, "softmax"), (3, 2, "poly")])
@pytest.mark.parametrize("decay", [None, 1.0])
@pytest.mark.parametrize("padded", [False, True])
def test_memory_off_is_todays_hybrid(window, sinks, local, decay, padded):
    T, M = 29, 5
    options = AttentionOptions(window=window, sinks=sinks, local=local, decay=decay, chunk_size=8)
    assert not options.memory
    fq, fk, v, q, k = _problem(T, M, seed=3)
    params = _params(options)
    mask = _mask(T) if padded else None
    want = feature_attention_naive(fq, fk, v, q=q, k=k, window=window, sinks=sinks, local=local, degree=2,
                                   gate=params.gate, key_padding_mask=mask)
    for fn in (memory_attention_naive, memory_attention):
        got = fn(fq, fk, v, q, k, options=options, params=params, degree=2, key_padding_mask=mask)
        assert (got - want).abs().max().item() <= TOL64, fn.__name__


@pytest.mark.parametrize("normalize", ["sum", "none"])
def test_pure_linear_is_todays(normalize):
    """window = 0, no memory: pure linear attention (no gate, no exact part)."""
    fq, fk, v, _, _ = _problem(23, 4, seed=5)
    options = AttentionOptions(normalize=normalize, chunk_size=5)
    want = feature_attention_naive(fq, fk, v, normalize=normalize)
    for fn in (memory_attention_naive, memory_attention):
        assert (fn(fq, fk, v, options=options) - want).abs().max().item() <= TOL64


@pytest.mark.parametrize("window, sinks", [(1, 0), (3, 2)])
@pytest.mark.parametrize("padded", [False, True])
def test_cache_holding_everything_is_softmax(window, sinks, padded):
    """K >= T with the softmax window and eps = 0: every key stays exact, the state stays empty."""
    T = 31
    options = AttentionOptions(window=window, sinks=sinks, cache=T + 5, eps=0.0, chunk_size=8)
    fq, fk, v, q, k = _problem(T, 3, seed=7)
    mask = _mask(T) if padded else None
    want = softmax_attention_naive(q, k, v, key_padding_mask=mask)
    rows = mask if padded else torch.ones(B, T, dtype=torch.bool)  # a pad query sees other keys
    for fn in (memory_attention_naive, memory_attention):
        got = fn(fq, fk, v, q, k, options=options, params=_params(options), key_padding_mask=mask)
        assert (got - want)[rows].abs().max().item() <= TOL64, fn.__name__


def _dense_decayed(fq, fk, v, q, k, gamma, window, sinks, g, eps, real):
    """The hybrid with far weights γ^(real steps in (j + w, t]) (key j entered the state at step j + w;
    a pad step does not decay): dense, float64. ``real [B, T]``: not a pad."""
    T = fq.shape[1]
    pos = torch.arange(T)
    near, far = local_far_masks(pos, pos, pos, window=window, sinks=sinks, causal=True)  # [T, T]
    seen = real[:, None, None, :]  # [B, 1, 1, T]: pads are no key
    count = real.double().cumsum(1)  # [B, T]: real steps up to t
    enter = (pos + window).clamp(max=T - 1)  # the step key j enters (far keys only use j + w <= t)
    lag = (count[:, :, None] - count[:, None, enter]).clamp(min=0)  # [B, T, T]: real steps in (j + w, t]
    fs = torch.einsum("bthm,bjhm->bhtj", fq, fk) * gamma[None, :, None, None] ** lag[:, None] * (far & seen)
    logits = torch.einsum("bthd,bjhd->bhtj", q, k) / math.sqrt(D)
    logits = logits.masked_fill(~(near & seen), -math.inf)
    a = (logits - logits.amax(-1, keepdim=True)).exp()
    gg = g[None, :, None, None]
    num = gg * (a @ v.transpose(1, 2)) + (1 - gg) * (fs @ v.transpose(1, 2))
    den = gg[..., 0] * a.sum(-1) + (1 - gg[..., 0]) * fs.sum(-1)
    return (num / (den + eps)[..., None]).transpose(1, 2)


@pytest.mark.parametrize("decay", [0.8, "head"])
@pytest.mark.parametrize("padded", [False, True])
def test_decay_closed_form(decay, padded):
    """K = 0 with a decay: each far key weighted by γ per real step since it entered (no twin involved)."""
    T, window, sinks = 26, 3, 2
    options = AttentionOptions(window=window, sinks=sinks, decay=decay, chunk_size=8)
    params = _params(options)
    fq, fk, v, q, k = _problem(T, 4, seed=11)
    mask = _mask(T) if padded else torch.ones(B, T, dtype=torch.bool)
    gamma = torch.full((H,), 0.8, dtype=torch.float64) if decay == 0.8 else torch.sigmoid(params.decay_bias)
    want = _dense_decayed(fq, fk, v, q, k, gamma, window, sinks, torch.sigmoid(params.gate), options.eps, mask)
    for fn in (memory_attention_naive, memory_attention):
        got = fn(fq, fk, v, q, k, options=options, params=params, key_padding_mask=mask if padded else None)
        assert (got - want)[mask].abs().max().item() <= TOL64, fn.__name__


@pytest.mark.parametrize("state", ["additive", "delta"])
def test_left_pads_change_nothing(state):
    """Without sinks and cache (whose positions and rescoring count pads), left pads are invisible:
    they never enter the window's keys, the state, nor its decay."""
    T, pads = 21, 4
    options = AttentionOptions(window=3, decay="input", state=state, chunk_size=4)
    params = _params(options)
    fq, fk, v, q, k = _problem(T, 4, seed=37)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :pads] = False
    for fn in (memory_attention_naive, memory_attention):
        padded = fn(fq, fk, v, q, k, options=options, params=params, key_padding_mask=mask)
        alone = fn(*[x[:, pads:] for x in (fq, fk, v, q, k)], options=options, params=params)
        assert (padded[:, pads:] - alone).abs().max().item() <= TOL64, fn.__name__


def test_delta_far_part_is_the_delta_rule_on_shifted_keys():
    """K = 0, state='delta': the far part is delta.py's rule over the keys leaving the window (each at
    step j + w, β from its own value), read with q̂; mixed with the exact window's softmax by the gate."""
    T, window = 19, 2
    options = AttentionOptions(window=window, state="delta", beta="input", chunk_size=4)
    params = _params(options)
    fq, fk, v, q, k = _problem(T, 4, seed=13)
    shift = lambda x: torch.cat([torch.zeros_like(x[:, :window]), x[:, :-window]], 1)  # noqa: E731  key t − w at t
    kh, vs = shift(unit(fk)), shift(v)
    beta = shift(torch.sigmoid(params.beta_bias + (v * params.beta_weight).sum(-1)))
    far, _ = delta_rule_naive(unit(fq), kh, vs, beta)
    logits = torch.einsum("bthd,bjhd->bhtj", q, k) / math.sqrt(D)
    pos = torch.arange(T)
    near = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    exact = (logits.masked_fill(~near, -math.inf).softmax(-1) @ v.transpose(1, 2)).transpose(1, 2)
    g = torch.sigmoid(params.gate)[None, None, :, None]
    want = g * exact + (1 - g) * far
    for fn in (memory_attention_naive, memory_attention):
        got = fn(fq, fk, v, q, k, options=options, params=params)
        assert (got - want).abs().max().item() <= TOL64, fn.__name__


SPLIT_CASES = {
    "cache_decay": dict(cache=3, decay="input", rescore=5),
    "delta_cache_decay": dict(state="delta", beta="input", cache=3, decay="head", rescore=6),
}


@pytest.mark.parametrize("name", SPLIT_CASES)
@pytest.mark.parametrize("fn", [memory_attention, memory_attention_naive])
@pytest.mark.parametrize("padded", [False, True])
def test_split_anywhere_equals_whole(name, fn, padded):
    """Cuts inside the window's and the sinks' fill (1, 3), after the cache fills (17), and two
    adjacent ones (30, 31); the state passed on."""
    T = 41
    options = AttentionOptions(window=4, sinks=2, chunk_size=8, **SPLIT_CASES[name])
    params = _params(options)
    fq, fk, v, q, k = _problem(T, 5, seed=17)
    mask = _mask(T) if padded else None
    kw = dict(options=options, params=params, output_final_state=True)
    whole, whole_state = fn(fq, fk, v, q, k, key_padding_mask=mask, **kw)
    outs, state = [], None
    bounds = [0, 1, 3, 17, 30, 31, T]
    for a, b in zip(bounds[:-1], bounds[1:]):
        sl = lambda x: x[:, a:b]  # noqa: E731
        out, state = fn(sl(fq), sl(fk), sl(v), sl(q), sl(k), key_padding_mask=None if mask is None else mask[:, a:b],
                        initial_state=state, **kw)
        assert isinstance(state, MemoryState) and state.offset == b
        outs.append(out)
    assert (torch.cat(outs, 1) - whole).abs().max().item() <= TOL64
    _assert_states(state, whole_state)


def test_step_equals_forward():
    """A loop of T = 1 calls (decoding), pads among them, equals one call."""
    T = 33
    options = AttentionOptions(window=3, sinks=2, cache=4, decay="input", state="delta", beta="input", rescore=5)
    params = _params(options)
    fq, fk, v, q, k = _problem(T, 4, seed=19)
    mask = _mask(T)
    kw = dict(options=options, params=params, output_final_state=True)
    whole, whole_state = memory_attention(fq, fk, v, q, k, key_padding_mask=mask, **kw)
    outs, state = [], None
    for t in range(T):
        sl = lambda x: x[:, t:t + 1]  # noqa: E731
        out, state = memory_attention(sl(fq), sl(fk), sl(v), sl(q), sl(k), key_padding_mask=mask[:, t:t + 1],
                                      initial_state=state, **kw)
        outs.append(out)
    assert (torch.cat(outs, 1) - whole).abs().max().item() <= TOL64
    _assert_states(state, whole_state)


def test_state_size_is_flat():
    options = AttentionOptions(window=8, sinks=2, cache=6, decay="head", state="delta")
    params = _params(options).float()
    fq, fk, v, q, k = _problem(500, 4, seed=23, dtype=torch.float32)
    with torch.no_grad():
        _, s50 = memory_attention(fq[:, :50], fk[:, :50], v[:, :50], q[:, :50], k[:, :50], options=options,
                                  params=params, output_final_state=True)
        _, s500 = memory_attention(fq, fk, v, q, k, options=options, params=params, output_final_state=True)
    assert s50.nbytes == s500.nbytes > 0
    assert s500.k_cache.shape[2] == 6 and s500.k_window.shape[2] == 8


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_low_precision_inputs(dtype, tol):
    """float32 runs in float32; half inputs in float32 with a float32 state and the output cast back.
    Tolerances: float32 round-off on O(1) outputs (~1e-6) far below 1e-4; bf16 inputs hold 3 digits."""
    options = AttentionOptions(window=3, sinks=2, cache=3, decay="head", chunk_size=8)
    fq, fk, v, q, k = _problem(20, 4, seed=29, dtype=dtype)
    params = _params(options).to(dtype)
    out, state = memory_attention(fq, fk, v, q, k, options=options, params=params, output_final_state=True)
    assert out.dtype == dtype and state.S.dtype == torch.float32 and state.k_cache.dtype == torch.float32
    want, want_state = memory_attention_naive(fq, fk, v, q, k, options=options, params=params, output_final_state=True)
    assert (out.double() - want).abs().max().item() < tol
    assert torch.equal(state.pos_cache, want_state.pos_cache)


def test_denominator_check():
    """Signed features: a normalising denominator <= 0 warns, or raises with denominator_check='raise'."""
    fq, fk, v, q, k = _problem(12, 3, seed=41)
    fq = -fq  # every far kernel value < 0: with the gate near 0 the denominators are negative
    options = AttentionOptions(window=1, decay=0.9, denominator_check="raise")
    params = _params(options)
    with torch.no_grad():
        params.gate.fill_(-30.0)
    for fn in (memory_attention_naive, memory_attention):
        with pytest.raises(FloatingPointError, match="normalising denominator <= 0"):
            fn(fq, fk, v, q, k, options=options, params=params)
        with pytest.warns(RuntimeWarning, match="normalising denominator <= 0"):
            fn(fq, fk, v, q, k, options=options.replace(denominator_check="warn"), params=params)


# ------------------------------------------------------------------------------------------------ hand-computed
def _hand(values, rescore, eps=0.0):
    """w = 1, K = 1, no sinks, φ = 1 everywhere: key j leaves at step j + 1; the state's recall of
    any key is the mean of the values in it (additive), so each score is by hand."""
    T = len(values)
    options = AttentionOptions(window=1, cache=1, rescore=rescore, eps=eps)
    v = torch.tensor(values, dtype=torch.float64)[None, :, None, :]  # [1, T, 1, 3]
    f = torch.ones(1, T, 1, 2, dtype=torch.float64)
    q = k = torch.zeros(1, T, 1, 2, dtype=torch.float64)
    outs = {}
    for fn in (memory_attention_naive, memory_attention):
        outs[fn.__name__] = [fn(f[:, :n], f[:, :n], v[:, :n], q[:, :n], k[:, :n], options=options,
                                output_final_state=True) for n in range(1, T + 1)]
    return outs


def test_hand_cache_keeps_the_worst_recalled_key():
    # step 1: key 0 cached (score |v0|² = 1). step 2: key 1 leaves (score |v1|² = 1.44): the cache holds
    # 2 > K keys, the least score (key 0) enters the state. step 3: key 2 leaves with score
    # |v2 − v0|² = 1 (the state recalls v0); key 1 keeps its score 1.44 (no rescoring) → key 2 enters,
    # key 1 stays. With rescore = 3, key 1 is re-scored at position 3: |v1 − v0|² = 0.04 → key 1 enters.
    vals = [[1.0, 0, 0], [1.2, 0, 0], [1.0, 1.0, 0], [0, 0, 5.0]]
    for rescore, kept in ((64, 1), (3, 2)):
        for name, runs in _hand(vals, rescore).items():
            assert [int(s.pos_cache) for _, s in runs] == [-1, 0, 1, kept], (name, rescore)
            _, s = runs[-1]
            entered = [0, 2] if rescore == 64 else [0, 1]  # the state: Σ φvᵀ of the keys that entered
            want_S = torch.tensor(vals, dtype=torch.float64)[entered].sum(0)
            assert torch.allclose(s.S[0, 0], want_S.expand(2, 3), atol=1e-12, rtol=0), (name, rescore)
            assert torch.allclose(s.z[0, 0], torch.full((2,), 2.0, dtype=torch.float64)), name
            # output at step 3 (q = k = 0: exact weights 1 each; far weights φq·φk = 2 per key in the state):
            # exact keys {3, kept}, state {0, entered}; g = 1/2 → o = (Σ_E v + 2·Σ_S v) / (2 + 2·2)
            o3 = runs[-1][0][0, 3, 0]
            want_o = (torch.tensor(vals[3]) + torch.tensor(vals[kept]) + 2 * want_S) / 6
            assert torch.allclose(o3, want_o.double(), atol=1e-12), (name, rescore)


def test_hand_cache_ties_evict_the_oldest():
    vals = [[1.0, 0, 0], [0, -1.0, 0], [0, 0, 0]]  # |v0|² = |v1|² = 1: key 0 (older) enters at step 2
    for name, runs in _hand(vals, 64).items():
        assert [int(s.pos_cache) for _, s in runs] == [-1, 0, 1], name
        assert torch.allclose(runs[-1][1].S[0, 0, 0], torch.tensor(vals[0], dtype=torch.float64)), name



def test_hand_cache_ties_between_cached_keys_evict_the_oldest():
    """K = 2, w = 1, φ = 1, eps = 0 (the state recalls the mean of its values; empty: 0). Key 0 (|v0|² = 0.25)
    enters at step 3 and key 2 takes its slot 0, beside key 1 in slot 1; at step 4 keys 1 and 2 tie
    (|v1|² = |v2|² = 1) below key 3's |v3 − v0|² = 9.25: key 1, the older (in the later slot), enters.
    With chunk_size 4 the tied keys are cached when a block (or chunk) starts."""
    vals = [[0.5, 0, 0], [1.0, 0, 0], [0, 1.0, 0], [0, 0, 3.0], [0, 0, 0]]
    v = torch.tensor(vals, dtype=torch.float64)[None, :, None, :]
    f = torch.ones(1, 5, 1, 2, dtype=torch.float64)
    q = k = torch.zeros(1, 5, 1, 2, dtype=torch.float64)
    for chunk in (4, 64):
        options = AttentionOptions(window=1, cache=2, eps=0.0, chunk_size=chunk)
        for fn in (memory_attention_naive, memory_attention):
            _, st = fn(f, f, v, q, k, options=options, output_final_state=True)
            assert st.pos_cache.tolist() == [[[2, 3]]], (fn.__name__, chunk)
            assert torch.allclose(st.S[0, 0, 0], v[0, 0, 0] + v[0, 1, 0]), (fn.__name__, chunk)

# ------------------------------------------------------------------------------------------------ gradients
GRAD_CASES = {
    "additive": dict(cache=2, decay="input", rescore=3),
    "delta": dict(cache=2, decay="input", state="delta", beta="input", rescore=3),
}
GRAD_T = 9


def _grad_problem(name):
    options = AttentionOptions(window=2, sinks=1, chunk_size=4, **GRAD_CASES[name])
    T, M = GRAD_T, 3
    g = torch.Generator().manual_seed(31)
    fq, fk = torch.rand(1, T, 2, M, generator=g, dtype=torch.float64) + 0.2, torch.rand(1, T, 2, M, generator=g, dtype=torch.float64) + 0.2
    q, k = torch.randn(1, T, 2, 2, generator=g, dtype=torch.float64), torch.randn(1, T, 2, 2, generator=g, dtype=torch.float64)
    v = torch.randn(1, T, 2, 2, generator=g, dtype=torch.float64) * 2
    params = FarParams(options, 2, 2).double()
    with torch.no_grad():
        for i, (_, x) in enumerate(sorted(params.named_parameters())):
            x.copy_(torch.randn(x.shape, generator=g, dtype=torch.float64) * 0.5)
    return options, params, [fq, fk, v, q, k]


def _call(fn, options, params, names, values, tensors):
    """``fn`` with the FarParams tensors ``names`` replaced by ``values`` (plain tensors: gradcheck's inputs)."""
    for name, x in zip(names, values):
        if name in params._parameters:
            del params._parameters[name]
        setattr(params, name, x)
    return fn(*tensors, options=options, params=params)


def _schedules(fn, options, params, tensors):
    """pos_cache after every prefix: the whole schedule."""
    return [fn(*[x[:, :n] for x in tensors], options=options, params=params, output_final_state=True)[1].pos_cache
            for n in range(1, GRAD_T + 1)]


@pytest.mark.parametrize("name", GRAD_CASES)
def test_choices_stable(name):
    """The gradcheck problems' schedules do not flip under perturbations 100× gradcheck's step."""
    options, params, tensors = _grad_problem(name)
    base = _schedules(memory_attention_naive, options, params, tensors)
    assert any(bool((s >= 0).all()) for s in base)  # the cache fills
    for seed in range(3):
        noisy = [x + 1e-4 * _rand(*x.shape, seed=40 + seed) for x in tensors]
        with torch.no_grad():
            for i, (_, p) in enumerate(params.named_parameters()):
                p.add_(1e-4 * _rand(*p.shape, seed=50 + seed + i))
        assert all(torch.equal(a, b) for a, b in zip(base, _schedules(memory_attention_naive, options, params, noisy)))


@pytest.mark.parametrize("name", GRAD_CASES)
def test_gradcheck(name):
    """Through v, φ_q, φ_k, q, k and every FarParams tensor, given the schedule."""
    options, params, tensors = _grad_problem(name)
    names = [n for n, _ in sorted(params.named_parameters())]
    assert set(names) == ({"gate", "decay_bias", "decay_weight"} | ({"beta_bias", "beta_weight"} if name == "delta" else set()))
    values = [getattr(params, n).detach().clone().requires_grad_() for n in names]
    inputs = [x.clone().requires_grad_() for x in tensors] + values
    n = len(tensors)

    def f(*xs):
        return _call(memory_attention, options, params, names, xs[n:], xs[:n])

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-6, fast_mode=True)


@pytest.mark.parametrize("name", GRAD_CASES)
def test_gradients_equal_the_twins(name):
    options, params, tensors = _grad_problem(name)
    names = [n for n, _ in sorted(params.named_parameters())]
    grads = {}
    for fn in (memory_attention_naive, memory_attention):
        values = [getattr(params, n).detach().clone().requires_grad_() for n in names]
        inputs = [x.clone().requires_grad_() for x in tensors]
        out = _call(fn, options, params, names, values, inputs)
        (out * _rand(*out.shape, seed=61)).sum().backward()
        grads[fn] = [x.grad for x in inputs + values]
    for a, b in zip(*grads.values()):
        assert (a - b).abs().max().item() <= TOL64


# ------------------------------------------------------------------------------------------------ refusals
def _ok():
    options = AttentionOptions(window=2, cache=2, decay="head")
    fq, fk, v, q, k = _problem(6, 3)
    return options, _params(options), fq, fk, v, q, k


@pytest.mark.parametrize("fn", [memory_attention, memory_attention_naive])
def test_refusals(fn):
    options, params, fq, fk, v, q, k = _ok()
    cases = [
        (dict(options={"window": 2}), TypeError, "options must be an AttentionOptions"),
        (dict(options=AttentionOptions(window=2, causal=False)), ValueError, "causal only"),
        (dict(params=None), ValueError, r"params.decay_bias is needed by decay='head'"),
        (dict(params="p"), TypeError, "params must be a FarParams"),
        (dict(params=_params(options.replace(decay="input"))), ValueError, "params.decay_weight is set but"),
        (dict(options=options.replace(local="poly")), TypeError, "degree"),
        (dict(key_padding_mask=torch.ones(B, 5, dtype=torch.bool)), ValueError, r"key_padding_mask must have shape"),
        (dict(initial_state="s"), TypeError, "initial_state must be a MemoryState"),
        (dict(initial_state=empty_memory_state(B, H, 3, D, DV, cache=3, like=fq)), ValueError,
         r"initial_state.k_cache must have shape \[2, 2, 2, 4\].*got \[2, 2, 3, 4\]"),
        (dict(output_final_state=1), TypeError, "output_final_state must be True or False"),
    ]
    for change, err, msg in cases:
        kw = dict(options=options, params=params, degree=None, key_padding_mask=None, initial_state=None,
                  output_final_state=False)
        kw.update(change)
        with pytest.raises(err, match=msg):
            fn(fq, fk, v, q, k, **kw)
    with pytest.raises(ValueError, match="window=2 > 0 needs the raw q and k"):
        fn(fq, fk, v, None, k, options=options, params=params)
    with pytest.raises(ValueError, match="must share the batch B"):
        fn(fq, fk, v, q[:, :, :1], k[:, :, :1], options=options, params=params)
    bad = _params(options)
    with torch.no_grad():
        bad.decay_bias[0] = float("nan")
    with pytest.raises(ValueError, match="params.decay_bias must be finite"):
        fn(fq, fk, v, q, k, options=options, params=bad)
    wrong = _params(options)
    del wrong._parameters["gate"]
    wrong.gate = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"params.gate must be a floating tensor of shape \[2\]"):
        fn(fq, fk, v, q, k, options=options, params=wrong)


def test_gate_given_apart_from_the_params_is_the_params_gate():
    """A module that keeps its gate outside its FarParams (a converted layer) passes it as ``gate=``:
    the same output as the gate inside the params; both at once are refused."""
    from sketchlab.attention.memory import memory_attention, memory_attention_naive
    from sketchlab.attention.options import AttentionOptions, FarParams

    gen = torch.Generator().manual_seed(11)
    B, T, H, D, M, Dv = 1, 20, 2, 4, 3, 3
    q, k = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64), torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    fq, fk = torch.rand(B, T, H, M, generator=gen, dtype=torch.float64), torch.rand(B, T, H, M, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64)
    opts = AttentionOptions(window=3, sinks=1, cache=2, decay="head")
    inside = FarParams(opts, H, Dv).double()
    apart = FarParams(opts, H, Dv, gate=False).double()
    with torch.no_grad():
        inside.gate.copy_(torch.tensor([1.5, -0.7], dtype=torch.float64))
    for fn in (memory_attention, memory_attention_naive):
        want = fn(fq, fk, v, q, k, options=opts, params=inside)
        got = fn(fq, fk, v, q, k, options=opts, params=apart, gate=inside.gate.detach())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
        assert float((fn(fq, fk, v, q, k, options=opts, params=apart) - want).abs().max()) > 1e-3  # g = 1/2 differs
        with pytest.raises(ValueError, match="both set"):
            fn(fq, fk, v, q, k, options=opts, params=inside, gate=inside.gate)


@pytest.mark.parametrize("like,dtype,want", [(torch.float64, None, torch.float64), (torch.bfloat16, None, torch.float32),
                                             (torch.float32, torch.float64, torch.float64)])
def test_empty_memory_state_holds_every_floating_field_in_the_state_dtype(like, dtype, want):
    """Every floating field of the empty state is in ``state_dtype(like.dtype)`` (or ``dtype``), not torch's
    default float32: a float64 run's first step adds float64 sums to them (issue 35 mutation round)."""
    import dataclasses

    state = empty_memory_state(2, 3, 5, 4, 6, cache=2, like=torch.zeros(1, dtype=like), dtype=dtype)
    floating = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
                if isinstance(getattr(state, f.name), torch.Tensor) and getattr(state, f.name).is_floating_point()}
    assert {"S", "z", "k_cache", "v_cache"} <= set(floating)
    assert {name: t.dtype for name, t in floating.items()} == {name: want for name in floating}
    assert state.S.shape == (2, 3, 5, 6) and state.k_cache.shape == (2, 3, 2, 4)


# ------------------------------------------------------------------------------------------------ the decoding branch
DECODE_CASES = dict(MECHANISMS, w0_decay=dict(window=0, decay="input"), w0_delta=dict(window=0, state="delta", beta="input"))


def _both_paths(monkeypatch, args, kw):
    """One call by the decoding branch and by the general path (``memory_fast._DECODE`` off)."""
    from sketchlab.attention import memory_fast

    got = memory_attention(*args, **kw)
    monkeypatch.setattr(memory_fast, "_DECODE", False)
    want = memory_attention(*args, **kw)
    monkeypatch.setattr(memory_fast, "_DECODE", True)
    return got, want


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name,sinks", [(name, sinks) for name in DECODE_CASES for sinks in (0, 2)
                                        if sinks == 0 or DECODE_CASES[name].get("window", 1)])  # sinks need a window
def test_decode_branch_equals_general_path(monkeypatch, name, sinks, padded):
    """Every step of a decoding loop (T = 1 with a state), the branch against the general path on the
    same incoming state: through the window's and sinks' fill, the cache filling and full, rescoring
    steps, pads; then the branch's own chain against one whole call."""
    cfg = dict(DECODE_CASES[name])
    window = cfg.pop("window", 1 if "rescore" in name else 4)
    T, M = 30, 3 + len(name) % 5
    options = AttentionOptions(window=window, sinks=sinks, chunk_size=8, **cfg)
    params = _params(options)
    fq, fk, v, q, k = _problem(T, M, seed=3 + len(name))
    mask = _mask(T) if padded else torch.ones(B, T, dtype=torch.bool)
    state, mine, outs, saw = None, None, [], set()
    for t in range(T):
        sl = lambda x: x[:, t:t + 1]  # noqa: E731
        args = [sl(x) for x in (fq, fk, v, q, k)]
        kw = dict(options=options, params=params, degree=2, key_padding_mask=mask[:, t:t + 1], output_final_state=True)
        if state is None:  # the first token: no state yet (the general path)
            state = memory_attention(*args, **kw)[1]
            mine, outs = state, [memory_attention(*args, **kw)[0]]
            continue
        (got, got_state), (want, want_state) = _both_paths(monkeypatch, args, dict(kw, initial_state=state))
        assert (got - want).abs().max().item() <= TOL64, t
        _assert_states(got_state, want_state)
        out, mine = memory_attention(*args, **dict(kw, initial_state=mine))  # the branch's own chain
        outs.append(out)
        if options.cache:
            saw.add(("full" if bool(state.cached.all()) else "filling", t % options.rescore == 0 and bool(state.cached.any())))
        state = want_state
    whole, whole_state = memory_attention(fq, fk, v, q, k, options=options, params=params, degree=2,
                                          key_padding_mask=mask, output_final_state=True)
    assert (torch.cat(outs, 1) - whole).abs().max().item() <= TOL64
    _assert_states(mine, whole_state)
    if options.cache and options.cache < 10:  # the loop met a filling cache, a full one, and rescoring steps
        assert {"filling", "full"} <= {a for a, _ in saw}, saw
        assert any(r for _, r in saw) or options.rescore >= T, saw


def test_decode_branch_ties_evict_the_oldest(monkeypatch):
    """The hand problem's tie (|v0|² = |v1|²), decoded token by token through the branch."""
    vals = [[1.0, 0, 0], [0, -1.0, 0], [0, 0, 0], [0, 2.0, 0]]
    options = AttentionOptions(window=1, cache=1, eps=0.0)
    v = torch.tensor(vals, dtype=torch.float64)[None, :, None, :]
    f = torch.ones(1, 4, 1, 2, dtype=torch.float64)
    q = k = torch.zeros(1, 4, 1, 2, dtype=torch.float64)
    state, seen = None, []
    for t in range(4):
        sl = lambda x: x[:, t:t + 1]  # noqa: E731
        _, state = memory_attention(sl(f), sl(f), sl(v), sl(q), sl(k), options=options, initial_state=state,
                                    output_final_state=True)
        seen.append(int(state.pos_cache))
    # step 2: keys 0 and 1 tie (|v0|² = |v1|² = 1): key 0, the oldest, enters the state; step 3: key 2
    # leaves with |v2 − v0|² = 1, tying key 1's 1 again: key 1, the older, enters
    assert seen == [-1, 0, 1, 2]
    assert torch.allclose(state.S[0, 0, 0], v[0, 0, 0] + v[0, 1, 0])


@pytest.mark.parametrize("name", ["cache_decay", "delta_cache_decay", "decay_input", "w0_delta"])
def test_decode_branch_gradients(monkeypatch, name):
    """Gradients of one decoded token (a full cache, a rescoring step) through the new token's tensors,
    the incoming state's tensors and every FarParams tensor: the branch's equal the general path's."""
    cfg = dict(DECODE_CASES[name])
    window = cfg.pop("window", 3)
    options = AttentionOptions(window=window, sinks=0 if window == 0 else 1, chunk_size=4,
                               **dict(cfg, rescore=cfg.get("rescore", 64)))
    T, M = 21, 3
    params = _params(options)
    fq, fk, v, q, k = _problem(T + 1, M, seed=7)
    mask = _mask(T + 1)
    kw = dict(options=options, params=params, degree=2, output_final_state=True)
    _, state = memory_attention(*[x[:, :T] for x in (fq, fk, v, q, k)], key_padding_mask=mask[:, :T], **kw)
    if options.cache:
        assert bool(state.cached.all())
    grads = []
    for flag in (True, False):
        from sketchlab.attention import memory_fast

        monkeypatch.setattr(memory_fast, "_DECODE", flag)
        new = [x[:, T:].clone().requires_grad_() for x in (fq, fk, v, q, k)]
        st = state.detach()
        leaves = {n: x.clone().requires_grad_() for n, x in st._tensors() if x.is_floating_point()}
        st = MemoryState(**{**{n: getattr(st, n) for n in ("mask_window", "mask_sink", "cached", "pos_cache",
                                                          "offset")}, **leaves})
        for p in params.parameters():
            p.grad = None
        out, st2 = memory_attention(*new, key_padding_mask=mask[:, T:], initial_state=st, **kw)
        loss = (out * _rand(*out.shape, seed=5)).sum() + (st2.S * _rand(*st2.S.shape, seed=6)).sum() \
            + (st2.z * _rand(*st2.z.shape, seed=8)).sum() + (st2.k_cache * _rand(*st2.k_cache.shape, seed=9)).sum()
        loss.backward()
        grads.append([x.grad for x in new] + [leaves[n].grad for n in sorted(leaves)]
                     + [p.grad for _, p in sorted(params.named_parameters())])
    monkeypatch.setattr(memory_fast, "_DECODE", True)
    assert any(g is not None for g in grads[0])
    for a, b in zip(*grads):
        assert (a is None) == (b is None) or not (a if a is not None else b).any()
        if a is not None and b is not None and a.numel():
            assert (a - b).abs().max().item() <= TOL64


@pytest.mark.parametrize("name", ["cache", "decay_input", "delta_cache_decay"])
def test_decode_step_refuses_invalid_inputs_with_the_entry_errors(name):
    """The decoding step (T = 1 with a state: a vouched state, the checks' fast paths) still gives every
    clear error: a non-finite new token, through ``linear_attention`` and through ``memory_attention``
    (named: q, v, phi_k), a token of the wrong width, a state of other options, a state whose field
    was replaced by one of the wrong shape."""
    import dataclasses

    from attention_calls import run_llops

    options = AttentionOptions(window=3, sinks=1, chunk_size=4, **MECHANISMS[name])
    params = _params(options)
    T = 12
    fq, fk, v, q, k = _problem(T + 1, 3, seed=11)
    kw = dict(options=options, params=params, degree=2, output_final_state=True)
    _, state = memory_attention(*[x[:, :T] for x in (fq, fk, v, q, k)], **kw)
    new = [x[:, T:] for x in (fq, fk, v, q, k)]
    _, state = memory_attention(*new, initial_state=state, **kw)  # a decoded step: its state is vouched
    _, state2 = memory_attention(*new, initial_state=state, **kw)  # ... and taken again without a full check
    assert state2.offset == T + 2 and "_checked" in vars(state2)  # the next step will not re-check its shapes
    for i, who in ((0, "phi_q"), (1, "phi_k"), (2, "v"), (3, "q"), (4, "k")):
        bad = [x.clone() for x in new]
        bad[i][1, 0, 1, 0] = float("nan")
        with pytest.raises(ValueError, match=rf"^{who} must be finite: 1 non-finite value"):
            memory_attention(*bad, initial_state=state, **kw)
    with pytest.raises(ValueError, match=r"phi_q and phi_k must share the last axis"):
        memory_attention(new[0][..., :2], *new[1:], initial_state=state, **kw)
    other = options.replace(window=4)
    with pytest.raises(ValueError, match=r"initial_state\.k_window must have shape .* window=4.*other options"):
        memory_attention(*new, initial_state=state, **dict(kw, options=other, params=_params(other)))
    broken = dataclasses.replace(state, S=state.S[:, :, :2])  # a new object: checked in full
    with pytest.raises(ValueError, match=r"initial_state\.S must have shape"):
        memory_attention(*new, initial_state=broken, **kw)
    # the public LLoPS entry on a decoding step: a NaN in the new token's value is named
    theta = _rand(H, 1, 2, D, 3, seed=5) * 0.5
    lo = AttentionOptions(window=3, sinks=1, normalize="sum", non_negative=True, backend="torch", **MECHANISMS[name])
    lp = FarParams(lo, H, D).double()
    x = [_rand(B, T, H, D, seed=s) for s in (1, 2, 3)]
    _, st = run_llops(*x, theta, theta, options=lo, params=lp, output_final_state=True)
    tok = [_rand(B, 1, H, D, seed=s) for s in (4, 5, 6)]
    _, st = run_llops(*tok, theta, theta, options=lo, params=lp, initial_state=st, output_final_state=True)
    tok[2][0, 0, 1, 2] = float("inf")
    with pytest.raises(ValueError, match=r"^v must be finite: 1 non-finite value\(s\) of 16, the first at index \(0, 0, 1, 2\)"):
        run_llops(*tok, theta, theta, options=lo, params=lp, initial_state=st, output_final_state=True)


@pytest.mark.parametrize("name", ["cache_decay", "delta_cache_decay", "w0_decay"])
def test_decode_buffer_survives_detach_and_to(name):
    """A decoding step keeps its layout of the state (``_rows``: the rows buffer, ``[S | z]``) for the
    next one; ``.detach()`` and ``.to(float64)`` of a float32 state (cast back to float32 by the next
    call, exactly) keep it, detached or cast, and decoding on from it equals decoding on from the
    state as the step left it (outputs and every field, bit for bit)."""
    cfg = dict(DECODE_CASES[name])
    options = AttentionOptions(window=cfg.pop("window", 3), chunk_size=4, **cfg)
    params = _params(options)
    T, T0 = 16, 9
    fq, fk, v, q, k = _problem(T, 3, seed=13, dtype=torch.float32)
    kw = dict(options=options, params=params, degree=2, output_final_state=True)
    _, state = memory_attention(*[x[:, :T0] for x in (fq, fk, v, q, k)], **kw)
    for t in range(T0, T0 + 3):  # decoded steps: the state holds the layout, and a graph to the params
        _, state = memory_attention(*[x[:, t:t + 1] for x in (fq, fk, v, q, k)], initial_state=state, **kw)
    assert "_rows" in vars(state) and state.S.requires_grad
    runs = []
    for st in (state, state.detach(), state.detach().to(torch.float64)):
        if st is not state:
            rows, _, Sz = vars(st)["_rows"]
            kept = [x for x in (rows, Sz) if x is not None]
            assert kept and all(not x.requires_grad and x.dtype == st.S.dtype for x in kept)
        outs = []
        for t in range(T0 + 3, T):
            out, st = memory_attention(*[x[:, t:t + 1] for x in (fq, fk, v, q, k)], initial_state=st, **kw)
            outs.append(out.detach())
        runs.append((torch.cat(outs, 1), st.detach()))
    for out, st in runs[1:]:
        assert torch.equal(out, runs[0][0])
        _assert_states(st, runs[0][1], tol=0.0)


# ------------------------------------------------------------------------------------------------ the fast path's blocks and batches
def _fast_equals_naive(options, T, M, *, seed):
    """The fast path's outputs and final state against the twin's on one masked problem; returns the
    problem and the call's keywords."""
    fq, fk, v, q, k = _problem(T, M, seed=seed)
    kw = dict(options=options, params=_params(options), degree=2, key_padding_mask=_mask(T), output_final_state=True)
    want, want_state = memory_attention_naive(fq, fk, v, q, k, **kw)
    got, got_state = memory_attention(fq, fk, v, q, k, **kw)
    assert (got - want).abs().max().item() <= TOL64
    _assert_states(got_state, want_state)
    return fq, fk, v, q, k, kw


@pytest.mark.parametrize("name", ["cache", "cache_decay", "cache1_rescore5", "delta_cache_decay", "cache_poly"])
def test_small_blocks_and_one_chunk_batches_equal_naive(monkeypatch, name):
    """Schedule blocks of 5 steps (cut apart from the query chunks and the re-scorings) and the exact part
    one query chunk per batch: the same outputs and states as the twin."""
    from sketchlab.attention.ops.cache import chunk, schedule

    monkeypatch.setattr(schedule, "BLOCK", 5)
    monkeypatch.setattr(chunk, "EXACT_ELEMENTS", 1)
    T, M = 43, 4
    options = AttentionOptions(window=1 if "rescore" in name else 3, sinks=2, chunk_size=8, **MECHANISMS[name])
    _fast_equals_naive(options, T, M, seed=11)


@pytest.mark.parametrize("decay", [None, 0.02])
def test_long_blocks_equal_naive(decay):
    """Blocks of 40 steps with a cache of 3: many evictions per block (keys cached and evicted inside one
    block, the slots passed along chains), several fixed-point passes; a decay strong enough that a
    block's state shrinks by e^-156."""
    T, M = 130, 3
    options = AttentionOptions(window=2, sinks=1, cache=3, rescore=40, chunk_size=40, decay=decay)
    fq, fk, v, q, k, kw = _fast_equals_naive(options, T, M, seed=21)
    # the whole schedule: the cache after every prefix
    for n in (37, 41, 80, 119):
        part = [x[:, :n] for x in (fq, fk, v, q, k)]
        kwn = dict(kw, key_padding_mask=kw["key_padding_mask"][:, :n])
        assert torch.equal(memory_attention(*part, **kwn)[1].pos_cache, memory_attention_naive(*part, **kwn)[1].pos_cache)
