"""convert_attention on tiny random LLaMA (GQA, rotary), GPT-2, BERT (padding) and toy models.

Two kinds of test. *Plumbing* tests swap in, for the sketched attention function, exact masked
softmax attention in float64 (``exact_softmax`` below: it honours the window-free part of the
contract — causal, padding, local_scale, initial/final state as the keys and values so far): the
converted model must then reproduce the teacher's logits to float64 round-off, which checks every
layout, head repeat, logit scale, mask and cache path of the glue independently of the sketch.
*Kernel* tests run the real :func:`sketchlab.attention.linear_attention` (window >= T with
local softmax is exactly softmax attention, DESIGN §6).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import transformers
from torch import nn

import sketchlab.attention.layer as attn_layer
import sketchlab.convert.sketched as sketched
from sketchlab.convert import convert_attention, converted_modules, load_linearized, save_linearized
from sketchlab.convert.families import ConvertedToyKernel
from sketchlab.featuremaps import HedgehogMap

# float64 models: the converted forward repeats the teacher's arithmetic in another order
# (explicit softmax vs SDPA, repeated heads vs grouped), so logits agree to ~1e-15 relative;
# 1e-10 leaves margin while any real difference (a wrong scale, mask or head) is O(1e-2) or more.
TOL64 = dict(rtol=1e-10, atol=1e-10)


@dataclasses.dataclass
class _KV:
    """Stand-in state of exact attention: every key and value so far (and the padding mask)."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor


def exact_softmax(q, k, v, fmap_q, fmap_k, *, options, params=None, gate=None, segments=None, key_padding_mask=None,
                  initial_state=None, output_final_state=False):
    """Exact masked softmax attention ``[B, T, H, D]`` with logits ``options.local_scale · qᵀk`` (float64),
    continuing from / returning the keys and values so far as its state (the op's ``(o, state)``)."""
    causal, local_scale = options.causal, options.local_scale
    B, T, H, _ = q.shape
    mask = torch.ones(B, k.shape[1], dtype=torch.bool) if key_padding_mask is None else key_padding_mask
    if initial_state is not None:
        k = torch.cat([initial_state.k, k], 1)
        v = torch.cat([initial_state.v, v], 1)
        mask = torch.cat([initial_state.mask, mask], 1)
    S = k.shape[1]
    logits = torch.einsum("bthd,bshd->bhts", q, k) * local_scale  # [B, H, T, S]
    allowed = mask[:, None, None, :].expand(B, 1, T, S)
    if causal:
        pos_q = torch.arange(S - T, S)[:, None]
        allowed = allowed & (torch.arange(S)[None, :] <= pos_q)
    logits = logits.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", torch.nan_to_num(logits.softmax(-1)), v)
    return out, (_KV(k, v, mask) if output_final_state else None)


class _Identity(nn.Module):
    """A stand-in feature map with one parameter (the plumbing tests never use its features)."""

    def __init__(self, heads):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(heads))


def _maps(layer, heads, head_dim):
    return _Identity(heads), _Identity(heads)


@pytest.fixture
def softmax_kernel(monkeypatch):
    monkeypatch.setattr(attn_layer, "linear_attention", exact_softmax)  # the op as the one layer core calls it


def _llama(causal_lm=True):
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    cls = transformers.LlamaForCausalLM if causal_lm else transformers.LlamaModel
    return cls(cfg).double().eval()


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  scale_attn_by_inverse_layer_idx=True, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="sdpa")
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def _bert():
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(2)
    return transformers.BertModel(cfg).double().eval()


def _inputs(padding: bool, B=2, T=9, seed=3):
    ids = torch.randint(1, 50, (B, T), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(B, T, dtype=torch.long)
    if padding:
        mask[1, 6:] = 0  # right padding in sequence 1
    return ids, mask


def _out(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _greedy_by_full_forward(model, ids, steps: int):
    """``ids`` and ``steps`` more tokens by greedy decoding by full forward passes (``use_cache=False``)."""
    seq = ids
    with torch.no_grad():
        for _ in range(steps):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq


def _state_after(model, n: int):
    """The :class:`~sketchlab.convert.cache.SketchStateCache` after one forward of ``n`` random tokens."""
    from sketchlab.convert.cache import SketchStateCache

    cache = SketchStateCache(2)
    with torch.no_grad():
        model(torch.randint(1, 50, (1, n)), cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("make,padding", [(_llama, False), (_llama, True), (_gpt2, True), (_bert, True)])
def test_plumbing_reproduces_teacher(make, padding, softmax_kernel):
    """With exact softmax as the swapped-in function the converted model equals the teacher: heads,
    GQA repeat, rotary q/k, GPT-2's per-layer logit scale, BERT's non-causal padding mask."""
    model = make()
    ids, mask = _inputs(padding)
    want = _out(model, ids, mask)
    sketches = convert_attention(model, feature_map=_maps, window=0, sinks=0)
    assert model.config._attn_implementation == "sketchlab" and len(sketches) == 2
    assert sketches == converted_modules(model)
    got = _out(model, ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], **TOL64)
    # the module's own logit scale reaches the local part: GPT-2 scales layer l by 1/(l+1)
    if make is _gpt2:
        seen = []
        orig = attn_layer.linear_attention
        attn_layer.linear_attention = lambda *a, **kw: (seen.append(kw["options"].local_scale), orig(*a, **kw))[1]
        try:
            _out(model, ids, mask)
        finally:
            attn_layer.linear_attention = orig
        assert seen == pytest.approx([1.0, 0.5])  # (scaling = 1/(√D (l+1))) · √D


def test_plumbing_new_parameters_train_and_weights_stay(softmax_kernel):
    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sketches = convert_attention(model, feature_map=_maps, window=8, sinks=2)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # every original weight kept
    new = sorted(set(after) - set(before))
    assert new == sorted(f"model.layers.{i}.self_attn.sketch.{n}" for i in range(2)
                         for n in ("map_q.weight", "map_k.weight", "gate"))
    assert all(p.requires_grad for s in sketches for p in s.parameters())
    assert sketches[0].gate.shape == (4,)
    frozen = convert_attention(_llama(), feature_map=_maps, learn=False)
    assert not any(p.requires_grad for s in frozen for p in s.parameters())
    with pytest.raises(ValueError, match="already converted"):
        convert_attention(model, feature_map=_maps)


def test_plumbing_generate_with_state_equals_full_forward_greedy(softmax_kernel):
    """generate() decodes with SketchStateCache (each step sees only the new token's keys) and gives
    the tokens of greedy decoding by full forward passes."""
    from sketchlab.convert.cache import SketchStateCache

    model = _llama()
    convert_attention(model, feature_map=_maps, window=0, sinks=0)
    ids, _ = _inputs(False, B=2, T=5)
    calls = []
    orig = attn_layer.linear_attention
    attn_layer.linear_attention = lambda q, k, *a, **kw: (calls.append((q.shape[1], k.shape[1])), orig(q, k, *a, **kw))[1]
    try:
        out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    finally:
        attn_layer.linear_attention = orig
    assert isinstance(out.cache, SketchStateCache) and out.cache.get_seq_length() == 10
    assert calls[:2] == [(5, 5), (5, 5)] and set(calls[2:]) == {(1, 1)}  # prefill, then one key per step
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out.sequences, seq)


def test_plumbing_state_continues_a_forward(softmax_kernel):
    from sketchlab.convert.cache import SketchStateCache

    model = _gpt2()
    convert_attention(model, feature_map=_maps, window=0, sinks=0)
    ids, _ = _inputs(False, B=1, T=9)
    whole = _out(model, ids, None)
    cache = SketchStateCache(2)
    with torch.no_grad():
        first = model(ids[:, :4], cache=cache, use_cache=True).logits
        second = model(ids[:, 4:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(torch.cat([first, second], 1), whole, **TOL64)
    # without the state cache a key/value cache is refused with the way out
    with torch.no_grad():
        dyn = transformers.DynamicCache()
        model(ids[:, :4], cache=dyn, use_cache=True)
        with pytest.raises(ValueError, match="decodes with sketchlab.convert.cache.SketchStateCache"):
            model(ids[:, 4:], cache=dyn, use_cache=True)


@pytest.mark.parametrize("make", [_llama, _bert])
def test_plumbing_save_load_round_trip(make, tmp_path, softmax_kernel):
    model = make()
    convert_attention(model, feature_map=_maps, window=4, sinks=1)
    with torch.no_grad():
        for s in converted_modules(model):
            s.gate.normal_()
    ids, mask = _inputs(True)
    want = _out(model, ids, mask)
    save_linearized(model, tmp_path / "lin")
    fresh = make()  # the teacher again
    convert_attention(fresh, feature_map=_maps, window=4, sinks=1)
    with pytest.raises(ValueError, match="other options"):
        load_linearized(tmp_path / "lin", _converted_other(make))
    load_linearized(tmp_path / "lin", fresh)
    for a, b in zip(converted_modules(fresh), converted_modules(model)):
        assert torch.equal(a.gate, b.gate) and torch.equal(a.map_q.weight, b.map_q.weight)
    torch.testing.assert_close(_out(fresh, ids, mask), want, rtol=0, atol=0)


def _converted_other(make):
    other = make()
    convert_attention(other, feature_map=_maps, window=5, sinks=1)
    return other


def test_unsupported_and_bad_options():
    cfg = transformers.T5Config(vocab_size=20, d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=16)
    with pytest.raises(ValueError, match=r"not a supported family; supported: .*llama, qwen2, mistral, gpt2, bert"):
        convert_attention(transformers.T5Model(cfg))
    with pytest.raises(ValueError, match="window must be an integer >= 0, got -1"):
        convert_attention(_llama(), feature_map=_maps, window=-1)
    with pytest.raises(ValueError, match=r"local must be one of \['softmax', 'poly'\], got 'linear'"):
        convert_attention(_llama(), feature_map=_maps, local="linear")
    with pytest.raises(ValueError, match="theta initialises LLoPS maps"):
        convert_attention(_llama(), attention="hedgehog", theta="x.safetensors")


def _untouched(model) -> bool:
    """Nothing of a conversion on ``model``: no options, no sketch, the teacher's attention implementation."""
    return (getattr(model.config, "sketchlab", None) is None and not converted_modules(model, required=False)
            and model.config._attn_implementation != sketched.ATTENTION_NAME)


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=0, sinks=2), r"sinks=2 with window=0: attention sinks are exact keys.* pass window >= 1 or sinks=0"),
    (dict(normalize="bogus"), r"normalize must be one of \['none', 'sum'\], got 'bogus'"),
    (dict(window=4, normalize="none"), r"the hybrid \(window=4 > 0\) .* always normalised: pass normalize='sum' "
                                       r"\(or None\), got 'none'"),
])
def test_layout_options_refused_before_the_model_is_touched(kwargs, match):
    """window, sinks and normalize are checked with the attention's own rules at conversion, before the
    model changes (they used to be accepted, saved, and fail at the first forward)."""
    model = _llama()
    with pytest.raises(ValueError, match=match):
        convert_attention(model, attention="hedgehog", m=4, **kwargs)
    assert _untouched(model)


@pytest.mark.parametrize("maps", [dict(attention="hedgehog", m=4),
                                  dict(feature_map=lambda layer, heads, dim: HedgehogMap(heads, dim, m=4))],
                         ids=["attention", "feature_map"])
def test_poly_window_with_a_map_without_degree_refused_before_the_model_is_touched(maps):
    """local='poly' scores the window with the maps' polynomial degree: Hedgehog has none, so the
    conversion refuses it, naming the map, the option and the remedy (it used to convert, and fail
    at the first forward). The softmax window with the same maps, and the poly window with LLoPS, convert."""
    model = _llama()
    with pytest.raises(ValueError, match=r"local='poly' needs a polynomial degree .*, and HedgehogMap has none "
                                         r"\(it is not a polynomial kernel\): use local='softmax'"):
        convert_attention(model, window=4, local="poly", **maps)
    assert _untouched(model)
    assert convert_attention(_llama(), window=4, local="softmax", **maps)
    assert convert_attention(_llama(), attention="llops", m=4, window=4, local="poly")


def test_sketched_attention_refuses_a_poly_window_without_a_map_degree():
    maps = (HedgehogMap(2, 4, m=4), HedgehogMap(2, 4, m=4))
    with pytest.raises(ValueError, match=r"local='poly' needs a polynomial degree .*, and HedgehogMap has none"):
        sketched.SketchedAttention(*maps, heads=2, head_dim=4, window=3, sinks=0, local="poly")
    assert sketched.SketchedAttention(*maps, heads=2, head_dim=4, window=0, sinks=0, local="poly").gate is None


def test_sinks_default_follows_the_window():
    """sinks=None: 4 with a window (the measured best), 0 for pure linear attention (window=0), which
    then runs; config.sketchlab records the resolved number, and an explicit value is kept."""
    ids, mask = _inputs(False)
    for window, sinks, want in ((0, None, 0), (3, None, 4), (3, 1, 1), (0, 0, 0)):
        model = _llama()
        sketches = convert_attention(model, attention="hedgehog", m=4, window=window, sinks=sinks)
        assert model.config.sketchlab["sinks"] == want and all(s.sinks == want for s in sketches)
        assert torch.isfinite(_out(model, ids, mask)).all()  # the forward runs
    model = _llama()
    convert_attention(model, attention="hedgehog", m=4)
    assert (model.config.sketchlab["window"], model.config.sketchlab["sinks"]) == (64, 4)


@pytest.mark.parametrize("make", ["gpt2", "bert"])
def test_cross_attention_refused_before_the_model_is_touched(make):
    """The attention implementation is one per model, so a decoder with cross-attention (GPT-2 or BERT
    built with add_cross_attention=True) would send its cross-attention through the sketch and fail at
    the first forward; conversion refuses it, naming the module and the config flag."""
    if make == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                      add_cross_attention=True, bos_token_id=0, eos_token_id=0)
        model, where = transformers.GPT2LMHeadModel(cfg).eval(), r"transformer\.h\.0\.crossattention"
    else:
        cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=16, is_decoder=True, add_cross_attention=True)
        model, where = transformers.BertLMHeadModel(cfg).eval(), r"bert\.encoder\.layer\.0\.crossattention"
    with pytest.raises(ValueError, match=rf"has cross-attention \({where}, .*config\.add_cross_attention=True"):
        convert_attention(model, attention="hedgehog", m=4, window=2, sinks=1)
    assert _untouched(model)


@pytest.mark.parametrize("family,kwargs,warns", [
    ("mistral", dict(sliding_window=3), "every layer"), ("mistral", dict(sliding_window=None), None),
    ("qwen2", dict(use_sliding_window=True, sliding_window=3, max_window_layers=1), r"layers \[1\]"),
    ("qwen2", dict(), None),
])
def test_teacher_with_its_own_sliding_window_warns(family, kwargs, warns):
    """window >= T reproduces the teacher only when its attention is not itself limited to a sliding
    window: with Mistral's sliding_window or Qwen2's use_sliding_window the converted model sees keys
    the teacher never did (here 0.16 and 0.13 off its logits at T = 9 > 3), so conversion warns, naming the value."""
    import warnings

    common = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, max_position_embeddings=64, attn_implementation="sdpa", **kwargs)
    torch.manual_seed(0)
    if family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common)).double().eval()
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).double().eval()
    ids, mask = _inputs(False)
    want = _out(model, ids, mask)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_attention(model, attention="hedgehog", m=4, window=ids.shape[1], sinks=0, eps=0.0)
    ours = [str(w.message) for w in caught if "sliding" in str(w.message)]
    gap = float((_out(model, ids, mask) - want).abs().max())
    if warns is None:
        assert ours == [] and gap < 1e-10  # window >= T: the teacher's attention (float64 round-off)
    else:
        assert len(ours) == 1 and "config.sliding_window=3" in ours[0]
        assert re.search(warns, ours[0]) and gap > 1e-3


# ------------------------------------------------------------------------------------------------
# the real sketched attention (sketchlab.attention.linear_attention)


@pytest.mark.parametrize("make,padding,attention", [(_llama, True, "llops"), (_gpt2, True, "hedgehog"),
                                                    (_bert, True, "llops")])
def test_window_covering_the_sequence_reproduces_teacher(make, padding, attention):
    """window >= T with local softmax is exactly the model's softmax attention (DESIGN §6): the
    converted model gives the teacher's logits to float64 round-off, whatever the maps and gate
    (eps=0: the default eps=1e-6 in the denominator would be a relative error of ~1e-6)."""
    model = make()
    ids, mask = _inputs(padding)
    want = _out(model, ids, mask)
    sketches = convert_attention(model, attention=attention, p=2, m=8, window=ids.shape[1], sinks=2, eps=0.0)
    with torch.no_grad():
        for s in sketches:
            s.gate.normal_()  # any gate: with no far keys it cancels in the shared denominator
    got = _out(model, ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], **TOL64)
    # a window shorter than the sequence makes the far part (the sketch) matter
    short = make()
    convert_attention(short, attention=attention, p=2, m=8, window=2, sinks=1)
    assert float((_out(short, ids, mask)[valid] - want[valid]).abs().max()) > 1e-3


@pytest.mark.parametrize("window,sinks", [(0, 0), (3, 1)])
def test_generate_with_state_equals_greedy_full_forward(window, sinks):
    """generate() decodes with the recurrent state (pure and hybrid, crossing the window) and gives
    the tokens of greedy decoding by full forward passes; the state does not grow with the context."""
    from sketchlab.convert.cache import SketchStateCache

    model = _llama()
    convert_attention(model, attention="hedgehog", m=8, window=window, sinks=sinks)
    ids, _ = _inputs(False, B=2, T=5)
    out = model.generate(ids, max_new_tokens=7, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.cache, SketchStateCache)
    assert torch.equal(out.sequences, _greedy_by_full_forward(model, ids, 7))
    # memory: the state after 12 tokens equals the state after 30
    sizes = [_state_after(model, n).state_bytes() for n in (12, 30)]
    assert sizes[0] == sizes[1] > 0


@pytest.mark.parametrize("window,sinks", [(0, 0), (3, 1)])
def test_beam_search_with_state_equals_beam_search_by_full_forward(window, sinks):
    """Beam search reorders the beams' recurrent states (``StateLayer.reorder_cache``) each step:
    with the state it returns the beams that full forward passes (``use_cache=False``) give."""
    model = _llama()
    convert_attention(model, attention="hedgehog", m=8, window=window, sinks=sinks)
    ids, mask = _inputs(False, B=2, T=5)
    kw = dict(attention_mask=mask, max_new_tokens=7, do_sample=False, num_beams=3, num_return_sequences=3,
              pad_token_id=0)
    with_state = model.generate(ids, **kw)
    by_forward = model.generate(ids, use_cache=False, **kw)
    assert with_state.shape == (6, 12)
    assert torch.equal(with_state, by_forward)


def perturb_maps(model) -> None:
    """Move a converted LLoPS model's query Θ and gates off their initial values (a round trip must
    carry trained values, not the ones a fresh conversion recreates)."""
    with torch.no_grad():
        for s in converted_modules(model):
            s.map_q.theta.add_(0.1 * torch.randn_like(s.map_q.theta))
            s.gate.normal_()


def test_save_load_round_trip_llops(tmp_path):
    model = _llama()
    convert_attention(model, attention="llops", p=2, m=8, window=3, sinks=1)
    perturb_maps(model)
    ids, mask = _inputs(True)
    want = _out(model, ids, mask)
    save_linearized(model, tmp_path / "lin")
    fresh = load_linearized(tmp_path / "lin", _llama())  # the teacher, converted as recorded
    torch.testing.assert_close(_out(fresh, ids, mask), want, rtol=0, atol=0)
    # a model converted afresh (other random maps) differs: the round trip restored the trained maps
    other = _llama()
    convert_attention(other, attention="llops", p=2, m=8, window=3, sinks=1, seed=1)
    assert float((_out(other, ids, mask) - want).abs().max()) > 1e-6


def test_theta_initialises_llops_maps():
    model = _llama()
    theta_q = torch.randn(2, 4, 1, 2, 8, 6, dtype=torch.float64)  # [L, H, t, p, D, m]
    theta_k = torch.randn(2, 4, 1, 2, 8, 6, dtype=torch.float64)
    sketches = convert_attention(model, attention="llops", p=2, m=6, theta=(theta_q, theta_k), tied=False)
    for layer, s in enumerate(sketches):
        assert torch.equal(s.map_q.theta, theta_q[layer]) and torch.equal(s.key_map.theta, theta_k[layer])
    with pytest.raises(ValueError, match="Θ has 3 layers, the model 2"):
        convert_attention(_llama(), attention="llops", p=2, m=6, theta=(theta_q.repeat(2, 1, 1, 1, 1, 1)[:3],) * 2)


def test_toy_model_window_covering_the_sequence_reproduces_teacher():
    from sketchlab.tasks.model import TransformerConfig, TransformerLM

    torch.manual_seed(4)
    model = TransformerLM(TransformerConfig(vocab_size=30, d_model=32, n_heads=2, n_layers=2)).double().eval()
    ids = torch.randint(0, 30, (2, 11))
    with torch.no_grad():
        want = model(ids)
        sketches = convert_attention(model, attention="hedgehog", m=8, window=11, sinks=0, eps=0.0)
        got = model(ids)
    torch.testing.assert_close(got, want, **TOL64)
    # each toy layer's kernel slot now holds its SketchedAttention, called with the toy's kernel protocol
    assert [m.sketch for m in model.modules() if isinstance(m, ConvertedToyKernel)] == sketches


def test_toy_model_generate_with_state_equals_greedy_full_forward():
    from sketchlab.tasks.model import TransformerConfig, TransformerLM, generate

    torch.manual_seed(6)
    model = TransformerLM(TransformerConfig(vocab_size=30, d_model=32, n_heads=2, n_layers=2)).double().eval()
    convert_attention(model, attention="hedgehog", m=8, window=3, sinks=1)
    prompt = torch.randint(0, 30, (2, 4))
    got = generate(model, prompt, 6)
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, seq)


def test_gate_init_at_one_is_window_and_sinks_alone():
    """gate_init = 40: g = sigmoid(40) = 1 in float64, the sketch has weight 0 — the output is the
    window + sinks softmax alone, the same whatever the maps (two seeds); gate_init = 0 depends on them."""
    ids, mask = _inputs(True)
    outs = {}
    for gate_init in (40.0, 0.0):
        for seed in (0, 1):
            model = _llama()
            sketches = convert_attention(model, attention="hedgehog", m=8, window=3, sinks=1, gate_init=gate_init,
                                         seed=seed)
            assert torch.equal(sketches[0].gate, torch.full((4,), gate_init, dtype=torch.float64))
            outs[gate_init, seed] = _out(model, ids, mask)
    torch.testing.assert_close(outs[40.0, 0], outs[40.0, 1], rtol=0, atol=0)
    assert float((outs[0.0, 0] - outs[0.0, 1]).abs().max()) > 1e-6


def _padded(prompts, layout="left"):
    """Batch ``prompts`` (1-D token tensors) with pad token 0: ids, mask ``[B, T]`` and the position ids
    transformers derives from the mask (each row's real tokens 0, 1, …). ``layout``: ``"left"`` (as
    ``generate()`` batches), ``"right"``, or ``"between"``: pads inside each prompt too — one after its
    2nd token (under the sinks), two after its 6th (in later tokens' windows) — then left padding."""
    rows = []
    for prompt in prompts:
        row = [(int(t), 1) for t in prompt]  # (token, real)
        if layout == "between":
            for at, pads in ((6, 2), (2, 1)):  # the later first, so `at` counts the prompt's tokens
                if len(prompt) > at:
                    row[at:at] = [(0, 0)] * pads
        rows.append(row)
    T = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, row in enumerate(rows):
        start = 0 if layout == "right" else T - len(row)
        ids[b, start:start + len(row)] = torch.tensor([t for t, _ in row])
        mask[b, start:start + len(row)] = torch.tensor([real for _, real in row])
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def _prompts(lengths, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 50, (n,), generator=g) for n in lengths]


# window 3, sinks 4 (the default): lengths 13 (unpadded) and 10 (3 pads) have window, sink and far keys,
# 6 is between sinks and sinks + window (no far key, the window reaches the sinks), 4 is sinks alone;
# an encoder also takes 2, fewer tokens than sinks (the padded row's sink positions 2, 3 are pads)
LEFT_WINDOW, LEFT_SINKS, LEFT_LENGTHS, ENCODER_LENGTHS = 3, 4, (13, 10, 6, 4), (13, 10, 6, 2)


def _left_converted(make, attention):
    model = make()
    convert_attention(model, attention=attention, p=2, m=8, window=LEFT_WINDOW, sinks=LEFT_SINKS)
    torch.manual_seed(5)
    with torch.no_grad():
        for s in converted_modules(model):
            s.gate.normal_()  # window and far part both weigh
    return model


def _padding_order_naive(padding, first):
    """:func:`sketched._padding_order` by its definition, row by row in Python: the first ``first``
    real tokens, the pads before the last real token, the other real tokens, the pads after it."""
    orders = []
    for row in padding.tolist():
        real = [i for i, r in enumerate(row) if r]
        last = real[-1] if real else -1
        pads = [i for i, r in enumerate(row) if not r]
        orders.append(real[:first] + [i for i in pads if i < last] + real[first:] + [i for i in pads if i > last])
    return torch.tensor(orders)


def test_padding_order():
    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0], [1, 0, 1, 1, 0, 1],
                            [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    # causal, 2 sinks: left padding puts the sinks first; a pad between the sinks goes behind them,
    # one past the sinks in front of the other real tokens; right padding keeps the identity
    assert sketched._padding_order(padding, 2).tolist() == [[2, 3, 0, 1, 4, 5], [0, 1, 2, 3, 4, 5], [1, 2, 0, 3, 4, 5],
                                                              [0, 2, 1, 4, 3, 5], [0, 1, 2, 3, 4, 5]]
    # non-causal (first = T): every row right-padded
    assert sketched._padding_order(padding, 6).tolist() == [[2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 0, 5],
                                                              [0, 2, 3, 5, 1, 4], [0, 1, 2, 3, 4, 5]]
    g = torch.Generator().manual_seed(0)
    for first in (0, 1, 3, 9):
        padding = torch.rand(64, 9, generator=g) < 0.6
        assert torch.equal(sketched._padding_order(padding, first), _padding_order_naive(padding, first))


@pytest.mark.parametrize("make,attention,layout", [(_llama, "llops", "left"), (_llama, "hedgehog", "left"),
                                                   (_gpt2, "hedgehog", "left"), (_llama, "llops", "between"),
                                                   (_gpt2, "hedgehog", "between")])
def test_padded_batch_equals_each_prompt_alone(make, attention, layout):
    """A left-padded batch, or one with pads between real tokens too (each row reordered inside
    hf_attention to its first sinks real tokens, its pads, its other real tokens), gives each prompt's
    logits as the prompt alone, unpadded, gives them: float64 round-off only (the batch runs longer
    sequences, so its sums are formed in another order; measured ≤ 2.2e-16 on logits ≤ 0.5, TOL64 = 1e-10
    leaves margin, while sinks left on the pads, pads left in the window or outputs put back in the wrong
    places move them by 1e-2 to 1e-1; the far part alone, its maps moved by 0.1, by ~1e-5). position_ids
    are passed as generate() derives them (the forward does not)."""
    model = _left_converted(make, attention)
    prompts = _prompts(LEFT_LENGTHS)
    ids, mask, positions = _padded(prompts, layout)
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for b, prompt in enumerate(prompts):
            alone = model(input_ids=prompt[None]).logits[0]
            torch.testing.assert_close(batch[b, mask[b].bool()], alone, **TOL64)


@pytest.mark.parametrize("attention", ["llops", "hedgehog"])
def test_encoder_padded_batch_equals_each_sentence_alone(attention):
    """A converted BERT (non-causal: two-sided window and sinks) gives each sentence's real tokens the
    embeddings of the sentence alone, unpadded, whether the batch is padded on the right (run as given),
    on the left or between real tokens too (each row's real tokens moved in front of its pads inside
    hf_attention): measured ≤ 4.4e-16, float64 round-off (TOL64 as above), while pads left in place move
    them by 1.5e-2 (left) and 2.1e-2 (between), the sinks alone moved in front of the pads by 1e-2. The
    sentence of 2 tokens has fewer than the 4 sinks. position_ids are passed (BERT's are absolute)."""
    model = _left_converted(_bert, attention)
    sentences = _prompts(ENCODER_LENGTHS)
    with torch.no_grad():
        alone = [model(input_ids=s[None]).last_hidden_state[0] for s in sentences]
        for layout in ("right", "left", "between"):
            ids, mask, positions = _padded(sentences, layout)
            batch = model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
            for b in range(len(sentences)):
                torch.testing.assert_close(batch[b, mask[b].bool()], alone[b], **TOL64)


@pytest.mark.parametrize("layout", ["left", "between"])
def test_padded_generate_equals_each_prompt_alone(layout):
    """generate() (greedy, with the state cache) on a left-padded batch, or one with pads between real
    tokens too, gives each prompt the new tokens and the step logits (TOL64, as above) it gets generated
    alone: the state the reordered prefill leaves continues each row as its own."""
    from sketchlab.convert.cache import SketchStateCache

    model = _left_converted(_llama, "llops")
    prompts = _prompts(LEFT_LENGTHS, seed=8)
    ids, mask, _ = _padded(prompts, layout)
    kw = dict(max_new_tokens=7, min_new_tokens=7, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              output_logits=True)
    batch = model.generate(ids, attention_mask=mask, **kw)
    assert isinstance(batch.cache, SketchStateCache)
    for b, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], **kw)
        assert torch.equal(batch.sequences[b, ids.shape[1]:], alone.sequences[0, len(prompt):])
        torch.testing.assert_close(torch.stack([s[b] for s in batch.logits]),
                                   torch.stack([s[0] for s in alone.logits]), **TOL64)


def test_padding_that_cannot_be_reordered_is_refused(monkeypatch):
    """Padding no reorder makes exact is refused, naming the row and its counts: a causal prompt with pads
    before real tokens and fewer real tokens than the sinks, in a call with a cache (its next tokens would
    be sinks; without a cache nothing continues, and its outputs are the prompt's alone), and a pad
    before a real token in a call that continues a sequence (under its remaining sinks or past them: the
    window would count the pad). Right padding, left padding without sinks, and any padding without a
    window (pure linear attention) run as given, with no reorder."""
    from sketchlab.convert.cache import SketchStateCache

    model = _left_converted(_llama, "llops")
    prompts = _prompts((6, 3))
    ids, mask, positions = _padded(prompts)
    short = r"row 1 of the batch \(3 of its 6 tokens pads\) has pads before real tokens and fewer real tokens than " \
            r"the 4 attention sinks"
    with torch.no_grad():  # no cache: [its 3 real tokens, the pads], all sinks, as the prompt alone
        batch = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        torch.testing.assert_close(batch[1, 3:], model(input_ids=prompts[1][None]).logits[0], **TOL64)
    with pytest.raises(ValueError, match=short):
        model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=SketchStateCache(2), use_cache=True)
    between = torch.ones(2, 6, dtype=torch.long)
    between[1, 1:4] = 0  # 3 real tokens, pads between them
    with pytest.raises(ValueError, match=short):
        model(input_ids=ids, attention_mask=between, cache=SketchStateCache(2), use_cache=True)
    for start, pad in ((2, 2), (5, 6)):  # a pad at the 3rd of the 4 sinks; a pad past them
        cache = SketchStateCache(2)
        with torch.no_grad():
            model(input_ids=torch.ones(2, start, dtype=torch.long), cache=cache, use_cache=True)
            later = torch.ones(2, start + 3, dtype=torch.long)
            later[1, pad] = 0  # in the new part of row 1, real tokens after it
            with pytest.raises(ValueError, match=rf"row 1 of the batch \(1 of its 3 tokens pads\) has a pad before a "
                                                 rf"real token in attention_mask, in a call that continues a sequence "
                                                 rf"of {start} tokens"):
                model(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=later, cache=cache, use_cache=True)
    # right padding, left padding without sinks, pads anywhere without a window: run as given, no reorder
    # (a gather would fail here)
    right, right_mask = _inputs(True)
    nosinks, linear = _llama(), _llama()
    convert_attention(nosinks, attention="llops", p=2, m=8, window=4, sinks=0)
    convert_attention(linear, attention="llops", p=2, m=8, window=0, sinks=0)
    bert = _left_converted(_bert, "llops")
    monkeypatch.setattr(sketched, "_take", None)
    with torch.no_grad():
        model(input_ids=right, attention_mask=right_mask)
        bert(input_ids=right, attention_mask=right_mask)
        nosinks(input_ids=ids, attention_mask=mask, position_ids=positions)
        linear(input_ids=ids, attention_mask=between)
        cache = SketchStateCache(2)
        linear(input_ids=ids, cache=cache, use_cache=True)
        linear(input_ids=ids[:, :3], attention_mask=torch.cat([mask, between[:, 2:5]], 1), cache=cache, use_cache=True)


def test_sketched_attention_passes_its_normalize_to_the_attention():
    """``normalize="none"`` reaches the attention: with the exact degree-2 maps and no window the output is
    the unnormalised causal sum ``Σ_{j≤i} ((c·q_i)ᵀ(c·k_j))² v_j``, ``c = D^{-1/4}``, computed here in float64
    independently (round-off only: 1e-12). Dropping the option falls back to the default ``"sum"``, which
    divides each row by its kernel sum, an O(1) change."""
    from sketchlab.featuremaps import ExactPolyMap

    torch.manual_seed(0)
    b, t, h, d = 1, 5, 2, 4
    q, k, v = (torch.randn(b, t, h, d, dtype=torch.float64) for _ in range(3))
    attn = sketched.SketchedAttention(ExactPolyMap(h, d, p=2), ExactPolyMap(h, d, p=2), heads=h, head_dim=d,
                                      window=0, sinks=0, normalize="none").double()
    c = d ** -0.25
    scores = torch.einsum("bihd,bjhd->bhij", q * c, k * c).pow(2).tril()  # [B, H, T, T]
    expected = torch.einsum("bhij,bjhd->bihd", scores, v)  # [B, T, H, D]
    torch.testing.assert_close(attn(q, k, v), expected, rtol=1e-12, atol=1e-12)
