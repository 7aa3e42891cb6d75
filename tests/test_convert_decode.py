"""generate() of a converted transformers model decodes through the lean steps (LayerDecoder over
RecurrentStep, KVDecoder for exact layers): the same greedy tokens as full forward passes, each token's
logits as the reference path's (one forward call per token with the state), on tiny random models."""

import pytest
import torch

from sketchlab.attention import AttentionState, MemoryState
from sketchlab.attention.recurrent import RecurrentStep
from sketchlab.convert import convert_attention, converted_modules
from sketchlab.convert.cache import SketchStateCache
from sketchlab.convert.exact import KVDecoder, KVState
from tests.test_attention_recurrent import path  # noqa: F401  (the fixture: compiled step and its torch twin)
from tests.test_convert import TOL64, _greedy_by_full_forward, _llama

#: conversions: the benchmark's (window + sinks + cache + decayed far state; the same with exact layers),
#: LLoPS maps (their features of q and k in one product), self-tensored features, the delta rule, and
#: pure linear attention, and the short convolution of q, k (its tails carried by the decoder's ConvStep)
CONVERSIONS = {
    "cache+decay": dict(attention="hedgehog", m=8, window=3, sinks=1, cache=3, decay="input"),
    "cache+decay+exact": dict(attention="hedgehog", m=8, window=3, sinks=1, cache=3, decay="input", exact_layers=[1]),
    "llops": dict(attention="llops", m=6, window=3, sinks=1),
    "llops-lifted": dict(attention="llops", m=4, window=3, sinks=1, non_negative=True),
    "llops-memory-lifted": dict(attention="llops", m=4, window=3, sinks=1, non_negative=True, decay=0.9),
    "gated-delta+cache": dict(attention="hedgehog", m=8, window=3, sinks=1, state="delta", decay="head", cache=2),
    "linear": dict(attention="hedgehog", m=8, window=0),
    "qk_conv+cache+decay": dict(attention="hedgehog", m=8, window=3, sinks=1, cache=3, decay="input", qk_conv=3),
    "llops+qk_conv": dict(attention="llops", m=6, window=3, sinks=1, qk_conv=4),
}


def _converted(name):
    model = _llama()
    convert_attention(model, **CONVERSIONS[name])
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # parameters off their initial values (gates, decays, β, maps)
        for s in converted_modules(model):
            for p in s.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def _count(monkeypatch, cls):
    calls = []
    orig = cls.step
    monkeypatch.setattr(cls, "step", lambda self, *a: (calls.append(1), orig(self, *a))[1])
    return calls


@pytest.mark.parametrize("name", CONVERSIONS)
@pytest.mark.usefixtures("path")
def test_generate_decodes_through_the_lean_steps(name, monkeypatch):
    """Greedy generate() equals greedy decoding by full forward passes, and every decoded token of every layer
    went through a lean step (none through the reference path's per-call entry points)."""
    model = _converted(name)
    lean = _count(monkeypatch, RecurrentStep)
    exact = _count(monkeypatch, KVDecoder)
    ids = torch.randint(1, 50, (2, 7), generator=torch.Generator().manual_seed(3))
    new = 8
    out = model.generate(ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, _greedy_by_full_forward(model, ids, new))
    n_exact = len(CONVERSIONS[name].get("exact_layers", []))
    assert len(lean) == (new - 1) * (2 - n_exact) and len(exact) == (new - 1) * n_exact
    kinds = {type(layer.state) for layer in out.cache.layers}  # written out of the decoders on reading
    assert kinds <= {AttentionState, MemoryState, KVState}


@pytest.mark.parametrize("name", ["cache+decay+exact", "llops-lifted", "gated-delta+cache", "qk_conv+cache+decay"])
@pytest.mark.usefixtures("path")
def test_lean_logits_equal_the_reference_path(name):
    """Token by token, the logits of a forward call with grad enabled (the reference path: one public call
    per layer with the state) and under no_grad (the lean steps) agree to float64 round-off, and so do
    the states they leave."""
    model = _converted(name)
    ids = torch.randint(1, 50, (2, 6), generator=torch.Generator().manual_seed(5))
    caches = [SketchStateCache(2), SketchStateCache(2)]
    with torch.no_grad():
        for c in caches:
            model(ids, cache=c, use_cache=True)
    step = torch.randint(1, 50, (2, 1), generator=torch.Generator().manual_seed(6))
    for t in range(9):
        with torch.no_grad():
            lean = model(step, cache=caches[0], use_cache=True).logits
        ref = model(step, cache=caches[1], use_cache=True).logits.detach()  # grad enabled: the reference path
        torch.testing.assert_close(lean, ref, **TOL64)
        step = lean[:, -1:].argmax(-1)
    for a, b in zip(caches[0].layers, caches[1].layers):
        sa, sb = a.state, b.state
        for f in ("S", "z", "k", "v", "k_window", "v_window", "phi_window", "k_cache", "score_cache", "conv_q", "conv_k"):
            if getattr(sb, f, None) is not None:
                torch.testing.assert_close(getattr(sa, f), getattr(sb, f).detach(), **TOL64)
        assert (getattr(sa, "conv_q", None) is None) == (getattr(sb, "conv_q", None) is None)
        assert sa.offset == sb.offset


def test_padded_prompts_decode_through_the_lean_steps(monkeypatch):
    """A left-padded batch: the pads the prefill moved behind the sinks stay in the state; the lean steps
    continue each row as its own (the tokens of each prompt generated alone)."""
    model = _converted("cache+decay")
    lean = _count(monkeypatch, RecurrentStep)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, 50, (n,), generator=gen) for n in (7, 4)]
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 7 - len(p):], mask[b, 7 - len(p):] = p, 1
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    batch = model.generate(ids, attention_mask=mask, **kw)
    assert len(lean) == 5 * 2
    for b, p in enumerate(prompts):
        assert torch.equal(batch[b, 7:], model.generate(p[None], **kw)[0, len(p):])


@pytest.mark.parametrize("kind", ["llops", "hedgehog"])
@pytest.mark.usefixtures("path")
def test_pair_features_run_on_inference_tensors(kind):
    """Maps made under ``torch.inference_mode`` (no version counter): the stacked weights are made again every
    call instead of failing, and the features still equal the maps' twins."""
    from sketchlab.attention.ops.pair_features import llops_pair_features
    from sketchlab.featuremaps import HedgehogMap, LLoPSMap
    from sketchlab.featuremaps.hedgehog import hedgehog_pair_features

    B, H, D = 2, 3, 4
    with torch.inference_mode():
        if kind == "llops":
            fm_q, fm_k = (LLoPSMap(H, D, p=2, m=5, rank=2, seed=s, dtype=torch.float64) for s in (1, 2))
            pair = llops_pair_features(fm_q.theta, fm_k.theta, B)
        else:
            fm_q, fm_k = (HedgehogMap(H, D, m=6, seed=s, dtype=torch.float64) for s in (1, 2))
            pair = hedgehog_pair_features(fm_q, fm_k, B)
        for step in range(2):
            q, k = (torch.randn(B, 1, H, D, generator=torch.Generator().manual_seed(step + i), dtype=torch.float64)
                    for i in (0, 5))
            fq, fk = pair(q.transpose(1, 2).reshape(B * H, 1, D), k.transpose(1, 2).reshape(B * H, 1, D))
            for got, m, x in ((fq, fm_q, q), (fk, fm_k, k)):
                torch.testing.assert_close(got, m.features_naive(x).transpose(1, 2).reshape(B * H, 1, -1), **TOL64)


@pytest.mark.parametrize("kind", ["llops", "llops-tied", "hedgehog"])
@pytest.mark.usefixtures("path")
def test_pair_features_equal_the_maps_float64_twins(kind):
    """The decoding features of q and k in one product equal each map's float64 twin, and follow an in-place
    change of the maps' parameters (a training step) at the next call."""
    from sketchlab.attention.ops.pair_features import llops_pair_features
    from sketchlab.featuremaps import HedgehogMap, LLoPSMap
    from sketchlab.featuremaps.hedgehog import hedgehog_pair_features

    B, H, D = 2, 3, 4
    if kind.startswith("llops"):
        fm_q = LLoPSMap(H, D, p=2, m=5, rank=2, seed=1, dtype=torch.float64)
        fm_k = fm_q if kind == "llops-tied" else LLoPSMap(H, D, p=2, m=5, rank=2, seed=2, dtype=torch.float64)
        pair = llops_pair_features(fm_q.theta, fm_k.theta, B)
    else:
        fm_q, fm_k = HedgehogMap(H, D, m=6, seed=1, dtype=torch.float64), HedgehogMap(H, D, m=6, seed=2,
                                                                                        dtype=torch.float64)
        pair = hedgehog_pair_features(fm_q, fm_k, B)
    gen = torch.Generator().manual_seed(0)
    for step in range(2):
        q, k = (torch.randn(B, 1, H, D, generator=gen, dtype=torch.float64) for _ in range(2))
        fq, fk = pair(q.transpose(1, 2).reshape(B * H, 1, D), k.transpose(1, 2).reshape(B * H, 1, D))
        for got, m, x in ((fq, fm_q, q), (fk, fm_k, k)):
            want = m.features_naive(x).transpose(1, 2).reshape(B * H, 1, -1)
            torch.testing.assert_close(got, want, **TOL64)
        with torch.no_grad():  # a training step in place between two tokens
            for p in list(fm_q.parameters()) + list(fm_k.parameters()):
                p.mul_(1.5)


@pytest.mark.parametrize("far", [dict(window=0, sinks=0), dict(window=3, sinks=1), dict(window=3, sinks=1, decay=0.9),
                                 dict(window=0, sinks=0, state="delta")])
@pytest.mark.usefixtures("path")
def test_signed_map_with_default_options_decodes_as_the_forward(far):
    """A layer built with ``normalize=None, non_negative=None`` over a signed map decides its defaults as the op
    does (AttentionOptions.resolve, one rule): self-tensored under a sum, not under the delta state (its
    readout divides by none). Its lean decoder (LayerDecoder) follows that decision: each decoded token
    equals the layer's forward on it with the state, and so does the state it leaves."""
    from sketchlab.convert.sketched import SketchedAttention
    from sketchlab.featuremaps import LLoPSMap

    B, H, D, T = 2, 2, 4, 6
    fm_q = LLoPSMap(H, D, p=2, m=3, rank=2, seed=1, dtype=torch.float64)
    fm_k = LLoPSMap(H, D, p=2, m=3, rank=2, seed=2, dtype=torch.float64)
    assert not fm_q.non_negative and not fm_k.non_negative  # signed: rank 2, unequal sides
    layer = SketchedAttention(fm_q, fm_k, heads=H, head_dim=D, normalize=None, non_negative=None, **far).double()
    assert layer.non_negative == (far.get("state") != "delta")
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, T + 3, H, D, generator=gen, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        _, state = layer(q[:, :T], k[:, :T], v[:, :T], output_final_state=True)
        dec = layer.decoder(state)
        for t in range(T, T + 3):
            want, state = layer(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], initial_state=state,
                                output_final_state=True)
            got = dec.step(*(x[:, t:t + 1].transpose(1, 2) for x in (q, k, v)))  # [B, H, 1, D] each
            torch.testing.assert_close(got, want, **TOL64)
    torch.testing.assert_close(dec.state().S, state.S, **TOL64)
