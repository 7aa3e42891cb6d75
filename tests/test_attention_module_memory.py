"""LLoPSAttention with the long-context memory (DESIGN §7): the block holds one AttentionOptions and
one FarParams; forward, step and the state round trip work with each mechanism.

Tolerance (float64): 1e-10, as ``test_memory.py`` (the step loop and the whole call add the same
terms in another order: chunked sums against one token at a time).
"""

import pytest
import torch
from attention_calls import run_llops

from sketchlab.attention import AttentionOptions, AttentionState, FarParams, LLoPSAttention, MemoryState
from sketchlab.attention.memory import memory_attention_naive
from sketchlab.llops import llops_features
from sketchlab.polynomial import self_tensor

TOL64 = 1e-10
E, H = 12, 3
MECHANISMS = {
    "cache": dict(window=4, sinks=1, cache=3),
    "decay_fixed": dict(window=4, sinks=1, decay=0.9),
    "decay_head": dict(window=4, decay="head"),
    "decay_input": dict(window=4, sinks=2, decay="input"),
    "delta": dict(window=4, sinks=1, state="delta"),
    "delta_input_cache": dict(window=4, sinks=1, state="delta", beta="input", cache=2),
    "pure_decay": dict(decay="input"),
    "pure_delta": dict(state="delta"),
}


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _block(seed=1, **kw):
    block = LLoPSAttention(E, H, m=5, dtype=torch.float64, seed=seed, chunk_size=8, **kw)
    with torch.no_grad():  # away from the initial values, so every tensor matters
        for i, (_, x) in enumerate(sorted(block.far.named_parameters() if block.far is not None else [])):
            x.copy_(_rand(*x.shape, seed=50 + i) * 0.7)
        if block.gate is not None:
            block.gate.copy_(_rand(H, seed=49))
    return block


@pytest.mark.parametrize("name", MECHANISMS)
def test_block_holds_the_options_and_params(name):
    kw = MECHANISMS[name]
    block = _block(**kw)
    assert isinstance(block.options, AttentionOptions) and block.options.memory
    assert isinstance(block.far, FarParams) and block.far.gate is None  # the gate stays block.gate
    assert (block.gate is not None) == bool(kw.get("window"))
    for key, value in kw.items():
        assert getattr(block.options, key) == value
    names = {n for n, _ in block.named_parameters()}
    assert ("far.decay_bias" in names) == isinstance(kw.get("decay"), str)
    assert ("far.beta_bias" in names) == (kw.get("state") == "delta")


@pytest.mark.parametrize("name", MECHANISMS)
def test_forward_is_memory_attention_of_the_projections(name):
    block = _block(**MECHANISMS[name])
    x = _rand(2, 19, E, seed=2)
    D, s = block.head_dim, block.qk_scale
    q = block.q_proj(x).view(2, 19, H, D) * s
    k = block.k_proj(x).view(2, 19, H, D) * s
    v = block.v_proj(x).view(2, 19, H, D)
    theta = block.theta_q
    feats = lambda x: llops_features(x.transpose(1, 2), theta).transpose(1, 2)  # noqa: E731  [B, T, H, M]
    fq, fk = feats(q), feats(k)
    if block.non_negative:
        fq, fk = self_tensor(fq), self_tensor(fk)
    ref = memory_attention_naive(fq, fk, v, q, k, options=block.options, params=block.far, gate=block.gate,
                                 degree=block.degree)
    assert torch.allclose(block(x), block.o_proj(ref.reshape(2, 19, E)), atol=TOL64, rtol=0)


@pytest.mark.parametrize("name", MECHANISMS)
def test_step_loop_equals_forward_and_split_equals_whole(name):
    block = _block(**MECHANISMS[name])
    x = _rand(2, 23, E, seed=3)
    whole, final = block(x, output_final_state=True)
    assert isinstance(final, MemoryState)
    state, ys, sizes = None, [], set()
    for t in range(x.shape[1]):
        y, state = block.step(x[:, t], state)
        ys.append(y)
        if t >= 8:
            sizes.add(state.nbytes)
    assert torch.allclose(torch.stack(ys, 1), whole, atol=TOL64, rtol=0)
    assert len(sizes) == 1  # flat once the window and sinks are full
    assert torch.allclose(state.S, final.S, atol=TOL64, rtol=0) and torch.equal(state.pos_cache, final.pos_cache)
    for cut in (1, 9, 16):
        first, mid = block(x[:, :cut], output_final_state=True)
        second, end = block(x[:, cut:], initial_state=mid, output_final_state=True)
        assert torch.allclose(torch.cat([first, second], 1), whole, atol=TOL64, rtol=0), cut
        assert torch.allclose(end.S, final.S, atol=TOL64, rtol=0), cut


@pytest.mark.parametrize("kw", [dict(window=4, sinks=1), dict(), dict(window=4, local="poly")])
def test_decay_one_is_todays_block_bit_for_bit(kw):
    today, one = _block(**kw), _block(decay=1.0, **kw)
    assert one.far is None and not one.options.memory
    assert today.state_dict().keys() == one.state_dict().keys()
    x = _rand(2, 17, E, seed=4)
    y0, s0 = today(x, output_final_state=True)
    y1, s1 = one(x, output_final_state=True)
    assert torch.equal(y0, y1) and isinstance(s1, AttentionState) and torch.equal(s0.S, s1.S)
    assert torch.equal(today.step(x[:, 0])[0], one.step(x[:, 0])[0])


@pytest.mark.parametrize("name", ["cache", "decay_input", "delta_input_cache"])
def test_state_dict_round_trip_and_gradients(name):
    block = _block(**MECHANISMS[name])
    x = _rand(2, 15, E, seed=5)
    y = block(x)
    again = LLoPSAttention(E, H, m=5, dtype=torch.float64, seed=7, chunk_size=8, **MECHANISMS[name])
    assert not torch.equal(again(x), y)
    again.load_state_dict(block.state_dict())
    assert torch.equal(again(x), y)
    y.square().sum().backward()
    for n, p in block.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


def test_reference_backend_and_refusals():
    kw = MECHANISMS["delta_input_cache"]
    fast, ref = _block(**kw), _block(backend="reference", **kw)
    x = _rand(1, 13, E, seed=6)
    assert torch.allclose(fast(x), ref(x), atol=TOL64, rtol=0)
    with pytest.raises(ValueError, match="cache=2 needs window >= 1"):
        LLoPSAttention(E, H, cache=2)
    with pytest.raises(ValueError, match="need causal=True"):
        LLoPSAttention(E, H, window=2, decay="head", causal=False)
    with pytest.raises(ValueError, match="state must be one of"):
        LLoPSAttention(E, H, state="gated")
    with pytest.raises(ValueError, match="have no fused kernel"):
        LLoPSAttention(E, H, window=2, cache=1, backend="triton", dtype=torch.float64)(_rand(1, 3, E))


@pytest.mark.parametrize("state", ["additive", "delta"])
def test_module_and_op_resolve_a_signed_theta_alike(state):
    """The drift of issue 40: ``LLoPSAttention(theta_q=<signed Θ>, normalize="sum", state="delta")`` self-tensored
    (``non_negative=True``) where ``llops_attention`` with the same arguments did not (the delta state has no
    denominator). Both now ask :meth:`AttentionOptions.resolve`: the block's resolved options are the op's, and the
    block's attention is the op's default call on the same scaled q, k, v."""
    tq, tk = _rand(H, 1, 2, E // H, 5, seed=3), _rand(H, 1, 2, E // H, 5, seed=4)  # unequal factors: signed
    kw = dict(window=4, state=state)
    block = LLoPSAttention(E, H, theta_q=tq, theta_k=tk, normalize="sum", dtype=torch.float64, chunk_size=8, **kw)
    assert block.options.non_negative is (state != "delta")  # self-tensored only where a sum divides
    options = AttentionOptions(normalize="sum", chunk_size=8, local_scale=block.options.local_scale, **kw)
    q, k, v = (_rand(2, 11, H, E // H, seed=s) for s in (5, 6, 7))
    op = run_llops(q * block.qk_scale, k * block.qk_scale, v, tq, tk, gate=block.gate, params=block.far,
                            options=options)
    assert torch.allclose(block.attend(q, k, v), op, rtol=0, atol=TOL64)
    assert block.options == options.resolve(False)  # the one rule, the map signed


@pytest.mark.parametrize("state", ["additive", "delta"])
def test_module_and_the_op_resolve_a_signed_theta_to_the_same_options(state, monkeypatch):
    """The drift test of issue 40 on the public op: ``LLoPSAttention(theta_q=<signed Θ>, normalize="sum",
    state=...)`` and ``sketchlab.linear_attention`` with the same Θ (as LLoPSMaps) and options resolve to the
    same options (``non_negative`` among them: self-tensored under the additive state's sum, not under the
    delta state, which divides by none), recorded where the op resolves them; the op's state holds ``M`` or
    ``M²`` features accordingly, and the block's attention is the op's call."""
    import sketchlab as sl
    from sketchlab.featuremaps import LLoPSMap

    tq, tk = _rand(H, 1, 2, E // H, 5, seed=3), _rand(H, 1, 2, E // H, 5, seed=4)  # unequal factors: signed
    kw = dict(window=4, state=state, normalize="sum", chunk_size=8)
    block = LLoPSAttention(E, H, theta_q=tq, theta_k=tk, dtype=torch.float64, **kw)
    assert block.options.non_negative is (state != "delta")
    resolved, resolve = [], AttentionOptions.resolve
    monkeypatch.setattr(AttentionOptions, "resolve", lambda self, m: (resolved.append(resolve(self, m)), resolved[-1])[1])
    options = AttentionOptions(local_scale=block.options.local_scale, **kw)  # non_negative: the default, None
    maps = [LLoPSMap(H, E // H, theta=t, dtype=torch.float64) for t in (tq, tk)]
    q, k, v = (_rand(2, 11, H, E // H, seed=s) for s in (5, 6, 7))
    o, st = sl.linear_attention(q * block.qk_scale, k * block.qk_scale, v, *maps, options=options, gate=block.gate,
                                params=block.far, output_final_state=True)
    assert resolved and resolved[-1] == block.options  # the op decided what the block decided
    assert st.S.shape[-2] == (25 if block.options.non_negative else 5)  # [B, H, M (or M²), Dv]
    assert torch.allclose(block.attend(q, k, v), o, rtol=0, atol=TOL64)
